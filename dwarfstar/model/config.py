"""DeepSeek V4 hyperparameters: one dataclass, read from and written to `deepseek4.*` GGUF metadata.

The same `ModelArgs` describes Flash, PRO and the tiny models the tests build; only the numbers differ.
Key names and value types follow what ds4 reads and what llama.cpp insists on (spec §4.2 and §8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from dwarfstar.errors import ConfigError
from dwarfstar.gguf.constants import ValueType

ARCH = "deepseek4"
# the releases whose encoders differ in their reasoning-effort table (dwarfstar/prompt/efforts.py): the V4
# preview, Flash 0731 / PRO 0813 (the DSpark releases), V4.1 (think levels); EFFORTS_KEY: ours in our files
PREVIEW, DSPARK_RELEASES, V41 = "preview", "0731", "v4.1"
RELEASES = (PREVIEW, DSPARK_RELEASES, V41)
EFFORTS_KEY = "dwarfstar.reasoning_efforts"
DSPARK_STAGES = 3  # the DSpark drafter's V4 blocks in Flash 0731 and PRO 0813
EXPERT_GATING_SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS


@dataclass(frozen=True)
class LayerSpec:
    """What kind of block layer `index` is, derived from the config."""

    index: int
    compress_ratio: int  # 0 = raw window only, 4 = compressed + indexer, 128 = heavily compressed
    hash_routed: bool  # experts picked from the token-id table instead of the learned router
    rope_theta: float
    yarn: bool  # YaRN frequency interpolation applies only to compressed layers

    @property
    def has_indexer(self) -> bool:
        return self.compress_ratio == 4

    @property
    def compressor_overlap(self) -> int:
        """Ratio-4 compressors pool two half-width series over overlapping windows (c = 2)."""
        return 2 if self.compress_ratio == 4 else 1


@dataclass(frozen=True)
class ModelArgs:
    n_layers: int = 43
    dim: int = 4096
    vocab_size: int = 129280
    n_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    n_hash_layers: int = 3
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    window: int = 128
    compress_ratios: tuple[int, ...] = field(default_factory=lambda: flash_compress_ratios(43))
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1048576
    n_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    # the release whose reasoning-effort table the prompt follows (dwarfstar/prompt/efforts.py): ours
    # is written as `dwarfstar.reasoning_efforts`; a ds4 trunk of a DSpark release (Flash 0731, PRO
    # 0813) tells by its ratio array, which carries the drafter stages' entries after the layers'
    reasoning_efforts: str = PREVIEW

    def __post_init__(self) -> None:
        self.validate()

    # -- presets -----------------------------------------------------------------------------------
    @classmethod
    def flash(cls) -> ModelArgs:
        return cls()

    @classmethod
    def pro(cls) -> ModelArgs:
        return cls(
            n_layers=61,
            dim=7168,
            n_heads=128,
            q_lora_rank=1536,
            o_groups=16,
            n_routed_experts=384,
            moe_inter_dim=3072,
            route_scale=2.5,
            index_topk=1024,
            compress_ratios=pro_compress_ratios(61),
        )

    def with_(self, **changes: Any) -> ModelArgs:
        return replace(self, **changes)

    # -- derived -----------------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    @property
    def hc_mix_dim(self) -> int:
        """HC-pre produces [pre(n) | post(n) | comb(n*n)]."""
        return (2 + self.hc_mult) * self.hc_mult

    def layer(self, index: int) -> LayerSpec:
        ratio = self.compress_ratios[index]
        return LayerSpec(
            index=index,
            compress_ratio=ratio,
            hash_routed=index < self.n_hash_layers,
            rope_theta=self.compress_rope_theta if ratio else self.rope_theta,
            yarn=bool(ratio) and self.rope_factor > 1.0,
        )

    @property
    def layers(self) -> list[LayerSpec]:
        return [self.layer(i) for i in range(self.n_layers)]

    def validate(self) -> None:
        problems = []
        if len(self.compress_ratios) < self.n_layers:
            problems.append(f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        bad = sorted({r for r in self.compress_ratios if r not in (0, 4, 128)})
        if bad:
            problems.append(f"compress ratios must be 0, 4 or 128, got {bad}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            problems.append(f"rope_dim {self.rope_dim} must be even and fit in head_dim and index_head_dim")
        if self.n_heads % self.o_groups:
            problems.append(f"{self.n_heads} heads do not split into {self.o_groups} output groups")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            problems.append(f"{self.n_activated_experts} active experts of {self.n_routed_experts}")
        if self.n_hash_layers > self.n_layers:
            problems.append(f"{self.n_hash_layers} hash layers in a {self.n_layers}-layer model")
        if self.index_head_dim & (self.index_head_dim - 1):
            problems.append(f"indexer head dim {self.index_head_dim} must be a power of two (Hadamard transform)")
        if self.reasoning_efforts not in RELEASES:
            problems.append(f"reasoning efforts of release {self.reasoning_efforts!r}, not one of {RELEASES}")
        if problems:
            raise ConfigError("invalid DeepSeek V4 config: " + "; ".join(problems))

    # -- GGUF metadata -----------------------------------------------------------------------------
    def to_gguf_metadata(self) -> dict[str, tuple[ValueType, Any]]:
        """`deepseek4.*` keys with the exact value types llama.cpp accepts (u32 counts, f32 floats).

        Arrays are written as (ValueType.ARRAY, (item_type, values)).
        """
        u32, f32 = ValueType.UINT32, ValueType.FLOAT32
        meta: dict[str, tuple[ValueType, Any]] = {"general.architecture": (ValueType.STRING, ARCH)}
        for key, (attr, vtype) in _SCALAR_KEYS.items():
            meta[f"{ARCH}.{key}"] = (vtype, getattr(self, attr))
        meta[f"{ARCH}.attention.head_count_kv"] = (u32, 1)
        meta[f"{ARCH}.attention.value_length"] = (u32, self.head_dim)
        meta[f"{ARCH}.expert_weights_norm"] = (ValueType.BOOL, True)
        meta[f"{ARCH}.expert_gating_func"] = (u32, EXPERT_GATING_SQRT_SOFTPLUS)
        meta[f"{ARCH}.rope.scaling.type"] = (ValueType.STRING, "yarn")
        meta[f"{ARCH}.attention.compress_ratios"] = (ValueType.ARRAY, (u32, list(self.compress_ratios)))
        clamp = [float(self.swiglu_limit)] * self.n_layers
        meta[f"{ARCH}.swiglu_clamp_exp"] = (ValueType.ARRAY, (f32, clamp))
        meta[f"{ARCH}.swiglu_clamp_shexp"] = (ValueType.ARRAY, (f32, clamp))
        meta[f"{ARCH}.leading_dense_block_count"] = (u32, 0)
        meta[f"{ARCH}.expert_group_count"] = (u32, 0)
        meta[f"{ARCH}.expert_group_used_count"] = (u32, 0)
        if self.reasoning_efforts != PREVIEW:
            meta[EFFORTS_KEY] = (ValueType.STRING, self.reasoning_efforts)
        return meta

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelArgs:
        """Build the config from a GGUF file's metadata, naming the first missing or wrong key."""
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise ConfigError(f"not a DeepSeek V4 model: general.architecture is {arch!r}, expected {ARCH!r}")
        values: dict[str, Any] = {}
        for key, (attr, _vtype) in _SCALAR_KEYS.items():
            full = f"{ARCH}.{key}"
            if full in meta:
                values[attr] = _coerce(full, meta[full], type(getattr(_FLASH, attr)))
            elif attr not in _OPTIONAL_ATTRS:
                raise ConfigError(f"GGUF metadata is missing required key {full!r}")
        kv_heads = meta.get(f"{ARCH}.attention.head_count_kv", 1)
        if kv_heads != 1:
            raise ConfigError(f"{ARCH}.attention.head_count_kv must be 1 (shared K=V), got {kv_heads}")
        ratios_key = f"{ARCH}.attention.compress_ratios"
        if ratios_key not in meta:
            raise ConfigError(f"GGUF metadata is missing required key {ratios_key!r}")
        values["compress_ratios"] = tuple(int(r) for r in _as_list(ratios_key, meta[ratios_key]))
        clamp = meta.get(f"{ARCH}.swiglu_clamp_exp")
        if clamp is not None:
            limits = {float(x) for x in _as_list("swiglu_clamp_exp", clamp)}
            if len(limits) != 1:
                raise ConfigError(f"per-layer SwiGLU clamps that differ ({sorted(limits)}) are not supported")
            values["swiglu_limit"] = limits.pop()
        n_layers = values.get("n_layers", 0)
        stages = len(values["compress_ratios"]) - n_layers
        values["reasoning_efforts"] = meta.get(EFFORTS_KEY, DSPARK_RELEASES if stages == DSPARK_STAGES else PREVIEW)
        n_mtp = values.get("n_mtp_layers", 0)
        if n_mtp and len(values["compress_ratios"]) < n_layers:
            raise ConfigError("compress_ratios is shorter than block_count")
        return cls(**values)


def flash_compress_ratios(n_layers: int) -> tuple[int, ...]:
    """Flash: layers 0 and 1 are window-only, then ratio 4 on even and ratio 128 on odd layers."""
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layers))


def pro_compress_ratios(n_layers: int) -> tuple[int, ...]:
    """PRO: layers 0 and 1 are ratio 128, then ratio 4 on even and ratio 128 on odd layers."""
    return tuple(128 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layers))


def yarn_inv_freq(args: ModelArgs, layer: LayerSpec) -> list[float]:
    """Per-pair rotary frequencies; compressed layers blend toward base/factor (YaRN, no mscale)."""
    half = args.rope_dim // 2
    inv = [layer.rope_theta ** (-2.0 * i / args.rope_dim) for i in range(half)]
    if not layer.yarn:
        return inv

    def correction_dim(rotations: float) -> float:
        return (
            args.rope_dim
            * math.log(args.original_seq_len / (rotations * 2 * math.pi))
            / (2 * math.log(layer.rope_theta))
        )

    lo = max(math.floor(correction_dim(args.beta_fast)), 0)
    hi = min(math.ceil(correction_dim(args.beta_slow)), args.rope_dim - 1)
    if lo == hi:
        hi += 0.001  # same guard as the official code: avoid a zero-width ramp
    out = []
    for i, freq in enumerate(inv):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        keep = 1.0 - ramp  # 1 keeps the original (extrapolated) frequency, 0 takes freq / factor
        out.append(freq / args.rope_factor * (1 - keep) + freq * keep)
    return out


# GGUF key (without the arch prefix) -> (ModelArgs attribute, value type written)
_SCALAR_KEYS: dict[str, tuple[str, ValueType]] = {
    "block_count": ("n_layers", ValueType.UINT32),
    "context_length": ("max_seq_len", ValueType.UINT32),
    "embedding_length": ("dim", ValueType.UINT32),
    "vocab_size": ("vocab_size", ValueType.UINT32),
    "attention.head_count": ("n_heads", ValueType.UINT32),
    "attention.key_length": ("head_dim", ValueType.UINT32),
    "rope.dimension_count": ("rope_dim", ValueType.UINT32),
    "attention.q_lora_rank": ("q_lora_rank", ValueType.UINT32),
    "attention.output_group_count": ("o_groups", ValueType.UINT32),
    "attention.output_lora_rank": ("o_lora_rank", ValueType.UINT32),
    "expert_count": ("n_routed_experts", ValueType.UINT32),
    "expert_used_count": ("n_activated_experts", ValueType.UINT32),
    "expert_shared_count": ("n_shared_experts", ValueType.UINT32),
    "expert_feed_forward_length": ("moe_inter_dim", ValueType.UINT32),
    "hash_layer_count": ("n_hash_layers", ValueType.UINT32),
    "expert_weights_scale": ("route_scale", ValueType.FLOAT32),
    "attention.sliding_window": ("window", ValueType.UINT32),
    "attention.indexer.head_count": ("index_n_heads", ValueType.UINT32),
    "attention.indexer.key_length": ("index_head_dim", ValueType.UINT32),
    "attention.indexer.top_k": ("index_topk", ValueType.UINT32),
    "hyper_connection.count": ("hc_mult", ValueType.UINT32),
    "hyper_connection.sinkhorn_iterations": ("hc_sinkhorn_iters", ValueType.UINT32),
    "hyper_connection.epsilon": ("hc_eps", ValueType.FLOAT32),
    "attention.layer_norm_rms_epsilon": ("norm_eps", ValueType.FLOAT32),
    "rope.freq_base": ("rope_theta", ValueType.FLOAT32),
    "attention.compress_rope_freq_base": ("compress_rope_theta", ValueType.FLOAT32),
    "rope.scaling.factor": ("rope_factor", ValueType.FLOAT32),
    "rope.scaling.original_context_length": ("original_seq_len", ValueType.UINT32),
    "rope.scaling.yarn_beta_fast": ("beta_fast", ValueType.FLOAT32),
    "rope.scaling.yarn_beta_slow": ("beta_slow", ValueType.FLOAT32),
    "nextn_predict_layers": ("n_mtp_layers", ValueType.UINT32),
}
_OPTIONAL_ATTRS = {"max_seq_len", "n_mtp_layers", "beta_fast", "beta_slow", "vocab_size"}
_FLASH = ModelArgs()


def _as_list(key: str, value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ConfigError(f"GGUF key {key!r} must be an array, got {type(value).__name__}")


def _coerce(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, (list, tuple, str, bytes)) or value is None:
        raise ConfigError(f"GGUF key {key!r} must be a number, got {value!r}")
    if kind is int:
        if float(value) != int(value):
            raise ConfigError(f"GGUF key {key!r} must be an integer, got {value!r}")
        return int(value)
    return float(value)
