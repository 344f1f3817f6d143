"""Every two-rank check in one torchrun launch (2 ranks, gloo), started by ddp_launch.py.

A launch costs seconds before any check runs (the agent, two Python processes importing torch,
the rendezvous), so the checks share one: each ``ddp_*.py`` script's ``main()`` runs in turn, in
one process group made here. Each script still runs alone under torchrun; inside the suite its
``init_process_group`` is a no-op (the group exists) and its ``destroy_process_group`` a barrier.

Usage: ``torchrun --nproc_per_node=2 ddp_suite.py OUT_DIR CHECK [CHECK ...]``. Check ``NAME`` gets
``OUT_DIR/NAME/out`` as its ``argv[1]``; each rank records how each check ended in
``OUT_DIR/status.RANK.json`` (``"ok"`` or the traceback) after every check. The first failure
ends the launch (torchrun stops the other rank), so no rank waits on a collective that never comes.
"""

import importlib
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the checks, beside this script in tests/launch/


@contextmanager
def _in_the_shared_group():
    """The scripts' own process-group set-up and tear-down, made harmless inside the suite."""
    with (
        mock.patch.object(dist, "init_process_group", lambda *args, **kwargs: None),
        mock.patch.object(dist, "destroy_process_group", lambda *args, **kwargs: dist.barrier()),
    ):
        yield


def _run(check: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    saved_argv = sys.argv
    sys.argv = [f"{check}.py", str(out / "out")]
    try:
        with _in_the_shared_group():
            importlib.import_module(check).main()
    finally:
        sys.argv = saved_argv
    dist.barrier()  # both ranks done with this check before either starts the next


def main() -> None:
    out_dir, checks = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    status_path = out_dir / f"status.{rank}.json"
    status: dict[str, str] = {}
    for check in checks:
        start = time.perf_counter()
        try:
            _run(check, out_dir / check)
            status[check] = "ok"
            print(f"rank {rank}: {check} took {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        except BaseException:
            status[check] = traceback.format_exc()
        status_path.write_text(json.dumps(status))
        if status[check] != "ok":
            print(f"rank {rank}: {check} failed:\n{status[check]}", file=sys.stderr, flush=True)
            os._exit(1)  # torchrun stops the other rank, which may be waiting on this one
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
