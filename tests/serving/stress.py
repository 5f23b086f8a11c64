"""Stress (issue 37): mixed concurrent traffic through the real server on the bundled model; every
completed greedy reply is compared with the same request run alone, and every token prefix's logits
with each other time the server computed them.

Traffic (`plan`, fixed by the seed): clients that each send requests in turn, chat completions,
Responses and Messages, streamed or not; most behind a shared ~1,400-token Italian prefix (the start
of I promessi sposi as the system prompt, tests/data/stress/prefix.txt), others short; tool requests
the model answers with a call, whose result then goes back; follow-up turns (the live session goes
on), the same request again (a rewind), other questions on the shared prefix (forks); streams the
client leaves mid-way. There are fewer live sessions than clients and a small prefill chunk, so
conversations are forked, cut back to checkpoints, evicted to the disk cache and restored from it.

Checks: the backend is wrapped by a `Recorder` (stress_record.py), which numbers every forward call
(a step) and keeps a digest of the logits each token prefix left: the same prefix must leave the
same bits every time (two requests, a fork and its parent, a replay from a checkpoint, the concurrent
and the lone run). Then every completed request runs again alone, streamed as it was and the other
way: its reply (text, tool calls, finish, error) must be the concurrent one. A difference is
reported with the seed, the first step whose logits differ, the batch at that step (slots,
positions, the slots sharing its row pages), and two commands: one runs the seed again, one replays
both steps from the tokens the recorder kept.

    python tests/serving/stress.py --seeds 0-9               # `nox -s stress` runs more
    python tests/serving/stress.py --seeds 7 --clients 6     # a seed again
    python tests/serving/stress.py --replay build/stress/seed7-conflict0.json
    TRITON_INTERPRET=1 python tests/serving/stress.py --backend triton --seeds 0 --clients 2 --requests 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # live_server, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import LiveServer, start_server  # noqa: E402
from stress_clients import APIS, Reply, first_body, next_body, send  # noqa: E402
from stress_record import Recorder, replay  # noqa: E402

from dwarfstar.engine.load import Engine, load_engine  # noqa: E402
from dwarfstar.engine.spec import EngineSpec  # noqa: E402
from dwarfstar.model.bundled import default_model_path  # noqa: E402
from dwarfstar.serving.config import ServerConfig  # noqa: E402

PREFIX = (Path(__file__).resolve().parents[1] / "data" / "stress" / "prefix.txt").read_text()
QUESTIONS = [
    "Chi è don Abbondio?",
    "Dove si trova il lago di Como?",
    "Riassumi il testo in una frase.",
    "Continua il racconto.",
    "Quel ramo del lago di Como",
    "Chi sono i bravi?",
    "Describe the lake in one sentence.",
    "Che cosa fa don Abbondio la sera?",
]
TOOL_ASKS = [
    "leggi il file `capitoli/lago.txt`",
    "please read the file `notes/abbondio.md`",
    "elenca i file in `lettere`",
    "please list the files in `docs`",
    'per favore cerca "don abbondio"',
    'please search for "lago"',
]
TOOL_RESULT = "Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti."
KINDS = ("plain", "plain", "prefix", "prefix", "prefix", "tools", "followup", "again", "cut")


@dataclass
class Sent:
    """One request of the concurrent phase, as sent, and what came back (None: the client left)."""

    name: str  # client#n
    kind: str
    api: str
    stream: bool
    body: dict
    reply: Reply | None
    seconds: float


@dataclass
class Outcome:
    seed: int
    compared: int = 0  # replies compared with a lone run (each lone run counts once)
    differing: list[str] = field(default_factory=list)  # reports of replies that differ
    conflicts: int = 0  # prefixes whose logits differ between two steps
    flips: int = 0  # of those, where the best token differs
    moved: float = 0.0  # the most the best token's logit moved where it did not flip
    conflict_reports: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    rss_mb: tuple[float, float] = (0.0, 0.0)  # the process, before and after the seed's traffic
    recorder_mb: tuple[float, float] = (0.0, 0.0)  # of which the recorder's own records
    steps: int = 0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- traffic --------------------------------------------------------------------------------------------
def run_client(
    http: httpx.Client, rng: random.Random, name: str, requests: int, max_tokens: int, prefix: str | None
) -> list[Sent]:
    """One client's requests, one after the other; the seed's `rng` picks each (`prefix`: the shared
    system prompt, None for short prompts only)."""
    sent: list[Sent] = []
    last: Sent | None = None

    def go(kind: str, api: str, stream: bool, body: dict, cut: int | None = None) -> Sent:
        start = time.perf_counter()
        reply = send(http, api, body, stream, cut)
        item = Sent(f"{name}#{len(sent)}", kind, api, stream, body, reply, time.perf_counter() - start)
        sent.append(item)
        return item

    for _ in range(requests):
        kind, api, stream = rng.choice(KINDS), rng.choice(APIS), rng.random() < 0.5
        tokens = rng.randint(max(2, max_tokens // 3), max_tokens)
        system = prefix if kind != "plain" and rng.random() < 0.8 else None
        usable = last is not None and last.reply is not None and not last.reply.error
        if kind == "followup" and usable and not last.reply.calls:
            last = go(kind, last.api, stream, next_body(last.api, last.body, last.reply, rng.choice(QUESTIONS), None))
        elif kind == "again" and last is not None:
            last = go(kind, last.api, stream, last.body)
        elif kind == "tools":
            # some calls fit, some are cut by max_tokens (a call of one short argument is about 45 tokens)
            body = first_body(api, system, rng.choice(TOOL_ASKS), True, rng.choice([max_tokens, 64]))
            last = go(kind, api, stream, body)
            if last.reply is not None and last.reply.calls and not last.reply.error:
                answer = next_body(api, body, last.reply, None, TOOL_RESULT)
                last = go("tool result", api, stream, answer)
        elif kind == "cut":
            go(kind, api, True, first_body(api, system, rng.choice(QUESTIONS), False, tokens), cut=rng.randint(1, 6))
        else:
            last = go(kind, api, stream, first_body(api, system, rng.choice(QUESTIONS), False, tokens))
    return sent


def config(disk: Path) -> ServerConfig:
    """Fewer live sessions than clients, a chunk well under the shared prefix, a disk cache that keeps
    what is evicted: forks, checkpoints, evictions and restores all happen."""
    return ServerConfig(
        ctx=4096, think_by_default=False, max_sessions=3, max_queue=64, prefill_chunk=256,
        kv_disk_dir=disk, kv_cache_min_tokens=256, kv_disk_space_mb=512, kv_memory_mb=0,
    )  # fmt: skip


@contextmanager
def serving(engine: Engine) -> Iterator[tuple[LiveServer, Recorder]]:
    """A live server over the engine's backend wrapped in a recorder, with a fresh disk cache."""
    recorder = Recorder(engine.backend)
    with tempfile.TemporaryDirectory() as disk:
        server = start_server(replace(engine, backend=recorder), config(Path(disk)))
        try:
            yield next(server), recorder
        finally:
            server.close()


def run_seed(
    engine: Engine,
    seed: int,
    clients: int,
    requests: int,
    max_tokens: int,
    out: Path,
    command: str,
    prefix: str | None = PREFIX,
    served: tuple[LiveServer, Recorder] | None = None,
) -> Outcome:
    """One seed's traffic, then each request alone; on a server of its own unless `served`."""
    if served is None:
        with serving(engine) as served:
            return run_seed(engine, seed, clients, requests, max_tokens, out, command, prefix, served)
    live, recorder = served
    outcome, steps, known = Outcome(seed), len(recorder.steps), len(recorder.conflicts)
    with httpx.Client(base_url=live.base_url, timeout=3600) as http:
        outcome.rss_mb, outcome.recorder_mb = (rss_mb(), 0.0), (recorder.held_mb(), 0.0)
        with ThreadPoolExecutor(clients) as pool:
            rngs = [random.Random(seed * 1000 + c) for c in range(clients)]
            jobs = [
                pool.submit(run_client, http, rngs[c], f"c{c}", requests, max_tokens, prefix) for c in range(clients)
            ]
            sent = [item for job in jobs for item in job.result()]
        outcome.rss_mb, outcome.recorder_mb = (
            (outcome.rss_mb[0], rss_mb()),
            (outcome.recorder_mb[0], recorder.held_mb()),
        )
        drained(live)  # the streams clients left may still be winding down: alone means alone
        outcome.latencies = [s.seconds for s in sent if s.reply is not None]
        for item in sent:
            if item.reply is not None:
                compare_alone(http, recorder, item, outcome, command)
    conflicts = recorder.conflicts[known:]
    outcome.steps, outcome.conflicts = len(recorder.steps) - steps, len(conflicts)
    outcome.flips = sum(c.flipped for c in conflicts)
    outcome.moved = max((c.gap for c in conflicts), default=0.0)
    worst = sorted(conflicts, key=lambda c: (c.flipped, c.gap), reverse=True)
    for n, conflict in enumerate(worst[:3]):  # the best token flipped, or moved furthest
        path = out / f"seed{seed}-conflict{n}.json"
        recorder.dump(conflict, path, command)
        first, second = recorder.entry(conflict.first), recorder.entry(conflict.second)
        outcome.conflict_reports.append(
            f"prefix of {first.pos + first.added} tokens: top {first.top} then {second.top}\n"
            f"  {recorder.steps[conflict.first[0]].describe(conflict.first[1])}\n"
            f"  {recorder.steps[conflict.second[0]].describe(conflict.second[1])}\n"
            f"  replay both steps: python tests/serving/stress.py --replay {path}"
        )
    return outcome


def drained(live) -> None:
    deadline = time.monotonic() + 600
    while live.metric("dwarfstar_active_requests") or live.metric("dwarfstar_queue_depth"):
        assert time.monotonic() < deadline, "the server did not finish its requests"
        time.sleep(0.05)


def compare_alone(http: httpx.Client, recorder: Recorder, item: Sent, outcome: Outcome, command: str) -> None:
    """The request alone, as it was sent and with the other stream setting: each reply must be the
    concurrent one."""
    for stream in (item.stream, not item.stream):
        recorder.phase = f"alone {item.name}{' streamed' if stream else ''}"
        reply = send(http, item.api, item.body, stream)
        outcome.compared += 1
        if reply.key() == item.reply.key():
            continue
        lines = [
            f"seed {outcome.seed}: {item.name} ({item.kind}, {item.api}{' streamed' if item.stream else ''}) "
            f"run alone{' streamed' if stream else ''} differs",
            f"  concurrent: {item.reply.key()}",
            f"  alone:      {reply.key()}",
        ]
        lines.append(first_difference(recorder, recorder.phase))
        lines.append(f"  run the seed again: {command}")
        outcome.differing.append("\n".join(lines))


def first_difference(recorder: Recorder, phase: str) -> str:
    """Where the lone run's numbers first left the concurrent run's: the first prefix it computed that
    an earlier step had left with other logits."""
    conflicts = {c.key: c for c in recorder.conflicts}
    for key in recorder.keys_by_phase.get(phase, []):
        if key in conflicts:
            c = conflicts[key]
            first = recorder.entry(c.first)
            return (
                f"  first logits that differ: a prefix of {first.pos + first.added} tokens, top {first.top} "
                f"then {recorder.entry(c.second).top}\n"
                f"  {recorder.steps[c.first[0]].describe(c.first[1])}\n"
                f"  {recorder.steps[c.second[0]].describe(c.second[1])}"
            )
    return "  every prefix the lone run computed got the same logits before: not the model's numbers"


# -- command line -----------------------------------------------------------------------------------------
def seeds_of(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def summary(outcomes: list[Outcome]) -> str:
    latencies = sorted(x for o in outcomes for x in o.latencies)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] if latencies else 0.0
    differing = sum(len(o.differing) for o in outcomes)
    lines = [
        f"seed {o.seed}: {o.compared} lone runs compared, {len(o.differing)} differ; {o.steps} steps, "
        f"{o.conflicts} prefixes with differing logits ({o.flips} with another best token, the best logit "
        f"moved {o.moved:.2g} at most otherwise); RSS {o.rss_mb[0]:.0f} -> {o.rss_mb[1]:.0f} MB, "
        f"of which the recorder's records {o.recorder_mb[0]:.1f} -> {o.recorder_mb[1]:.1f} MB"
        for o in outcomes
    ]
    lines.append(
        f"all: {sum(o.compared for o in outcomes)} compared, {differing} differ "
        f"(seeds {[o.seed for o in outcomes if o.differing]}), "
        f"{sum(o.conflicts for o in outcomes)} prefixes with differing logits "
        f"(seeds {[o.seed for o in outcomes if o.conflicts]}); concurrent latency p50 "
        f"{statistics.median(latencies) if latencies else 0:.2f} s, p99 {p99:.2f} s"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="e.g. 0-9 or 3,7")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--no-prefix", action="store_true", help="short prompts only (Triton's interpreter)")
    parser.add_argument("--same-server", action="store_true", help="every seed on one server: a long run")
    parser.add_argument("--minutes", type=float, help="start no seed after this many minutes (a timed soak)")
    parser.add_argument("--out", type=Path, default=Path("build/stress"))
    parser.add_argument("--replay", type=Path, help="run both steps of a dumped conflict again")
    parser.add_argument("--bits", action=argparse.BooleanOptionalAction, default=None,
                        help="fail on differing logits too (default: on the reference backend)")  # fmt: skip
    args = parser.parse_args()
    engine = load_engine(EngineSpec(default_model_path(), args.backend, ctx=4096))
    if args.replay:
        print(replay(engine.backend, config(Path()).prefill_chunk, args.replay))
        return
    outcomes, stack = [], ExitStack()
    served = stack.enter_context(serving(engine)) if args.same_server else None
    start = time.monotonic()
    for seed in seeds_of(args.seeds):
        if args.minutes is not None and time.monotonic() - start >= 60 * args.minutes:
            break
        command = (  # on one server a seed's traffic follows the seeds before it: run them all again
            f"python tests/serving/stress.py --seeds {args.seeds if args.same_server else seed} "
            f"--clients {args.clients} --requests {args.requests} --max-tokens {args.max_tokens} "
            f"--backend {args.backend}{' --no-prefix' if args.no_prefix else ''}"
            f"{' --same-server' if args.same_server else ''}"
        )
        prefix = None if args.no_prefix else PREFIX
        outcome = run_seed(
            engine, seed, args.clients, args.requests, args.max_tokens, args.out, command, prefix, served
        )
        for report in outcome.differing + outcome.conflict_reports:
            print(report, flush=True)
        print(summary([outcome]).splitlines()[0], flush=True)
        outcomes.append(outcome)
    stack.close()
    print(summary(outcomes))
    print(f"{len(outcomes)} seeds in {(time.monotonic() - start) / 60:.1f} minutes")
    bits = args.backend == "reference" if args.bits is None else args.bits
    if any(o.differing or (bits and o.conflicts) for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
