"""The reliability campaign, reduced for ``make test`` (``make reliability`` runs the full one:
``benchmarks/reliability.py``, which writes ``benchmarks/RELIABILITY.md``).

- Fault injection: errors of every kind raised at seeded operator indices of real trials, in
  every phase, under every strategy; afterwards state, bytes and the edge must be as before.
  Three more tests break batchfit on purpose to show the campaign notices.
- Bad inputs: every entry of ``tests/support/bad_inputs.py``.
- Endurance: consecutive searches in one process with no growth in device or process memory.
"""

from __future__ import annotations

import sys

import pytest
import torch

import batchfit.search.prober
import batchfit.step.state
from bad_inputs import TABLE
from bad_inputs import check
from bad_inputs import cli_invoker
from batchfit.search.prober import Prober
from endurance import run_endurance
from fault_injection import KINDS
from fault_injection import Fault
from fault_injection import FaultyDevice
from fault_injection import Injector
from fault_injection import phase_hooks
from models import transformer
from reliability_campaign import CAMPAIGN_CASES
from reliability_campaign import METHODS
from reliability_campaign import Outcome
from reliability_campaign import run_campaign

SEED = 11
INJECTIONS = 30  # one per workload x method; the full campaign runs 510
ENDURANCE_SEARCHES, ENDURANCE_WARMUP = 100, 20  # the full campaign: 1000 after 100
RSS_BOUND_MIB = 16  # resident memory may grow this much after the warm-up (a leaked batch per search shows in bytes)
OBJECT_BOUND = (
    200  # gc-tracked objects may grow this much after the warm-up (one leaked Trial per search would not fit)
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; more only contend on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _describe(outcome: Outcome) -> str:
    found = [*outcome.problems, *(f"changed {d}" for d in outcome.state_differences)]
    if outcome.leaked_bytes:
        found.append(f"{outcome.leaked_bytes} bytes left alive")
    if outcome.wrong_edge_after:
        found.append(f"next search found {outcome.edge_after}")
    return f"{outcome.case}/{outcome.method}: {outcome.kind} at op {outcome.op_index} ({outcome.fired_phase}): {found}"


@pytest.mark.slow  # a campaign: make reliability runs it
def test_faults_anywhere_in_a_trial_leave_state_bytes_and_the_edge_intact():
    campaign = run_campaign(INJECTIONS, seed=SEED)
    figures = campaign.figures()
    assert campaign.clean_problems == []
    assert [_describe(o) for o in campaign.failures()] == []
    assert figures["injections"] == INJECTIONS
    assert set(figures["by_kind"]) == set(KINDS)
    assert set(figures["by_phase"]) == {"batch", "forward", "backward", "optimizer"}
    assert set(figures["by_method"]) == {label for label, _strategy, _trace in METHODS}
    assert set(figures["by_case"]) == {case.name for case in CAMPAIGN_CASES}
    assert figures["phase_disagreements"] == 0
    assert 0 < figures["raised_after_op"] < INJECTIONS


def test_an_oom_anywhere_in_backward_leaves_nothing_alive_once_its_trial_is_over():
    """Found by this campaign: after an error in backward, torch's autograd engine keeps the failed
    graph's pending tasks (saved activations, the batch) in the thread's ready queue until the next
    backward, out of reach of gc; a search whose last trial failed so left them alive."""
    work, injector = transformer(), Injector()
    device = FaultyDevice("64MiB", injector)
    leaked = {}
    with phase_hooks(injector), Prober(work, device) as prober:
        injector.reset(recording=True)
        prober.probe(4)
        backward_ops = [i for i, phase in enumerate(injector.labels) if phase == "backward"]
        for op in backward_ops[::9]:
            injector.reset(Fault("oom", op, after=False, marker="[injected]"))
            trial = prober.probe(4)
            assert trial.oom and trial.failed_phase == "backward" and injector.fired_phase == "backward"
            injector.reset()
            if device.live_bytes() != prober.baseline_bytes:
                leaked[op] = device.live_bytes() - prober.baseline_bytes
    assert len(backward_ops[::9]) >= 20 and leaked == {}


NOISY = [case for case in CAMPAIGN_CASES if case.name == "noisy_mlp"]


def test_the_campaign_notices_an_rng_that_is_not_restored(monkeypatch):
    monkeypatch.setattr(batchfit.step.state, "restore_rng", lambda rng: None)
    campaign = run_campaign(4, seed=SEED, cases=NOISY, methods=["binary"])
    assert campaign.clean_problems and campaign.figures()["state_differences"] > 0


def test_the_campaign_notices_errors_taken_for_ooms(monkeypatch):
    monkeypatch.setattr(batchfit.search.prober, "is_oom", lambda error: True)
    campaign = run_campaign(6, seed=SEED, cases=NOISY, methods=["power"])
    assert campaign.figures()["search_problems"] >= 3  # the non-OOM kinds were swallowed as failed trials


def test_the_campaign_notices_a_leak(monkeypatch):
    kept = []
    reset = batchfit.search.prober.Prober._reset

    def keep_the_error(self):
        error = sys.exc_info()[1]
        if error is not None and not kept:
            kept.append(error)  # like a logger holding the first error: its traceback pins the trial's tensors
        reset(self)

    monkeypatch.setattr(batchfit.search.prober.Prober, "_reset", keep_the_error)
    campaign = run_campaign(6, seed=SEED, cases=NOISY, methods=["binary"])
    assert campaign.figures()["leaks"] >= 1


def test_every_bad_input_gives_one_clear_line_and_leaves_no_file(tmp_path_factory):
    """One test for the whole table (a test each would spend more on fixtures than on the checks).
    A known issue must still show, so that fixing it is noticed and its mark removed."""
    invoke, misbehaved, fixed = cli_invoker(), {}, []
    for case in TABLE:
        problems = check(case, tmp_path_factory.mktemp(case.id), invoke).problems
        if problems and not case.known_issue:
            misbehaved[case.id] = problems
        elif not problems and case.known_issue:
            fixed.append(case.id)
    assert misbehaved == {}
    assert fixed == [], "these known issues behave now: remove their known_issue"


def test_the_bad_input_table_covers_every_kind_of_mistake():
    assert len(TABLE) >= 25 and len({case.id for case in TABLE}) == len(TABLE)
    categories = {case.category for case in TABLE}
    assert categories == {
        "wrong type",
        "empty or inconsistent batch",
        "nonsense capacity",
        "malformed grid",
        "malformed plan",
        "unreadable file",
        "unwritable output",
    }
    working = [case for case in TABLE if not case.known_issue]
    assert sum(case.surface == "library" for case in working) >= 25
    assert sum(case.surface == "CLI" for case in working) >= 25


@pytest.mark.slow  # a campaign: make reliability runs it
def test_searches_in_a_row_grow_neither_device_nor_process_memory():
    run = run_endurance(ENDURANCE_SEARCHES, CAMPAIGN_CASES, warmup=ENDURANCE_WARMUP, seed=SEED)
    figures = run.figures(ENDURANCE_WARMUP)
    assert figures["searches"] == ENDURANCE_SEARCHES and figures["wrong_edges"] == 0
    assert figures["max_extra_live_bytes"] == 0  # every search leaves exactly the baseline on its device
    assert figures["rss_growth_after_warmup_mib"] <= RSS_BOUND_MIB
    assert figures["object_growth_after_warmup"] <= OBJECT_BOUND
    assert set(run.methods) == {label for label, _strategy, _trace in METHODS}
