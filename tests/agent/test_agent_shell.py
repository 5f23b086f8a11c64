"""The bash tool: head+tail truncation, exit status, cwd, background jobs, status and stop."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dwarfstar.agent.files import ToolError
from dwarfstar.agent.shell import HEAD_BYTES, HEAD_LINES, TAIL_BYTES, Jobs, truncate_output


def test_truncation_keeps_head_and_tail() -> None:
    short = "a\n" * 50
    assert truncate_output(short) == short
    many_lines = "".join(f"{n}\n" for n in range(100000))
    cut = truncate_output(many_lines)
    head, _, tail = cut.partition("\n[... ")
    assert head.splitlines() == [str(n) for n in range(HEAD_LINES)]
    omitted = int(tail.split(" bytes omitted")[0])
    assert len(head.encode()) + omitted + len(tail.split("...]\n", 1)[1].encode()) == len(many_lines.encode())
    assert tail.endswith("99999\n") and len(tail.split("...]\n", 1)[1].encode()) == TAIL_BYTES
    one_long_line = "x" * (HEAD_BYTES + TAIL_BYTES + 10)
    cut = truncate_output(one_long_line)
    assert cut.startswith("x" * HEAD_BYTES + "\n[... 10 bytes omitted ...]\n")


@pytest.fixture
def jobs(tmp_path: Path):
    j = Jobs(tmp_path)
    yield j
    j.close()


def test_runs_in_the_workspace_with_status(jobs: Jobs, tmp_path: Path) -> None:
    done = jobs.run("pwd; echo err >&2; exit 3")
    first, *rest = done.splitlines()
    assert "exited with status 3" in first
    assert rest == [str(tmp_path), "err"]
    with pytest.raises(ToolError, match="non-empty"):
        jobs.run("  ")


def test_a_slow_command_continues_in_the_background(jobs: Jobs, tmp_path: Path) -> None:
    progress: list[str] = []
    started = jobs.run("echo begun; sleep 0.6; echo finished > done.txt; echo end", timeout_sec=0.3, refresh_sec=0.1,
                       progress=progress.append)  # fmt: skip
    assert "job 1" in started and "still running after 0.3s" in started and "begun" in started
    assert progress and progress[-1].strip() == "begun"
    assert not (tmp_path / "done.txt").exists()
    final = jobs.status(job=1, refresh_sec=5)
    assert "exited with status 0" in final
    assert final.splitlines()[1:] == ["end"]  # only what was not reported yet
    assert (tmp_path / "done.txt").read_text() == "finished\n"
    assert "(no new output)" in jobs.status(job=1)


def test_stop_ends_the_whole_process_group(jobs: Jobs, tmp_path: Path) -> None:
    started = jobs.run("(sleep 1; echo late > late.txt) & echo child; wait", timeout_sec=0.2)
    pid = int(started.split("pid ")[1].split(")")[0])
    stopped = jobs.stop(pid=pid)
    assert "stopped: job 1" in stopped and "exited with status" in stopped
    time.sleep(1.5)
    assert not (tmp_path / "late.txt").exists()  # the background child went with its group
    with pytest.raises(ToolError, match="no job 7"):
        jobs.status(job=7)


def test_an_interrupt_sends_the_command_to_the_background(jobs: Jobs) -> None:
    result = jobs.run("sleep 5", timeout_sec=30, should_stop=lambda: True)
    assert "interrupted by the user" in result and "continues in the background" in result
