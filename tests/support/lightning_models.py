"""A small LightningModule and DataModule for the Lightning tests (and the DDP script)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torch.utils.data import Dataset
from torch.utils.data import default_collate

ROWS = 8192


class Rows(Dataset):
    """Rows made when read, like data decoded from disk: on a GPU the dataset is not in device memory,
    and on a simulated device a dataset tensor read under the count would be counted whole."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(32, generator=generator), torch.randint(0, 10, (), generator=generator)


def sample(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``rows`` rows as one batch, as the loader collates them."""
    return default_collate([Rows()[index] for index in range(rows)])


class Classifier(pl.LightningModule):
    """An MLP whose train_dataloader() reads ``self.hparams.batch_size``; it records every batch's rows."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
        self.rows_seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.rows_seen.append(x.shape[0])
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=self.hparams.batch_size, shuffle=True)


class PlainClassifier(Classifier):
    """The same module without a train_dataloader() or a batch size: data comes from a DataModule."""

    train_dataloader = pl.LightningModule.train_dataloader

    def __init__(self):
        super().__init__()
        del self.hparams["batch_size"]


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=self.batch_size)


class Recorder(pl.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))


def trainer(**overrides) -> pl.Trainer:
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    return pl.Trainer(**{**settings, **overrides})
