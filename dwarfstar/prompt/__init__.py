"""DeepSeek V4 prompts: the official `encoding_dsv4` renderer and the streaming DSML tool-call parser."""

from dwarfstar.prompt.conversation import PromptError
from dwarfstar.prompt.dsml import ToolCall
from dwarfstar.prompt.options import DS4, OFFICIAL, RenderOptions
from dwarfstar.prompt.render import Prompt, render_conversation

__all__ = ["DS4", "OFFICIAL", "Prompt", "PromptError", "RenderOptions", "ToolCall", "render_conversation"]
