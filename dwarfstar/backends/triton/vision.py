"""The vision encoder on the Triton backend's device.

The encoder is small next to the language model and runs once per image, at prefill, so it needs no
kernels of its own: it is the torch oracle's steps (backends/reference/vision.py) on the GPU with
bfloat16 operands in its products (tensor cores, float32 accumulation) and a fused attention, the
norms, RoPE, softmax and activations staying float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dwarfstar.backends.reference.vision import TorchVisionOps
from dwarfstar.model.vision import VisionArgs

DTYPE = torch.bfloat16  # the products' operands (the checkpoint's own type)


def vision_ops(
    args: VisionArgs, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
) -> TorchVisionOps:
    """The encoder's steps on `device` (default: the backend's, `runtime.default_device()`)."""
    if device is None:
        from dwarfstar.backends.triton.runtime import default_device

        device = default_device()
    return TorchVisionOps(args, tensors, device=device, dtype=DTYPE)
