"""DeepSeek V4 prompts: the official `encoding_dsv4` renderer and the streaming DSML tool-call parser."""

from dwarfstar.prompt.conversation import PromptError
from dwarfstar.prompt.dsml import ToolCall
from dwarfstar.prompt.dsml_parser import DsmlParser, ParsedCompletion, ParsedToolCall, parse_completion
from dwarfstar.prompt.render import Prompt, render_conversation
from dwarfstar.prompt.render_options import DS4, OFFICIAL, RenderOptions

__all__ = [
    "DS4",
    "OFFICIAL",
    "DsmlParser",
    "ParsedCompletion",
    "ParsedToolCall",
    "Prompt",
    "PromptError",
    "RenderOptions",
    "ToolCall",
    "parse_completion",
    "render_conversation",
]
