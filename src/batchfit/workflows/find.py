"""The search of a model and a sample batch, as a library user calls it: ``find_max_batch_size`` (what
``batchfit find`` does) and ``probe_batch_size`` (one trial). Each builds the ``Workload`` of its arguments,
as one rank of a world under FSDP2 where ``parallelism`` is given (``ShardedCopy``), and hands it to the
search (``search_workload``, ``probe_workload``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.search.cached import CacheSpec
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import device_for
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import check_soak_device
from batchfit.search.soak import soaked_result
from batchfit.search.strategies import Strategy
from batchfit.search.trial import Trial
from batchfit.step.batching import pad_sequences
from batchfit.step.workload import Workload

if TYPE_CHECKING:
    from batchfit.parallel.copied import ShardedCopy
    from batchfit.parallel.settings import Parallelism


def find_max_batch_size(
    model: torch.nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    strategy: str | Strategy = "auto",
    margin: int | float | str = 0,
    max_trials: int | None = None,
    max_seconds: float | None = None,
    steps: int = 2,
    mode: str = "train",
    step_fn: Callable | None = None,
    keep_output: bool = True,
    on_trial: Callable[[Trial], None] | None = None,
    trace: bool | str = "auto",
    longest_seq_len: int | None = None,
    cache: CacheSpec = False,
    parallelism: Parallelism | None = None,
    confirm_steps: int | None = None,
    settings: SearchSettings | None = None,
    soak_steps: int | None = None,
    eval_every_steps: int | None = None,
) -> SearchResult:
    """The largest batch size that really fits: every answer is a size a trial ran.

    Each trial runs ``steps`` (at least 2) full training steps (forward, loss, backward,
    optimizer step, AMP if ``amp_dtype``) on a batch built from ``sample_batch``; an
    out-of-memory error marks the size as failing and everything is restored. ``device=None``
    probes where the model is; ``"sim:8GiB"`` or ``SimulatedDevice("8GiB")`` simulates a GPU on the
    CPU. ``margin`` keeps headroom (bytes, ``"512MiB"`` or a fraction such as ``0.05``). Under an
    initialised ``torch.distributed`` process group every rank runs the same trials and all ranks
    return the same size: the largest that fits on every one of them.
    ``strategy``: ``auto`` (default), ``binary``, ``power``, ``grow``, ``halving``. With
    ``auto``, ``trace="auto"`` (default) spends the cheaper evidence first: where a real trial is
    expensive (a GPU, a simulated device with ``step_seconds``) the edge is first estimated on a
    ``TraceDevice`` (fake tensors, nothing allocated) and real trials only verify it; elsewhere the
    first real trial's time decides. ``trace=True`` always traces first, ``False`` never does. ``longest_seq_len`` pads every
    sequence of the sample to the longest length the run will see (masks fully attended), so the
    answer holds for the worst batch, not the sample's. ``keep_output=True`` (default) keeps the
    model's output alive until after backward, as ``outputs = model(x); loss = loss_fn(outputs, y);
    loss.backward()`` does; ``False`` models a loop whose loss call drops it (Lightning's
    ``training_step``, the Hugging Face Trainer). ``cache=True`` (or a folder) returns a
    stored answer, with zero trials, when this very search ran before (see ``ResultCache``).
    ``max_trials`` and ``max_seconds`` bound the search: no trial starts past them (nor one
    predicted to end past ``max_seconds``), and the answer is the largest size confirmed so far,
    with ``exact=False``. ``parallelism`` (a ``batchfit.parallel.Parallelism``, outside
    ``torchrun``) runs real trials of one rank of that world size under FSDP2, over torch's fake
    process group: the model is copied onto ``meta``, sharded, and only the rank's shards are
    allocated (with the rank's rows of the model's values); the optimizer is built again over
    them. The answer is the micro-batch per rank; ``result.extra["mode"]`` says what ran. The
    model and optimizer passed are not changed. Where a caching allocator decides what fits (a GPU, or
    ``"sim:8GiB:cuda"``), the answer is confirmed by ``confirm_steps`` (default 4) steps in a row from an
    emptied cache, as training starts, going lower if it fails; ``result.extra["allocator"]`` says what the
    allocator reserved beyond the live bytes and, where predicted, the answer with expandable segments.
    ``settings`` (a ``SearchSettings``) gives the search settings in one object, as every entry point takes
    them; the keywords ``min_batch_size`` to ``confirm_steps`` are its aliases (one form or the other).
    ``soak_steps`` (on a device that models the caching allocator) answers for a run of that many steps, with an
    evaluation pass every ``eval_every_steps``, replayed through the allocator model from the cache each step leaves
    (``batchfit.search.soak``): ``batch_size`` is the largest that holds for every step, and
    ``extra["soak"]`` keeps the fresh-cache answer, the runs and what expandable segments would give.

    >>> import batchfit as bf
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> batch = (torch.randn(4, 64), torch.randint(0, 10, (4,)))
    >>> result = bf.find_max_batch_size(model, batch, loss_fn=torch.nn.functional.cross_entropy,
    ...     optimizer=torch.optim.Adam(model.parameters()), device=bf.SimulatedDevice("2MiB"))
    >>> result.batch_size > 0 and result.trials[-1].batch_size in (result.batch_size, result.batch_size + 1)
    True
    """
    settings = SearchSettings.merged(
        settings,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        strategy=strategy,
        margin=margin,
        max_trials=max_trials,
        max_seconds=max_seconds,
        steps=steps,
        trace=trace,
        cache=cache,
        confirm_steps=confirm_steps,
    )
    if longest_seq_len is not None:
        sample_batch = pad_sequences(sample_batch, longest_seq_len)
    workload = _users_workload(
        model,
        sample_batch,
        parallelism,
        loss_fn=loss_fn,
        optimizer=optimizer,
        amp_dtype=amp_dtype,
        mode=mode,
        step_fn=step_fn,
        keep_output=keep_output,
    )
    soak = SoakSettings(soak_steps, eval_every_steps) if soak_steps is not None else None
    if soak is None and eval_every_steps is not None:
        raise InputError("eval_every_steps says when a soak evaluates: give soak_steps too (1000 is a long run)")
    if soak is None:
        return search_workload(workload, settings, device=device, on_trial=on_trial)
    dev = device_for(workload, device)
    check_soak_device(dev)  # before any trial
    result = search_workload(workload, settings, device=dev, on_trial=on_trial)
    return soaked_result(result, workload, soak, device=dev, margin=settings.margin)


def _users_workload(
    model: torch.nn.Module, sample_batch: Any, parallelism: Parallelism | None, **options: Any
) -> Workload | ShardedCopy:
    """The ``Workload`` of the public functions' arguments; with ``parallelism``, as one rank of it (its
    ``ShardedCopy``)."""
    workload = Workload(model, sample_batch, **options)
    if parallelism is None:
        return workload
    # Imported here so that `import batchfit` does not load the FSDP2 layer; a caller with a Parallelism has.
    from batchfit.parallel.copied import ShardedCopy
    from batchfit.parallel.settings import Parallelism

    if not isinstance(parallelism, Parallelism):
        raise InputTypeError(f"parallelism must be a batchfit.parallel.Parallelism, got {type(parallelism).__name__}")
    return ShardedCopy(workload, parallelism)


def probe_batch_size(
    model: torch.nn.Module,
    sample_batch: Any,
    batch_size: int,
    *,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    margin: int | float | str = 0,
    steps: int = 2,
    mode: str = "train",
    step_fn: Callable | None = None,
    keep_output: bool = True,
    parallelism: Parallelism | None = None,
) -> Trial:
    """Run one trial at ``batch_size`` and return it; state is restored afterwards. With
    ``parallelism``, one rank's trial at that world size (see ``find_max_batch_size``).

    >>> model = torch.nn.Linear(8, 1)
    >>> trial = probe_batch_size(model, torch.randn(2, 8), 16, loss_fn=lambda out, batch: out.mean(),
    ...                          device="sim:1MiB")
    >>> trial.fits, trial.steps
    (True, 2)
    """
    settings = SearchSettings(margin=margin, steps=steps)
    workload = _users_workload(
        model,
        sample_batch,
        parallelism,
        loss_fn=loss_fn,
        optimizer=optimizer,
        amp_dtype=amp_dtype,
        mode=mode,
        step_fn=step_fn,
        keep_output=keep_output,
    )
    return probe_workload(workload, batch_size, settings, device=device)
