"""DeepSeek V4.1 Flash hyperparameters (issue 33): one frozen dataclass, read from and written to ds4's
`deepseek41.*` GGUF metadata (facts and sources: shared/spec/RELEASES_2026.md).

V4.1 is a sibling of V4's `ModelArgs`, not a subclass: its attention (CSA2: ratios 0, 1 and 2, four
layers that own compressed caches, the rest reading them), its lagged mHC and its Engram layers make
V4 code wrong on it, so nothing that takes a `ModelArgs` accepts one by accident.

A layer's mode (`LayerSpec41.mode`) follows from the ratio array and the source lists:

* `window`: ratio 0, the sliding window only;
* `full`: a kv source (`kv_source_layer_ids`): it compresses its own rows and index keys and scores
  them with its own indexer; the candidate source (layer 20 in Flash) also publishes the candidate
  blocks that later reindex layers choose inside;
* `reindex`: an index source that owns no rows: its own indexer query over the latest kv source's
  rows and keys;
* `reuse`: the latest kv source's rows with the latest index source's top-k.

ds4 writes each hyperparameter twice, as a typed `deepseek41.<key>` and inside `deepseek41.config` (the
whole config.json): the typed keys are read, the JSON must agree with them, and the Engram shape,
which has no typed key, comes from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

import numpy as np

from dwarfstar.errors import ConfigError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config import V41

ARCH41 = "deepseek41"
MODEL_TYPE = "deepseek_v41"  # config.json's model_type, which ds4's converter checks
ENGRAM_ENCODING = "e4m3_e8m0_32_row264"  # ds4's name for the 264-byte row (engram/rows.py)
# the only Engram shape ds4 converts (its metadata script refuses any other), and the one the row
# format (256 values) and the hash (8 heads per n-gram size, 2- to 4-grams) are written for
ENGRAM_LAYERS, ENGRAM_HEADS, ENGRAM_HEAD_DIM, ENGRAM_MAX_NGRAM = 2, 8, 256, 4


class LayerMode(StrEnum):
    WINDOW = "window"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


@dataclass(frozen=True)
class LayerSpec41:
    """What V4.1 layer `index` computes and which layers' caches it reads."""

    index: int
    compress_ratio: int  # 0: window only; 1 or 2: also one compressed row per 1 or 2 tokens
    mode: LayerMode
    kv_source: int | None  # the layer whose compressed rows (and index keys) it reads; itself when full
    index_source: int | None  # the layer whose top-k it attends with; itself when full or reindex
    builds_candidates: bool  # the candidate source: publishes each query's candidate blocks
    uses_candidates: bool  # a reindex layer after the candidate source: picks its top-k inside them
    engram: bool  # the Engram lookup is added to its streams before the block
    rope_theta: int
    yarn: bool  # compressed layers rotate everything with compress_rope_theta and YaRN

    @property
    def has_compressor(self) -> bool:
        """Owns compressor weights (kv, norm) and the index-key projection."""
        return self.mode == LayerMode.FULL

    @property
    def has_gate(self) -> bool:
        """Ratio 2 pools 2 tokens with a softmax gate; ratio 1 keeps one latent per token, no gate."""
        return self.has_compressor and self.compress_ratio > 1

    @property
    def has_index_query(self) -> bool:
        """Owns an indexer query (attn_q_b, proj) and scores rows itself."""
        return self.mode in (LayerMode.FULL, LayerMode.REINDEX)


@dataclass(frozen=True)
class LayerPlan41:
    """A V4.1 layer layout: the ratio array, the source lists and the Engram layers."""

    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    engram_layers: tuple[int, ...]


FLASH41_PLAN = LayerPlan41(
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
    kv_source_layers=(2, 8, 14, 20),
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20,
    engram_layers=(1, 14),
)


def layer_plan(n_layers: int) -> LayerPlan41:
    """Flash V4.1's layout scaled to `n_layers` (4 or more): 2 window layers, then ratio-2 layers in groups
    of 6 (a kv source and 5 reusers) taking 18/38 of the rest, then ratio-1 layers in groups of 4 (the
    candidate source, then a reindex layer heading each later group, 3 reusers each); Engram on layer 1 and
    on the last ratio-2 kv source. 40 layers give Flash's own layout."""
    if n_layers < 4:
        raise ConfigError(f"a V4.1 layout needs at least 4 layers (window, window, ratio 2, ratio 1), got {n_layers}")
    rest = n_layers - 2
    ratio2 = min(max(1, round(rest * 18 / 38)), rest - 1)
    first1 = 2 + ratio2
    kv2 = tuple(range(2, first1, 6))
    reindex = tuple(range(first1 + 4, n_layers, 4))
    return LayerPlan41(
        compress_ratios=(0, 0) + (2,) * ratio2 + (1,) * (rest - ratio2),
        kv_source_layers=(*kv2, first1),
        index_source_layers=(*kv2, first1, *reindex),
        candidate_source_layer=first1,
        engram_layers=(1, kv2[-1]),
    )


@dataclass(frozen=True)
class ModelArgs41:
    """V4.1's hyperparameters; the defaults are V4.1 Flash's (config.json, spec §0)."""

    n_layers: int = 40
    dim: int = 5120
    vocab_size: int = 129280
    n_heads: int = 64
    n_kv_heads: int = 1
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 384
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2304
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    window: int = 128
    compress_ratios: tuple[int, ...] = FLASH41_PLAN.compress_ratios
    kv_source_layers: tuple[int, ...] = FLASH41_PLAN.kv_source_layers
    index_source_layers: tuple[int, ...] = FLASH41_PLAN.index_source_layers
    candidate_source_layer: int = FLASH41_PLAN.candidate_source_layer
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-20
    rope_theta: int = 10000
    compress_rope_theta: int = 160000
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1048576
    engram_layers: tuple[int, ...] = FLASH41_PLAN.engram_layers
    engram_rows: tuple[int, ...] = (384_006_168, 384_016_682)  # each table's rows: the sum of its 24 primes
    engram_compressed_vocab: int = 99092
    engram_pad_id: int = 2  # the compressed id that stands for "no token"
    engram_prime_start: int = 16_000_000  # config.json's engram_vocab_size: where the prime search starts
    engram_n_heads: int = ENGRAM_HEADS
    engram_head_dim: int = ENGRAM_HEAD_DIM
    engram_max_ngram: int = ENGRAM_MAX_NGRAM
    bos_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def with_(self, **changes: Any) -> ModelArgs41:
        return replace(self, **changes)

    def with_plan(self, plan: LayerPlan41) -> ModelArgs41:
        return replace(self, n_layers=len(plan.compress_ratios), **asdict(plan))

    # -- derived -----------------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    @property
    def reasoning_efforts(self) -> str:
        """The release whose reasoning-effort table the prompt follows (`prompt/efforts.py`): V4.1's
        think levels, as `ModelArgs.reasoning_efforts` names a V4 file's."""
        return V41

    @property
    def hc_mix_dim(self) -> int:
        """An mHC mix produces [pre(n) | post(n) | comb(n*n)]."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_columns(self) -> int:
        """Rows a token looks up per Engram layer: one per head and n-gram size (2..max)."""
        return (self.engram_max_ngram - 1) * self.engram_n_heads

    def layer(self, index: int) -> LayerSpec41:
        ratio = self.compress_ratios[index]
        kv = _latest(self.kv_source_layers, index) if ratio else None
        idx = _latest(self.index_source_layers, index) if ratio else None
        if not ratio:
            mode = LayerMode.WINDOW
        elif index in self.kv_source_layers:
            mode = LayerMode.FULL
        elif index in self.index_source_layers:
            mode = LayerMode.REINDEX
        else:
            mode = LayerMode.REUSE
        return LayerSpec41(
            index=index,
            compress_ratio=ratio,
            mode=mode,
            kv_source=kv,
            index_source=idx,
            builds_candidates=index == self.candidate_source_layer,
            uses_candidates=mode == LayerMode.REINDEX and index > self.candidate_source_layer,
            engram=index in self.engram_layers,
            rope_theta=self.compress_rope_theta if ratio else self.rope_theta,
            yarn=bool(ratio) and self.rope_factor > 1.0,
        )

    @property
    def layers(self) -> list[LayerSpec41]:
        return [self.layer(i) for i in range(self.n_layers)]

    # -- validation --------------------------------------------------------------------------------
    def validate(self) -> None:
        problems = self._shape_problems() + self._engram_problems()
        if not problems:  # the layer layout is only meaningful over a well-formed ratio array
            problems = self._layout_problems()
        if problems:
            raise ConfigError("invalid DeepSeek V4.1 config: " + "; ".join(problems))

    def _shape_problems(self) -> list[str]:
        problems = []
        if self.n_layers < 1 or len(self.compress_ratios) != self.n_layers:
            problems.append(f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        bad = sorted({r for r in self.compress_ratios if r not in (0, 1, 2)})
        if bad:
            problems.append(f"V4.1 compress ratios must be 0, 1 or 2, got {bad}")
        if self.n_kv_heads != 1:
            problems.append(f"num_key_value_heads must be 1 (one shared K=V row), got {self.n_kv_heads}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            problems.append(f"rope_dim {self.rope_dim} must be even and fit in head_dim and index_head_dim")
        if self.o_groups <= 0 or self.n_heads % self.o_groups:
            problems.append(f"{self.n_heads} heads do not split into {self.o_groups} output groups")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            problems.append(f"{self.n_activated_experts} active experts of {self.n_routed_experts}")
        for name, want in (("scoring_func", "sqrtsoftplus"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
            if getattr(self, name) != want:
                problems.append(f"{name} must be {want!r} (V4.1's router and experts), got {getattr(self, name)!r}")
        for name in ("window", "index_topk", "candidate_topk_blocks", "candidate_block_size", "hc_mult"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        return problems

    def _engram_problems(self) -> list[str]:
        problems = []
        shape = (len(self.engram_layers), self.engram_max_ngram, self.engram_n_heads, self.engram_head_dim)
        if shape != (ENGRAM_LAYERS, ENGRAM_MAX_NGRAM, ENGRAM_HEADS, ENGRAM_HEAD_DIM):
            problems.append(
                f"Engram must be {ENGRAM_LAYERS} layers of {ENGRAM_MAX_NGRAM}-grams, {ENGRAM_HEADS} heads of "
                f"{ENGRAM_HEAD_DIM} dims as ds4 converts it; got {shape[0]} layers of {shape[1]}-grams, "
                f"{shape[2]} heads of {shape[3]} dims"
            )
        if list(self.engram_layers) != sorted(set(self.engram_layers)) or not all(
            0 <= layer < self.n_layers for layer in self.engram_layers
        ):
            problems.append(f"Engram layers {list(self.engram_layers)} must be distinct, ascending layers of the model")
        if len(self.engram_rows) != len(self.engram_layers) or any(rows < 1 for rows in self.engram_rows):
            problems.append(f"Engram rows {list(self.engram_rows)} must be one positive count per Engram layer")
        if not 0 <= self.engram_pad_id < self.engram_compressed_vocab <= self.vocab_size:
            problems.append(
                f"the Engram pad id {self.engram_pad_id} must be below the compressed vocabulary "
                f"{self.engram_compressed_vocab}, itself at most the vocabulary {self.vocab_size}"
            )
        return problems

    def _layout_problems(self) -> list[str]:
        problems = []
        for name in ("kv_source_layers", "index_source_layers"):
            layers = getattr(self, name)
            if list(layers) != sorted(set(layers)) or not all(0 <= il < self.n_layers for il in layers):
                problems.append(f"{name} {list(layers)} must be distinct, ascending layers of the model")
            elif any(self.compress_ratios[il] == 0 for il in layers):
                problems.append(f"{name} {list(layers)} name a window-only (ratio 0) layer")
        if problems:
            return problems
        if missing := sorted(set(self.kv_source_layers) - set(self.index_source_layers)):
            problems.append(f"kv sources {missing} are not index sources: a layer that owns rows scores them too")
        if self.candidate_source_layer not in self.kv_source_layers:
            problems.append(f"the candidate source {self.candidate_source_layer} is not a kv source")
        for spec in self.layers:
            if spec.mode == LayerMode.WINDOW:
                continue
            what = f"layer {spec.index} ({spec.mode}, ratio {spec.compress_ratio})"
            if spec.kv_source is None or spec.index_source is None:
                problems.append(f"{what} reads compressed rows, but no kv and index source comes at or before it")
                continue
            source_ratio = self.compress_ratios[spec.kv_source]
            if source_ratio != spec.compress_ratio:
                problems.append(f"{what} reads the rows of kv source {spec.kv_source}, whose ratio is {source_ratio}")
            elif _latest(self.kv_source_layers, spec.index_source) != spec.kv_source:
                problems.append(
                    f"{what} reads kv source {spec.kv_source}'s rows with the top-k of index source "
                    f"{spec.index_source}, which indexes another source's rows"
                )
            elif spec.uses_candidates and spec.kv_source != self.candidate_source_layer:
                problems.append(
                    f"{what} picks inside candidate source {self.candidate_source_layer}'s blocks but reads "
                    f"kv source {spec.kv_source}'s rows"
                )
        return problems

    # -- GGUF metadata -----------------------------------------------------------------------------
    def config_json(self) -> str:
        """config.json as ds4 stores it in `deepseek41.config`: compact, keys sorted."""
        text = {key: getattr(self, attr) for key, (attr, _) in _TYPED_KEYS.items()}
        text.update({key: list(getattr(self, attr)) for key, attr in _ARRAY_KEYS.items()})
        text.update({key: getattr(self, attr) for key, attr in _JSON_ONLY_KEYS.items()})
        text["engram_layer_ids"] = list(self.engram_layers)
        text["engram_num_embeddings"] = list(self.engram_rows)
        text["engram_compressed_vocab_size"] = self.engram_compressed_vocab
        text["engram_pad_token_id"] = self.engram_pad_id
        text["model_type"] = MODEL_TYPE + "_text"
        text["rope_scaling"] = {"type": "yarn", **{key: getattr(self, attr) for key, attr in _ROPE_KEYS.items()}}
        root = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": MODEL_TYPE,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "text_config": text,
        }
        return json.dumps(root, sort_keys=True, separators=(",", ":"))

    def to_gguf_metadata(self) -> dict[str, tuple[ValueType, Any]]:
        """The `deepseek41.*` keys ds4's converter writes, with its value types (u32 counts, f32 floats),
        except the Engram hash tables (`file_v41.engram_hash_metadata`)."""
        u32, f32 = ValueType.UINT32, ValueType.FLOAT32
        meta: dict[str, tuple[ValueType, Any]] = {"general.architecture": (ValueType.STRING, ARCH41)}
        meta[f"{ARCH41}.config"] = (ValueType.STRING, self.config_json())
        for key, (attr, vtype) in _TYPED_KEYS.items():
            meta[f"{ARCH41}.{key}"] = (vtype, getattr(self, attr))
        for key, attr in _ARRAY_KEYS.items():
            meta[f"{ARCH41}.{key}"] = (ValueType.ARRAY, (u32, list(getattr(self, attr))))
        for key, attr in _ROPE_KEYS.items():
            meta[f"{ARCH41}.rope_scaling.{key}"] = (f32, float(getattr(self, attr)))
        meta[f"{ARCH41}.engram.encoding"] = (ValueType.STRING, ENGRAM_ENCODING)
        meta[f"{ARCH41}.engram.layer_ids"] = (ValueType.ARRAY, (u32, list(self.engram_layers)))
        meta[f"{ARCH41}.engram.rows"] = (ValueType.ARRAY, (u32, list(self.engram_rows)))
        meta[f"{ARCH41}.engram.compressed_vocab_size"] = (u32, self.engram_compressed_vocab)
        meta[f"{ARCH41}.engram.pad_id"] = (u32, self.engram_pad_id)
        return meta

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelArgs41:
        """The config of a `deepseek41` file, naming the first missing, mistyped or contradicting key."""
        arch = meta.get("general.architecture")
        if arch != ARCH41:
            raise ConfigError(f"not a DeepSeek V4.1 model: general.architecture is {arch!r}, expected {ARCH41!r}")
        values: dict[str, Any] = {}
        for key, (attr, vtype) in _TYPED_KEYS.items():
            values[attr] = _typed(f"{ARCH41}.{key}", _required(meta, f"{ARCH41}.{key}"), vtype)
        for key, attr in _ARRAY_KEYS.items():
            values[attr] = _ints(f"{ARCH41}.{key}", _required(meta, f"{ARCH41}.{key}"))
        for key, attr in _ROPE_KEYS.items():
            full = f"{ARCH41}.rope_scaling.{key}"
            value = _typed(full, _required(meta, full), ValueType.FLOAT32)
            values[attr] = int(value) if attr == "original_seq_len" else value
        encoding = _required(meta, f"{ARCH41}.engram.encoding")
        if encoding != ENGRAM_ENCODING:
            raise ConfigError(f"Engram rows encoded as {encoding!r}; ds4's V4.1 files use {ENGRAM_ENCODING!r}")
        values["engram_layers"] = _ints(f"{ARCH41}.engram.layer_ids", _required(meta, f"{ARCH41}.engram.layer_ids"))
        values["engram_rows"] = _ints(f"{ARCH41}.engram.rows", _required(meta, f"{ARCH41}.engram.rows"))
        for key, attr in (("compressed_vocab_size", "engram_compressed_vocab"), ("pad_id", "engram_pad_id")):
            full = f"{ARCH41}.engram.{key}"
            values[attr] = _typed(full, _required(meta, full), ValueType.UINT32)
        text = _text_config(_required(meta, f"{ARCH41}.config"))
        _check_agrees(text, values)
        for key, attr in _JSON_ONLY_KEYS.items():
            if key not in text:
                raise ConfigError(f"{ARCH41}.config has no text_config.{key}")
            values[attr] = _typed(f"{ARCH41}.config text_config.{key}", text[key], ValueType.UINT32)
        for key in ("bos_token_id", "eos_token_id"):
            if isinstance(meta.get(f"tokenizer.ggml.{key}"), int):
                values[key] = meta[f"tokenizer.ggml.{key}"]
        return cls(**values)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs41:
        """The config of a V4.1 Hugging Face checkpoint: config.json, its language model under
        `text_config` (the keys ds4 copies into its typed metadata), naming the first missing or
        mistyped key. Its `compress_ratios` go on past the layers with the DSpark stages' entries
        (`num_nextn_predict_layers` of them), which are not the trunk's."""
        if config.get("model_type") != MODEL_TYPE or not isinstance(config.get("text_config"), dict):
            raise ConfigError(
                f"config.json is a {config.get('model_type')!r} config; a V4.1 checkpoint's is {MODEL_TYPE!r} "
                "with a text_config object"
            )
        text, source = config["text_config"], "config.json text_config"

        def read(key: str, vtype: ValueType) -> Any:
            return _typed(key, _required(text, key, source), vtype, source)

        values: dict[str, Any] = {attr: read(key, vtype) for key, (attr, vtype) in _TYPED_KEYS.items()}
        values |= {attr: read(key, ValueType.UINT32) for key, attr in (_JSON_ONLY_KEYS | _AGREE_SCALARS).items()}
        for key, attr in (_ARRAY_KEYS | _AGREE_ARRAYS).items():
            values[attr] = _ints(key, _required(text, key, source), source)
        layers, ratios = values["n_layers"], values["compress_ratios"]
        stages = read("num_nextn_predict_layers", ValueType.UINT32) if "num_nextn_predict_layers" in text else 0
        if len(ratios) != layers + stages:
            raise ConfigError(
                f"{source}.compress_ratios has {len(ratios)} entries; {layers} layers and {stages} DSpark stages "
                f"need {layers + stages}"
            )
        values["compress_ratios"] = ratios[:layers]
        rope = _required(text, "rope_scaling", source)
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}.rope_scaling must be an object, got {rope!r}")
        for key, attr in _ROPE_KEYS.items():
            value = _typed(key, _required(rope, key, f"{source}.rope_scaling"), ValueType.FLOAT32, source)
            values[attr] = int(value) if attr == "original_seq_len" else value
        for key in ("bos_token_id", "eos_token_id"):
            if key in config:
                values[key] = _typed(key, config[key], ValueType.UINT32, "config.json")
        return cls(**values)


# deepseek41.<key> (config.json's own name) -> (attribute, GGUF value type), as ds4's converter writes them
_U32, _F32 = ValueType.UINT32, ValueType.FLOAT32
_TYPED_KEYS: dict[str, tuple[str, ValueType]] = {
    "vocab_size": ("vocab_size", _U32),
    "hidden_size": ("dim", _U32),
    "moe_intermediate_size": ("moe_inter_dim", _U32),
    "num_hidden_layers": ("n_layers", _U32),
    "num_attention_heads": ("n_heads", _U32),
    "num_key_value_heads": ("n_kv_heads", _U32),
    "head_dim": ("head_dim", _U32),
    "qk_rope_head_dim": ("rope_dim", _U32),
    "q_lora_rank": ("q_lora_rank", _U32),
    "o_lora_rank": ("o_lora_rank", _U32),
    "o_groups": ("o_groups", _U32),
    "n_routed_experts": ("n_routed_experts", _U32),
    "n_shared_experts": ("n_shared_experts", _U32),
    "num_experts_per_tok": ("n_activated_experts", _U32),
    "max_position_embeddings": ("max_seq_len", _U32),
    "sliding_window": ("window", _U32),
    "index_n_heads": ("index_n_heads", _U32),
    "index_head_dim": ("index_head_dim", _U32),
    "index_topk": ("index_topk", _U32),
    "candidate_source_layer_id": ("candidate_source_layer", _U32),
    "candidate_topk_blocks": ("candidate_topk_blocks", _U32),
    "candidate_block_size": ("candidate_block_size", _U32),
    "hc_mult": ("hc_mult", _U32),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters", _U32),
    "rope_theta": ("rope_theta", _U32),
    "compress_rope_theta": ("compress_rope_theta", _U32),
    "rms_norm_eps": ("norm_eps", _F32),
    "hc_eps": ("hc_eps", _F32),
    "swiglu_limit": ("swiglu_limit", _F32),
    "routed_scaling_factor": ("route_scale", _F32),
    "scoring_func": ("scoring_func", ValueType.STRING),
    "hidden_act": ("hidden_act", ValueType.STRING),
    "topk_method": ("topk_method", ValueType.STRING),
    "norm_topk_prob": ("norm_topk_prob", ValueType.BOOL),
}
_ARRAY_KEYS = {  # u32 arrays
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
}
_ROPE_KEYS = {  # deepseek41.rope_scaling.<key>, f32
    "factor": "rope_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_max_position_embeddings": "original_seq_len",
}
_JSON_ONLY_KEYS = {  # no typed key: the Engram shape and prime search start, from config.json only
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_max_ngram_size": "engram_max_ngram",
    "engram_vocab_size": "engram_prime_start",
}
_AGREE_ARRAYS = {  # config.json keys that repeat a deepseek41.engram.* key: u32 arrays
    "engram_layer_ids": "engram_layers",
    "engram_num_embeddings": "engram_rows",
}
_AGREE_SCALARS = {"engram_compressed_vocab_size": "engram_compressed_vocab", "engram_pad_token_id": "engram_pad_id"}
_AGREE_KEYS = _AGREE_ARRAYS | _AGREE_SCALARS


def _latest(sources: tuple[int, ...], index: int) -> int | None:
    """The last source at or before layer `index`: the one whose cache slot it reads."""
    before = [il for il in sources if il <= index]
    return before[-1] if before else None


def _required(meta: dict[str, Any], key: str, source: str = "GGUF metadata") -> Any:
    if key not in meta:
        raise ConfigError(f"{source} is missing required key {key!r}")
    return meta[key]


def _typed(key: str, value: Any, vtype: ValueType, source: str = "GGUF") -> Any:
    what = f"{source} key {key!r}"
    if vtype == ValueType.STRING:
        if not isinstance(value, str):
            raise ConfigError(f"{what} must be a string, got {value!r}")
        return value
    if vtype == ValueType.BOOL:
        if not isinstance(value, bool):
            raise ConfigError(f"{what} must be a bool, got {value!r}")
        return value
    if isinstance(value, (bool, list, tuple, str, bytes, dict)) or value is None:
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if vtype == ValueType.FLOAT32:  # the shortest decimal that is this f32: 1e-20, not 9.99999968e-21
        return float(str(np.float32(value)))
    if float(value) != int(value) or value < 0:
        raise ConfigError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _ints(key: str, value: Any, source: str = "GGUF") -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{source} key {key!r} must be an array, got {type(value).__name__}")
    return tuple(_typed(key, v, ValueType.UINT32, source) for v in value)


def _text_config(raw: Any) -> dict[str, Any]:
    key = f"{ARCH41}.config"
    try:
        root = json.loads(raw) if isinstance(raw, str) else None
    except ValueError as exc:
        raise ConfigError(f"{key} is not JSON: {exc}") from None
    if not isinstance(root, dict) or not isinstance(root.get("text_config"), dict):
        raise ConfigError(f"{key} must be config.json, an object with a text_config object")
    if root.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{key} is a {root.get('model_type')!r} config, expected {MODEL_TYPE!r}")
    return root["text_config"]


def _check_agrees(text: dict[str, Any], values: dict[str, Any]) -> None:
    """Every typed key that config.json repeats must say the same."""
    pairs = [(key, attr) for key, (attr, _) in _TYPED_KEYS.items()]
    pairs += [*_ARRAY_KEYS.items(), *_AGREE_KEYS.items()]
    for key, attr in pairs:
        if key not in text:
            continue
        said, typed = text[key], values[attr]
        if isinstance(typed, tuple):
            said = tuple(said) if isinstance(said, list) else said
        elif isinstance(typed, float) and isinstance(said, (int, float)) and not isinstance(said, bool):
            said = float(str(np.float32(said)))
        if said != typed:
            raise ConfigError(f"{ARCH41}.config says {key} = {text[key]!r}, but its typed key says {typed!r}")
