"""Read a DeepSeek V4 Hugging Face `config.json` into `ModelArgs`.

Two dialects exist and both are accepted:

* the official checkpoint's: `compress_ratios` (one entry per layer, plus a trailing one for the MTP
  block), `num_hash_layers`, `rope_scaling` {type yarn, factor, original_max_position_embeddings,
  beta_fast, beta_slow};
* the one transformers 5.23 `DeepseekV4Config.save_pretrained` writes: `layer_types` named through
  `compress_rates`, `mlp_layer_types` (hash_moe / moe), `rope_parameters` {main: {...}, compress: {...}}.

Each quantity is read from whichever key is present. The shape-defining keys are required, because a
default there would only surface later as a confusing tensor-shape error; every other key keeps the
`ModelArgs` (Flash) default when the config does not carry it.

`num_nextn_predict_layers` is deliberately not read: the converter writes the trunk only, so the GGUF
declares no MTP layers. A DSpark drafter (V4 Flash 0731, PRO 0813) is declared by `dspark_*` keys and
one trailing `compress_ratios` entry per stage; `dspark_args_from_hf_config` reads them for the
support file `convert --dspark` writes.

A vision encoder is declared by flat `vision_*` keys (V4 Flash Vision-Exp) or a nested `vision_config`
(V4.1 Flash, `model_type` deepseek_v41_vision, its language model under `text_config`);
`vision_config_from_hf_config` reads either for the encoder file `convert --vision` writes
(shared/spec/RELEASES_2026.md). Its shape keys are required; the image budget's keys, which
transformers' V4.1 config may leave out, default to the family's published values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dwarfstar.errors import ConfigError, DwarfStarError, ModelFileError
from dwarfstar.model.config import DSPARK_RELEASES, PREVIEW, ModelArgs
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.vision import V41_FLASH, VISION_EXP_FLASH, VisionArgs
from dwarfstar.model.vision_file import RouterShape

# ModelArgs field -> config.json key, for the keys both dialects spell the same way.
_REQUIRED_INTS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
}
_OPTIONAL_INTS = {
    "n_shared_experts": "n_shared_experts",
    "window": "sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "max_seq_len": "max_position_embeddings",
}
_OPTIONAL_FLOATS = {
    "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "hc_eps": "hc_eps",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
}
# YaRN keys inside `rope_scaling` / `rope_parameters.compress` -> (ModelArgs field, kind)
_YARN_KEYS = {
    "factor": ("rope_factor", float),
    "original_max_position_embeddings": ("original_seq_len", int),
    "beta_fast": ("beta_fast", float),
    "beta_slow": ("beta_slow", float),
}
# transformers' `layer_types` value for window-only layers; the others are named in `compress_rates`.
_WINDOW_LAYER = "sliding_attention"
_HASH_MLP = "hash_moe"
_DSPARK_PREFIX = "dspark_"
_DSPARK_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
# VisionArgs field -> the config key of Vision-Exp's flat `vision_*` keys and of V4.1's `vision_config`
_VISION_SHAPE_KEYS = {
    "n_layers": ("vision_n_layers", "num_hidden_layers"),
    "dim": ("vision_dim", "hidden_size"),
    "n_heads": ("vision_n_heads", "num_attention_heads"),
    "inter_dim": ("vision_inter_dim", "intermediate_size"),
    "patch": ("vision_patch_size", "patch_size"),
    "downsample": ("vision_downsample_ratio", "downsample_ratio"),
}
_VISION_BUDGET_KEYS = {  # optional: the family's published value when absent
    "max_tokens": ("vision_max_n_token", "max_image_tokens"),
    "min_pixels": ("vision_min_pixels", "min_pixels"),
    "max_wh_ratio": ("vision_max_wh_ratio", "max_wh_ratio"),  # null: no limit (0)
}
_VISION_ROPE_KEY = ("vision_rope_theta", "rope_theta")
_V41_VISION_TYPE = "deepseek_v41_vision"


@dataclass(frozen=True)
class VisionConfig:
    """What config.json says of a checkpoint's vision encoder and the language model it feeds."""

    args: VisionArgs
    language: tuple[int, int]  # the language model's (layers, routed experts)
    router: RouterShape | None  # the router biases the encoder file carries (Vision-Exp); None for V4.1


def read_checkpoint_config(src: Path) -> dict[str, Any]:
    """The `config.json` of the checkpoint directory `src`, which must exist."""
    if not src.is_dir():
        raise ModelFileError(f"checkpoint directory {src} does not exist")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"no config.json in {src}: expected a Hugging Face checkpoint directory")
    return read_hf_config(config_path)


def read_hf_config(path: Path) -> dict[str, Any]:
    """`config.json` at `path` as its JSON object, for `model_args_from_hf_config` (either dialect) and
    `dspark_args_from_hf_config`."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    _check_fixed_choices(config)
    values: dict[str, Any] = {}
    for attr, key in _REQUIRED_INTS.items():
        if key not in config:
            raise ConfigError(f"config.json is missing required key {key!r}")
        values[attr] = _integer(config, key)
    for attr, key in _OPTIONAL_INTS.items():
        if config.get(key) is not None:
            values[attr] = _integer(config, key)
    for attr, key in _OPTIONAL_FLOATS.items():
        if config.get(key) is not None:
            values[attr] = _number(config, key)
    rope_dim = _rope_dim(config, values["head_dim"])
    if rope_dim is not None:
        values["rope_dim"] = rope_dim
    values["compress_ratios"] = _compress_ratios(config, values["n_layers"])
    n_hash = _hash_layer_count(config)
    if n_hash is not None:
        values["n_hash_layers"] = n_hash
    values.update(_rope_settings(config))
    # a checkpoint with a DSpark drafter is Flash 0731 or PRO 0813, whose encoder has the later effort table
    values["reasoning_efforts"] = DSPARK_RELEASES if has_dspark_drafter(config) else PREVIEW
    return ModelArgs(**values)


def has_dspark_drafter(config: dict[str, Any]) -> bool:
    """Whether the config declares a DSpark drafter (any `dspark_*` key), whatever its values."""
    return any(key.startswith(_DSPARK_PREFIX) for key in config)


def dspark_args_from_hf_config(config: dict[str, Any], args: ModelArgs) -> DSparkArgs:
    """The drafter's settings, checked against the trunk `args`. The stage count is `n_mtp_layers`
    (DeepSeek's inference config) or else the `compress_ratios` entries past the trunk's layers, which
    must be 0: the stages are window-only."""
    if not has_dspark_drafter(config):
        raise ConfigError("the checkpoint has no DSpark drafter: its config.json has no dspark_* keys")
    for key in _DSPARK_KEYS:
        if config.get(key) is None:
            raise ConfigError(f"config.json declares a DSpark drafter but has no {key!r}")
    layers = config["dspark_target_layer_ids"]
    if not isinstance(layers, list) or not all(_is_int(i) for i in layers):
        raise ConfigError(f"config.json: dspark_target_layer_ids must be a list of integers, got {layers!r}")
    d = DSparkArgs(
        block_size=_integer(config, "dspark_block_size"),
        markov_rank=_integer(config, "dspark_markov_rank"),
        noise_token_id=_integer(config, "dspark_noise_token_id"),
        target_layers=tuple(layers),
        stages=_dspark_stages(config, args.n_layers),
    )
    d.check(args, "config.json", ConfigError)
    return d


def _dspark_stages(config: dict[str, Any], n_layers: int) -> int:
    if config.get("n_mtp_layers") is not None:
        return _integer(config, "n_mtp_layers")
    ratios = config.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) <= n_layers:
        raise ConfigError(
            "config.json declares a DSpark drafter but neither n_mtp_layers nor compress_ratios entries "
            "past the trunk's layers give its stage count"
        )
    if any(ratios[n_layers:]):
        raise ConfigError(
            f"compress_ratios gives the DSpark stages {ratios[n_layers:]}; they must be 0 (window-only attention)"
        )
    return len(ratios) - n_layers


def vision_config_from_hf_config(config: dict[str, Any]) -> VisionConfig:
    """The vision encoder a checkpoint's config declares: V4 Flash Vision-Exp's flat `vision_*` keys (its
    language model's keys at the top level, read as the trunk's) or V4.1 Flash's `vision_config` (its
    language model's under `text_config`)."""
    flat = sorted(key for key in config if key.startswith("vision_") and key != "vision_config")
    nested = config.get("vision_config")
    if nested is not None and flat:
        raise ConfigError(
            f"config.json has both a vision_config (V4.1 Flash) and flat vision keys ({flat[0]}...: Vision-Exp)"
        )
    if nested is not None:
        return _v41_vision(config, nested)
    if not flat:
        raise ConfigError(
            "config.json declares no vision encoder: it has neither vision_* keys (DeepSeek V4 Flash Vision-Exp) "
            "nor a vision_config (DeepSeek V4.1 Flash)"
        )
    lm = model_args_from_hf_config(config)
    mtp = _integer(config, "num_nextn_predict_layers") if config.get("num_nextn_predict_layers") is not None else 0
    args = _vision_args(config, VISION_EXP_FLASH, 0, "", out_dim=lm.dim)
    router = RouterShape(lm.n_layers, lm.n_routed_experts, lm.n_hash_layers, mtp)
    return VisionConfig(args, (lm.n_layers, lm.n_routed_experts), router)


def _v41_vision(config: dict[str, Any], section: Any) -> VisionConfig:
    if not isinstance(section, dict):
        raise ConfigError(f"config.json: vision_config must be an object, got {section!r}")
    kind = section.get("model_type", _V41_VISION_TYPE)
    if kind != _V41_VISION_TYPE:
        raise ConfigError(
            f"config.json: unknown vision encoder family vision_config.model_type {kind!r}; "
            f"known: {_V41_VISION_TYPE} (DeepSeek V4.1 Flash) and Vision-Exp's flat vision_* keys"
        )
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json has a vision_config (DeepSeek V4.1 Flash) but no text_config object")
    sizes = []
    for key in ("hidden_size", "num_hidden_layers", "n_routed_experts"):
        if text.get(key) is None:
            raise ConfigError(f"config.json is missing required key 'text_config.{key}'")
        sizes.append(_integer(text, key, "text_config."))
        if sizes[-1] <= 0:
            raise ConfigError(f"config.json: text_config.{key} must be positive, got {sizes[-1]}")
    width, layers, experts = sizes
    args = _vision_args(section, V41_FLASH, 1, "vision_config.", out_dim=width)
    if config.get("image_token_id") is not None:
        args = replace(args, image_token_id=_integer(config, "image_token_id"))
    return VisionConfig(args, (layers, experts), None)


def _vision_args(section: dict[str, Any], family: VisionArgs, dialect: int, where: str, out_dim: int) -> VisionArgs:
    """The encoder's args from `section` (the config, or its vision_config: `dialect` picks the key
    names), the budget keys it leaves out as `family`'s."""
    values: dict[str, Any] = {"out_dim": out_dim}
    for attr, names in {**_VISION_SHAPE_KEYS, **_VISION_BUDGET_KEYS, "rope_theta": _VISION_ROPE_KEY}.items():
        key = names[dialect]
        if attr == "max_wh_ratio" and key in section and section[key] is None:
            values[attr] = 0  # V4.1's null: no limit
            continue
        if section.get(key) is None:
            if attr in _VISION_SHAPE_KEYS:
                raise ConfigError(f"config.json is missing required key {where + key!r}")
            continue
        value = (_number if attr == "rope_theta" else _integer)(section, key, where)
        if value < 0 or value == 0 and attr != "max_wh_ratio":
            raise ConfigError(f"config.json: {where}{key} must be positive, got {section[key]!r}")
        values[attr] = value
    args = replace(family, **values)
    try:
        args.check()
    except DwarfStarError as exc:
        raise ConfigError(f"config.json: {exc}") from None
    return args


def _check_fixed_choices(config: dict[str, Any]) -> None:
    """Reject configs that describe a model the ds4 layout cannot express (the GGUF hard-codes these)."""
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != 1:
        raise ConfigError(f"num_key_value_heads must be 1 (DeepSeek V4 shares one K=V head), got {kv_heads!r}")
    scoring = config.get("scoring_func")
    if scoring is not None and scoring != "sqrtsoftplus":
        raise ConfigError(f"scoring_func must be 'sqrtsoftplus' (DeepSeek V4 routing), got {scoring!r}")
    if config.get("norm_topk_prob") is False:
        raise ConfigError("norm_topk_prob is false; DeepSeek V4 always renormalises the top-k expert weights")


def _rope_dim(config: dict[str, Any], head_dim: int) -> int | None:
    if config.get("qk_rope_head_dim") is not None:
        return _integer(config, "qk_rope_head_dim")
    factor = config.get("partial_rotary_factor")
    if factor is None:
        return None
    dims = _number(config, "partial_rotary_factor") * head_dim
    if dims != int(dims):
        raise ConfigError(f"partial_rotary_factor {factor} of head_dim {head_dim} is not a whole number of dims")
    return int(dims)


def _compress_ratios(config: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """Per-layer ratios of the trunk; the official list's trailing MTP entry is dropped."""
    if config.get("compress_ratios") is not None:
        raw = config["compress_ratios"]
        if not isinstance(raw, list) or not all(_is_int(r) for r in raw):
            raise ConfigError(f"compress_ratios must be a list of integers, got {raw!r}")
        ratios = [int(r) for r in raw]
        source = "compress_ratios"
    elif config.get("layer_types") is not None:
        ratios = _ratios_from_layer_types(config)
        source = "layer_types"
    else:
        raise ConfigError("config.json has neither 'compress_ratios' nor 'layer_types': cannot tell the layer kinds")
    if len(ratios) < n_layers:
        raise ConfigError(f"{source} has {len(ratios)} entries for num_hidden_layers={n_layers}")
    return tuple(ratios[:n_layers])


def _ratios_from_layer_types(config: dict[str, Any]) -> list[int]:
    rates = config.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"compress_rates must be an object mapping layer type to ratio, got {rates!r}")
    ratios = []
    for kind in config["layer_types"]:
        if kind == _WINDOW_LAYER:
            ratios.append(0)
        elif kind in rates and _is_int(rates[kind]):
            ratios.append(int(rates[kind]))
        else:
            known = [_WINDOW_LAYER, *rates]
            raise ConfigError(f"layer_types entry {kind!r} has no compress ratio (known: {', '.join(known)})")
    return ratios


def _hash_layer_count(config: dict[str, Any]) -> int | None:
    if config.get("num_hash_layers") is not None:
        return _integer(config, "num_hash_layers")
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return None
    n_hash = sum(kind == _HASH_MLP for kind in kinds)
    # ds4 (and ModelArgs) only know "the first n layers are hash-routed".
    if any(kind != _HASH_MLP for kind in kinds[:n_hash]):
        raise ConfigError(f"mlp_layer_types must start with all the {_HASH_MLP!r} layers, got {kinds}")
    return n_hash


def _rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """YaRN settings of the compressed layers, and transformers' per-kind rope bases."""
    values: dict[str, Any] = {}
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, yarn, where = params.get("main") or {}, params["compress"], "rope_parameters.compress"
        if main.get("rope_theta") is not None:
            values["rope_theta"] = _number(main, "rope_theta", "rope_parameters.main.")
        if yarn.get("rope_theta") is not None:
            values["compress_rope_theta"] = _number(yarn, "rope_theta", f"{where}.")
    elif isinstance(params, dict):
        yarn, where = params, "rope_parameters"  # the flat form transformers also accepts
    elif isinstance(config.get("rope_scaling"), dict):
        yarn, where = config["rope_scaling"], "rope_scaling"
    else:
        return values
    kind = yarn.get("rope_type", yarn.get("type"))
    if kind is not None and kind != "yarn":
        raise ConfigError(f"{where} has rope type {kind!r}; DeepSeek V4's compressed layers use 'yarn'")
    for key, (attr, parse) in _YARN_KEYS.items():
        if yarn.get(key) is not None:
            values[attr] = (_integer if parse is int else _number)(yarn, key, f"{where}.")
    return values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(section: dict[str, Any], key: str, where: str = "") -> int:
    value = section[key]
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():  # JSON writers sometimes emit 16.0 for 16
        return int(value)
    raise ConfigError(f"config.json: {where}{key} must be an integer, got {value!r}")


def _number(section: dict[str, Any], key: str, where: str = "") -> float:
    value = section[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"config.json: {where}{key} must be a number, got {value!r}")
