"""`dwarfstar pull` on huggingface_hub, against a hub on loopback that answers as Hugging Face does
(HEAD/GET on /{repo}/resolve/{rev}/{file}: a redirect to a CDN host with X-Repo-Commit, X-Linked-Etag
and X-Linked-Size), refuses bad tokens, supports Range and drops connections. Nothing leaves loopback."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from huggingface_hub import constants as hf_constants
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.hub import DEFAULT_MODEL_LINK, REPO, TARGETS, HubError

_register_commands()
runner = CliRunner()
GOOD_TOKEN = "hf_good"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
Q2 = TARGETS["q2-imatrix"].files[0]
MTP = TARGETS["mtp"].files[0]
PRO_Q4 = TARGETS["pro-q4-split"].files
CHUNK = 1 << 20


@dataclass
class Hub:
    files: dict[str, bytes] = field(default_factory=dict)
    drops: int = 0  # CDN answers still to cut off halfway
    cdn_status: int = 200  # anything else: the CDN fails every GET with it
    wrong_hash: bool = False
    requests: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)  # method, path, auth, range


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
            hub.requests.append((self.command, self.path, auth, self.headers.get("Range")))
            if self.path.startswith(prefix):  # the hub: check the token, redirect to the CDN
                name = self.path[len(prefix) :]
                if auth != f"Bearer {GOOD_TOKEN}":
                    return self.empty(401)
                if name not in hub.files:
                    return self.empty(404, **{"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
                data = hub.files[name]
                digest = hashlib.sha256(b"x" if hub.wrong_hash else data).hexdigest()
                # the CDN is another host name for this same server: the token must not follow the redirect
                cdn = f"http://localhost:{self.server.server_port}/cdn/{name}?signed=1"
                linked = {"X-Repo-Commit": COMMIT, "X-Linked-Size": len(data), "X-Linked-Etag": f'"{digest}"'}
                return self.empty(302, Location=cdn, ETag='"git-blob-sha1"', **linked)
            name = self.path.removeprefix("/cdn/").split("?")[0]
            if auth is not None:  # signed CDN URLs refuse a second credential
                return self.empty(400)
            if hub.cdn_status != 200:
                return self.empty(hub.cdn_status)
            data = hub.files[name]
            start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
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
    state = Hub(files={Q2: os.urandom(3 << 20) + b"end", PRO_Q4[0]: b"first part", PRO_Q4[1]: b"second part"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("DWARFSTAR_HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # read at import otherwise
    # huggingface_hub writes whole chunks (10 MiB): 1 MiB ones let a 3 MiB file show where a resume starts
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("DS4_GGUF_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    yield state
    server.shutdown()
    server.server_close()


def pull(*args: str):
    return runner.invoke(app, ["pull", *args])


def cdn_gets(hub: Hub) -> list[str | None]:
    """The Range header of each GET the CDN answered."""
    return [rng for method, path, _, rng in hub.requests if method == "GET" and path.startswith("/cdn/")]


def test_a_dropped_connection_resumes_into_the_hf_cache_and_links_the_default(hub, tmp_path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(GOOD_TOKEN + "\n")  # the token file `hf auth login` writes
    hub.drops = 1
    done = pull("q2-imatrix")
    assert done.exit_code == 0, done.output
    link = tmp_path / "gguf" / Q2
    assert link.is_symlink() and link.read_bytes() == hub.files[Q2]
    cache = tmp_path / "hf" / "hub" / "models--antirez--deepseek-v4-gguf"
    assert link.resolve() == cache / "blobs" / hashlib.sha256(hub.files[Q2]).hexdigest()
    # the first answer stopped halfway, after one whole chunk: the second asks for the rest from there
    assert len(hub.files[Q2]) // 2 // CHUNK == 1 and cdn_gets(hub) == [None, f"bytes={CHUNK}-"]
    assert all(auth is None for _, path, auth, _ in hub.requests if path.startswith("/cdn/"))  # token stays on the hub
    assert os.readlink(DEFAULT_MODEL_LINK) == os.path.join("gguf", Q2)  # ds4's link, to ds4's file name

    listed = pull("--list")
    assert "q2-imatrix" in listed.output and "downloaded" in listed.output and "default" in listed.output
    again = pull("q2-imatrix")
    assert again.exit_code == 0 and "already downloaded" in again.output and len(cdn_gets(hub)) == 2


def test_a_file_in_the_shared_cache_is_not_fetched_again(hub, tmp_path) -> None:
    assert pull("q2-imatrix", "--token", GOOD_TOKEN).exit_code == 0
    other_dir = pull("q2-imatrix", "--token", GOOD_TOKEN, "--dir", str(tmp_path / "elsewhere"))
    assert other_dir.exit_code == 0, other_dir.output
    assert (tmp_path / "elsewhere" / Q2).read_bytes() == hub.files[Q2]
    assert len(cdn_gets(hub)) == 1  # the second directory links the cached blob


def test_the_pro_split_target_fetches_both_parts_and_leaves_the_default(hub, tmp_path) -> None:
    done = pull("pro-q4-split", "--token", GOOD_TOKEN)
    assert done.exit_code == 0, done.output
    assert [(tmp_path / "gguf" / f).read_bytes() for f in PRO_Q4] == [b"first part", b"second part"]
    assert not DEFAULT_MODEL_LINK.is_symlink()  # as download_model.sh: a split target does not update it
    assert PRO_Q4 == ("DeepSeek-V4-Pro-Q4K-Layers00-30.gguf", "DeepSeek-V4-Pro-Q4K-Layers-31-output.gguf")


def test_missing_file_bad_token_offline_and_no_network(hub, tmp_path, monkeypatch) -> None:
    missing = pull("mtp", "--token", GOOD_TOKEN)
    assert isinstance(missing.exception, HubError) and "HTTP 404" in str(missing.exception)

    refused = pull("q2-imatrix", "--token", "hf_wrong")
    assert isinstance(refused.exception, HubError)
    assert "refused the token from --token (HTTP 401)" in str(refused.exception)
    anonymous = pull("q2-imatrix")
    assert "pass --token or set HF_TOKEN" in str(anonymous.exception)

    hub.cdn_status = 503
    failing = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(failing.exception, HubError) and "answered HTTP 503" in str(failing.exception)
    assert not (tmp_path / "gguf" / Q2).exists()

    with monkeypatch.context() as patch:
        patch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        offline = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(offline.exception, HubError) and "HF_HUB_OFFLINE is set" in str(offline.exception)

    monkeypatch.setenv("DWARFSTAR_HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with monkeypatch.context() as patch:  # huggingface_hub backs off 23 s in all before it gives up
        patch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)
        unreachable = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(unreachable.exception, HubError) and "cannot reach 127.0.0.1:9" in str(unreachable.exception)

    unknown = pull("q3")
    assert "unknown model 'q3'" in str(unknown.exception)


def test_a_full_disk_is_refused_before_downloading_and_a_bad_hash_is_caught(hub, tmp_path, monkeypatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr("dwarfstar.model.hub.shutil.disk_usage", lambda path: SimpleNamespace(free=1000))
        full = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(full.exception, HubError) and "not enough disk space" in str(full.exception)
    assert cdn_gets(hub) == []

    hub.wrong_hash = True
    corrupt = pull("q2-imatrix", "--token", GOOD_TOKEN)
    assert isinstance(corrupt.exception, HubError) and "does not match" in str(corrupt.exception)
    assert not (tmp_path / "gguf" / Q2).exists()
    assert not any((tmp_path / "hf" / "hub").rglob(hashlib.sha256(b"x").hexdigest()))  # removed from the cache
