"""Model files: ds4's published GGUFs on the Hugging Face hub, downloaded by `huggingface_hub`.

The targets and file names are those of ds4's `download_model.sh` (repository
`antirez/deepseek-v4-gguf`), PRO included: `pro-q2-imatrix` in one file, PRO Q4 as the split set
`pro-q4-layers00-30` + `pro-q4-layers31-output` (`pro-q4-split` fetches both; `dwarfstar.gguf.split`).

`hf_hub_download` does the transfer: Xet where the hub serves it, HTTP otherwise, a dropped
connection resumed with a Range request, the token, its progress bars, and the shared HF cache
(`HF_HOME` / `HF_HUB_CACHE`), so a file fetched once by any Hugging Face tool is not fetched again.
The download directory (`--dir`, ds4's `DS4_GGUF_DIR`) holds links into that cache under ds4's file
names. A file whose cache name is an LFS SHA-256 is hashed once more when complete: the HTTP path
checks only the size.

As `download_model.sh` does, a main-model download points `./ds4flash.gguf` at the file, and that
link is the default model of every command; without it, the bundled model is.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError

REPO = "antirez/deepseek-v4-gguf"
REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV = ("DWARFSTAR_HF_ENDPOINT", "HF_ENDPOINT")
DEFAULT_MODEL_LINK = Path("ds4flash.gguf")
READ_BYTES = 8 << 20
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
        Target("pro-q4-layers00-30", (_PRO_Q4_A,), 426, False, "PRO Q4, first part (layers 0-30): a first stage"),
        Target("pro-q4-layers31-output", (_PRO_Q4_B,), 412, False, "PRO Q4, second part (31-output): a last stage"),
        Target("pro-q4-split", (_PRO_Q4_A, _PRO_Q4_B), 838, False, "both PRO Q4 parts, for one machine"),
        Target("mtp", (_MTP,), 3.5, False, "optional MTP draft model for Flash (use with --mtp)"),
    )
}


class HubError(DwarfStarError):
    """A download that cannot go on: no network, missing file, refused token, full disk, bad hash."""


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
    # to the download directory's name for the file, not through it into the HF cache's blob names
    link.symlink_to(os.path.relpath(os.path.abspath(file), os.path.dirname(os.path.abspath(link))))


# -- where and as whom -------------------------------------------------------------------------------------
def endpoint() -> str:
    for name in ENDPOINT_ENV:
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return DEFAULT_ENDPOINT


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


def _hub_error(exc: BaseException, file: str, token_source: str) -> HubError:
    """What went wrong, from the chain `huggingface_hub` raises (it wraps HEAD failures in
    LocalEntryNotFoundError, with the HTTP or connection error as the cause)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return HubError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it and run again")
    http = next((e for e in chain if isinstance(e, HfHubHTTPError) and e.response is not None), None)
    if http is not None:
        status = http.response.status_code
        if status == 404:
            return HubError(f"{file} is not in {REPO} at {endpoint()} (HTTP 404)")
        if status in (401, 403):
            if token_source == "none":
                return HubError(f"{endpoint()} refused access (HTTP {status}): pass --token or set HF_TOKEN")
            return HubError(f"{endpoint()} refused the token from {token_source} (HTTP {status}): check it")
        return HubError(f"{endpoint()} answered HTTP {status} for {file}")
    transport = next((e for e in chain if isinstance(e, httpx2.TransportError)), None)
    if isinstance(transport, httpx2.ConnectError):
        return HubError(f"cannot reach {urllib.parse.urlsplit(endpoint()).netloc}: {transport}")
    if transport is not None:
        return HubError(f"connection lost downloading {file} ({transport}); run the same command again")
    return HubError(f"downloading {file} failed: {exc}")


# -- downloading --------------------------------------------------------------------------------------------------
Progress = Callable[[int, int], None]  # the SHA-256 check: (bytes hashed, total)


def _check_space(cache: Path, size: int, file: str) -> None:
    """huggingface_hub only warns; a 400 GB download that cannot fit should not start."""
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if size > free:
        raise HubError(f"not enough disk space in {cache} for {file}: {size / 1e9:.2f} GB, {free / 1e9:.2f} GB free")


def _verify(cached: Path, file: str, on_progress: Progress) -> None:
    """Hash a blob named by its LFS SHA-256; a mismatch removes it from the cache, so a rerun fetches it again."""
    blob = cached.resolve()
    if not SHA256.fullmatch(blob.name):
        return
    digest, done, total = hashlib.sha256(), 0, blob.stat().st_size
    with blob.open("rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
            done += len(block)
            on_progress(done, total)
    if digest.hexdigest() != blob.name:
        blob.unlink()
        cached.unlink(missing_ok=True)
        raise HubError(f"{file}: SHA-256 {digest.hexdigest()} does not match the hub's {blob.name}; deleted, try again")


def download(
    file: str,
    out_dir: Path,
    token: str | None,
    token_source: str,
    on_progress: Progress = lambda done, total: None,
) -> Path:
    """Fetch `file` into the HF cache, check it, and link `out_dir/file` to it; returns that path."""
    # imported here, not at the top: every command resolves its model through this module, and only
    # a download needs the hub client (the GPU check's machine has no httpx2)
    import httpx2
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import hf_hub_download

    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / file
    if final.exists():
        return final
    cache = Path(hf_constants.HF_HUB_CACHE)
    common = dict(revision=REVISION, endpoint=endpoint(), token=token or False, cache_dir=cache)
    try:
        plan = hf_hub_download(REPO, file, dry_run=True, **common)
        if plan.will_download and plan.file_size is not None:
            _check_space(cache, plan.file_size, file)
        cached = Path(hf_hub_download(REPO, file, **common))
    except (OSError, httpx2.HTTPError, ValueError) as exc:  # HF errors are OSErrors; ValueError: over 50 GB sans Xet
        raise _hub_error(exc, file, token_source) from None
    _verify(cached, file, on_progress)
    if final.is_symlink():  # a link left dangling by an emptied cache
        final.unlink()
    final.symlink_to(cached)
    return final
