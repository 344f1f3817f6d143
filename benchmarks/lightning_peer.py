"""A workload as a LightningModule for ``Tuner.scale_batch_size``, and a count of the trials it runs.

The module's ``train_dataloader`` reads ``self.batch_size`` (the attribute the tuner changes) and
serves batches built from the workload's sample rows, cycled, as batchfit's trials do, so both
train on the same data. ``configure_optimizers`` returns the workload's own optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.parsing import lightning_getattr
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

import batchfit as bf
from batchfit.step.batching import resize_batch
from batchfit.step.workload import compute_loss

DATASET_ROWS = 1 << 20  # above any size tried: Lightning stops growing at the dataset's length


class SampleRows(Dataset):
    """``DATASET_ROWS`` rows made from the sample's, cycled; fetched a whole batch at a time."""

    def __init__(self, sample: Any):
        self.sample = sample

    def __len__(self) -> int:
        return DATASET_ROWS

    def __getitems__(self, indices: list[int]) -> Any:
        return resize_batch(self.sample, len(indices))


class WorkloadModule(pl.LightningModule):
    """The workload's model, loss and optimizer, trained by Lightning at ``self.batch_size``."""

    def __init__(self, work: bf.Workload, batch_size: int = 2):
        super().__init__()
        self.net = work.model
        self.loss_fn = work.loss_fn
        self.optimizer = work.optimizer
        self.sample = work.sample_batch
        self.batch_size = batch_size
        self.completed_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return compute_loss(self.net, batch, loss_fn=self.loss_fn)

    def on_train_batch_end(self, *args: Any) -> None:
        self.completed_steps += 1

    def configure_optimizers(self) -> Any:
        return self.optimizer

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SampleRows(self.sample), batch_size=self.batch_size, collate_fn=_whole_batch)


def _whole_batch(batch: Any) -> Any:
    return batch


def make_module(work: bf.Workload) -> WorkloadModule:
    return WorkloadModule(work)


def make_trainer(root: str) -> pl.Trainer:
    """A CPU trainer with nothing but the loop: no logger, checkpoints, progress bar or summary."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


@contextlib.contextmanager
def counting_trials(scaling: ModuleType, tally: Any, around_each: Callable[[], None]) -> Iterator[None]:
    """Count every trial Lightning's batch-size scaler runs (its ``_try_loop_run``), the size it
    ran at and whether it ended in an OOM, by wrapping that function for the duration; call
    ``around_each()`` before each trial and when it ends, OOM or not."""
    original = scaling._try_loop_run

    def counted(trainer: pl.Trainer, params: dict[str, Any]) -> None:
        around_each()
        size = lightning_getattr(trainer.lightning_module, "batch_size")
        tally.sizes.append(size)
        try:
            original(trainer, params)
        except RuntimeError as error:
            tally.ooms += bool(is_oom_error(error))
            raise
        finally:
            around_each()
        tally.fitted.append(size)

    scaling._try_loop_run = counted
    try:
        yield
    finally:
        scaling._try_loop_run = original
