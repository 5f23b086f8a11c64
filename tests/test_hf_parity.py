"""Parity with an implementation nobody here wrote: transformers' DeepseekV4ForCausalLM.

Path: random HF model -> save_pretrained -> dwarfstar convert (f32) -> reference forward with the QAT
rounding off (transformers does not apply it). Configs follow the Flash layer pattern and prompts are
long enough (>= 300 tokens) to emit rows in ratio-4 and ratio-128 layers and to make the indexer pick
a strict subset of them.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.convert.hf import convert_checkpoint
from dwarfstar.model.loader import open_model

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    "tiny-flash": dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=128,
        partial_rotary_factor=32 / 128,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=4,
        sliding_window=8,
        compress_ratios=[0, 0, 4, 128, 4, 128],
        num_hash_layers=3,
        rope_parameters=YARN,
    ),
    "wider-partial-fp8-block": dict(
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=64,
        partial_rotary_factor=16 / 64,
        q_lora_rank=48,
        o_groups=4,
        o_lora_rank=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=48,
        index_n_heads=32,
        index_head_dim=64,
        index_topk=8,
        sliding_window=16,
        compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128],
        num_hash_layers=2,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
    ),
    "short-window-strong-yarn": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        head_dim=128,
        partial_rotary_factor=64 / 128,
        q_lora_rank=32,
        o_groups=1,
        o_lora_rank=64,
        n_routed_experts=4,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=3,
        sliding_window=4,
        compress_ratios=[0, 0, 4, 128],
        num_hash_layers=1,
        swiglu_limit=2.0,
        compress_rope_theta=40000.0,
        rope_parameters={**YARN, "factor": 4.0, "original_max_position_embeddings": 256},
    ),
}


def random_hf_model(config: dict, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(vocab_size=129280, **config)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # O(1) activations, so that every branch matters in the logits
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
                if name.endswith("scale"):
                    p.abs_().add_(0.1)
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for module in model.modules():
            if hasattr(module, "tid2eid"):
                ranks = torch.rand(cfg.vocab_size, cfg.n_routed_experts).argsort(1)
                module.tid2eid.copy_(ranks[:, : cfg.num_experts_per_tok])
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_transformers(name, tmp_path):
    hf = random_hf_model(CONFIGS[name], seed=len(name))
    hf.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "model.gguf", "f32")
    tokens = torch.randint(3, 128000, (320,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    ours = ReferenceModel(open_model(tmp_path / "model.gguf"), qat=False)
    state = ours.new_state()
    got = ours.forward(tokens, state)
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err < 1e-4, f"max abs logit error {err:.2e} x max |logit|"
    first_ratio4 = next(i for i, r in enumerate(CONFIGS[name]["compress_ratios"]) if r == 4)
    rows = len(state.rows(first_ratio4, "attn"))
    assert rows > CONFIGS[name]["index_topk"]  # the indexer really had to choose
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
