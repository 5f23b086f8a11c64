"""Claude Code, Codex and opencode, run non-interactively against a local `dwarfstar serve`.

    python tools/clients_check.py --clients build/clients [--only claude codex] [--servers scripted bundled]
        [--scenarios image ...] [--model FILE] [--json figures.json] [--keep DIR]

The clients are the npm packages installed under `--clients` (see `nox -s clients`). Each runs in
its own temporary HOME with a configuration that points it at the loopback server and turns off
telemetry and update checks; nothing but 127.0.0.1 is needed. Each client runs four scenarios,
each in a fresh git workspace holding `quaderno.txt` (a line of I promessi sposi), `appunti.txt` and
the picture IMAGE:

- plain turn: PLAIN_PROMPT, answered: exit 0, an answer printed, and the turn ended by the model
  (finish `stop` in the server's trace, not `length`);
- tool round trip: READ_PROMPT; the client's own read tool runs (a later request's prompt holds the
  file's line) and the answer printed quotes the file (QUOTE_WORDS consecutive words of it);
- image: IMAGE_PROMPT with the workspace's IMAGE attached as each client attaches one (Claude Code a
  Messages image block through `--input-format stream-json`, Codex `exec --image`, opencode `run
  --file`). On the scripted server, which reads images (`--vision`, a random encoder), the image
  must reach the model: a request of the turn has an image block in its prompt (the trace's
  `image_blocks`), and the turn passes as the plain turn does. The bundled model has no vision
  encoder, so there the client must show the server's 400, which names `--vision`;
- session: SESSION_PROMPTS as four turns of one client session (claude --continue, codex exec resume
  --last, opencode run --continue), with a line appended to appunti.txt and `git commit -am` between
  turns; each turn passes as the plain turn does, the read turn as the tool round trip. Per turn the
  conversation requests' prompt, cached and prefilled tokens and, for a miss, the client block whose
  rewrite moved the prompt (dwarfstar/serving/trace_reuse.py) are printed and written to `--json`.

`--servers scripted` (the default) runs them against tests/serving/scripted_server.py (the test
suite's ScriptedBackend replaying given DSML, cheap and exact); `bundled` against the bundled model
through `python -m dwarfstar serve`, one server per client with a context from BUNDLED_CTX.
Exit status 1 if any scenario fails.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the package beside it
from dwarfstar.serving.trace_reuse import conversation, print_reuse, reuse_rows, rewrite_cost  # noqa: E402

MODEL = "deepseek-v4-flash"
DSML = "｜DSML｜"
QUADERNO = "Questo matrimonio non s'ha da fare, né domani, né mai."  # quaderno.txt, the file read
# what the scenarios ask; to be tuned to what the bundled model was trained on
PLAIN_PROMPT = "Say hello."
READ_PROMPT = "read the file quaderno.txt"  # a training template (dwarfstar/train/chat_data.py), bare
SESSION_PROMPTS = ("Hello!", READ_PROMPT, "Thanks!", "Hello again!")
IMAGE = "vignetta.png"  # the picture the image scenario attaches, drawn by make_workspace
IMAGE_PROMPT = "What is in this picture?"
# after the session (scripted server only): a commit, then two new sessions in its workspace, the
# first after the commit, the second with nothing changed but its text (see measure_rewrite)
NEW_SESSION_PROMPTS = ("Hello, new session.", "Ciao, new session.")
QUOTE_WORDS = 4  # consecutive words of the file an answer must hold to quote it
# the bundled server's context per client: Claude Code's first prompt is ~11.7k tokens in a git
# workspace, Codex's ~6.4k and opencode's ~7.3k; Codex sends no output limit, so its context bounds
# what a model that does not end its turn writes
BUNDLED_CTX = {"claude": 14336, "codex": 9216, "opencode": 9216}
BUNDLED_OUTPUT = 256  # output tokens the clients that have a setting ask the bundled model for
TURN_TIMEOUT = 900  # seconds; a cold Claude Code prompt is ~11k tokens of CPU prefill
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}
SCENARIOS = ("plain turn", "tool round trip", "image", "session")


def tool_call(name: str, **arguments: str) -> str:
    parameters = "\n".join(
        f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>' for key, value in arguments.items()
    )
    return f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="{name}">\n{parameters}\n</{DSML}invoke>\n</{DSML}tool_calls>'


def workspace(root: Path, name: str, scenario: str) -> Path:
    return root / scenario.replace(" ", "-") / name / "work"


def read_call(name: str, path: Path) -> str:
    """The scripted model's call of the client's own file-reading tool."""
    if name == "claude":
        return tool_call("Read", file_path=str(path))
    if name == "codex":
        return tool_call("exec_command", cmd=f"cat {path}")
    return tool_call("read", filePath=str(path))


def scripts(root: Path) -> dict[str, str]:
    """What the scripted model says; reasoning first, since every client asks for thinking. The
    scripted quaderno.txt ends with the `quote` marker, so its tool result scripts the answer."""
    said = {
        "hello": "A greeting.</think>Hello from the scripted model.",
        "thanks": "Thanks.</think>You are welcome.",
        "quote": f"The file is read.</think>The file says: {QUADERNO}",
        "image": "A picture.</think>The picture shows a red square on gray.",
    }
    for name in PACKAGES:
        for scenario in ("tool round trip", "session"):
            call = read_call(name, workspace(root, name, scenario) / "quaderno.txt")
            said[f"{name}_read_{scenario.split()[0]}"] = "Read the file.</think>" + call
    return said


def scripted_prompts(name: str, scenario: str) -> list[str]:
    read = f"[[script:{name}_read_{scenario.split()[0]}]] {READ_PROMPT}"
    if scenario == "plain turn":
        return [f"[[script:hello]] {PLAIN_PROMPT}"]
    if scenario == "image":
        return [f"[[script:image]] {IMAGE_PROMPT}"]
    if scenario == "tool round trip":
        return [read]
    hello, thanks, again = SESSION_PROMPTS[0], SESSION_PROMPTS[2], SESSION_PROMPTS[3]
    return [f"[[script:hello]] {hello}", read, f"[[script:thanks]] {thanks}", f"[[script:hello]] {again}"]


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

    def command(self, prompt: str, *, first: bool, image: str | None = None) -> list[str]:
        """The client's command line for one turn; `image`: a workspace file attached to the prompt
        (Claude Code's comes as a Messages image block on stdin, `stdin_message`)."""
        if self.name == "claude":
            keep = [] if first else ["--continue"]
            if image is not None:  # the prompt and the image come as one stream-json message on stdin
                streamed = ["--input-format", "stream-json", "--output-format", "stream-json", "--verbose"]
                return [str(self.bin), "-p", *streamed, "--model", MODEL, *keep]
            return [str(self.bin), "-p", prompt, "--model", MODEL, "--allowedTools", "Read", *keep]
        if self.name == "codex":
            resume = [] if first else ["resume", "--last"]
            attach = [] if image is None else ["--image", image]  # after the prompt: it takes several files
            return [str(self.bin), "exec", *resume, "--skip-git-repo-check", prompt, *attach]
        keep = [] if first else ["--continue"]
        attach = [] if image is None else ["--file", image]  # likewise
        return [str(self.bin), "run", "-m", f"dwarfstar/{MODEL}", *keep, prompt, *attach]

    def stdin_message(self, prompt: str, image: str) -> str:
        """Claude Code's stream-json input: one user message holding the prompt and the image, base64."""
        data = base64.b64encode((self.work / image).read_bytes()).decode()
        picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        message = {"role": "user", "content": [{"type": "text", "text": prompt}, picture]}
        return json.dumps({"type": "user", "message": message}) + "\n"

    def run(self, prompt: str, *, first: bool, image: str | None = None) -> subprocess.CompletedProcess:
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "TERM": "dumb", **self.env}
        streamed = self.name == "claude" and image is not None
        try:
            result = subprocess.run(
                self.command(prompt, first=first, image=image),
                cwd=self.work,
                env=env,
                capture_output=True,
                text=True,
                timeout=TURN_TIMEOUT,
                input=self.stdin_message(prompt, image) if streamed else None,
                stdin=None if streamed else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {TURN_TIMEOUT} s")
        return streamed_result(result) if streamed else result

    def git(self, *args: str) -> None:
        person = ["-c", "user.name=DwarfStar", "-c", "user.email=clients@dwarfstar.invalid"]
        person += ["-c", "commit.gpgsign=false"]
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home)}
        subprocess.run(["git", *person, *args], cwd=self.work, env=env, check=True, capture_output=True)


def streamed_result(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Claude Code's stream-json output read as its plain output: the final `result` event's text on
    stdout (an error result's text on stderr), the other events dropped."""
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    final = next((event for event in reversed(events) if event.get("type") == "result"), {})
    text = str(final.get("result") or "")
    if final.get("is_error"):
        return subprocess.CompletedProcess(result.args, result.returncode or 1, "", f"{text}\n{result.stderr}")
    return subprocess.CompletedProcess(result.args, result.returncode, text, result.stderr)


def draw_image(path: Path) -> None:
    """A small PNG for the image scenario: a red square on gray."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (96, 64), (127, 127, 127))
    ImageDraw.Draw(picture).rectangle((24, 8, 71, 55), fill=(200, 30, 30))
    picture.save(path)


def make_workspace(client: Client, *, scripted: bool) -> None:
    """A git repository with the file to read, the picture to attach and a notes file the session
    edits between turns."""
    marker = "\n[[script:quote]]" if scripted else ""
    (client.work / "quaderno.txt").write_text(f"{QUADERNO}{marker}\n")
    draw_image(client.work / IMAGE)
    (client.work / "appunti.txt").write_text("Appunti.\n")
    client.git("init", "-q", "-b", "main")
    client.git("add", "quaderno.txt", "appunti.txt", IMAGE)
    client.git("commit", "-q", "-m", "Quaderno e appunti")


def edit_and_commit(client: Client, n: int) -> None:
    with (client.work / "appunti.txt").open("a") as notes:
        notes.write(f"Appunto {n}.\n")
    client.git("commit", "-q", "-am", f"Appunto {n}")


def make_client(name: str, clients: Path, root: Path, url: str, output: int = 4096) -> Client:
    home, work = root / "home", root / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
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
                    "models": {
                        MODEL: {
                            "name": "DeepSeek V4 Flash",
                            "limit": {"context": 65536, "output": output},
                            # images are sent (`run --file`); a server without --vision refuses them
                            "attachment": True,
                            "modalities": {"input": ["text", "image"], "output": ["text"]},
                        }
                    },
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
    images = "".join(f" image@{first}+{length}" for first, length in record.get("image_blocks") or ())
    return (
        f"{record['api']} prompt={record['prompt_tokens']}{images} cached={record['cached_tokens']} "
        f"prefilled={record['prefilled_tokens']} out={record['completion_tokens']} finish={record['finish']}"
    )


@dataclass
class Turn:
    prompt: str
    result: subprocess.CompletedProcess
    records: list[dict]
    seconds: float
    read: bool = False  # the turn asks for the file
    image: str | None = None  # the turn attaches the picture: "seen" (the model reads it) or "refused"

    @property
    def answer(self) -> str:
        return self.result.stdout.strip()

    def ended_by_model(self) -> bool:
        """The conversation's last request of the turn stopped by itself (not at the output limit)."""
        main = conversation(self.records)
        return bool(main) and main[-1]["finish"] == "stop"

    def tool_ran(self) -> bool:
        """A request after the first carries the file's line: the client ran its tool and sent the result."""
        return any(QUADERNO in (record["prompt"] or "") for record in self.records[1:])

    def image_reached(self) -> bool:
        """A request of the turn had an image block in its prompt: the image reached the model."""
        return any(record.get("image_blocks") for record in self.records)

    def problems(self) -> list[str]:
        if self.image == "refused":  # no vision encoder: the client must show the server's 400
            said = f"{self.result.stdout}\n{self.result.stderr}"
            return [] if "--vision" in said else ["the client did not show the 400 that names --vision"]
        found = []
        if self.image == "seen" and not self.image_reached():
            found.append("no image block reached the model")
        if self.result.returncode != 0:
            found.append(f"exit {self.result.returncode}")
        if not self.answer:
            found.append("no answer printed")
        if not self.ended_by_model():
            finishes = [r["finish"] for r in conversation(self.records)]
            found.append(f"not ended by the model (finish {finishes or 'none'})")
        if self.read and not self.tool_ran():
            found.append("the read tool did not run")
        if self.read and not quotes(self.answer, QUADERNO):
            found.append("the answer does not quote the file")
        return found


def words(text: str) -> list[str]:
    return re.sub(r"[\W_]+", " ", text.lower()).split()


def quotes(answer: str, source: str, n: int = QUOTE_WORDS) -> bool:
    """Whether `answer` holds `n` consecutive words of `source` (case and punctuation aside)."""
    said, wanted = f" {' '.join(words(answer))} ", words(source)
    return any(f" {' '.join(wanted[i : i + n])} " in said for i in range(max(1, len(wanted) - n + 1)))


def run_turn(client: Client, server: Server, prompt: str, *, first: bool, read: bool, image: str | None = None) -> Turn:
    """One turn; `image`: the turn attaches the picture, and the model reads it ("seen") or the server
    refuses it ("refused")."""
    before = len(server.records())
    start = time.monotonic()
    result = client.run(prompt, first=first, image=None if image is None else IMAGE)
    return Turn(prompt, result, server.records()[before:], time.monotonic() - start, read, image)


def report(label: str, turns: list[Turn]) -> bool:
    ok = all(not t.problems() for t in turns)
    seconds = sum(t.seconds for t in turns)
    print(f"  {label}: {'PASS' if ok else 'FAIL'} ({seconds:.0f} s, {len(turns)} turn(s))", flush=True)
    for n, t in enumerate(turns, 1):
        issues = t.problems()
        print(f"    turn {n} ({t.seconds:.0f} s): {'; '.join(issues) if issues else 'ok'}; answer {t.answer[:80]!r}")
        for record in t.records:
            print(f"      {describe(record)}")
        if t.image == "refused":
            said = [line.strip()[:240] for line in f"{t.result.stdout}\n{t.result.stderr}".splitlines()]
            print("      the client showed:", next((line for line in said if "--vision" in line), "nothing"))
        if issues and t.result.returncode != 0:
            print("      stderr:", t.result.stderr[-800:].strip())
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


def run_scenario(name: str, scenario: str, clients: Path, root: Path, server: Server, *, scripted: bool):
    """One scenario's turns in a fresh workspace, with an edit and a commit before every turn but the first."""
    output = 4096 if scripted else BUNDLED_OUTPUT
    client = make_client(name, clients, workspace(root, name, scenario).parent, server.url, output)
    make_workspace(client, scripted=scripted)
    asked = {"plain turn": [PLAIN_PROMPT], "tool round trip": [READ_PROMPT], "session": list(SESSION_PROMPTS)}
    asked["image"] = [IMAGE_PROMPT]
    image = None if scenario != "image" else "seen" if scripted else "refused"
    turns: list[Turn] = []
    for n, prompt in enumerate(scripted_prompts(name, scenario) if scripted else asked[scenario]):
        if n:
            edit_and_commit(client, n)
        turns.append(run_turn(client, server, prompt, first=n == 0, read=READ_PROMPT in prompt, image=image))
        if turns[-1].result.returncode == 124:
            break  # a turn that ran out of time leaves nothing to continue
    return client, turns


def turn_figures(label: str, turns: list[Turn]) -> dict:
    """Pass or fail (printed), and per turn what the JSON keeps: time, exit, problems, answer, requests."""
    return {
        "pass": report(label, turns),
        "turns": [
            {
                "prompt": t.prompt,
                "seconds": round(t.seconds, 1),
                "exit": t.result.returncode,
                "problems": t.problems(),
                "answer": t.answer[:400],
                "requests": [{k: r[k] for k in REQUEST_FIGURES} for r in t.records],
            }
            for t in turns
        ],
    }


def run_scenarios(
    name: str, clients: Path, root: Path, server: Server, *, scripted: bool, scenarios: tuple[str, ...] = SCENARIOS
) -> dict:
    """The scenarios for one client (and, after the scripted session, the rewrite measurement)."""
    figures, seen = {}, []
    for scenario in scenarios:
        client, turns = run_scenario(name, scenario, clients, root, server, scripted=scripted)
        figures[scenario] = turn_figures(scenario, turns)
        seen += [r for t in turns for r in t.records]
        if scenario == "session":
            rows = reuse_rows([t.records for t in turns])
            if scripted:
                rows += measure_rewrite(client, server, figures)
            print_reuse(rows, indent="    ")
            figures[scenario]["reuse"] = rows
    request_shapes(seen)
    return figures


def measure_rewrite(client: Client, server: Server, figures: dict) -> list[dict]:
    """What a rewrite of the client's environment block costs: after the session, a commit and a
    new session in its workspace (what changed against the session's prompt is the client's fresh
    environment, Claude Code's git status say), then another new session with nothing changed but
    its text. The second one's prefill is what a new session's turn costs by itself; the first
    one's prefill beyond that is the rewrite's."""
    edit_and_commit(client, len(SESSION_PROMPTS))
    turns = [run_turn(client, server, f"[[script:hello]] {p}", first=True, read=False) for p in NEW_SESSION_PROMPTS]
    figures["new sessions"] = turn_figures("new sessions (after a commit, then unchanged)", turns)
    if not all(t.records for t in turns):
        return []
    changed, unchanged = (conversation(t.records)[-1] for t in turns)
    return rewrite_cost(changed, unchanged)


REQUEST_FIGURES = (
    "api",
    "prompt_tokens",
    "image_blocks",
    "cached_tokens",
    "prefilled_tokens",
    "replayed_tokens",
    "completion_tokens",
    "finish",
)


def versions(clients: Path) -> dict[str, str]:
    found = {}
    for name, package in PACKAGES.items():
        manifest = clients / "node_modules" / package / "package.json"
        declared = json.loads(manifest.read_text())["version"] if manifest.exists() else "not installed"
        shown = subprocess.run(
            [str(clients / "node_modules" / ".bin" / name), "--version"], capture_output=True, text=True, timeout=60
        )
        print(f"{package} {declared} ({shown.stdout.strip() or shown.stderr.strip()})")
        found[name] = declared
    return found


def server_command(kind: str, root: Path, name: str, model: Path | None = None) -> list[str]:
    if kind == "scripted":
        return ["tests.serving.scripted_server", "--scripts", str(root / "scripts.json"), "--vision"]
    chosen = ["-m", str(model)] if model is not None else []
    return ["dwarfstar", "serve", "--ctx", str(BUNDLED_CTX[name]), "--model-alias", "*", *chosen]


def check(
    kind: str, names: list[str], clients: Path, root: Path, model: Path | None = None, scenarios=SCENARIOS
) -> dict:
    """Every client through the scenarios on one kind of server: one scripted server for all of
    them, or one bundled-model server per client (its own context, and a cache of its own)."""
    root.mkdir(parents=True)
    if kind == "scripted":
        (root / "scripts.json").write_text(json.dumps(scripts(root)))
    figures, server = {}, None
    try:
        for name in names:
            if server is None or kind == "bundled":
                label = "scripted" if kind == "scripted" else name
                command = [sys.executable, "-m", *server_command(kind, root, name, model)]
                server = start_server(command, root / f"{label}.jsonl", root / f"{label}.log")
            print(f"{name} against the {kind} server:", flush=True)
            figures[name] = run_scenarios(name, clients, root, server, scripted=kind == "scripted", scenarios=scenarios)
            if kind == "bundled":
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=Path, default=ROOT / "build" / "clients")
    parser.add_argument("--only", nargs="*", choices=list(PACKAGES), default=list(PACKAGES))
    parser.add_argument(
        "--servers", nargs="+", choices=("scripted", "bundled"), default=["scripted"], help="bundled: the bundled model"
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--model", type=Path, default=None, help="the bundled servers' model (default: bundled)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures (per scenario, per turn) here")
    parser.add_argument("--keep", type=Path, default=None, help="work in this new folder and keep it (traces, logs)")
    args = parser.parse_args()
    clients = args.clients.resolve()
    figures: dict = {"versions": versions(clients)}
    with tempfile.TemporaryDirectory(prefix="dwarfstar-clients-") as folder:
        root = args.keep.resolve() if args.keep else Path(folder)
        for kind in args.servers:
            figures[kind] = check(kind, args.only, clients, root / kind, args.model, tuple(args.scenarios))
    failed = [
        f"{name} {scenario} ({kind})"
        for kind in args.servers
        for name, scenarios in figures[kind].items()
        for scenario, outcome in scenarios.items()
        if not outcome["pass"]
    ]
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    print("FAILED: " + "; ".join(failed) if failed else "all client checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
