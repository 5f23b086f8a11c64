"""The agent's slash commands, shared by the line mode and the terminal UI.

Commands that replace the live session (/switch, /new) wait for an idle worker and are refused
while a task runs (ESC or Ctrl+C interrupts it first); /save while busy waits for the next safe
point. `confirm(question)` asks the user yes/no (the line mode answers from its input).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dwarfstar.agent.output import Printer
from dwarfstar.agent.store import SHOWN_ID
from dwarfstar.agent.transcript import Transcript
from dwarfstar.agent.worker import Worker
from dwarfstar.errors import DwarfStarError

HISTORY_DEFAULT = 3
HISTORY_MAX = 200
QUIT = ("/quit", "/exit")

HELP = """\
/help             this help
/save             save the session (KV file + transcript); deferred to a safe point while busy
/list             saved sessions, most recent first
/switch ID        continue a saved session (its KV is loaded: no prefill); Tab completes the id
/history [N]      the last N user turns (default 3)
/new              a fresh session (offers to save this one)
/del ID           delete a saved session
/strip ID         drop a saved session's KV but keep its text; switching to it rebuilds by prefill
/quit, /exit      leave (asks to save unsaved work)
Enter while busy queues the prompt; Ctrl+X edits the first queued one; ESC interrupts and sends it now;
Ctrl+C interrupts (or clears the line); Ctrl+D on an empty line exits."""


class Commands:
    def __init__(
        self, worker: Worker, printer: Printer, fresh: Callable[[], Transcript], confirm: Callable[[str], bool]
    ) -> None:
        self.worker, self.printer, self.fresh, self.confirm = worker, printer, fresh, confirm

    def names(self) -> list[str]:
        return ["/help", "/save", "/list", "/switch", "/history", "/new", "/del", "/strip", *QUIT]

    def session_ids(self) -> list[str]:
        return [s.id[:SHOWN_ID] for s in self.worker.store.sessions()]

    def typed(self, line: str, submit: Callable[[str], None]) -> bool:
        """A line the user typed: a command is run, any other text given to `submit` as a task (a blank
        line is nothing); False when the agent should exit."""
        line = line.strip()
        if line.startswith("/"):
            return self.handle(line)
        if line:
            submit(line)
        return True

    def handle(self, line: str) -> bool:
        """Run one command line; False when the agent should exit."""
        command, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        try:
            if command in QUIT:
                return not self._leave()
            handler = {
                "/help": lambda: self.printer.message(HELP),
                "/save": self._save,
                "/list": self._list,
                "/switch": lambda: self._switch(arg),
                "/history": lambda: self._history(arg),
                "/new": self._new,
                "/del": lambda: self._delete(arg),
                "/strip": lambda: self._strip(arg),
            }.get(command)
            if handler is None:
                self.printer.message(f"unknown command {command}; /help lists them", "red")
            else:
                handler()
        except DwarfStarError as exc:
            self.printer.message(f"error: {exc}", "red")
        return True

    def _idle_only(self, what: str) -> None:
        if self.worker.busy or self.worker.queue:
            raise DwarfStarError(f"busy: interrupt the task (ESC or Ctrl+C) before {what}")

    def _save(self) -> None:
        if self.worker.busy:
            self.worker.save_requested = True
            self.printer.message("[save deferred to the next safe point]", "dim")
            return
        saved = self.worker.call(self.worker.save)
        self.printer.message(f"saved session {saved.id[:SHOWN_ID]} ({saved.tokens} tokens)")

    def _list(self) -> None:
        sessions = self.worker.store.sessions()
        if not sessions:
            self.printer.message("no saved sessions")
            return
        now = time.time()
        self.printer.message("\n".join(s.line(now) for s in sessions))

    def _switch(self, prefix: str) -> None:
        self._idle_only("switching")
        if self.worker.agent.dirty and self.confirm("save the current session first?"):
            self._save()
        listed, prefilled = self.worker.call(lambda: self.worker.switch(prefix))
        how = "rebuilt by prefill" if prefilled else "loaded from disk, no prefill"
        self.printer.message(
            f"switched to {listed.id[:SHOWN_ID]}: {len(self.worker.agent.session.tokens)} tokens, {how} "
            f"({prefilled} tokens prefilled)"
        )
        self._history("")

    def _history(self, arg: str) -> None:
        if arg and not arg.isdigit():
            raise DwarfStarError("usage: /history [N]")
        n = min(int(arg) if arg else HISTORY_DEFAULT, HISTORY_MAX)
        turns = self.worker.agent.transcript.user_turns()
        if not turns:
            self.printer.message("no user turns yet")
            return
        start = max(0, len(turns) - n)
        self.printer.message("\n".join(f"  {i + 1}. {text}" for i, text in enumerate(turns[start:], start)))

    def _new(self) -> None:
        self._idle_only("starting a new session")
        if self.worker.agent.dirty and self.confirm("save the current session first?"):
            self._save()
        self.worker.call(lambda: self.worker.new(self.fresh()))
        self.printer.message("new session")

    def _delete(self, prefix: str) -> None:
        listed = self.worker.store.delete(prefix)
        if listed.id == self.worker.identity.id:
            self.worker.agent.dirty = True  # it lives on only in memory now
        self.printer.message(f"deleted session {listed.id[:SHOWN_ID]}")

    def _strip(self, prefix: str) -> None:
        listed = self.worker.store.strip(prefix)
        self.printer.message(f"stripped session {listed.id[:SHOWN_ID]}: text kept, KV dropped")

    def _leave(self) -> bool:
        """True to exit; asks to save unsaved work."""
        if self.worker.agent.dirty and self.worker.identity.id is not None:
            if self.confirm("save the session before leaving?"):
                self.worker.interrupt()
                self.worker.wait_idle()
                self._save()
        return True
