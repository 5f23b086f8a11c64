"""Fixed prompt texts: the tools section, the response-format section and the reasoning-effort preamble.

The texts must match the official encoder (and, for the ds4 variant, ds4's server) byte for byte, so
they are written out in full. Control-token strings inside them (`｜DSML｜`, `<think>`, `</think>`)
are real control tokens in the rendered prompt; the tool schemas placed into the section are client
text and stay plain.
"""

from __future__ import annotations

import re

from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import Control, PromptPart

_TOOLS_INTRO = """## Tools

You have access to a set of tools to help answer the {asker} question. \
You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

{string_rule}

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""

_OFFICIAL_STRING_RULE = (
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
)
_DS4_STRING_RULE = (
    'String parameters should be specified as raw text and set `string="true"`. Preserve characters such as '
    "`>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. "
    "Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that "
    "tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, "
    'objects), pass the value in JSON format and set `string="false"`.'
)

_OFFICIAL_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_DS4_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)

RESPONSE_FORMAT_INTRO = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

# The reasoning-effort preambles that open a thinking prompt (which effort takes which: efforts.py). The
# preview releases' "max" and the later releases' "high" are the first; the later releases' "max" the
# second (the encoder of Flash 0731 and PRO 0813).
REASONING_EFFORT_ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
REASONING_EFFORT_BEYOND = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# V4.1's effort prefix (N: its think level, 1..100), as the official V4.1 encoder writes it; the tech report
# words it differently, and the encoder's text is what the model is prompted with (sources: RELEASES_2026.md)
THINK_LEVEL_PREFIX = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

_TEMPLATE_CONTROLS = re.compile(
    "(" + "|".join(re.escape(t) for t in (specials.DSML, specials.THINK_START, specials.THINK_END)) + ")"
)


def template_parts(text: str) -> list[PromptPart]:
    """Split trusted template text so its control-token strings become `Control` parts."""
    return [Control(piece) if i % 2 else piece for i, piece in enumerate(_TEMPLATE_CONTROLS.split(text)) if piece]


def tools_section(schema_lines: list[str], variant: str) -> list[PromptPart]:
    """The "## Tools" section listing one JSON schema per line."""
    ds4 = variant == "ds4"
    intro = _TOOLS_INTRO.format(
        asker="user" if ds4 else "user's",
        string_rule=_DS4_STRING_RULE if ds4 else _OFFICIAL_STRING_RULE,
    )
    return [*template_parts(intro), "\n".join(schema_lines), _DS4_OUTRO if ds4 else _OFFICIAL_OUTRO]
