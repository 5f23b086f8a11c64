"""The interactive chat of `dwarfstar run`: line editing and history, slash commands, Ctrl+C.

Ctrl+C while the model works stops it at the next token (or prefill chunk) and returns to the
prompt; the session stays valid. At an empty prompt the first Ctrl+C says how to leave and the
second one exits, as does Ctrl+D or /quit.
"""

from __future__ import annotations

import atexit
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from dwarfstar.console.chat import Chat, ThinkMode
from dwarfstar.console.terminal import Interrupt, note
from dwarfstar.errors import DwarfStarError

PROMPT = "dwarfstar> "
HISTORY_LINES = 1000
SAVE_NAME = re.compile(r"[A-Za-z0-9._-]+")

HELP = """\
/help           this help
/think          think before answering (default)
/think-max      think with maximum effort (needs --ctx >= 393216)
/nothink        answer directly
/ctx N          a new session of N tokens, up to the --ctx loaded (the conversation is recomputed)
/read FILE      send the contents of FILE as the next message
/image FILE     attach an image (PNG, JPEG, WebP, GIF) to the next message (needs --vision)
/save NAME      save the conversation and its KV state under ~/.dwarfstar/sessions/
/load NAME      continue a saved conversation without recomputing it
/stats          what the last turn reused, computed and generated
/quit, /exit    leave (also Ctrl+D, or Ctrl+C twice at an empty prompt)
Ctrl+C while the model is working stops it and keeps the conversation."""


def dwarfstar_home() -> Path:
    return Path.home() / ".dwarfstar"


def _enable_line_editing() -> None:
    """Arrow keys and a persistent history, where Python has readline (not on plain Windows)."""
    try:
        import readline
    except ImportError:
        return
    history = dwarfstar_home() / "history"
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LINES)

    def save() -> None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save)


def ask(chat: Chat, text: str) -> None:
    try:
        with Interrupt() as stop:
            stats = chat.ask(text, stop)
    except DwarfStarError as exc:
        note(f"error: {exc}", "red")
        return
    if stats.finish == "cancelled":
        note("[stopped during prefill; the message was dropped]")
        return
    if stats.finish == "interrupted":
        note("[interrupted]")
    note(describe(chat))


def describe(chat: Chat) -> str:
    s = chat.last
    if s is None:
        return f"session: {len(chat.session.tokens)} tokens"
    prefill_rate = s.prefilled / s.prefill_s if s.prefill_s > 0 else 0.0
    decode_rate = len(s.ids) / s.decode_s if s.decode_s > 0 else 0.0
    return (
        f"[reused {s.kept} cached tokens, prefilled {s.prefilled} at {prefill_rate:,.1f} tok/s, "
        f"generated {len(s.ids)} at {decode_rate:,.1f} tok/s ({s.finish}); "
        f"session {len(chat.session.tokens)}/{chat.session.ctx} tokens, KV {chat.session.nbytes() / 2**20:.1f} MiB]"
    )


def _saved(name: str) -> Path:
    if not SAVE_NAME.fullmatch(name):
        raise DwarfStarError(f"session names use letters, digits, '.', '_' and '-': {name!r}")
    return dwarfstar_home() / "sessions" / name


def _set_mode(chat: Chat, mode: ThinkMode) -> None:
    warning = chat.set_mode(mode)
    if warning:
        note(f"warning: {warning}", "yellow")
    note(f"[mode: {chat.mode.value}]")


def _ctx(chat: Chat, arg: str) -> None:
    if not arg.isdigit() or int(arg) <= 0:
        raise DwarfStarError("usage: /ctx N (a positive number of tokens)")
    chat.set_ctx(int(arg))
    note(f"[new session of {chat.session.ctx} tokens; the conversation is recomputed at the next message]")


def _read(chat: Chat, arg: str) -> None:
    if not arg:
        raise DwarfStarError("usage: /read FILE")
    try:
        text = Path(arg).expanduser().read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DwarfStarError(f"cannot read {arg}: {exc.strerror or exc}") from None
    note(f"[sending {arg}: {len(text)} characters]")
    ask(chat, text)


def _image(chat: Chat, arg: str) -> None:
    if not arg:
        raise DwarfStarError("usage: /image FILE")
    chat.attach(Path(arg).expanduser())
    note(f"[attached {arg} to the next message: {len(chat.images)} image(s)]")


def _save(chat: Chat, arg: str) -> None:
    size = chat.save(_saved(arg))
    note(f"[saved {arg}: {len(chat.session.tokens)} tokens, {size / 2**20:.1f} MiB]")


def _load(chat: Chat, arg: str) -> None:
    n = chat.load(_saved(arg))
    note(f"[loaded {arg}: {len(chat.turns)} turns, {n} tokens, mode {chat.mode.value}]")


COMMANDS: dict[str, Callable[[Chat, str], None]] = {
    "/help": lambda chat, arg: print(HELP),
    "/think": lambda chat, arg: _set_mode(chat, ThinkMode.THINK),
    "/think-max": lambda chat, arg: _set_mode(chat, ThinkMode.THINK_MAX),
    "/nothink": lambda chat, arg: _set_mode(chat, ThinkMode.NOTHINK),
    "/ctx": _ctx,
    "/read": _read,
    "/image": _image,
    "/save": _save,
    "/load": _load,
    "/stats": lambda chat, arg: note(describe(chat)),
}
QUIT = ("/quit", "/exit")


def run_repl(chat: Chat) -> None:
    # Ctrl+C is the chat's own key (stop a reply, then leave), even when started with SIGINT ignored,
    # as a shell starts a background job; Interrupt restores this handler after each turn
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _enable_line_editing()
    note("type a message, /help for commands, Ctrl+D to quit")
    ctrl_c_at_prompt = False
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            if ctrl_c_at_prompt:
                print()
                return
            ctrl_c_at_prompt = True
            print()
            note("[press Ctrl+C again to quit]")
            continue
        ctrl_c_at_prompt = False
        line = line.strip()
        if not line:
            continue
        if not line.startswith("/"):
            ask(chat, line)
            continue
        command, _, arg = line.partition(" ")
        if command in QUIT:
            return
        handler = COMMANDS.get(command)
        if handler is None:
            note(f"unknown command {command}; /help lists them", "red")
            continue
        try:
            handler(chat, arg.strip())
        except DwarfStarError as exc:
            note(f"error: {exc}", "red")
        sys.stdout.flush()
