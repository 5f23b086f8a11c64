"""The terminal UI: a prompt_toolkit editor under the streamed transcript, with a status footer.

The worker thread prints through `patch_stdout`, so the transcript scrolls above the editor while
the user types. Keys: Enter submits (queued while busy), Ctrl+X takes the first queued prompt back
into the editor, ESC interrupts the task so the queued prompt runs now, Ctrl+C interrupts the task
or clears the line, Ctrl+D on an empty line exits. Tab completes commands and session ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.patch_stdout import patch_stdout

from dwarfstar.agent.commands import Commands
from dwarfstar.agent.output import Printer
from dwarfstar.agent.worker import Worker

PROMPT = "› "
FOOTER_REFRESH_S = 0.5
ID_COMMANDS = ("/switch", "/del", "/strip")


class AgentCompleter(Completer):
    def __init__(self, commands: Commands) -> None:
        self.commands = commands

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        text = document.text_before_cursor
        command, space, arg = text.partition(" ")
        if not space:
            if text.startswith("/"):
                for name in self.commands.names():
                    if name.startswith(text):
                        yield Completion(name, -len(text))
            return
        if command in ID_COMMANDS:
            for sid in self.commands.session_ids():
                if sid.startswith(arg):
                    yield Completion(sid, -len(arg))


def footer(worker: Worker, printer: Printer, model_name: str) -> str:
    agent = worker.agent
    used = len(agent.session.tokens)
    speed = agent.decode_speed
    rate = speed.tokens / speed.seconds if speed.seconds else 0.0
    session = worker.identity.id[:8] if worker.identity.id else "new"
    doing = printer.activity if worker.busy else "idle"
    if worker.question:
        doing = "waiting for your answer (y/n)"
    queued = f" │ {len(worker.queue)} queued" if worker.queue else ""
    return (
        f" {model_name} │ {used}/{agent.ctx} tokens, {agent.ctx - used} free │ {rate:,.1f} tok/s │ "
        f"session {session} │ {doing}{queued}"
    )


def _key_bindings(worker: Worker, printer: Printer) -> KeyBindings:
    keys = KeyBindings()

    @keys.add("c-x")
    def _edit_queued(event) -> None:
        queued = worker.pop_queued()
        if queued is not None:
            event.current_buffer.text = queued
            event.current_buffer.cursor_position = len(queued)

    @keys.add("escape", eager=True)
    def _send_now(event) -> None:
        if worker.busy:
            worker.interrupt()  # the first queued prompt is next in line
            printer.message("[interrupted]" + ("; sending the queued prompt" if worker.queue else ""), "yellow")

    @keys.add("c-c")
    def _interrupt_or_clear(event) -> None:
        if worker.busy:
            worker.interrupt()
            printer.message("[interrupted]", "yellow")
        else:
            event.current_buffer.reset()

    @keys.add("c-d")
    def _exit(event) -> None:
        if not event.current_buffer.text:
            event.app.exit(exception=EOFError)

    return keys


def run_tui(
    worker: Worker, commands: Commands, printer: Printer, model_name: str, first: str | None, home: Path
) -> int:
    home.mkdir(parents=True, exist_ok=True)
    editor: PromptSession[str] = PromptSession(
        history=FileHistory(str(home / "agent_history")),
        key_bindings=_key_bindings(worker, printer),
        bottom_toolbar=lambda: footer(worker, printer, model_name),
        refresh_interval=FOOTER_REFRESH_S,
        completer=AgentCompleter(commands),
        complete_while_typing=False,
    )
    commands.confirm = lambda question: editor.prompt(f"{question} [y/N] ").strip().lower() in ("y", "yes")

    def queue(task: str) -> None:
        if worker.busy:
            printer.message(f"[queued: {task[:60]}]", "dim")
        worker.submit(task)

    with patch_stdout(raw=True):
        printer.message("type a task, /help for commands, Ctrl+D to quit", "dim")
        if first is not None:
            worker.submit(first)
        while True:
            try:
                line = editor.prompt(PROMPT)
            except EOFError:
                commands.handle("/quit")
                return 0
            except KeyboardInterrupt:
                continue
            if worker.question is not None:
                worker.answer(line.strip().lower() in ("y", "yes"))
                continue
            if not commands.typed(line, queue):
                return 0
