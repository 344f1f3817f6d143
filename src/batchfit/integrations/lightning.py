"""Lightning: the ``BatchFit`` callback and ``fit_batch_size``, where ``BatchSizeFinder`` is used.

Unlike Lightning's finder, the size set is one a trial ran (two full steps of the module's own
``training_step`` and the optimizer from ``configure_optimizers``), all state is restored after
every trial, ranks under DDP agree on one size, and a requested global batch is kept by setting
``accumulate_grad_batches``.

>>> from batchfit.integrations.lightning import BatchFit
>>> callback = BatchFit(global_batch_size=256)   # doctest: +SKIP
>>> trainer = lightning.pytorch.Trainer(callbacks=[callback])   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.parsing import lightning_getattr
    from lightning.pytorch.utilities.parsing import lightning_hasattr
    from lightning.pytorch.utilities.parsing import lightning_setattr
except ImportError as error:  # pragma: no cover - exercised only where lightning is missing
    raise ImportError("batchfit's Lightning integration needs Lightning: pip install 'batchfit[lightning]'") from error

from batchfit.errors import InputError
from batchfit.integrations.result import LOOP_HEADROOM
from batchfit.integrations.result import FitResult
from batchfit.integrations.result import deprecated_alias
from batchfit.integrations.result import search_and_plan
from batchfit.planning.plan import BatchPlan
from batchfit.search.result import SearchResult
from batchfit.search.settings import SearchSettings
from batchfit.step.batching import batch_ceiling
from batchfit.step.workload import Workload

logger = logging.getLogger("batchfit")

PRECISION_AMP = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class BatchFitResult(FitResult):
    """What ``BatchFit`` set: a ``FitResult`` (the same fields as the Transformers integration's),
    with the numbers it logs.

    ``micro_batch_size`` went to ``batch_arg_name`` and ``gradient_accumulation_steps`` to the
    trainer's ``accumulate_grad_batches``; ``settings()`` names both as Lightning does. With
    accumulation, ``search`` measured a window's later micro-batch, whose forward runs with the
    gradients alive, and ``one_step_search`` the plain step, whose answer is larger. The old names
    ``batch_size``, ``accumulate_grad_batches`` and ``one_step`` still read, with a
    ``DeprecationWarning``, for one release.
    """

    batch_size = deprecated_alias("batch_size", "micro_batch_size")
    accumulate_grad_batches = deprecated_alias("accumulate_grad_batches", "gradient_accumulation_steps")

    @property
    def one_step(self) -> SearchResult | None:
        """Deprecated: ``one_step_search`` (this was ``None`` without accumulation)."""
        warnings.warn("one_step is deprecated: use one_step_search", DeprecationWarning, stacklevel=2)
        return self.one_step_search if self.accumulating else None

    def metrics(self) -> dict[str, float]:
        """The numbers logged to the trainer's loggers, under ``batchfit/``, named as in ``to_dict()``
        (``batch_size`` and ``accumulate_grad_batches`` too, for one release)."""
        found = {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "global_batch_size": self.global_batch_size,
            "exact_global_batch": self.exact_global_batch,
            "max_batch_size": self.search.batch_size,
            "trials": len(self.search.trials),
            "search_seconds": self.search.seconds,
            "batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.gradient_accumulation_steps,
        }
        if self.search.peak_bytes is not None:
            found["peak_bytes"] = self.search.peak_bytes
        return {f"batchfit/{key}": float(value) for key, value in found.items()}


class BatchFit(pl.Callback):
    """Set the largest micro-batch that fits, and keep a global batch, at the start of ``fit``.

    At ``on_fit_start`` it probes the module's ``training_step`` with the trainer's optimizer and
    precision on a batch from the train dataloader (a ``LightningDataModule``'s or the module's
    ``train_dataloader()``), sets ``batch_arg_name`` on the module, its ``hparams`` or the
    datamodule (as ``BatchSizeFinder`` does), and, with ``global_batch_size``, sets the trainer's
    ``accumulate_grad_batches`` so that micro-batch x accumulation x world size is that batch.
    A global batch that cannot be split exactly is a ``ValueError`` unless ``allow_inexact=True``
    (then the closest split, with a warning), as in ``fit_trainer``.
    ``device`` (a batchfit Device such as ``SimulatedDevice("2GiB")``) overrides where trials run;
    ``margin`` keeps room for the loop's own tensors (``LOOP_HEADROOM``); ``search_options``
    (``strategy``, ``min_batch_size``, ``max_batch_size``, ``steps``, ``max_trials``, ``trace``, ...)
    are ``SearchSettings`` fields, checked here. ``early_exit=True`` stops ``fit`` after setting,
    as ``fit_batch_size`` does. The outcome, a ``BatchFitResult``, is in ``.result`` and on every
    logger as ``batchfit/*``.

    >>> BatchFit(batch_arg_name="batch_size", global_batch_size=512).global_batch_size
    512
    """

    def __init__(
        self,
        *,
        batch_arg_name: str = "batch_size",
        global_batch_size: int | None = None,
        device: Any = None,
        margin: int | float | str = LOOP_HEADROOM,
        allow_inexact: bool = False,
        early_exit: bool = False,
        **search_options: Any,
    ) -> None:
        if global_batch_size is not None and (
            not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1
        ):
            raise InputError(f"global_batch_size must be a positive integer or None, got {global_batch_size!r}")
        self.batch_arg_name = batch_arg_name
        self.global_batch_size = global_batch_size
        self.device = device
        self.settings = SearchSettings(margin=margin, **search_options)
        self.allow_inexact = allow_inexact
        self.early_exit = early_exit
        self.result: BatchFitResult | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.result = self.fit(trainer, pl_module)
        if self.early_exit:
            from lightning.pytorch.utilities.exceptions import _TunerExitException

            raise _TunerExitException()  # how Lightning's own tuner callbacks end fit early

    def fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BatchFitResult:
        """Search, set the batch size (and accumulation), log, and return what was set."""
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise InputError(
                f"{self.batch_arg_name!r} is not an attribute of the module, its hparams or the datamodule: "
                "add it there, or pass BatchFit(batch_arg_name=...) naming the one your train_dataloader() reads"
            )
        loader = train_dataloader(trainer, pl_module)
        workload = lightning_workload(trainer, pl_module, next(iter(loader)))
        ceiling = batch_ceiling(getattr(loader, "dataset", None), trainer.world_size, self.settings.max_batch_size)
        found, one_step, plan = search_and_plan(
            workload,
            self.settings.replace(max_batch_size=ceiling),
            device=self.device,
            global_batch_size=self.global_batch_size,
            world_size=trainer.world_size,
            allow_inexact=self.allow_inexact,
        )
        result = self._result(trainer, pl_module, found, one_step, plan)
        lightning_setattr(pl_module, self.batch_arg_name, result.micro_batch_size)
        trainer.accumulate_grad_batches = result.gradient_accumulation_steps
        _reload_train_data(trainer)
        _report(trainer, result)
        return result

    def _result(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        found: SearchResult,
        one_step: SearchResult,
        plan: BatchPlan | None,
    ) -> BatchFitResult:
        """What to set: the plan's split (no global batch asked for: the size found, no accumulation)."""
        split = (found.batch_size, 1) if plan is None else (plan.micro_batch_size, plan.gradient_accumulation_steps)
        before = (lightning_getattr(pl_module, self.batch_arg_name), trainer.accumulate_grad_batches)
        names = (self.batch_arg_name, "accumulate_grad_batches")
        return BatchFitResult(
            *split,
            trainer.world_size,
            found,
            one_step,
            plan=plan,
            applied=dict(zip(names, split, strict=True)),
            previous=dict(zip(names, before, strict=True)),
        )


def fit_batch_size(
    trainer: pl.Trainer, model: pl.LightningModule, *, datamodule: Any = None, **options: Any
) -> BatchFitResult:
    """One call, like ``Tuner(trainer).scale_batch_size``: run ``BatchFit(**options)`` and stop.

    The trainer's ``fit`` runs only until the batch size is set; call ``trainer.fit`` afterwards
    to train with it. ``options`` are ``BatchFit``'s (``batch_arg_name``, ``global_batch_size``,
    ``device``, ``strategy``, ...).

    >>> result = fit_batch_size(trainer, model, global_batch_size=256)   # doctest: +SKIP
    >>> trainer.fit(model)   # doctest: +SKIP
    """
    callback = BatchFit(**options, early_exit=True)
    trainer.callbacks.append(callback)
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        trainer.callbacks.remove(callback)
    if callback.result is None:
        raise RuntimeError("fit ended before BatchFit ran: was the trainer already fitted, or fast_dev_run set?")
    return callback.result


def train_dataloader(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The loader whose batch size ``batch_arg_name`` controls: the datamodule's, else the module's."""
    source = getattr(trainer.fit_loop, "_data_source", None)  # Lightning's record of where fit's data comes from
    from_fit_call = source is not None and not source.is_module()
    datamodule = trainer.datamodule
    if not from_fit_call and datamodule is not None and is_overridden("train_dataloader", datamodule):
        return datamodule.train_dataloader()
    if not from_fit_call and is_overridden("train_dataloader", pl_module):
        return pl_module.train_dataloader()
    raise InputError(
        "BatchFit sets the batch size that train_dataloader() reads, so the loader must come from a "
        "LightningDataModule or the module's train_dataloader(), not from dataloaders passed to fit()"
    )


def lightning_workload(trainer: pl.Trainer, pl_module: pl.LightningModule, sample_batch: Any) -> Workload:
    """A batchfit ``Workload`` whose step is the module's ``training_step`` with the trainer's optimizer."""
    if not pl_module.automatic_optimization:
        raise InputError(
            "BatchFit probes automatic optimization only: with manual optimization, build a "
            "batchfit.Workload with a step_fn that runs your step, and call batchfit.search_workload"
        )
    return Workload(
        pl_module,
        sample_batch,
        optimizer=_optimizer(trainer, pl_module),
        amp_dtype=PRECISION_AMP.get(str(trainer.precision)),
        step_fn=_training_step,
        name=type(pl_module).__name__,
        keep_output=False,  # Lightning holds neither the output nor the loss: training_step's own loop
    )


def _optimizer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.optim.Optimizer:
    # The strategy sets the trainer's optimizers up before on_fit_start; outside fit, build one.
    optimizer = trainer.optimizers[0] if trainer.optimizers else _first_optimizer(pl_module.configure_optimizers())
    return getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the real one


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer in any shape ``configure_optimizers`` may return."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise InputError("configure_optimizers() returned no optimizer: BatchFit probes the optimizer step too")


def _training_step(pl_module: pl.LightningModule, batch: Any) -> torch.Tensor:
    with _quiet_logging(pl_module):
        output = pl_module.training_step(batch, 0)
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if loss is None:
        raise InputError("training_step returned no loss on the probe batch: BatchFit needs a step that trains")
    return loss


@contextlib.contextmanager
def _quiet_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` outside Lightning's loop would raise; during a probe it records nothing."""
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def _reload_train_data(trainer: pl.Trainer) -> None:
    """Make the fit loop build its loaders again with the new batch size (if it built them already)."""
    loop = trainer.fit_loop
    if getattr(loop, "_combined_loader", None) is not None:
        loop._combined_loader = None
        loop.setup_data()


def _report(trainer: pl.Trainer, result: BatchFitResult) -> None:
    logger.info("batchfit: %s", result.summary())
    for warning in [] if result.plan is None else result.plan.warnings:
        logger.warning("batchfit: %s", warning)
    for each in trainer.loggers:
        each.log_metrics(result.metrics(), step=trainer.global_step)


__all__ = ["BatchFit", "BatchFitResult", "fit_batch_size", "lightning_workload", "train_dataloader"]
