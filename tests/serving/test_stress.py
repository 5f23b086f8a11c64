"""The stress test's quick seeded subset (issue 37; `nox -s stress` runs many seeds): mixed concurrent
traffic through the server on the bundled model (tests/serving/stress.py). Every completed reply is
the reply the same request gets alone, streamed or not, and every token prefix's logits are the same
bits wherever the server computed them (batched or alone, in any prefill split, forked, replayed)."""

from __future__ import annotations

from stress import run_seed, summary

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path


def test_concurrent_replies_are_the_replies_alone(tmp_path) -> None:
    engine = load_engine(EngineSpec(default_model_path(), "reference", ctx=4096))
    outcome = run_seed(engine, 0, clients=3, requests=2, max_tokens=8, out=tmp_path, command="seed 0")
    print(summary([outcome]))
    assert outcome.compared >= 8 and outcome.steps > 50
    assert outcome.recorder_mb[1] > outcome.recorder_mb[0]  # the traffic's steps are held, and counted
    assert not outcome.differing, "\n".join(outcome.differing)
    assert not outcome.conflicts, "\n".join(outcome.conflict_reports)
