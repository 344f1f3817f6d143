"""A traced plan checked by one rank's real trials (``batchfit plan CONFIG --gpus N --verify``).

Each activation-checkpointing choice's traced answer is tried for real at that micro-batch and the one
above it, on one device (one rank's shards over torch's fake process group); a traced answer whose real
trial does not fit gives way to the largest size one rank's real trials fit below it. When the plan
accumulates, the plan's micro-batch and the largest with the window's gradients held are tried as later
micro-batches of the window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchfit.devices.resolve import resolve_device
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.units import format_bytes
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.settings import Parallelism
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.verdict import PlanVerification

Found = list[tuple[Parallelism, LargestBatch]]  # each checkpointing choice and its largest micro-batch per rank


def verification_device(device: str, capacity_bytes: int) -> Any:
    """Where the real trials run: ``device`` as given, or with ``auto`` a simulated device of the plan's
    capacity per rank (refused in one line if this host cannot hold it)."""
    if device == "auto":
        return SimulatedDevice(capacity_bytes).for_workload(None)
    return resolve_device(device, None)


def verify_plan(
    workload: str, seq_len: int, found: Found, device: Any, progress: Progress = SILENT
) -> tuple[PlanVerification, Found]:
    """Each choice's traced answer tried for real at it and the size above (``verify_largest``), replaced by
    ``verified_batch_size`` where it did not fit; returns the check and ``found`` with the verified sizes."""
    from batchfit.parallel.one_rank import verified_batch_size
    from batchfit.parallel.one_rank import verify_largest

    check, verified = PlanVerification(device.name, []), []
    for parallelism, largest in found:
        with progress.working(f"Real trials of one rank at micro-batch {max(largest.batch_size, 1)} and above"):
            rows = verify_largest(workload, seq_len, largest, device=device)
        with progress.working(f"Real trials of one rank below the traced {largest.batch_size}, where it did not fit"):
            real = verified_batch_size(workload, seq_len, largest, rows, device=device)
        check.rows += [row.to_dict() | {"verified_batch_size": real} for row in rows]
        if real != largest.batch_size:
            check.notes.append(
                f"Activation checkpointing {parallelism.activation_checkpointing}: the traced micro-batch "
                f"{largest.batch_size} did not fit in one rank's real trial; the largest that does is {real}, "
                "and the plan uses it."
            )
            largest = dataclasses.replace(largest, batch_size=real)
        verified.append((parallelism, largest))
    progress.verified(check)
    return check, verified


def verify_accumulating(
    workload: str,
    seq_len: int,
    parallelism: Parallelism,
    planned: int,
    largest: int,
    device: Any,
    progress: Progress = SILENT,
) -> list[dict[str, Any]]:
    """The plan's micro-batch, the largest with the window's gradients held and the size above, each as one
    rank's real trial of a later micro-batch of the window (no fake figure beside them: the trace takes the
    held gradients' bytes off the capacity); said as each is found; the rows."""
    from batchfit.parallel.one_rank import probe_rank_batch_size

    rows = []
    for batch_size in dict.fromkeys((planned, largest, largest + 1)):
        with progress.working(f"Real trial of one rank at micro-batch {batch_size}, the window's gradients held"):
            trial = probe_rank_batch_size(
                workload, seq_len, batch_size, parallelism=parallelism, device=device, accumulating=True
            )
        rows.append(
            {
                "activation_checkpointing": parallelism.activation_checkpointing,
                "batch_size": batch_size,
                "accumulating": True,
                "real_peak_bytes": trial.peak_bytes,
                "fits": trial.fits,
                "error": trial.error,
            }
        )
        verdict = f"fits (peak {format_bytes(trial.peak_bytes)})" if trial.fits else "does not fit"
        progress.said(
            f"Verified on {device.name} as a later micro-batch (the window's gradients held): {batch_size} {verdict}."
        )
    return rows
