"""One rank's memory under sharded training, traced with FSDP2 itself over a fake world.

Inside ``fake_world`` (torch's fake process group) and ``FakeTensorMode``, the model is built
from its config, sharded (``shard_model``), given its optimizer, and trained for ``steps`` steps
on a batch of ``(batch_size, seq_len)`` token ids; ``RankBytes`` counts every storage the rank
holds. The peak and its breakdown are those of the LAST step: the first one differs (the
optimizer makes its state during it, FSDP2 initialises lazily, and DTensor's sharding
propagation makes global-shape fake tensors on its cache misses, though inside DTensor's own
dispatch, where this counter does not look). ``fake=False`` runs the same with real tensors: one
rank's real memory at any world size, the proof of the fake numbers. A ``RankSession`` keeps the
world, the sharded model and its optimizer for several micro-batch sizes: after the first size,
each costs one steady step with the same peak and breakdown as its own ``trace_rank``.

Two things keep the fake trace what real execution does:
- the loop is a hand-written one: ``output`` and ``loss`` stay alive into the next step;
- transformers' packed-sequence check reads ``position_ids`` values, which fake tensors lack, and
  would then treat the batch as packed (an explicit mask, no grouped-query attention in SDPA).
  The batch here is plain (positions 0..seq_len-1 in every row), so the check is answered as
  real execution answers it for that batch, computed on real tensors before the trace.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel import accelerator
from batchfit.parallel.child_session import ChildSession
from batchfit.parallel.counting import HostAndDeviceBytes
from batchfit.parallel.counting import PeakMoment
from batchfit.parallel.counting import RankBytes
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.models import model_builder
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.world import fake_world
from batchfit.parallel.wrap import shard_model
from batchfit.step.batching import tensor_leaves

BREAKDOWN_KEYS = (
    "sharded_parameters",
    "unsharded_parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "communication",
    "batch",
    "temporaries",
)
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
Forward = Callable[[nn.Module, Any], tuple[Any, Any]]  # (model, batch) -> (output, loss)


class StepPeak(NamedTuple):
    """One counted step: its peak bytes, their breakdown by role, the phase of the peak, and the
    bytes of the rank's sharded state (parameters and gradients after backward, optimizer state
    after the optimizer step), and the peak of each phase (forward with the loss, backward, optimizer)."""

    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    state_bytes: dict[str, int]
    phase_peaks_bytes: dict[str, int]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW as torch runs it on GPUs by default (``foreach``, one extra list of temporaries)."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


@dataclass(frozen=True)
class ShardedEstimate:
    """One rank's peak bytes in a steady training step and what they are made of.

    ``breakdown`` (bytes by ``BREAKDOWN_KEYS``) sums to ``peak_bytes``: ``sharded_parameters`` are
    the parameters the rank keeps (its shards; all of them without FSDP2), ``unsharded_parameters``
    the all-gathered ones alive at the peak, ``communication`` FSDP2's all-gather and
    reduce-scatter buffers, ``activations`` what forward left for backward (with the loop's kept
    output), ``temporaries`` the rest (backward's and the optimizer's working memory, unreduced
    gradients). ``step_peaks_bytes`` is every step's peak, the reported one last (only that one
    for a size a ``RankSession`` traced after another). ``state_bytes``
    is the sharded state the rank holds in that step, wherever the peak is: its parameters and
    gradients after backward, its optimizer state after the optimizer step (what divides by the
    number of ranks sharding it). ``phase_peaks_bytes`` is that step's peak in each phase.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    world_size: int
    batch_size: int
    seq_len: int
    peak_phase: str
    parallelism: Parallelism
    step_peaks_bytes: tuple[int, ...] = ()
    state_bytes: dict[str, int] = field(default_factory=dict)
    phase_peaks_bytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    host_peak_bytes: int | None = None
    """With CPU offload: the rank's peak bytes in host memory in that step (its sharded state and
    the optimizer's working memory); ``None`` without offload."""
    host_breakdown: dict[str, int] = field(default_factory=dict)
    """``host_peak_bytes`` by role (they sum to it)."""

    def summary(self) -> str:
        """One sentence: the peak per rank, where it happens, the largest part.

        >>> ShardedEstimate(3 * 2**30, {"activations": 2**31, "gradients": 2**30}, 8, 1, 4096, "backward",
        ...                 Parallelism(world_size=8)).summary()
        'Per rank at micro-batch 1 x 4096 tokens over 8 ranks: 3.0 GiB (in backward), the largest part activations (2.0 GiB).'
        """
        name, nbytes = max(self.breakdown.items(), key=lambda item: item[1])
        host = (
            "" if self.host_peak_bytes is None else f" Host memory: {format_bytes(self.host_peak_bytes)} (offloaded)."
        )
        return (
            f"Per rank at micro-batch {self.batch_size}{f' x {self.seq_len} tokens' if self.seq_len else ''} "
            f"over {self.world_size} ranks: "
            f"{format_bytes(self.peak_bytes)} (in {self.peak_phase}), the largest part "
            f"{name.replace('_', ' ')} ({format_bytes(nbytes)}).{host}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the parallelism as its settings)."""
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "peak_phase": self.peak_phase,
            "parallelism": self.parallelism.to_dict(),
            "step_peaks_bytes": list(self.step_peaks_bytes),
            "state_bytes": dict(self.state_bytes),
            "phase_peaks_bytes": dict(self.phase_peaks_bytes),
            **self.host_part(),
            **self.extra,
        }

    def host_part(self) -> dict[str, Any]:
        """With CPU offload, ``host_peak_bytes`` and ``host_breakdown`` (JSON-ready); nothing without."""
        if self.host_peak_bytes is None:
            return {}
        return {"host_peak_bytes": self.host_peak_bytes, "host_breakdown": dict(self.host_breakdown)}


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` computes its own loss from ``labels`` (a transformers model)."""
    return hasattr(model, "config") and hasattr(model, "loss_function")


def language_model_loss(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None
) -> tuple[Any, torch.Tensor]:
    """``(output, loss)`` of a causal language model on ``input_ids`` (its own next tokens as
    labels): a Hugging Face model's own loss on ``labels`` (the ids themselves when ``None``;
    a data collator makes them a copy of their own), without the generation cache, which training
    does not use but transformers builds by default; or cross-entropy of a plain model's logits."""
    if is_transformers_model(model):
        output = model(input_ids=input_ids, labels=input_ids if labels is None else labels, use_cache=False)
        return output, output.loss
    logits = model(input_ids)
    return logits, next_token_loss(logits, input_ids)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a plain language model's logits (in fp32) against ``input_ids``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten())


def language_model_batch(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, labels)``: a transformers model's labels a tensor of their own, as a data
    collator makes them; ``None`` for a plain model (its loss reads the ids)."""
    return input_ids, input_ids.clone() if is_transformers_model(model) else None


def language_model_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[Any, Any]:
    """``(output, loss)`` of a language model on a ``language_model_batch``."""
    return language_model_loss(model, *batch)


@contextlib.contextmanager
def plain_batch_checks(batch_size: int, seq_len: int) -> Iterator[None]:
    """While active, transformers' packed-sequence check answers for fake ``position_ids`` what it
    answers for real ones of a plain batch (``0..seq_len-1`` in every row): computed here on real
    tensors. Restored on the way out; nothing happens when transformers is not imported."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    original = masking.find_packed_sequence_indices
    with _disable_current_modes():  # real tensors, also when called inside a FakeTensorMode
        real = original(torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len))

    def decided(position_ids: torch.Tensor) -> torch.Tensor | None:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(position_ids) and tuple(position_ids.shape) == (batch_size, seq_len):
            return real
        return original(position_ids)

    masking.find_packed_sequence_indices = decided
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _check_sizes(batch_size: object, seq_len: object, steps: object) -> None:
    for name, value, least in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("steps", steps, 2)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        if value < least:
            why = " (the peak is taken from a step after the first)" if name == "steps" else ""
            raise InputError(f"{name} must be at least {least}{why}, got {value}")


def vocab_size_of(model: nn.Module) -> int:
    """The size of ``model``'s token embedding (a language model is fed ids below it)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embeddings is None:
        raise InputError(
            f"{type(model).__name__} has no token embedding: the trace feeds token ids to a language model"
        )
    return embeddings.num_embeddings


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class _StepRecord(NamedTuple):
    """One counted step before it is reported: the peak until the previous step's output was
    released (``earlier``, in the forward) and the peak after it (``later``), each a moment of the
    counter's ledger; the sharded state and the peak of each phase."""

    earlier: PeakMoment
    later: PeakMoment
    state_bytes: dict[str, int]
    phase_peaks_bytes: dict[str, int]


def _reported(record: _StepRecord, counter: RankBytes, kept: dict[str, int]) -> StepPeak:
    """The step's peak as counted, plus ``kept``: bytes by role that a previous step at this size
    would have left alive (its output and loss) until this step's forward replaced them, which a
    step traced right after another size did not hold. With ``kept`` empty, the step as run."""
    kept_bytes = sum(kept.values())
    earlier, later = record.earlier, record.later
    if earlier.peak_bytes + kept_bytes >= later.peak_bytes:  # a tie goes to the earlier moment, as in one ledger
        moment, extra = earlier, kept
    else:
        moment, extra = later, {}
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for part in (counter.breakdown_at(moment), extra):
        for role, nbytes in part.items():
            breakdown[role] = breakdown.get(role, 0) + nbytes
    phase_peaks = {**record.phase_peaks_bytes, "forward": record.phase_peaks_bytes["forward"] + kept_bytes}
    peak_bytes = moment.peak_bytes + sum(extra.values())
    return StepPeak(peak_bytes, breakdown, moment.phase, record.state_bytes, phase_peaks)


class _Steps:
    """The training loop one rank runs, counted by ``counter``, with the roles named as they become known."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        counter: RankBytes,
        forward: Forward | None = None,
    ):
        self.model, self.optimizer, self.batch, self.counter = model, optimizer, batch, counter
        self.forward = forward or language_model_step
        self.output: Any = None  # the loop's variables: alive into the next step, as in a hand-written loop
        self.loss: Any = None

    def register(self) -> None:
        counter = self.counter
        counter.track_all(self.model.parameters(), "sharded_parameters")
        counter.track_all(self.model.buffers(), "buffers")
        counter.track_all(_optimizer_tensors(self.optimizer), "optimizer_state")
        counter.track_all(tensor_leaves(self.batch), "batch")

    def step(self) -> _StepRecord:
        """One step; its peaks (before and after the previous output is released), the phase of
        each, and the sharded state."""
        counter, phase_peaks = self.counter, {}
        counter.restart_peak()
        counter.start_phase("forward")
        output, loss = self.forward(self.model, self.batch)
        counter.split_peak()  # the previous step's output and loss are released on the next line
        self.output, self.loss = output, loss
        del output, loss
        counter.ledger.assign(counter.live_keys_with("temporaries"), "activations")  # kept for backward
        phase_peaks["forward"] = counter.phase_peak_bytes
        counter.start_phase("backward")
        self.loss.backward()
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        counter.assign(gradients, "gradients")
        state = {
            "sharded_parameters": counter.bytes_of(self.model.parameters()),
            "gradients": counter.bytes_of(gradients),
        }
        del gradients
        phase_peaks["backward"] = counter.phase_peak_bytes
        counter.start_phase("optimizer")
        self.optimizer.step()
        counter.assign(_optimizer_tensors(self.optimizer), "optimizer_state")
        state["optimizer_state"] = counter.bytes_of(_optimizer_tensors(self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        phase_peaks["optimizer"] = counter.phase_peak_bytes
        return _StepRecord(counter.earlier_peak, counter.later_peak(), state, phase_peaks)

    def release_output(self) -> dict[str, int]:
        """Drop the loop's output and loss; the bytes that freed, by role."""

        def release() -> None:
            self.output = self.loss = None

        return self.counter.released_by_role(release)


def trace_rank(
    model: ModelSpec,
    batch_size: int,
    seq_len: int,
    *,
    parallelism: Parallelism | None = None,
    dtype: torch.dtype = torch.float32,
    optimizer: OptimizerFactory | None = None,
    steps: int = 2,
    fake: bool = True,
) -> ShardedEstimate:
    """One rank's peak memory training ``model`` at micro-batch ``batch_size`` x ``seq_len`` tokens
    under ``parallelism``, traced with FSDP2 over a fake world of that size; see the module.

    ``model`` is a preset (``LLM_PRESETS``), a config.json path, a transformers config or dict
    (see ``model_config``), or a function returning an ``nn.Module`` language model; it is built
    in ``dtype`` (FSDP2's ``param_dtype`` in ``parallelism`` sets the compute dtype).
    ``optimizer`` makes the optimizer from the parameters (AdamW with ``foreach``, torch's GPU
    default, when ``None``). ``fake=False`` runs one rank for real (real memory: keep it small).
    To trace several micro-batch sizes of one model, a ``RankSession`` builds and shards it once.

    >>> from batchfit.parallel.models import TinyTransformer
    >>> estimate = trace_rank(TinyTransformer, 2, 16, parallelism=Parallelism(world_size=2))
    >>> estimate.world_size, sum(estimate.breakdown.values()) == estimate.peak_bytes
    (2, True)
    """
    _check_sizes(batch_size, seq_len, steps)  # before the model is built
    session = RankSession(
        model, seq_len, parallelism=parallelism, dtype=dtype, optimizer=optimizer, steps=steps, fake=fake
    )
    with session:
        return session.trace(batch_size)


def _checked_parallelism(parallelism: Parallelism | None) -> Parallelism:
    parallelism = Parallelism() if parallelism is None else parallelism
    if not isinstance(parallelism, Parallelism):
        raise InputTypeError(f"parallelism must be a batchfit Parallelism, got {type(parallelism).__name__}")
    if parallelism.sharding == "ddp":
        raise InputError(
            "sharding='ddp' cannot be traced (DistributedDataParallel needs real tensors): every DDP rank holds the "
            "whole model, so trace sharding='none' with world_size=1, or probe real DDP under torchrun"
        )
    return parallelism


def _estimate(
    peaks: list[StepPeak], batch_size: int, seq_len: int, parallelism: Parallelism, host: RankBytes | None = None
) -> ShardedEstimate:
    """The estimate of the last of ``peaks``; ``host``: the host's counter, as that step left it."""
    last = peaks[-1]
    return ShardedEstimate(
        peak_bytes=last.peak_bytes,
        breakdown=last.breakdown,
        world_size=parallelism.world_size,
        batch_size=batch_size,
        seq_len=seq_len,
        peak_phase=last.phase,
        parallelism=parallelism,
        step_peaks_bytes=tuple(step.peak_bytes for step in peaks),
        state_bytes=last.state_bytes,
        phase_peaks_bytes=last.phase_peaks_bytes,
        host_peak_bytes=None if host is None else host.peak_bytes,
        host_breakdown={} if host is None else {role: n for role, n in host.breakdown().items() if n},
    )


class RankSession:
    """One rank's fake world, sharded model and optimizer, made once and traced at several
    micro-batch sizes of ``seq_len`` tokens (the arguments are ``trace_rank``'s).

    The first ``trace`` runs ``steps`` steps and reports the last, as ``trace_rank`` does. The
    optimizer state then exists, so a later size needs one steady step: it starts without the
    output and loss a previous step at that size would have left alive until its forward
    replaced them, and those bytes (the ones the step's own output frees, by role) are added to
    its forward, so its peak, breakdown and phase peaks are those of ``trace_rank`` at that size
    (``step_peaks_bytes`` then holds that one step). Should a step change what the rank keeps
    between steps, that size is traced again from ``steps`` steps. The process group lives
    while the ``with`` block does; fake mode is on only inside ``trace``.

    With ``Parallelism(cpu_offload=True)`` the session lives in a child process that runs one
    rank on a fake accelerator (``batchfit.parallel.offload``), and each estimate counts the
    host's bytes apart (``host_peak_bytes``); the model and optimizer specs must then pickle.

    >>> from batchfit.parallel.models import TinyTransformer
    >>> with RankSession(TinyTransformer, 16, parallelism=Parallelism(world_size=2)) as session:
    ...     peaks = [session.trace(size).peak_bytes for size in (1, 2)]
    >>> peaks[0] < peaks[1], session.traces, session.steps_run
    (True, 2, 3)
    """

    builds_on_accelerator = True  # a process with the fake accelerator builds the model on it

    def __init__(
        self,
        model: ModelSpec,
        seq_len: int,
        *,
        parallelism: Parallelism | None = None,
        dtype: torch.dtype = torch.float32,
        optimizer: OptimizerFactory | None = None,
        steps: int = 2,
        fake: bool = True,
    ):
        self.parallelism = _checked_parallelism(parallelism)
        _check_sizes(1, seq_len, steps)
        if self.parallelism.cpu_offload and not fake:
            raise InputError(
                "cpu_offload is traced on fake tensors only (fake=True): on this machine host and device are one, "
                "so real tensors would measure no offload"
            )
        self.seq_len, self.steps, self.fake = seq_len, steps, fake
        self._spec = {"model": model, "dtype": dtype, "optimizer": optimizer}  # for a child process
        self._build = model_builder(model, dtype)
        self._make_optimizer = optimizer or default_optimizer
        self._child: Any = None  # with CPU offload: the child process that traces (batchfit.parallel.offload)
        self._device = torch.device("cpu")  # the fake accelerator in a process that has it
        self._stack: contextlib.ExitStack | None = None
        self._warm = False  # whether a step has made the optimizer state and FSDP2's lazy state
        self._failed = False  # whether a trace raised (the model may be stuck in a step)
        self.traces = 0
        self.steps_run = 0

    def __enter__(self) -> RankSession:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # in batchfit's child process (or a benchmark's that registered the fake accelerator)
        on_accelerator = self.builds_on_accelerator and self.fake and accelerator.is_registered()
        if self.parallelism.cpu_offload and not on_accelerator:
            return self._enter_child()
        if on_accelerator:
            self._device = torch.device(accelerator.NAME, 0)
        with contextlib.ExitStack() as stack:
            mesh = stack.enter_context(fake_world(self.parallelism, self._device.type))
            self._mode = FakeTensorMode(allow_non_fake_inputs=True) if self.fake else contextlib.nullcontext()
            with self._mode:
                self.model, self.optimizer = self._sharded(mesh)
            self.counter = HostAndDeviceBytes() if on_accelerator else RankBytes()
            self._stack = stack.pop_all()
        return self

    def _enter_child(self) -> RankSession:
        """Trace in a child process with the fake accelerator (whose registration is process-wide)."""
        options = {**self._spec, "parallelism": self.parallelism, "steps": self.steps}
        self._child = ChildSession(self.seq_len, options)
        self._stack = contextlib.ExitStack()
        self._stack.callback(self._child.close)
        return self

    def _sharded(self, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The rank's model (built from its spec, on the session's device, sharded over ``mesh``)
        and its optimizer."""
        model = self._build()
        if self._device.type != "cpu":
            model = accelerator.moved_to(model, self._device)
        model = shard_model(model, mesh, self.parallelism)
        self._vocab_size = vocab_size_of(model)
        return model, self._make_optimizer(model.parameters())

    def _batch(self, batch_size: int) -> Any:
        """A batch of ``batch_size`` rows and what checks it (made inside the session's mode)."""
        input_ids = torch.randint(0, self._vocab_size, (batch_size, self.seq_len), device=self._device)
        return language_model_batch(self.model, input_ids)

    def _checks(self, batch_size: int) -> Any:
        return plain_batch_checks(batch_size, self.seq_len)

    def _forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        """``(output, loss)`` of one step on ``batch``: a language model's."""
        return language_model_step(model, batch)

    def __exit__(self, *exc_info: object) -> None:
        self.model = self.optimizer = self.counter = self._child = None
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def trace(self, batch_size: int) -> ShardedEstimate:
        """One rank's peak at micro-batch ``batch_size`` (see the class)."""
        _check_sizes(batch_size, self.seq_len or 1, self.steps)  # 0: a workload's own rows, no tokens
        if self._stack is None:
            raise InputError("a RankSession traces inside its with block: with RankSession(...) as session: ...")
        if self._failed:
            raise InputError("this RankSession's model stopped in the middle of a step: trace in a new RankSession")
        try:
            if self._child is not None:
                estimate, self.steps_run = self._child.trace(batch_size)
            else:
                peaks = self._traced(batch_size)
                estimate = _estimate(
                    peaks, batch_size, self.seq_len, self.parallelism, getattr(self.counter, "host", None)
                )
        except BaseException:
            self._failed = True  # FSDP2 may hold gathered parameters, the optimizer half a step
            raise
        self.traces += 1
        return estimate

    def _traced(self, batch_size: int) -> list[StepPeak]:
        with self._mode:
            loop = _Steps(self.model, self.optimizer, self._batch(batch_size), self.counter, self._forward)
            with self._checks(batch_size), self.counter.measuring():
                loop.register()
                peaks = self._steady(loop) if self._warm else None
                if peaks is None:
                    peaks = [_reported(loop.step(), self.counter, {}) for _ in range(self.steps)]
                    self.steps_run += self.steps
                    loop.release_output()
            loop.batch = None
        self._warm = True
        return peaks

    def _steady(self, loop: _Steps) -> list[StepPeak] | None:
        """One steady step at a new size, reported with what a previous step at that size would
        have left alive; ``None`` when the step changed what the rank keeps between steps."""
        start_bytes = self.counter.live_bytes  # the resting state and this size's batch
        record = loop.step()
        self.steps_run += 1
        kept = loop.release_output()
        if self.counter.live_bytes != start_bytes:
            return None
        return [_reported(record, self.counter, kept)]


def count_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, steps: int = 2
) -> list[StepPeak]:
    """Train ``model`` (sharded or not, fake or real tensors, in a fake world or a real one such as
    a ``torchrun`` job) for ``steps`` steps on ``input_ids`` and return every step's peak bytes of
    this rank, their breakdown and the phase of the peak, counted by ``RankBytes`` from the state
    the model and optimizer hold now."""
    loop = _Steps(model, optimizer, language_model_batch(model, input_ids), RankBytes())
    batch_size, seq_len = input_ids.shape
    with plain_batch_checks(batch_size, seq_len), loop.counter.measuring():
        loop.register()
        return [_reported(loop.step(), loop.counter, {}) for _ in range(steps)]
