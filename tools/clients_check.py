"""Claude Code, Codex and opencode, run non-interactively against a local `dwarfstar serve`.

    python tools/clients_check.py --clients build/clients [--only claude codex] [--servers scripted bundled]

The clients are the npm packages installed under `--clients` (see `nox -s clients`). Each runs in
its own temporary HOME with a configuration that points it at the loopback server and turns off
telemetry and update checks; nothing but 127.0.0.1 is needed. Checks, per client:

- plain turn: one prompt, answered (scripted server; with `--servers scripted bundled`, also
  against the bundled model through `python -m dwarfstar serve`, where the answer is whatever the
  model writes, cut at BUNDLED_OUTPUT tokens where the client lets one say so);
- tool round trip: the scripted model calls the client's file-reading tool on `notes.txt`, the
  client runs it, and the file's content (a script marker) makes the model write the final answer;
- prefix reuse: three turns of one conversation, with the prompt, cached and prefilled tokens of
  each request from the server's trace, and where a prompt's bytes stop extending the previous one.

The scripted server is `tests/serving/scripted_server.py` (the test suite's ScriptedBackend).
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v4-flash"
DSML = "｜DSML｜"
ANSWER = "The notes say the launch is on Tuesday."
BUNDLED_CTX = 12800  # Claude Code's first prompt is ~11.5k tokens
BUNDLED_OUTPUT = 64  # output tokens the clients that have a setting ask the bundled model for
TURN_TIMEOUT = 900  # seconds; a cold Claude Code prompt is ~11k tokens of CPU prefill
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}


def tool_call(name: str, **arguments: str) -> str:
    parameters = "\n".join(
        f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>' for key, value in arguments.items()
    )
    return f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="{name}">\n{parameters}\n</{DSML}invoke>\n</{DSML}tool_calls>'


def tool_work(root: Path, name: str) -> Path:
    return root / "tool" / name / "work"


def scripts(root: Path) -> dict[str, str]:
    """What the scripted model says; reasoning first, since every client asks for thinking."""

    def notes(name: str) -> str:
        return str(tool_work(root, name) / "notes.txt")

    return {
        "hello": "A greeting.</think>Hello from the scripted model.",
        "turn2": "Second turn.</think>This is the second answer.",
        "turn3": "Third turn.</think>This is the third answer.",
        "answer": f"The file is read.</think>{ANSWER}",
        "claude_read": "Read the file.</think>" + tool_call("Read", file_path=notes("claude")),
        "codex_read": "Read the file.</think>" + tool_call("exec_command", cmd=f"cat {notes('codex')}"),
        "opencode_read": "Read the file.</think>" + tool_call("read", filePath=notes("opencode")),
    }


@dataclass
class Server:
    url: str
    trace: Path
    process: subprocess.Popen

    def records(self) -> list[dict]:
        if not self.trace.exists():
            return []
        return [json.loads(line) for line in self.trace.read_text().splitlines()]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], trace: Path, log: Path) -> Server:
    port = free_port()
    process = subprocess.Popen(
        [*command, "--port", str(port), "--trace", str(trace)], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Server(url, trace, process)
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise SystemExit("server did not start within 120 s")


@dataclass
class Client:
    name: str
    bin: Path
    home: Path
    work: Path
    env: dict[str, str] = field(default_factory=dict)

    def command(self, prompt: str, *, first: bool) -> list[str]:
        if self.name == "claude":
            keep = [] if first else ["--continue"]
            return [str(self.bin), "-p", prompt, "--model", MODEL, "--allowedTools", "Read", *keep]
        if self.name == "codex":
            resume = [] if first else ["resume", "--last"]
            return [str(self.bin), "exec", *resume, "--skip-git-repo-check", prompt]
        keep = [] if first else ["--continue"]
        return [str(self.bin), "run", "-m", f"dwarfstar/{MODEL}", *keep, prompt]

    def run(self, prompt: str, *, first: bool) -> subprocess.CompletedProcess:
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "TERM": "dumb", **self.env}
        try:
            return subprocess.run(
                self.command(prompt, first=first),
                cwd=self.work,
                env=env,
                capture_output=True,
                text=True,
                timeout=TURN_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {TURN_TIMEOUT} s")


def make_client(name: str, clients: Path, root: Path, url: str, output: int = 4096) -> Client:
    home, work = root / name / "home", root / name / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("[[script:answer]] launch on Tuesday\n")
    client = Client(name, clients / "node_modules" / ".bin" / name, home, work)
    if name == "claude":
        client.env = {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_AUTH_TOKEN": "dwarfstar",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output),
        }
    elif name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "dwarfstar"\n'
            'approval_policy = "never"\nsandbox_mode = "read-only"\n'
            "check_for_update_on_startup = false\n\n[analytics]\nenabled = false\n\n"
            "[model_providers.dwarfstar]\n"
            f'name = "DwarfStar"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        )
        client.env = {"CODEX_HOME": str(codex_home)}
    else:
        config = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "model": f"dwarfstar/{MODEL}",
            "provider": {
                "dwarfstar": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "DwarfStar",
                    "options": {"baseURL": f"{url}/v1", "apiKey": "dwarfstar"},
                    "models": {MODEL: {"name": "DeepSeek V4 Flash", "limit": {"context": 65536, "output": output}}},
                }
            },
        }
        (work / "opencode.json").write_text(json.dumps(config, indent=2))
        client.env = {
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local/state"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        }
    return client


def describe(record: dict) -> str:
    return (
        f"{record['api']} prompt={record['prompt_tokens']} cached={record['cached_tokens']} "
        f"prefilled={record['prefilled_tokens']} out={record['completion_tokens']} finish={record['finish']}"
    )


def turn(client: Client, server: Server, prompt: str, *, first: bool) -> tuple[subprocess.CompletedProcess, list]:
    before = len(server.records())
    result = client.run(prompt, first=first)
    return result, server.records()[before:]


def report(label: str, ok: bool, result: subprocess.CompletedProcess, records: list[dict]) -> bool:
    print(f"  {label}: {'PASS' if ok else 'FAIL'} (exit {result.returncode}, {len(records)} requests)")
    for record in records:
        print(f"    {describe(record)}")
    if not ok:
        print("    stdout:", result.stdout[-1500:].strip())
        print("    stderr:", result.stderr[-1500:].strip())
    return ok


def request_shapes(records: list[dict]) -> None:
    """The request fields, message roles and input item types a client sent: the audit of what it uses."""
    fields, kinds = set(), set()
    for record in records:
        body = record["request"] or {}
        fields.update(body)
        for message in body.get("messages") or []:
            kinds.add(f"role {message.get('role')}")
        for item in body.get("input") if isinstance(body.get("input"), list) else []:
            kinds.add(f"item {item.get('type')}" + (f"/{item['role']}" if item.get("role") else ""))
    print(f"    request fields: {', '.join(sorted(fields))}")
    print(f"    messages/items: {', '.join(sorted(kinds))}")


def explain_reuse(turns: list[list[dict]]) -> None:
    """Per turn, the conversation's main request (the longest prompt), and the trace's word on a miss."""
    for n, records in enumerate(turns, 1):
        if not records:
            print(f"    turn {n}: no request reached the server")
            continue
        main = max(records, key=lambda r: r["prompt_tokens"])
        print(f"    turn {n}: cached {main['cached_tokens']} of {main['prompt_tokens']} prompt tokens")
        where = main.get("divergence")  # the server's trace: where the bytes leave the closest cached text
        if where is None and main["cached_tokens"] == 0:
            print("      cold: nothing traced before it")
        elif where is None:
            print("      the prompt extends a traced conversation (prompt and answer): only its suffix is new")
        else:
            print(f"      diverges at character {where['offset']} after {where['common'][-80:]!r}")
            print(f"        cached : {where['before'][:100]!r}")
            print(f"        now    : {where['after'][:100]!r}")


def check_scripted(name: str, clients: Path, root: Path, server: Server) -> dict[str, bool]:
    results = {}
    client = make_client(name, clients, root / "plain", server.url)
    result, records = turn(client, server, "[[script:hello]] Say hello.", first=True)
    ok = result.returncode == 0 and "Hello from the scripted model." in result.stdout
    results["plain turn"] = report("plain turn", ok, result, records)

    client = make_client(name, clients, root / "tool", server.url)
    assert client.work == tool_work(root, name)
    result, records = turn(client, server, f"[[script:{name}_read]] What does notes.txt say?", first=True)
    ran = any("launch on Tuesday" in (r["prompt"] or "") for r in records)
    ok = result.returncode == 0 and ran and ANSWER in result.stdout
    records_seen = records
    results["tool round trip"] = report("tool round trip", ok, result, records)

    client = make_client(name, clients, root / "reuse", server.url)
    turns, ok = [], True
    for n, prompt in enumerate(
        ["[[script:hello]] Say hello.", "[[script:turn2]] Again.", "[[script:turn3]] Once more."]
    ):
        result, records = turn(client, server, prompt, first=n == 0)
        ok = ok and result.returncode == 0 and bool(records)
        turns.append(records)
    results["three turns"] = report("three turns", ok, result, [r for records in turns for r in records])
    explain_reuse(turns)
    request_shapes([r for records in turns for r in records] + records_seen)
    return results


def check_bundled(name: str, clients: Path, root: Path, server: Server) -> bool:
    client = make_client(name, clients, root / "bundled", server.url, output=BUNDLED_OUTPUT)
    result, records = turn(client, server, "Ciao! Come stai?", first=True)
    answered = any(r["finish"] in ("stop", "length") and r["completion_tokens"] > 0 for r in records)
    return report("plain turn, bundled model", result.returncode == 0 and answered, result, records)


def versions(clients: Path) -> None:
    for name, package in PACKAGES.items():
        manifest = clients / "node_modules" / package / "package.json"
        declared = json.loads(manifest.read_text())["version"] if manifest.exists() else "not installed"
        shown = subprocess.run(
            [str(clients / "node_modules" / ".bin" / name), "--version"], capture_output=True, text=True, timeout=60
        )
        print(f"{package} {declared} ({shown.stdout.strip() or shown.stderr.strip()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=Path, default=ROOT / "build" / "clients")
    parser.add_argument("--only", nargs="*", choices=list(PACKAGES), default=list(PACKAGES))
    parser.add_argument(
        "--servers", nargs="+", choices=("scripted", "bundled"), default=["scripted"], help="bundled: the bundled model"
    )
    args = parser.parse_args()
    clients = args.clients.resolve()
    versions(clients)
    failed = []
    with tempfile.TemporaryDirectory(prefix="dwarfstar-clients-") as folder:
        root = Path(folder)
        (root / "scripts.json").write_text(json.dumps(scripts(root)))
        servers = {
            "scripted": ["tests.serving.scripted_server", "--scripts", str(root / "scripts.json")],
            # the bundled model rarely ends a turn by itself: the small context bounds what Codex,
            # which sends no output limit, can make it write
            "bundled": ["dwarfstar", "serve", "--ctx", str(BUNDLED_CTX), "--model-alias", "*"],
        }
        for kind in args.servers:
            command = servers[kind]
            server = start_server([sys.executable, "-m", *command], root / f"{kind}.jsonl", root / f"{kind}.log")
            try:
                for name in args.only:
                    print(f"{name} against the {kind} server:", flush=True)
                    if kind == "scripted":
                        outcome = check_scripted(name, clients, root, server)
                    else:
                        outcome = {"plain turn, bundled": check_bundled(name, clients, root / kind, server)}
                    failed += [f"{name}: {check}" for check, ok in outcome.items() if not ok]
            finally:
                server.stop()
    print("FAILED: " + "; ".join(failed) if failed else "all client checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
