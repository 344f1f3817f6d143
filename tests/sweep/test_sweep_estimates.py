"""Where a sweep's starting estimate comes from: scale-factor rules (JSON or TOML) and
the memory model fitted across configurations."""

from __future__ import annotations

import json
import sys

import pytest

from batchfit.sweep.crossconfig import CrossConfigModel
from batchfit.sweep.crossconfig import MeasuredConfig
from batchfit.sweep.rules import ScaleRules

PROFILING_RULES = {  # a profiling sweep's scale tables: crops, top-k, active blocks
    "base_batch_size": 64,
    "knobs": {
        "max_crops": [
            {"upto": 2, "scale": 1.0},
            {"upto": 4, "scale": 0.8},
            {"upto": 6, "scale": 0.6},
            {"upto": 8, "scale": 0.5},
            {"upto": 10, "scale": 0.4},
            {"upto": 12, "scale": 0.3},
            {"scale": 0.25},
        ],
        "top_k": [{"upto": 2, "scale": 1.0}, {"upto": 4, "scale": 0.9}, {"upto": 8, "scale": 0.8}, {"scale": 0.7}],
        "num_active_blocks": {"ratio_of": 24},
    },
}


def test_the_rules_reproduce_a_profiling_sweeps_scale_tables():
    rules = ScaleRules.from_dict(PROFILING_RULES)
    crops = [rules.estimate({"max_crops": c}) for c in (2, 4, 6, 8, 10, 12, 13)]
    assert crops == [64, 51, 38, 32, 25, 19, 16]  # base 64 times each crops step's scale
    assert [rules.estimate({"top_k": k}) for k in (1, 4, 8, 16)] == [64, 57, 51, 44]
    assert rules.estimate({"num_active_blocks": 12}) == 32  # depth ratio 12/24
    assert rules.estimate({"max_crops": 12, "top_k": 4}) == int(64 * 0.3 * 0.9)  # knobs multiply


def test_the_base_comes_from_the_file_or_the_upper_limit():
    rules = ScaleRules.from_dict({"knobs": {"top_k": [{"scale": 0.5}]}})
    assert rules.estimate({"top_k": 3}) is None
    assert rules.estimate({"top_k": 3}, base_batch_size=40) == 20


def test_rules_load_from_json_and_toml(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(PROFILING_RULES))
    assert ScaleRules.load(tmp_path / "r.json").estimate({"max_crops": 12}) == 19
    if sys.version_info >= (3, 11):
        (tmp_path / "r.toml").write_text(
            "base_batch_size = 64\n[[knobs.max_crops]]\nupto = 12\nscale = 0.3\n[[knobs.max_crops]]\nscale = 0.25\n"
        )
        assert ScaleRules.load(tmp_path / "r.toml").estimate({"max_crops": 13}) == 16


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "need a 'knobs' table"),
        ({"knobs": {"k": []}}, "list of steps or a ratio_of"),
        ({"knobs": {"k": [{"upto": 2}]}}, r"needs a scale in \(0, 1\]"),
        ({"knobs": {"k": [{"scale": 1.5}]}}, r"needs a scale in \(0, 1\]"),
        ({"knobs": {"k": {"ratio_of": 0}}}, "positive ratio_of"),
        ({"base_batch_size": 0, "knobs": {}}, "base_batch_size must be a positive integer"),
    ],
)
def test_bad_rules_are_clear_errors(data, message):
    with pytest.raises(ValueError, match=message):
        ScaleRules.from_dict(data)


def test_bad_rules_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ScaleRules.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ScaleRules.load(tmp_path / "bad.json")
    rules = ScaleRules.from_dict({"knobs": {"k": [{"upto": 2, "scale": 1.0}]}})
    with pytest.raises(ValueError, match="above every step"):
        rules.estimate({"k": 3}, base_batch_size=8)


def measured(seq_len: int, layers: int, limit: int = 10_000) -> MeasuredConfig:
    """A synthetic workload: held bytes grow with layers, per-sample bytes with seq_len x layers."""
    held = 500 * layers
    per_sample = 3 * seq_len * layers
    batch = (limit - held) // per_sample
    return MeasuredConfig({"seq_len": seq_len, "layers": layers}, batch, held + batch * per_sample, held)


def test_the_model_predicts_an_unmeasured_configuration_from_power_laws():
    model = CrossConfigModel.fit([measured(8, 1), measured(16, 1), measured(8, 2)])
    assert model is not None and model.knobs == ("seq_len", "layers")
    assert model.predict_batch_size({"seq_len": 16, "layers": 2}, 10_000) == measured(16, 2).batch_size
    assert model.predict_batch_size({"seq_len": 32, "layers": 1}, 10_000) == pytest.approx(
        measured(32, 1).batch_size, abs=1
    )


def test_the_model_does_not_guess_outside_what_it_has_seen():
    assert CrossConfigModel.fit([measured(8, 1)]) is None  # one point gives no law
    model = CrossConfigModel.fit([measured(8, 1), measured(16, 1)])
    assert model.knobs == ("seq_len",) and model.fixed == {"layers": 1}
    assert model.predict_batch_size({"seq_len": 16, "layers": 2}, 10_000) is None  # layers never varied
    assert CrossConfigModel.fit([measured(8, 1), measured(16, 2)]) is None  # two knobs vary, two points
    words = [MeasuredConfig({"mode": m}, 4, 400, 100) for m in ("a", "b")]
    assert CrossConfigModel.fit(words) is None  # a varying knob that is not a number
