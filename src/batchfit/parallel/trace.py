"""One rank's memory under sharded training, traced with FSDP2 itself over a fake world.

Inside ``fake_world`` (torch's fake process group) and ``FakeTensorMode``, the model is built
from its config, sharded (``shard_model``), given its optimizer, and trained for ``steps`` steps
on a batch of ``(batch_size, seq_len)`` token ids; ``RankBytes`` counts every storage the rank
holds. The peak and its breakdown are those of the LAST step: the first one differs (the
optimizer makes its state during it, FSDP2 initialises lazily, and DTensor's sharding
propagation makes global-shape fake tensors on its cache misses, though inside DTensor's own
dispatch, where this counter does not look). ``fake=False`` runs the same with real tensors: one
rank's real memory at any world size, the proof of the fake numbers.

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
from batchfit.parallel.counting import RankBytes
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.models import model_builder
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.world import fake_world
from batchfit.parallel.wrap import shard_model

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
    gradients). ``step_peaks_bytes`` is every step's peak, the reported one last. ``state_bytes``
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

    def summary(self) -> str:
        """One sentence: the peak per rank, where it happens, the largest part.

        >>> ShardedEstimate(3 * 2**30, {"activations": 2**31, "gradients": 2**30}, 8, 1, 4096, "backward",
        ...                 Parallelism(world_size=8)).summary()
        'Per rank at micro-batch 1 x 4096 tokens over 8 ranks: 3.0 GiB (in backward), the largest part activations (2.0 GiB).'
        """
        name, nbytes = max(self.breakdown.items(), key=lambda item: item[1])
        return (
            f"Per rank at micro-batch {self.batch_size} x {self.seq_len} tokens over {self.world_size} ranks: "
            f"{format_bytes(self.peak_bytes)} (in {self.peak_phase}), the largest part "
            f"{name.replace('_', ' ')} ({format_bytes(nbytes)})."
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
            **self.extra,
        }


def language_model_loss(model: nn.Module, input_ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``(output, loss)`` of a causal language model on ``input_ids`` (its own next tokens as
    labels): a Hugging Face model's own loss (without the generation cache, which training does not
    use but transformers builds by default), or cross-entropy of a plain model's logits."""
    if hasattr(model, "config") and hasattr(model, "loss_function"):
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        return output, output.loss
    logits = model(input_ids)
    return logits, F.cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten())


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


def _vocab_size(model: nn.Module) -> int:
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


class _Steps:
    """The training loop one rank runs, counted by ``counter``, with the roles named as they become known."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, counter: RankBytes):
        self.model, self.optimizer, self.input_ids, self.counter = model, optimizer, input_ids, counter
        self.output: Any = None  # the loop's variables: alive into the next step, as in a hand-written loop
        self.loss: Any = None

    def register(self) -> None:
        counter = self.counter
        counter.track_all(self.model.parameters(), "sharded_parameters")
        counter.track_all(self.model.buffers(), "buffers")
        counter.track_all(_optimizer_tensors(self.optimizer), "optimizer_state")
        counter.track(self.input_ids, "batch")

    def step(self) -> StepPeak:
        """One step; its peak bytes, their breakdown, the phase of the peak, and the sharded state."""
        counter, phase_peaks = self.counter, {}
        counter.restart_peak()
        counter.start_phase("forward")
        self.output, self.loss = language_model_loss(self.model, self.input_ids)
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
        breakdown = {**dict.fromkeys(BREAKDOWN_KEYS, 0), **counter.breakdown()}
        return StepPeak(counter.peak_bytes, breakdown, counter.ledger.peak_phase, state, phase_peaks)


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

    >>> from batchfit.parallel.models import TinyTransformer
    >>> estimate = trace_rank(TinyTransformer, 2, 16, parallelism=Parallelism(world_size=2))
    >>> estimate.world_size, sum(estimate.breakdown.values()) == estimate.peak_bytes
    (2, True)
    """
    parallelism = Parallelism() if parallelism is None else parallelism
    if not isinstance(parallelism, Parallelism):
        raise InputTypeError(f"parallelism must be a batchfit Parallelism, got {type(parallelism).__name__}")
    _check_sizes(batch_size, seq_len, steps)
    if parallelism.sharding == "ddp":
        raise InputError(
            "sharding='ddp' cannot be traced (DistributedDataParallel needs real tensors): every DDP rank holds the "
            "whole model, so trace sharding='none' with world_size=1, or probe real DDP under torchrun"
        )
    peaks = _run(
        model_builder(model, dtype), batch_size, seq_len, parallelism, optimizer or default_optimizer, steps, fake
    )
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
    )


def _run(
    build: Callable[[], nn.Module],
    batch_size: int,
    seq_len: int,
    parallelism: Parallelism,
    optimizer: OptimizerFactory,
    steps: int,
    fake: bool,
) -> list[StepPeak]:
    """Every step's peak, breakdown and phase: the world (before any fake mode), then the model,
    its optimizer and batch built (fake or real), then the counted steps."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_world(parallelism) as mesh, FakeTensorMode() if fake else contextlib.nullcontext():
        model = shard_model(build(), mesh, parallelism)
        input_ids = torch.randint(0, _vocab_size(model), (batch_size, seq_len))
        return count_steps(model, optimizer(model.parameters()), input_ids, steps)


def count_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, steps: int = 2
) -> list[StepPeak]:
    """Train ``model`` (sharded or not, fake or real tensors, in a fake world or a real one such as
    a ``torchrun`` job) for ``steps`` steps on ``input_ids`` and return every step's peak bytes of
    this rank, their breakdown and the phase of the peak, counted by ``RankBytes`` from the state
    the model and optimizer hold now."""
    loop = _Steps(model, optimizer, input_ids, RankBytes())
    batch_size, seq_len = input_ids.shape
    with plain_batch_checks(batch_size, seq_len), loop.counter.measuring():
        loop.register()
        return [loop.step() for _ in range(steps)]
