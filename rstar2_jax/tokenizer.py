"""A model's tokenizer, loaded and checked against the model and the chat format before any work.

``transformers.AutoTokenizer.from_pretrained`` on a directory without tokenizer files silently
returns a tokenizer that encodes every text to ``[]``, and on a missing directory asks the Hub
for a repository of that name. Every entry point therefore opens its tokenizer here:

    tokenizer = open_tokenizer(model.path, model.tokenizer_path, fmt)

which raises `TokenizerError` (or `ModelError` for the model directory) naming the directory
when the tokenizer is missing, belongs to another model (its ids do not fit the embedding), lacks
the chat markup as single special tokens, or does not encode and decode a prompt faithfully.
"""
from __future__ import annotations

from pathlib import Path

from rstar2_jax import chat
from rstar2_jax.errors import TokenizerError
from rstar2_jax.model import ModelConfig
from rstar2_jax.model.hf import read_hf_config

# What `save_pretrained` writes for a tokenizer (any subset), copied verbatim by `export`.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
_PROBE_QUESTION = "What is 12 + 30? Reply with <answer>\\boxed{42}</answer>."


def tokenizer_files(directory) -> list[Path]:
    """The tokenizer files present in ``directory``."""
    return [Path(directory) / name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]


def load_tokenizer(directory):
    """The Hugging Face tokenizer saved in ``directory`` (a local directory, never the Hub)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer directory {directory} does not exist (model.tokenizer, or "
                             f"model.path when it is unset, must be a local directory)")
    names = {p.name for p in tokenizer_files(directory)}
    if not ("tokenizer.json" in names or {"vocab.json", "merges.txt"} <= names
            or "tokenizer.model" in names):
        raise TokenizerError(
            f"{directory} has no tokenizer (tokenizer.json, or vocab.json + merges.txt): copy the "
            f"tokenizer files of the model it comes from there, or set model.tokenizer to their "
            f"directory")
    from transformers import AutoTokenizer  # heavy; only the entry points need it

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the files are the cause
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"cannot load the tokenizer in {directory}: {first_line}") from None


def check_tokenizer(tokenizer, config: ModelConfig, fmt: chat.ChatFormat, directory) -> None:
    """Raises TokenizerError naming ``directory`` unless ``tokenizer`` fits ``config`` and ``fmt``.

    Checks: the tokenizer's ids fit the embedding (and cover most of it: a much smaller
    vocabulary belongs to another model); ``<|im_start|>`` and ``<|im_end|>`` are single
    special tokens (the sampler stops on one, and data must not be able to produce them); a
    prompt in ``fmt`` encodes to tokens that decode back to its text.
    """
    where = f"the tokenizer in {directory}"
    size = len(tokenizer)
    if size > config.vocab_size or 2 * size < config.vocab_size:
        raise TokenizerError(
            f"{where} has {size} tokens but the model's embedding has {config.vocab_size} rows: it "
            f"is not this model's tokenizer (set model.tokenizer to the model's own)")
    specials = chat.special_tokens(tokenizer)
    for token in (chat.IM_START, chat.IM_END):
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1 or token not in specials:
            raise TokenizerError(
                f"{where} has no special token {token!r} (it encodes it as {len(ids)} tokens); "
                f"the chat markup needs Qwen's <|im_start|>/<|im_end|> special tokens")
    prompt = chat.encode_prompt(tokenizer, _PROBE_QUESTION, fmt)
    if not prompt:
        raise TokenizerError(f"{where} encodes the prompt to no tokens at all")
    decoded = tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if decoded != fmt.prompt_text(_PROBE_QUESTION):
        raise TokenizerError(f"{where} does not decode an encoded prompt back to its text "
                             f"(first 80 characters: {decoded[:80]!r})")


def open_tokenizer(model_path, tokenizer_path, fmt: chat.ChatFormat):
    """The tokenizer in ``tokenizer_path``, checked against the model in ``model_path`` (its
    config.json) and the chat format; raises ModelError / TokenizerError naming the directory."""
    config = read_hf_config(model_path)
    tokenizer = load_tokenizer(tokenizer_path)
    check_tokenizer(tokenizer, config, fmt, tokenizer_path)
    return tokenizer
