"""The methods benchmarks/peers.py compares, each run on a fresh workload and simulated device.

batchfit's strategies run through ``bf.search``. The peers run for real: Lightning's
``Tuner.scale_batch_size`` on a CPU ``Trainer``, accelerate's ``find_executable_batch_size``, and an
Ultralytics-style linear fit written here from its documented algorithm. A peer's OOMs are the
simulated device's own: the whole peer call runs inside ``device.measuring()`` with the model's
state registered first, so every byte counts as it would on a GPU. Trials, OOMs and steps are
counted from what actually ran (a wrapped step, a wrapped trial loop), not from the peer's claims.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

import numpy as np
import torch
from bench_workloads import Case

import batchfit as bf
from batchfit.devices.cleanup import drain_autograd_queue  # the peers' trials end with it, as batchfit's do
from batchfit.search.strategies import Grow
from batchfit.step.batching import resize_batch
from batchfit.step.batching import tensor_leaves
from batchfit.step.workload import compute_loss

STEPS_PER_CALL = 2  # accelerate: steps per call of the wrapped function, as in a batchfit trial
CHECK_STEPS = 20  # the check after a search: this many real training steps at the size found
CLASSIC_MAX = 512  # the classic bisection's max_batch_size (binary), also grow's cap
GROW_START, GROW_ATTEMPTS = 32, 5  # grow: the starting estimate and its usual cap on attempts
ULTRALYTICS_SIZES = (1, 2, 4, 8, 16)  # the sizes Ultralytics' autobatch profiles
ULTRALYTICS_FRACTION = 0.60  # its default fraction of memory to aim at
ULTRALYTICS_DEFAULT, ULTRALYTICS_SAFE_MAX = 16, 1024  # its fallback batch outside [1, 1024]


@dataclass
class Tally:
    """What a method actually ran: every size tried in order, which fitted, OOMs and steps."""

    sizes: list[int] = field(default_factory=list)
    fitted: list[int] = field(default_factory=list)
    ooms: int = 0
    steps: int = 0


@dataclass
class Run:
    """One method on one case."""

    found: int | None
    tally: Tally
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tested(self) -> bool | None:
        """Whether the size returned is one that ran and fitted during the search (``None``: no answer)."""
        return None if self.found is None else self.found in self.tally.fitted


def train_step(work: bf.Workload, batch: object) -> None:
    """One plain training step, as a user's loop writes it."""
    loss = compute_loss(work.model, batch, loss_fn=work.loss_fn)
    loss.backward()
    work.optimizer.step()
    work.optimizer.zero_grad(set_to_none=True)


def prepared(case: Case) -> tuple[bf.Workload, bf.SimulatedDevice]:
    """A fresh workload and device, the workload's state and sample registered (as a probe does)."""
    drain_autograd_queue()
    work, device = case.build(), bf.SimulatedDevice(case.capacity)
    device.register([*work.state_tensors(), *tensor_leaves(work.sample_batch)])
    return work, device


def runs_steps(case: Case, batch_size: int, steps: int = CHECK_STEPS) -> bool:
    """Whether ``steps`` real training steps at ``batch_size`` run without an OOM, every byte counted."""
    work, device = prepared(case)
    try:
        with device.measuring():
            batch = resize_batch(work.sample_batch, batch_size)
            for _ in range(steps):
                train_step(work, batch)
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
    return True


# -- batchfit ---------------------------------------------------------------------------------


def batchfit_method(strategy: str, **options: object) -> Callable[[Case], Run]:
    """``bf.search`` with ``strategy`` and ``options`` (trace, max_batch_size, max_trials)."""

    def run(case: Case) -> Run:
        drain_autograd_queue()
        work, device = case.build(), bf.SimulatedDevice(case.capacity)
        chosen = Grow(start=GROW_START) if strategy == "grow" else strategy
        start = time.perf_counter()
        try:
            result = bf.search_workload(work, device=device, strategy=chosen, **{"trace": False, **options})
        except bf.NoBatchFitsError as error:  # grow's 5 attempts can run out before anything fits
            trials = error.trials
            tally = Tally([t.batch_size for t in trials], [], sum(t.oom for t in trials), sum(t.steps for t in trials))
            return Run(None, tally, time.perf_counter() - start, {"error": str(error)})
        seconds = time.perf_counter() - start
        tally = Tally(
            [t.batch_size for t in result.trials],
            [t.batch_size for t in result.trials if t.fits],
            result.oom_trials,
            result.steps,
        )
        traced = result.extra.get("trace") or {}
        return Run(
            result.batch_size,
            tally,
            seconds,
            {
                "trace_estimate": traced.get("batch_size"),
                "trace_trials": traced.get("trials"),
                "trace_seconds": traced.get("seconds"),
            },
        )

    return run


# -- accelerate -------------------------------------------------------------------------------


def accelerate_method(starting_batch_size: int) -> Callable[[Case], Run]:
    """``find_executable_batch_size`` around a function that runs real training steps at its size."""

    def run(case: Case) -> Run:
        return accelerate_run(*prepared(case), starting_batch_size)

    return run


def accelerate_run(work: bf.Workload, device: bf.SimulatedDevice, starting_batch_size: int) -> Run:
    """accelerate's ``find_executable_batch_size`` from ``starting_batch_size`` around a function
    that runs ``STEPS_PER_CALL`` real training steps at its size, each ending with
    ``device.synchronize()`` as a batchfit trial's does."""
    from accelerate.utils import find_executable_batch_size

    tally = Tally()

    def train(batch_size: int) -> int:
        tally.sizes.append(batch_size)
        try:
            with device.measuring():
                batch = resize_batch(work.sample_batch, batch_size)
                for _ in range(STEPS_PER_CALL):
                    train_step(work, batch)
                    device.synchronize()
                    tally.steps += 1
        except torch.OutOfMemoryError:
            tally.ooms += 1
            raise
        finally:
            drain_autograd_queue()
        tally.fitted.append(batch_size)
        return batch_size

    start = time.perf_counter()
    try:
        found = find_executable_batch_size(train, starting_batch_size=starting_batch_size)()
    except RuntimeError as error:  # "No executable batch size found, reached zero."
        return Run(None, tally, time.perf_counter() - start, {"error": str(error)})
    return Run(found, tally, time.perf_counter() - start)


# -- Ultralytics-style ------------------------------------------------------------------------


def ultralytics_style(case: Case) -> Run:
    """Ultralytics' documented autobatch: profile forward and backward (no optimizer step) at
    1, 2, 4, 8 and 16, fit peak memory against batch size with a line, take the batch whose
    predicted peak is 60% of the capacity; if a profiled size failed, stay below it; outside
    [1, 1024] fall back to 16. Written from the description; no Ultralytics code."""
    work, device = prepared(case)
    tally, points = Tally(), []
    start = time.perf_counter()
    for size in ULTRALYTICS_SIZES:
        drain_autograd_queue()
        tally.sizes.append(size)
        device.reset_peak()
        try:
            with device.measuring():
                compute_loss(work.model, resize_batch(work.sample_batch, size), loss_fn=work.loss_fn).backward()
            points.append((size, device.peak_bytes()))
            tally.fitted.append(size)
            tally.steps += 1  # a forward and backward pass, not a full step
        except torch.OutOfMemoryError:
            tally.ooms += 1
            gc.collect()
        work.model.zero_grad(set_to_none=True)
    failed = [size for size in ULTRALYTICS_SIZES if size not in tally.fitted]
    found = ultralytics_pick(points, bf.parse_bytes(case.capacity), failed)
    return Run(found, tally, time.perf_counter() - start, {"steps_are": "forward+backward passes"})


def ultralytics_pick(points: list[tuple[int, int]], capacity_bytes: int, failed: list[int]) -> int:
    """The batch for ``ULTRALYTICS_FRACTION`` of ``capacity_bytes`` on a least-squares line."""
    if len(points) < 2:
        return points[0][0] if points else ULTRALYTICS_DEFAULT
    sizes, peaks = zip(*points, strict=True)
    slope, intercept = np.polyfit(sizes, peaks, 1)
    pick = int((ULTRALYTICS_FRACTION * capacity_bytes - intercept) / slope)
    if failed and pick >= min(failed):
        pick = max(s for s, _ in points if s < min(failed))
    return pick if 1 <= pick <= ULTRALYTICS_SAFE_MAX else ULTRALYTICS_DEFAULT


# -- Lightning --------------------------------------------------------------------------------


def lightning_method(mode: str, **options: object) -> Callable[[Case], Run]:
    """``Tuner(trainer).scale_batch_size(module, mode=mode, **options)`` on ``Trainer(accelerator="cpu")``."""

    def run(case: Case) -> Run:
        from lightning.pytorch.tuner import Tuner
        from lightning.pytorch.tuner import batch_size_scaling
        from lightning_peer import counting_trials
        from lightning_peer import make_module
        from lightning_peer import make_trainer

        work, device = prepared(case)
        module, tally = make_module(work), Tally()
        with (
            tempfile.TemporaryDirectory() as root,
            counting_trials(batch_size_scaling, tally, around_each=drain_autograd_queue),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
            trainer = make_trainer(root)
            found, extra, start = None, {}, time.perf_counter()
            try:
                with device.measuring():
                    found = Tuner(trainer).scale_batch_size(module, mode=mode, **options)
            except Exception as error:  # e.g. an OOM raised by Lightning's own code after a trial's OOM
                extra["error"] = f"crashed: {type(error).__name__} in {_where(error)}"
            seconds = time.perf_counter() - start
        tally.steps = module.completed_steps
        return Run(found, tally, seconds, extra)

    return run


def _where(error: BaseException) -> str:
    """The Lightning functions the first error raised outside a trial passed through, innermost last."""
    first = error
    while isinstance(first.__context__, torch.OutOfMemoryError) and not _in_trial(first.__context__):
        first = first.__context__
    frames = [
        frame.f_code.co_name
        for frame, _ in traceback.walk_tb(first.__traceback__)
        if "lightning" in frame.f_code.co_filename
    ]
    return "Lightning's " + " > ".join(frames[-4:])


def _in_trial(error: BaseException) -> bool:
    """Whether ``error`` came out of a trial (``lightning_peer.counting_trials`` wraps each one)."""
    return any(frame.f_code.co_name == "counted" for frame, _ in traceback.walk_tb(error.__traceback__))
