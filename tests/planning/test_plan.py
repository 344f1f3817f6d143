"""The planner: worked examples exactly (token budgets by accumulation, devices, linear learning-rate
scaling, Goyal et al.'s warmup), the warnings it gives, and bad inputs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from batchfit.planning.advice import REFERENCE_BATCHES
from batchfit.planning.advice import batch_schedule
from batchfit.planning.advice import reference
from batchfit.planning.advice import starting_range
from batchfit.planning.advice import workload_distribution
from batchfit.planning.lr import scale_learning_rate
from batchfit.planning.lr import suggested_warmup_epochs
from batchfit.planning.lr import warmup_need
from batchfit.planning.plan import AdviceInputs
from batchfit.planning.plan import BatchTarget
from batchfit.planning.plan import LearningRateConfig
from batchfit.planning.plan import TrainingRun
from batchfit.planning.plan import plan_batch


def test_a_token_budget_is_reached_by_accumulation():
    plan = plan_batch(micro_batch_size=16, global_batch_tokens=32768, seq_len=256, devices=1)
    assert (plan.gradient_accumulation_steps, plan.global_batch_tokens, plan.exact) == (8, 32768, True)
    plan = plan_batch(micro_batch_size=8, global_batch_tokens=16384, seq_len=512, devices=1)
    assert plan.gradient_accumulation_steps == 4


def test_devices_and_linear_lr_scaling_and_the_batch_configuration_json():
    assert plan_batch(micro_batch_size=64, global_batch_size=256, devices=4).global_batch_size == 256
    plan = plan_batch(micro_batch_size=64, global_batch_size=1024, devices=1, base_lr=0.1, base_batch_size=256)
    assert math.isclose(plan.learning_rate, 0.4)
    plan = plan_batch(
        micro_batch_size=64, global_batch_size=512, devices=8, base_lr=0.001, base_batch_size=128, warmup_epochs=5
    )
    configuration = plan.to_dict()["batch_configuration"]
    expected = {
        "per_gpu_batch_size": 64,
        "total_batch_size": 512,
        "gradient_accumulation_steps": 1,
        "learning_rate": 0.004,
        "warmup_epochs": 5,
    }
    assert {key: configuration[key] for key in expected} == pytest.approx(expected)
    assert list(configuration)[:5] == list(expected)


def test_an_uneven_target_uses_an_exact_smaller_micro_batch():
    plan = plan_batch(micro_batch_size=16, global_batch_size=120, devices=1)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.exact) == (15, 8, True)


def test_an_unsplittable_target_is_stated_never_silently_changed():
    plan = plan_batch(micro_batch_size=24, global_batch_size=1000, devices=3)
    assert not plan.exact and plan.global_batch_size == 1008 and plan.target_samples == 1000
    assert plan.deviation == pytest.approx(0.008)
    assert any("the global batch is 1008, not the 1000 asked for (+0.8%)" in w for w in plan.warnings)
    assert plan.to_dict()["batch_configuration"]["exact"] is False


def test_learning_rate_scaling_rules_and_the_imagenet_warmup_in_steps():
    assert scale_learning_rate(1e-3, 4, "sqrt") == pytest.approx(2e-3)
    assert scale_learning_rate(1e-3, 4, "none") == 1e-3
    assert [warmup_need(s) for s in (2, 4, 8, 16)] == ["none", "optional", "required", "critical"]
    assert suggested_warmup_epochs(32) == 5  # Goyal et al.'s 5 epochs at 8192 vs 256
    plan = plan_batch(
        micro_batch_size=32,
        global_batch_size=4096,
        devices=8,
        base_lr=0.1,
        base_batch_size=256,
        dataset_size=1_281_167,
        epochs=90,
    )
    assert plan.warmup == "critical" and plan.warmup_epochs == 4
    assert plan.steps_per_epoch == math.ceil(1_281_167 / 4096) and plan.warmup_steps == 4 * plan.steps_per_epoch
    assert plan.total_steps == 90 * plan.steps_per_epoch


def test_the_lr_scheduler_warms_up_then_follows_cosine():
    plan = plan_batch(
        micro_batch_size=32,
        global_batch_size=1024,
        devices=1,
        base_lr=0.1,
        base_batch_size=256,
        dataset_size=10_240,
        epochs=10,
    )
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=plan.learning_rate)
    scheduler = plan.lr_scheduler(optimizer)
    rates = []
    for _ in range(plan.total_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = plan.warmup_steps
    assert warmup == 2 * 10 and rates[0] == 0 and rates[warmup] == pytest.approx(0.4)
    assert rates[warmup // 2] == pytest.approx(0.2) and rates[-1] < 0.01


@pytest.mark.parametrize(
    ("kwargs", "warning"),
    [
        ({"micro_batch_size": 4, "global_batch_size": 128}, "32 accumulation steps: every optimizer step runs 32"),
        ({"micro_batch_size": 1, "global_batch_size": 128}, "outside the 2-64 range"),
        ({"micro_batch_size": 8, "global_batch_size": 64, "has_batchnorm": True}, "BatchNorm with accumulation"),
        (
            {"micro_batch_size": 64, "global_batch_size": 512, "fine_tuning": True},
            "for fine-tuning: 16-32 is usual",
        ),
        (
            {
                "micro_batch_size": 64,
                "global_batch_size": 512,
                "base_lr": 0.1,
                "base_batch_size": 128,
                "lr_scaling": "none",
            },
            "is not scaled",
        ),
        ({"micro_batch_size": 64, "global_batch_size": 64}, "just use the maximum that fits"),
        ({"micro_batch_size": 64, "global_batch_size": 1024, "goal": "accuracy"}, "goal 'accuracy'"),
        (
            {
                "micro_batch_size": 64,
                "global_batch_size": 2048,
                "base_lr": 0.1,
                "base_batch_size": 256,
                "warmup_epochs": 0,
            },
            "warmup is required",
        ),
    ],
)
def test_each_risky_plan_gets_its_warning(kwargs, warning):
    plan = plan_batch(devices=1, **kwargs)
    assert any(warning in w for w in plan.warnings), plan.warnings


def test_advice_is_reported_with_its_source_and_never_applied():
    plan = plan_batch(
        micro_batch_size=64,
        global_batch_size=1024,
        devices=1,
        base_lr=0.1,
        base_batch_size=256,
        weight_decay=1e-4,
        capacity_gib=12,
        goal="memory",
        fine_tuning=True,
    )
    text = " | ".join(plan.advice)
    assert "weight decay 0.0001 -> 0.0002 (scaled by sqrt of the batch ratio; a heuristic)" in text
    assert "label smoothing" in text and "starts at a batch of 32-64" in text and "goal 'memory'" in text
    assert plan.learning_rate == pytest.approx(0.4)  # advice changed nothing
    assert starting_range(4) == (16, 32) and starting_range(40) == (128, 256)


def test_reference_batches_for_model_families():
    assert reference("GPT2")["global_batch"] == 32_768 and reference("llama")["global_batch"] == 4_194_304
    assert (
        REFERENCE_BATCHES["resnet50-imagenet"]["learning_rate"] == 0.1 and reference("bert")["global_batch"] == 262_144
    )
    with pytest.raises(ValueError, match="unknown model family 'vgg'"):
        reference("vgg")


def test_heterogeneous_workers_get_shares_proportional_to_throughput():
    plan = plan_batch(
        micro_batch_size=32, global_batch_size=100, devices=2, worker_throughput={"fast": 300.0, "slow": 100.0}
    )
    calibration = plan.to_dict()["hardware_calibration"]
    assert calibration["workload_distribution"] == {"fast": 0.75, "slow": 0.25}
    assert calibration["samples_per_step"] == {"fast": 75, "slow": 25}
    equal = workload_distribution(
        {f"worker-{i}": 0.85 for i in range(4)}, 256
    )  # four equal workers, as in the planning rules' example
    assert set(equal["workload_distribution"].values()) == {0.25} and sum(equal["samples_per_step"].values()) == 256


def test_a_batch_size_schedule_ramps_by_accumulation_with_the_lr_following():
    stages = batch_schedule(64, 512, 8, micro_batch_size=32, devices=2, base_lr=0.1, base_batch_size=256)
    assert stages[0].global_batch_size == 64 and stages[-1].global_batch_size == 512
    assert all(s.global_batch_size == 64 * s.gradient_accumulation_steps for s in stages)
    assert all(s.learning_rate == pytest.approx(0.1 * s.global_batch_size / 256) for s in stages)
    exponential = batch_schedule(64, 512, 4, micro_batch_size=64, ramp="exponential")
    assert [s.global_batch_size for s in exponential] == [64, 128, 256, 512]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"micro_batch_size": 16, "global_batch_size": 2, "devices": 4},
            r"smaller than one sample per device \(4 devices\)",
        ),
        ({"micro_batch_size": 16, "global_batch_size": 64, "devices": 0}, "devices must be a positive integer, got 0"),
        (
            {"micro_batch_size": 16, "global_batch_size": 64, "base_lr": -0.1, "base_batch_size": 64},
            "base_lr must be a positive, finite number",
        ),
        ({"micro_batch_size": 16, "global_batch_tokens": 4096}, "global_batch_tokens needs seq_len"),
        (
            {"micro_batch_size": 16, "global_batch_size": 64, "global_batch_tokens": 4096, "seq_len": 64},
            "give exactly one target",
        ),
        ({"micro_batch_size": 16}, "give exactly one target"),
        ({"micro_batch_size": 0, "global_batch_size": 64}, "micro_batch_size must be a positive integer"),
        (
            {"micro_batch_size": 16, "global_batch_size": 64, "base_lr": 0.1},
            "give base_lr and base_batch_size together",
        ),
        (
            {
                "micro_batch_size": 16,
                "global_batch_size": 64,
                "lr_scaling": "cubic",
                "base_lr": 0.1,
                "base_batch_size": 64,
            },
            "lr_scaling must be one of",
        ),
        ({"micro_batch_size": 16, "global_batch_size": 64, "goal": "fame"}, "goal must be one of"),
    ],
)
def test_bad_inputs_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(**kwargs)


def test_a_target_below_the_micro_batch_is_planned_and_said():
    plan = plan_batch(micro_batch_size=64, global_batch_size=32, devices=1)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.exact) == (32, 1, True)
    assert any("fewer than the micro-batch of 64 that fits: the micro-batch is 32" in w for w in plan.warnings)


def test_a_model_family_supplies_the_typical_target():
    gpt2 = plan_batch(micro_batch_size=16, seq_len=1024, devices=1, model_family="gpt2")
    assert gpt2.global_batch_tokens == 32_768 and gpt2.gradient_accumulation_steps == 2
    resnet = plan_batch(micro_batch_size=64, devices=4, model_family="resnet50-imagenet")
    assert resnet.global_batch_size == 256 and resnet.learning_rate == pytest.approx(0.1)


def test_a_plan_can_carry_a_batch_size_ramp():
    plan = plan_batch(
        micro_batch_size=32,
        global_batch_size=512,
        devices=2,
        epochs=4,
        schedule_from=64,
        base_lr=0.1,
        base_batch_size=256,
    )
    ramp = plan.to_dict()["batch_schedule"]
    assert [stage["global_batch_size"] for stage in ramp] == [64, 192, 384, 512]
    assert ramp[-1]["learning_rate"] == pytest.approx(plan.learning_rate)
    with pytest.raises(ValueError, match="schedule needs epochs"):
        plan_batch(micro_batch_size=32, global_batch_size=512, schedule_from=64)


def test_review_fixes_in_the_planner():
    # a ramp towards a token target scales the learning rate in tokens
    plan = plan_batch(
        micro_batch_size=16,
        global_batch_tokens=65536,
        seq_len=256,
        devices=1,
        base_lr=3e-4,
        base_batch_size=65536,
        epochs=4,
        schedule_from=64,
    )
    assert plan.schedule[-1].learning_rate == pytest.approx(3e-4) and plan.learning_rate == pytest.approx(3e-4)
    # warmup epochs become steps without a learning rate too
    plain = plan_batch(
        micro_batch_size=16, global_batch_size=64, devices=1, warmup_epochs=1, dataset_size=640, epochs=3
    )
    assert plain.warmup_steps == 10 and plain.lr_lambda()(0) == 0.0
    # a suggested warmup longer than the run is cut to fit, and said
    short = plan_batch(
        micro_batch_size=64,
        global_batch_size=8192,
        devices=1,
        base_lr=0.1,
        base_batch_size=256,
        dataset_size=81920,
        epochs=2,
    )
    assert short.warmup_epochs == 1 and any("do not fit a 2-epoch run" in w for w in short.warnings)
    # advice in the target's unit: 128 samples of 512 tokens against a 256-sample base is 0.5x, no advice
    assert not plan_batch(
        micro_batch_size=16, global_batch_size=128, seq_len=512, base_lr=0.1, base_batch_size=256, devices=1
    ).advice
    # the closest achievable split when the target does not divide by the devices
    uneven = plan_batch(micro_batch_size=16, global_batch_size=100, devices=3)
    assert uneven.global_batch_size == 99 and any(
        "100 samples do not split evenly over 3 devices" in w for w in uneven.warnings
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_size": -100}, "dataset_size must be a positive integer"),
        ({"epochs": 0}, "epochs must be a positive integer"),
        ({"base_lr": float("nan"), "base_batch_size": 64}, "base_lr must be a positive, finite number"),
        ({"base_lr": True, "base_batch_size": 64}, "base_lr must be a positive, finite number"),
        (
            {"warmup_epochs": 5, "dataset_size": 640, "epochs": 2},
            r"warmup \(50 steps\) is longer than the run \(20 steps\)",
        ),
    ],
)
def test_more_bad_planner_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(micro_batch_size=16, global_batch_size=64, devices=1, **kwargs)


def test_the_keywords_and_the_config_objects_plan_the_same():
    keywords = {
        "micro_batch_size": 32,
        "global_batch_size": 1024,
        "devices": 2,
        "base_lr": 0.1,
        "base_batch_size": 256,
        "dataset_size": 10_240,
        "epochs": 10,
        "schedule_from": 128,
        "goal": "speed",
        "weight_decay": 1e-4,
        "worker_throughput": {"a": 2.0, "b": 1.0},
    }
    flat = plan_batch(**keywords)
    grouped = plan_batch(
        micro_batch_size=32,
        target=BatchTarget(global_batch_size=1024, devices=2),
        lr=LearningRateConfig(base_lr=0.1, base_batch_size=256),
        run=TrainingRun(dataset_size=10_240, epochs=10, schedule_from=128),
        context=AdviceInputs(goal="speed", weight_decay=1e-4, worker_throughput={"a": 2.0, "b": 1.0}),
    )
    assert grouped == flat and grouped.to_dict() == flat.to_dict()
    with pytest.raises(TypeError, match="give target=BatchTarget"):
        plan_batch(micro_batch_size=32, global_batch_size=64, target=BatchTarget(global_batch_size=128))
    with pytest.raises(TypeError, match="lr must be a LearningRateConfig"):
        plan_batch(micro_batch_size=32, global_batch_size=64, lr={"base_lr": 0.1})


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: BatchTarget(global_batch_size=0), "global_batch_size must be a positive integer, got 0"),
        (lambda: BatchTarget(global_batch_size=64, seq_len=0), "seq_len must be a positive integer, got 0"),
        (lambda: LearningRateConfig(base_lr=0.1, base_batch_size=0), "base_batch_size must be a positive integer"),
        (lambda: LearningRateConfig(warmup_steps=-1), "cannot be negative, got warmup_steps=-1"),
        (lambda: TrainingRun(epochs=3, schedule_ramp="cubic"), "schedule_ramp must be one of linear, exponential"),
        (lambda: AdviceInputs(capacity_gib=-8), "capacity_gib must be a positive number"),
        (lambda: AdviceInputs(weight_decay=-0.1), "weight_decay must be a non-negative number"),
        (lambda: AdviceInputs(model_family="vgg"), "unknown model family 'vgg'"),
        (lambda: AdviceInputs(worker_throughput={"a": 0.0}), "worker throughput must be positive"),
    ],
)
def test_each_config_is_checked_when_built(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_plan_and_its_inputs_are_frozen_and_the_callers_objects_untouched():
    throughput = {"fast": 300.0, "slow": 100.0}
    context = AdviceInputs(worker_throughput=throughput)
    throughput["slow"] = 1.0  # the caller changes its dict after building the config
    plan = plan_batch(micro_batch_size=32, global_batch_size=100, devices=2, context=context)
    assert plan.hardware_calibration["samples_per_step"] == {"fast": 75, "slow": 25}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.learning_rate = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.goal = "speed"


def test_a_plan_summarises_in_one_sentence_and_serialises_to_json():
    plan = plan_batch(
        micro_batch_size=16,
        global_batch_tokens=32768,
        seq_len=256,
        devices=1,
        base_lr=3e-4,
        base_batch_size=8192,
        dataset_size=12_800,
        epochs=4,
    )
    assert plan.summary() == (
        "16 per device x 8 accumulation steps x 1 device(s) = 128 samples (32,768 tokens) per optimizer step, "
        "learning rate 0.0012 with 200 warmup steps."
    )
    document = json.loads(json.dumps(plan.to_dict()))
    assert document["batch_configuration"]["warmup_steps"] == 200 == plan.warmup_steps
    inexact = plan_batch(micro_batch_size=24, global_batch_size=1000, devices=3)
    assert inexact.summary().endswith("= 1008 samples per optimizer step (+0.8% from the 1000 asked for).")


def test_warnings_and_advice_state_their_reasons_not_internal_document_names():
    plans = [
        plan_batch(devices=1, **kwargs)
        for kwargs in (
            {"micro_batch_size": 1, "global_batch_size": 128, "has_batchnorm": True, "fine_tuning": True},
            {"micro_batch_size": 64, "global_batch_size": 64, "goal": "speed", "capacity_gib": 12},
            {"micro_batch_size": 64, "global_batch_size": 1024, "goal": "accuracy", "weight_decay": 1e-4}
            | {"base_lr": 0.1, "base_batch_size": 64, "lr_scaling": "none", "warmup_epochs": 0},
            {"micro_batch_size": 16, "global_batch_size": 64, "goal": "memory"},
        )
    ]
    lines = [line for plan in plans for line in plan.warnings + plan.advice]
    assert len(lines) >= 12 and not [line for line in lines if "seed" in line.lower()]
