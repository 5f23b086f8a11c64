"""Pipelined prefill: up to `window` chunks of one sequence in flight along the route.

A relay thread per worker sends each chunk to its stage and passes the reply to the next stage's
thread, so stage k+1 runs chunk i while stage k runs chunk i+1 and the coordinator's own layers run
chunk i+2. Chunks of one sequence reach every stage in order (one thread per link, FIFO queues),
which the KV state needs. The coordinator advances its own layers chunk by chunk; if any stage fails,
the threads are stopped and joined, the state returns to where it was and is marked for replay.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from dwarfstar.distributed.protocol import FLAG_LOGITS, DistError
from dwarfstar.distributed.route import RemoteStage, Route
from dwarfstar.distributed.route_state import RouteState

_STOP = None  # sentinel down the relay queues


@dataclass
class _Failed:
    error: BaseException


def pipelined_prefill(route: Route, state: RouteState, tokens: torch.Tensor, all_logits: bool) -> list[torch.Tensor]:
    """Each chunk's logits ([chunk, vocab] with all_logits, else [1, vocab]); the state advanced."""
    step, window = route.options.prefill_chunk, route.options.prefill_window
    chunks = [tokens[at : at + step] for at in range(0, tokens.numel(), step)]
    stages = list(route.stages)
    inboxes: list[queue.Queue] = [queue.Queue() for _ in stages]
    done: queue.Queue = queue.Queue()
    threads = [
        threading.Thread(target=_relay, args=(route, stages, inboxes, done, k), daemon=True) for k in range(len(stages))
    ]
    for t in threads:
        t.start()
    pos, history = state.pos, list(state.tokens)
    results: list[torch.Tensor] = []
    try:
        for i, chunk in enumerate(chunks):
            if i >= window:
                results.append(_take(route, done, all_logits, len(chunks[len(results)])))
            batch = route.local.batch([chunk], [state])
            msg, _ = route.first_hop(batch, all_logits)
            route.local.advance(batch)  # the coordinator's layers now hold the chunk
            inboxes[0].put(msg)
        inboxes[0].put(_STOP)
        while len(results) < len(chunks):
            results.append(_take(route, done, all_logits, len(chunks[len(results)])))
    except BaseException:
        inboxes[0].put(_STOP)
        for t in threads:
            t.join(timeout=route.options.timeout_s)
        state.pos, state.tokens, state.dirty, state.gathered = pos, history, True, None
        state.reset_hash()
        raise
    for t in threads:
        t.join(timeout=route.options.timeout_s)
    state.logits = results[-1][-1].to(route.local_device).clone()
    return results


def _relay(route: Route, stages: list[RemoteStage], inboxes: list[queue.Queue], done: queue.Queue, k: int) -> None:
    last = k + 1 == len(stages)
    while True:
        msg = inboxes[k].get()
        if msg is _STOP:
            if not last:
                inboxes[k + 1].put(_STOP)
            return
        try:
            reply, hop = route.relay(stages[k], msg)
        except BaseException as exc:  # noqa: BLE001 - handed to the coordinator's thread
            done.put(_Failed(exc))
            if not last:
                inboxes[k + 1].put(_STOP)
            return
        if route.options.debug:
            route.log(hop.line())
        if reply.header.flags & FLAG_LOGITS:
            done.put(reply)
        elif last:
            done.put(_Failed(DistError(f"the last stage {stages[k].layers} returned no logits")))
            return
        else:
            inboxes[k + 1].put(route.next_message(msg, reply))


def _take(route: Route, done: queue.Queue, all_logits: bool, n_rows: int) -> torch.Tensor:
    try:
        item = done.get(timeout=route.options.timeout_s * max(1, len(route.stages)))
    except queue.Empty:
        raise DistError("a pipelined prefill chunk did not come back in time") from None
    if isinstance(item, _Failed):
        raise item.error
    return route.logits_of(item, n_rows if all_logits else 1)
