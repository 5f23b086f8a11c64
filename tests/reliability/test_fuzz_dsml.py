"""The DSML parser on generated-looking text made of tag fragments (well-formed, truncated and
malformed), fed whole and in random chunkings: never an exception, and the same completion and the
same event text whatever the chunking."""

from __future__ import annotations

from fuzz_support import FUZZ, tally
from hypothesis import given
from hypothesis import strategies as st

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
    damage = draw(st.sampled_from(["none", "none", "replace", "cut", "insert"]))
    at = draw(st.integers(0, len(text)))
    if damage == "cut":
        text = text[:at]
    elif damage == "insert":
        text = text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at:]
    elif damage == "replace":
        text = text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at + draw(st.integers(1, 12)) :]
    return text


texts = soup | answers()


def run(pieces: list[str], thinking: bool, escaped: bool):
    parser = DsmlParser(thinking=thinking, escaped=escaped)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
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
@given(text=texts, cuts=st.lists(st.integers(0, 400), max_size=12), thinking=st.booleans(), escaped=st.booleans())
def test_any_chunking_gives_the_same_completion(text, cuts, thinking, escaped):
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole, whole_events = run([text], thinking, escaped)
    chunked, chunked_events = run(pieces, thinking, escaped)
    assert chunked == whole
    assert streams(chunked_events) == streams(whole_events)
    # nothing is lost: reasoning, content and the accepted block together hold all the text
    kept = (whole.reasoning or "") + whole.content + (whole.raw_dsml or "")
    assert len(kept) <= len(text)
    tally("dsml parser", "tool calls" if whole.tool_calls else ("problems" if whole.problems else "plain text"))
