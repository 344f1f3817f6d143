"""Loading a workload for a command: the options that reach it, and which loop its trials model. Imports the
library (and torch): only command bodies use it, once a command runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchfit.cli.common import Amp
from batchfit.cli.workloads import load_workload
from batchfit.errors import InputError
from batchfit.search.settings import LARGEST_SIZE
from batchfit.step.workload import Workload


def load_for_cli(
    workload: str,
    seq_len: int | None,
    image_size: int | None,
    amp: Amp | None,
    framework: str | None = "torch",
    keep_output: bool = True,
    settings: list[str] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The workload and the options that reached it (for the JSON); ``framework=None`` accepts MLX ones too.
    ``keep_output`` sets which loop a torch workload's probe models (``Workload.keep_output``); ``settings`` are
    the ``--set KEY=VALUE`` ones, passed to the workload's function typed as it annotates them."""
    for flag, size in (("--seq-len", seq_len), ("--image-size", image_size)):
        if size is not None and size > LARGEST_SIZE:  # the workload's own check takes the small ones
            raise InputError(f"{flag} must be at most {LARGEST_SIZE:,} (2**31 - 1), got {size}")
    options = {"seq_len": seq_len, "image_size": image_size, "amp_dtype": amp.value if amp else None}
    work = with_loop(load_workload(workload, framework=framework, settings=settings or (), **options), keep_output)
    used = {key: value for key, value in options.items() if value is not None}
    if settings:
        used["set"] = list(settings)
    if isinstance(work, Workload):
        used["keep_output"] = work.keep_output
    return work, used


def with_loop(work: Any, keep_output: bool) -> Any:
    """A copy of a torch ``Workload`` whose probe holds (or drops) the output as asked; other
    workloads (MLX's) unchanged."""
    if isinstance(work, Workload) and work.keep_output != keep_output:
        return dataclasses.replace(work, keep_output=keep_output)
    return work
