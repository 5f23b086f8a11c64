"""Soak: parallel clients mixing chat, Responses and Messages, streaming and not, tool round trips,
disconnects mid-stream and shared prefixes, on the tiny model. At temperature 0 every completed
answer equals the same request run alone; afterwards no job is left, every session is back in the
pool, and the server's RSS grew by less than RSS_BOUND_MB. Prints the latencies.

The suite runs 3 clients x 4 requests; `nox -s reliability` runs DWARFSTAR_SOAK_CLIENTS=10 x
DWARFSTAR_SOAK_REQUESTS=50 (the issue's figures).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import anthropic
import openai
import pytest
from serving_conftest import API_KEY, BASE_CONFIG, SCRIPTS, TOOLS, ScriptedBackend, start_server

CLIENTS = int(os.environ.get("DWARFSTAR_SOAK_CLIENTS", "3"))
REQUESTS = int(os.environ.get("DWARFSTAR_SOAK_REQUESTS", "4"))
RSS_BOUND_MB = 300  # the tiny model's sessions hold about 1 MB each; growth beyond this is a leak
MODEL = "deepseek-v4-flash"
SYSTEM = "You are a careful assistant for a soak test. Answer briefly."  # the shared prefix
TOPICS = ["the lake", "the mountains", "the river", "the town", "the bridge", "the castle"]
KINDS = ["chat", "chat stream", "responses", "responses stream", "messages", "messages stream", "tools", "cut"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Clients:
    def __init__(self, base_url: str) -> None:
        self.oai = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        self.claude = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=300)

    def run(self, kind: str, topic: str) -> str | None:
        """The answer text of one request (None for a stream the client walks away from)."""
        user = f"Tell me about {topic}."
        nothink = {"thinking": {"type": "disabled"}}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        if kind == "chat":
            reply = self.oai.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=12, extra_body=nothink
            )
            return reply.choices[0].message.content
        if kind in ("chat stream", "cut"):
            stream = self.oai.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=12, extra_body=nothink, stream=True
            )
            if kind == "cut":  # a client that disconnects mid-stream
                next(iter(stream))
                stream.close()
                return None
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        if kind.startswith("responses"):
            request = dict(
                model=MODEL, instructions=SYSTEM, input=user, temperature=0, max_output_tokens=12,
                reasoning={"effort": "none"},
            )  # fmt: skip
            if kind == "responses":
                return self.oai.responses.create(**request).output_text
            events = self.oai.responses.create(**request, stream=True)
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")
        if kind.startswith("messages"):
            request = dict(
                model=MODEL, system=SYSTEM, max_tokens=12, messages=[{"role": "user", "content": user}],
                extra_body={"temperature": 0, "thinking": {"type": "disabled"}},  # fields this SDK lacks
            )  # fmt: skip
            if kind == "messages":
                return "".join(block.text for block in self.claude.messages.create(**request).content)
            with self.claude.messages.stream(**request) as stream:
                return stream.get_final_text()
        # a tool round trip: the scripted call, its result sent back, the model's answer to it
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{user} [[script:weather]]"}]
        first = self.oai.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=0, extra_body=nothink
        )
        (call,) = first.choices[0].message.tool_calls
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": f"Sunny over {topic}"},
        ]
        second = self.oai.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=12, extra_body=nothink
        )
        return call.function.arguments + "|" + (second.choices[0].message.content or "")


@pytest.fixture(scope="module")
def soak_server(tiny_engine):
    scripted = replace(tiny_engine, backend=ScriptedBackend(tiny_engine.backend, tiny_engine.tokenizer, SCRIPTS))
    yield from start_server(scripted, replace(BASE_CONFIG, ctx=1024, max_sessions=4, max_queue=64))


def test_soak(soak_server):
    clients = Clients(soak_server.base_url)
    cases = [(kind, topic) for kind in KINDS for topic in TOPICS]
    rng = random.Random(0)
    plans = [[rng.choice(cases) for _ in range(REQUESTS)] for _ in range(CLIENTS)]
    alone = {case: clients.run(*case) for case in sorted({c for plan in plans for c in plan}) if case[0] != "cut"}
    rss_before = rss_mb()

    def client(plan):
        done = []
        for case in plan:
            start = time.perf_counter()
            done.append((case, clients.run(*case), time.perf_counter() - start))
        return done

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [r for rs in pool.map(client, plans) for r in rs]

    assert len(results) == CLIENTS * REQUESTS  # none lost
    garbled = [(case, text) for case, text, _ in results if case[0] != "cut" and text != alone[case]]
    assert not garbled
    deadline = time.monotonic() + 30
    while soak_server.metric("dwarfstar_active_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert soak_server.metric("dwarfstar_active_requests") == 0 and soak_server.metric("dwarfstar_queue_depth") == 0
    pool = soak_server.service.pool
    assert len(pool.live) <= pool.max_sessions and not any(live.busy for live in pool.live)
    growth = rss_mb() - rss_before
    assert growth < RSS_BOUND_MB
    latencies = sorted(seconds for case, _, seconds in results if case[0] != "cut")
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    cut = sum(case[0] == "cut" for case, _, _ in results)
    print(
        f"soak: {CLIENTS} clients x {REQUESTS} requests: {len(results)} done, 0 lost, 0 garbled, {cut} cut mid-stream;"
        f" latency p50 {statistics.median(latencies) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms;"
        f" RSS {rss_before:.0f} -> {rss_mb():.0f} MB (+{growth:.0f}, bound {RSS_BOUND_MB})"
    )
