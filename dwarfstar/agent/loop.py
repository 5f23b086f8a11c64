"""The agent loop on one live session: a user turn, then model replies and tool rounds until the model
answers without calling a tool.

Each step renders the whole transcript (transcript.py) and prefills only what the session does not
hold yet, so the tool results after a reply cost just their own tokens. A reply is parsed while it
streams (the DSML parser); its tool calls run in order, and their results form the next user turn.
Refused, with a tool error the model reads: a tool call written inside `<think>` and a malformed
DSML block. Nothing is run for either.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dwarfstar.agent import compaction
from dwarfstar.agent.policy import Policy
from dwarfstar.agent.tools import Toolbox, ToolOutcome
from dwarfstar.agent.transcript import Entry, Transcript
from dwarfstar.backends.protocol import Backend
from dwarfstar.console.diagnostics import Trace
from dwarfstar.console.terminal import Speed
from dwarfstar.engine.images import ImageEncoder
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.store import ExpertStore
from dwarfstar.experts.telemetry import summary as expert_summary
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.state import SequenceState
from dwarfstar.prompt.dsml import BLOCK_OPEN
from dwarfstar.prompt.dsml_guard import ToolGrammar, ToolGuard
from dwarfstar.prompt.dsml_parser import ContentDelta, DsmlParser, ParsedCompletion, ReasoningDelta
from dwarfstar.session.loopguard import LoopGuard, Repetition, ToolStreak, call_key, tool_loop_note
from dwarfstar.session.prefix import image_reuse
from dwarfstar.session.session import Cancelled, Session
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer
from dwarfstar.tokenizer.tokenizer import Tokenizer

THINK_CALL_REFUSED = (
    "error: tool calls are not allowed inside <think></think>; nothing was run. Close the reasoning with "
    "</think>, then write the tool calls."
)


class Events:
    """What the loop reports as it goes; the front ends override what they show."""

    def text(self, kind: str, text: str) -> None:  # kind: "reasoning" or "content"
        pass

    def reply_end(self, finish: str) -> None:
        pass

    def tool_start(self, name: str, arguments: dict[str, Any]) -> None:
        pass

    def tool_progress(self, name: str, output: str) -> None:
        pass

    def tool_end(self, name: str, outcome: ToolOutcome) -> None:
        pass

    def status(self, text: str) -> None:
        pass


@dataclass
class TurnResult:
    # "stop", "length", "interrupted", "cancelled" (stopped during the prompt's prefill) or "repetition"
    # (the loop guard: a reply that loops, or the same tool calls in K replies with `stop`)
    finish: str
    rounds: int  # tool rounds run
    reused: int  # tokens of the first step's prompt already in the session
    prefilled: int  # tokens the first step computed


class Agent:
    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        backend: Backend,
        ctx: int,
        policy: Policy,
        toolbox: Toolbox,
        transcript: Transcript,
        max_tokens: int,
        trace: Trace | None = None,
        experts: ExpertStore | None = None,
        loop_guard: LoopGuard | None = None,
        images: ImageEncoder | None = None,
    ) -> None:
        if toolbox.vision != (images is not None):
            raise DwarfStarError("the toolbox offers view_image exactly when the agent has a vision encoder")
        self.tokenizer, self.backend, self.policy, self.toolbox = tokenizer, backend, policy, toolbox
        self.images = images  # the vision encoder (--vision): view_image's images become blocks of the prompt
        self.transcript, self.max_tokens, self.trace = transcript, max_tokens, trace
        self.experts = experts  # the streamed-expert cache (--ssd-streaming): its figures go in the trace
        self.eos = backend.args.eos_token_id
        self.session = Session(backend, ctx=ctx)
        self.prefill_speed, self.decode_speed = Speed(), Speed()
        self.dirty = False  # the transcript changed since it was last saved or loaded
        self.loop_guard = loop_guard  # --loop-guard (session/loopguard.py)
        self.streak = ToolStreak()  # the same tool calls in consecutive replies

    @property
    def ctx(self) -> int:
        return self.session.ctx

    def note(self, title: str, body: str | None = None) -> None:
        if self.trace:
            self.trace.write(title, body)

    # -- the session ------------------------------------------------------------------------------
    def transcript_prompt(self, transcript: Transcript | None = None) -> tuple[list[int], list[ImageSpan]]:
        """The tokens of `transcript` (default: the agent's), the head in the model release's effort
        table, and its image blocks."""
        efforts = self.backend.args.reasoning_efforts
        return (transcript or self.transcript).prompt(
            self.tokenizer, self.eos, efforts, self.toolbox.tools, self.images
        )

    def transcript_ids(self) -> list[int]:
        return self.transcript_prompt()[0]

    def entry_size(self, entry: Entry) -> int:
        return len(self.transcript.entry_prompt(entry, self.tokenizer, self.eos, self.images)[0])

    def head_ids(self, transcript: Transcript) -> list[int]:
        """`transcript`'s system turn as this agent's model renders it (its release's effort table)."""
        return transcript.head_ids(self.tokenizer, self.backend.args.reasoning_efforts, tools=self.toolbox.tools)

    def sync(self, should_stop: Callable[[], bool] = lambda: False, label: str = "step") -> tuple[int, int]:
        """Bring the session to the transcript's tokens; returns (tokens reused, tokens computed)."""
        ids, spans = self.transcript_prompt()
        keep, later = image_reuse(self.session.tokens, ids, spans)
        computed, start = self.session.stats.computed, time.perf_counter()
        if self.trace:  # an image's block shows as nothing: its ids have no text
            shown = self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])
            self.note(f"{label}: rendered prompt ({len(ids)} tokens, {len(spans)} images)", shown)
        try:
            self.session.truncate(keep)
            self.policy.extend(self.session, ids[keep:], should_stop, later)
        finally:
            prefilled = self.session.stats.computed - computed
            self.prefill_speed.add(prefilled, time.perf_counter() - start)
            self.note(f"cache: reused {keep} tokens, prefilled {prefilled}")
        return keep, prefilled

    def adopt(self, state: SequenceState, transcript: Transcript) -> None:
        """Continue from a state read from disk (no prefill); the next step reuses what matches. The
        state holds its image blocks' ids, not their rows: the session learns them from the
        transcript's prompt, so that a cut behind a block replays it. A transcript this agent cannot
        render (images without --vision) is refused before anything changes."""
        ids, spans = self.transcript_prompt(transcript)
        self.session.reset()
        self.session.state = state
        self.session.adopt(spans, ids)
        self.transcript = transcript
        self.dirty = False

    def new_transcript(self, transcript: Transcript) -> None:
        """Go on with `transcript` (the next step prefills what the session lacks); one this agent
        cannot render is refused before anything changes."""
        self.transcript_prompt(transcript)
        self.transcript = transcript
        self.dirty = False

    # -- a turn -----------------------------------------------------------------------------------
    def run(
        self,
        text: str,
        events: Events,
        should_stop: Callable[[], bool] = lambda: False,
        safe_point: Callable[[], None] = lambda: None,
    ) -> TurnResult:
        entries = self.transcript.entries
        if entries and compaction.soft_due(len(self.session.tokens), self.ctx):
            self.compact(events, "soft")
            entries = self.transcript.entries
        # after an interrupted tool round the user's words join its results, as one user turn
        joins = bool(entries) and entries[-1].kind == "tools" and not entries[-1].text
        if joins:
            entries[-1].text = text
        else:
            entries.append(Entry("user", text=text, thinking=self.transcript.thinking))
        self.dirty = True
        rounds, first = 0, None
        while True:
            try:
                step = self.sync(should_stop, label=f"turn {len(self.transcript.user_turns())} step {rounds}")
            except Cancelled:
                if rounds == 0:  # the model never saw this turn: drop it
                    if joins:
                        entries[-1].text = ""
                    else:
                        entries.pop()
                return TurnResult("cancelled", rounds, *(first or (0, 0)))
            first = first or step
            completion, finish = self._reply(events, should_stop)
            if finish != "stop":
                return TurnResult(finish, rounds, *first)
            looped = self._tool_loop(completion, events)
            if looped and self.loop_guard.tools == "stop":
                return TurnResult("repetition", rounds, *first)
            results = self._run_tools(completion, events, should_stop)
            if results and looped:  # the model reads the note with the results
                note = tool_loop_note(self.streak.name, self.streak.turns)
                results[-1] = replace(results[-1], text=f"{results[-1].text}\n\n{note}")
            if results is None:
                return TurnResult("stop", rounds, *first)
            rounds += 1
            self._append_results(results, events)
            safe_point()
            if should_stop():
                return TurnResult("interrupted", rounds, *first)

    def _reply(self, events: Events, should_stop: Callable[[], bool]) -> tuple[ParsedCompletion, str]:
        thinking = self.transcript.entries[-1].thinking
        parser = DsmlParser(thinking=thinking)
        detok = IncrementalDetokenizer(self.tokenizer)
        ids: list[int] = []
        finish, start = "length", time.perf_counter()
        room = self.ctx - len(self.session.tokens)
        repetition = Repetition(self.loop_guard) if self.loop_guard is not None else None
        guard = ToolGuard(ToolGrammar(self.toolbox.tools), self.tokenizer, thinking=thinking)
        for token in self.policy.reply(self.session, min(self.max_tokens, room), should_stop, guard):
            if token == self.eos:
                finish = "stop"
                break
            ids.append(token)
            self._show(parser.feed(detok.push(token)), events)
            if repetition is not None and repetition.push(token):
                finish = "repetition"
                events.status(f"loop guard: {repetition.detail}; reply stopped")
                self.note("loop guard", repetition.detail)
                break
        if finish == "length" and should_stop():
            finish = "interrupted"
        self._show(parser.feed(detok.flush()) + parser.finish(ended=finish == "stop"), events)
        self.decode_speed.add(len(ids) + (finish == "stop"), time.perf_counter() - start)
        self.transcript.entries.append(Entry("assistant", ids=ids))
        self.dirty = True  # also after a save at a safe point earlier in this turn
        self.note(f"generated {len(ids)} tokens, finish {finish}", self.tokenizer.decode(ids))
        if self.experts is not None:  # the cache since the start, as `run --trace` records it
            self.note("experts", json.dumps(expert_summary(self.experts)))
        events.reply_end(finish)
        return parser.completion, finish

    @staticmethod
    def _show(parsed: list, events: Events) -> None:
        for event in parsed:
            if isinstance(event, ReasoningDelta):
                events.text("reasoning", event.text)
            elif isinstance(event, ContentDelta):
                events.text("content", event.text)

    def _tool_loop(self, completion: ParsedCompletion, events: Events) -> bool:
        """Whether this reply's tool calls make K replies in a row with the same calls (the loop guard)."""
        turns = self.streak.push([call_key(c.name, c.arguments) for c in completion.tool_calls])
        if self.loop_guard is None or turns < self.loop_guard.tool_turns:
            return False
        detail = f"{self.streak.name} called the same way in {turns} replies in a row"
        events.status(f"loop guard: {detail}; " + ("stopped" if self.loop_guard.tools == "stop" else "noted"))
        self.note("loop guard", detail)
        return True

    def _run_tools(
        self, completion: ParsedCompletion, events: Events, should_stop: Callable[[], bool]
    ) -> list[ToolOutcome] | None:
        """The results of the reply's tool calls, in order; None when the reply called none."""
        if completion.reasoning and BLOCK_OPEN in completion.reasoning:
            refused = ToolOutcome(THINK_CALL_REFUSED, True)
            events.tool_end("(inside think)", refused)
            return [refused]
        if not completion.tool_calls:
            if completion.invalid_dsml is not None:
                why = "; ".join(completion.problems) or "unparsable block"
                error = f"error: malformed tool call ({why}); nothing was run. Write the DSML block exactly as shown."
                malformed = ToolOutcome(error, True)
                events.tool_end("(malformed)", malformed)
                return [malformed]
            return None
        results = []
        for call in completion.tool_calls:
            if should_stop():
                outcome = ToolOutcome("error: not run, the user interrupted", True)
            else:
                events.tool_start(call.name, call.arguments)
                outcome = self.toolbox.call(
                    call.name, call.arguments, should_stop, lambda out, name=call.name: events.tool_progress(name, out)
                )
            events.tool_end(call.name, outcome)
            self.note(f"tool {call.name} {call.arguments_json}", outcome.text)
            results.append(outcome)
        return results

    def _append_results(self, results: list[ToolOutcome], events: Events) -> None:
        images = {n: r.image for n, r in enumerate(results) if r.image is not None}
        entry = Entry("tools", results=[r.text for r in results], thinking=self.transcript.thinking, images=images)
        size = self.entry_size(entry)
        if compaction.hard_due(len(self.session.tokens), size, self.ctx):
            self.compact(events, "hard")
            if compaction.hard_due(len(self.transcript_ids()), size, self.ctx):
                entry.results = [
                    f"error: this tool result ({size} tokens) does not fit in the context; ask for less output"
                    for _ in results
                ]
                entry.images = {}
        self.transcript.entries.append(entry)

    # -- compaction -------------------------------------------------------------------------------
    def compact(self, events: Events, trigger: str) -> None:
        """Replace the conversation by the model's summary of it plus a verbatim tail."""
        transcript = self.transcript
        kept = list(transcript.entries)
        sizes = [self.entry_size(e) for e in kept]
        start = compaction.tail_start([e.kind for e in kept], sizes, self.ctx)
        if start == 0:
            # the whole conversation fits in the tail (the rest is the system prompt): a summary frees
            # nothing, and compacting again would only repeat at every turn
            return
        events.status(f"COMPACTING ({trigger}: {len(self.session.tokens)}/{self.ctx} tokens)")
        transcript.entries.append(Entry("user", text=compaction.SUMMARY_REQUEST, thinking=False))
        self.sync(label="compaction")
        saved_max, self.max_tokens = self.max_tokens, compaction.summary_budget(len(self.session.tokens), self.ctx)
        try:
            completion, _ = self._reply(events, lambda: False)
        finally:
            self.max_tokens = saved_max
        summary = completion.content.split(BLOCK_OPEN)[0].strip() or "(the model wrote no summary)"
        if transcript.first_prompt is None:  # the title outlives the turn it came from
            transcript.first_prompt = next((e.text for e in kept if e.text), None)
        transcript.entries = kept[start:]
        transcript.summary = summary
        self.note(f"compaction ({trigger}): kept {len(kept) - start} of {len(kept)} entries", summary)
        self.sync(label="after compaction")
        events.status(f"compacted: {len(self.session.tokens)}/{self.ctx} tokens")
