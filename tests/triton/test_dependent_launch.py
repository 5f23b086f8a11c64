"""Programmatic dependent launch (`runtime.dependent_launch`): on NVIDIA sm_90 and later only, never in
the interpreter, off on request (DWARFSTAR_PDL=off, or after a failed probe); a kernel launched so
waits for the kernel before it ahead of its first global read (`plan.disasm.waits_before_reading`,
which the AOT check applies to every such kernel)."""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from dwarfstar.backends.triton import gpu_bench, runtime
from dwarfstar.backends.triton.plan.disasm import waits_before_reading
from dwarfstar.backends.triton.plan.target import TargetOnlyDriver

ON = {"PDL": True, "launch_pdl": True}


@pytest.fixture
def compiling_for(monkeypatch):
    """Make `target` the active one, as gpu-plan and the AOT check do, and the interpreter off."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def activate(backend: str, arch) -> None:
        monkeypatch.setattr(driver, "_active", TargetOnlyDriver(GPUTarget(backend, arch, 32)))  # put back after

    yield activate
    runtime.set_dependent_launches(True)


@pytest.mark.parametrize(
    "backend,arch,launch",
    [("cuda", 90, ON), ("cuda", 100, ON), ("cuda", 89, {"PDL": False}), ("hip", "gfx942", {"PDL": False})],
)
def test_dependent_launch_on_hopper_and_later_only(compiling_for, backend, arch, launch):
    compiling_for(backend, arch)
    assert runtime.dependent_launch() == launch


def test_dependent_launch_off_on_request_and_in_the_interpreter(compiling_for, monkeypatch):
    compiling_for("cuda", 90)
    runtime.set_dependent_launches(False)  # a device that failed gpu_bench's probe
    assert runtime.dependent_launch() == {"PDL": False}
    runtime.set_dependent_launches(True)
    assert runtime.dependent_launch() == ON
    monkeypatch.setenv("DWARFSTAR_PDL", "off")  # tools/gpu_check.sh passes it to every step
    assert runtime.dependent_launch() == {"PDL": False}
    monkeypatch.setenv("DWARFSTAR_PDL", "on")
    assert runtime.dependent_launch() == ON
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.dependent_launch() == {"PDL": False}


def test_wait_must_come_before_the_first_global_read():
    head = "mov.u32 %r1, %ctaid.x;\n"
    wait = "griddepcontrol.launch_dependents;\ngriddepcontrol.wait;\n"
    load, atomic = (
        "ld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd1];\n",
        "atom.global.gpu.acq_rel.add.u32 %r6, [%rd2], 1;\n",
    )
    assert waits_before_reading(head + wait + load + atomic)
    assert not waits_before_reading(head + load + wait)  # a read ahead of the wait
    assert not waits_before_reading(head + atomic + wait + load)
    assert not waits_before_reading(head + load)  # no wait at all


def test_the_probe_chain_reads_each_link_before(device):
    """`gpu_bench.probe_dependent_launch`'s chain: 8 launches, each of what the one before wrote."""
    bufs = [torch.zeros(3000, device=device), torch.full((3000,), -7.0, device=device)]
    assert bool((gpu_bench.dependent_chain(bufs, 8) == 255.0).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device runs the probe itself")
def test_dependent_launches_run_and_capture_on_this_gpu():
    assert gpu_bench.probe_dependent_launch(torch.device("cuda")) is None
