"""The GGUF-built tokenizer against the official V4 tokenizer.json run through HF `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.tokenizer import Tokenizer, TokenizerError
from dwarfstar.tokenizer import tokenizer as tokenizer_module
from dwarfstar.tokenizer.pretokenize import DEEPSEEK_SPLITS
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, tokenizer_metadata

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FIXTURE_FILES = sorted(p for p in (SHARED / "fixtures").rglob("*") if p.is_file())
VOCAB_SIZE = 129280

SPECIAL_STRINGS = ["<｜User｜>", "<｜Assistant｜>", "｜DSML｜", "<think>", "</think>", "<｜end▁of▁sentence｜>"]
SAMPLES = [
    "今天天气很好，我们去公园散步吧。北京是中国的首都。",
    "日本語のテキストです。カタカナとひらがなと漢字が混ざっています。",
    "Quel ramo del lago di Como, che volge a mezzogiorno... È così, perché né l'uno né l'altro.",
    "مرحبا بالعالم، هذه جملة عربية مع أرقام ١٢٣٤٥ و 67890.",
    "Emoji: 😀🎉👍🏽👨‍👩‍👧‍👦 🇮🇹 and ZWJ sequences ❤️‍🔥",
    "def f(x):\n\tif x >= 10_000:\n\t\treturn {'a': [1, 2, 3]}  # comment\n    return x**2 != 0\n",
    'int main(void) { printf("%d\\n", 1234567); return 0; }\r\n',
    "   leading spaces, trailing spaces   \n\n\n\t\t\n   \r\n\r\n  mixed \u00a0 nbsp \u3000 ideographic space ",
    "numbers 1 12 123 1234 12345 3.14159 ١٢٣ 一二三 ⅷ",
    "punctuation!!! ???... ---> <=> ;;\n>>;\n",
    "Ünïcödé àccents ñ ß ø å æ œ ğ ş ı ł č ř ž",
]


def plain_metadata() -> dict:
    """The GGUF tokenizer keys as a reader returns them: plain values, arrays as lists."""
    meta = {}
    for key, (value_type, value) in tokenizer_metadata(bundled_tokenizer_json(), VOCAB_SIZE).items():
        meta[key] = value[1] if value_type == ValueType.ARRAY else value
    return meta


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(plain_metadata())


@pytest.fixture(scope="module")
def official() -> HFTokenizer:
    return HFTokenizer.from_file(str(bundled_tokenizer_json()))


@pytest.fixture(scope="module")
def official_plain() -> HFTokenizer:
    """The official tokenizer without its added tokens: what plain text must encode to."""
    spec = json.loads(bundled_tokenizer_json().read_text(encoding="utf-8"))
    spec["added_tokens"] = []
    return HFTokenizer.from_str(json.dumps(spec))


def test_pre_tokenizer_regexes_are_the_official_ones() -> None:
    spec = json.loads(bundled_tokenizer_json().read_text(encoding="utf-8"))
    official = [step["pattern"]["Regex"] for step in spec["pre_tokenizer"]["pretokenizers"] if step["type"] == "Split"]
    assert list(DEEPSEEK_SPLITS) == official


def test_special_token_ids(tok: Tokenizer) -> None:
    expected = {
        "<｜begin▁of▁sentence｜>": 0,
        "<｜end▁of▁sentence｜>": 1,
        "<｜User｜>": 128803,
        "<｜Assistant｜>": 128804,
        "<think>": 128821,
        "</think>": 128822,
        "｜DSML｜": 128825,
        "<｜latest_reminder｜>": 128828,
    }
    assert {text: tok.token_id(text) for text in expected} == expected
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, VOCAB_SIZE)


def test_shared_fixtures_are_there() -> None:
    names = {path.name for path in FIXTURE_FILES}
    assert {"promessi_sposi.txt", "long_context_story_prompt.txt", "long_context_security_prompt.txt"} <= names
    assert len(FIXTURE_FILES) >= 20


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: str(p.relative_to(SHARED)))
def test_fixture_files_match_official(path: Path, tok: Tokenizer, official, official_plain) -> None:
    text = path.read_bytes().decode("utf-8", errors="replace")
    with_specials = tok.encode_with_specials(text)
    assert with_specials == official.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == official_plain.encode(text, add_special_tokens=False).ids
    assert tok.decode(with_specials) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_multilingual_code_and_whitespace(text: str, tok: Tokenizer, official) -> None:
    ids = tok.encode(text)
    assert ids == official.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_user_text_never_becomes_control_tokens(tok: Tokenizer, official) -> None:
    text = "I typed " + " and ".join(SPECIAL_STRINGS)
    plain = tok.encode(text)
    added = [i for i in plain if tok.is_added(i)]
    assert added == []
    assert tok.decode(plain) == text
    with_specials = tok.encode_with_specials(text)
    assert with_specials == official.encode(text, add_special_tokens=False).ids
    assert [tok.token_id(s) for s in SPECIAL_STRINGS] == [i for i in with_specials if tok.is_added(i)]


# Random text: any code point (no surrogates) mixed with whitespace, digits, CJK and control-token strings.
unicode_text = st.lists(
    st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
        st.sampled_from(list(" \n\t\r\u00a0\u3000") + list("0123456789") + list("的一是不了人我在有他日本語カナ")),
        st.sampled_from(SPECIAL_STRINGS),
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=unicode_text)
def test_random_unicode_matches_official(text: str, tok: Tokenizer, official, official_plain) -> None:
    plain = tok.encode(text)
    assert plain == official_plain.encode(text, add_special_tokens=False).ids
    assert tok.encode_with_specials(text) == official.encode(text, add_special_tokens=False).ids
    assert tok.decode(plain) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=120))
def test_invalid_utf8_bytes(data: bytes, tok: Tokenizer, official_plain) -> None:
    text = data.decode("utf-8", errors="replace")
    ids = tok.encode_bytes(data)
    assert ids == official_plain.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_lone_surrogates_become_replacement_characters(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("a\ud800b\udfff")) == "a\ufffdb\ufffd"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.text(alphabet=st.sampled_from(list("ab1. \t\n\r\u00a0,;日") + ["\u2028", "\x1c", "\x85"]), max_size=12),
        max_size=12,
    )
)
def test_parallel_chunks_give_the_same_ids(lines: list[str], tok: Tokenizer, official_plain, monkeypatch) -> None:
    text = "\n".join(lines)
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_module, "CHUNK_CHARS", 3)
        chunked = tok.encode(text)
    assert chunked == official_plain.encode(text, add_special_tokens=False).ids


def test_long_text_is_cut_only_after_newlines() -> None:
    text = "alpha\n beta\ngamma\n\ndelta\nepsilon"
    pieces = tokenizer_module.split_at_safe_cuts(text, 3)
    assert "".join(pieces) == text
    assert pieces == ["alpha\n beta\n", "gamma\n\n", "delta\n", "epsilon"]


def test_decode_rejects_ids_outside_the_vocabulary(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        tok.decode([5, VOCAB_SIZE])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "llama"}, "only byte-level BPE"),
        ({"tokenizer.ggml.pre": "qwen2"}, "unsupported tokenizer.ggml.pre"),
        ({"tokenizer.ggml.tokens": None}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": ["Ġt"]}, "malformed tokenizer merge"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token types"),
    ],
)
def test_bad_metadata_is_a_model_file_error(change: dict, message: str) -> None:
    meta = plain_metadata()
    meta.update(change)
    with pytest.raises(ModelFileError, match=message):
        Tokenizer.from_gguf_metadata(meta)
