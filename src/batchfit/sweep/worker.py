"""One sweep configuration in a fresh process: ``python -m batchfit.sweep.worker JOB OUTCOME``.

The local engine starts this for each configuration, its slot's device pinned in the environment before
Python starts (``CUDA_VISIBLE_DEVICES``), so nothing from one probe's CUDA state reaches the next. It reads
the pickled ``ConfigJob``, runs ``run_job`` and writes the pickled ``Outcome`` atomically; a process that
ends without writing it died (its exit status says how). On Linux it dies with its driver
(``PR_SET_PDEATHSIG``), so a killed driver leaves no probe holding a GPU.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends
THREADS_VARIABLE = "BATCHFIT_WORKER_THREADS"


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux only; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the request was made
        os._exit(1)


def main(job_path: str, outcome_path: str) -> int:
    die_with_parent()
    threads = os.environ.get(THREADS_VARIABLE)
    import torch  # after the environment is final: the slot's device and threads

    if threads:
        torch.set_num_threads(int(threads))
    from batchfit.sweep.jobs import Outcome
    from batchfit.sweep.jobs import failed_record
    from batchfit.sweep.jobs import run_job

    try:
        job = pickle.loads(Path(job_path).read_bytes())
    except Exception as error:  # the factory cannot be imported here: the configuration's error, not a death
        reason = f"the job could not be loaded in the worker: {type(error).__name__}: {error}"
        outcome = Outcome({}, failed_record({}, "raised", reason), log=[f"✗ {reason}"], pid=os.getpid())
    else:
        outcome = run_job(job)
    temporary = Path(outcome_path + ".part")
    temporary.write_bytes(pickle.dumps(outcome))
    os.replace(temporary, outcome_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
