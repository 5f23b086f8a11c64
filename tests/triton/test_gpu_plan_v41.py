"""`dwarfstar bench gpu-plan --preset v41`: V4.1's uncaptured decode step on the meta device, its launches
per layer as the layer modes imply, its host-device waits and Engram host reads, and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.model.config_v41 import ModelArgs41

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plan6(tmp_path_factory) -> tuple[dict, str]:
    # Flash's layout scaled to 6 layers: window, window (Engram), ratio-2 kv source (Engram), ratio-2
    # reuse, ratio-1 kv source (the candidate source), ratio-1 reuse
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    flags = ("--preset", "v41", "--ctx", "2048", "--layers", "6", "--no-compile", "--json", str(out))
    result = _run("dwarfstar.backends.triton.plan", *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_layer_modes_in_the_recorded_step(plan6):
    plan, _ = plan6
    layers = plan["per_layer"]
    assert [(r["mode"], r["ratio"], r["engram"]) for r in layers] == [
        ("window", 0, False), ("window", 0, True), ("full", 2, True), ("reuse", 2, False), ("full", 1, False),
        ("reuse", 1, False),
    ]  # fmt: skip
    window, window_engram, full2, reuse2, full1, reuse1 = layers
    # each sublayer's mHC steps are one launch (the post before it, its mix, its collapse and norm:
    # `hc_mix.hc_post_mix`); a post runs alone only before an Engram layer (its gate reads the new
    # streams) and after the last layer (for the head): in the layer whose FFN it follows
    for r in layers:
        hc = {k: v for k, v in r["kernels"].items() if k.startswith("_hc_")}
        alone = r is reuse1 or layers[r["layer"] + 1]["engram"]
        assert hc == {"_hc_pre_fused_kernel": 2} | ({"_hc_post_kernel": 1} if alone else {}), r
    # a reuse layer owns the window layer's matrices and nothing else (no compressor, no indexer): the same
    # kernels; it only picks rows it does not own
    assert reuse2["kernels"] | {"_hc_post_kernel": 1} == reuse1["kernels"] == window["kernels"]
    # measured: a window layer's step is 14 Triton launches (6 projections, 2 norms, attention, 2 mHC, the
    # route and 2 expert kernels), a kv source's more
    assert [r["triton"] for r in layers] == [15, 18, 25, 14, 26, 15]
    assert (plan["totals"]["triton_launches"], plan["totals"]["torch_launches"]) == (116, 115)
    for layer in (window, reuse2, reuse1):
        assert "_frontier_kernel" not in layer["kernels"] and "_scores_kernel" not in layer["kernels"]
    # a kv source compresses (ratio 2 pools pairs in the compressor's kernel; ratio 1 keeps each latent)
    # and scores its rows with its own indexer: more launches than a window layer
    assert full2["kernels"].get("_frontier_kernel") == 1 and "_frontier_kernel" not in full1["kernels"]
    assert full2["kernels"]["_scores_kernel"] == full1["kernels"]["_scores_kernel"] == 1
    assert full2["triton"] > window["triton"] and full1["triton"] > window["triton"]
    # the call's tables (its positions uploaded, the RoPE angles, the window's index) are built once, in the
    # first layer; every other layer's window takes one launch (its rows appended: past the first window a
    # decode step's window is those rows, no gather), and a reuse layer picks nothing of its own: it reads
    # its source's gathered rows
    assert window["uploads"] == 1 and window["torch"] > reuse1["torch"]
    assert reuse2["torch"] == reuse1["torch"] == 1
    assert full1["torch"] > reuse1["torch"] and full2["torch"] > reuse2["torch"]  # the top-k selection, the pick
    # the Engram layer adds its step before the block: the rows' rounding, their projection and the gate,
    # and one upload (the rows, from the host)
    extra = Counter(window_engram["kernels"]) - Counter(window["kernels"])
    assert extra == Counter({"_rms_norm_rope_kernel": 1, "_qmatmul_kernel": 1, "_engram_gate_kernel": 1})
    assert window_engram["uploads"] == reuse1["uploads"] + 1 == 1
    assert sum(r["triton"] + r["torch"] for r in layers) < plan["totals"]["launches"]  # embedding, head, draw


def test_uncaptured_waits_and_engram_host_reads(plan6):
    plan, text = plan6
    totals = plan["totals"]
    assert plan["captured"] is False and totals["captured"] is False
    assert "UNCAPTURED" in text and "MODEL" in plan["note"]
    # per token, 2 Engram layers x 24 rows (8 heads x the 2-, 3- and 4-grams) of 264 B, read on the host
    args = ModelArgs41()
    rows = len(args.engram_layers) * (args.engram_max_ngram - 1) * args.engram_n_heads
    assert (totals["engram_host_rows"], totals["engram_host_bytes"]) == (48, 48 * ROW_BYTES) == (rows, rows * 264)
    # and uploaded as bf16 (2 B per value, 256 values a row), besides the positions
    assert totals["upload_bytes"] >= rows * 256 * 2
    # outside the layers: the token id to embed and the sampler's knobs (the first sublayer's one-hot pre
    # stays on the device from the step before); inside: the positions once, the Engram rows
    assert totals["uploads"] == sum(r["uploads"] for r in plan["per_layer"]) + 2 == 1 + 2 + 2
    # no layer reads a device value on the host; the drawn token is read once, a value the meta device
    # cannot know
    assert totals["host_syncs"] == 1 and totals["blind_host_syncs"] == 1
    # every wait ends a stretch of launches; the step's last act is the draw's read
    assert totals["stretches"] == totals["uploads"] + totals["host_syncs"]
    # host-bound: the step is at least its host time (no graph hides a launch)
    assert totals["predicted_ms_per_step"] >= totals["host_ms_per_step"] > 0
    assert totals["predicted_ms_per_step"] >= totals["device_ms_per_step"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--batch", "2"), "one after another"),
        (("--precision", "fast"), "exact only"),
        (("--layers", "3"), "at least 4 layers"),
        (("--preset", "v42"), "flash, pro or v41"),
    ],
)
def test_refusals(flags, message):
    result = _run("dwarfstar", "bench", "gpu-plan", "--preset", "v41", "--no-compile", *flags)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
