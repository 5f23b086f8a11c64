"""Pre-tokenizer rules named by `tokenizer.ggml.pre`, as `tokenizers` pre-tokenizers.

DeepSeek V3/V4 split text with three regexes in a row, each cutting every piece into its matches
and the gaps between them ("isolated"), then map bytes to the GPT-2 alphabet. ds4's GGUF files
call this rule set "joyai-llm" (llama.cpp's name for the same regexes); "deepseek-v3" is
llama.cpp's older name for it.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

from dwarfstar.errors import ModelFileError

DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}",
    # CJK ideographs U+4E00-U+9FA5, Hiragana and Katakana runs.
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
)

SPLITS_BY_NAME = {"joyai-llm": DEEPSEEK_SPLITS, "deepseek-v3": DEEPSEEK_SPLITS}
# A GGUF without the key is assumed to be DeepSeek's own, since that is the only model family we load.
DEFAULT_PRE = "joyai-llm"


def pre_tokenizer_for(name: str | None) -> pre_tokenizers.PreTokenizer:
    splits = SPLITS_BY_NAME.get(name or DEFAULT_PRE)
    if splits is None:
        known = ", ".join(sorted(SPLITS_BY_NAME))
        raise ModelFileError(f"unsupported tokenizer.ggml.pre {name!r} (known: {known})")
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
