"""What an out-of-memory error leaves behind, and how to free it: used by every OOM path
(the prober, the Microbatcher, the decorator)."""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import _disable_current_modes


def drain_autograd_queue() -> None:
    """After an error in backward, the autograd engine keeps the failed graph's pending tasks (their
    saved activations, the batch, partial gradients) in this thread's ready queue until the next
    backward runs on it, and no garbage collection frees them. A one-element backward drains the
    queue; tasks of a failed graph are dropped unrun. Outside any dispatch mode, so a simulated
    device at its limit neither counts nor refuses the one scalar. On a GPU the device's autograd
    thread drops them itself; there this costs one tiny CPU backward."""
    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        torch.ones((), requires_grad=True).backward()


def free_memory() -> None:
    """What an OOM leaves behind: a cut-short backward's queued work, reference cycles, and the
    CUDA/MPS allocators' caches."""
    drain_autograd_queue()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()
