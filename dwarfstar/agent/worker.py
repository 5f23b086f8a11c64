"""The worker thread: the only thread that touches the live session.

The front end submits prompts (queued while a task runs), asks for an interrupt, and runs session
commands (`call`) that wait for the worker to be idle. `/save` while busy is deferred to the next
safe point: between tool rounds, or the end of the task. A tool that needs a yes/no from the user
(a write outside the workspace) blocks on `ask`, which the front end answers with `answer`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dwarfstar.agent.loop import Agent, Events, TurnResult
from dwarfstar.agent.store import SavedSession, SessionStore, session_id
from dwarfstar.agent.transcript import Transcript
from dwarfstar.errors import DwarfStarError


@dataclass
class Identity:
    """The live session's id, fixed at its first prompt (None before it)."""

    id: str | None = None
    created: float | None = None


class Worker:
    def __init__(self, agent: Agent, store: SessionStore, events: Events) -> None:
        self.agent, self.store, self.events = agent, store, events
        self.identity = Identity()
        self.queue: deque[str] = deque()
        self.busy = False
        self.activity = "idle"
        self.last_result: TurnResult | None = None
        self.save_requested = False
        self.question: str | None = None
        self._answer: bool | None = None
        self._answered = threading.Event()
        self._stop = False
        self._closing = False
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="agent-worker", daemon=True)
        self._thread.start()

    # -- the front end's side ---------------------------------------------------------------------
    def submit(self, text: str) -> None:
        with self._cond:
            self.queue.append(text)
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Stop the running task at its next safe point (token, prefill chunk, tool poll)."""
        self._stop = True
        if self.question is not None:
            self.answer(False)

    def pop_queued(self) -> str | None:
        with self._cond:
            return self.queue.popleft() if self.queue else None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker once it is idle, and return its result (or raise its error)."""
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self.busy and not self.queue and not self._calls)

    def answer(self, yes: bool) -> None:
        self._answer = yes
        self._answered.set()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self.agent.toolbox.close()

    # -- the worker's side ------------------------------------------------------------------------
    def ask(self, question: str) -> bool:
        """Called on the worker (by a tool): wait for the user's yes or no."""
        self._answered.clear()
        self.question = question
        self.events.status(f"{question} [y/N]")
        self._answered.wait()
        self.question = None
        return bool(self._answer)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._calls or self.queue)
                if self._closing:
                    return
                if self._calls:
                    fn, future = self._calls.popleft()
                    text = None
                else:
                    text = self.queue.popleft()
                    self.busy, self._stop = True, False
            if text is None:
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller re-raises it on its own thread
                    future.set_exception(exc)
                with self._cond:
                    self._cond.notify_all()
                continue
            self._run(text)

    def _run(self, text: str) -> None:
        if self.identity.id is None:
            self.identity.created = time.time()
            self.identity.id = session_id(text, self.identity.created)
        self.activity, self.last_result = "working", None
        try:
            self.last_result = self.agent.run(text, self.events, lambda: self._stop, self._safe_point)
        except DwarfStarError as exc:
            self.events.status(f"error: {exc}")
        finally:
            self.activity = "idle"
            self._safe_point()
            with self._cond:
                self.busy = False
                self._cond.notify_all()

    def _safe_point(self) -> None:
        if self.save_requested:
            self.save_requested = False
            try:
                saved = self.save()
                self.events.status(f"saved session {saved.id[:8]} ({saved.tokens} tokens)")
            except DwarfStarError as exc:
                self.events.status(f"error: {exc}")

    # -- session commands (run on the worker through `call`, or at a safe point) -------------------
    def save(self) -> SavedSession:
        agent = self.agent
        if self.identity.id is None or not agent.session.tokens:
            raise DwarfStarError("nothing to save yet")
        saved = self.store.save(self.identity.id, self.identity.created, agent.transcript, agent.session.state)
        agent.dirty = False
        agent.note(f"save {saved.id}: {saved.tokens} tokens to {saved.kv_name}")
        return saved

    def switch(self, prefix: str) -> tuple[SavedSession, int]:
        """Continue a saved session; returns it and the tokens prefilled to get there."""
        listed, transcript, state = self.store.load(prefix)
        agent = self.agent
        if state is None:
            system = self.store.load_system(agent.head_ids(transcript))
            if system is None:
                agent.new_transcript(transcript)
            else:  # the head comes from sysprompt.kv; only the conversation is prefilled
                agent.adopt(system, transcript)
            _, prefilled = agent.sync(label=f"switch {listed.id}")
            agent.note(f"switch {listed.id}: stripped, rebuilt by prefill ({prefilled} tokens)")
        else:
            agent.adopt(state, transcript)
            prefilled = 0
            agent.note(f"switch {listed.id}: loaded {len(state.tokens)} tokens from disk, prefilled 0")
        self.identity = Identity(listed.id, listed.created)
        return listed, prefilled

    def new(self, transcript: Transcript) -> None:
        self.agent.new_transcript(transcript)
        self.identity = Identity()
        self.agent.sync(label="new session")

    def start(self) -> int:
        """Bring up the system prompt, from sysprompt.kv when it holds this prompt; returns tokens prefilled."""
        agent = self.agent
        ids = agent.head_ids(agent.transcript)
        state = self.store.load_system(ids)
        if state is not None:
            agent.adopt(state, agent.transcript)
            agent.note(f"sysprompt: loaded {len(ids)} tokens from sysprompt.kv, prefilled 0")
            return 0
        _, prefilled = agent.sync(label="system prompt")
        try:
            self.store.save_system(agent.session.state)
        except DwarfStarError as exc:
            self.events.status(f"warning: {exc}")
        agent.note(f"sysprompt: prefilled {prefilled} tokens, saved sysprompt.kv")
        return prefilled
