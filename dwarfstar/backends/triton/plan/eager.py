"""A step that is not graph-captured, recorded as it runs: launches, host-device transfers and host syncs.

`recorder.record` records a captured step, in which a host read of a device value cannot happen. An
eager step (V4.1's first Triton version) does read device values on the host (a position to index
with) and uploads host tensors (positions, Engram rows) inside the step. On the meta device such a
value does not exist, so small tensors are shadowed: each one made on the host and uploaded, or
computed by torch from shadowed tensors only (positions, index ranges), keeps a CPU copy computed
alongside, and a host read of it returns the copy's value. A tensor a Triton kernel is handed, or a
torch operation writes from unshadowed inputs, loses its shadow (and every view of its storage). A
host read of a tensor with no shadow (a value the model computed, e.g. a drawn token) is recorded as
a blind sync and reads zeros: the step then runs as it would with that value.

The step's list holds, in order, every launch (`recorder.Launch`, kinds "triton" and "torch") and
every transfer: kind "upload" (a host tensor copied to the device: torch's blocking copy, which also
waits for the device's stream) and kind "sync" (a device value read on the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from dwarfstar.backends.triton.plan.recorder import NO_LAUNCH, Launch, _programs
from dwarfstar.backends.triton.plan.target import intercepted

SHADOW_LIMIT = 1 << 16  # elements: only small tensors are shadowed (positions, ranges, picks of one token)
UPLOAD, SYNC = "upload", "sync"
READS = frozenset({"_local_scalar_dense", "item"})  # a scalar read on the host
# allocations whose values are undefined: no shadow (a kernel fills them)
UNDEFINED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _crosses(name: str, args, kwargs) -> bool:
    """A copy between the host and the meta device."""
    if name == "copy_":
        return (args[0].device.type == "meta") != (args[1].device.type == "meta")
    if name in ("_to_copy", "to"):  # inference mode leaves `to` whole
        device = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, torch.device)), None)
        return device is not None and (torch.device(device).type == "meta") != (args[0].device.type == "meta")
    return False


class _EagerLaunches(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, launches: list[Launch]) -> None:
        super().__init__()
        self.launches = launches
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> its CPU copy

    def forget(self, tensors) -> None:
        """Drop the shadows of these tensors' storages: something wrote them that has no shadow."""
        storages = {_storage(t) for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "meta"}
        for t in [t for t in self.shadows.keys() if _storage(t) in storages]:
            del self.shadows[t]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        metas = [t for t in flat if t.device.type == "meta"]
        if name in READS and metas:
            return self._read(metas[0])
        if _crosses(name, args, kwargs):
            return self._transfer(func, args, kwargs)
        out = func(*args, **kwargs)
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        no_op = any(out is x for x in flat)
        if name not in NO_LAUNCH and not no_op and (metas or any(t.device.type == "meta" for t in outs)):
            moved = sum(t.numel() * t.element_size() for t in [*metas, *outs] if t.device.type == "meta")
            self.launches.append(Launch("torch", name, bytes=moved))
        self._shadow(func, name, args, kwargs, metas, out)
        return out

    def _shadow(self, func, name: str, args, kwargs, metas: list[torch.Tensor], out) -> None:
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.device.type == "meta"]
        small = all(t.numel() <= SHADOW_LIMIT for t in [*metas, *outs])
        if name in UNDEFINED or not outs or not small or not all(t in self.shadows for t in metas):
            self.forget(metas if name not in NO_LAUNCH else [])  # written by what has no shadow (in place)
            return

        def host(x):
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                return self.shadows[x]
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x

        with torch.utils._python_dispatch._disable_current_modes():
            shadow = func(*tree_map(host, args), **tree_map(host, kwargs))
        for meta, cpu in zip(tree_flatten(out)[0], tree_flatten(shadow)[0], strict=True):
            if isinstance(meta, torch.Tensor) and meta.device.type == "meta":
                self.shadows[meta] = cpu

    def _read(self, t: torch.Tensor):
        self.launches.append(Launch(SYNC, "item" if t in self.shadows else "item (blind)", bytes=t.element_size()))
        with torch.utils._python_dispatch._disable_current_modes():
            return self.shadows[t].item() if t in self.shadows else torch.zeros((), dtype=t.dtype).item()

    def _transfer(self, func, args, kwargs):
        """A copy between the host and the device: an upload (host -> meta) or a host read."""
        in_place = func.overloadpacket.__name__ == "copy_"
        src = args[1] if in_place else args[0]
        with torch.utils._python_dispatch._disable_current_modes():
            if src.device.type != "meta":  # host -> device
                out = func(*args, **kwargs)
                self.forget([out])
                if src.numel() <= SHADOW_LIMIT:
                    self.shadows[out] = src.to(out.dtype).clone()
                self.launches.append(
                    Launch(UPLOAD, func.overloadpacket.__name__, bytes=out.numel() * out.element_size())
                )
                return out
            known = src in self.shadows  # device -> host: a read of the device's values
            self.launches.append(Launch(SYNC, "to host" if known else "to host (blind)", bytes=src.nbytes))
            value = self.shadows[src] if known else torch.zeros(src.shape, dtype=src.dtype)
            return args[0].copy_(value) if in_place else func(value, *args[1:], **kwargs)


class _Launches(list):
    """The recorded list, each launch tagged with the layer running when it was added."""

    def __init__(self, layer: Callable[[], int | None]) -> None:
        super().__init__()
        self.layer = layer

    def append(self, launch: Launch) -> None:
        launch.layer = self.layer()
        super().append(launch)


def record_eager(
    step: Callable[[], None],
    warmup: Callable[[], None] | None = None,
    layer: Callable[[], int | None] = lambda: None,
) -> list[Launch]:
    """Run `warmup()` (if any) and then `step()` with every device launch, upload and host read
    intercepted, and return `step()`'s, in order, each tagged with `layer()` when it came."""
    launches = _Launches(layer)
    mode = _EagerLaunches(launches)

    def on_launch(fn, args, grid, kwargs):
        named = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        launches.append(Launch("triton", fn.fn.__name__, _programs(grid, named), named, fn, (args, grid, kwargs)))
        mode.forget([*args, *kwargs.values()])  # a kernel may write any tensor it is handed

    with intercepted(on_launch), mode, torch.inference_mode():
        if warmup is not None:
            warmup()
            launches.clear()
        step()
    return list(launches)
