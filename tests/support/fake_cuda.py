"""A stand-in for torch.cuda's memory functions, for the CUDA device's logic without the hardware."""

from __future__ import annotations

import torch


class FakeCuda:
    """Stands in for torch.cuda's memory functions, recording the calls."""

    def __init__(self):
        self.calls = []
        self.allocated = 1000

    def patch(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device: (6000, 8000))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device: 1500)
        monkeypatch.setattr(cuda, "memory_allocated", self.memory_allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: 4321)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device: 5432)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: self.calls.append(("reset", device)))
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append(("empty_cache",)))
        monkeypatch.setattr(cuda, "synchronize", lambda device: self.calls.append(("sync", device)))

    def memory_allocated(self, device):
        self.allocated += 10
        return self.allocated
