"""BatchPlan: micro-batch, accumulation, devices, learning rate and warmup for a global batch.

Pure arithmetic (seed 003: total = micro x seq_len x accumulation x devices); torch is imported
only to read the world size or to build an LR scheduler, and only when asked.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.planning.advice import Stage
from batchfit.planning.advice import batch_schedule
from batchfit.planning.advice import reference
from batchfit.planning.advice import regularization_advice
from batchfit.planning.advice import starting_range
from batchfit.planning.advice import workload_distribution
from batchfit.planning.lr import LR_RULES
from batchfit.planning.lr import scale_learning_rate
from batchfit.planning.lr import suggested_warmup_epochs
from batchfit.planning.lr import warmup_cosine
from batchfit.planning.lr import warmup_need
from batchfit.planning.noise import critical_target
from batchfit.planning.noise import noise_scale_value
from batchfit.planning.noise import tradeoff_advice
from batchfit.planning.noise import tradeoff_at

GOALS = ("accuracy", "speed", "memory")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _optional_positive_int(name: str, value: Any) -> None:
    if value is not None:
        _positive_int(name, value)


def world_size() -> int:
    """Devices from ``torch.distributed`` when it is initialised, else 1."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass
class BatchPlan:
    """How to reach a global batch. Fields given in ``plan_batch``'s terms; the rest derived.

    ``global_batch_size`` is what one optimizer step really sees, in samples:
    ``micro_batch_size * gradient_accumulation_steps * devices``. ``target_samples`` is what was
    asked for; ``deviation`` is their relative difference (0 when ``exact``).
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
            _positive_int(name, getattr(self, name))
        if self.lr_scaling not in LR_RULES:
            raise ValueError(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}")

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
        return None if self.dataset_size is None else math.ceil(self.dataset_size / self.global_batch_size)

    @property
    def total_steps(self) -> int | None:
        per_epoch = self.steps_per_epoch
        return None if per_epoch is None or self.epochs is None else per_epoch * self.epochs

    def lr_lambda(self, schedule: str = "cosine"):
        """The LR multiplier per optimizer step: linear warmup, then cosine decay or constant."""
        if self.total_steps is None:
            raise ValueError("the LR schedule needs dataset_size and epochs in plan_batch")
        return warmup_cosine(self.warmup_steps or 0, self.total_steps, schedule)

    def lr_scheduler(self, optimizer: Any, schedule: str = "cosine") -> Any:
        """A ``torch.optim.lr_scheduler.LambdaLR``; set the optimizer's lr to ``learning_rate`` first."""
        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, self.lr_lambda(schedule))

    def to_dict(self) -> dict[str, Any]:
        """Seed 004's ``batch_configuration`` (per_gpu_batch_size, total_batch_size, ...) and more."""
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


def _target_samples(
    global_batch_size: int | None, global_batch_tokens: int | None, seq_len: int | None
) -> tuple[int, list[str]]:
    if (global_batch_size is None) == (global_batch_tokens is None):
        raise ValueError("give exactly one target: global_batch_size (samples) or global_batch_tokens (with seq_len)")
    if global_batch_size is not None:
        _positive_int("global_batch_size", global_batch_size)
        return global_batch_size, []
    _positive_int("global_batch_tokens", global_batch_tokens)
    if seq_len is None:
        raise ValueError(
            "global_batch_tokens needs seq_len (tokens per sample): total = micro x seq_len x accumulation x devices"
        )
    _positive_int("seq_len", seq_len)
    samples = max(1, round(global_batch_tokens / seq_len))
    notes = (
        []
        if samples * seq_len == global_batch_tokens
        else [
            f"{global_batch_tokens} tokens is not a whole number of {seq_len}-token samples: aiming at {samples} samples"
        ]
    )
    return samples, notes


def _split(target: int, devices: int, largest_micro: int) -> tuple[int, int, list[str]]:
    """Micro-batch and accumulation for ``target`` samples on ``devices``: the largest exact
    micro-batch <= ``largest_micro``; when none is at least half of it, or the target does not
    divide by the devices, the closest achievable batch (micro-batches of at least half the
    largest), stated."""
    if target < devices:
        raise ValueError(
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
        exact = next(m for m in range(ceiling, 0, -1) if int(per_device) % m == 0)
        if exact * 2 >= ceiling:
            return exact, int(per_device) // exact, smaller
    candidates = [(m, max(1, round(per_device / m))) for m in range(ceiling, (ceiling + 1) // 2 - 1, -1) if m >= 1]
    micro, accumulation = min(candidates, key=lambda c: (abs(c[0] * c[1] * devices - target), -c[0]))
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
) -> BatchPlan:
    """Plan micro-batch, accumulation, learning rate and warmup for a global batch.

    ``micro_batch_size`` is the largest that fits (measured or given); the plan never exceeds it
    and never changes the global batch silently. ``base_lr`` was tuned at ``base_batch_size``
    (samples, or tokens when the target is in tokens) and is scaled by ``lr_scaling``.
    ``model_family`` (``gpt2``, ``bert``, ``llama``, ``resnet50-imagenet``) supplies a typical
    target when none is given. ``schedule_from`` with ``epochs`` adds a batch-size ramp from that
    global batch up to the target (seed 001 pattern 7), by accumulation steps.
    ``global_batch_size="critical"`` with ``noise_scale`` (a ``NoiseScale`` from
    ``measure_noise_scale``, or B_simple as a number) plans the critical batch (McCandlish et al.
    2018); with any target, a noise scale adds the steps and samples the plan's batch costs
    relative to their minimum (``plan.critical``).

    >>> plan = plan_batch(micro_batch_size=16, global_batch_tokens=32768, seq_len=256)
    >>> plan.gradient_accumulation_steps, plan.global_batch_tokens
    (8, 32768)
    """
    _positive_int("micro_batch_size", micro_batch_size)
    _optional_positive_int("dataset_size", dataset_size)
    _optional_positive_int("epochs", epochs)
    devices = world_size() if devices is None else devices
    _positive_int("devices", devices)
    if goal is not None and goal not in GOALS:
        raise ValueError(f"goal must be one of {', '.join(GOALS)}, got {goal!r}")
    if model_family is not None and global_batch_size is None and global_batch_tokens is None:
        family = reference(model_family)
        if family["unit"] == "tokens":
            global_batch_tokens = int(family["global_batch"])
        else:
            global_batch_size = int(family["global_batch"])
            if base_lr is None and base_batch_size is None and "learning_rate" in family:
                base_lr, base_batch_size = float(family["learning_rate"]), int(family["global_batch"])
    phi = noise_scale_value(noise_scale)
    critical_notes: list[str] = []
    if global_batch_size == "critical":
        if phi is None:
            raise ValueError("global_batch_size='critical' needs noise_scale: measure_noise_scale(...) or B_simple")
        global_batch_size, critical_notes = critical_target(phi, micro_batch_size, devices)
    target, notes = _target_samples(global_batch_size, global_batch_tokens, seq_len)
    notes += critical_notes
    micro, accumulation, split_notes = _split(target, devices, micro_batch_size)
    plan = BatchPlan(
        micro,
        accumulation,
        devices,
        target,
        seq_len,
        lr_scaling=lr_scaling,
        dataset_size=dataset_size,
        epochs=epochs,
        max_micro_batch_size=micro_batch_size,
        warnings=notes + split_notes,
        target_in_tokens=global_batch_tokens is not None,
    )
    _learning_rate(plan, base_lr, base_batch_size, global_batch_tokens is not None, warmup_epochs, warmup_steps)
    if phi is not None:
        plan.critical = tradeoff_at(phi, plan.global_batch_size)
        plan.advice.append(tradeoff_advice(plan.critical))
    plan.warnings += _warnings(plan, has_batchnorm, fine_tuning, goal, measured_optimal)
    plan.advice += _advice(plan, goal, fine_tuning, capacity_gib, weight_decay)
    if worker_throughput is not None:
        plan.hardware_calibration = workload_distribution(worker_throughput, plan.global_batch_size)
    if schedule_from is not None:
        if epochs is None:
            raise ValueError(
                "a batch-size schedule needs epochs: the ramp runs from schedule_from to the target over them"
            )
        plan.schedule = batch_schedule(
            schedule_from,
            plan.global_batch_size,
            epochs,
            micro_batch_size=plan.micro_batch_size,
            devices=devices,
            ramp=schedule_ramp,
            base_lr=base_lr,
            base_batch_size=base_batch_size,
            lr_scaling=lr_scaling,
            unit=seq_len if plan.target_in_tokens else 1,
        )
    return plan


def _learning_rate(
    plan: BatchPlan,
    base_lr: float | None,
    base_batch_size: int | None,
    in_tokens: bool,
    warmup_epochs: int | None,
    warmup_steps: int | None,
) -> None:
    valid_lr = (
        isinstance(base_lr, (int, float)) and not isinstance(base_lr, bool) and math.isfinite(base_lr) and base_lr > 0
    )
    if base_lr is not None and not valid_lr:
        raise ValueError(f"base_lr must be a positive, finite number, got {base_lr!r}")
    if (base_lr is None) != (base_batch_size is None):
        raise ValueError("give base_lr and base_batch_size together: the learning rate and the batch it was tuned at")
    if (warmup_epochs is not None and warmup_epochs < 0) or (warmup_steps is not None and warmup_steps < 0):
        raise ValueError("warmup_epochs and warmup_steps cannot be negative")
    plan.warmup_epochs, plan.warmup_steps = warmup_epochs, warmup_steps
    if base_lr is not None:
        _scale(plan, base_lr, base_batch_size, in_tokens, suggest=warmup_epochs is None and warmup_steps is None)
    _warmup_steps(plan)


def _scale(plan: BatchPlan, base_lr: float, base_batch_size: int, in_tokens: bool, suggest: bool) -> None:
    _positive_int("base_batch_size", base_batch_size)
    achieved = plan.global_batch_tokens if in_tokens else plan.global_batch_size
    scale = achieved / base_batch_size
    plan.base_learning_rate, plan.base_batch_size = base_lr, base_batch_size
    plan.learning_rate = scale_learning_rate(base_lr, scale, plan.lr_scaling)
    plan.warmup = warmup_need(scale)
    if suggest:
        plan.warmup_epochs = suggested_warmup_epochs(scale)
        if plan.epochs is not None and plan.warmup_epochs >= plan.epochs:
            plan.warnings.append(
                f"the suggested {plan.warmup_epochs} warmup epochs do not fit a {plan.epochs}-epoch run: "
                f"warming up over {plan.epochs - 1} instead; consider a smaller batch"
            )
            plan.warmup_epochs = plan.epochs - 1
    if plan.lr_scaling == "none" and scale >= 2:
        plan.warnings.append(
            f"the learning rate is not scaled although the batch is {scale:g}x the tuned one (seed 001)"
        )
    if plan.warmup in ("required", "critical") and plan.warmup_epochs == 0:
        plan.warnings.append(f"warmup is {plan.warmup} at {scale:g}x the tuned batch (seed 001), but none is planned")


def _warmup_steps(plan: BatchPlan) -> None:
    """Warmup epochs in optimizer steps, once steps per epoch are known (with or without an LR)."""
    if plan.warmup_steps is None and plan.warmup_epochs is not None and plan.steps_per_epoch is not None:
        plan.warmup_steps = plan.warmup_epochs * plan.steps_per_epoch
    if plan.warmup_steps is not None and plan.total_steps is not None and plan.warmup_steps > plan.total_steps:
        raise ValueError(
            f"warmup ({plan.warmup_steps} steps) is longer than the run ({plan.total_steps} steps): shorten it"
        )


def _warnings(
    plan: BatchPlan, has_batchnorm: bool, fine_tuning: bool, goal: str | None, measured_optimal: bool
) -> list[str]:
    warnings = []
    steps = plan.gradient_accumulation_steps
    if steps > 16:
        warnings.append(
            f"{steps} accumulation steps: every optimizer step runs {steps} micro-batches in sequence (seed 001); more devices would be faster"
        )
    if steps > 64:
        warnings.append(f"{steps} accumulation steps is outside the 2-64 range seed 003 calls typical")
    if has_batchnorm and steps > 1:
        warnings.append(
            f"BatchNorm with accumulation: statistics come from each micro-batch of {plan.micro_batch_size}, "
            "not the global batch; use SyncBatchNorm, GroupNorm or LayerNorm"
        )
    if fine_tuning and plan.global_batch_size > 64:
        warnings.append(
            f"a global batch of {plan.global_batch_size} for fine-tuning: seed 001 suggests 16-32 and a learning rate 10-100x below pre-training"
        )
    if goal == "accuracy" and plan.global_batch_size > 256:
        warnings.append(
            f"goal 'accuracy' with a global batch of {plan.global_batch_size}: seed 001 suggests 32-128 and validating accuracy"
        )
    if plan.micro_batch_size == plan.max_micro_batch_size and not measured_optimal and steps == 1:
        warnings.append(
            '"just use the maximum that fits" is a red flag in seed 001: measure throughput (batchfit optimal) and validate accuracy'
        )
    return warnings


def _advice(
    plan: BatchPlan, goal: str | None, fine_tuning: bool, capacity_gib: float | None, weight_decay: float | None
) -> list[str]:
    advice = []
    if capacity_gib is not None:
        low, high = starting_range(capacity_gib)
        advice.append(f"with {capacity_gib:g} GiB, seed 001's decision tree starts at a batch of {low}-{high}")
    if goal == "speed":
        advice.append(
            "goal 'speed': a larger batch (256-1024) with LR scaling and warmup; validate accuracy (seed 001)"
        )
    elif goal == "memory":
        advice.append(
            "goal 'memory': keep the micro-batch small and reach the global batch by accumulation; AMP and checkpointing help (seed 001)"
        )
    if fine_tuning:
        advice.append(
            "fine-tuning: a small batch (16-32) and a learning rate 10-100x below pre-training preserve what was learned (seed 001)"
        )
    if plan.base_batch_size:
        achieved = plan.global_batch_tokens if plan.target_in_tokens else plan.global_batch_size
        advice += regularization_advice(achieved / plan.base_batch_size, weight_decay)
    return advice
