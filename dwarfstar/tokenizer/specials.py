"""The DeepSeek V4 control-token strings the prompt renderer inserts, and a marker type for them.

`｜` is U+FF5C (fullwidth vertical line) and `▁` is U+2581; the ids are looked up by string in the
vocabulary, never hard-coded, because a GGUF file is the authority on them.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
SYSTEM = "<｜System｜>"  # V4.1 only (id 128799 there; a placeholder in V4's vocabulary): opens a system message
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# Quick-instruction task tokens of the official encoder (internal classification tasks).
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}


@dataclass(frozen=True, slots=True)
class Control:
    """One control token placed by the renderer; its `text` is the token's vocabulary string.

    Prompts are sequences of `str` (plain text, tokenized with BPE whatever it contains) and
    `Control` (exactly one token). Keeping the two apart is what stops user text such as
    `<｜User｜>` from turning into a control token.
    """

    text: str

    def __str__(self) -> str:
        return self.text


PromptPart = str | Control
