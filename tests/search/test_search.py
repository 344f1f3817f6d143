"""find_max_batch_size on four kinds of model under SimulatedDevice, against a linear scan."""

from __future__ import annotations

import json

import pytest
import torch

import batchfit as bf
from batchfit.search.strategies import STRATEGIES
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import make_strategy
from models import CASES
from models import linear_scan_edge
from models import mlp_tuple
from strategy_harness import run_strategy

MAX_BATCH_SIZE = 256  # a cap for the strategies that start from the top (binary, halving)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_each_strategy_finds_the_linear_scan_edge_with_the_expected_sequence(case, strategy):
    truth = linear_scan_edge(case)
    work = case.build()
    result = bf.search_workload(
        work, device=bf.SimulatedDevice(case.capacity), strategy=strategy, max_batch_size=MAX_BATCH_SIZE, trace=True
    )
    tried = [t.batch_size for t in result.trials]
    assert result.batch_size == truth
    assert result.exact
    assert all(t.fits == (t.batch_size <= truth) for t in result.trials)  # the device agrees with the scan
    if strategy != "auto":  # the others depend on fits(b) alone: the sequence is fully determined
        expected, _ = run_strategy(make_strategy(strategy), SearchSpace(1, MAX_BATCH_SIZE), lambda b: b <= truth)
        assert tried == expected
    else:  # the trace's estimate is exact on the simulated device: only the edge and one more
        assert tried == [truth, truth + 1]
        assert result.extra["trace"]["batch_size"] == truth


def test_auto_sequences_on_the_test_models():
    # Real trials at 2 and 3 give every storage's line, the third lands on the edge, the fourth is one more.
    sequences = {}
    for case in CASES:
        result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=False)
        sequences[case.name] = [t.batch_size for t in result.trials]
        assert result.batch_size == linear_scan_edge(case)
        assert result.extra["lines"] == {"batch_size": result.batch_size, "from": [2, 3]}
        assert "the lines of the trials at 2 and 3 put the edge at" in result.summary()
    assert sequences == {
        "mlp_tuple": [2, 3, 56, 57],
        "cnn_bn": [2, 3, 29, 30],
        "transformer": [2, 3, 15, 16],
        "dict_model": [2, 3, 56, 57],
    }


def test_every_trial_runs_two_full_steps_and_the_result_is_json_ready(case):
    result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity))
    fitting = [t for t in result.trials if t.fits]
    assert fitting and all(t.steps == 2 for t in fitting)
    assert all(set(t.phase_peak_bytes) == {"forward", "backward", "optimizer"} for t in fitting)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["batch_size"] == result.batch_size
    assert [t["batch_size"] for t in data["trials"]] == [t.batch_size for t in result.trials]
    assert data["peak_bytes"] <= data["capacity_bytes"]


def test_a_one_step_probe_overestimates_an_adam_model_and_two_steps_do_not():
    case = CASES[0]  # Adam: its two state tensors per parameter appear at the end of step 1
    truth = linear_scan_edge(case)
    one_step = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), steps=1)
    two_steps = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), steps=2)
    assert two_steps.batch_size == truth
    assert one_step.batch_size > truth
    # ...and the size a one-step probe picks really fails a second training step:
    work = case.build()
    trial = bf.probe_batch_size(
        work.model,
        work.sample_batch,
        one_step.batch_size,
        loss_fn=work.loss_fn,
        optimizer=work.optimizer,
        device=bf.SimulatedDevice(case.capacity),
    )
    assert not trial.fits and trial.oom and trial.steps == 1


def test_find_max_batch_size_takes_a_model_batch_loss_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    inputs, labels = torch.randn(5, 32), torch.randint(0, 10, (5,))
    criterion = torch.nn.CrossEntropyLoss()
    result = bf.find_max_batch_size(
        model,
        (inputs, labels),
        loss_fn=criterion,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        device="sim:120KiB",
    )
    assert result.batch_size > 1 and result.exact
    assert result.device == "sim:120.0KiB"


def test_margin_keeps_headroom_in_bytes_fraction_or_string():
    case = CASES[0]
    plain = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity))
    for margin in (4 * 1024, 0.02, "4KiB"):
        result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), margin=margin)
        assert result.batch_size < plain.batch_size
        assert result.peak_bytes <= result.limit_bytes < result.capacity_bytes
        failed = [t for t in result.trials if not t.fits]
        assert failed and all(t.batch_size > result.batch_size for t in failed)


def test_max_trials_stops_early_and_says_the_edge_is_unconfirmed():
    case = CASES[0]
    result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), strategy="power", max_trials=3)
    assert [t.batch_size for t in result.trials] == [1, 2, 4]
    assert result.batch_size == 4 and not result.exact
    assert "not confirmed" in result.summary()


def test_max_seconds_starts_no_trial_past_the_budget_and_answers_the_largest_confirmed(tmp_path):
    case = CASES[0]
    device = bf.SimulatedDevice(case.capacity, step_seconds=0.25)  # a trial's two steps: at least 0.5 s
    run = dict(device=device, trace=False, max_seconds=0.4, cache=tmp_path)
    result = bf.search_workload(case.build(), **run)
    assert [t.batch_size for t in result.trials] == [2] and result.batch_size == 2 and not result.exact
    assert result.extra["stopped_by"] == "max_seconds" and "stopped early by max_seconds" in result.summary()
    again = bf.search_workload(case.build(), **run)  # an edge the clock cut short was not cached
    assert not again.cached and [t.batch_size for t in again.trials] == [2]


def test_max_seconds_that_ends_before_any_fit_says_so_in_one_line():
    with pytest.raises(bf.NoBatchFitsError, match=r"^max_seconds ran out before any size fitted: raise max_seconds"):
        bf.search_workload(mlp_tuple(), device=bf.SimulatedDevice("1MiB"), max_seconds=1e-9)
    with pytest.raises(bf.InputError, match="max_seconds must be above 0"):
        bf.search_workload(mlp_tuple(), device=bf.SimulatedDevice("1MiB"), max_seconds=0)


def test_nothing_fits_raises_naming_the_size_and_capacity():
    work = mlp_tuple()
    with pytest.raises(bf.NoBatchFitsError, match=r"even batch size 1 does not fit on sim:\S+ \(usable") as info:
        bf.search_workload(work, device=bf.SimulatedDevice("145KiB"), min_batch_size=1)
    assert [t.batch_size for t in info.value.trials] == [2, 1]  # the lines begin at 2; then the minimum


def test_min_batch_size_that_does_not_fit_is_reported():
    truth = linear_scan_edge(CASES[0])
    with pytest.raises(bf.NoBatchFitsError, match=f"even batch size {truth + 5} does not fit"):
        bf.search_workload(mlp_tuple(), device=bf.SimulatedDevice(CASES[0].capacity), min_batch_size=truth + 5)


def test_eval_mode_fits_more_than_training():
    case = CASES[2]
    train = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity))
    work = case.build()
    work.mode = "eval"
    evaluated = bf.search_workload(work, device=bf.SimulatedDevice(case.capacity), max_batch_size=4096)
    assert evaluated.batch_size > train.batch_size and evaluated.exact
    assert set(evaluated.trials[0].phase_peak_bytes) == {"forward"}


def test_one_log_line_per_trial_says_fits_or_out_of_memory(caplog):
    case = CASES[1]
    with caplog.at_level("INFO", logger="batchfit"):
        result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=True)
    lines = [r.getMessage() for r in caplog.records]  # the trace's trials are DEBUG: only an estimate
    assert len(lines) == len(result.trials)
    assert lines[0].startswith(f"✓ Batch size {result.batch_size} fits — peak ") and " of 400.0 KiB (" in lines[0]
    assert lines[-1].startswith(f"✗ Batch size {result.batch_size + 1}: out of memory in ")


def test_running_out_of_trials_is_not_reported_as_nothing_fitting():
    with pytest.raises(bf.NoBatchFitsError, match="max_trials ran out before any size fitted"):
        bf.search_workload(
            mlp_tuple(),
            device=bf.SimulatedDevice(CASES[0].capacity),
            strategy="halving",
            max_batch_size=4096,
            max_trials=2,
        )


def test_fp16_probes_measure_the_optimizer_state_even_when_the_first_scale_overflows():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    batch = torch.randn(4, 64) * 1e3
    huge = lambda output, batch: output.float().pow(2).sum() * 1e6  # noqa: E731  overflows at a scale of 2**16
    params = sum(p.numel() * 4 for p in model.parameters())
    trial = bf.probe_batch_size(
        model,
        batch,
        4,
        loss_fn=huge,
        optimizer=torch.optim.Adam(model.parameters()),
        amp_dtype=torch.float16,
        device="sim:64MiB",
    )
    assert trial.fits and trial.held_bytes >= 3 * params  # parameters plus Adam's two moments at step 2


def result_schema() -> dict:
    from importlib import resources

    return json.loads(resources.files("batchfit").joinpath("search/schemas/search_result.schema.json").read_text())


def test_a_library_result_and_a_cached_one_validate_against_the_shipped_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    case = CASES[0]
    measured = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), cache=tmp_path)
    cached = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), cache=tmp_path)
    assert measured.trials and not cached.trials
    for result in (measured, cached):
        jsonschema.validate(json.loads(json.dumps(result.to_dict())), result_schema())


def test_max_batch_size_is_the_callers_cap_and_upper_bound_the_largest_size_considered():
    case = CASES[0]
    uncapped = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), strategy="binary")
    assert uncapped.max_batch_size is None  # no cap given
    assert uncapped.upper_bound > uncapped.batch_size  # the free memory over one sample's bytes
    capped = bf.search_workload(
        case.build(), device=bf.SimulatedDevice(case.capacity), strategy="binary", max_batch_size=16
    )
    assert capped.max_batch_size == capped.upper_bound == capped.batch_size == 16 and capped.exact
    data = capped.to_dict()
    assert (data["max_batch_size"], data["upper_bound"]) == (16, 16)
    assert uncapped.to_dict()["max_batch_size"] is None


def test_a_trial_summarises_itself_in_one_line():
    case = CASES[0]
    result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=False)
    fitted = next(t for t in result.trials if t.fits)
    failed = next(t for t in result.trials if not t.fits)
    assert fitted.summary() == f"batch size {fitted.batch_size}: fits, peak {bf.format_bytes(fitted.peak_bytes)}"
    assert failed.summary() == f"batch size {failed.batch_size}: does not fit (out of memory in {failed.failed_phase})"
    assert "\n" not in fitted.summary() + failed.summary()
    assert fitted.to_dict()["batch_size"] == fitted.batch_size


def test_find_and_probe_keep_their_keywords_and_check_them_before_any_trial():
    work = CASES[0].build()
    for bad in ({"min_batch_size": 0}, {"steps": 0}, {"max_trials": 0}, {"strategy": "nope"}):
        with pytest.raises(ValueError):
            bf.find_max_batch_size(work.model, work.sample_batch, loss_fn=work.loss_fn, device="sim:1MiB", **bad)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        bf.probe_batch_size(work.model, work.sample_batch, 4, loss_fn=work.loss_fn, device="sim:1MiB", steps=0)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"margin": "abc"}, ValueError, "not a size"),
        ({"margin": 1.5}, ValueError, r"fractional margin must be in \[0, 1\)"),
        ({"margin": True}, TypeError, "margin must be bytes"),
        ({"cache": 5}, TypeError, "cache must be True, False, a folder or a ResultCache"),
        ({"agree": "yes"}, TypeError, "agree must be True, False or None"),
        ({"steps": True}, ValueError, "steps must be at least 1"),
    ],
    ids=lambda value: str(value) if isinstance(value, dict) else "",
)
def test_settings_refuse_a_bad_value_when_built_before_any_trial(bad, error, match):
    with pytest.raises(error, match=match):
        bf.SearchSettings(**bad)


def test_a_search_traces_first_only_with_auto_trace_a_known_memory_and_a_real_device():
    from batchfit.search.runner import traces_first

    work, sim, default = mlp_tuple(), bf.SimulatedDevice("1MiB"), bf.SearchSettings()
    assert traces_first(work, default, sim, 1 << 20)
    assert not traces_first(work, default, sim, None)  # no capacity: nothing to aim the trace at
    assert not traces_first(work, default, bf.TraceDevice("1MiB"), 1 << 20)  # already fake tensors
    assert not traces_first(work, default.replace(trace=False), sim, 1 << 20)
    assert not traces_first(work, default.replace(strategy="binary"), sim, 1 << 20)


def test_max_seconds_starts_no_trial_predicted_to_end_past_the_budget():
    case = CASES[0]
    device = bf.SimulatedDevice(case.capacity, step_seconds=0.2)  # trials at 2 and 3: about 0.4 s each
    result = bf.search_workload(case.build(), device=device, trace=False, max_seconds=2.0)
    # 2 and 3 fit in about 0.8 s; the edge's trial, predicted at 0.4 s x edge / 3 > 1.2 s left, is not started
    assert [t.batch_size for t in result.trials] == [2, 3] and result.extra["stopped_by"] == "max_seconds"
    assert result.seconds < 2.0
