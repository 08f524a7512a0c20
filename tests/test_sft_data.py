"""SFT data in the standard chat layout: a conversation of each kind (system message, several
turns, tool_calls with object or JSON-text arguments, tool messages), rendered by the tokenizer's
chat template (general chat) or exactly as the sampler builds it (agent trajectories), with the
loss on assistant tokens only. On the Qwen3 tokenizer layout, with and without a chat template."""
import json

import pytest

from helpers_qwen_tokenizer import qwen3_style_tokenizer
from rstar2_jax import chat
from rstar2_jax.errors import DataError
from rstar2_jax.train.sft_data import Conversations, encode_row

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "2 is the only even prime."},
]
FUNCTION_CALL = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome \"ancient\"\n"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "24C, clear"},
    {"role": "assistant", "content": "Paris 18C, Rome 24C."},
]
CODE = "print(6 * 7)"
AGENT = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "Let me run it.</reason>", "tool_calls": [
        {"type": "function", "function": {"name": chat.TOOL_NAME, "arguments": {"code": CODE, "input": ""}}}]},
    {"role": "tool", "content": "Tool call success\nstdout: 42"},
    {"role": "assistant", "content": "It is 42.</reason><answer>\\boxed{42}</answer>"},
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    corpus = [json.dumps(c) for c in (CHAT, FUNCTION_CALL, AGENT)] + [chat.ChatFormat().prompt_text("q")]
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("q3"), corpus * 3, base_vocab=2000, merges=700)


@pytest.fixture(scope="module")
def qwen3_no_template(tmp_path_factory):
    corpus = [json.dumps(c) for c in (CHAT, FUNCTION_CALL, AGENT)] + [chat.ChatFormat().prompt_text("q")]
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("q3plain"), corpus * 3, base_vocab=2000,
                                 merges=700, chat_template=False)


def _trained_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_general_chat_is_the_tokenizers_template_with_loss_on_assistant_turns(qwen3):
    kind, (ids, mask) = encode_row(qwen3, CHAT, chat.ChatFormat())
    assert kind == "chat"
    assert qwen3.decode(ids) == qwen3.apply_chat_template(CHAT, tokenize=False)
    assert ids == qwen3.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert _trained_text(qwen3, ids, mask) == (
        "7.<|im_end|>" "<think>\n\n</think>\n\n2 is the only even prime.<|im_end|>")


def test_function_calls_to_other_tools_use_the_template_with_the_rows_tools(qwen3):
    kind, (ids, mask) = encode_row(qwen3, FUNCTION_CALL, chat.ChatFormat(), tools=[WEATHER_TOOL])
    assert kind == "chat"
    text = qwen3.decode(ids)
    assert text == qwen3.apply_chat_template(FUNCTION_CALL, tools=[WEATHER_TOOL], tokenize=False)
    assert '"get_weather"' in text.split("<|im_start|>user")[0]  # the schema is in the system turn
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n24C, clear" in text
    assert _trained_text(qwen3, ids, mask) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome \\"ancient\\"\\n"}}\n'
        "</tool_call><|im_end|><think>\n\n</think>\n\nParis 18C, Rome 24C.<|im_end|>")


def test_arguments_as_json_text_or_object_give_the_same_tokens(qwen3):
    as_text = json.loads(json.dumps(FUNCTION_CALL))
    for call in as_text[1]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    # and the Hugging Face style without the "function" wrapper
    as_hf = json.loads(json.dumps(FUNCTION_CALL))
    as_hf[1]["tool_calls"] = [c["function"] for c in as_hf[1]["tool_calls"]]
    results = {json.dumps(encode_row(qwen3, m, chat.ChatFormat(), [WEATHER_TOOL])) for m in (FUNCTION_CALL, as_text, as_hf)}
    assert len(results) == 1


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3_no_template"])
def test_agent_trajectories_are_what_the_sampler_builds(request, fixture):
    tokenizer = request.getfixturevalue(fixture)
    kind, (ids, mask) = encode_row(tokenizer, AGENT, chat.ChatFormat())
    assert kind == "agent"  # it calls the format's tool: never the chat template
    im_end = tokenizer.convert_tokens_to_ids(chat.IM_END)
    turn1 = tokenizer.encode("Let me run it.</reason>" + chat.format_tool_call(CODE), add_special_tokens=False)
    turn2 = tokenizer.encode(AGENT[3]["content"], add_special_tokens=False)
    prompt = chat.encode_prompt(tokenizer, AGENT[0]["content"])
    tool = chat.encode_tool_response(tokenizer, AGENT[2]["content"])
    assert ids == prompt + turn1 + [im_end] + tool + turn2 + [im_end]
    assert mask == [0] * len(prompt) + [1] * (len(turn1) + 1) + [0] * len(tool) + [1] * (len(turn2) + 1)
    # The toy's layout, the call written into the content, gives the same tokens.
    inline = [AGENT[0], {"role": "assistant", "content": "Let me run it.</reason>" + chat.format_tool_call(CODE)},
              AGENT[2], AGENT[3]]
    assert encode_row(tokenizer, inline, chat.ChatFormat()) == (kind, (ids, mask))


def test_without_a_template_general_chat_is_rendered_in_the_chat_format(qwen3_no_template):
    tokenizer = qwen3_no_template
    kind, (ids, mask) = encode_row(tokenizer, CHAT, chat.ChatFormat())
    assert kind == "agent"
    fmt = chat.ChatFormat()
    assert tokenizer.decode(ids) == (
        f"<|im_start|>system\n{CHAT[0]['content']}<|im_end|>\n"  # the row's system message
        f"<|im_start|>user\n{fmt.user_text(CHAT[1]['content'])}<|im_end|>\n<|im_start|>assistant\n<reason>"
        "7.<|im_end|>\n"
        f"<|im_start|>user\n{fmt.user_text(CHAT[3]['content'])}<|im_end|>\n<|im_start|>assistant\n<reason>"
        "2 is the only even prime.<|im_end|>")
    assert _trained_text(tokenizer, ids, mask) == "7.<|im_end|>2 is the only even prime.<|im_end|>"


def test_a_template_that_drops_content_is_refused(qwen3, tmp_path):
    qwen3.chat_template, saved = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n<|im_end|>\\n' }}{% endfor %}", qwen3.chat_template
    try:
        with pytest.raises(ValueError, match="does not render every content"):
            encode_row(qwen3, CHAT, chat.ChatFormat())
    finally:
        qwen3.chat_template = saved


def test_jsonl_file_of_every_kind(qwen3, tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"messages": CHAT}, {"messages": FUNCTION_CALL, "tools": [WEATHER_TOOL]}, {"messages": AGENT}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    examples = Conversations(str(path), qwen3, chat.ChatFormat(), seq_len=4096)
    assert [e for e in examples] == [encode_row(qwen3, r["messages"], chat.ChatFormat(), r.get("tools"))[1]
                                     for r in rows]


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "line 1: message 1: tool call arguments are not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]}, "needs a string name and object arguments"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "tools": [{"function": {"name": "<|im_end|>"}}]}, "control token"),
    ({"conversations": []}, 'expected an object {"messages"'),
])
def test_bad_rows_name_the_line(qwen3, tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        Conversations(str(path), qwen3, chat.ChatFormat(), seq_len=4096)


def test_missing_and_empty_files_are_named(qwen3, tmp_path):
    with pytest.raises(DataError, match=f"cannot read the SFT data {tmp_path / 'nope.jsonl'}"):
        Conversations(str(tmp_path / "nope.jsonl"), qwen3, chat.ChatFormat(), seq_len=64)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no conversation"):
        Conversations(str(tmp_path / "empty.jsonl"), qwen3, chat.ChatFormat(), seq_len=64)
