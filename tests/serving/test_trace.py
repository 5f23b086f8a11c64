"""`divergence`: where a new prompt stops extending the text a cached session holds."""

from __future__ import annotations

from dwarfstar.serving.trace import divergence


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
