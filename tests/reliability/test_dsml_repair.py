"""Tolerant DSML: the drift long contexts produce is repaired to the calls the model meant, the same
whether the text arrives whole or cut anywhere; what cannot be repaired is an invalid tool call whose
DSML never reaches the content."""

from __future__ import annotations

import pytest

from dwarfstar.prompt.dsml_parser import ContentDelta, DsmlParser, parse_completion

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
INVOKE_BASH = (
    f'<{D}invoke name="bash">\n'
    f'<{D}parameter name="command" string="true">ls -la /tmp</{D}parameter>\n'
    f'<{D}parameter name="timeout" string="false">10</{D}parameter>\n'
    f"</{D}invoke>"
)
INVOKE_READ = f'<{D}invoke name="read">\n<{D}parameter name="path" string="true">a.txt</{D}parameter>\n</{D}invoke>'
CALL = f"Looking.\n\n<{D}tool_calls>\n{INVOKE_BASH}\n{INVOKE_READ}\n</{D}tool_calls>"
MEANT = parse_completion(CALL, thinking=False)


def parse_every_way(text: str, *, ended: bool = False):
    """The completion of `text` fed whole, and asserted equal when cut once at every position."""
    whole = parse_completion(text, thinking=False, ended=ended)
    for cut in range(1, len(text)):
        parser = DsmlParser(thinking=False)
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish(ended=ended)
        assert parser.completion == whole, f"cut at {cut}"
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == whole.content
    return whole


def test_the_well_formed_block_needs_no_repair() -> None:
    assert [call.name for call in MEANT.tool_calls] == ["bash", "read"]
    assert MEANT.problems == [] and MEANT.content == "Looking."


DRIFT = [
    ("lookalike opening bracket", CALL.replace(f"<{D}tool_calls>", f"‹{D}tool_calls>")),
    ("fullwidth brackets", CALL.replace(f"</{D}invoke>", f"＜/{D}invoke＞")),
    ("lookalike bracket on a parameter", CALL.replace(f'<{D}parameter name="path"', f'‹{D}parameter name="path"')),
    ("lookalike bracket closing a value", CALL.replace(f"10</{D}parameter>", f"10‹/{D}parameter›")),
    ("missing underscore", CALL.replace("tool_calls", "toolcalls")),
    ("missing underscore at the end only", CALL.replace(f"</{D}tool_calls>", f"</{D}toolcalls>")),
    ("leading bar dropped", CALL.replace(f"<{D}tool_calls>", "<DSML｜tool_calls>")),
    ("ASCII bars", CALL.replace(D, "|DSML|")),
    ("invoke not closed before the next", CALL.replace(f"</{D}invoke>\n<{D}invoke", f"<{D}invoke", 1)),
    ("last invoke not closed", CALL.replace(f"</{D}invoke>\n</{D}tool_calls>", f"</{D}tool_calls>")),
    ("block ended by end-of-sentence", CALL.replace(f"\n</{D}tool_calls>", EOS)),
    ("invoke and block ended by end-of-sentence", CALL.replace(f"</{D}invoke>\n</{D}tool_calls>", EOS)),
]


@pytest.mark.parametrize("text", [text for _, text in DRIFT], ids=[why for why, _ in DRIFT])
def test_drift_is_repaired_to_the_meant_calls(text: str) -> None:
    assert text != CALL
    repaired = parse_every_way(text)
    assert repaired.tool_calls == MEANT.tool_calls
    assert repaired.content == "Looking."
    assert repaired.invalid_dsml is None
    assert repaired.problems and all(p.startswith("repaired tool call: ") for p in repaired.problems)
    # the bytes as generated, for the exact replay that makes the next turn's prefix hit
    assert repaired.raw_dsml == text[len("Looking.") :].removesuffix(EOS)


def test_a_block_the_model_ended_is_closed_only_when_it_ended() -> None:
    unterminated = CALL.removesuffix(f"\n</{D}tool_calls>")
    # the model's end-of-sentence token (not fed as text in serving) closes it ...
    ended = parse_every_way(unterminated, ended=True)
    assert ended.tool_calls == MEANT.tool_calls
    assert "repaired tool call: the tool-call block was not closed" in ended.problems
    # ... a length limit or stop string does not: the calls may be cut short
    cut_short = parse_every_way(unterminated)
    assert cut_short.tool_calls == [] and cut_short.content == "Looking."
    assert cut_short.invalid_dsml == unterminated[len("Looking.") :]


UNREPAIRABLE = [
    ("value cut off", CALL[: CALL.index("/tmp")] + EOS, "a parameter value was not closed"),
    ("name cut off", CALL[: CALL.index('"read"') + 3], "a name is not closed on its line"),
    ("unknown tag", CALL.replace(f'<{D}invoke name="read">', "<invoke>"), "expected an invoke or the end of the block"),
    ("no invoke", f"Looking.\n\n<{D}tool_calls>\n</{D}tool_calls>", "it holds no invoke"),
]


@pytest.mark.parametrize(("text", "why"), [c[1:] for c in UNREPAIRABLE], ids=[c[0] for c in UNREPAIRABLE])
def test_unrepairable_blocks_are_invalid_tool_calls_without_dsml_in_content(text: str, why: str) -> None:
    invalid = parse_every_way(text, ended=True)
    assert invalid.tool_calls == []
    assert invalid.content == "Looking."
    assert invalid.invalid_dsml == text[len("Looking.") :].removesuffix(EOS)
    assert f"invalid tool call: {why}" in invalid.problems


def test_text_after_an_invalid_block_stays_out_of_the_content() -> None:
    text = f"Looking.\n\n<{D}tool_calls>\n<invoke>stray words</{D}invoke>\n</{D}tool_calls>{EOS}"
    invalid = parse_every_way(text)
    assert invalid.content == "Looking."
    assert invalid.invalid_dsml == text[len("Looking.") : -len(EOS)]


def test_prose_that_merely_mentions_dsml_is_content() -> None:
    text = "Use <DSML> tags, or write tool_calls and ‹quotes›."
    plain = parse_every_way(text)
    assert plain.content == text and plain.problems == [] and plain.invalid_dsml is None
