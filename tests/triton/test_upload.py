"""Uploading a model file releases its mapped pages tensor by tensor, so where the GPU shares RAM
with the CPU the file and its device copy are never both resident."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dwarfstar.backends.triton.weights import upload
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")


def mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path`, from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("upload") / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, layout="ds4", seed=0)
    return path


def resident_after_upload(path: Path) -> tuple[int, int]:
    """(resident bytes of the file's tensor data after uploading it to the CPU, bytes of its tensors).

    The header (metadata and tensor directory, all parsed) stays resident and is not counted."""
    model = open_model(path)
    try:
        weights = upload(model.gguf, model.args, "cpu")
        assert weights.nbytes > 0
        header = min(info.offset for info in model.gguf.tensors.values())
        return mapped_rss(path) - header, sum(info.nbytes for info in model.gguf.tensors.values())
    finally:
        model.gguf.close()


def test_upload_releases_every_tensor_page(model_path):
    resident, tensor_bytes = resident_after_upload(model_path)
    assert tensor_bytes > 50 * 2**20
    # what stays: pages the kernel maps around each fault (fault-around), 64 KB next to each tensor
    assert resident < 0.05 * tensor_bytes


def test_without_release_the_file_stays_resident(model_path, monkeypatch):
    """The control: the same upload keeping the pages holds the whole file, so the check above can fail."""
    monkeypatch.setattr(GGUFFile, "release", lambda self, name: None)
    resident, tensor_bytes = resident_after_upload(model_path)
    assert resident > 0.9 * tensor_bytes
