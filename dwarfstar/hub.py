"""Model files: ds4's published GGUFs on the Hugging Face hub, resumable downloads, the default model.

The targets and file names are those of ds4's `download_model.sh` (repository
`antirez/deepseek-v4-gguf`). Downloads go to `<dir>/<file>.part` and are renamed when complete and
checked, so an interrupted download resumes with an HTTP Range request, in this run (after a
dropped connection) or the next (after an error). The size and SHA-256 come from the hub's
`X-Linked-Size` / `X-Linked-Etag` headers when it sends them (it does for LFS files); the hash is
checked in one pass over the finished file, so resuming never needs an earlier run's hash state.

As `download_model.sh` does, a main-model download points `./ds4flash.gguf` at the file, and that
link is the default model of every command; without it, the bundled model is.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError

REPO = "antirez/deepseek-v4-gguf"
DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV = ("DWARFSTAR_HF_ENDPOINT", "HF_ENDPOINT")
DEFAULT_MODEL_LINK = Path("ds4flash.gguf")
READ_BYTES = 1 << 20
TIMEOUT_S = 60
MAX_REDIRECTS = 10
SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Target:
    name: str
    files: tuple[str, ...]
    approx_gb: float  # from download_model.sh, for --list without a network
    links_default: bool  # a main model: ./ds4flash.gguf points at it after the download
    about: str


_Q2 = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf"
_Q2_Q4 = (
    "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8"
    "-chat-v2-imatrix-fixed.gguf"
)
_Q4 = "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf"
_PRO_Q2 = "DeepSeek-V4-Pro-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-Instruct-imatrix.gguf"
_PRO_Q4_A = "DeepSeek-V4-Pro-Q4K-Layers00-30.gguf"
_PRO_Q4_B = "DeepSeek-V4-Pro-Q4K-Layers-31-output.gguf"
_MTP = "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("q2-imatrix", (_Q2,), 81, True, "Flash, 2-bit routed experts; for 96-128 GB machines"),
        Target("q2-q4-imatrix", (_Q2_Q4,), 98, True, "Flash, 2-bit experts but 4-bit in the last 6 layers"),
        Target("q4-imatrix", (_Q4,), 153, True, "Flash, 4-bit routed experts; for 256 GB machines"),
        Target("pro-q2-imatrix", (_PRO_Q2,), 430, True, "PRO, 2-bit routed experts; for 512 GB machines"),
        Target("pro-q4-layers00-30", (_PRO_Q4_A,), 426, False, "PRO Q4, first half (layers 0-30)"),
        Target("pro-q4-layers31-output", (_PRO_Q4_B,), 412, False, "PRO Q4, second half (layers 31-output)"),
        Target("pro-q4-split", (_PRO_Q4_A, _PRO_Q4_B), 838, False, "both PRO Q4 halves"),
        Target("mtp", (_MTP,), 3.5, False, "optional MTP draft model for Flash (use with --mtp)"),
    )
}


class HubError(DwarfStarError):
    """A download that cannot go on: no network, missing file, refused token, full disk, bad hash."""


class _Retryable(Exception):
    """The connection failed or dropped: worth another try from where the file now ends."""


# -- the default model ----------------------------------------------------------------------------------
def resolve_model(model: Path | None) -> Path:
    """`-m` if given, else ./ds4flash.gguf (what `pull` links), else the bundled model."""
    if model is not None:
        return model
    if DEFAULT_MODEL_LINK.exists():
        return DEFAULT_MODEL_LINK
    try:
        from dwarfstar.model.bundled import default_model_path
    except ImportError:
        raise DwarfStarError(
            "no model given: pass -m MODEL.gguf, or download one with `dwarfstar pull q2-imatrix`"
        ) from None
    return default_model_path()


def link_default_model(file: Path, link: Path = DEFAULT_MODEL_LINK) -> None:
    if link.is_symlink() or link.exists():
        if not link.is_symlink():
            raise HubError(f"{link} exists and is not a link; move it away to make {file.name} the default")
        link.unlink()
    link.symlink_to(os.path.relpath(file.resolve(), link.resolve().parent))


# -- where and as whom -------------------------------------------------------------------------------------
def endpoint() -> str:
    for name in ENDPOINT_ENV:
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return DEFAULT_ENDPOINT


def file_url(file: str) -> str:
    return f"{endpoint()}/{REPO}/resolve/main/{urllib.parse.quote(file)}"


def find_token(explicit: str | None) -> tuple[str | None, str]:
    """The token and where it came from: --token, HF_TOKEN, or the token file `hf auth login` writes."""
    if explicit:
        return explicit, "--token"
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"], "HF_TOKEN"
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    cached = hf_home / "token"
    try:
        token = cached.read_text(encoding="utf-8").strip()
    except OSError:
        return None, "none"
    return (token, str(cached)) if token else (None, "none")


# -- HTTP ------------------------------------------------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None  # followed by hand in `_open`, to control which host sees the token


_opener = urllib.request.build_opener(_NoRedirect)


def _open(url: str, token: str | None, method: str = "GET", start: int = 0) -> tuple[http.client.HTTPResponse, list]:
    """Open `url`, following redirects; returns the answer and the headers of the redirects on the way.

    The token goes only to the hub's own host, never to a CDN it redirects to (signed CDN URLs
    refuse a second credential)."""
    hub_host = urllib.parse.urlsplit(url).netloc
    redirects = []
    for _ in range(MAX_REDIRECTS):
        request = urllib.request.Request(url, method=method)
        if token and urllib.parse.urlsplit(url).netloc == hub_host:
            request.add_header("Authorization", f"Bearer {token}")
        if start:
            request.add_header("Range", f"bytes={start}-")
        try:
            return _opener.open(request, timeout=TIMEOUT_S), redirects
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code not in (301, 302, 303, 307, 308) or not exc.headers.get("Location"):
                raise
            redirects.append(exc.headers)
            url = urllib.parse.urljoin(url, exc.headers["Location"])
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"cannot reach {urllib.parse.urlsplit(url).netloc}: {reason}") from None
    raise HubError(f"too many redirects for {url}")


def _http_error(exc: urllib.error.HTTPError, file: str, token_source: str) -> HubError:
    if exc.code == 404:
        return HubError(f"{file} is not in {REPO} at {endpoint()} (HTTP 404)")
    if exc.code in (401, 403):
        if token_source == "none":
            return HubError(f"{endpoint()} refused access (HTTP {exc.code}): pass --token or set HF_TOKEN")
        return HubError(f"{endpoint()} refused the token from {token_source} (HTTP {exc.code}): check it")
    return HubError(f"{endpoint()} answered HTTP {exc.code} {exc.reason} for {file}")


@dataclass(frozen=True)
class RemoteFile:
    size: int | None
    sha256: str | None


def probe(file: str, token: str | None, token_source: str) -> RemoteFile:
    """Size and SHA-256 of `file` on the hub: its LFS headers (on the redirect), else Content-Length."""
    try:
        response, redirects = _open(file_url(file), token, method="HEAD")
    except urllib.error.HTTPError as exc:
        raise _http_error(exc, file, token_source) from None
    response.close()
    size = sha = None
    for headers in [*redirects, response.headers]:
        if headers.get("X-Linked-Size"):
            size = int(headers["X-Linked-Size"])
        etag = (headers.get("X-Linked-Etag") or "").removeprefix("W/").strip('"').lower()
        if SHA256.fullmatch(etag):
            sha = etag
    if size is None and response.headers.get("Content-Length"):
        size = int(response.headers["Content-Length"])
    return RemoteFile(size, sha)


# -- downloading --------------------------------------------------------------------------------------------------
Progress = Callable[[str, int, int | None], None]  # (phase "download" or "verify", bytes done, total or None)


def _check_space(part: Path, missing: int) -> None:
    free = shutil.disk_usage(part.parent).free
    if missing > free:
        kept = f"; the partial file {part} is kept" if part.exists() else ""
        raise HubError(
            f"not enough disk space in {part.parent}: {missing / 1e9:.2f} GB still to download, "
            f"{free / 1e9:.2f} GB free{kept}"
        )


def _fetch_rest(
    file: str, part: Path, remote: RemoteFile, token: str | None, token_source: str, on_progress: Progress
) -> None:
    """One request for what `part` still lacks; raises _Retryable when the connection fails or drops."""
    have = part.stat().st_size if part.exists() else 0
    if remote.size is not None:
        if have == remote.size:
            return
        if have > remote.size:
            have = 0  # not a prefix of this file: start over
        _check_space(part, remote.size - have)
    try:
        response, _ = _open(file_url(file), token, start=have)
    except urllib.error.HTTPError as exc:
        raise _http_error(exc, file, token_source) from None
    with response:
        if response.status != 206 or not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            have = 0  # the server ignored the Range: the answer is the whole file
        length = response.headers.get("Content-Length")
        end = have + int(length) if length else remote.size
        done = have
        with part.open("r+b" if have else "wb") as out:
            out.seek(have)
            out.truncate()
            try:
                while block := response.read(READ_BYTES):
                    out.write(block)
                    done += len(block)
                    on_progress("download", done, remote.size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise HubError(
                        f"disk full after {done / 1e9:.2f} GB of {file}; the partial file {part} is kept: "
                        "free some space and run the same command to resume"
                    ) from None
                raise _Retryable(f"connection lost after {done} bytes: {exc}") from None
            except http.client.HTTPException as exc:
                raise _Retryable(f"connection lost after {done} bytes: {exc!r}") from None
    if end is not None and done < end:
        raise _Retryable(f"connection closed after {done} of {end} bytes")


def _sha256(path: Path, on_progress: Progress) -> str:
    digest = hashlib.sha256()
    done, total = 0, path.stat().st_size
    with path.open("rb") as f:
        while block := f.read(READ_BYTES * 8):
            digest.update(block)
            done += len(block)
            on_progress("verify", done, total)
    return digest.hexdigest()


def download(
    file: str,
    out_dir: Path,
    token: str | None,
    token_source: str,
    retries: int = 5,
    on_progress: Progress = lambda phase, done, total: None,
    retry_wait_s: float = 1.0,
) -> Path:
    """Download `file` into `out_dir` (resuming a `.part` left by an earlier run); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final, part = out_dir / file, out_dir / (file + ".part")
    if final.exists():
        return final
    remote: RemoteFile | None = None
    for attempt in range(retries + 1):
        try:
            remote = remote or probe(file, token, token_source)
            _fetch_rest(file, part, remote, token, token_source, on_progress)
            break
        except _Retryable as exc:
            if attempt == retries:
                kept = f"; {part.stat().st_size} bytes kept in {part}, run again to resume" if part.exists() else ""
                raise HubError(f"{exc}{kept}") from None
            time.sleep(retry_wait_s * 2**attempt)
    size = part.stat().st_size
    if remote.size is not None and size != remote.size:
        raise HubError(f"{part} has {size} bytes, the hub says {remote.size}; delete it and try again")
    if remote.sha256 is not None:
        actual = _sha256(part, on_progress)
        if actual != remote.sha256:
            part.unlink()
            raise HubError(f"{file}: SHA-256 {actual} does not match the hub's {remote.sha256}; deleted, try again")
    part.rename(final)
    return final
