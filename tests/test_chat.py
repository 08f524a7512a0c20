"""The chat format: prompts, tool-call parsing, tool responses and SFT encoding, on two tokenizers."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import AutoTokenizer
from transformers.models.qwen2 import Qwen2Tokenizer

from rstar2_jax import chat
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.problems import make_splits
from rstar2_jax.toy.tokenizer import build_tokenizer

QUESTION = "What is 123456 * 654321 mod 997?"
CODE = "print(123456 * 654321 % 997)"
TOOL_OUTPUT = "Tool call success\nstdout: 372\nexecution time: 0.01s"
MESSAGES = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "Let me compute it.</reason>\n" + chat.format_tool_call(CODE)},
    {"role": "tool", "content": TOOL_OUTPUT},
    {"role": "assistant", "content": "The tool says 372.</reason>\n<answer>\\boxed{372}</answer>"},
]


def _corpus():
    train, _ = make_splits(300, 0, seed=1)
    return [TOY_FORMAT.prompt_text(p.question) + chat.format_tool_call(p.code) for p in train]


@pytest.fixture(scope="module", params=["toy", "qwen2"])
def tokenizer(request, tmp_path_factory):
    """The toy tokenizer, and a Qwen2Tokenizer (Qwen's class and added tokens) on the same merges."""
    directory = tmp_path_factory.mktemp(request.param)
    toy = build_tokenizer(_corpus(), vocab_size=600)
    if request.param == "toy":
        toy.save_pretrained(directory)
    else:
        vocab_file, merges_file = toy.backend_tokenizer.model.save(str(directory))
        with open(vocab_file) as f:
            vocab = json.load(f)
        with open(merges_file) as f:
            merges = [tuple(line.split()) for line in f if not line.startswith("#")]
        qwen = Qwen2Tokenizer(vocab=vocab, merges=merges)
        qwen.add_tokens([AddedToken(t, special=True) for t in (chat.IM_START, chat.IM_END)], special_tokens=True)
        qwen.add_tokens([AddedToken(t, special=False) for t in (chat.TOOL_CALL_START, chat.TOOL_CALL_END,
                                                                chat.TOOL_RESPONSE_START, chat.TOOL_RESPONSE_END)])
        qwen.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def test_prompt_is_system_user_and_prefilled_reason(tokenizer):
    ids = chat.encode_prompt(tokenizer, QUESTION)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert "<|im_end|>\n<|im_start|>user\nYou must put your answer inside <answer> </answer> tags" in text
    assert text.endswith(f"This is the problem:\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<reason>")
    assert ids.count(chat.token_id(tokenizer, chat.IM_START)) == 3


def test_system_prompt_lists_the_one_tool_schema():
    prompt = chat.RSTAR2_SYSTEM_PROMPT
    schemas = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert len(schemas) == 1
    function = json.loads(schemas[0])["function"]
    assert function["name"] == "execute_python_code_with_standard_io"
    assert set(function["parameters"]["required"]) == {"code", "input"}
    assert "within <tool_call></tool_call> XML tags" in prompt


def test_custom_format_changes_only_the_text_around_the_question(tokenizer):
    text = tokenizer.decode(chat.encode_prompt(tokenizer, "2+2?", TOY_FORMAT))
    assert text == (f"<|im_start|>system\n{TOY_FORMAT.system_prompt}<|im_end|>\n"
                    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<reason>")


def test_format_rejects_template_without_question_slot():
    with pytest.raises(ValueError, match="question"):
        chat.ChatFormat(user_template="Solve this.")


def test_tool_response_scaffold(tokenizer):
    ids = chat.encode_tool_response(tokenizer, "Tool call success\nstdout: 7")
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\nTool call success\nstdout: 7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<reason>")
    for markup in (chat.IM_START, chat.IM_END, chat.TOOL_RESPONSE_START, chat.TOOL_RESPONSE_END):
        assert chat.token_id(tokenizer, markup) in ids


def test_markup_tokens_are_single_tokens(tokenizer):
    ids = [chat.token_id(tokenizer, t) for t in (chat.IM_START, chat.IM_END, chat.TOOL_CALL_START,
                                                  chat.TOOL_CALL_END, chat.TOOL_RESPONSE_START,
                                                  chat.TOOL_RESPONSE_END)]
    assert len(set(ids)) == 6


def test_token_id_rejects_a_multi_token_string(tokenizer):
    with pytest.raises(ValueError, match="must be one token"):
        chat.token_id(tokenizer, "<reason>")


def test_conversation_matches_sampler_construction(tokenizer):
    """The sampler appends prompt, generated ids + <|im_end|>, tool ids: SFT must give the same."""
    ids, mask = chat.encode_conversation(tokenizer, MESSAGES)
    im_end = chat.token_id(tokenizer, chat.IM_END)
    turn1 = tokenizer.encode(MESSAGES[1]["content"], add_special_tokens=False) + [im_end]
    turn2 = tokenizer.encode(MESSAGES[3]["content"], add_special_tokens=False) + [im_end]
    prompt = chat.encode_prompt(tokenizer, QUESTION)
    tool = chat.encode_tool_response(tokenizer, TOOL_OUTPUT)
    assert ids == prompt + turn1 + tool + turn2
    assert mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)


def test_conversation_text_is_the_plain_chat_rendering(tokenizer):
    ids, mask = chat.encode_conversation(tokenizer, MESSAGES)
    assert tokenizer.decode(ids) == (
        chat.ChatFormat().prompt_text(QUESTION) + MESSAGES[1]["content"] + "<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{TOOL_OUTPUT}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<reason>" + MESSAGES[3]["content"] + "<|im_end|>")
    generated = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert generated == MESSAGES[1]["content"] + "<|im_end|>" + MESSAGES[3]["content"] + "<|im_end|>"


@pytest.mark.parametrize("roles, message", [
    (["user"], "last message must be the assistant's"),
    (["assistant", "user"], "role 'assistant' after None"),
    (["user", "tool", "assistant"], "role 'tool' after 'user'"),
    (["user", "assistant", "tool"], "last message must be the assistant's"),
    (["user", "assistant", "assistant"], "role 'assistant' after 'assistant'"),
    (["user", "system", "assistant"], "role 'system' after 'user'"),
    (["system", "system", "user", "assistant"], "role 'system' after 'system'"),
])
def test_conversation_rejects_bad_role_order(tokenizer, roles, message):
    with pytest.raises(ValueError, match=message):
        chat.encode_conversation(tokenizer, [{"role": r, "content": "x"} for r in roles])


def test_conversation_rejects_non_string_content(tokenizer):
    with pytest.raises(ValueError, match="content"):
        chat.encode_conversation(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])


def test_parse_no_call_ends_trajectory():
    assert chat.parse_tool_call("So the answer is 4.</reason>\n<answer>\\boxed{4}</answer>") is None


def test_parse_valid_call():
    text = 'Compute.</reason>\n<tool_call>{"name": "execute_python_code_with_standard_io", ' \
           '"arguments": {"code": "print(input())", "input": "hi"}}</tool_call>'
    assert chat.parse_tool_call(text) == chat.ToolCall(code="print(input())", stdin="hi", error=None)


def test_parse_released_template_layout_with_newlines_and_missing_input():
    text = '<tool_call>\n{"name": "execute_python_code_with_standard_io", "arguments": {"code": "1+1"}}\n</tool_call>'
    assert chat.parse_tool_call(text) == chat.ToolCall(code="1+1", stdin="")


def test_parse_uses_first_call_of_turn():
    text = chat.format_tool_call("print(1)") + "\n" + chat.format_tool_call("print(2)")
    assert chat.parse_tool_call(text).code == "print(1)"


@pytest.mark.parametrize("body, message", [
    ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": "x"}', "failed to decode"),
    ('{"name": "python", "arguments": {"code": "print(1)"}}', "unknown tool 'python'"),
    ('{"name": "execute_python_code_with_standard_io", "arguments": {"input": ""}}', '"code"'),
    ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": 5}}', '"code"'),
    ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": "", "input": 3}}', '"input"'),
    ('{"name": "execute_python_code_with_standard_io", "arguments": "{\\"code\\": \\"1\\"}"}', "JSON object"),
    ('["execute_python_code_with_standard_io"]', "JSON object"),
])
def test_parse_malformed_call_is_a_tool_error(body, message):
    call = chat.parse_tool_call(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and message in call.error
    assert (call.code, call.stdin) == ("", "")
    response = chat.malformed_call_response(call)
    assert response.startswith("Tool call failure\nreason: ") and call.error in response


def test_parse_unclosed_call_is_a_tool_error():
    call = chat.parse_tool_call('<tool_call>{"name": "execute_python_code_with_standard_io"')
    assert "closing </tool_call>" in call.error


def test_malformed_response_needs_an_error():
    with pytest.raises(ValueError):
        chat.malformed_call_response(chat.ToolCall(code="1", stdin=""))


_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=60).filter(
    lambda s: chat.TOOL_CALL_START not in s and chat.TOOL_CALL_END not in s)


@settings(max_examples=200, deadline=None)
@given(code=_text, stdin=_text, before=_text)
def test_parse_inverts_format(code, stdin, before):
    assert chat.parse_tool_call(before + chat.format_tool_call(code, stdin)) == chat.ToolCall(code, stdin)


@pytest.mark.parametrize("text, n", [
    ("no tags", 0),
    ("<answer>\\boxed{1}</answer>", 1),
    ("<answer>1</answer> then <answer>\n2\n</answer>", 2),
    ("<answer>1</answer><answer>unclosed", 1),
    ("</answer><answer>", 0),
])
def test_count_answer_blocks(text, n):
    assert chat.count_answer_blocks(text) == n
