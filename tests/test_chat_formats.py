"""The built-in chat formats: one conversation rendered in each, and the released rStar2-Agent
checkpoint's format checked against the rules of its released chat template, tool config and
agent loop (microsoft/rStar, rstar2_agent/config/*.yaml and rollout/rstar2_agent_loop.py)."""
import json

import pytest

from helpers_qwen_tokenizer import qwen3_style_tokenizer
from rstar2_jax import chat
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sandbox import SandboxPool
from scripted_policy import make_policy

QUESTION = "What is 2 + 3?"
CODE = "print(2 + 3)"
OUTPUT = "Tool call success\nstdout: 5\nexecution time: 0.01s"
CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "Let me compute.</reason>",
     "tool_calls": [{"type": "function", "function": {"name": "{tool}", "arguments": {"code": CODE, "input": ""}}}]},
    {"role": "tool", "content": OUTPUT},
    {"role": "assistant", "content": "It is 5.</reason><answer>\\boxed{5}</answer>"},
]

# The released template's rules, written out.
INSTRUCTION = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <reason> "
    "</reason> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
    "<reason> reasoning process here </reason> <answer> answer here </answer>.")
USER_PREFIX = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
               "</answer>. And your final answer will be extracted automatically by the \\boxed{} "
               "tag.\nThis is the problem:\n")


def _conversation(tool_name):
    text = json.dumps(CONVERSATION).replace("{tool}", tool_name)
    return json.loads(text)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [chat.ChatFormat().prompt_text(QUESTION), chat.RELEASED_FORMAT.prompt_text(QUESTION), OUTPUT]
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("q3"), corpus * 3, base_vocab=2000, merges=600)


def test_released_tool_schema_is_the_released_tool_config():
    function = chat.RELEASED_TOOL_SCHEMA["function"]
    assert function["name"] == "python_code_with_standard_io"
    assert function["parameters"]["required"] == ["code", "input"]
    assert function["description"].startswith("Execute Python code with standard input and capture "
                                              "standard output.")
    assert function["parameters"]["properties"]["input"]["description"] == (
        "A string that will be provided as standard input to the code when it calls input().")
    assert "strict" not in function and "return" not in function  # dumped without unset fields


def test_one_conversation_in_each_format(tokenizer):
    ours = tokenizer.decode(chat.encode_conversation(tokenizer, _conversation(chat.TOOL_NAME))[0])
    released = tokenizer.decode(chat.encode_conversation(
        tokenizer, _conversation("python_code_with_standard_io"), chat.RELEASED_FORMAT)[0])
    ours_call = json.dumps({"name": chat.TOOL_NAME, "arguments": {"code": CODE, "input": ""}})
    assert ours == (
        f"<|im_start|>system\n{chat.RSTAR2_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{USER_PREFIX}{QUESTION}<|im_end|>\n<|im_start|>assistant\n<reason>"
        f"Let me compute.</reason><tool_call>{ours_call}</tool_call><|im_end|>"
        f"\n<|im_start|>user\n<tool_response>\n{OUTPUT}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<reason>It is 5.</reason><answer>\\boxed{5}</answer><|im_end|>")
    # The released template: the instruction, then the "# Tools" block with the schema as JSON
    # on its own line inside <tools>, closed by the call syntax; every user message gets the
    # answer-format prefix; tool calls are '\n<tool_call>\n{"name": ..., "arguments": <json>}\n
    # </tool_call>'; a tool message is a user turn '\n<tool_response>\n...\n</tool_response>';
    # the generation prompt is '<|im_start|>assistant\n<reason>'. The agent loop appends the tool
    # turn right after the generated <|im_end|> (no newline).
    schema = json.dumps(chat.RELEASED_TOOL_SCHEMA)
    assert released == (
        f"<|im_start|>system\n{INSTRUCTION}\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{schema}\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        f"<|im_start|>user\n{USER_PREFIX}{QUESTION}<|im_end|>\n<|im_start|>assistant\n<reason>"
        'Let me compute.</reason>\n<tool_call>\n{"name": "python_code_with_standard_io", '
        f'"arguments": {{"code": "{CODE}", "input": ""}}}}\n</tool_call><|im_end|>'
        f"<|im_start|>user\n<tool_response>\n{OUTPUT}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<reason>It is 5.</reason><answer>\\boxed{5}</answer><|im_end|>")
    # The prompt alone is what the sampler starts from.
    assert released.startswith(tokenizer.decode(chat.encode_prompt(tokenizer, QUESTION, chat.RELEASED_FORMAT)))


def test_released_truncation_keeps_128_characters_each_side():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    shown = chat.RELEASED_FORMAT.truncate(text)
    assert shown == text[:128] + "...(truncated)..." + text[-128:]
    assert chat.RELEASED_FORMAT.truncate(text[:256]) == text[:256]
    assert chat.tool_response_text(text, chat.RELEASED_FORMAT) == (
        f"<|im_start|>user\n<tool_response>\n{shown}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<reason>")
    assert chat.ChatFormat().truncate(text) == text  # ours leaves it to the sandbox's rendering


def test_released_calls_parse_with_its_tool_name_only():
    call = chat.RELEASED_FORMAT.tool_call_text("python_code_with_standard_io", {"code": CODE, "input": "7"})
    assert chat.parse_tool_call("Let me.</reason>" + call, "python_code_with_standard_io") == chat.ToolCall(CODE, "7")
    assert "unknown tool" in chat.parse_tool_call(call).error  # not our tool name
    assert chat.get_format("rstar2_released") is chat.RELEASED_FORMAT


def test_the_sampler_runs_the_released_format(tokenizer):
    """A scripted policy writes released-layout calls: they run, the tool turn is glued to the
    model's <|im_end|> and the output is cut in the middle to 256 characters."""
    fmt = chat.RELEASED_FORMAT
    call = fmt.tool_call_text(fmt.tool_name, {"code": "print('x' * 300 + 'END')", "input": ""})
    config, params, forward, markers = make_policy(tokenizer, [["Go." + call, "<answer>\\boxed{1}</answer>"]])
    prompt = [markers[0]] + chat.encode_prompt(tokenizer, QUESTION, fmt)
    with SandboxPool(num_workers=1, timeout_s=30.0) as pool:
        sampler = AgentSampler(config, tokenizer, pool, RolloutSettings(num_slots=1, chunk=8),
                               RolloutLimits(max_turns=3, max_response_tokens=600, max_prompt_tokens=600),
                               SamplingParams(temperature=1.0), forward_fn=forward, fmt=fmt)
        (traj,), _ = sampler.rollout(params, [prompt])
    assert [c.status for c in traj.tool_calls] == ["ok"] and traj.finish_reason == "answer"
    text = tokenizer.decode(traj.response_ids)
    rendered = traj.tool_calls[0].response_text  # as the sandbox rendered it
    assert rendered.startswith("Tool call success\nstdout: xxx") and "xEND\nexecution time" in rendered
    shown = rendered[:128] + "...(truncated)..." + rendered[-128:]
    assert f"</tool_call><|im_end|><|im_start|>user\n<tool_response>\n{shown}\n</tool_response>" in text
