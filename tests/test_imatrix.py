"""Imatrix collection (per expert, only routed tokens), the .dat format, and prompt files."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.cli import main
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.quant.imatrix import Imatrix, ImatrixCollector, ImatrixError, read_imatrix, write_imatrix
from dwarfstar.quant.prompts import PromptText, read_prompts, tokenize_prompt
from dwarfstar.tokenizer.tokenizer import Tokenizer

PROMPTS = ["Explain B-tree insertion, including splits.", "Write a haiku about the sea.", "What is 17 * 23?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("imatrix") / "tiny.gguf"
    write_synthetic_model(path, TINY, layout="f32", seed=1)
    return path


def test_collector_means_over_routed_rows_only() -> None:
    collector = ImatrixCollector(TINY)
    rows = torch.tensor([[1.0] * TINY.dim, [3.0] * TINY.dim])
    collector(2, "ffn_up_exps.weight", 5, rows)
    collector(2, "ffn_up_exps.weight", 5, rows[:1] * 2)
    collector(2, "ffn_down_exps.weight", 1, torch.full((1, TINY.moe_inter_dim), 0.5))
    result = collector.result(chunks=1, dataset="d")
    up = result.entries["blk.2.ffn_up_exps.weight"].reshape(TINY.n_routed_experts, TINY.dim)
    assert torch.allclose(up[5], torch.full((TINY.dim,), (1 + 9 + 4) / 3))
    assert (up[:5] == 1).all() and (up[6:] == 1).all()  # experts no token reached: no preference
    down = result.entries["blk.2.ffn_down_exps.weight"].reshape(TINY.n_routed_experts, TINY.moe_inter_dim)
    assert torch.allclose(down[1], torch.full((TINY.moe_inter_dim,), 0.25))
    assert len(result.entries) == 3 * TINY.n_layers


def test_collection_follows_the_router(tiny: Path) -> None:
    model_file = open_model(tiny)
    tokenizer = Tokenizer.from_gguf_metadata(model_file.gguf.metadata)
    ids = [tokenize_prompt(PromptText(str(i), p, rendered=False), tokenizer) for i, p in enumerate(PROMPTS)]
    model = ReferenceModel(model_file)
    routed = {il: torch.zeros(TINY.n_routed_experts, dtype=torch.long) for il in range(TINY.n_layers)}

    def record(layer: int, chosen: torch.Tensor) -> None:
        routed[layer] += torch.bincount(chosen.flatten(), minlength=TINY.n_routed_experts)

    collector = ImatrixCollector(TINY)
    model.ops.route_observer, model.ops.expert_observer = record, collector
    for tokens in ids:
        model.forward(tokens, model.new_state())
    counts = dict(collector.counts)
    result = collector.result(len(ids), "prompts")
    for il in range(TINY.n_layers):
        for tensor in ("gate", "up", "down"):
            assert torch.equal(counts[f"blk.{il}.ffn_{tensor}_exps.weight"], routed[il])
        gate = result.entries[f"blk.{il}.ffn_gate_exps.weight"].reshape(TINY.n_routed_experts, -1)
        assert torch.equal(gate, result.entries[f"blk.{il}.ffn_up_exps.weight"].reshape(gate.shape))
        down = result.entries[f"blk.{il}.ffn_down_exps.weight"].reshape(TINY.n_routed_experts, TINY.moe_inter_dim)
        for e in range(TINY.n_routed_experts):
            assert ((gate[e] == 1).all() and (down[e] == 1).all()) == (routed[il][e] == 0)
    model_file.close()


def test_prompt_files_in_three_layouts(tiny: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(tiny)
    rendered = "<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜></think>"
    want = tokenizer.encode_with_specials(rendered)
    plain = tmp_path / "plain.txt"
    plain.write_text("Hi there\n\n" + rendered + "\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"id": "case_000", "prompt": "Hi there"}) + "\n" + json.dumps({"rendered": rendered}))
    ds4 = tmp_path / "rendered_prompts.txt"
    ds4.write_text(f"===== DS4_IMATRIX_PROMPT 1 nothink\n{rendered}\n\n===== DS4_IMATRIX_PROMPT 2\n  {rendered}\n")
    for path, n in ((plain, 2), (jsonl, 2), (ds4, 2)):
        prompts = read_prompts(path)
        assert len(prompts) == n
        assert all(tokenize_prompt(p, tokenizer) == want for p in prompts), path.name
    assert read_prompts(jsonl)[0].id == "case_000"
    assert want[:2] == [tokenizer.bos_id, tokenizer.token_id("<｜User｜>")] and want[-1] == tokenizer.token_id(
        "</think>"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(DwarfStarError, match="bad.jsonl:1: expected a string 'prompt'"):
        read_prompts(bad)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DwarfStarError, match="holds no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_dat_round_trip_and_llama_cpp_sums(tmp_path: Path) -> None:
    imatrix = Imatrix({"blk.0.ffn_up_exps.weight": torch.tensor([1.0, 2.5, 0.0, 4.0])}, chunks=7, dataset="set.txt")
    path = tmp_path / "a.dat"
    write_imatrix(path, imatrix)
    back = read_imatrix(path)
    assert back.chunks == 7 and back.dataset == "set.txt" and back.source == str(path)
    assert torch.equal(back.entries["blk.0.ffn_up_exps.weight"], imatrix.entries["blk.0.ffn_up_exps.weight"])
    # llama.cpp stores sums with ncall = the number of chunks: the reader divides, and the trailer is optional
    name = b"blk.1.attn_q_a.weight"
    sums = np.array([4.0, 8.0], dtype="<f4")
    (tmp_path / "b.dat").write_bytes(
        struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 4, 2) + sums.tobytes()
    )
    assert read_imatrix(tmp_path / "b.dat").entries["blk.1.attn_q_a.weight"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "truncated"),
        (struct.pack("<i", 0), "0 entries"),
        (b"GGUF" + bytes(40), "not an imatrix file"),
        (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 4) + bytes(8), "truncated"),
        (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 1) + struct.pack("<f", -1.0), "negative"),
    ],
)
def test_bad_dat_files(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "bad.dat"
    path.write_bytes(content)
    with pytest.raises(ImatrixError, match=problem):
        read_imatrix(path)


def test_imatrix_cli(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    out = tmp_path / "tiny.dat"
    monkeypatch.setattr(
        sys, "argv", ["dwarfstar", "imatrix", "-m", str(tiny), "--prompts", str(prompts), "-o", str(out)]
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    assert f"wrote {out}: {3 * TINY.n_layers} entries from 3 prompts" in capsys.readouterr().out
    result = read_imatrix(out)
    assert result.chunks == 3 and result.dataset == str(prompts)
    assert result.entries["blk.0.ffn_down_exps.weight"].numel() == TINY.n_routed_experts * TINY.moe_inter_dim
