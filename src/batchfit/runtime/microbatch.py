"""Keep training alive: split each global batch into micro-batches that fit, and on an OOM
shrink and replay the whole global batch, so no sample is lost or counted twice and the
optimizer steps exactly once (the idea of Composer's automatic micro-batching, growing back too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.devices.cleanup import drain_autograd_queue
from batchfit.devices.interrupts import interrupts_deferred
from batchfit.devices.interrupts import interrupts_held
from batchfit.devices.interrupts import raise_if_interrupted
from batchfit.devices.oom import is_oom
from batchfit.devices.resolve import resolve_device
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.planning.noise import NoiseScaleEstimator
from batchfit.runtime.accumulate import backward_micro_batches
from batchfit.runtime.micro_batches import default_tokens_per_sample
from batchfit.runtime.micro_batches import micro_batch
from batchfit.runtime.micro_batches import row_slices
from batchfit.runtime.micro_batches import token_slices
from batchfit.runtime.micro_batches import widths_of
from batchfit.runtime.noise_measure import GradientWatcher
from batchfit.runtime.undo import OptimizerSnapshot
from batchfit.runtime.undo import ReplayStart
from batchfit.search import distributed
from batchfit.search.cached import CacheSpec
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.settings import margin_bytes
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import soaked_result
from batchfit.search.strategies import Strategy
from batchfit.step.batching import batch_length
from batchfit.step.batching import tensor_leaves
from batchfit.step.compiled import runnable
from batchfit.step.state import reset_sharded_iteration
from batchfit.step.workload import Workload
from batchfit.step.workload import amp_dtype_of

logger = logging.getLogger("batchfit")


@dataclass(frozen=True)
class StepRecord:
    """One global step: the micro-batch size that completed it, and what it took to get there.

    ``ooms`` counts the attempts an out-of-memory error cut short (on this rank or, under a process
    group, on any rank); ``replays`` counts the micro-batches those attempts had already run
    through forward and backward, whose gradients were then dropped and which ran again: the work
    lost to out-of-memory errors. ``max_tokens`` is the token budget of the micro-batches that
    completed the step (``None`` when they are counted in samples).

    >>> record = StepRecord(step=3, micro_batch_size=16, micro_batches=4, ooms=1, replays=2, samples=64)
    >>> record.summary()
    'Step 3: 64 samples in 4 micro-batches of at most 16; 1 out-of-memory error, 2 micro-batches run again.'
    >>> record.to_dict()["replays"]
    2
    """

    step: int
    micro_batch_size: int
    micro_batches: int
    ooms: int
    replays: int
    samples: int
    max_tokens: int | None = None

    def summary(self) -> str:
        """One sentence: what the step ran, and what out-of-memory errors cost it."""
        budget = f" ({self.max_tokens} tokens each at most)" if self.max_tokens is not None else ""
        ran = f"Step {self.step}: {self.samples} samples in {self.micro_batches} micro-batches of at most "
        ran += f"{self.micro_batch_size}{budget}"
        if not self.ooms:
            return f"{ran}; no out-of-memory error."
        errors = f"{self.ooms} out-of-memory error{'s' if self.ooms > 1 else ''}"
        return f"{ran}; {errors}, {self.replays} micro-batch{'es' if self.replays != 1 else ''} run again."

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MicrobatcherSettings:
    """What the caller gave a ``Microbatcher``: checked once, never changed by training (the live,
    shrinking values are ``Microbatcher.current_micro_batch_size`` and ``current_max_tokens``).

    >>> MicrobatcherSettings(micro_batch_size=0)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: micro_batch_size must be a positive integer or None, got 0
    """

    micro_batch_size: int | None = None
    """The first micro-batch size (``None``: found by a search on the first global batch)."""
    max_tokens: int | None = None
    """The first token budget per micro-batch (``None``: micro-batches are counted in samples)."""
    grow_after: int | None = 100
    """Clean steps before trying twice the micro-batch again (``None``: never grow)."""
    guard_optimizer_step: bool = False
    """Keep a host copy of what each optimizer step changes (the parameters it updates and their optimizer
    state; their gradients too under a GradScaler), so that an error inside it is undone bitwise."""
    weight: str = "samples"
    """How each micro-batch's loss is weighted: ``"samples"`` or ``"tokens"``, as the loss is averaged."""
    amp_dtype: torch.dtype | None = None
    """Forward and loss under ``torch.autocast`` to this dtype, in training and in the search."""
    search: SearchSettings = dataclasses.field(default_factory=SearchSettings)
    """How the first micro-batch size is searched; its ``min_batch_size`` is also the floor when shrinking."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InputError(f"{name} must be a positive integer or None, got {value!r}")
        if self.grow_after is not None and self.grow_after < 1:
            raise InputError(f"grow_after must be at least 1 or None, got {self.grow_after!r}")
        if self.weight not in ("samples", "tokens"):
            raise InputError(
                "weight must be 'samples' (a loss averaged per sample) or 'tokens' (a loss averaged per token), "
                f"got {self.weight!r}"
            )
        object.__setattr__(self, "amp_dtype", amp_dtype_of(self.amp_dtype))
        floor = self.search.min_batch_size
        if self.micro_batch_size is not None and self.micro_batch_size < floor:
            raise InputError(
                f"micro_batch_size ({self.micro_batch_size}) is below min_batch_size ({floor}): raise it or lower the floor"
            )


def warn_renamed(owner: str, old: str, new: str) -> None:
    """The ``DeprecationWarning`` for reading a setting's old name, which now holds the live value."""
    warnings.warn(
        f"{owner}.{old} is deprecated and will be removed in the next release: read .{new} for the live "
        f"value, or .settings.{old} for the one you gave",
        DeprecationWarning,
        stacklevel=3,
    )


def device_accounting(device: Any) -> contextlib.AbstractContextManager:
    """Only a simulated device needs its accounting active to raise OOM; real allocators raise their own."""
    return device.measuring() if device.simulated else contextlib.nullcontext()


class Microbatcher:
    """One optimizer step per global batch, in micro-batches that fit, surviving OOM.

    On an out-of-memory error anywhere in the step, gradients are dropped, the cache emptied, a
    partial GradScaler step undone, the module buffers put back as the step found them (BatchNorm's
    running statistics: a host copy of every buffer is taken before each step), and the micro-batch
    halved; then the *whole* global batch is replayed. An OOM inside ``optimizer.step()`` cannot be
    fixed by smaller micro-batches and may have updated some parameters: with
    ``guard_optimizer_step=True`` (a host copy of the parameters it updates and their optimizer state
    before every step, which costs a device-to-host copy per step) it is undone and the step runs
    again per parameter (``foreach=False``); if that fails too, it is undone again and the error
    propagates with nothing half-applied. Without the guard, a clear error says so.
    After ``grow_after`` clean steps it tries twice the size again, never above one that failed.
    With ``max_tokens``, micro-batches are contiguous runs of samples that hold at most that many
    tokens as the device holds them: rows times the widest row, each row up to its last attended
    position (``attention_mask``; the whole sequence without one; ``tokens_per_sample`` where given),
    the padding after it cut off. So a budget measured by ``batchfit tokens`` is never exceeded, and a
    sample longer than the budget is an error before any step runs. It is the token budget that
    halves on OOM. ``weight`` must match how the loss is reduced:
    ``"samples"`` for a mean over samples, ``"tokens"`` for a mean over tokens (Hugging Face
    causal-LM losses); only then is the accumulated gradient the full batch's. ``noise`` (a
    ``NoiseScaleEstimator``) measures the gradient noise scale on the way: micro-batches are the
    small batch, the global step the big one (read it with ``noise.result()``). ``amp_dtype``
    runs every forward pass and loss under ``torch.autocast`` (pass a ``scaler`` for float16).

    With ``micro_batch_size=None`` the first global batch is searched for the largest micro-batch
    that fits, with the keywords of ``find_max_batch_size``: ``min_batch_size``, ``strategy``,
    ``margin``, ``max_trials``, ``steps``, ``trace``, ``cache``, or all in one ``settings`` (a
    ``SearchSettings``; one form or the other; the search never goes above the global batch). With
    ``soak_steps`` (a device that models the caching allocator), the first size is the one that holds for a run of
    that many steps through the allocator model, not one step from an emptied cache (``batchfit.search.soak``). ``min_batch_size`` is also the floor when shrinking: a micro-batch of that size
    (or a token budget of the longest sample) that runs out of memory raises ``NoBatchFitsError``.

    What you gave stays in ``settings`` (a frozen ``MicrobatcherSettings``); what training changes
    is live state: ``current_micro_batch_size`` (``None`` until the first search),
    ``current_max_tokens``, ``smallest_failure`` and ``history`` (a ``StepRecord`` per step).

    >>> model = torch.nn.Linear(4, 1)
    >>> batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                        loss_fn=torch.nn.functional.mse_loss, micro_batch_size=8)
    >>> loss = batcher.step((torch.randn(20, 4), torch.randn(20, 1)))
    >>> batcher.history[-1].micro_batches, batcher.current_micro_batch_size, batcher.settings.micro_batch_size
    (3, 8, 8)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable | None = None,
        step_fn: Callable | None = None,
        amp_dtype: torch.dtype | str | None = None,
        device: Any = None,
        micro_batch_size: int | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        grow_after: int | None = 100,
        guard_optimizer_step: bool = False,
        sample_weight: Callable[[Any], int] | None = None,
        max_tokens: int | None = None,
        tokens_per_sample: Callable[[Any], torch.Tensor] | None = None,
        weight: str = "samples",
        noise: NoiseScaleEstimator | None = None,
        min_batch_size: int = 1,
        strategy: str | Strategy = "auto",
        margin: int | float | str = 0,
        max_trials: int | None = None,
        steps: int = 2,
        trace: bool | str = "auto",
        cache: CacheSpec = False,
        settings: SearchSettings | None = None,
        soak_steps: int | None = None,
    ):
        self.soak = SoakSettings(soak_steps) if soak_steps is not None else None
        search = SearchSettings.merged(
            settings,
            min_batch_size=min_batch_size,
            strategy=strategy,
            margin=margin,
            max_trials=max_trials,
            steps=steps,
            trace=trace,
            cache=cache,
        )
        self.settings = MicrobatcherSettings(
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
            grow_after=grow_after,
            guard_optimizer_step=guard_optimizer_step,
            weight=weight,
            amp_dtype=amp_dtype,
            search=search,
        )
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.device = resolve_device(device, model)
        self.scheduler, self.scaler = scheduler, scaler
        self.tokens_per_sample = tokens_per_sample or default_tokens_per_sample
        self._own_tokens = tokens_per_sample is not None
        token_weight = lambda piece: int(self.tokens_per_sample(piece).sum())  # noqa: E731
        self.sample_weight = sample_weight or (token_weight if weight == "tokens" else batch_length)
        self.noise = noise  # the gradient noise scale, measured passively from the micro-batches
        # Live state: training shrinks and grows these; the settings above never change.
        self.current_micro_batch_size: int | None = micro_batch_size
        self.current_max_tokens: int | None = max_tokens
        self.smallest_failure: int | None = None
        self.history: list[StepRecord] = []
        self._watcher: GradientWatcher | None = None
        self._clean_steps = 0

    @property
    def micro_batch_size(self) -> int | None:
        """Deprecated: ``current_micro_batch_size`` (the live size; ``settings.micro_batch_size`` is yours)."""
        warn_renamed("Microbatcher", "micro_batch_size", "current_micro_batch_size")
        return self.current_micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, size: int | None) -> None:
        warn_renamed("Microbatcher", "micro_batch_size", "current_micro_batch_size")
        self.current_micro_batch_size = size

    @property
    def max_tokens(self) -> int | None:
        """Deprecated: ``current_max_tokens`` (the live budget; ``settings.max_tokens`` is yours)."""
        warn_renamed("Microbatcher", "max_tokens", "current_max_tokens")
        return self.current_max_tokens

    @max_tokens.setter
    def max_tokens(self, tokens: int | None) -> None:
        warn_renamed("Microbatcher", "max_tokens", "current_max_tokens")
        self.current_max_tokens = tokens

    @property
    def _by_tokens(self) -> bool:
        return self.settings.max_tokens is not None

    # -- the step --------------------------------------------------------------------------------

    def step(self, batch: Any) -> float:
        """Train on ``batch`` (the whole global batch): one optimizer step. Returns the mean loss.

        Under a process group, ranks agree after the micro-batches whether any ran out of memory
        and then all shrink and replay together; DDP gradients are averaged once, explicitly, so no
        rank ever waits in a gradient all-reduce that an out-of-memory rank will never join.

        On a simulated device (whose accounting a Ctrl-C must not cut half-way) a Ctrl-C is deferred
        (``batchfit.devices.interrupts``): one during the micro-batches stops the step at the next op, and it
        is dropped whole (gradients dropped, buffers and random state as the step found them, nothing
        recorded); one during the optimizer step is raised when the step is done. Either way
        ``KeyboardInterrupt`` reaches the caller, and the next step runs as if the interrupted one never had.
        """
        with interrupts_deferred() if self.device.simulated else contextlib.nullcontext():
            return self._step(batch)

    def _step(self, batch: Any) -> float:
        total = batch_length(batch)
        size = self.current_max_tokens if self._by_tokens else min(self._current_size(batch), total)
        agreeing = distributed.active()
        self._check_token_budget(batch, size, agreeing)
        ooms = replays = 0
        start = ReplayStart.take(self.model)  # in host memory, outside the device's accounting
        try:
            while True:
                slices = self._slices(batch, size)
                loss, completed = self._accumulate_agreeing(batch, slices, size, agreeing)
                failed = loss is None
                if agreeing and self._agree_on_outcome(failed) and not failed:
                    failed = True
                    self._clean_up("another rank ran out of memory")
                if not failed:
                    break
                start.restore()  # the replay starts from the buffers and random state the failed attempt did
                ooms += 1
                replays += completed  # micro-batches whose forward and backward are thrown away and run again
                size = self._shrink(size, self._floor(batch, agreeing))
            raise_if_interrupted()  # the last point where the step can be dropped whole: nothing applied yet
            with interrupts_held():  # a Ctrl-C from here on is raised once the optimizer has stepped
                if self._watcher is not None:
                    self._watcher.finish(self.noise)  # each rank's own micro-batches, before averaging
                if agreeing and hasattr(self.model, "no_sync"):
                    distributed.average_gradients(self.model)
                self._optimizer_step()
        except KeyboardInterrupt:
            self._drop_step(start)
            raise
        if ooms and self._by_tokens:
            self.current_max_tokens = size
        elif ooms:
            self.current_micro_batch_size = size  # only a failure shrinks it: a short batch does not
        self._record(slices, ooms, replays, total, size)
        self._maybe_grow(ooms)
        return loss

    def _drop_step(self, start: ReplayStart) -> None:
        """A Ctrl-C stopped the step before its optimizer step (or, a second Ctrl-C, inside it: then undone only
        with ``guard_optimizer_step``): its gradients dropped, buffers and random state as it found them."""
        drain_autograd_queue()
        reset_sharded_iteration(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self._undo_scaler()
        self._watcher = None
        start.restore()

    def _accumulate_agreeing(
        self, batch: Any, slices: list[tuple[int, int]], size: int, agreeing: bool
    ) -> tuple[float | None, int]:
        """``_accumulate``; under a process group, an error other than an OOM is told to the other
        ranks (in this step's agreement) before it propagates, so none is left waiting."""
        try:
            with device_accounting(self.device):
                return self._accumulate(batch, slices, size, local_only=agreeing)
        except Exception as error:
            if agreeing:
                distributed.report_raised_step(error)
            raise

    @staticmethod
    def _agree_on_outcome(failed: bool) -> bool:
        """Whether any rank ran out of memory in this step; a ``RuntimeError`` when one raised."""
        worst = distributed.worst_step_outcome(distributed.STEP_OOM if failed else distributed.STEP_FITS)
        if worst == distributed.STEP_RAISED:
            raise distributed.RankStoppedError(
                "batchfit: another rank's training step raised (its own error says what), so this rank stops "
                "too: the ranks cannot stay in step"
            )
        return worst == distributed.STEP_OOM

    def _record(self, slices: list[tuple[int, int]], ooms: int, replays: int, samples: int, size: int) -> None:
        largest = max(stop - start for start, stop in slices)
        budget = size if self._by_tokens else None
        self.history.append(StepRecord(len(self.history), largest, len(slices), ooms, replays, samples, budget))

    def _current_size(self, batch: Any) -> int:
        if self.current_micro_batch_size is None:
            self.current_micro_batch_size = self._search(batch)
        return self.current_micro_batch_size

    def _search(self, batch: Any) -> int:
        """The largest micro-batch of ``batch`` that fits, by the library's search (at most the whole batch),
        as a later micro-batch of the window runs: the window's gradients alive, and the whole batch on the
        device beside it (the search's sample is host data, so its bytes are kept as headroom here)."""
        search = self.settings.search
        settings = search.replace(
            max_batch_size=max(batch_length(batch), search.min_batch_size),
            margin=self._margin_with(batch, search.margin),
        )
        workload = Workload(
            self.model,
            batch,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            amp_dtype=self.settings.amp_dtype,
            step_fn=self.step_fn,
            keep_output=False,  # this loop's loss call drops the output before backward
            accumulating=True,  # a later micro-batch runs with the window's gradients alive
        )
        result = search_workload(workload, settings, device=self.device)
        if self.soak is not None:  # the size that holds for a run of the soak's steps, not one from an emptied cache
            device = resolve_device(self.device, self.model)
            result = soaked_result(result, workload, self.soak, device=device, margin=settings.margin)
        return result.batch_size

    def _margin_with(self, batch: Any, margin: int | float | str) -> int | float | str:
        """``margin`` in bytes plus those of ``batch``'s storages on the device the search measures (a
        batch on the host, moved there a micro-batch at a time, takes none of its memory). A little
        conservative: the micro-batches are views of that batch, where a trial's batch is its own."""
        device = resolve_device(self.device, self.model)
        held = sum(
            leaf.untyped_storage().nbytes() for leaf in tensor_leaves(batch) if leaf.device == device.torch_device
        )
        return margin_bytes(margin, device.capacity_bytes()) + held if held else margin

    def _accumulate(
        self, batch: Any, slices: list[tuple[int, int]], size: int, local_only: bool = False
    ) -> tuple[float | None, int]:
        """Backward over the micro-batches ``slices``: the mean loss, or ``None`` after an OOM (cleaned
        up), and how many micro-batches completed. DDP synchronises on the last micro-batch only, or
        never with ``local_only``."""
        widths = self._widths(batch) if self._by_tokens and not self._own_tokens else None
        pieces = [micro_batch(batch, start, stop, widths) for start, stop in slices]
        self._watcher = GradientWatcher(self.model, self.scaler) if self.noise is not None else None
        completed = 0

        def after_each(weight: int, share: float) -> None:
            nonlocal completed
            completed += 1
            if self._watcher is not None:
                self._watcher.after(weight, share)

        try:
            loss = backward_micro_batches(
                runnable(self.model, self.device),
                pieces,
                [self.sample_weight(piece) for piece in pieces],
                loss_fn=self.loss_fn,
                step_fn=self.step_fn,
                scaler=self.scaler,
                sync_last=not local_only,
                after_each=after_each,
                amp_dtype=self.settings.amp_dtype,
                device_type=self.device.torch_device.type,
            )
            return loss, completed
        except BaseException as error:
            if not is_oom(error):
                raise
            why = f"{type(error).__name__} in forward/backward at micro-batch {size}"
        self._clean_up(why)  # after the except block, so the failed micro-batch's tensors are free
        return None, completed

    def _widths(self, batch: Any) -> list[int]:
        """Each row's positions in a micro-batch: ``tokens_per_sample`` where given, else up to its last attended
        position (``sequence_widths``); a micro-batch holds its rows at the widest of them."""
        if self._own_tokens:
            return [int(count) for count in self.tokens_per_sample(batch)]
        return [int(width) for width in widths_of(batch)]

    def _check_token_budget(self, batch: Any, size: int, agreeing: bool) -> None:
        """A sample longer than the budget cannot be split: every rank learns it before any raises."""
        if not self._by_tokens:
            return
        longest = max(self._widths(batch))
        too_long = longest > size
        if agreeing:
            too_long = distributed.any_rank(too_long)
        if too_long:
            raise RuntimeError(
                f"a single sample holds more tokens ({longest} here) than the budget of {size}: raise max_tokens or free memory"
            )

    def _slices(self, batch: Any, size: int) -> list[tuple[int, int]]:
        """Row ranges of the micro-batches: ``size`` rows each, or at most ``size`` tokens each."""
        if not self._by_tokens:
            return row_slices(batch_length(batch), size)
        return token_slices(self._widths(batch), size)

    def _optimizer_step(self) -> None:
        """``optimizer.step()``; with ``guard_optimizer_step``, undone on any error that leaves it, and
        after an OOM run again per parameter."""
        snapshot = self._guard()  # in host memory, outside the device's accounting
        failed = False
        try:
            with device_accounting(self.device):
                self._step_once()
        except BaseException as error:
            if snapshot is not None:
                self._undo_step(snapshot)  # nothing half-applied, whatever the error
            if not is_oom(error):
                raise
            if snapshot is None:
                raise RuntimeError(
                    "the optimizer step ran out of memory and may have updated some parameters already: "
                    "use Microbatcher(..., guard_optimizer_step=True) to undo and retry it exactly, or free memory"
                ) from error
            failed = True  # retry after the except block: its traceback holds the partial step's tensors
        if failed:
            self.device.collect()
            self._retry_per_parameter(snapshot)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _step_once(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _guard(self) -> OptimizerSnapshot | None:
        if not self.settings.guard_optimizer_step:
            return None
        return OptimizerSnapshot.take(self.optimizer, grads=self.scaler is not None)

    def _undo_step(self, snapshot: OptimizerSnapshot) -> None:
        """Parameters, optimizer state and gradients as before the step; a GradScaler's step forgotten."""
        snapshot.restore()
        self._undo_scaler()

    def _retry_per_parameter(self, snapshot: OptimizerSnapshot) -> None:
        """The optimizer step itself ran out of memory: a smaller micro-batch cannot help, but
        per-parameter updates (``foreach=False``) need far smaller temporaries. An error in this
        retry leaves with the step undone again: nothing is half-applied."""
        groups = self.optimizer.param_groups
        saved = [group.get("foreach") for group in groups]
        for group in groups:
            group["foreach"] = False
        try:
            with device_accounting(self.device):
                self._step_once()
        except BaseException as error:
            self._undo_step(snapshot)  # outside the accounting; each group's foreach is put back too
            logger.warning(
                "batchfit: the optimizer step ran out of memory, and its per-parameter retry raised %s: the step "
                "is undone (parameters, optimizer state and gradients as before it)",
                type(error).__name__,
            )
            raise
        finally:
            for group, foreach in zip(groups, saved, strict=True):
                group["foreach"] = foreach
        logger.warning("batchfit: the optimizer step ran out of memory; it ran again per parameter (foreach=False)")

    # -- recovery --------------------------------------------------------------------------------

    def _clean_up(self, why: str) -> None:
        drain_autograd_queue()  # a backward cut short by the OOM keeps its activations queued (CPU devices)
        # FSDP2 left mid-iteration (its parameters gathered, its post-backward callback marked queued) never
        # reduce-scatters again: the optimizer would step shards without gradients, so bring it back to rest.
        reset_sharded_iteration(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self._undo_scaler()
        self.device.collect()
        logger.warning("batchfit: %s; replaying the global batch with smaller micro-batches", why)

    def _undo_scaler(self) -> None:
        if self.scaler is not None:
            # GradScaler keeps "unscaled / stepped" flags per optimizer until update(); a step cut
            # short by an OOM must start over from a clean slate (torch's own reset is update()).
            self.scaler._per_optimizer_states.clear()

    def _floor(self, batch: Any, agreeing: bool) -> int:
        """The smallest micro-batch worth trying: ``min_batch_size`` samples, or a token budget that
        holds the longest sample (the longest on any rank, so that all ranks stop together)."""
        if not self._by_tokens:
            return self.settings.search.min_batch_size
        longest = max(self._widths(batch))
        return -distributed.agree_min(-longest) if agreeing else longest

    def _shrink(self, size: int, floor: int) -> int:
        """Half of ``size``, not below ``floor``; ``NoBatchFitsError`` when ``size`` was the floor already."""
        self.smallest_failure = size if self.smallest_failure is None else min(self.smallest_failure, size)
        self._clean_steps = 0
        if size <= floor and self._by_tokens:
            raise NoBatchFitsError(
                f"even a budget of {size} tokens (the longest sample alone) runs out of memory on {self.device.name}: "
                "use amp_dtype, gradient checkpointing, shorter sequences or a smaller model, or free memory",
                [],
            )
        if size <= floor:
            raise NoBatchFitsError(
                f"even a micro-batch of {size} (the floor, min_batch_size={floor}) runs out of memory on "
                f"{self.device.name}: use amp_dtype, gradient checkpointing or a smaller model, or free memory",
                [],
            )
        return max(size // 2, floor)

    def _maybe_grow(self, ooms: int) -> None:
        if self._by_tokens:
            return  # the token budget only shrinks
        self._clean_steps = 0 if ooms else self._clean_steps + 1
        grow_after = self.settings.grow_after
        if grow_after is None or self._clean_steps < grow_after or self.smallest_failure is None:
            return
        grown = min(2 * self.current_micro_batch_size, self.smallest_failure)
        if grown > self.current_micro_batch_size:
            self.current_micro_batch_size = grown
            self._clean_steps = 0
