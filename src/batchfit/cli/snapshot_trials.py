"""The trial a ``--memory-snapshot FILE`` writes (``batchfit find``, ``batchfit estimate``): one trial of a workload at
a batch size, run on the device the command measured on, as a PyTorch memory snapshot
(``batchfit.devices.memory_snapshots``). It runs a trial, so it lives above the search layer; the bodies of
``find`` and ``estimate`` import it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rich.markup import escape

from batchfit.cli.common import console
from batchfit.devices.allocator_replay import SETTLE_STEPS
from batchfit.devices.cuda import CudaDevice
from batchfit.devices.interrupts import interrupts_deferred
from batchfit.devices.memory_snapshots import memory_snapshot
from batchfit.devices.memory_snapshots import recording_cuda_history
from batchfit.devices.memory_snapshots import snapshot_refusal
from batchfit.devices.memory_snapshots import write_snapshot
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import tracing
from batchfit.errors import InputError
from batchfit.files import STDOUT
from batchfit.files import check_writable
from batchfit.search.prober import Prober


def snapshot_trial(
    workload: Any,
    batch_size: int,
    device: Any,
    *,
    steps: int = 2,
    run_on: bool = True,
    settle_steps: int = SETTLE_STEPS,
) -> dict[str, Any]:
    """One trial of ``workload`` at ``batch_size`` on ``device``, state restored after it, as a memory snapshot: on
    a device that models the CUDA caching allocator (a ``TraceDevice`` runs it on fake tensors), its
    ``memory_snapshot``; on a CUDA GPU, torch's own (``torch.cuda.memory._record_memory_history`` with no stack
    frames around the trial, then ``torch.cuda.memory._snapshot``). Any other device is an ``InputError``."""
    if isinstance(device, CudaDevice):
        with interrupts_deferred(), recording_cuda_history() as snapshots:
            with Prober(device.prepare(workload), device, steps=steps) as prober:
                prober.probe(batch_size)
            snapshot = snapshots()
        snapshot["batchfit"] = {"device": device.name, "batch_size": batch_size, "steps": steps}
        return snapshot
    if getattr(getattr(device, "counter", None), "allocator", None) is None:
        memory_snapshot(device)  # the one-line refusal, before the trial
    traced = isinstance(device, TraceDevice)
    with interrupts_deferred(), tracing() if traced else contextlib.nullcontext():
        prepared = device.prepare(workload)
        with Prober(prepared, device, steps=steps, settle_steps=0) as prober:  # the loop runs on in the snapshot
            prober.probe(batch_size)
            measured = prober.device
    return memory_snapshot(measured, batch_size=batch_size, run_on=run_on, settle_steps=settle_steps)


SHARDED_SNAPSHOT = "--memory-snapshot snapshots one device's trial of a workload: not with --gpus"


def check_snapshot_output(path: Path, device: Any) -> None:
    """``--memory-snapshot PATH`` refused before the search, in one line, where it cannot be written: standard
    output (a pickle is binary), a device without the CUDA caching allocator (real or modelled), a path that
    cannot be written."""
    if str(path) == STDOUT:
        raise InputError("--memory-snapshot writes a pickle: give it a file path, not -")
    refusal = snapshot_refusal(device)
    if refusal is not None:
        raise InputError(refusal)
    check_writable(path)


def write_memory_snapshot(workload: Any, device: Any, batch_size: int, path: Path, *, quiet: bool) -> None:
    """The trial at ``batch_size`` run (again) on ``device`` and written to ``path`` as a PyTorch memory snapshot;
    a line says where, unless ``quiet``."""
    with console.status(f"Batch size {batch_size} again, for its memory snapshot", spinner="dots") as status:
        if quiet:
            status.stop()
        snapshot = snapshot_trial(workload, batch_size, device)
    write_snapshot(snapshot, path)
    if not quiet:
        events = sum(len(trace) for trace in snapshot["device_traces"])
        line = (
            f"Wrote {path}: the memory snapshot of batch size {batch_size} ({events} allocator events); view it at "
            f"pytorch.org/memory_viz or replay it with: batchfit allocator {path}"
        )
        console.print(escape(line), highlight=False, soft_wrap=True)
