"""A tokenizer laid out like Qwen3's, built locally with `tokenizers` (no download).

Qwen3's tokenizer is a byte-level BPE of 151,643 tokens followed by 26 added tokens:
``<|endoftext|>`` (151643), ``<|im_start|>``, ``<|im_end|>`` and the vision/box markers are
special; ``<tool_call>``/``</tool_call>`` (151657-8), the FIM and repository markers,
``<tool_response>``/``</tool_response>`` and ``<think>``/``</think>`` (151665-8) are added but
NOT special, so ``decode(skip_special_tokens=True)`` keeps them. Its model has 151,936
embedding rows. The BPE here is trained on a small corpus and padded with unreachable entries
up to ``base_vocab`` so that the added tokens get Qwen3's ids; its chat template renders
conversations the way Qwen3's does (system turn with a "# Tools" block, tool calls as
``<tool_call>\\n{json}\\n</tool_call>``, tool responses in user turns, an empty think block on the
last assistant turn).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

QWEN3_BASE_VOCAB = 151_643
QWEN3_EMBEDDING_ROWS = 151_936
QWEN3_ADDED = (  # (content, special), in id order from 151643
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN3_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if loop.first and not message.content %}{{- '<tool_call>\\n' }}"
    "{%- else %}{{- '\\n<tool_call>\\n' }}{%- endif %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson) "
    "+ '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_style_tokenizer(directory, corpus, *, base_vocab: int = QWEN3_BASE_VOCAB, merges: int = 700,
                          chat_template: bool = True, without: tuple[str, ...] = ()):
    """Builds, saves to ``directory`` and reloads (AutoTokenizer) a Qwen3-layout tokenizer.

    ``base_vocab`` is the number of ids before the added tokens (Qwen3: 151,643); the trained
    BPE has ``256 + merges`` reachable tokens, the rest are unreachable fillers. ``without``
    leaves out some added tokens (to build a broken tokenizer).
    """
    trainer_model = Tokenizer(models.BPE())
    trainer_model.normalizer = normalizers.NFC()
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_model.train_from_iterator(corpus, trainer=trainer)
    trained = json.loads(trainer_model.to_str())["model"]
    vocab = dict(trained["vocab"])
    if len(vocab) > base_vocab:
        raise ValueError(f"base_vocab={base_vocab} is smaller than the trained vocabulary {len(vocab)}")
    # Fillers: characters no byte-level merge can produce, so they are never emitted.
    vocab |= {f"\u2603{i}": i for i in range(len(vocab), base_vocab)}
    merges_list = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges_list))
    tokenizer.normalizer = trainer_model.normalizer
    tokenizer.pre_tokenizer = trainer_model.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in QWEN3_ADDED:
        if content in without:
            continue
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None,
                                   clean_up_tokenization_spaces=False)
    if chat_template:
        fast.chat_template = QWEN3_LIKE_TEMPLATE
    directory = Path(directory)
    fast.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    assert loaded.convert_tokens_to_ids("<|im_start|>") == base_vocab + 1
    return loaded
