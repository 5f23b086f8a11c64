"""The `bash` tool and its background jobs.

A command runs in its own process group with the workspace as cwd. It gets `timeout_sec` to
finish; after that it keeps running as a background job (a build or a test run must not be killed
just because it is slow), and the model follows it with `bash_status` or ends it with `bash_stop`.
While a command runs, `progress` is told its latest output every `refresh_sec`. Results keep the
head and the tail of the output: an error is usually at one end of a long log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dwarfstar.agent.files import ToolError

HEAD_BYTES = 8 << 10
HEAD_LINES = 100
TAIL_BYTES = 32 << 10
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_REFRESH_S = 5.0
STOP_GRACE_S = 2.0  # SIGTERM first; SIGKILL the group after this
POLL_S = 0.05


def truncate_output(text: str) -> str:
    """Head (at most HEAD_LINES lines and HEAD_BYTES) and tail (TAIL_BYTES) of `text`, with the gap marked."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= HEAD_BYTES + TAIL_BYTES:
        lines = text.split("\n")
        if len(lines) <= HEAD_LINES or len(data) <= TAIL_BYTES:
            return text
    head = data[:HEAD_BYTES]
    cut = _nth_newline(head, HEAD_LINES)
    head = head[:cut] if cut is not None else head
    tail = data[max(len(head), len(data) - TAIL_BYTES) :]
    omitted = len(data) - len(head) - len(tail)
    if omitted <= 0:
        return text
    return (
        head.decode("utf-8", errors="ignore")
        + f"\n[... {omitted} bytes omitted ...]\n"
        + tail.decode("utf-8", errors="ignore")
    )


def _nth_newline(data: bytes, n: int) -> int | None:
    at = -1
    for _ in range(n):
        at = data.find(b"\n", at + 1)
        if at < 0:
            return None
    return at + 1


@dataclass
class Job:
    number: int
    command: str
    process: subprocess.Popen
    started: float
    output: bytearray = field(default_factory=bytearray)
    reported: int = 0  # bytes of output already returned to the model
    lock: threading.Lock = field(default_factory=threading.Lock)

    def text(self, start: int = 0) -> str:
        with self.lock:
            return bytes(self.output[start:]).decode("utf-8", errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def describe(self) -> str:
        code = self.returncode
        state = "running" if code is None else f"exited with status {code}"
        return f"job {self.number} (pid {self.process.pid}) {state} after {time.monotonic() - self.started:.1f}s"


class Jobs:
    """The commands the agent started; those still running after their timeout are background jobs."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.jobs: dict[int, Job] = {}

    def run(
        self,
        command: str,
        timeout_sec: float = DEFAULT_TIMEOUT_S,
        refresh_sec: float = DEFAULT_REFRESH_S,
        should_stop: Callable[[], bool] = lambda: False,
        progress: Callable[[str], None] | None = None,
    ) -> str:
        if not isinstance(command, str) or not command.strip():
            raise ToolError("command must be a non-empty string")
        job = self._start(command)
        finished = self._wait(job, float(timeout_sec), float(refresh_sec), should_stop, progress)
        if finished:
            return self._report(job)
        why = "interrupted by the user" if should_stop() else f"still running after {timeout_sec:g}s"
        return (
            f"{job.describe()}: {why}; it continues in the background (bash_status / bash_stop)\n"
            + self._new_output(job)
        )

    def status(self, job: int | None = None, pid: int | None = None, refresh_sec: float = 0.0) -> str:
        target = self._find(job, pid)
        self._wait(target, float(refresh_sec), float(refresh_sec), lambda: False, None)
        if target.returncode is not None:
            return self._report(target)
        return f"{target.describe()}\n" + self._new_output(target)

    def stop(self, job: int | None = None, pid: int | None = None, refresh_sec: float = STOP_GRACE_S) -> str:
        target = self._find(job, pid)
        if target.returncode is None:
            _signal_group(target.process, signal.SIGTERM)
            if not self._wait(target, float(refresh_sec), float(refresh_sec), lambda: False, None):
                _signal_group(target.process, signal.SIGKILL)
                target.process.wait()
        return f"stopped: {self._report(target)}"

    def close(self) -> None:
        for job in self.jobs.values():
            if job.returncode is None:
                _signal_group(job.process, signal.SIGKILL)
                job.process.wait()

    # -- internals ------------------------------------------------------------------------------
    def _start(self, command: str) -> Job:
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so bash_stop reaches its children
        )
        job = Job(len(self.jobs) + 1, command, process, time.monotonic())
        self.jobs[job.number] = job
        threading.Thread(target=_drain, args=(job,), daemon=True, name=f"job-{job.number}").start()
        return job

    def _wait(self, job: Job, timeout: float, refresh: float, should_stop, progress) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        next_report = time.monotonic() + max(refresh, POLL_S)
        while job.returncode is None:
            now = time.monotonic()
            if now >= deadline or should_stop():
                return False
            if progress is not None and now >= next_report:
                progress(job.text()[-200:])
                next_report = now + max(refresh, POLL_S)
            time.sleep(POLL_S)
        job.process.wait()
        _reader_done(job)
        return True

    def _report(self, job: Job) -> str:
        return f"{job.describe()}\n" + self._new_output(job)

    def _new_output(self, job: Job) -> str:
        with job.lock:
            start, job.reported = job.reported, len(job.output)
        text = job.text(start)
        return truncate_output(text) if text else "(no new output)"

    def _find(self, job: int | None, pid: int | None) -> Job:
        for candidate in self.jobs.values():
            if (job is not None and candidate.number == job) or (pid is not None and candidate.process.pid == pid):
                return candidate
        known = ", ".join(f"{j.number} (pid {j.process.pid})" for j in self.jobs.values()) or "none"
        raise ToolError(f"no job {job if job is not None else f'with pid {pid}'}; jobs: {known}")


def _drain(job: Job) -> None:
    stream = job.process.stdout
    while chunk := stream.read1(65536):
        with job.lock:
            job.output += chunk
    stream.close()


def _reader_done(job: Job) -> None:
    """Wait (briefly) for the reader to take the last bytes a finished process wrote."""
    deadline = time.monotonic() + 1.0
    while not job.process.stdout.closed and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
