"""Sizes without bounds, arguments the workflows took as anything, and results that were silent: each a row of
one table per surface (library and command line), run by the reliability campaign's checker
(``tests/support/bad_inputs.py``): one line naming the fix (exit code 2 on the command line), no traceback, no
file left behind, and nothing run first (no hang, no billion-step confirmation, no 35 TB pad on the host)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from bad_inputs import BadInput
from bad_inputs import check
from bad_inputs import cli_invoker
from batchfit.parallel.settings import Parallelism
from batchfit.planning.noise import goodput
from batchfit.planning.plan import plan_batch
from batchfit.step.builtin_workloads import gpt_tiny

HUGE = 10**30
LLAMA = "examples/llama-tiny.json"
RANKS = Parallelism(world_size=4)


def _tokens(**options: Any):
    def call(tmp: Path) -> Any:
        work = gpt_tiny(seq_len=32)
        kwargs = {"lengths": [16, 32], "loss_fn": work.loss_fn, "device": "sim:64MiB", **options}
        return bf.find_token_budget(work.model, work.sample_batch, optimizer=work.optimizer, **kwargs)

    return call


def _find(**options: Any):
    def call(tmp: Path) -> Any:
        model = nn.Linear(4, 2)
        batch = (torch.randn(3, 4), torch.tensor([0, 1, 1]))
        return bf.find_max_batch_size(model, batch, loss_fn=F.cross_entropy, device="sim:1MiB", **options)

    return call


def _probe(size: int):
    def call(tmp: Path) -> Any:
        model = nn.Linear(4, 2)
        return bf.probe_batch_size(model, (torch.randn(3, 4), torch.tensor([0, 1, 1])), size, loss_fn=F.cross_entropy)

    return call


def _plan_sharded(**options: Any):
    from batchfit.workflows.sharded_plan import plan_sharded

    arguments = {"workload": LLAMA, "capacity": "8MiB", "seq_len": 32, "choices": [RANKS]}
    arguments |= {"planner": lambda b: plan_batch(micro_batch_size=b, global_batch_size=64), **options}
    return lambda tmp: plan_sharded(**arguments)


def _sharded_tokens(**options: Any):
    from batchfit.workflows.sharded_tokens import sharded_token_budget

    arguments = {"workload": LLAMA, "lengths": [32], "capacity": "8MiB", "parallelism": RANKS, **options}
    return lambda tmp: sharded_token_budget(**arguments)


def _estimate_config(**options: Any):
    from batchfit.workflows.sharded_estimate import estimate_config

    return lambda tmp: estimate_config(LLAMA, "8MiB", [RANKS], **options)


def _plan_workload(**options: Any):
    from batchfit.workflows.workload_plan import measure_micro_batch
    from batchfit.workflows.workload_plan import plan_workload

    def call(tmp: Path) -> Any:
        model = nn.Linear(4, 2)
        work = bf.Workload(model, (torch.randn(3, 4), torch.tensor([0, 1, 1])), F.cross_entropy)
        if "held" in options:
            return measure_micro_batch(work, device="sim:1MiB", **options)
        return plan_workload(work, options.pop("planner"), device="sim:1MiB", **options)

    return call


LIBRARY = [
    BadInput("tokens-length-2-40", "size past any tensor", r"a bucket length must be at most 2,147,483,647",
             _tokens(lengths=[16, 2**40])),
    BadInput("tokens-length-huge", "size past any tensor", r"a bucket length must be at most", _tokens(lengths=[HUGE])),
    BadInput("tokens-max-seq-len-huge", "size past any tensor", r"max_seq_len must be at most",
             _tokens(lengths=None, max_seq_len=HUGE)),
    BadInput("tokens-pad-past-the-host", "size past the host", r"padded to 2,147,483,647 tokens would take",
             _tokens(lengths=[16, 2**31 - 1])),
    BadInput("tokens-packed-no", "a flag as text", r"packed must be True, False or None, got 'no'",
             _tokens(packed="no"), error=TypeError),
    BadInput("tokens-forward-no", "a flag as text", r"forward must be True or False, got 'no'",
             _tokens(forward="no"), error=TypeError),
    BadInput("tokens-lengths-text", "wrong type", r"lengths must be a list of bucket lengths", _tokens(lengths="32"),
             error=TypeError),
    BadInput("find-confirm-steps-billion", "a run, not a trial", r"confirm_steps .*must be at most 1,000",
             _find(confirm_steps=10**9)),
    BadInput("find-steps-ten-thousand", "a run, not a trial", r"steps must be at most 1,000", _find(steps=10**4)),
    BadInput("probe-batch-size-huge", "size past any tensor", r"batch_size must be at most", _probe(HUGE)),
    BadInput("plan-micro-huge", "size past any tensor", r"micro_batch_size must be at most",
             lambda tmp: plan_batch(micro_batch_size=HUGE, global_batch_size=100_000_007)),
    BadInput("plan-tokens-huge", "size past any tensor", r"global_batch_tokens .* is more than",
             lambda tmp: plan_batch(micro_batch_size=8, global_batch_tokens=10**40, seq_len=8)),
    BadInput("plan-sharded-seq-len-huge", "size past any tensor", r"seq_len must be at most",
             _plan_sharded(seq_len=HUGE)),
    BadInput("plan-sharded-one-choice", "wrong type", r"choices must be a list of Parallelism settings",
             _plan_sharded(choices=RANKS), error=TypeError),
    BadInput("plan-sharded-two-worlds", "nonsense", r"choices must share one world",
             _plan_sharded(choices=[RANKS, Parallelism(world_size=8)])),
    BadInput("plan-sharded-planner-number", "wrong type", r"planner must be a function", _plan_sharded(planner=64),
             error=TypeError),
    BadInput("plan-sharded-workload-model", "wrong type", r"workload must be an LLM preset name or a config.json",
             _plan_sharded(workload=nn.Linear(2, 2)), error=TypeError),
    BadInput("plan-sharded-capacity-number", "wrong type", r"capacity must be a GPU preset or a size",
             _plan_sharded(capacity=8 << 20), error=TypeError),
    BadInput("plan-sharded-progress-print", "wrong type", r"progress must be a batchfit Progress",
             _plan_sharded(progress=print), error=TypeError),
    BadInput("sharded-tokens-length-huge", "size past any tensor", r"a bucket length must be at most",
             _sharded_tokens(lengths=[HUGE])),
    BadInput("sharded-tokens-verify-no", "a flag as text", r"verify must be True or False",
             _sharded_tokens(verify="no"), error=TypeError),
    BadInput("sharded-tokens-parallelism-dict", "wrong type", r"parallelism must be a batchfit Parallelism",
             _sharded_tokens(parallelism={"world_size": 4}), error=TypeError),
    BadInput("estimate-config-seq-len-huge", "size past any tensor", r"seq_len must be at most",
             _estimate_config(seq_len=HUGE)),
    BadInput("estimate-config-batch-huge", "size past any tensor", r"batch_size must be at most",
             _estimate_config(batch_size=HUGE)),
    BadInput("plan-workload-no-planner", "wrong type", r"planner must be a function", _plan_workload(planner=None),
             error=TypeError),
    BadInput("measure-held-yes", "a flag as text", r"held must be True or False", _plan_workload(held="yes"),
             error=TypeError),
    BadInput("goodput-negative-noise", "nonsense", r"the noise scale must be a positive number",
             lambda tmp: goodput(None, -5.0)),
]  # fmt: skip

CLI = [
    BadInput("cli-tokens-bucket-huge", "size past any tensor", r"a bucket length must be at most",
             args=("tokens", "lm-tiny", "--buckets", f"16,{HUGE}", "--device", "sim:16MiB")),
    BadInput("cli-tokens-max-seq-len-huge", "size past any tensor", r"max_seq_len must be at most",
             args=("tokens", "lm-tiny", "--max-seq-len", str(HUGE), "--device", "sim:16MiB")),
    BadInput("cli-tokens-num-buckets-huge", "size past any tensor", r"the number of buckets must be at most",
             args=("tokens", "lm-tiny", "--max-seq-len", "64", "--num-buckets", str(HUGE), "--device", "sim:16MiB")),
    BadInput("cli-tokens-checkpointing-own", "an option not read", r"--activation-checkpointing applies to a model",
             args=("tokens", "lm-tiny", "--buckets", "32", "--activation-checkpointing", "banana")),
    BadInput("cli-tokens-per-rank-nothing-fits", "a silent result", r"not even one sequence of 32 tokens",
             args=("tokens", LLAMA, "--gpus", "2", "--gpu", "64KiB", "--buckets", "32,64")),
    BadInput("cli-plan-micro-huge", "size past any tensor", r"micro_batch_size must be at most",
             args=("plan", "--micro-batch-size", str(HUGE), "--global-batch-size", "8")),
    BadInput("cli-plan-prime-huge", "size past any tensor", r"global_batch_size must be at most",
             args=("plan", "--micro-batch-size", "100000000", "--global-batch-size", str(HUGE))),
    BadInput("cli-plan-tokens-inf", "nonsense", r"--global-batch-tokens must be a count such as 32768",
             args=("plan", "--micro-batch-size", "8", "--global-batch-tokens", "inf", "--seq-len", "8")),
    BadInput("cli-plan-tokens-1e40", "size past any tensor", r"is more than 2,147,483,647 sequences",
             args=("plan", "--micro-batch-size", "8", "--global-batch-tokens", "1e40", "--seq-len", "8")),
    BadInput("cli-plan-device-without-verify", "an option not read", r"is where --verify runs",
             args=("plan", LLAMA, "--gpus", "2", "--gpu", "8MiB", "--device", "sim:8MiB", "--global-batch-size", "8")),
    BadInput("cli-sweep-grid-huge", "size past any tensor", r"--grid seq_len=.* is past any size",
             args=("sweep", "gpt-tiny", "--grid", f"seq_len={HUGE}", "--device", "sim:64MiB")),
    *(BadInput(f"cli-optimal-noise-{value}", "nonsense", r"the noise scale must be a positive number",
               args=("optimal", "mlp", "--device", "sim:8MiB", f"--noise-scale={value}")) for value in ("-5", "inf", "nan")),
    BadInput("cli-sweep-json-stdout", "an output that cannot be", r"--json - cannot hold a sweep's results",
             args=("sweep", "gpt-tiny", "--grid", "seq_len=32", "--device", "sim:32MiB", "--json", "-")),
    BadInput("cli-sweep-json-folder", "an output that cannot be", r"it is a folder; give a file path",
             args=("sweep", "gpt-tiny", "--grid", "seq_len=32", "--device", "sim:32MiB", "--json", "{tmp}")),
    BadInput("cli-find-empty-module", "nonsense", r"workload ':make' names no module or file", args=("find", ":make")),
    BadInput("cli-estimate-empty-function", "nonsense", r"names no function",
             args=("estimate", "x.py:", "--capacity", "1GiB")),
]  # fmt: skip


@pytest.mark.parametrize("case", LIBRARY, ids=lambda case: case.id)
def test_library_sizes_and_arguments_are_one_line(case, tmp_path):
    assert check(case, tmp_path, cli_invoker()).problems == []


def test_command_line_sizes_and_arguments_are_one_line(tmp_path_factory):
    """One test for the table (each row is a quick refusal; a test each would spend more on fixtures)."""
    invoke = cli_invoker()
    problems = {
        case.id: found for case in CLI if (found := check(case, tmp_path_factory.mktemp(case.id), invoke).problems)
    }
    assert problems == {}
