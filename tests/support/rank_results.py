"""The ending the torchrun checks share: every rank's result gathered, written by rank 0, then a
teardown that every rank reaches together (gloo aborts on a one-sided teardown)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist


def gather_and_write(result: Any, path: str | Path) -> None:
    """Gather ``result`` from every rank; rank 0 writes the list, in rank order, as JSON to ``path``;
    then every rank waits for the others and destroys the process group."""
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(results))
    dist.barrier()  # every rank done before any tears down
    dist.destroy_process_group()
