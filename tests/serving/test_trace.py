"""`divergence`: where a new prompt stops extending the text a cached session holds."""

from __future__ import annotations

import orjson

from dwarfstar.serving.request_trace import Trace, divergence


def test_a_pure_suffix_is_no_divergence():
    assert divergence("<User>hi<Assistant>Hello", "<User>hi<Assistant>Hello<EOS><User>again") is None


def test_a_rewritten_block_is_located_with_the_text_on_both_sides():
    before = "SYSTEM<User>hello# Env<Assistant>"
    after = "SYSTEM<User>hello\n<reminder>limit hit</reminder># Env<Assistant>"
    where = divergence(before, after, context=8)
    assert where == {"offset": 17, "common": "er>hello", "before": "# Env<As", "after": "\n<remind"}


def test_a_shorter_prompt_diverges_where_it_ends():
    where = divergence("abcdef", "abc", context=2)
    assert where == {"offset": 3, "common": "bc", "before": "de", "after": ""}


def test_the_trace_explains_a_miss_against_the_closest_recent_conversation(tmp_path):
    trace = Trace(tmp_path / "trace.jsonl")
    trace.write({"prompt": "SYS<User>hello# Env<Assistant>", "generated": "Hi", "cached_tokens": 0, "prompt_tokens": 9})
    trace.write({"prompt": "OTHER<User>x<Assistant>", "generated": "y", "cached_tokens": 0, "prompt_tokens": 5})
    # a pure extension of the first conversation (its prompt and answer): nothing to explain
    extended = "SYS<User>hello# Env<Assistant>Hi<User>again"
    trace.write({"prompt": extended, "generated": "", "cached_tokens": 9, "prompt_tokens": 12})
    # the client inserted a reminder before an early block: the record says where
    rewritten = "SYS<User>hello<reminder># Env<Assistant>Hi<User>more"
    trace.write({"prompt": rewritten, "generated": "", "cached_tokens": 4, "prompt_tokens": 14})
    trace.close()
    records = [orjson.loads(line) for line in (tmp_path / "trace.jsonl").read_bytes().splitlines()]
    assert ["divergence" in r for r in records] == [False, True, False, True]
    assert records[3]["divergence"]["offset"] == len("SYS<User>hello")
    assert records[3]["divergence"]["before"].startswith("# Env<Assistant>Hi<User>again")
    assert records[3]["divergence"]["after"].startswith("<reminder>")
