"""The streaming DSML parser: inverse of the renderer, chunking-independent, and never raising."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dwarfstar.prompt import DS4, OFFICIAL, render_conversation
from dwarfstar.prompt.dsml import PARAM_CLOSE_ESCAPED, to_json
from dwarfstar.prompt.dsml_parser import (
    ContentDelta,
    DsmlParser,
    ParseProblem,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    parse_completion,
)

CORPUS = json.loads((Path(__file__).parent / "data" / "encoding" / "corpus.json").read_text(encoding="utf-8"))
EOS = "<｜end▁of▁sentence｜>"
USER = {"role": "user", "content": "go"}
# A closing tag followed by what can only be structure: the one thing an unescaped value cannot hold
# (in any spelling the parser accepts for a tag: see dwarfstar/prompt/dsml_tags.py).
_OPEN, _DSML, _CLOSE = "[<‹＜]", "[｜|]?DSML[｜|]?", "[>›＞]"
STRUCTURAL_CLOSE = re.compile(
    rf"{_OPEN}/{_DSML}parameter{_CLOSE}\s*"
    rf"({_OPEN}{_DSML}(parameter|invoke) name=\"|{_OPEN}/{_DSML}invoke{_CLOSE}|{_OPEN}/{_DSML}tool[_\- ]?calls{_CLOSE})"
)


def generated_part(message: dict, *, thinking: bool, options=OFFICIAL) -> tuple[str, str]:
    """The full rendering of [user, message] and the part of it the model would have generated."""
    prompt = render_conversation([USER], thinking=thinking, options=options).text
    full = render_conversation([USER, message], thinking=thinking, options=options).text
    assert full.startswith(prompt)
    return full, full[len(prompt) :]


def stream(text: str, cuts: list[int], *, thinking: bool, escaped: bool = False):
    parser = DsmlParser(thinking=thinking, escaped=escaped)
    events = []
    previous = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[previous:cut])
        previous = cut
    events += parser.finish()
    return parser.completion, events


def check_events(completion, events) -> None:
    """Streamed deltas add up to the final completion."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning == (completion.reasoning or "")
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == completion.content
    ends = [e.call for e in events if isinstance(e, ToolCallEnd)]
    starts = [e.name for e in events if isinstance(e, ToolCallStart)]
    abandoned = sum(e.abandoned_calls for e in events if isinstance(e, ParseProblem))
    assert len(starts) == len(completion.tool_calls) + abandoned
    if completion.tool_calls:
        assert ends == completion.tool_calls
        for index, call in enumerate(completion.tool_calls):
            pieces = [e.text for e in events if isinstance(e, ToolArgumentsDelta) and e.index == index]
            assert "".join(pieces) == call.arguments_json
            assert json.loads(call.arguments_json) == json.loads(json.dumps(call.arguments))


# -- the corpus' own tool calls ------------------------------------------------------------------------------


CORPUS_ASSISTANTS = [
    (case["name"], message, case["thinking"])
    for case in CORPUS["cases"]
    for message in case["request"]["messages"]
    if message["role"] == "assistant" and message.get("tool_calls")
]


@pytest.mark.parametrize(("name", "message", "thinking"), CORPUS_ASSISTANTS, ids=[c[0] for c in CORPUS_ASSISTANTS])
def test_corpus_tool_calls_round_trip(name: str, message: dict, thinking: bool) -> None:
    full, generated = generated_part(message, thinking=thinking)
    completion = parse_completion(generated, thinking=thinking)
    assert completion.problems == []
    ids = [call["id"] for call in message["tool_calls"]]
    again = render_conversation([USER, completion.to_openai_message(ids)], thinking=thinking).text
    assert again == full
    assert [c.name for c in completion.tool_calls] == [c["function"]["name"] for c in message["tool_calls"]]


def test_official_fixture_completion_parses() -> None:
    case = next(c for c in CORPUS["cases"] if c["name"] == "tool_call_typed_arguments")
    generated = case["expected"].split("<｜Assistant｜><think>")[-1]
    completion = parse_completion(generated, thinking=True)
    assert completion.reasoning == "typed"
    assert completion.content == ""
    [call] = completion.tool_calls
    assert call.name == "write_file"
    assert call.arguments["obj"] == {"nested": {"deep": ["x", {"y": None}]}, "emoji": "🙂"}
    assert call.arguments["multiline"] == "line 1\nline 2\n"
    assert completion.raw_dsml.startswith("\n\n<｜DSML｜tool_calls>") and completion.raw_dsml.endswith("tool_calls>")


# -- properties ----------------------------------------------------------------------------------------------

FRAGMENTS = [
    "</tool_result>",
    "<tool_result>",
    "</｜DSML｜parameter>",
    '<｜DSML｜parameter name="k" string="true">',
    "</｜DSML｜invoke>",
    "<｜DSML｜tool_calls>",
    "｜DSML｜",
    "</think>",
    "&lt;",
    "&amp;",
    '"',
    "<",
    ">",
    "&",
    "\n",
    " ",
]
text_values = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=6), st.sampled_from(FRAGMENTS)),
    max_size=8,
).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text_values, inner, max_size=3),
    max_leaves=8,
)
plain_names = st.text(st.sampled_from("abcxyz_-.:09éß東語 "), min_size=1, max_size=10)
odd_names = st.text(st.sampled_from('ab_<>&"; é'), min_size=1, max_size=10)


def tool_calls_strategy(names):
    call = st.builds(
        lambda name, args, n: {
            "id": f"call_{n}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        },
        names,
        st.dictionaries(names, st.one_of(text_values, json_values), max_size=4),
        st.integers(0, 10**6),
    )
    return st.lists(call, min_size=1, max_size=3)


def rendered_values(message: dict, compact: bool) -> list[str]:
    values = []
    for call in message["tool_calls"]:
        for value in json.loads(call["function"]["arguments"]).values():
            values.append(value if isinstance(value, str) else to_json(value, compact=compact))
    return values


def round_trip(message: dict, thinking: bool, options, escaped: bool, cuts: list[int]) -> None:
    full, generated = generated_part(message, thinking=thinking, options=options)
    completion, events = stream(generated, cuts, thinking=thinking, escaped=escaped)
    assert completion.problems == []
    check_events(completion, events)
    ids = [call["id"] for call in message["tool_calls"]]
    again = render_conversation([USER, completion.to_openai_message(ids)], thinking=thinking, options=options)
    assert again.text == full


@settings(max_examples=300, deadline=None)
@given(
    calls=tool_calls_strategy(plain_names),
    content=text_values,
    reasoning=text_values,
    thinking=st.booleans(),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
)
def test_render_parse_render_is_identity(calls, content, reasoning, thinking, cuts) -> None:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}
    assume("<｜DSML｜tool_calls>" not in content and "</think>" not in reasoning)
    assume(not any(STRUCTURAL_CLOSE.search(v) for v in rendered_values(message, compact=False)))
    round_trip(message, thinking, OFFICIAL, False, cuts)


@settings(max_examples=200, deadline=None)
@given(calls=tool_calls_strategy(odd_names), content=text_values, cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_ds4_escaping_round_trips_any_names_and_values(calls, content, cuts) -> None:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    assume("<｜DSML｜tool_calls>" not in content)
    assume(not any(PARAM_CLOSE_ESCAPED in v for v in rendered_values(message, compact=True)))
    round_trip(message, False, DS4, True, cuts)


DSML_PIECES = [
    "\n\n",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    '<｜DSML｜parameter name="b" string="false">',
    '<｜DSML｜parameter name="c">',
    "</｜DSML｜parameter>",
    "</think>",
    EOS,
    "{",
    "1",
    "x",
    "\n",
    '"',
    "<",
    "｜DSML｜",
]


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(DSML_PIECES) | st.text(max_size=3), max_size=25),
    thinking=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_arbitrary_text_never_raises_and_loses_nothing(pieces, thinking, cuts) -> None:
    text = "".join(pieces)
    whole = parse_completion(text, thinking=thinking)
    streamed, events = stream(text, cuts, thinking=thinking)
    assert streamed == whole
    check_events(whole, events)
    if thinking or EOS in text:
        return
    if not whole.tool_calls:
        assert whole.content + (whole.invalid_dsml or "") == text
        return
    start = text.index(whole.raw_dsml)
    assert whole.content[:start] == text[:start]
    after = text[start + len(whole.raw_dsml) :]
    assert whole.content[start:] in ("", after)
    assert whole.content[start:] == after or not after.strip()


# -- specific behaviour --------------------------------------------------------------------------------------

CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls -la /tmp</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def test_name_is_reported_before_arguments_are_complete() -> None:
    parser = DsmlParser(thinking=False)
    cut = CALL.index("/tmp")
    events = parser.feed("Let me look." + CALL[:cut])
    assert ContentDelta("Let me look.") in events
    assert ToolCallStart(0, "bash") in events
    partial = "".join(e.text for e in events if isinstance(e, ToolArgumentsDelta))
    assert partial == '{"command": "ls -la '
    rest = parser.feed(CALL[cut:] + EOS) + parser.finish()
    assert "".join(e.text for e in rest if isinstance(e, ToolArgumentsDelta)) == '/tmp", "timeout": 10}'
    assert parser.completion.tool_calls[0].arguments == {"command": "ls -la /tmp", "timeout": 10}


def test_dsml_inside_reasoning_is_not_a_call() -> None:
    completion = parse_completion("I could write" + CALL + " here.</think>Answer." + EOS, thinking=True)
    assert completion.tool_calls == []
    assert completion.reasoning == "I could write" + CALL + " here."
    assert completion.content == "Answer."


def test_closing_tag_inside_a_value_is_kept_in_official_mode() -> None:
    value = "a </｜DSML｜parameter> b"
    text = CALL.replace("ls -la /tmp", value)
    [call] = parse_completion(text, thinking=False).tool_calls
    assert call.arguments["command"] == value


def test_ds4_escapes_are_read_back() -> None:
    text = CALL.replace('name="bash"', 'name="a&amp;b"').replace("ls -la /tmp", f"x {PARAM_CLOSE_ESCAPED} y")
    [call] = parse_completion(text, thinking=False, escaped=True).tool_calls
    assert call.name == "a&b"
    assert call.arguments["command"] == "x </｜DSML｜parameter> y"


def test_parameter_without_string_flag_is_a_string() -> None:
    text = CALL.replace('name="command" string="true"', 'name="command"')
    [call] = parse_completion(text, thinking=False).tool_calls
    assert call.arguments["command"] == "ls -la /tmp"


def test_non_json_value_marked_false_is_kept_as_text() -> None:
    completion = parse_completion(CALL.replace(">10<", ">ten<"), thinking=False)
    assert completion.tool_calls[0].arguments["timeout"] == "ten"
    assert "not JSON" in completion.problems[0]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (CALL[: CALL.index("</｜DSML｜invoke>")], "not closed"),
        (CALL.replace("</｜DSML｜tool_calls>", ""), "not closed"),
        (CALL.replace('name="bash">', 'name="bash'), "not closed on its line"),
        (CALL.replace('<｜DSML｜invoke name="bash">', "<invoke>"), "expected an invoke"),
        (CALL.replace('name="timeout"', 'name="command"'), "given twice"),
        ("\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>", "no invoke"),
        (CALL.replace('name="bash">\n', 'name="bash">\njunk'), "expected a parameter"),
        # After a value, a closing tag not followed by structure is value text, so the value never ends.
        (CALL.replace("</｜DSML｜invoke>", "junk</｜DSML｜invoke>"), "value was not closed"),
    ],
)
def test_unrepairable_blocks_are_invalid_tool_calls(text: str, problem: str) -> None:
    completion, events = stream("Before." + text, [3, 20, 41], thinking=False)
    assert completion.tool_calls == []
    assert completion.content == "Before."  # no raw DSML in the visible answer
    assert completion.invalid_dsml == text
    assert any(p.startswith("invalid tool call: ") and problem in p for p in completion.problems)
    check_events(completion, events)


def test_text_after_the_block_is_kept() -> None:
    completion = parse_completion(CALL + "\nP.S. more", thinking=False)
    assert len(completion.tool_calls) == 1
    assert completion.content == "\nP.S. more"
    assert completion.problems == ["text after the tool calls was kept as content"]


def test_unclosed_reasoning_and_text_after_eos() -> None:
    cut = parse_completion("thinking forever", thinking=True)
    assert cut.reasoning == "thinking forever" and cut.content == ""
    assert cut.problems == ["the reasoning was never closed with </think>"]
    tail = parse_completion("done." + EOS + "junk", thinking=False)
    assert tail.content == "done."
    assert tail.problems == ["text after the end-of-sentence token was ignored"]
