"""BatchPlan: micro-batch, accumulation, devices, learning rate and warmup for a global batch.

Pure arithmetic: the global batch is micro-batch x accumulation steps x devices samples, and
micro x seq_len x accumulation x devices tokens. torch is imported only to read the world size or
to build an LR scheduler, and only when asked. ``plan_batch`` computes every value first and
builds the (frozen) plan once.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.bounds import LARGEST_SIZE
from batchfit.errors import InputError
from batchfit.planning.advice import Stage
from batchfit.planning.advice import batch_schedule
from batchfit.planning.advice import reference
from batchfit.planning.advice import regularization_advice
from batchfit.planning.advice import starting_range
from batchfit.planning.advice import workload_distribution
from batchfit.planning.config import GOALS
from batchfit.planning.config import AdviceInputs
from batchfit.planning.config import BatchTarget
from batchfit.planning.config import LearningRateConfig
from batchfit.planning.config import TrainingRun
from batchfit.planning.config import merge
from batchfit.planning.config import positive_int
from batchfit.planning.lr import LR_RULES
from batchfit.planning.lr import scale_learning_rate
from batchfit.planning.lr import suggested_warmup_epochs
from batchfit.planning.lr import warmup_cosine
from batchfit.planning.lr import warmup_need
from batchfit.planning.noise import critical_target
from batchfit.planning.noise import noise_scale_value
from batchfit.planning.noise import tradeoff_advice
from batchfit.planning.noise import tradeoff_at

__all__ = [
    "GOALS",
    "AdviceInputs",
    "BatchPlan",
    "BatchTarget",
    "LearningRateConfig",
    "TrainingRun",
    "plan_batch",
    "world_size",
]


def world_size() -> int:
    """Devices from ``torch.distributed`` when it is initialised, else 1. A process that never imported
    ``torch.distributed`` has no process group: it is not imported here for the question (a plan from numbers
    stays arithmetic).

    >>> world_size()
    1
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def steps_per_epoch(dataset_size: int | None, global_batch_size: int) -> int | None:
    """Optimizer steps in one epoch (the last one may be partial), or ``None`` without a dataset size."""
    return None if dataset_size is None else math.ceil(dataset_size / global_batch_size)


@dataclass(frozen=True)
class BatchPlan:
    """How to reach a global batch. Fields given in ``plan_batch``'s terms; the rest derived.

    ``global_batch_size`` is what one optimizer step really sees, in samples:
    ``micro_batch_size * gradient_accumulation_steps * devices``. ``target_samples`` is what was
    asked for; ``deviation`` is their relative difference (0 when ``exact``).

    >>> BatchPlan(16, 8, 1, 128, seq_len=256).summary()
    '16 per device x 8 accumulation steps x 1 device(s) = 128 samples (32,768 tokens) per optimizer step.'
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    devices: int
    target_samples: int
    seq_len: int | None = None
    learning_rate: float | None = None
    base_learning_rate: float | None = None
    base_batch_size: int | None = None
    lr_scaling: str = "linear"
    warmup_epochs: int | None = None
    warmup_steps: int | None = None
    warmup: str = "none"
    dataset_size: int | None = None
    epochs: int | None = None
    max_micro_batch_size: int | None = None
    warnings: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    hardware_calibration: dict[str, Any] | None = None
    schedule: list[Stage] | None = None
    target_in_tokens: bool = False
    critical: dict[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps", "devices", "target_samples"):
            positive_int(name, getattr(self, name))
        if self.lr_scaling not in LR_RULES:
            raise InputError(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}")

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.devices

    @property
    def global_batch_tokens(self) -> int | None:
        return None if self.seq_len is None else self.global_batch_size * self.seq_len

    @property
    def exact(self) -> bool:
        return self.global_batch_size == self.target_samples

    @property
    def deviation(self) -> float:
        return (self.global_batch_size - self.target_samples) / self.target_samples

    @property
    def steps_per_epoch(self) -> int | None:
        return steps_per_epoch(self.dataset_size, self.global_batch_size)

    @property
    def total_steps(self) -> int | None:
        per_epoch = self.steps_per_epoch
        return None if per_epoch is None or self.epochs is None else per_epoch * self.epochs

    def lr_lambda(self, schedule: str = "cosine"):
        """The LR multiplier per optimizer step: linear warmup, then cosine decay or constant."""
        if self.total_steps is None:
            raise InputError("the LR schedule needs dataset_size and epochs in plan_batch")
        return warmup_cosine(self.warmup_steps or 0, self.total_steps, schedule)

    def lr_scheduler(self, optimizer: Any, schedule: str = "cosine") -> Any:
        """A ``torch.optim.lr_scheduler.LambdaLR``; set the optimizer's lr to ``learning_rate`` first."""
        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, self.lr_lambda(schedule))

    def summary(self) -> str:
        """One sentence: the split of the global batch, and the learning rate and warmup when planned."""
        tokens = f" ({self.global_batch_tokens:,} tokens)" if self.global_batch_tokens is not None else ""
        off = "" if self.exact else f" ({self.deviation:+.1%} from the {self.target_samples} asked for)"
        rate = f", learning rate {self.learning_rate:.4g}" if self.learning_rate is not None else ""
        if self.warmup_steps is not None:
            rate += f" with {self.warmup_steps} warmup steps"
        elif self.warmup_epochs is not None:
            rate += f" with {self.warmup_epochs} warmup epochs"
        return (
            f"{self.micro_batch_size} per device x {self.gradient_accumulation_steps} accumulation steps x "
            f"{self.devices} device(s) = {self.global_batch_size} samples{tokens} per optimizer step{off}{rate}."
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict. Its ``batch_configuration`` opens with the keys of a training
        coordinator's batch configuration (``per_gpu_batch_size``, ``total_batch_size``,
        ``gradient_accumulation_steps``, ``learning_rate``, ``warmup_steps`` and/or
        ``warmup_epochs``), then the rest of the plan; warnings, advice and the optional parts follow."""
        configuration: dict[str, Any] = {
            "per_gpu_batch_size": self.micro_batch_size,
            "total_batch_size": self.global_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "learning_rate": self.learning_rate,
        }
        if self.warmup_steps is not None:
            configuration["warmup_steps"] = self.warmup_steps
        if self.warmup_epochs is not None:
            configuration["warmup_epochs"] = self.warmup_epochs
        configuration.update(
            devices=self.devices,
            seq_len=self.seq_len,
            total_batch_tokens=self.global_batch_tokens,
            target_batch_size=self.target_samples,
            exact=self.exact,
            deviation=self.deviation,
            base_learning_rate=self.base_learning_rate,
            base_batch_size=self.base_batch_size,
            lr_scaling=self.lr_scaling,
            warmup=self.warmup,
            max_micro_batch_size=self.max_micro_batch_size,
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
        )
        document: dict[str, Any] = {
            "batch_configuration": configuration,
            "warnings": list(self.warnings),
            "advice": list(self.advice),
        }
        if self.hardware_calibration is not None:
            document["hardware_calibration"] = self.hardware_calibration
        if self.critical is not None:
            document["critical_batch"] = dict(self.critical)
        if self.schedule is not None:
            document["batch_schedule"] = [asdict(stage) for stage in self.schedule]
        return document


@dataclass(frozen=True)
class _Shape:
    """The split a plan settles on, and what follows from it, before the plan is built."""

    micro: int
    accumulation: int
    devices: int
    target: int
    seq_len: int | None
    in_tokens: bool
    max_micro: int
    dataset_size: int | None
    epochs: int | None

    @property
    def global_batch_size(self) -> int:
        return self.micro * self.accumulation * self.devices

    @property
    def achieved(self) -> int:
        """The global batch in the target's unit: tokens for a token target, else samples."""
        return self.global_batch_size * self.seq_len if self.in_tokens else self.global_batch_size

    @property
    def total_steps(self) -> int | None:
        per_epoch = steps_per_epoch(self.dataset_size, self.global_batch_size)
        return None if per_epoch is None or self.epochs is None else per_epoch * self.epochs


@dataclass(frozen=True)
class _Rate:
    """The learning rate and warmup a plan settles on, with the warnings that came with them."""

    learning_rate: float | None = None
    base_learning_rate: float | None = None
    base_batch_size: int | None = None
    warmup: str = "none"
    warmup_epochs: int | None = None
    warmup_steps: int | None = None
    warnings: tuple[str, ...] = ()


def _target_samples(target: BatchTarget) -> tuple[int, list[str]]:
    if not target.given:
        raise InputError("give exactly one target: global_batch_size (samples) or global_batch_tokens (with seq_len)")
    if target.global_batch_size is not None:
        return target.global_batch_size, []
    tokens, seq_len = target.global_batch_tokens, target.seq_len
    samples = max(1, round(tokens / seq_len))
    if samples * seq_len == tokens:
        return samples, []
    return samples, [f"{tokens} tokens is not a whole number of {seq_len}-token samples: aiming at {samples} samples"]


def _smaller_exact(micro: int, ceiling: int, per_device: int) -> list[str]:
    """Why the micro-batch is smaller than the one that fits, where it is (none when it is not).

    >>> _smaller_exact(8, 12, 64)
    ['the micro-batch is 8, not the 12 that fits: 8 is the largest that divides the 64 samples per device exactly (12 would need 5.33 accumulation steps)']
    """
    if micro == ceiling:
        return []
    return [
        f"the micro-batch is {micro}, not the {ceiling} that fits: {micro} is the largest that divides the "
        f"{per_device} samples per device exactly ({ceiling} would need {per_device / ceiling:.3g} accumulation steps)"
    ]


def _largest_divisor(count: int, ceiling: int) -> int:
    """The largest divisor of ``count`` that is at most ``ceiling``, from the divisor pairs up to its square root
    (a scan down from ``ceiling`` took 11 s for a prime count of 10**8).

    >>> _largest_divisor(64, 12), _largest_divisor(100_000_007, 10**8), _largest_divisor(36, 36)
    (8, 1, 36)
    """
    best = 1
    for low in range(1, math.isqrt(count) + 1):
        if count % low == 0:
            best = max([best, *(d for d in (low, count // low) if d <= ceiling)])
    return best


def _split_candidates(per_device: float, ceiling: int) -> list[tuple[int, int]]:
    """Each micro-batch ``m`` from ``ceiling`` down to half of it that could come closest to ``per_device`` samples,
    with its accumulation ``round(per_device / m)``. Where the micro-batches outnumber the accumulation counts in
    play, each count ``k`` names its best micro-batches (the two integers around ``per_device / k``, kept within
    the range: no other ``m`` with that count comes closer), so the list is at most about ``sqrt(2 * per_device)`` long, not
    ``ceiling / 2`` (a prime global batch of 10**8 once took 33 s here).

    >>> _split_candidates(10.5, 4) == [(m, round(10.5 / m)) for m in (4, 3, 2)]
    True
    >>> len(_split_candidates(100_000_007.0, 100_000_007)) < 10
    True
    """
    lowest = max(1, (ceiling + 1) // 2)
    if ceiling - lowest < max(1, int(per_device / lowest)) - int(per_device / ceiling):
        micros = range(ceiling, lowest - 1, -1)
    else:
        counts = range(max(1, int(per_device / ceiling)), int(per_device / lowest) + 2)
        near = (min(max(m, lowest), ceiling) for k in counts for m in (int(per_device // k), int(per_device // k) + 1))
        micros = sorted(set(near), reverse=True)
    return [(m, max(1, round(per_device / m))) for m in micros]


def _split(target: int, devices: int, largest_micro: int) -> tuple[int, int, list[str]]:
    """Micro-batch and accumulation for ``target`` samples on ``devices``: the largest exact
    micro-batch <= ``largest_micro``; when none is at least half of it, or the target does not
    divide by the devices, the closest achievable batch (micro-batches of at least half the
    largest), stated."""
    if target < devices:
        raise InputError(
            f"the global batch ({target} samples) is smaller than one sample per device ({devices} devices)"
        )
    per_device = target / devices
    smaller = (
        []
        if per_device >= largest_micro
        else [
            f"the target is {per_device:g} samples per device, fewer than the micro-batch of {largest_micro} that fits: "
            f"the micro-batch is {int(per_device)}"
        ]
    )
    ceiling = min(largest_micro, max(1, int(per_device)))
    if per_device == int(per_device):
        exact = _largest_divisor(int(per_device), ceiling)
        if exact * 2 >= ceiling:
            return exact, int(per_device) // exact, smaller + _smaller_exact(exact, ceiling, int(per_device))
    micro, accumulation = min(
        _split_candidates(per_device, ceiling), key=lambda c: (abs(c[0] * c[1] * devices - target), -c[0])
    )
    achieved = micro * accumulation * devices
    cause = (
        f"{target} samples do not split evenly over {devices} devices"
        if target % devices
        else f"no micro-batch between {(ceiling + 1) // 2} and {ceiling} splits {int(per_device)} samples per device exactly"
    )
    return (
        micro,
        accumulation,
        [
            f"the global batch is {achieved}, not the {target} asked for ({(achieved - target) / target:+.1%}): {cause}; "
            "change the target or the devices to make it exact"
        ],
    )


def plan_batch(
    *,
    micro_batch_size: int,
    global_batch_size: int | str | None = None,
    global_batch_tokens: int | None = None,
    seq_len: int | None = None,
    devices: int | None = None,
    noise_scale: Any = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    lr_scaling: str = "linear",
    warmup_epochs: int | None = None,
    warmup_steps: int | None = None,
    dataset_size: int | None = None,
    epochs: int | None = None,
    has_batchnorm: bool = False,
    fine_tuning: bool = False,
    goal: str | None = None,
    capacity_gib: float | None = None,
    weight_decay: float | None = None,
    worker_throughput: dict[str, float] | None = None,
    measured_optimal: bool = False,
    model_family: str | None = None,
    schedule_from: int | None = None,
    schedule_ramp: str = "linear",
    target: BatchTarget | None = None,
    lr: LearningRateConfig | None = None,
    run: TrainingRun | None = None,
    context: AdviceInputs | None = None,
) -> BatchPlan:
    """Plan micro-batch, accumulation, learning rate and warmup for a global batch.

    ``micro_batch_size`` is the largest that fits (measured or given); the plan never exceeds it
    and never changes the global batch silently. ``base_lr`` was tuned at ``base_batch_size``
    (samples, or tokens when the target is in tokens) and is scaled by ``lr_scaling``.
    ``model_family`` (``gpt2``, ``bert``, ``llama``, ``resnet50-imagenet``) supplies a typical
    target when none is given. ``schedule_from`` with ``epochs`` adds a batch-size ramp from that
    global batch up to the target, by accumulation steps (Smith et al. 2018, "Don't Decay the
    Learning Rate, Increase the Batch Size").
    ``global_batch_size="critical"`` with ``noise_scale`` (a ``NoiseScale`` from
    ``measure_noise_scale``, or B_simple as a number) plans the critical batch (McCandlish et al.
    2018); with any target, a noise scale adds the steps and samples the plan's batch costs
    relative to their minimum (``plan.critical``).

    The keywords come in four groups, each also accepted as one checked, frozen object (then leave
    that group's keywords out): ``target=BatchTarget(...)`` (global_batch_size,
    global_batch_tokens, seq_len, devices), ``lr=LearningRateConfig(...)`` (base_lr,
    base_batch_size, lr_scaling, warmup_epochs, warmup_steps), ``run=TrainingRun(...)``
    (dataset_size, epochs, schedule_from, schedule_ramp) and ``context=AdviceInputs(...)``
    (has_batchnorm, fine_tuning, goal, capacity_gib, weight_decay, model_family,
    worker_throughput, measured_optimal).

    >>> plan = plan_batch(micro_batch_size=16, global_batch_tokens=32768, seq_len=256)
    >>> plan.gradient_accumulation_steps, plan.global_batch_tokens
    (8, 32768)
    >>> plan_batch(micro_batch_size=16, target=BatchTarget(global_batch_tokens=32768, seq_len=256)) == plan
    True
    """
    positive_int("micro_batch_size", micro_batch_size, largest=LARGEST_SIZE)
    run = merge("run", run, TrainingRun(dataset_size, epochs, schedule_from, schedule_ramp))
    target = merge("target", target, BatchTarget(global_batch_size, global_batch_tokens, seq_len, devices))
    context = merge(
        "context",
        context,
        AdviceInputs(
            has_batchnorm,
            fine_tuning,
            goal,
            capacity_gib,
            weight_decay,
            model_family,
            worker_throughput,
            measured_optimal,
        ),
    )
    lr = merge("lr", lr, LearningRateConfig(base_lr, base_batch_size, lr_scaling, warmup_epochs, warmup_steps))
    return _build(micro_batch_size, target, lr, run, context, noise_scale)


def _build(
    micro_batch_size: int,
    target: BatchTarget,
    lr: LearningRateConfig,
    run: TrainingRun,
    context: AdviceInputs,
    noise_scale: Any,
) -> BatchPlan:
    """Every value of the plan, computed from the checked inputs, then the plan built once."""
    devices = world_size() if target.devices is None else target.devices
    target, lr = _with_family(target, lr, context.model_family)
    phi = noise_scale_value(noise_scale)
    samples, notes = _resolve_target(target, phi, micro_batch_size, devices)
    micro, accumulation, split_notes = _split(samples, devices, micro_batch_size)
    shape = _Shape(
        micro,
        accumulation,
        devices,
        samples,
        target.seq_len,
        target.global_batch_tokens is not None,
        micro_batch_size,
        run.dataset_size,
        run.epochs,
    )
    rate = _learning_rate(lr, shape)
    critical = tradeoff_at(phi, shape.global_batch_size) if phi is not None else None
    calibration = context.worker_throughput
    return BatchPlan(
        micro,
        accumulation,
        devices,
        samples,
        target.seq_len,
        learning_rate=rate.learning_rate,
        base_learning_rate=rate.base_learning_rate,
        base_batch_size=rate.base_batch_size,
        lr_scaling=lr.lr_scaling,
        warmup_epochs=rate.warmup_epochs,
        warmup_steps=rate.warmup_steps,
        warmup=rate.warmup,
        dataset_size=run.dataset_size,
        epochs=run.epochs,
        max_micro_batch_size=micro_batch_size,
        warnings=notes + split_notes + list(rate.warnings) + _warnings(shape, context),
        advice=([tradeoff_advice(critical)] if critical else []) + _advice(shape, context, rate.base_batch_size),
        hardware_calibration=(
            workload_distribution(dict(calibration), shape.global_batch_size) if calibration is not None else None
        ),
        schedule=_schedule(shape, run, lr),
        target_in_tokens=shape.in_tokens,
        critical=critical,
    )


def _with_family(
    target: BatchTarget, lr: LearningRateConfig, model_family: str | None
) -> tuple[BatchTarget, LearningRateConfig]:
    """A model family's typical target (and its learning rate, where known) when no target is given."""
    if model_family is None or target.given:
        return target, lr
    family = reference(model_family)
    if family["unit"] == "tokens":
        return dataclasses.replace(target, global_batch_tokens=int(family["global_batch"])), lr
    target = dataclasses.replace(target, global_batch_size=int(family["global_batch"]))
    if lr.base_lr is None and lr.base_batch_size is None and "learning_rate" in family:
        lr = dataclasses.replace(
            lr, base_lr=float(family["learning_rate"]), base_batch_size=int(family["global_batch"])
        )
    return target, lr


def _resolve_target(
    target: BatchTarget, phi: float | None, micro_batch_size: int, devices: int
) -> tuple[int, list[str]]:
    """The target in samples, with notes; ``"critical"`` becomes the batch nearest the noise scale."""
    if target.global_batch_size != "critical":
        return _target_samples(target)
    if phi is None:
        raise InputError("global_batch_size='critical' needs noise_scale: measure_noise_scale(...) or B_simple")
    samples, critical_notes = critical_target(phi, micro_batch_size, devices)
    return samples, critical_notes


def _schedule(shape: _Shape, run: TrainingRun, lr: LearningRateConfig) -> list[Stage] | None:
    if run.schedule_from is None:
        return None
    return batch_schedule(
        run.schedule_from,
        shape.global_batch_size,
        run.epochs,
        micro_batch_size=shape.micro,
        devices=shape.devices,
        ramp=run.schedule_ramp,
        base_lr=lr.base_lr,
        base_batch_size=lr.base_batch_size,
        lr_scaling=lr.lr_scaling,
        unit=shape.seq_len if shape.in_tokens else 1,
    )


def _learning_rate(lr: LearningRateConfig, shape: _Shape) -> _Rate:
    """The scaled learning rate (with ``base_lr``), the warmup it calls for, and warmup in steps."""
    if lr.base_lr is None:
        rate = _Rate(warmup_epochs=lr.warmup_epochs, warmup_steps=lr.warmup_steps)
        return dataclasses.replace(rate, warmup_steps=_warmup_steps(rate, shape))
    scale = shape.achieved / lr.base_batch_size
    need = warmup_need(scale)
    warmup_epochs, warnings = _warmup_epochs(lr, scale, shape.epochs)
    if lr.lr_scaling == "none" and scale >= 2:
        warnings.append(
            f"the learning rate is not scaled although the batch is {scale:g}x the tuned one "
            "(Goyal et al. 2017 scale it linearly with the batch)"
        )
    if need in ("required", "critical") and warmup_epochs == 0:
        warnings.append(
            f"warmup is {need} at {scale:g}x the tuned batch (a large batch diverges early without it; "
            "Goyal et al. 2017), but none is planned"
        )
    rate = _Rate(
        scale_learning_rate(lr.base_lr, scale, lr.lr_scaling),
        lr.base_lr,
        lr.base_batch_size,
        need,
        warmup_epochs,
        lr.warmup_steps,
        tuple(warnings),
    )
    return dataclasses.replace(rate, warmup_steps=_warmup_steps(rate, shape))


def _warmup_epochs(lr: LearningRateConfig, scale: float, epochs: int | None) -> tuple[int | None, list[str]]:
    """The warmup epochs given, or (when no warmup is given) suggested from the scale and cut to fit the run."""
    if lr.warmup_epochs is not None or lr.warmup_steps is not None:
        return lr.warmup_epochs, []
    suggested = suggested_warmup_epochs(scale)
    if epochs is None or suggested < epochs:
        return suggested, []
    return epochs - 1, [
        f"the suggested {suggested} warmup epochs do not fit a {epochs}-epoch run: "
        f"warming up over {epochs - 1} instead; consider a smaller batch"
    ]


def _warmup_steps(rate: _Rate, shape: _Shape) -> int | None:
    """Warmup epochs in optimizer steps, once steps per epoch are known (with or without an LR)."""
    steps = rate.warmup_steps
    per_epoch = steps_per_epoch(shape.dataset_size, shape.global_batch_size)
    if steps is None and rate.warmup_epochs is not None and per_epoch is not None:
        steps = rate.warmup_epochs * per_epoch
    total = shape.total_steps
    if steps is not None and total is not None and steps > total:
        raise InputError(f"warmup ({steps} steps) is longer than the run ({total} steps): shorten it")
    return steps


def _warnings(shape: _Shape, context: AdviceInputs) -> list[str]:
    warnings = []
    steps, global_batch = shape.accumulation, shape.global_batch_size
    if steps > 16:
        warnings.append(
            f"{steps} accumulation steps: every optimizer step runs {steps} micro-batches in sequence; "
            "more devices would be faster"
        )
    if steps > 64:
        warnings.append(f"{steps} accumulation steps is outside the 2-64 range that is typical")
    if context.has_batchnorm and steps > 1:
        warnings.append(
            f"BatchNorm with accumulation: statistics come from each micro-batch of {shape.micro}, "
            "not the global batch; use SyncBatchNorm, GroupNorm or LayerNorm"
        )
    if context.fine_tuning and global_batch > 64:
        warnings.append(
            f"a global batch of {global_batch} for fine-tuning: 16-32 is usual, with a learning rate "
            "10-100x below pre-training"
        )
    if context.goal == "accuracy" and global_batch > 256:
        warnings.append(
            f"goal 'accuracy' with a global batch of {global_batch}: 32-128 usually generalises better "
            "(Keskar et al. 2017); validate accuracy"
        )
    if shape.micro == shape.max_micro and not context.measured_optimal and steps == 1:
        warnings.append(
            '"just use the maximum that fits" is a red flag: the largest batch is rarely the fastest to '
            "a given accuracy; measure throughput (batchfit optimal) and validate accuracy"
        )
    return warnings


def _advice(shape: _Shape, context: AdviceInputs, base_batch_size: int | None) -> list[str]:
    advice = []
    if context.capacity_gib is not None:
        low, high = starting_range(context.capacity_gib)
        advice.append(
            f"with {context.capacity_gib:g} GiB of device memory, a search usually starts at a batch of {low}-{high}"
        )
    if context.goal == "speed":
        advice.append("goal 'speed': a larger batch (256-1024) with LR scaling and warmup; validate accuracy")
    elif context.goal == "memory":
        advice.append(
            "goal 'memory': keep the micro-batch small and reach the global batch by accumulation; "
            "AMP and checkpointing help"
        )
    if context.fine_tuning:
        advice.append(
            "fine-tuning: a small batch (16-32) and a learning rate 10-100x below pre-training preserve what was learned"
        )
    if base_batch_size:
        advice += regularization_advice(shape.achieved / base_batch_size, context.weight_decay)
    return advice
