"""The ds4 preset against the literal renderings of ds4's C renderer (../shared/spec/DS4_SURFACE.md §3.4)."""

from __future__ import annotations

from dataclasses import replace

from dwarfstar.prompt import DS4, OFFICIAL, render_conversation

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# §3.3, written out from the spec rather than taken from the renderer's own template.
DS4_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name":"bash","description":"Run a shell command.","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"number"}},"required":["command"]}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas."""  # noqa: E501

THINK_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
}


def bash_call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": arguments}}


def test_plain_chat_nothink() -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    expected = f"{BOS}You are terse.<｜User｜>Hello<｜Assistant｜></think>"
    assert render_conversation(messages, options=DS4).text == expected


def test_think_multi_turn_drops_old_reasoning() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
    ]
    expected = f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜><think>"
    assert render_conversation(messages, thinking=True, options=DS4).text == expected


def test_think_max_without_system() -> None:
    prompt = render_conversation(
        [{"role": "user", "content": "Hello"}], thinking=True, reasoning_effort="max", options=DS4
    )
    assert prompt.text == f"{BOS}{THINK_MAX}<｜User｜>Hello<｜Assistant｜><think>"


def test_tool_call_and_two_results_think() -> None:
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List /tmp"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use bash.",
            "tool_calls": [bash_call('{"command":"ls /tmp && echo done","timeout":10}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
        {"role": "tool", "tool_call_id": "call_1", "content": "x </tool_result> y"},
    ]
    expected = (
        f"{BOS}{DS4_TOOLS_PROMPT}\n\nYou are a coding agent.<｜User｜>List /tmp<｜Assistant｜><think>Use bash.</think>"
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls /tmp && echo done</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>a.txt\nb.txt</tool_result>"
        "<tool_result>x &lt;/tool_result> y</tool_result><｜Assistant｜><think>"
    )
    assert render_conversation(messages, tools=[BASH], thinking=True, options=DS4).text == expected


def test_tool_call_nothink_without_client_system() -> None:
    messages = [
        {"role": "user", "content": "List /tmp"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [bash_call('{"command":"ls /tmp"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]
    expected = (
        f"{BOS}{DS4_TOOLS_PROMPT}<｜User｜>List /tmp<｜Assistant｜></think>Sure.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>a.txt</tool_result><｜Assistant｜></think>"
    )
    assert render_conversation(messages, tools=[BASH], options=DS4).text == expected


def test_ds4_escapes_tool_supplied_text() -> None:
    arguments = '{"command": "make 2>&1 && echo </｜DSML｜parameter>", "meta": {"s": "</｜DSML｜parameter>"}}'
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [bash_call(arguments)]}]
    text = render_conversation(messages, options=DS4).text
    assert ">make 2>&1 && echo &lt;/｜DSML｜parameter></｜DSML｜parameter>" in text
    assert '>{"s":"\\u003c/｜DSML｜parameter>"}</｜DSML｜parameter>' in text
    official = render_conversation(messages).text
    assert ">make 2>&1 && echo </｜DSML｜parameter></｜DSML｜parameter>" in official


def test_ds4_hoists_developer_messages_into_the_system_block() -> None:
    messages = [
        {"role": "system", "content": "A."},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": "B."},
    ]
    assert render_conversation(messages, options=DS4).text == f"{BOS}A.\n\nB.<｜User｜>q<｜Assistant｜></think>"
    assert render_conversation(messages).text == f"{BOS}A.<｜User｜>q<｜User｜>B.<｜Assistant｜></think>"


def test_merge_user_turns_option() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert "<｜User｜>a\n\nb<｜Assistant｜>" in render_conversation(messages).text
    separate = render_conversation(messages, options=replace(OFFICIAL, merge_user_turns=False)).text
    assert "<｜User｜>a<｜User｜>b<｜Assistant｜>" in separate


def test_sort_tool_results_option() -> None:
    calls = [bash_call("{}") | {"id": "x"}, bash_call("{}") | {"id": "y"}]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "y", "content": "2"},
        {"role": "tool", "tool_call_id": "x", "content": "1"},
    ]
    assert "<tool_result>1</tool_result>\n\n<tool_result>2</tool_result>" in render_conversation(messages).text
    unsorted = render_conversation(messages, options=replace(OFFICIAL, sort_tool_results=False)).text
    assert "<tool_result>2</tool_result>\n\n<tool_result>1</tool_result>" in unsorted


def test_ds4_keeps_reasoning_when_the_history_has_tool_calls() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "reasoning_content": "R1", "tool_calls": [bash_call('{"command": "ls"}')]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "reasoning_content": "R2", "content": "done"},
        {"role": "user", "content": "again"},
    ]
    assert "R1" not in render_conversation(messages, thinking=True).text
    ds4 = render_conversation(messages, thinking=True, options=DS4).text
    assert "<think>R1</think>" in ds4 and "<think>R2</think>" in ds4
