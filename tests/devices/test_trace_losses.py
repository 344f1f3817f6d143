"""A regression loss the loop keeps (``loss = F.mse_loss(out, y)``, held through backward into the next step)
keeps the storage of every element's loss on real tensors; the trace counts it too, so a trace on one device
gives the simulated device's peak to the byte (``batchfit.devices.loss_storage``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import batchfit as bf

LOSSES = {
    "mse": F.mse_loss,
    "smooth_l1": F.smooth_l1_loss,
    "soft_margin": lambda out, y: F.soft_margin_loss(out, y.sign()),
    "bce": lambda out, y: F.binary_cross_entropy(out.sigmoid(), y.sigmoid()),
    "l1_beta_0": lambda out, y: F.smooth_l1_loss(out, y, beta=0.0),
}


@pytest.mark.parametrize("name", LOSSES)
def test_the_trace_keeps_what_a_real_loss_keeps(name):
    peaks = []
    for device in ("sim:64MiB", bf.TraceDevice("64MiB")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        sample = (torch.randn(8, 64), torch.randn(8, 64))
        optimizer = torch.optim.AdamW(model.parameters())
        trial = bf.probe_batch_size(model, sample, 32, loss_fn=LOSSES[name], optimizer=optimizer, device=device)
        peaks.append(trial.peak_bytes)
    assert peaks[0] == peaks[1]
