"""What ``plan_batch`` is asked: four frozen, checked groups of inputs.

``BatchTarget`` (the global batch and the devices), ``LearningRateConfig`` (the tuned learning
rate, its scaling rule and warmup), ``TrainingRun`` (dataset, epochs and a batch-size ramp) and
``AdviceInputs`` (what the warnings and advice need). Each is checked when built, so a bad value
fails before any arithmetic, with a one-line message naming the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import fields
from typing import Any

from batchfit.bounds import LARGEST_SIZE
from batchfit.bounds import check_size
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.planning.advice import REFERENCE_BATCHES
from batchfit.planning.lr import LR_RULES

GOALS = ("accuracy", "speed", "memory")
RAMPS = ("linear", "exponential")


def positive_int(name: str, value: Any, largest: int | None = None) -> None:
    """A ``ValueError`` unless ``value`` is an integer of at least 1 (``True`` is not a count), and at most
    ``largest`` where given (a batch: ``batchfit.bounds.LARGEST_SIZE``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    if largest is not None:
        check_size(name, value, largest=largest)


def optional_positive_int(name: str, value: Any, largest: int | None = None) -> None:
    if value is not None:
        positive_int(name, value, largest)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_default(config: Any) -> bool:
    return all(getattr(config, f.name) == f.default for f in fields(config))


@dataclass(frozen=True)
class BatchTarget:
    """The global batch one optimizer step should see, and the devices that share it.

    >>> BatchTarget(global_batch_tokens=32768, seq_len=256, devices=1).global_batch_tokens
    32768
    >>> BatchTarget(global_batch_tokens=4096)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: global_batch_tokens needs seq_len (tokens per sample): total = micro x seq_len x accumulation x devices
    """

    global_batch_size: int | str | None = None
    """The target in samples, or ``"critical"`` for the critical batch of a measured noise scale."""
    global_batch_tokens: int | None = None
    """The target in tokens instead (needs ``seq_len``); give one target, or a model family's."""
    seq_len: int | None = None
    """Tokens per sample: the global batch in tokens is micro x seq_len x accumulation x devices."""
    devices: int | None = None
    """Data-parallel devices (``None``: torch.distributed's world size when planning, else 1)."""

    def __post_init__(self) -> None:
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise InputError(
                "give exactly one target: global_batch_size (samples) or global_batch_tokens (with seq_len)"
            )
        if self.global_batch_size != "critical":
            optional_positive_int("global_batch_size", self.global_batch_size, largest=LARGEST_SIZE)
        optional_positive_int("global_batch_tokens", self.global_batch_tokens)
        if self.global_batch_tokens is not None and self.seq_len is None:
            raise InputError(
                "global_batch_tokens needs seq_len (tokens per sample): total = micro x seq_len x accumulation x devices"
            )
        optional_positive_int("seq_len", self.seq_len, largest=LARGEST_SIZE)
        optional_positive_int("devices", self.devices, largest=LARGEST_SIZE)
        if self.global_batch_tokens is not None and self.global_batch_tokens // self.seq_len > LARGEST_SIZE:
            raise InputError(
                f"global_batch_tokens {self.global_batch_tokens:,} is more than {LARGEST_SIZE:,} sequences of "
                f"{self.seq_len}: give the global batch in tokens your run takes (e.g. 4M)"
            )

    @property
    def given(self) -> bool:
        """Whether a target (samples, tokens or ``"critical"``) is given."""
        return self.global_batch_size is not None or self.global_batch_tokens is not None


@dataclass(frozen=True)
class LearningRateConfig:
    """The learning rate tuned at a smaller batch, how to scale it, and the warmup.

    >>> LearningRateConfig(base_lr=0.1, base_batch_size=256, lr_scaling="sqrt").lr_scaling
    'sqrt'
    >>> LearningRateConfig(base_lr=0.1)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: give base_lr and base_batch_size together: the learning rate and the batch it was tuned at
    """

    base_lr: float | None = None
    """The learning rate tuned at ``base_batch_size`` (positive and finite)."""
    base_batch_size: int | None = None
    """The batch ``base_lr`` was tuned at, in the target's unit (samples, or tokens for a token target)."""
    lr_scaling: str = "linear"
    """``linear`` (Goyal et al. 2017), ``sqrt`` (Krizhevsky 2014; Malladi et al. 2022 for Adam) or ``none``."""
    warmup_epochs: int | None = None
    """Learning-rate warmup in epochs (``None`` with ``base_lr``: suggested from the batch scale)."""
    warmup_steps: int | None = None
    """Learning-rate warmup in optimizer steps (else derived from ``warmup_epochs`` and the dataset)."""

    def __post_init__(self) -> None:
        if self.base_lr is not None and not (_number(self.base_lr) and self.base_lr > 0):
            raise InputError(f"base_lr must be a positive, finite number, got {self.base_lr!r}")
        if (self.base_lr is None) != (self.base_batch_size is None):
            raise InputError(
                "give base_lr and base_batch_size together: the learning rate and the batch it was tuned at"
            )
        optional_positive_int("base_batch_size", self.base_batch_size)
        if self.lr_scaling not in LR_RULES:
            raise InputError(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}")
        for name in ("warmup_epochs", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value >= 0):
                raise InputError(f"warmup_epochs and warmup_steps cannot be negative, got {name}={value!r}")


@dataclass(frozen=True)
class TrainingRun:
    """How long training runs, for steps per epoch, the LR schedule and a batch-size ramp.

    >>> TrainingRun(dataset_size=10_240, epochs=10).epochs
    10
    >>> TrainingRun(schedule_from=64)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: a batch-size schedule needs epochs: the ramp runs from schedule_from to the target over them
    """

    dataset_size: int | None = None
    """Samples per epoch: gives steps per epoch, warmup in steps and total steps."""
    epochs: int | None = None
    """Epochs of the run: gives total steps (with ``dataset_size``) and the length of a ramp."""
    schedule_from: int | None = None
    """Ramp the global batch from this many samples up to the target over ``epochs`` (Smith et al.
    2018, "Don't Decay the Learning Rate, Increase the Batch Size"), by accumulation steps."""
    schedule_ramp: str = "linear"
    """How the ramp grows: ``linear`` or ``exponential``."""

    def __post_init__(self) -> None:
        optional_positive_int("dataset_size", self.dataset_size)
        optional_positive_int("epochs", self.epochs)
        optional_positive_int("schedule_from", self.schedule_from)
        if self.schedule_from is not None and self.epochs is None:
            raise InputError(
                "a batch-size schedule needs epochs: the ramp runs from schedule_from to the target over them"
            )
        if self.schedule_ramp not in RAMPS:
            raise InputError(f"schedule_ramp must be one of {', '.join(RAMPS)}, got {self.schedule_ramp!r}")


@dataclass(frozen=True)
class AdviceInputs:
    """What the plan's warnings and advice take into account; none of it changes the arithmetic,
    except ``model_family``, which supplies a typical target when none is given.

    >>> AdviceInputs(goal="speed", capacity_gib=24).goal
    'speed'
    >>> AdviceInputs(goal="fame")
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: goal must be one of accuracy, speed, memory, got 'fame'
    """

    has_batchnorm: bool = False
    """The model has BatchNorm: accumulation then computes statistics per micro-batch (a warning)."""
    fine_tuning: bool = False
    """Fine-tuning rather than pre-training: a small batch and learning rate are advised."""
    goal: str | None = None
    """``accuracy``, ``speed`` or ``memory``: what the advice optimises for."""
    capacity_gib: float | None = None
    """Device memory in GiB, for a starting batch range."""
    weight_decay: float | None = None
    """The weight decay tuned at the base batch, to suggest its scaled value."""
    model_family: str | None = None
    """``gpt2``, ``bert``, ``llama`` or ``resnet50-imagenet``: a typical target (and learning rate) if none is given."""
    worker_throughput: Mapping[str, float] | None = None
    """Samples/s per worker name: splits the global batch in proportion (heterogeneous workers)."""
    measured_optimal: bool = False
    """The micro-batch is the throughput-optimal one, not just the largest that fits (silences a warning)."""

    def __post_init__(self) -> None:
        if self.goal is not None and self.goal not in GOALS:
            raise InputError(f"goal must be one of {', '.join(GOALS)}, got {self.goal!r}")
        if self.capacity_gib is not None and not (_number(self.capacity_gib) and self.capacity_gib > 0):
            raise InputError(f"capacity_gib must be a positive number of GiB, got {self.capacity_gib!r}")
        if self.weight_decay is not None and not (_number(self.weight_decay) and self.weight_decay >= 0):
            raise InputError(f"weight_decay must be a non-negative number, got {self.weight_decay!r}")
        if self.model_family is not None and (
            not isinstance(self.model_family, str) or self.model_family.strip().lower() not in REFERENCE_BATCHES
        ):
            raise InputError(
                f"unknown model family {self.model_family!r}: choose one of {', '.join(REFERENCE_BATCHES)}"
            )
        if self.worker_throughput is not None:
            throughput = dict(self.worker_throughput)  # a copy: the caller's dict may change later
            if not throughput or not all(_number(v) and v > 0 for v in throughput.values()):
                raise InputError(
                    "worker throughput must be positive samples/s for every worker, e.g. {'worker-0': 850.0}"
                )
            object.__setattr__(self, "worker_throughput", throughput)


def merge(name: str, config: Any, flat: Any) -> Any:
    """``config`` if given (then the flat keywords of its group must be left at their defaults), else ``flat``."""
    if config is None:
        return flat
    if not isinstance(config, type(flat)):
        raise InputTypeError(f"{name} must be a {type(flat).__name__}, got {type(config).__name__}")
    if not _is_default(flat):
        raise InputTypeError(f"give {name}={type(flat).__name__}(...) or its fields as keywords, not both")
    return config
