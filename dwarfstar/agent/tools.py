"""The agent's tools: their schemas (rendered into its system prompt) and the dispatch of a call.

A call's arguments arrive typed by DSML's `string=` flag; each is checked against the schema here,
so a wrong name or type is a tool error the model can read and fix, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dwarfstar.agent.files import ToolError, Workspace
from dwarfstar.agent.shell import Jobs
from dwarfstar.prompt.images import ImagePart


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _p(kind: str, description: str) -> dict[str, str]:
    return {"type": kind, "description": description}


_JOB = {
    "job": _p("integer", "Job number from bash."),
    "pid": _p("integer", "Process id, instead of job."),
    "refresh_sec": _p("number", "Seconds to wait for it to finish before reporting."),
}

TOOLS: list[dict[str, Any]] = [
    _tool(
        "bash",
        "Run a bash command in the workspace. Output is truncated to its head and tail. A command still "
        "running after timeout_sec continues as a background job.",
        {
            "command": _p("string", "The command line."),
            "timeout_sec": _p("number", "Seconds to wait before it goes to the background (default 30)."),
            "refresh_sec": _p("number", "Seconds between progress reports while it runs (default 5)."),
        },
        ["command"],
    ),
    _tool("bash_status", "Report a background job's state and new output.", dict(_JOB), []),
    _tool("bash_stop", "Stop a background job (SIGTERM, then SIGKILL).", dict(_JOB), []),
    _tool(
        "read",
        "Read a text file with line numbers, 500 lines from start_line by default; reports a continue_offset.",
        {
            "path": _p("string", "File path, relative to the workspace."),
            "start_line": _p("integer", "First line, 1-based (default 1)."),
            "max_lines": _p("integer", "Lines to show (default 500)."),
            "whole": _p("boolean", "Show the whole file."),
            "raw": _p("boolean", "Without line numbers."),
        },
        ["path"],
    ),
    _tool("more", "Continue the last read.", {"count": _p("integer", "Lines to show.")}, []),
    _tool(
        "write",
        "Create or overwrite a file.",
        {"path": _p("string", "File path."), "content": _p("string", "The whole new content.")},
        ["path", "content"],
    ),
    _tool(
        "edit",
        "Replace lines you were shown: line, start_line+end_line, or range 'A:B' or 'all', with new. "
        "Or replace the exact text old (occurring once) with new.",
        {
            "path": _p("string", "File path."),
            "new": _p("string", "Replacement text."),
            "line": _p("integer", "One line to replace."),
            "start_line": _p("integer", "First line to replace."),
            "end_line": _p("integer", "Last line to replace."),
            "range": _p("string", "'A:B' or 'all'."),
            "old": _p("string", "Exact text to replace, instead of lines."),
        },
        ["path", "new"],
    ),
    _tool(
        "search",
        "Search file contents (ripgrep when installed).",
        {
            "query": _p("string", "Text or regex."),
            "path": _p("string", "File or directory (default the workspace)."),
            "mode": _p("string", "literal (default) or regex."),
            "glob": _p("string", "Only files matching this glob."),
            "context": _p("integer", "Lines of context around each match."),
            "max_results": _p("integer", "Most matches to show (default 50)."),
            "case_sensitive": _p("boolean", "Match case (default false)."),
        },
        ["query"],
    ),
    _tool("list", "List a directory.", {"path": _p("string", "Directory (default the workspace).")}, []),
]
# offered only with a vision encoder (`--vision`): the image comes back in the tool result, for the model to see
VIEW_IMAGE = _tool(
    "view_image",
    "Look at an image file (PNG, JPEG, WebP or GIF): it is shown to you in the tool result.",
    {"path": _p("string", "Image file path, relative to the workspace.")},
    ["path"],
)

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
_PYTHON_NAMES = {"range": "line_range"}  # a schema name that would shadow a Python builtin


@dataclass(frozen=True)
class ToolOutcome:
    text: str
    error: bool
    image: ImagePart | None = None  # view_image's image, which the model sees after `text`


class Toolbox:
    """The tools the model may call; `vision`: with view_image (the agent has a vision encoder)."""

    def __init__(self, workspace: Workspace, vision: bool = False) -> None:
        self.workspace, self.vision = workspace, vision
        self.tools = [*TOOLS, VIEW_IMAGE] if vision else TOOLS
        self.jobs = Jobs(workspace.root)
        w, j = workspace, self.jobs
        self._handlers: dict[str, Callable[..., str | ToolOutcome]] = {
            "bash": j.run,
            "bash_status": j.status,
            "bash_stop": j.stop,
            "read": w.read,
            "more": w.more,
            "write": w.write,
            "edit": w.edit,
            "search": w.search,
            "list": w.list,
            "view_image": self._view_image,
        }
        self._schemas = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}

    def _view_image(self, path: str) -> ToolOutcome:
        text, image = self.workspace.image(path)
        return ToolOutcome(text, False, image)

    def call(
        self,
        name: str,
        arguments: Mapping[str, Any],
        should_stop: Callable[[], bool] = lambda: False,
        progress: Callable[[str], None] | None = None,
    ) -> ToolOutcome:
        try:
            kwargs = self._checked(name, arguments)
            if name == "bash":
                kwargs.update(should_stop=should_stop, progress=progress)
            result = self._handlers[name](**kwargs)
            return result if isinstance(result, ToolOutcome) else ToolOutcome(result, False)
        except ToolError as exc:
            return ToolOutcome(f"error: {exc}", True)
        except OSError as exc:
            return ToolOutcome(f"error: {exc}", True)

    def _checked(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        schema = self._schemas.get(name)
        if schema is None and name == VIEW_IMAGE["function"]["name"]:
            raise ToolError("view_image is not available: the agent runs without a vision encoder (--vision)")
        if schema is None:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(self._schemas)}")
        props = schema["properties"]
        out = {}
        for key, value in arguments.items():
            if key not in props:
                raise ToolError(f"{name} has no parameter {key!r}; it takes {', '.join(props)}")
            kind = props[key]["type"]
            if kind == "integer" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
                value = int(value)  # a number sent with string="true"
            if not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
                raise ToolError(f"{name}.{key} must be {kind}, got {type(value).__name__}")
            out[_PYTHON_NAMES.get(key, key)] = value
        missing = [k for k in schema["required"] if k not in arguments]
        if missing:
            raise ToolError(f"{name} needs {', '.join(missing)}")
        return out

    def close(self) -> None:
        self.jobs.close()
