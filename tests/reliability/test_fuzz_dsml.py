"""The DSML parser on generated-looking text made of tag fragments (well-formed, drifted, truncated
and malformed), fed whole and in random chunkings: never an exception, the same completion and the
same event text whatever the chunking, and no DSML block in the content of an answer without calls."""

from __future__ import annotations

from fuzz_support import FUZZ, tally
from hypothesis import given
from hypothesis import strategies as st

from dwarfstar.prompt import dsml_tags
from dwarfstar.prompt.dsml_parser import (
    ContentDelta,
    DsmlParser,
    ParseProblem,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallStart,
)

D = "｜DSML｜"
FRAGMENTS = [
    "\n\n",
    "\n",
    " ",
    "</think>",
    "<think>",
    f"<{D}tool_calls>",
    f"</{D}tool_calls>",
    f'<{D}invoke name="get_weather">',
    f'<{D}invoke name="run">',
    f"</{D}invoke>",
    f'<{D}parameter name="city" string="true">',
    f'<{D}parameter name="days" string="false">',
    f'<{D}parameter name="x">',
    f"</{D}parameter>",
    "&lt;/" + D + "parameter>",
    # the drift long contexts produce: a lookalike bracket, a lost underscore, a half tag
    f"‹{D}tool_calls>",
    f"<{D}toolcalls>",
    f"</{D}tool-calls>",
    f"‹/{D}parameter›",
    f"＜/{D}invoke＞",
    '<|DSML|invoke name="run">',
    "<DSML｜tool_calls>",
    "‹",
    "<｜end▁of▁sentence｜>",
    f"<{D}tool_",
    f"<{D}",
    "｜DSML",
    '"',
    '">',
    "Paris",
    '{"n": 3}',
    "[1, 2]",
    "null",
    "plain words ",
    "é✓🙂",
]

DRIFT = [
    (f"<{D}", f"‹{D}"),
    (f"</{D}", f"＜/{D}"),
    ("tool_calls", "toolcalls"),
    (D, "|DSML|"),
    (f"<{D}tool_calls>", "<DSML｜tool_calls>"),
    (f"</{D}invoke>\n</{D}tool_calls>", f"</{D}tool_calls>"),
    (f"</{D}invoke>\n<{D}invoke", f"<{D}invoke"),
    (f"\n</{D}tool_calls>", "<｜end▁of▁sentence｜>"),
]

soup = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=40).map("".join)


@st.composite
def answers(draw) -> str:
    """An answer ending in a well-formed block of one or two calls, then maybe damaged in one spot."""
    invokes = []
    for _ in range(draw(st.integers(1, 2))):
        params = "".join(
            f'<{D}parameter name="{key}" string="{"true" if string else "false"}">{value}</{D}parameter>\n'
            for key, string, value in draw(
                st.lists(st.tuples(st.sampled_from(["city", "days", "q"]), st.booleans(), st.sampled_from(FRAGMENTS)))
            )
        )
        invokes.append(f'<{D}invoke name="{draw(st.sampled_from(["get_weather", "run"]))}">\n{params}</{D}invoke>\n')
    text = draw(st.text(max_size=20)) + f"\n\n<{D}tool_calls>\n" + "".join(invokes) + f"</{D}tool_calls>"
    damage = draw(st.sampled_from(["none", "none", "drift", "replace", "cut", "insert"]))
    at = draw(st.integers(0, len(text)))
    if damage == "drift":  # one tag spelling drifts the way long contexts make it (a repairable kind)
        canonical, drifted = draw(st.sampled_from(DRIFT))
        text = text.replace(canonical, drifted, draw(st.integers(1, 3)))
    elif damage == "cut":
        text = text[:at]
    elif damage == "insert":
        text = text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at:]
    elif damage == "replace":
        text = text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at + draw(st.integers(1, 12)) :]
    return text


texts = soup | answers()


def run(pieces: list[str], thinking: bool, escaped: bool, ended: bool):
    parser = DsmlParser(thinking=thinking, escaped=escaped)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish(ended=ended)
    return parser.completion, events


def streams(events) -> dict[str, str]:
    """The text of each event stream joined (chunking may split deltas differently, not their text)."""
    out = {"reasoning": "", "content": "", "calls": "", "problems": ""}
    for event in events:
        if isinstance(event, ReasoningDelta):
            out["reasoning"] += event.text
        elif isinstance(event, ContentDelta):
            out["content"] += event.text
        elif isinstance(event, ToolArgumentsDelta):
            out[f"arguments {event.index}"] = out.get(f"arguments {event.index}", "") + event.text
        elif isinstance(event, ToolCallStart):
            out["calls"] += f"{event.index}:{event.name};"
        elif isinstance(event, ParseProblem):
            out["problems"] += event.message + ";"
    return out


@FUZZ
@given(
    text=texts,
    cuts=st.lists(st.integers(0, 400), max_size=12),
    thinking=st.booleans(),
    escaped=st.booleans(),
    ended=st.booleans(),
)
def test_any_chunking_gives_the_same_completion(text, cuts, thinking, escaped, ended):
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole, whole_events = run([text], thinking, escaped, ended)
    chunked, chunked_events = run(pieces, thinking, escaped, ended)
    assert chunked == whole
    assert streams(chunked_events) == streams(whole_events)
    # the parts are pieces of the text: reasoning, content, the accepted or the invalid block
    kept = (whole.reasoning or "") + whole.content + (whole.raw_dsml or "") + (whole.invalid_dsml or "")
    assert len(kept) <= len(text)
    if not whole.tool_calls:  # content after an accepted block is stray text; before, never DSML
        opener = dsml_tags.BLOCK_OPEN.find(whole.content)
        assert opener is None or opener.partial
    repaired = any(p.startswith("repaired") for p in whole.problems)
    outcome = "tool calls, repaired" if repaired and whole.tool_calls else "tool calls" if whole.tool_calls else ""
    outcome = outcome or ("invalid tool call" if whole.invalid_dsml is not None else "")
    tally("dsml parser", outcome or ("problems" if whole.problems else "plain text"))
