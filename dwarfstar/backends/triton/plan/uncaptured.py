"""The time of a step that no CUDA graph captures: its launches issued one by one from Python, its
uploads and host reads each waiting for the device.

A model, not a measurement. Without a graph every launch costs host time (Triton's launcher, or a
torch operation's dispatch) that a replay does not. The device runs the launches as they come; a
blocking upload (torch copies host to device with `memcpy_and_sync`: the copy, then the stream's
synchronize) or a host read of a device value waits until the device has finished everything issued
before it. So the step is a run of stretches, each ended by such a wait: a stretch takes the longer of
its host time and its device time (the `predict` model of each launch), then the wait's round trip
and its bytes over the host link. The Engram rows' reads from the file happen on the host before their
upload: counted apart (`HostReads`), not in the step's time, since they depend on the disk and cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dwarfstar.backends.triton.plan.eager import UPLOAD
from dwarfstar.backends.triton.plan.recorder import Launch


@dataclass(frozen=True)
class HostFigures:
    """Stated figures of the host that drives an uncaptured step: assumptions, not measured here."""

    triton_launch: float  # s of host time per Triton launch (binding the arguments, the launcher)
    torch_op: float  # s per torch operation on the device (dispatch and the CUDA launch)
    wait: float  # s: a blocking copy's or a host read's round trip once the device is idle
    link: float  # bytes/s of a copy from pageable host memory to the device


# a Python-launched Triton kernel ~20 us, an eager torch op on CUDA ~8 us, a synchronize round trip
# ~15 us and ~25 GB/s for pageable PCIe 5 uploads: common figures for an H100/H200 host, unmeasured here
HOST = HostFigures(20e-6, 8e-6, 15e-6, 25e9)


@dataclass
class Uncaptured:
    """An uncaptured step's waits and modelled time (`add` each launch in order, then `finish`)."""

    uploads: int = 0  # host -> device copies
    upload_bytes: int = 0
    syncs: int = 0  # device values read on the host
    blind_syncs: int = 0  # of them, values the model computed (read as zeros on the meta device)
    stretches: int = 0  # runs of launches ended by a wait (or by the step's end)
    host_seconds: float = 0.0  # issuing launches and waiting
    device_seconds: float = 0.0  # the launches' modelled time on the device
    seconds: float = 0.0  # the step
    host_reads: Any = None  # `step41.HostReads`: the Engram rows read from the file
    _host: float = 0.0  # the open stretch
    _device: float = 0.0

    def add(self, launch: Launch, device_seconds: float) -> None:
        if launch.kind in ("triton", "torch"):
            self._host += HOST.triton_launch if launch.kind == "triton" else HOST.torch_op
            self._device += device_seconds
            return
        if launch.kind == UPLOAD:
            self.uploads += 1
            self.upload_bytes += launch.bytes
        else:
            self.syncs += 1
            self.blind_syncs += "blind" in launch.name
        self._close(HOST.wait + launch.bytes / HOST.link)

    def finish(self) -> None:
        if self._host or self._device:
            self._close(0.0)

    def _close(self, wait: float) -> None:
        self.stretches += 1
        self.seconds += max(self._host, self._device) + wait
        self.host_seconds += self._host + wait
        self.device_seconds += self._device
        self._host = self._device = 0.0

    def lines(self, launches: int) -> list[str]:
        """What the report says of it."""
        reads = self.host_reads
        out = [
            f"** UNCAPTURED: the step runs eagerly, no CUDA graph; each of its {launches} launches costs host time "
            "(not hidden by a graph replay) **",
            f"host-device: {self.uploads} uploads ({self.upload_bytes} B; each a blocking copy that waits for the "
            f"device), {self.syncs} host reads of device values ({self.blind_syncs} of computed values): "
            f"{self.stretches} stretches between waits",
            f"modelled: host {self.host_seconds * 1e3:.3f} ms (launch {HOST.triton_launch * 1e6:.0f} us Triton, "
            f"{HOST.torch_op * 1e6:.0f} us torch, wait {HOST.wait * 1e6:.0f} us, assumed), device "
            f"{self.device_seconds * 1e3:.3f} ms: step {self.seconds * 1e3:.3f} ms (per stretch the longer of the two)",
        ]
        if reads is not None:
            out.append(
                f"Engram rows read on the host from the model file (SSD, not HBM; not in the time): {reads.rows} rows, "
                f"{reads.bytes} B in {reads.reads} reads per token"
            )
        return out

    def totals(self) -> dict:
        reads = self.host_reads
        return {
            "captured": False,
            "uploads": self.uploads,
            "upload_bytes": self.upload_bytes,
            "host_syncs": self.syncs,
            "blind_host_syncs": self.blind_syncs,
            "stretches": self.stretches,
            "host_ms_per_step": round(self.host_seconds * 1e3, 3),
            "device_ms_per_step": round(self.device_seconds * 1e3, 3),
            "engram_host_rows": reads.rows if reads else 0,
            "engram_host_bytes": reads.bytes if reads else 0,
        }
