"""Rendering options: the official DeepSeek V4 encoding by default, ds4's server layout on request.

Every field is one documented difference between the official `encoding_dsv4` encoder and
antirez/ds4's server renderer (`../shared/spec/DS4_SURFACE.md` §2.8, §3). `OFFICIAL` reproduces the
official encoder byte for byte; `DS4` reproduces ds4's server, so that KV-cache files and exact DSML
replay stay compatible with prompts ds4 rendered. See `DS4_DEVIATIONS.md` for the full list,
including the differences that are not options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dwarfstar.model.config import PREVIEW


@dataclass(frozen=True, slots=True)
class RenderOptions:
    # Wording of the "## Tools" section. ds4 rewrote the string-parameter paragraph (raw text, the
    # `&lt;` escape rule), says "the user question", adds a closing sentence and no final newline.
    tools_prompt: Literal["official", "ds4"] = "official"
    # Serialize tool schemas, response_format and non-string DSML values without spaces (`{"a":1}`).
    # ds4 copies the client's schema bytes and minifies values; the official encoder uses json.dumps.
    compact_json: bool = False
    # ds4 DSML escaping: `& < > "` as entities in tool and parameter names, `</｜DSML｜parameter>` as
    # `&lt;/｜DSML｜parameter>` in string values and as `\u003c/...` inside JSON values. The parser
    # must be told the same (`DsmlParser(escaped=True)`).
    escape_dsml: bool = False
    # ds4 puts one system block first: the tools section, then every system and developer message
    # (wherever it is in the conversation), joined by blank lines. Officially a system message renders
    # where it stands with tools after its text, and a developer message is a user turn.
    ds4_system_block: bool = False
    # Officially consecutive user and tool messages become one user turn (parts joined by blank lines);
    # ds4 starts a new `<｜User｜>` for every user message and only chains tool results.
    merge_user_turns: bool = True
    # Text between two tool results in one user turn ("\n\n" officially, nothing in ds4).
    tool_result_separator: str = "\n\n"
    # Officially tool results are reordered to follow the preceding assistant's tool calls; ds4 keeps
    # the order the messages came in.
    sort_tool_results: bool = True
    # ds4 escapes `</tool_result>` inside a tool result as `&lt;/tool_result>`; officially it is raw.
    escape_tool_results: bool = False
    # Officially earlier reasoning is kept only when tools are defined; ds4 also keeps it whenever the
    # history holds a tool call or a tool result.
    keep_reasoning_with_tool_history: bool = False
    # Not a server difference but the model's: the release whose reasoning-effort table applies
    # (`model.config.RELEASES`); the renderer takes it from the model file (`ModelArgs.reasoning_efforts`).
    efforts: str = PREVIEW


OFFICIAL = RenderOptions()

DS4 = RenderOptions(
    tools_prompt="ds4",
    compact_json=True,
    escape_dsml=True,
    ds4_system_block=True,
    merge_user_turns=False,
    tool_result_separator="",
    sort_tool_results=False,
    escape_tool_results=True,
    keep_reasoning_with_tool_history=True,
)
