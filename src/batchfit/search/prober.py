"""Prober: run trials of a workload on a device, restoring every bit of state after each one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

from batchfit.bounds import check_steps_count
from batchfit.devices.allocator_replay import SETTLE_STEPS
from batchfit.devices.base import Device
from batchfit.devices.cleanup import drain_autograd_queue
from batchfit.devices.interrupts import raise_if_interrupted
from batchfit.devices.oom import is_oom
from batchfit.devices.oom import summarize_oom
from batchfit.devices.resolve import model_device
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import ModelDoesNotFitError
from batchfit.search.trial import Trial
from batchfit.step.batching import copy_batch
from batchfit.step.batching import host_batch
from batchfit.step.batching import resize_batch
from batchfit.step.batching import tensor_leaves
from batchfit.step.compiled import CompileWatch
from batchfit.step.compiled import is_compiled
from batchfit.step.compiled import mark_batch_dynamic
from batchfit.step.state import StateSnapshot
from batchfit.step.workload import LoopVariables
from batchfit.step.workload import Workload


def _same_place(a: torch.device, b: torch.device) -> bool:
    index_a = a.index if a.index is not None else 0
    index_b = b.index if b.index is not None else 0
    return a.type == b.type and (a.type == "cpu" or index_a == index_b)


def _move_optimizer_state(optimizer: torch.optim.Optimizer | None, source: torch.device, target: torch.device) -> None:
    """Move optimizer state that lives with its parameters from ``source`` to ``target``. As in
    torch's ``load_state_dict``, a ``step`` count stays where it is unless the group is
    ``capturable`` or ``fused`` (then it lives on the parameters' device)."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        steps_move = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            entries = optimizer.state.get(param, {})
            for key, value in entries.items():
                if (
                    isinstance(value, torch.Tensor)
                    and _same_place(value.device, source)
                    and (key != "step" or steps_move)
                ):
                    entries[key] = value.to(target)


class Prober:
    """Use as a context manager: on entry the state is saved (and the model moved to ``device``
    if it lives elsewhere); ``probe(b)`` runs one trial; on exit everything is put back.

    A trial runs ``steps`` full training steps (forward, loss, backward, optimizer step) as the loop
    people write runs them, from the state training starts in: each step copies a batch of ``b`` rows
    (built once on the host from the sample's) onto the device while the last step's batch, output
    and loss still live, so the optimizer state made by step 1 is alive during step 2. On a device
    that models the CUDA caching allocator the loop then runs on in the model, the last step again
    and again, until the allocator's cache settles (up to ``settle_steps`` more steps; 0: none): a
    step that would run out of memory there fails the trial (``Trial.loop_steps``, ``Trial.settled``).
    Only out-of-memory errors are caught; any other exception, ``KeyboardInterrupt``
    included, propagates unchanged after the state is restored. ``phase_hook(name)`` is called
    before each step's batch is copied in (``"step"``), after (``"batch"``) and at the end of each phase. Each step is timed with
    ``clock`` (device synchronised), for throughput. Trials measure on
    ``device.for_workload(workload)``: the device as it measures this workload.
    """

    def __init__(
        self,
        workload: Workload,
        device: Device,
        *,
        steps: int = 2,
        limit_bytes: int | None = None,
        phase_hook: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        settle_steps: int = SETTLE_STEPS,
    ):
        check_steps(steps)
        self.settle_steps = settle_steps
        self.workload = workload
        self.device = device.for_workload(workload)  # per search: the caller's device is left as it was
        self.steps = steps
        self.limit_bytes = limit_bytes
        self.phase_hook = phase_hook or (lambda phase: None)
        self.clock = clock
        self.baseline_bytes = 0
        self._snapshot: StateSnapshot | None = None
        self._home: torch.device | None = None
        self._sample: Any = None
        self.compile_watch: CompileWatch | None = None  # set when the model probed is a compiled one

    def __enter__(self) -> Prober:
        work = self.workload
        self._home = model_device(work.model)
        target = self.device.torch_device
        # Move first, then snapshot: moving replaces buffer objects, so the snapshot must hold the
        # tensors the trials will use; __exit__ restores them there and moves everything back.
        if not _same_place(self._home, target):
            work.model.to(target)
            _move_optimizer_state(work.optimizer, self._home, target)
        try:
            self._snapshot = StateSnapshot.take(work.model, work.optimizer)
            # The sample stays where it is: a trial's batch reaches the device as a loader's
            # batch does, so only its own rows count, never the sample's as well.
            self._sample = work.sample_batch
            self.device.register(work.state_tensors())
            self.device.cleanup()
            self.baseline_bytes = self.device.live_bytes()
            self._check_capacity()
            self.compile_watch = CompileWatch() if is_compiled(work.model) else None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._sample = None
        if self._snapshot is not None:
            self._snapshot.restore()
        if self._home is not None and not _same_place(self._home, self.device.torch_device):
            self.workload.model.to(self._home)
            _move_optimizer_state(self.workload.optimizer, self.device.torch_device, self._home)
        self.device.cleanup()

    def _check_capacity(self) -> None:
        check_room(
            self.device,
            self.limit_bytes,
            self.baseline_bytes,
            "the workload already holds",
            "parameters, buffers, gradients, optimizer state",
        )

    def probe(self, batch_size: int, steps: int | None = None) -> Trial:
        """Run one trial at ``batch_size`` (``steps`` full steps, default the prober's) and put the state back."""
        if self._snapshot is None:
            raise RuntimeError("use Prober as a context manager: with Prober(...) as prober: prober.probe(8)")
        record = _Record()
        start = time.perf_counter()
        error = None
        try:
            self._run_steps(batch_size, record, self.steps if steps is None else steps)
        except BaseException as exc:
            if not is_oom(exc):
                self._reset()
                raise
            error = summarize_oom(exc)
        seconds = time.perf_counter() - start
        self._reset()
        return self._trial(batch_size, record, seconds, error)

    def _run_steps(self, batch_size: int, record: _Record, steps: int) -> None:
        device, work = self.device, self.workload
        device_type = device.torch_device.type

        reserved_peak = getattr(device, "reserved_peak_bytes", None)
        note = getattr(device, "mark", lambda label: None)

        def mark(phase: str) -> None:
            if phase in ("backward", "optimizer"):  # the optimizer step's own time: between these two marks
                if device_type != "cpu":  # an accelerator's queued work (the CPU's, and a simulated device's, is done)
                    device.synchronize()
                now = self.clock()
                if phase == "optimizer" and record.backward_done is not None:
                    record.optimizer_seconds.append(now - record.backward_done)
                record.backward_done = now if phase == "backward" else None
            record.peaks[phase] = max(record.peaks.get(phase, 0), device.peak_bytes())
            reserved = reserved_peak() if reserved_peak is not None else None
            if reserved is not None:
                record.reserved_peak = max(record.reserved_peak or 0, reserved)
            record.phase = _NEXT_PHASE.get(phase, "forward")
            note(phase)
            self.phase_hook(phase)
            device.reset_peak()

        # The rows are built on the host, as a loader builds them, and copied in at the start of every step
        # while the last step's copy still lives (``batch = to_device(next(loader))`` rebinds it afterwards).
        with getattr(device, "host", contextlib.nullcontext)():
            rows = resize_batch(host_batch(self._sample), batch_size)
        with device.measuring(uncounted=[*tensor_leaves(self._sample), *tensor_leaves(rows)]):
            device.reset_peak()
            scaler = work.make_scaler(device_type)
            held = LoopVariables()  # a loop's `batch`, `outputs` and `loss`, alive from one step into the next
            for _ in range(steps):
                raise_if_interrupted()
                note("step")
                self.phase_hook("step")
                held.batch = copy_batch(rows, device.torch_device)
                if self.compile_watch is not None:
                    mark_batch_dynamic(held.batch)  # one graph for every size, not a recompile per size
                note("batch")
                self.phase_hook("batch")
                record.held_bytes = device.live_bytes() - held.tensor_bytes()
                started = self.clock()
                if work.mode == "train":
                    work.train_step(held.batch, device_type, scaler, mark, held, note)
                else:
                    work.eval_step(held.batch, device_type, mark, held)
                device.synchronize()
                record.step_seconds.append(self.clock() - started)
                record.steps += 1
            note("end")
            self._run_on(record)

    def _run_on(self, record: _Record) -> None:
        """Where the device models a caching allocator: the loop run on past the trial's steps, in the model,
        until the allocator settles; an out-of-memory error where a later step would meet one."""
        loop_replay = getattr(self.device, "loop_replay", None)
        outcome = loop_replay(self.settle_steps) if loop_replay is not None and self.settle_steps else None
        if outcome is None:
            return
        record.loop_steps, record.settled = outcome.loop_steps, outcome.settled
        if not outcome.served:
            record.phase = outcome.failed_phase or record.phase
            loop = f" ({outcome.loop.describe()})" if outcome.loop is not None else ""
            raise torch.OutOfMemoryError(
                f"{self.device.name} out of memory (CUDA out of memory, simulated) at step {outcome.failed_step} of "
                f"the training loop{loop}, in {record.phase}: the caching allocator model ran the loop on from "
                f"the trial's {record.steps} steps, which it served"
            )

    def _reset(self) -> None:
        """Restore the state and free what the trial left; a full collection only when needed
        (after an OOM, tracebacks form reference cycles that hold activations: pytorch#82218)."""
        assert self._snapshot is not None
        drain_autograd_queue()
        self._snapshot.restore()
        self.device.register(self.workload.state_tensors())  # tensors a restore had to re-create
        self.device.cleanup()
        if self.device.live_bytes() > self.baseline_bytes:
            self.device.collect()

    def _trial(self, batch_size: int, record: _Record, seconds: float, error: str | None) -> Trial:
        common = dict(
            phase_peak_bytes=record.peaks,
            steps=record.steps,
            held_bytes=record.held_bytes,
            step_seconds=tuple(record.step_seconds),
            optimizer_seconds=tuple(record.optimizer_seconds),
            reserved_peak_bytes=record.reserved_peak,
            loop_steps=record.loop_steps,
            settled=record.settled,
        )
        if error is not None:
            return Trial(batch_size, False, None, seconds, error, oom=True, failed_phase=record.phase, **common)
        timeline, exact = self.device.timeline(), self.device.exact_timeline()
        common["timeline"] = tuple(timeline) if timeline else None
        common["exact_timeline"] = tuple(exact) if exact else None
        peak = max(record.peaks.values())
        if self.limit_bytes is not None and peak > self.limit_bytes:
            over = (
                f"peak {format_bytes(peak)} is over the usable {format_bytes(self.limit_bytes)} (capacity minus margin)"
            )
            return Trial(batch_size, False, peak, seconds, over, **common)
        return Trial(batch_size, True, peak, seconds, None, **common)


def check_steps(steps: Any) -> None:
    """``steps`` must be a positive integer (a trial's full training steps)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InputError(f"steps must be at least 1 (2 or more to include optimizer state), got {steps!r}")
    check_steps_count("steps", steps)


def check_room(device: Any, limit_bytes: int | None, baseline_bytes: int, holder: str, held: str) -> None:
    """``ModelDoesNotFitError`` when what is held before any batch already fills the usable
    memory (``limit_bytes``, else the device's capacity); ``holder`` and ``held`` word the message."""
    limit = limit_bytes if limit_bytes is not None else device.capacity_bytes()
    if limit is not None and baseline_bytes >= limit:
        raise ModelDoesNotFitError(
            f"{device.name} has {format_bytes(limit)} usable but {holder} {format_bytes(baseline_bytes)} "
            f"before any batch ({held}): give a larger capacity or a smaller margin"
        )


@dataclass
class _Record:
    """What a trial has measured so far (kept when an OOM cuts it short)."""

    peaks: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    held_bytes: int | None = None
    phase: str = "forward"  # where the trial is now: the phase an OOM struck in
    step_seconds: list[float] = field(default_factory=list)
    optimizer_seconds: list[float] = field(default_factory=list)  # each step's optimizer step and zero_grad
    backward_done: float | None = None  # when this step's backward ended
    reserved_peak: int | None = None  # the caching allocator's, where the device has one
    loop_steps: int | None = None  # steps of the loop the allocator model ran (the trial's, then more)
    settled: bool | None = None  # whether the modelled allocator's state repeated within them


_NEXT_PHASE = {"forward": "backward", "backward": "optimizer"}
