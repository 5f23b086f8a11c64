"""ds4's vision encoder GGUFs: open one (`open_vision`), check it, and hand out its tensors (issue 34).

The layout (the facts, from ds4's sidecar writers; sources: shared/spec/RELEASES_2026.md):

- `general.architecture` "deepseek4-vision" for both encoders; `general.name`, `general.alignment`;
- `deepseek4-vision.checkpoint_variant`: "vision-exp" (V4 Flash Vision-Exp) or "v4.1-flash";
- u32 `.block_count`, `.embedding_length`, `.feed_forward_length`, `.attention.head_count`,
  `.projection_length`, `.patch_size`, `.downsample_ratio`, `.image.max_tokens`, `.image.min_pixels`,
  `.image.max_width_height_ratio` (0: no limit), V4.1's `.image.token_id`, and the language model's
  `.language.block_count` and `.language.expert_count`; f32 `.rope.freq_base` and
  `.attention.layer_norm_rms_epsilon`;
- the encoder's tensors in BF16 under the checkpoint's names (`vision.blocks.{i}.attn.wqkv.weight`...,
  `VisionArgs.tensor_shapes`), GGUF dims the reverse of the [out, in] shape, as every GGUF;
- Vision-Exp's file also carries the language model's routers' biases for image tokens, F32
  [expert_count]: `layers.{i}.ffn.gate.bias_vl` for every layer, `mtp.{j}.ffn.gate.bias_vl` for the
  checkpoint's MTP layers, and `layers.{i}.ffn.gate.bias` (the text bias) of the hash-routed layers
  (ds4's Vision-Exp language GGUF has none of them). V4.1's language GGUF carries its own instead.

Every way a file can be wrong ends in a `ModelFileError` naming the file and the problem, a language
model passed where the encoder belongs among them (`--vision` takes the encoder file).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import GGUFFile, read_gguf
from dwarfstar.model.config import ARCH as LANGUAGE_ARCH
from dwarfstar.model.vision import PREFIX, V41, VISION_EXP, VisionArgs, check_tensors

u32, f32 = ValueType.UINT32, ValueType.FLOAT32

# metadata key (after `deepseek4-vision.`) -> (VisionArgs attribute, the type ds4 writes)
ARG_KEYS: dict[str, tuple[str, ValueType]] = {
    "block_count": ("n_layers", u32),
    "embedding_length": ("dim", u32),
    "feed_forward_length": ("inter_dim", u32),
    "attention.head_count": ("n_heads", u32),
    "projection_length": ("out_dim", u32),
    "patch_size": ("patch", u32),
    "downsample_ratio": ("downsample", u32),
    "image.max_tokens": ("max_tokens", u32),
    "image.min_pixels": ("min_pixels", u32),
    "image.max_width_height_ratio": ("max_wh_ratio", u32),
    "rope.freq_base": ("rope_theta", f32),
    "attention.layer_norm_rms_epsilon": ("norm_eps", f32),
}
VARIANT_KEY = f"{PREFIX}.checkpoint_variant"
# ds4 writes these in the Vision-Exp *language* file: its variant, and that it needs its encoder file
LM_VARIANT_KEY = "deepseek4.checkpoint_variant"
LM_SIDECAR_KEY = "deepseek4.vision.sidecar_required"
TOKEN_ID_KEY = f"{PREFIX}.image.token_id"  # V4.1 only
LANGUAGE_LAYERS_KEY = f"{PREFIX}.language.block_count"
LANGUAGE_EXPERTS_KEY = f"{PREFIX}.language.expert_count"
ALIGNMENT = 32  # ds4's writers state general.alignment; 32 is GGUF's default
# the attributes that are sizes: none of them may be 0 (the image budget's ratio may: no limit)
_POSITIVE = ("n_layers", "dim", "inter_dim", "n_heads", "out_dim", "patch", "downsample", "max_tokens")

# the language model's router biases a Vision-Exp encoder file carries
IMAGE_BIAS = "layers.{}.ffn.gate.bias_vl"  # every language layer's, for image tokens
MTP_IMAGE_BIAS = "mtp.{}.ffn.gate.bias_vl"  # every MTP layer's
TEXT_BIAS = "layers.{}.ffn.gate.bias"  # the hash-routed layers' bias for text
_BIAS_NAME = re.compile(r"(layers|mtp)\.(\d+)\.ffn\.gate\.(bias_vl|bias)")
FLOAT_TYPES = {GGMLType.BF16: torch.bfloat16, GGMLType.F16: torch.float16, GGMLType.F32: torch.float32}
FAMILY_NAMES = {VISION_EXP: "DeepSeek V4 Flash Vision-Exp", V41: "DeepSeek V4.1 Flash"}


@dataclass(frozen=True)
class RouterShape:
    """The language model an encoder file's router biases are for: its layers and routed experts, how
    many of its first layers are hash-routed (their text bias is carried too) and its MTP layers."""

    n_layers: int
    n_experts: int
    n_hash_layers: int = 0
    n_mtp_layers: int = 0

    def tensor_names(self) -> list[str]:
        """The bias tensors, in ds4's order: every layer's image bias, the MTP layers', the hash layers' text bias."""
        return [
            *(IMAGE_BIAS.format(i) for i in range(self.n_layers)),
            *(MTP_IMAGE_BIAS.format(j) for j in range(self.n_mtp_layers)),
            *(TEXT_BIAS.format(i) for i in range(self.n_hash_layers)),
        ]


def vision_metadata(
    args: VisionArgs, name: str, language: tuple[int, int] | None = None
) -> dict[str, tuple[ValueType, Any]]:
    """An encoder file's metadata as ds4 writes it (its provenance strings aside); `language`: the
    language model's (block_count, expert_count)."""
    args.check()
    if (args.family == V41) != (args.image_token_id is not None):
        raise ValueError(f"a {args.family} encoder {'needs' if args.family == V41 else 'has no'} image token id")
    meta: dict[str, tuple[ValueType, Any]] = {
        "general.architecture": (ValueType.STRING, PREFIX),
        "general.name": (ValueType.STRING, name),
        "general.alignment": (u32, ALIGNMENT),
        VARIANT_KEY: (ValueType.STRING, args.family),
    }
    for key, (attr, vtype) in ARG_KEYS.items():
        meta[f"{PREFIX}.{key}"] = (vtype, getattr(args, attr))
    if args.image_token_id is not None:
        meta[TOKEN_ID_KEY] = (u32, args.image_token_id)
    if language is not None:
        meta[LANGUAGE_LAYERS_KEY] = (u32, language[0])
        meta[LANGUAGE_EXPERTS_KEY] = (u32, language[1])
    return meta


@dataclass
class VisionFile:
    """A checked encoder GGUF; its tensors stay memory-mapped until read. The tensors handed out are
    views of the read-only mapping: read them, or copy them before writing in place."""

    path: Path
    gguf: GGUFFile
    args: VisionArgs
    name: str | None  # general.name
    language: tuple[int, int] | None  # the language model's (block_count, expert_count), when stated
    router: RouterShape | None  # the router biases the file carries; None: none

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` (a checkpoint name) in its file type, [out, in]; no copy."""
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}")
        raw = np.asarray(self.gguf.raw(name))
        with warnings.catch_warnings():  # a view of the read-only mapping, only ever read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(raw)
        return flat.view(FLOAT_TYPES[info.ggml_type]).reshape(info.shape)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every encoder tensor `VisionArgs.tensor_shapes` names, by name."""
        return {name: self.tensor(name) for name in self.args.tensor_shapes()}

    def image_router_biases(self) -> dict[int, torch.Tensor]:
        """Language layer -> its router's bias for image tokens (`layers.{i}.ffn.gate.bias_vl`); {} if none."""
        return self._biases(IMAGE_BIAS, self.router.n_layers if self.router else 0)

    def mtp_image_router_biases(self) -> dict[int, torch.Tensor]:
        """MTP layer -> its router's bias for image tokens (`mtp.{j}.ffn.gate.bias_vl`)."""
        return self._biases(MTP_IMAGE_BIAS, self.router.n_mtp_layers if self.router else 0)

    def hash_text_biases(self) -> dict[int, torch.Tensor]:
        """Hash-routed layer -> its router's text bias (`layers.{i}.ffn.gate.bias`), as the sidecar carries it."""
        return self._biases(TEXT_BIAS, self.router.n_hash_layers if self.router else 0)

    def _biases(self, pattern: str, count: int) -> dict[int, torch.Tensor]:
        return {i: self.tensor(pattern.format(i)) for i in range(count)}

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> VisionFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_vision(path: str | os.PathLike) -> VisionFile:
    """Map and check a vision encoder GGUF (`--vision FILE`)."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; give the vision encoder GGUF file in it")
    if not path.is_file():
        raise ModelFileError(f"vision encoder file not found: {path}")
    return read_gguf(path, read_vision)


def read_vision(gguf: GGUFFile) -> VisionFile:
    """Check an open GGUF as a vision encoder (it stays open; the caller closes it on an error)."""
    path = gguf.path
    check_architecture(gguf)
    args = vision_args(gguf)
    _check_tensors(gguf, args)
    language = _language(gguf)
    router = _router(gguf, language)
    name = gguf.metadata.get("general.name")
    return VisionFile(path, gguf, args, name if isinstance(name, str) else None, language, router)


def check_architecture(gguf: GGUFFile) -> None:
    arch = gguf.metadata.get("general.architecture")
    if arch == PREFIX:
        return
    path = gguf.path
    if arch == LANGUAGE_ARCH:
        raise ModelFileError(
            f"{path} is a DeepSeek V4 language model, not a vision encoder: --vision takes the encoder GGUF "
            f"(general.architecture {PREFIX!r}, e.g. DeepSeek-V4-Flash-Vision-Encoder.gguf), and the model goes to -m"
        )
    if arch is None:
        raise ModelFileError(f"{path} is not a vision encoder: it has no general.architecture (expected {PREFIX!r})")
    raise ModelFileError(f"{path} is not a vision encoder: general.architecture is {arch!r}, expected {PREFIX!r}")


def vision_args(gguf: GGUFFile) -> VisionArgs:
    """The encoder's `VisionArgs` from its metadata, naming the first missing or wrong key."""
    path, meta = gguf.path, gguf.metadata
    family = _key(gguf, VARIANT_KEY)
    if not isinstance(family, str):
        raise ModelFileError(f"{path}: {VARIANT_KEY} must be a string, got {family!r}")
    if family not in (VISION_EXP, V41):
        raise ModelFileError(
            f"{path}: unknown vision encoder variant {family!r} ({VARIANT_KEY}); known: {VISION_EXP}, {V41}"
        )
    types = {f.name: f.type for f in fields(VisionArgs)}
    values: dict[str, Any] = {"family": family}
    for key, (attr, _) in ARG_KEYS.items():
        full = f"{PREFIX}.{key}"
        values[attr] = _number(gguf, full, _key(gguf, full), float if types[attr] == "float" else int)
    if family == V41:
        values["image_token_id"] = _number(gguf, TOKEN_ID_KEY, _key(gguf, TOKEN_ID_KEY), int)
    elif TOKEN_ID_KEY in meta:
        values["image_token_id"] = _number(gguf, TOKEN_ID_KEY, meta[TOKEN_ID_KEY], int)
    for attr in _POSITIVE:
        if values[attr] <= 0:
            key = next(k for k, (a, _) in ARG_KEYS.items() if a == attr)
            raise ModelFileError(f"{path}: {PREFIX}.{key} must be positive, got {values[attr]}")
    args = VisionArgs(**values)
    try:
        args.check()
    except DwarfStarError as e:
        raise ModelFileError(f"{path}: {e}") from None
    return args


def _key(gguf: GGUFFile, key: str) -> Any:
    if key not in gguf.metadata:
        raise ModelFileError(f"{gguf.path}: the vision encoder's metadata lacks {key!r}")
    return gguf.metadata[key]


def _number(gguf: GGUFFile, key: str, value: Any, kind: type) -> Any:
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFileError(f"{gguf.path}: {key} must be an unsigned integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(f"{gguf.path}: {key} must be a number, got {value!r}")
    if gguf.metadata_types[key][0] == ValueType.FLOAT32:
        # the shortest decimal that is this float32: the value the writer meant (1e-06, not 9.99999997e-07)
        return float(str(np.float32(value)))
    return float(value)


def _check_tensors(gguf: GGUFFile, args: VisionArgs) -> None:
    path, tensors = gguf.path, gguf.tensors
    want = args.tensor_shapes()
    try:
        check_tensors(args, {name: info.shape for name, info in tensors.items()})
    except DwarfStarError as e:
        raise ModelFileError(f"{path}: {e}") from None
    for name, info in tensors.items():
        if name not in want and not _BIAS_NAME.fullmatch(name):
            raise ModelFileError(f"{path}: unexpected tensor {name!r}, which a {args.family} encoder does not have")
        if info.ggml_type not in FLOAT_TYPES:
            raise ModelFileError(
                f"{path}: tensor {name!r} is {info.ggml_type.name}; the vision encoder is read as BF16, F16 or F32"
            )


def _language(gguf: GGUFFile) -> tuple[int, int] | None:
    meta = gguf.metadata
    if LANGUAGE_LAYERS_KEY not in meta and LANGUAGE_EXPERTS_KEY not in meta:
        return None
    layers = _number(gguf, LANGUAGE_LAYERS_KEY, _key(gguf, LANGUAGE_LAYERS_KEY), int)
    experts = _number(gguf, LANGUAGE_EXPERTS_KEY, _key(gguf, LANGUAGE_EXPERTS_KEY), int)
    return layers, experts


def _router(gguf: GGUFFile, language: tuple[int, int] | None) -> RouterShape | None:
    """The router biases the file carries, all or none: every language layer's image bias, the MTP
    layers' and the hash layers' from 0 up, each F32-wide [expert_count]."""
    path = gguf.path
    found: dict[tuple[str, str], set[int]] = {}
    for name in gguf.tensors:
        m = _BIAS_NAME.fullmatch(name)
        if m:
            found.setdefault((m[1], m[3]), set()).add(int(m[2]))
    if not found:
        return None
    if language is None:
        raise ModelFileError(
            f"{path} carries router biases but not the language model they are for "
            f"({LANGUAGE_LAYERS_KEY}, {LANGUAGE_EXPERTS_KEY})"
        )
    n_layers, n_experts = language
    counts = {}
    for (kind, bias), pattern, expect in (
        (("layers", "bias_vl"), IMAGE_BIAS, n_layers),
        (("mtp", "bias_vl"), MTP_IMAGE_BIAS, None),
        (("layers", "bias"), TEXT_BIAS, None),
    ):
        have = found.pop((kind, bias), set())
        count = len(have) if expect is None else expect
        for i in range(count):
            if i not in have:
                raise ModelFileError(f"{path}: the router biases lack {pattern.format(i)}")
        extra = sorted(have - set(range(count)))
        if extra:
            raise ModelFileError(
                f"{path}: router bias {pattern.format(extra[0])} is past the language model's {n_layers} layers"
            )
        counts[pattern] = count
    if found:
        (kind, bias), indices = next(iter(found.items()))
        raise ModelFileError(f"{path}: unexpected tensor {kind}.{min(indices)}.ffn.gate.{bias}")
    router = RouterShape(n_layers, n_experts, counts[TEXT_BIAS], counts[MTP_IMAGE_BIAS])
    for name in router.tensor_names():
        shape = gguf.tensors[name].shape
        if shape != (n_experts,):
            raise ModelFileError(
                f"{path}: router bias {name} has shape {shape}, expected ({n_experts},) for {n_experts} experts"
            )
    return router


def describe(vision: VisionFile) -> list[str]:
    """What `dwarfstar inspect` shows of an encoder, one line each."""
    a = vision.args
    ratio = "none" if a.max_wh_ratio == 0 else f"{a.max_wh_ratio}:1"
    lines = [
        f"vision encoder: {FAMILY_NAMES[a.family]} ({a.family})",
        f"  ViT: {_count(a.n_layers, 'layer')}, width {a.dim}, {a.n_heads} heads of {a.head_dim}, MLP {a.inter_dim}, "
        f"{a.patch}-pixel patches",
        f"  aligner: {a.downsample}x{a.downsample} patches per token, output width {a.out_dim}",
        f"  image budget: {a.max_tokens} tokens, min {a.min_pixels} pixels, max width/height ratio {ratio}",
    ]
    if a.image_token_id is not None:
        lines.append(f"  image token id: {a.image_token_id}")
    lines.append(f"  tensors: {len(vision.gguf.tensors)}, {vision.nbytes:,} bytes ({vision.nbytes / 1e6:.1f} MB)")
    r = vision.router
    if r is None:
        where = " (V4.1's language model file carries them)" if a.family == V41 else ""
        lines.append(f"  image router biases: none{where}")
    else:
        lines.append(
            f"  image router biases: {_count(r.n_layers, 'layer')} and {_count(r.n_mtp_layers, 'MTP layer')} "
            f"of {r.n_experts} experts; text biases of {_count(r.n_hash_layers, 'hash-routed layer')}"
        )
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
