"""Hugging Face Transformers: fit a ``Trainer``'s batch sizes and keep its global batch.

transformers' ``auto_find_batch_size`` halves ``per_device_train_batch_size`` after an OOM, which
changes the global batch (per-device x accumulation x world size) silently, and never tunes
evaluation. Here the largest per-device micro-batch is measured on the Trainer's own step (its
``compute_loss``, ``create_optimizer`` and AMP), ``plan_batch`` splits the global batch into
micro-batch x accumulation x devices, and an eval-mode search sets the eval batch size.

>>> from batchfit.integrations.transformers import fit_trainer
>>> fit = fit_trainer(trainer, global_batch_size=256)   # doctest: +SKIP
>>> trainer.train()   # logs the plan when training begins   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import torch

try:
    from accelerate.utils import convert_outputs_to_fp32
    from transformers import Trainer
    from transformers import TrainerCallback
    from transformers import TrainingArguments
except ImportError as error:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError(
        "batchfit's Transformers integration needs transformers and accelerate: pip install 'batchfit[transformers]'"
    ) from error

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.integrations.result import LOOP_HEADROOM
from batchfit.integrations.result import FitResult
from batchfit.integrations.result import deprecated_alias
from batchfit.integrations.result import search_and_plan
from batchfit.planning.plan import BatchPlan
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.step.batching import batch_ceiling
from batchfit.step.batching import pad_sequences
from batchfit.step.state import StateSnapshot
from batchfit.step.state import restore_rng
from batchfit.step.state import save_rng
from batchfit.step.workload import Workload
from batchfit.step.workload import hold_gradients

__all__ = [
    "BatchFitCallback",
    "TrainerFit",
    "data_parallel_size",
    "fit_trainer",
    "fit_training_args",
    "train_workload",
    "training_amp_dtype",
]

logger = logging.getLogger("batchfit")

SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size")


@dataclasses.dataclass(frozen=True)
class TrainerFit(FitResult):
    """What ``fit_trainer`` found and set on ``TrainingArguments``: a ``FitResult`` (the same fields
    as the Lightning integration's).

    ``micro_batch_size`` went to ``per_device_train_batch_size``, ``gradient_accumulation_steps``
    to the field of that name and ``eval_batch_size`` (``None`` without an eval dataset) to
    ``per_device_eval_batch_size``; ``settings()`` names them as ``TrainingArguments`` does and
    ``previous`` holds the three as they were. ``search`` found the micro-batch the plan uses: it
    is ``one_step_search`` when the plan does not accumulate, else a search of an accumulation
    micro-step (the window's gradients alive during the forward pass), which is smaller. The old names ``per_device_train_batch_size``, ``per_device_eval_batch_size`` and
    ``train_search`` still read, with a ``DeprecationWarning``, for one release.
    """

    note: str | None = None
    """Why ``micro_batch_size`` is below a micro-batch that fits or may fit, and which argument gives
    the larger one (``None`` when it is the largest that fits); ``summary()`` ends with it and
    ``fit_trainer`` logs it as a warning."""

    per_device_train_batch_size = deprecated_alias("per_device_train_batch_size", "micro_batch_size")
    per_device_eval_batch_size = deprecated_alias("per_device_eval_batch_size", "eval_batch_size")
    train_search = deprecated_alias("train_search", "search")

    def summary(self) -> str:
        """``FitResult.summary()``, then the ``note`` when there is one."""
        text = super().summary()
        return text if self.note is None else f"{text}; {self.note}"

    def to_dict(self) -> dict[str, Any]:
        """``FitResult.to_dict()`` with the ``note``."""
        return {**super().to_dict(), "note": self.note}

    def differences(self, args: TrainingArguments) -> dict[str, tuple[int, int]]:
        """``{field: (planned, actual)}`` for each setting ``args`` no longer matches."""
        return {
            name: (value, getattr(args, name))
            for name, value in self.settings().items()
            if getattr(args, name) != value
        }


# -- the Trainer's step as a Workload --------------------------------------------------------------


def training_amp_dtype(args: TrainingArguments) -> torch.dtype | None:
    """The autocast dtype the Trainer trains with: ``bf16`` -> bfloat16, ``fp16`` -> float16, else None.

    >>> training_amp_dtype(TrainingArguments(output_dir="out", bf16=True, use_cpu=True))
    torch.bfloat16
    """
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(args, "fp16", False) else None


def data_parallel_size(trainer: Trainer) -> int:
    """Micro-batches one optimizer step sums, as in ``Trainer.get_total_train_batch_size``: processes
    (a tensor/context/sequence-parallel group counts once) x DataParallel GPUs."""
    processes = trainer.args.world_size
    for parallel in ("get_tp_size", "get_cp_size", "get_sp_size"):
        if hasattr(trainer, parallel):
            processes //= getattr(trainer, parallel)()
    return max(1, processes) * max(1, trainer.args.n_gpu)


def _first_batch(loader: Any, what: str) -> Any:
    """One collated batch; the iterator is closed and an accelerate loader told it ended (else it
    stays registered as the active loader in accelerate's gradient state)."""
    iterator = iter(loader)
    try:
        return next(iterator)
    except StopIteration:
        raise InputError(
            f"the {what} dataloader yields no batch: give the Trainer a non-empty {what} dataset"
        ) from None
    finally:
        for cleanup in (getattr(iterator, "close", None), getattr(loader, "end", None)):
            if callable(cleanup):
                cleanup()


@contextlib.contextmanager
def _outputs_in_fp32(trainer: Trainer, model: torch.nn.Module) -> Iterator[None]:
    """The forward as the Trainer runs it under native AMP: accelerate's ``prepare_model`` makes the
    outputs' half-precision tensors (the logits) fp32 copies."""
    if not getattr(trainer.accelerator, "native_amp", False) or "forward" in model.__dict__:  # no AMP, or prepared
        yield
        return
    model.forward = convert_outputs_to_fp32(model.forward)
    try:
        yield
    finally:
        del model.forward


def _loss_step(trainer: Trainer):
    """The loss as ``Trainer.training_step`` computes it (train mode, ``compute_loss``)."""

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        model.train()
        with _outputs_in_fp32(trainer, model), trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, dict(batch))  # a copy: compute_loss may pop "labels"

    return step


def _eval_step(trainer: Trainer):
    """An eval forward as ``Trainer.prediction_step`` runs it: loss and outputs when labels are given."""

    def step(model: torch.nn.Module, batch: Any) -> Any:
        inputs = dict(batch)
        labelled = bool(trainer.label_names) and all(inputs.get(name) is not None for name in trainer.label_names)
        with _outputs_in_fp32(trainer, model), trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, inputs, return_outputs=True) if labelled else model(**inputs)

    return step


def train_workload(trainer: Trainer, *, longest_seq_len: int | None = None) -> Workload:
    """The Trainer's train step as a batchfit ``Workload`` (for ``search``, ``estimate_memory``,
    ``find_optimal_batch_size``): its model, a batch from ``get_train_dataloader()``, its optimizer
    (``trainer.optimizer``, else the one ``create_optimizer()`` builds, taken off the trainer
    again), its ``compute_loss`` and AMP dtype.

    >>> batchfit.search_workload(train_workload(trainer), device="sim:16GiB").batch_size   # doctest: +SKIP
    48
    """
    batch = _first_batch(trainer.get_train_dataloader(), "train")
    if longest_seq_len is not None:
        batch = pad_sequences(batch, longest_seq_len)
    optimizer = trainer.optimizer
    if optimizer is None:
        optimizer = trainer.create_optimizer()  # what train() builds: subclasses, decay groups, args.optim
        trainer.optimizer = None
    return Workload(
        trainer.model,
        batch,
        optimizer=optimizer,
        amp_dtype=training_amp_dtype(trainer.args),
        step_fn=_loss_step(trainer),
        name=type(trainer.model).__name__,
        keep_output=False,  # the Trainer's own step, exactly as before
    )


def _eval_workload(
    trainer: Trainer, name: str | None, optimizer: torch.optim.Optimizer, longest_seq_len: int | None
) -> Workload:
    batch = _first_batch(trainer.get_eval_dataloader(name), "eval")
    if longest_seq_len is not None:
        batch = pad_sequences(batch, longest_seq_len)
    return Workload(
        trainer.model,
        batch,
        optimizer=optimizer,
        amp_dtype=training_amp_dtype(trainer.args),
        mode="eval",
        step_fn=_eval_step(trainer),
        name=type(trainer.model).__name__,
        keep_output=False,  # the Trainer's own step, exactly as before
    )


@contextlib.contextmanager
def _optimizer_state_made(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, ``optimizer`` holds the state it has in training (one step on zero gradients makes
    it): evaluation during and after ``train()`` runs with it alive. Afterwards the model, the
    optimizer and the RNG states are as before, bitwise."""
    snapshot = StateSnapshot.take(model, optimizer)
    try:
        model.zero_grad(set_to_none=True)
        hold_gradients(model)  # zero gradients: one step makes the optimizer's state
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield
    finally:
        snapshot.restore()


# -- the fit ---------------------------------------------------------------------------------------


def _check(trainer: Any, global_batch_size: Any, max_batch_size: Any) -> None:
    if not isinstance(trainer, Trainer):
        raise InputTypeError(
            f"fit_trainer needs a transformers.Trainer, got {type(trainer).__name__}: "
            "for a model, TrainingArguments and a dataset use fit_training_args"
        )
    for name, value, meaning in (
        (
            "global_batch_size",
            global_batch_size,
            "samples per optimizer step over all devices, or None to keep the trainer's",
        ),
        ("max_batch_size", max_batch_size, "the largest per-device batch to try, or None"),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name} must be a positive integer ({meaning}), got {value!r}")
    if trainer.train_dataset is None:
        raise InputError("the trainer has no train_dataset to take a batch from: pass Trainer(train_dataset=...)")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise NotImplementedError(
            "DeepSpeed fixes the batch sizes in its config when the Trainer is built: set "
            "train_micro_batch_size_per_gpu and gradient_accumulation_steps there from batchfit.plan_batch"
        )


@contextlib.contextmanager
def _trainer_left_as_found(trainer: Trainer) -> Iterator[None]:
    """Put back what probing touches besides the model (the Prober restores that): the RNG states
    a sampler draws from, ``trainer.optimizer``, and loaders cached for persistent workers."""
    rng, optimizer, cached = save_rng(), trainer.optimizer, trainer.__dict__.get("_eval_dataloaders")
    saved = dict(cached) if cached is not None else None
    try:
        yield
    finally:
        restore_rng(rng)
        trainer.optimizer = optimizer
        trainer.__dict__.pop("_eval_dataloaders", None)
        if saved is not None:
            trainer._eval_dataloaders = saved


def _eval_search(
    trainer: Trainer,
    optimizer: torch.optim.Optimizer,
    devices: int,
    settings: SearchSettings,
    device: DeviceSpec,
    longest_seq_len: int | None,
) -> SearchResult:
    """The eval-mode search (of each eval dataset of a dict: the smallest answer), with the
    optimizer's training state held; no larger than a device's share of the eval set."""
    names = list(trainer.eval_dataset) if isinstance(trainer.eval_dataset, Mapping) else [None]
    results = []
    with _optimizer_state_made(trainer.model, optimizer):
        for name in names:
            dataset = trainer.eval_dataset if name is None else trainer.eval_dataset[name]
            workload = _eval_workload(trainer, name, optimizer, longest_seq_len)
            ceiling = batch_ceiling(dataset, devices, settings.max_batch_size)
            results.append(search_workload(workload, settings.replace(max_batch_size=ceiling), device=device))
    return min(results, key=lambda result: result.batch_size)


def _apply(trainer: Trainer, fit: TrainerFit) -> None:
    """``fit``'s settings on ``trainer.args`` (plain assignment, as transformers does itself) and on
    what the Trainer cached from them: ``_train_batch_size``, eval loaders of persistent workers."""
    args = trainer.args
    for name, value in fit.settings().items():
        setattr(args, name, value)
    if hasattr(trainer, "_train_batch_size"):
        trainer._train_batch_size = args.train_batch_size  # get_train_dataloader reads it; __init__ cached it
    trainer.__dict__.pop("_eval_dataloaders", None)
    if args.auto_find_batch_size:
        logger.warning(
            "batchfit: auto_find_batch_size=True halves per_device_train_batch_size after an OOM "
            "without raising gradient_accumulation_steps, which changes the global batch: set it to False"
        )


def _trainer_fit(
    args: TrainingArguments,
    plan: BatchPlan,
    found: SearchResult,
    one_step: SearchResult,
    evaluated: SearchResult | None,
    note: str | None = None,
) -> TrainerFit:
    """The fit: the plan's split and the eval batch, under ``TrainingArguments``' names too."""
    split = (plan.micro_batch_size, plan.gradient_accumulation_steps)
    applied = dict(zip(SETTINGS[:2], split, strict=True))
    if evaluated is not None:
        applied[SETTINGS[2]] = evaluated.batch_size
    previous = {name: getattr(args, name) for name in SETTINGS}
    return TrainerFit(
        *split, plan.devices, found, one_step, evaluated, plan, applied=applied, previous=previous, note=note
    )


def _why_not_larger(
    args: TrainingArguments,
    plan: BatchPlan,
    found: SearchResult,
    one_step: SearchResult,
    *,
    share: int,
    user_cap: int | None,
    asked: bool,
) -> str | None:
    """Why the micro-batch set is below one that fits (or may fit), and which argument gives the
    larger one; ``None`` when it is the largest that fits, or ``max_batch_size`` kept it lower.

    Two causes: the search stops at a device's share of the global batch, so a small global batch
    (the trainer's own, by default) hides larger micro-batches; and the micro-batch must divide a
    device's share exactly, so the largest that fits may not be the one set.
    """
    devices = plan.devices
    device_word = "device" if devices == 1 else "devices"
    if one_step.batch_size >= share and (user_cap is None or user_cap > share):
        whose = (
            f"global_batch_size={plan.target_samples}"
            if asked
            else f"the trainer's global batch of {plan.target_samples} (per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps {args.gradient_accumulation_steps}"
            f" x {devices} {device_word})"
        )
        return (
            f"the search stopped at {share}, each device's share of {whose}, so a larger micro-batch may fit: "
            "pass fit_trainer a larger global_batch_size (samples per optimizer step) to search further"
        )
    largest, micro = found.batch_size, plan.micro_batch_size
    if not plan.exact or micro >= largest:
        return None  # an inexact split already warned, naming its closest global batch
    per_rank = largest * devices
    steps = plan.target_samples // per_rank
    choices = [(k * per_rank, k) for k in (steps, steps + 1) if k >= 1]
    suggested = " or ".join(f"{total} ({largest} x {k} x {devices})" for total, k in choices)
    return (
        f"the micro-batch is {micro}, not the {largest} that fits, because {largest} does not divide the "
        f"{plan.target_samples // devices} samples per device exactly ({micro} x {plan.gradient_accumulation_steps} "
        f"accumulation steps does); for micro-batches of {largest}, pass fit_trainer global_batch_size={suggested}"
    )


def fit_trainer(
    trainer: Trainer,
    *,
    global_batch_size: int | None = None,
    device: DeviceSpec = None,
    margin: int | float | str = LOOP_HEADROOM,
    max_batch_size: int | None = None,
    longest_seq_len: int | None = None,
    fit_eval: bool = True,
    allow_inexact: bool = False,
    log_plan: bool = True,
    **search_options: Any,
) -> TrainerFit:
    """Set ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` from the largest
    per-device micro-batch that fits, keeping the global batch, and ``per_device_eval_batch_size``
    from an eval-mode search.

    ``global_batch_size`` defaults to the trainer's (per-device x accumulation x data-parallel
    size), so it is kept; one that cannot be split exactly is a ``ValueError`` unless
    ``allow_inexact=True`` (then ``plan_batch``'s closest split, with a ``UserWarning`` naming it),
    as in the Lightning ``BatchFit``. Trials run the Trainer's own step; when the global
    batch needs accumulation, the micro-batch is measured with the window's gradients alive, as
    the Trainer runs it. The window's other micro-batches, which the Trainer keeps on the device,
    are not measured (small for tokens; a ``margin`` covers large inputs such as images). The eval
    search holds the optimizer's training state and measures one forward pass (predictions kept
    on the device for ``compute_metrics`` are not in it: ``eval_accumulation_steps`` moves them).
    The train search stops at a device's share of the global batch, the eval search at its share
    of the eval set; ``max_batch_size`` lowers both. ``device`` is where trials run; ``margin``
    (default ``LOOP_HEADROOM``, 2 MiB: the Trainer's loop holds a few KiB of tensors its step does
    not, as Lightning's does; ``margin=0`` keeps none) and ``search_options`` (``strategy``,
    ``min_batch_size``, ``steps``, ``trace``, ...) are ``SearchSettings`` fields, checked before any trial. The result is a ``TrainerFit``; ``longest_seq_len`` pads
    the sample to the longest sequence of the run. Ranks of a process group agree on one size.
    The model, optimizer state, RNG states and ``trainer.optimizer`` are left as they were; the
    learning rate is not changed. ``log_plan`` adds a ``BatchFitCallback`` (replacing an earlier one).

    >>> fit = fit_trainer(trainer, global_batch_size=256, device=batchfit.SimulatedDevice("16GiB"))   # doctest: +SKIP
    >>> fit.micro_batch_size * fit.gradient_accumulation_steps * fit.world_size   # doctest: +SKIP
    256
    """
    _check(trainer, global_batch_size, max_batch_size)
    settings = SearchSettings(margin=margin, max_batch_size=max_batch_size, **search_options)  # checked before any work
    devices = data_parallel_size(trainer)
    args = trainer.args
    target = global_batch_size or args.per_device_train_batch_size * args.gradient_accumulation_steps * devices
    share = math.ceil(target / devices)
    with _trainer_left_as_found(trainer):
        train = train_workload(trainer, longest_seq_len=longest_seq_len)
        found, one_step, plan = search_and_plan(
            train,
            settings.replace(max_batch_size=min(share, max_batch_size or share)),
            device=device,
            global_batch_size=target,
            world_size=devices,
            allow_inexact=allow_inexact,
            stacklevel=3,  # the warning points at fit_trainer's caller
        )
        evaluated = None
        if fit_eval and trainer.eval_dataset is not None:
            evaluated = _eval_search(trainer, train.optimizer, devices, settings, device, longest_seq_len)
    note = _why_not_larger(
        args, plan, found, one_step, share=share, user_cap=max_batch_size, asked=global_batch_size is not None
    )
    fit = _trainer_fit(args, plan, found, one_step, evaluated, note)
    _apply(trainer, fit)
    level = logging.INFO if note is None else logging.WARNING  # a larger micro-batch is there to have: say so
    logger.log(level, "batchfit: %s; set %s (was %s)", fit.summary(), fit.settings(), fit.previous)
    if log_plan:  # one callback, for the latest fit
        for earlier in [c for c in trainer.callback_handler.callbacks if isinstance(c, BatchFitCallback)]:
            trainer.remove_callback(earlier)
        trainer.add_callback(BatchFitCallback(fit))
    return fit


def fit_training_args(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    *,
    eval_dataset: Any = None,
    data_collator: Any = None,
    processing_class: Any = None,
    **fit_options: Any,
) -> TrainerFit:
    """``fit_trainer`` for a model, ``TrainingArguments`` and datasets, without a Trainer of your
    own: one is built (the seeding it does is undone), fitted and dropped; ``args`` is changed in
    place. Pass ``callbacks=[BatchFitCallback(fit)]`` to your Trainer to log the fit.

    >>> fit = fit_training_args(model, args, train_dataset, global_batch_size=64)   # doctest: +SKIP
    >>> Trainer(model=model, args=args, train_dataset=train_dataset).train()   # doctest: +SKIP
    """
    if not isinstance(args, TrainingArguments):
        raise InputTypeError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    rng = save_rng()
    try:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            processing_class=processing_class,
        )
    finally:
        restore_rng(rng)
    return fit_trainer(trainer, **{"log_plan": False, **fit_options})


class BatchFitCallback(TrainerCallback):
    """Logs a ``TrainerFit`` when training begins: a line on the ``batchfit`` logger and an entry
    ``{"batchfit": fit.to_dict(), "step": ...}`` in ``state.log_history`` (saved in checkpoints'
    ``trainer_state.json``); warns when the arguments no longer match the fit.

    >>> trainer.add_callback(BatchFitCallback(fit_trainer(trainer, log_plan=False)))   # doctest: +SKIP
    """

    def __init__(self, fit: TrainerFit) -> None:
        if not isinstance(fit, TrainerFit):
            raise InputTypeError(
                f"BatchFitCallback needs the TrainerFit that fit_trainer returns, got {type(fit).__name__}: "
                "fit_trainer(trainer) adds one itself"
            )
        self.fit = fit
        self.logged: dict[str, Any] | None = None

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        for name, (planned, actual) in self.fit.differences(args).items():
            logger.warning(
                "batchfit: %s is %s, but the fit set %s: it was changed after the fit", name, actual, planned
            )
        record = self.fit.to_dict()
        logger.info("batchfit: training with %s", json.dumps(record["plan"]["batch_configuration"]))
        for warning in self.fit.plan.warnings:
            logger.info("batchfit: %s", warning)
        if state.is_world_process_zero:
            state.log_history.append({"batchfit": record, "step": state.global_step})
        self.logged = record
