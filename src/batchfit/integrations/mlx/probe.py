"""MlxProber: run trials of an MLX workload on an MlxDevice, restoring every bit of state after each one.

The same contract as torch's ``batchfit.search.prober.Prober``, so the search runs it unchanged: a context
manager whose ``probe(b)`` returns a ``Trial``. A trial runs ``steps`` full training steps on a batch
of ``b`` rows built from the sample; its peak is MLX's, absolute (parameters and optimizer state
included). MLX is lazy, so forward, backward and the update all run in the step's one ``mx.eval``:
the peak is recorded under the ``optimizer`` phase, which that eval ends, and an out-of-memory
error raised by it is ``failed_phase="optimizer"`` (``"forward"`` while the batch is built). MLX
dispatches work ahead of the computation, so a step's peak varies from run to run by about one
intermediate array: a trial keeps the largest over its steps; give a margin for headroom.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

import mlx.core as mx

from batchfit.devices.oom import summarize_oom
from batchfit.devices.units import format_bytes
from batchfit.integrations.mlx.batch import batch_bytes
from batchfit.integrations.mlx.batch import resize_batch
from batchfit.integrations.mlx.device import MlxDevice
from batchfit.integrations.mlx.device import is_mlx_oom
from batchfit.integrations.mlx.snapshot import MlxSnapshot
from batchfit.integrations.mlx.trainable import MlxTrainable
from batchfit.search.prober import check_room
from batchfit.search.prober import check_steps
from batchfit.search.trial import Trial


@dataclass
class _Record:
    """What a trial has measured so far (kept when an OOM cuts it short)."""

    steps: int = 0
    held_bytes: int | None = None
    phase: str = "forward"
    step_seconds: list[float] = field(default_factory=list)


class MlxProber:
    """Use as a context manager: on entry the state is saved; ``probe(b)`` runs one trial; on exit
    (and after every trial) everything is put back. Only MLX out-of-memory errors are caught; any
    other exception, ``KeyboardInterrupt`` included, propagates unchanged after the state is restored.

    >>> import mlx.nn as nn, mlx.optimizers as optim
    >>> from batchfit.integrations.mlx.workload import MlxWorkload
    >>> work = MlxWorkload(nn.Linear(4, 1), mx.zeros((2, 4)), loss_fn=lambda out, batch: out.mean(),
    ...                    optimizer=optim.Adam(learning_rate=1e-3))
    >>> with MlxProber(work, MlxDevice("64MiB")) as prober:
    ...     trial = prober.probe(16)
    >>> trial.fits, trial.steps, list(trial.phase_peak_bytes)
    (True, 2, ['optimizer'])
    """

    compile_watch = None  # what torch's Prober reports about torch.compile; nothing to watch for MLX

    def __init__(
        self,
        workload: MlxTrainable,
        device: MlxDevice,
        *,
        steps: int = 2,
        limit_bytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        check_steps(steps)
        self.workload = workload
        self.device = device
        self.steps = steps
        self.limit_bytes = limit_bytes
        self.clock = clock
        self.baseline_bytes = 0
        self._snapshot: MlxSnapshot | None = None

    def __enter__(self) -> MlxProber:
        try:
            with self.device.measuring():
                self._snapshot = MlxSnapshot.take(self.workload.model, self.workload.optimizer)
                mx.eval(self.workload.sample_batch)
            self.device.collect()  # MLX counts every live array: garbage of earlier workloads must go first
            self.baseline_bytes = self.device.live_bytes()
            self._check_capacity()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._snapshot is not None:
            self._snapshot.restore()
        self.device.cleanup()

    def _check_capacity(self) -> None:
        check_room(
            self.device,
            self.limit_bytes,
            self.baseline_bytes,
            "MLX already holds",
            "parameters, optimizer state, the sample",
        )

    def probe(self, batch_size: int, steps: int | None = None) -> Trial:
        """Run one trial at ``batch_size`` (``steps`` full steps, default the prober's) and put the state back."""
        if self._snapshot is None:
            raise RuntimeError("use MlxProber as a context manager: with MlxProber(...) as prober: prober.probe(8)")
        record = _Record()
        start = time.perf_counter()
        error = peak = None
        try:
            peak = self._run_steps(batch_size, record, self.steps if steps is None else steps)
        except BaseException as exc:
            if not is_mlx_oom(exc):
                self._reset()
                raise
            error = summarize_oom(exc)
        seconds = time.perf_counter() - start
        self._reset()
        return self._trial(batch_size, record, seconds, peak, error)

    def _run_steps(self, batch_size: int, record: _Record, steps: int) -> int:
        device, work = self.device, self.workload

        def mark(phase: str) -> None:
            if phase == "forward":  # the graph is built: the eval that runs it ends the step
                record.phase = "optimizer"

        with device.measuring():
            device.reset_peak()
            batch = resize_batch(work.sample_batch, batch_size)
            mx.eval(batch)
            held_batch = batch_bytes(batch)
            for _ in range(steps):
                record.phase = "forward"
                record.held_bytes = device.live_bytes() - held_batch
                started = self.clock()
                work.train_step(batch, mark)
                device.synchronize()
                record.step_seconds.append(self.clock() - started)
                record.steps += 1
            return device.peak_bytes()

    def _reset(self) -> None:
        """Restore the state and free what the trial left (a full collection only when needed)."""
        assert self._snapshot is not None
        self._snapshot.restore()
        self.device.cleanup()
        if self.device.live_bytes() > self.baseline_bytes:
            self.device.collect()

    def _trial(self, batch_size: int, record: _Record, seconds: float, peak: int | None, error: str | None) -> Trial:
        common = dict(steps=record.steps, held_bytes=record.held_bytes, step_seconds=tuple(record.step_seconds))
        if error is not None or peak is None:
            return Trial(batch_size, False, None, seconds, error, oom=True, failed_phase=record.phase, **common)
        phases = {"optimizer": peak}
        if self.limit_bytes is not None and peak > self.limit_bytes:
            over = (
                f"peak {format_bytes(peak)} is over the usable {format_bytes(self.limit_bytes)} (capacity minus margin)"
            )
            return Trial(batch_size, False, peak, seconds, over, phase_peak_bytes=phases, **common)
        return Trial(batch_size, True, peak, seconds, None, phase_peak_bytes=phases, **common)
