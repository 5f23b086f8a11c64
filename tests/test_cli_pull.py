"""`dwarfstar pull` against a hub on loopback that redirects to a CDN, drops connections and
supports Range, as Hugging Face does."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.hub import DEFAULT_MODEL_LINK, REPO, TARGETS, HubError

_register_commands()
runner = CliRunner()
GOOD_TOKEN = "hf_good"
Q2 = TARGETS["q2-imatrix"].files[0]
MTP = TARGETS["mtp"].files[0]


@dataclass
class Hub:
    files: dict[str, bytes] = field(default_factory=dict)
    drops: int = 0  # answers still to cut off halfway
    wrong_hash: bool = False
    requests: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # (path, auth, range)


def make_handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    prefix = f"/{REPO}/resolve/main/"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            auth = self.headers.get("Authorization")
            hub.requests.append((self.path, auth, self.headers.get("Range")))
            if self.path.startswith(prefix):  # the hub: check the token, redirect to the CDN
                name = self.path[len(prefix) :]
                if auth != f"Bearer {GOOD_TOKEN}":
                    return self.empty(401)
                if name not in hub.files:
                    return self.empty(404)
                data = hub.files[name]
                digest = hashlib.sha256(b"x" if hub.wrong_hash else data).hexdigest()
                # the CDN is another host name for this same server: the token must not follow the redirect
                cdn = f"http://localhost:{self.server.server_port}/cdn/{name}?signed=1"
                linked = {"X-Linked-Size": len(data), "X-Linked-Etag": f'"{digest}"'}
                return self.empty(302, Location=cdn, **linked)
            name = self.path.removeprefix("/cdn/").split("?")[0]
            if auth is not None:  # signed CDN URLs refuse a second credential
                return self.empty(400)
            data = hub.files[name]
            start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            if hub.drops:
                hub.drops -= 1
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def empty(self, status: int, **headers) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Iterator[Hub]:
    state = Hub(files={Q2: os.urandom(3 << 20) + b"end"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("DWARFSTAR_HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("DS4_GGUF_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    yield state
    server.shutdown()
    server.server_close()


def pull(*args: str):
    return runner.invoke(app, ["pull", *args])


def test_resume_after_a_failed_run_gives_the_same_bytes_and_links_the_default(hub, tmp_path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(GOOD_TOKEN + "\n")  # the token file `hf auth login` writes
    hub.drops = 1
    failed = pull("q2-imatrix", "--retries", "0")
    assert isinstance(failed.exception, HubError) and "run again to resume" in str(failed.exception)
    part = tmp_path / "gguf" / (Q2 + ".part")
    assert 0 < part.stat().st_size < len(hub.files[Q2])

    done = pull("q2-imatrix")
    assert done.exit_code == 0, done.output
    path = tmp_path / "gguf" / Q2
    assert path.read_bytes() == hub.files[Q2] and not part.exists()
    resumed = [r for r in hub.requests if r[0].startswith("/cdn/") and r[2]]
    assert resumed and resumed[0][2] == f"bytes={len(hub.files[Q2]) // 2}-"  # the first answer stopped halfway
    assert all(auth is None for p, auth, _ in hub.requests if p.startswith("/cdn/"))  # the token stays on the hub
    assert DEFAULT_MODEL_LINK.resolve() == path.resolve()

    listed = pull("--list")
    assert "q2-imatrix" in listed.output and "downloaded" in listed.output and "default" in listed.output


def test_a_dropped_connection_resumes_in_the_same_run(hub, tmp_path) -> None:
    hub.drops = 1
    done = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert done.exit_code == 0, done.output
    assert (tmp_path / "gguf" / Q2).read_bytes() == hub.files[Q2]
    assert sum(1 for p, _, r in hub.requests if p.startswith("/cdn/") and r) == 1


def test_missing_file_bad_token_and_no_network(hub, tmp_path, monkeypatch) -> None:
    missing = pull("mtp", "--token", GOOD_TOKEN)
    assert isinstance(missing.exception, HubError) and "HTTP 404" in str(missing.exception)
    assert not (tmp_path / "gguf" / (MTP + ".part")).exists()

    refused = pull("q2-imatrix", "--token", "hf_wrong")
    assert isinstance(refused.exception, HubError)
    assert "refused the token from --token (HTTP 401)" in str(refused.exception)
    anonymous = pull("q2-imatrix")
    assert "pass --token or set HF_TOKEN" in str(anonymous.exception)

    monkeypatch.setenv("DWARFSTAR_HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    offline = pull("q2-imatrix", "--token", GOOD_TOKEN, "--retries", "0")
    assert isinstance(offline.exception, HubError) and "cannot reach 127.0.0.1:9" in str(offline.exception)

    unknown = pull("q3")
    assert "unknown model 'q3'" in str(unknown.exception)


def test_disk_full_keeps_the_partial_file_and_a_bad_hash_is_caught(hub, tmp_path, monkeypatch) -> None:
    hub.drops = 1
    pull("q2-imatrix", "--token", GOOD_TOKEN, "--retries", "0")
    part = tmp_path / "gguf" / (Q2 + ".part")
    kept = part.read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr("dwarfstar.hub.shutil.disk_usage", lambda path: SimpleNamespace(free=1000))
        full = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(full.exception, HubError) and "not enough disk space" in str(full.exception)
    assert "partial file" in str(full.exception) and part.read_bytes() == kept

    hub.wrong_hash = True
    corrupt = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(corrupt.exception, HubError) and "does not match" in str(corrupt.exception)
    assert not part.exists() and not (tmp_path / "gguf" / Q2).exists()
