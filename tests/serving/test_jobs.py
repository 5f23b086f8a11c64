"""A job's life cycle in the engine worker: queued, then prefill, then decode, then done, and from any
phase but done straight to done (failed or cancelled). Any other move raises and leaves the job as it
was; the worker walks a real request through exactly that cycle."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import openai
import pytest

from dwarfstar.sampling import SamplingParams
from dwarfstar.serving.generation import GenerationRequest
from dwarfstar.serving.jobs import KV, Decoding, IllegalTransition, Job, Phase

MODEL = "deepseek-v4-flash"
# the life cycle, written out: (phase, move) -> the phase it leads to; every other pair is illegal
ALLOWED = {
    ("queued", "admit"): "prefill",
    ("queued", "end"): "done",
    ("prefill", "start_decoding"): "decode",
    ("prefill", "end"): "done",
    ("decode", "end"): "done",
}
# the phases' data are opaque to the moves: stand-ins do
MOVES: dict[str, Callable[[Job], None]] = {
    "admit": lambda job: job.admit(KV(lease=object(), pending=[7])),
    "start_decoding": lambda job: job.start_decoding(Decoding(sampler=object(), decoder=object()), None),
    "end": lambda job: job.end(),
}
PATHS = {"queued": [], "prefill": ["admit"], "decode": ["admit", "start_decoding"], "done": ["end"]}


@pytest.fixture
def new_job() -> Iterator[Callable[[], Job]]:
    loop = asyncio.new_event_loop()
    request = GenerationRequest(prompt=None, prompt_ids=[1, 2, 3], max_tokens=4, sampling=SamplingParams())
    yield lambda: Job(request, loop, [])
    loop.close()


@pytest.mark.parametrize("start", PATHS)
@pytest.mark.parametrize("move", MOVES)
def test_each_move_is_allowed_or_raises(new_job, start, move):
    job = new_job()
    for step in PATHS[start]:
        MOVES[step](job)
    assert job.phase.value == start
    before = (job.phase, job.kv, job.decoding, job.drafting)
    if (start, move) in ALLOWED:
        MOVES[move](job)
        assert job.phase.value == ALLOWED[start, move]
    else:
        with pytest.raises(IllegalTransition, match=f"from {start} to"):
            MOVES[move](job)
        assert (job.phase, job.kv, job.decoding, job.drafting) == before


def test_the_phase_is_set_only_by_a_move(new_job):
    job = new_job()
    with pytest.raises(AttributeError):
        job.phase = Phase.DONE
    assert job.phase is Phase.QUEUED


def test_the_worker_walks_a_request_through_the_cycle(oai, monkeypatch):
    """A finished request and a failed one, each: prefill, decode, done (queued from the start)."""
    moves: list[tuple[int, str]] = []
    move = Job._move

    def spy(job: Job, to: Phase) -> None:
        move(job, to)
        moves.append((job.id, to.value))

    monkeypatch.setattr(Job, "_move", spy)
    for text, fails in (("Hi. [[script:hello]]", False), ("Break. [[fail]]", True)):
        moves.clear()
        failed = False
        try:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8)
        except openai.APIError as exc:
            failed = "generation failed" in str(exc)
        assert failed == fails
        assert len({job for job, _ in moves}) == 1
        assert [phase for _, phase in moves] == ["prefill", "decode", "done"]
