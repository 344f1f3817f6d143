"""Real trials of one rank at world size N, on the one device a user has.

torch's fake process group lets FSDP2 run one rank's training step with real tensors at any world
size: collectives return at once and move no data, everything else (the rank's shards, the
all-gathered parameters, the reduce-scatter buffers, activations, optimizer state) is allocated
as on a real rank. The model is built on ``meta``, sharded with ``fully_shard`` (``shard_model``),
and only this rank's shards are materialised on the device (``to_empty``, then the model's own
initialisation), so a model far larger than the device is tried as long as one rank's share fits.

A ``RankWorkload`` declares its own search backend, so ``search_workload`` runs the usual search
over it (strategies, ``max_trials``/``max_seconds``, progress) and each trial is the usual
``Prober`` trial of the sharded model: state restored after every trial, only real
out-of-memory errors counted. An out-of-memory error comes where it happens, inside FSDP2's forward
or backward as on a GPU (no peer waits in a collective of the fake group), and the restore brings
FSDP2 back to rest before the shards go back (``batchfit.step.state.reset_sharded_iteration``), so
the next trial runs as on a fresh prober. What it does not see: collectives do not run (NCCL's own buffers
are not counted), and torch's fake process group fills an all-gather with this rank's shard in
every slice and a reduce-scatter with a chunk of its input: values are finite but not the real
run's (a model that routes by values may allocate differently); sizes are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.devices.accounting import local_tensors
from batchfit.devices.base import Device
from batchfit.devices.resolve import resolve_device
from batchfit.devices.trace import TraceDevice
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.errors import ModelDoesNotFitError
from batchfit.errors import NoBatchFitsError
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.models import model_builder
from batchfit.parallel.settings import REAL_OFFLOAD_REFUSAL
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import OptimizerFactory
from batchfit.parallel.trace import RankSession
from batchfit.parallel.trace import default_optimizer
from batchfit.parallel.trace import is_transformers_model
from batchfit.parallel.trace import next_token_loss
from batchfit.parallel.trace import vocab_size_of
from batchfit.parallel.world import fake_world
from batchfit.parallel.wrap import shard_model
from batchfit.search.phase_lines import PhaseLines
from batchfit.search.prober import Prober
from batchfit.search.result import SearchResult
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.trial import Trial
from batchfit.step.workload import Workload

TOKEN_BYTES = 8  # token ids are int64
DDP_REFUSAL = (
    "one-rank trials run FSDP2 over a fake process group, and DDP's reducer needs real collectives: "
    "use sharding='fsdp', 'hybrid' or 'none', or probe real DDP under torchrun"
)


def check_real_trials(parallelism: object) -> None:
    """One line unless one rank's real trials can run ``parallelism``: a ``Parallelism``, not DDP
    (its reducer needs real collectives), not CPU offload (host and device are one here)."""
    if not isinstance(parallelism, Parallelism):
        raise InputTypeError(f"parallelism must be a batchfit Parallelism, got {type(parallelism).__name__}")
    if parallelism.sharding == "ddp":
        raise InputError(DDP_REFUSAL)
    if parallelism.cpu_offload:
        raise InputError(REAL_OFFLOAD_REFUSAL)


def one_rank_mode(parallelism: Parallelism, traced: bool = False) -> str:
    """What one rank's trials are, in one phrase (for the result, the JSON and the CLI): real, or
    ``traced`` on fake tensors (on a ``TraceDevice``)."""
    trials = "traced on fake tensors" if traced else "real trials"
    return f"one rank of {parallelism.world_size}, {trials}; collectives not run, NCCL buffers not counted"


@dataclass(frozen=True)
class RankWorkload:
    """One rank of ``parallelism`` training a language model built from ``model`` (a preset, a
    config.json path, a transformers config or dict, or a function returning an ``nn.Module``) on
    micro-batches of ``seq_len`` token ids, for real trials over torch's fake process group.

    >>> from batchfit.parallel.models import TinyTransformer
    >>> work = RankWorkload(TinyTransformer, 16, Parallelism(world_size=4))
    >>> work.name, work.mode()
    ('TinyTransformer', 'one rank of 4, real trials; collectives not run, NCCL buffers not counted')
    """

    model: ModelSpec
    seq_len: int
    parallelism: Parallelism
    dtype: torch.dtype = torch.float32
    optimizer: OptimizerFactory | None = None
    accumulating: bool = False
    """Run each step as a later micro-batch of an accumulation window: the gradients held throughout."""

    def __post_init__(self) -> None:
        check_real_trials(self.parallelism)
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise InputError(f"seq_len must be an integer of at least 1, got {self.seq_len!r}")

    @property
    def name(self) -> str:
        spec = self.model
        return spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)

    def mode(self, traced: bool = False) -> str:
        """What the trials are, in one phrase (for the result, the JSON and the CLI)."""
        return one_rank_mode(self.parallelism, traced)

    def parameter_count(self) -> int:
        """The whole model's parameters (all ranks'), counted on a ``meta`` build: nothing allocated."""
        with torch.device("meta"):
            model = model_builder(self.model, self.dtype)()
        return sum(p.numel() for p in model.parameters())

    def bytes_per_sample(self) -> int:
        return self.seq_len * TOKEN_BYTES

    def build(self, mesh: Any, device: torch.device) -> Workload:
        """The rank's training step: its shards on ``device``, a fresh optimizer over them."""
        model = local_shards(self, mesh, device)
        optimizer = (self.optimizer or default_optimizer)(model.parameters())
        return rank_step_workload(model, optimizer, self.seq_len, self.accumulating)

    def annotated(self, result: SearchResult, device: Device) -> SearchResult:
        """The search's result naming what its trials were (see ``annotated``)."""
        return annotated(self, result, device)

    def session(self, steps: int = 2) -> RankSession:
        """A ``RankSession`` tracing this rank on fake tensors at several micro-batch sizes."""
        return RankSession(
            self.model,
            self.seq_len,
            parallelism=self.parallelism,
            dtype=self.dtype,
            optimizer=self.optimizer,
            steps=steps,
        )

    def backend(self) -> RankBackend:
        return ONE_RANK


def _initialise(model: nn.Module) -> None:
    """Give the materialised shards (and buffers) values as the model's own code does: a
    transformers or torchtitan model's ``init_weights()``, else every module's ``reset_parameters()``."""
    with warnings.catch_warnings():  # DTensor warns that random ops on a CPU mesh may differ: values only
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        init_weights = getattr(model, "init_weights", None)
        if callable(init_weights):
            init_weights()
            return
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()


def local_shards(work: RankWorkload, mesh: Any, device: torch.device) -> nn.Module:
    """The model of ``work`` built on ``meta``, sharded over ``mesh``, and only this rank's shards
    (with the buffers) materialised on ``device`` and initialised."""
    with torch.device("meta"):
        model = model_builder(work.model, work.dtype)()
    shard_model(model, mesh, work.parallelism)
    model.to_empty(device=device)
    _initialise(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # training builds no generation cache (the trace passes use_cache=False)
    return model


def rank_step_workload(
    model: nn.Module, optimizer: torch.optim.Optimizer, seq_len: int, accumulating: bool = False
) -> Workload:
    """The training step of a language model as a ``Workload``: a transformers model gets
    ``{"input_ids", "labels"}`` and uses its own loss; a plain one gets the ids and cross-entropy
    of its logits (what ``trace_rank`` runs). The output stays alive through backward; with
    ``accumulating``, the gradients are held throughout (a later micro-batch of a window)."""
    ids = torch.randint(0, vocab_size_of(model), (1, seq_len))
    if is_transformers_model(model):
        sample, loss_fn = {"input_ids": ids, "labels": ids.clone()}, None
    else:
        sample, loss_fn = ids, next_token_loss
    return Workload(model, sample, loss_fn=loss_fn, optimizer=optimizer, accumulating=accumulating)


class RankProber:
    """The trials of a ``RankWorkload`` (or a ``ShardedCopy``): entering starts the fake world,
    builds the rank's step on the device (``work.build``) and a torch ``Prober`` over it; leaving
    restores and destroys it all."""

    def __init__(self, work: RankWorkload, device: Device, *, steps: int, limit_bytes: int | None):
        self.work, self.device, self.steps, self.limit_bytes = work, device, steps, limit_bytes
        self.compile_watch = None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> RankProber:
        if isinstance(self.device, TraceDevice):
            return self._enter_trace()
        with contextlib.ExitStack() as stack:
            torch_device = self.device.torch_device
            mesh = stack.enter_context(fake_world(self.work.parallelism, torch_device.type))
            step = self.work.build(mesh, torch_device)
            inner = Prober(step, self.device, steps=self.steps, limit_bytes=self.limit_bytes)
            try:
                self._prober = stack.enter_context(inner)
            except ModelDoesNotFitError as error:
                raise ModelDoesNotFitError(
                    f"one rank's share of {self.work.parallelism.world_size}: {error}, or shard over more ranks"
                ) from None
            self.baseline_bytes = self._prober.baseline_bytes
            self._stack = stack.pop_all()
        return self

    def _enter_trace(self) -> RankProber:
        """On a ``TraceDevice``: the rank's ``RankSession`` on fake tensors; each trial a trace."""
        with contextlib.ExitStack() as stack:
            self._session = stack.enter_context(self.work.session(self.steps))
            self._prober = None
            model = getattr(self._session, "model", None)  # None where a child process traces (CPU offload)
            parameters = model.parameters() if model is not None else ()
            self.baseline_bytes = sum(t.numel() * t.element_size() for p in parameters for t in local_tensors(p))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        stack, self._stack, self._prober, self._session = self._stack, None, None, None
        if stack is not None:
            stack.close()
        if not isinstance(self.device, TraceDevice):  # fake tensors hold no memory to free: no full collection
            self.device.collect()  # FSDP2's modules and hooks hold cycles: the rank's memory is free only after one

    def probe(self, batch_size: int, steps: int | None = None) -> Trial:
        if self._prober is None:
            return self._traced_trial(batch_size)
        return self._prober.probe(batch_size, steps)

    def _traced_trial(self, batch_size: int) -> Trial:
        """A fake trial: the session's trace at ``batch_size``, fitting when its peak is within the limit."""
        start = time.perf_counter()
        estimate = self._session.trace(batch_size)
        fits = self.limit_bytes is None or estimate.peak_bytes <= self.limit_bytes
        return Trial(
            batch_size,
            fits,
            estimate.peak_bytes,
            time.perf_counter() - start,
            phase_peak_bytes=dict(estimate.phase_peaks_bytes),
            steps=len(estimate.step_peaks_bytes),
            held_bytes=estimate.state_bytes.get("sharded_parameters", 0)
            + estimate.state_bytes.get("optimizer_state", 0)
            + estimate.breakdown.get("buffers", 0),
        )


class RankBackend:
    """The search backend of a ``RankWorkload`` or a ``ShardedCopy``: ``RankProber`` trials, real
    ones on a torch device and traced ones on a ``TraceDevice`` (such as ``TraceDevice("h100-80gb")``:
    the rank on fake tensors, nothing allocated); no trace before real trials."""

    name = "torch"

    def resolve_device(self, workload: RankWorkload, spec: Any) -> Device:
        return resolve_device("auto" if spec is None else spec, None)

    def bytes_per_sample(self, workload: RankWorkload) -> int:
        return workload.bytes_per_sample()

    def prepare(self, device: Device, workload: RankWorkload) -> RankWorkload:
        """Nothing before the prober: it builds the rank's model itself (real or fake)."""
        return workload

    def prober(self, workload: RankWorkload, device: Device, *, steps: int, limit_bytes: int | None) -> RankProber:
        return RankProber(workload, device, steps=steps, limit_bytes=limit_bytes)

    def auto_strategy(self, device: Device) -> Any:
        return PhaseLines() if isinstance(device, TraceDevice) else "auto"  # a trace knows every phase's peak

    def is_trace(self, device: Device) -> bool:
        return isinstance(device, TraceDevice)

    def can_trace(self, workload: RankWorkload) -> bool:
        return False

    def __repr__(self) -> str:
        return "RankBackend()"


ONE_RANK = RankBackend()


def find_rank_batch_size(
    model: ModelSpec,
    seq_len: int,
    *,
    parallelism: Parallelism,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    optimizer: OptimizerFactory | None = None,
    settings: SearchSettings | None = None,
    **options: Any,
) -> SearchResult:
    """The largest micro-batch of ``seq_len`` tokens per rank that really fits on ``device``, from
    real trials of one rank (``parallelism.rank``) of ``parallelism.world_size`` over torch's fake
    process group (see the module). ``settings``/``options`` are ``find_max_batch_size``'s search
    settings (``strategy``, ``margin``, ``max_trials``, ``max_seconds``, ``steps``, ...).
    ``result.extra["mode"]`` says what the trials were.

    >>> from batchfit.parallel.models import TinyTransformer
    >>> result = find_rank_batch_size(TinyTransformer, 16, parallelism=Parallelism(world_size=4),
    ...                               device="sim:4MiB")
    >>> result.batch_size > 0 and result.trials[-1].batch_size in (result.batch_size, result.batch_size + 1)
    True
    """
    work = RankWorkload(model, seq_len, parallelism, dtype, optimizer)
    return search_workload(work, settings, device=device, **options)


def annotated(work: Any, result: SearchResult, device: Device) -> SearchResult:
    """``result`` with ``extra["mode"]`` (what ``work``'s trials on ``device`` were: real, or traced
    on a ``TraceDevice``) and ``extra["parallelism"]`` (the settings; batch sizes are per rank)."""
    mode = work.mode(isinstance(device, TraceDevice))
    return dataclasses.replace(result, extra={**result.extra, "mode": mode, "parallelism": work.parallelism.to_dict()})


def probe_rank_batch_size(
    model: ModelSpec,
    seq_len: int,
    batch_size: int,
    *,
    parallelism: Parallelism,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    optimizer: OptimizerFactory | None = None,
    steps: int = 2,
    margin: int | float | str = 0,
    accumulating: bool = False,
) -> Trial:
    """One real trial of one rank at micro-batch ``batch_size`` (see ``find_rank_batch_size``);
    ``accumulating``: as a later micro-batch of an accumulation window (the gradients held).

    >>> from batchfit.parallel.models import TinyTransformer
    >>> trial = probe_rank_batch_size(TinyTransformer, 16, 2, parallelism=Parallelism(world_size=2),
    ...                               device="sim:64MiB")
    >>> trial.fits, trial.steps
    (True, 2)
    """
    work = RankWorkload(model, seq_len, parallelism, dtype, optimizer, accumulating)
    return probe_workload(work, batch_size, device=device, steps=steps, margin=margin)


@dataclass(frozen=True)
class Verification:
    """One micro-batch size's fake-tensor estimate beside one rank's real trial of it."""

    batch_size: int
    fake_peak_bytes: int | None
    trial: Trial
    parallelism: Parallelism

    @property
    def real_peak_bytes(self) -> int | None:
        return self.trial.peak_bytes

    @property
    def fits(self) -> bool:
        return self.trial.fits

    @property
    def difference_bytes(self) -> int | None:
        """Real minus fake, where both are known (a real trial that ran out of memory has no peak)."""
        if self.fake_peak_bytes is None or self.trial.peak_bytes is None:
            return None
        return self.trial.peak_bytes - self.fake_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "activation_checkpointing": self.parallelism.activation_checkpointing,
            "batch_size": self.batch_size,
            "fake_peak_bytes": self.fake_peak_bytes,
            "real_peak_bytes": self.real_peak_bytes,
            "difference_bytes": self.difference_bytes,
            "fits": self.fits,
            "error": self.trial.error,
        }


def verify_largest(
    model: ModelSpec,
    seq_len: int,
    found: Any,
    *,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    optimizer: OptimizerFactory | None = None,
) -> list[Verification]:
    """Confirm ``found`` (a ``LargestBatch`` from ``largest_batch_size``: the fake-tensor answer)
    with one rank's real trials on ``device``: at its micro-batch and the one above (at 1 alone
    when none fitted), each beside the fake peak.

    >>> from batchfit.parallel.fit import largest_batch_size
    >>> from batchfit.parallel.models import TinyTransformer
    >>> found = largest_batch_size(TinyTransformer, 16, "2MiB", parallelism=Parallelism(world_size=2))
    >>> [(row.batch_size, row.fits, row.difference_bytes) for row in verify_largest(TinyTransformer, 16, found,
    ...                                                                            device="sim:2MiB")]
    [(3, True, 0), (4, False, None)]
    """
    parallelism = found.estimate.parallelism
    sizes = [(1, found.estimate)] if found.batch_size == 0 else [(found.batch_size, found.estimate)]
    if found.batch_size > 0:
        sizes.append((found.batch_size + 1, found.above))
    rows = []
    for batch_size, fake in sizes:
        trial = probe_rank_batch_size(
            model, seq_len, batch_size, parallelism=parallelism, device=device, dtype=dtype, optimizer=optimizer
        )
        rows.append(Verification(batch_size, fake.peak_bytes if fake is not None else None, trial, parallelism))
    return rows


def verified_batch_size(
    model: ModelSpec,
    seq_len: int,
    found: Any,
    rows: list[Verification],
    *,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    optimizer: OptimizerFactory | None = None,
) -> int:
    """The micro-batch a plan may use after ``verify_largest``'s ``rows``: the traced answer (``found``) where
    its real trial fitted, else the largest size below it that one rank's real trials fit (a search capped at
    the traced answer less one; 0 when not even 1 fits). A traced answer that failed for real is never used.

    >>> from batchfit.parallel.fit import largest_batch_size
    >>> from batchfit.parallel.models import TinyTransformer
    >>> found = largest_batch_size(TinyTransformer, 16, "2MiB", parallelism=Parallelism(world_size=2))
    >>> rows = verify_largest(TinyTransformer, 16, found, device="sim:1900KiB")
    >>> [(row.batch_size, row.fits) for row in rows], verified_batch_size(TinyTransformer, 16, found, rows,
    ...                                                                    device="sim:1900KiB")
    ([(3, False), (4, False)], 2)
    """
    at = next((row for row in rows if row.batch_size == found.batch_size), None)
    if at is None or at.fits:
        return found.batch_size
    if found.batch_size <= 1:
        return 0
    parallelism = found.estimate.parallelism
    try:
        result = find_rank_batch_size(
            model,
            seq_len,
            parallelism=parallelism,
            device=device,
            dtype=dtype,
            optimizer=optimizer,
            max_batch_size=found.batch_size - 1,
            trace=False,
        )
    except (ModelDoesNotFitError, NoBatchFitsError):
        return 0
    return result.batch_size
