"""The gradient noise scale against brute force, its invariances, the plan at the critical batch,
goodput against the analytic optimum, and the critical batch found by training at each size."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.planning.noise import NoiseScaleEstimator
from batchfit.planning.noise import goodput_optimal_batch
from batchfit.planning.noise import two_batch_estimates
from batchfit.throughput import ThroughputPoint
from batchfit.throughput import ThroughputResult
from noise_data import POPULATION
from noise_data import loader
from noise_data import regression


def brute_force(model, inputs, targets) -> tuple[float, float]:
    """|G|² and tr Σ (1/N normalisation) from every example's own gradient."""
    grads = []
    for n in range(POPULATION):
        model.zero_grad()
        F.mse_loss(model(inputs[n : n + 1]), targets[n : n + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    per_example = torch.stack(grads)
    mean = per_example.mean(0)
    return float(mean.pow(2).sum()), float((per_example - mean).pow(2).sum(1).mean())


def scaled_loss(scale: float):
    return lambda output, targets: F.mse_loss(output, targets) * scale


@pytest.mark.slow  # an accuracy campaign against brute force: make reliability runs it
def test_the_estimate_matches_brute_force_within_two_percent():
    model, inputs, targets = regression()
    grad_norm_sq, trace_sigma = brute_force(model, inputs, targets)
    before = [p.detach().clone() for p in model.parameters()]
    noise = bf.measure_noise_scale(
        model, loader(inputs, targets, 64), loss_fn=F.mse_loss, steps=2000, micro_batch_size=8
    )
    assert noise.grad_norm_sq == pytest.approx(grad_norm_sq, rel=0.02)
    assert noise.trace_sigma == pytest.approx(trace_sigma, rel=0.02)
    assert noise.b_simple == pytest.approx(trace_sigma / grad_norm_sq, rel=0.03)
    low, high = noise.critical_range
    assert low < noise.b_simple < high and 0 < noise.b_simple_stderr < 0.05 * noise.b_simple
    assert (noise.small_batch_size, noise.big_batch_size, noise.steps) == (8, 64, 2000)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # a fixed point
    assert all(p.grad is None for p in model.parameters())


def test_a_constant_on_the_loss_or_a_grad_scaler_leaves_it_unchanged():
    model, inputs, targets = regression()
    plain = bf.measure_noise_scale(model, loader(inputs, targets, 16), loss_fn=F.mse_loss, steps=30, micro_batch_size=4)
    times = bf.measure_noise_scale(
        model, loader(inputs, targets, 16), loss_fn=scaled_loss(1000.0), steps=30, micro_batch_size=4
    )
    assert times.b_simple == pytest.approx(plain.b_simple, rel=1e-9)
    assert times.grad_norm_sq == pytest.approx(plain.grad_norm_sq * 1e6, rel=1e-9)  # the statistics are the loss's
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled = bf.measure_noise_scale(
        model, loader(inputs, targets, 16), loss_fn=F.mse_loss, steps=30, micro_batch_size=4, scaler=scaler
    )
    assert (scaled.b_simple, scaled.grad_norm_sq) == pytest.approx((plain.b_simple, plain.grad_norm_sq), rel=1e-9)


def test_a_summed_loss_is_turned_into_a_mean():
    model, inputs, targets = regression()
    mean = bf.measure_noise_scale(model, loader(inputs, targets, 16), loss_fn=F.mse_loss, steps=20, micro_batch_size=4)
    summed = bf.measure_noise_scale(
        model,
        loader(inputs, targets, 16),
        steps=20,
        micro_batch_size=4,
        reduction="sum",
        loss_fn=lambda out, y: F.mse_loss(out, y, reduction="sum"),
    )
    assert (summed.b_simple, summed.trace_sigma) == pytest.approx((mean.b_simple, mean.trace_sigma), rel=1e-9)


def test_with_an_optimizer_it_trains_on_the_big_batch_gradient():
    model, inputs, targets = regression()
    reference = regression()[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bf.measure_noise_scale(
        model, loader(inputs, targets, 16), loss_fn=F.mse_loss, steps=3, micro_batch_size=4, optimizer=optimizer
    )
    data = loader(inputs, targets, 16)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(3):  # plain full-batch SGD on the same batches
        x, y = next(data)
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for trained, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(trained, expected, atol=1e-12)


def test_the_ratio_of_averages_not_the_average_of_ratios():
    estimator = NoiseScaleEstimator()
    estimator.update(*_statistics(grad_norm_sq=1.0, trace_sigma=10.0))
    estimator.update(*_statistics(grad_norm_sq=3.0, trace_sigma=10.0))
    assert estimator.result().b_simple == pytest.approx(20.0 / 4.0)  # not (10 + 10/3) / 2


def _statistics(grad_norm_sq: float, trace_sigma: float, small: int = 4, big: int = 16) -> tuple:
    return grad_norm_sq + trace_sigma / small, small, grad_norm_sq + trace_sigma / big, big


def test_two_batch_estimates_invert_the_expectation_exactly():
    assert two_batch_estimates(*_statistics(2.5, 40.0)) == pytest.approx((2.5, 40.0))
    with pytest.raises(ValueError, match="big batch must be larger"):
        two_batch_estimates(1.0, 8, 1.0, 8)


def test_an_ema_follows_recent_steps():
    estimator = NoiseScaleEstimator(ema_decay=0.5)
    for grad_norm_sq in (10.0, 10.0, 1.0, 1.0, 1.0, 1.0):
        estimator.update(*_statistics(grad_norm_sq, 10.0))
    weights = [0.5**k for k in range(5, -1, -1)]  # oldest to newest
    recent = sum(w * g for w, g in zip(weights, (10, 10, 1, 1, 1, 1), strict=True)) / sum(weights)
    assert estimator.result().b_simple == pytest.approx(10.0 / recent)  # 7.0, where a plain average gives 2.5
    with pytest.raises(ValueError, match="ema_decay must be in"):
        NoiseScaleEstimator(ema_decay=1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 1}, "steps must be an integer of at least 2"),
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer"),
        ({"reduction": "max"}, "reduction must be 'mean' or 'sum'"),
        ({"optimizer": "sgd"}, "optimizer must be a torch.optim.Optimizer"),
        ({"micro_batch_size": 16}, "needs at least two small batches per step"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    model, inputs, targets = regression()
    with pytest.raises((ValueError, TypeError), match=message):
        bf.measure_noise_scale(model, loader(inputs, targets, 16), loss_fn=F.mse_loss, **kwargs)
    with pytest.raises(ValueError, match="the loader gave no batch"):
        bf.measure_noise_scale(model, [], loss_fn=F.mse_loss)


def test_the_plan_at_the_critical_batch_reports_the_tradeoff():
    noise = bf.NoiseScale(300.0, 10.0, 1.0, 300.0, 50, 8, 64, (290.0, 310.0))
    plan = bf.plan_batch(micro_batch_size=16, devices=2, global_batch_size="critical", noise_scale=noise)
    assert plan.global_batch_size == 288 and plan.exact  # the multiple of 16 x 2 nearest 300
    critical = plan.to_dict()["critical_batch"]
    assert critical["steps_ratio"] == pytest.approx(1 + 300 / 288) and critical["samples_ratio"] == pytest.approx(
        1 + 288 / 300
    )
    assert (critical["steps_ratio"] - 1) * (critical["samples_ratio"] - 1) == pytest.approx(1.0)  # McCandlish eq. 2.11
    assert any("noise scale of 300" in line for line in plan.advice)
    capped = bf.plan_batch(micro_batch_size=4, global_batch_size="critical", noise_scale=1e7)
    assert capped.global_batch_size == 4 * 256 and any("capped" in w for w in capped.warnings)
    with pytest.raises(ValueError, match="needs noise_scale"):
        bf.plan_batch(micro_batch_size=16, global_batch_size="critical")
    with pytest.raises(ValueError, match="positive B_simple"):
        bf.plan_batch(micro_batch_size=16, global_batch_size=64, noise_scale=-3)


@pytest.mark.parametrize(("alpha", "beta", "phi"), [(0.05, 0.0004, 500.0), (0.2, 0.001, 37.0), (0.01, 0.002, 2000.0)])
def test_the_goodput_optimum_is_the_analytic_one(alpha, beta, phi):
    best = math.sqrt(phi * alpha / beta)
    found = goodput_optimal_batch(alpha, beta, phi, 100_000)
    brute = max(range(1, 20_000), key=lambda b: b / ((alpha + beta * b) * (phi + b)))
    assert found == brute and abs(found - best) < 1
    points = [
        ThroughputPoint(b, alpha + beta * b, b / (alpha + beta * b), None, None)
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    ]
    line = ThroughputResult(512, 1024, 1024, 0.05, points, alpha, beta, "synthetic")
    result = bf.goodput(line, phi)
    assert result.optimal_batch_size == min(found, 1024)
    measured_best = max(points, key=lambda p: p.samples_per_second * (phi + 1) / (phi + p.batch_size))
    assert result.best_measured_batch_size == measured_best.batch_size


def test_training_on_equal_samples_finds_where_validation_loss_stops_holding_up():
    torch.manual_seed(0)
    inputs = torch.randn(2048, 8)
    targets = inputs @ torch.randn(8, 1) + torch.randn(2048, 1)  # noisy: the loss floor is about 1
    sizes = (4, 8, 16, 32, 64, 128, 256)

    def build(lr):
        model = nn.Linear(8, 1)
        return model, torch.optim.SGD(model.parameters(), lr=min(lr, 0.2))  # the LR cannot scale without bound

    result = bf.critical_batch_by_training(
        build,
        (inputs[:1536], targets[:1536]),
        (inputs[1536:], targets[1536:]),
        samples=1024,
        base_lr=0.01,
        batch_sizes=sizes,
        loss_fn=F.mse_loss,
        tolerance=0.1,
    )
    losses = {p.batch_size: p.validation_loss for p in result.points}
    assert [p.steps for p in result.points] == [1024 // b for b in sizes]
    assert [p.learning_rate for p in result.points] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64])
    best = min(losses.values())
    assert all(losses[b] <= 1.1 * best for b in sizes if b <= result.critical_batch_size)  # the plateau
    assert result.critical_batch_size == 128 and losses[256] > 1.1 * best  # four steps at a capped LR fall short
    assert "up to batch size 128" in result.summary()
    with pytest.raises(ValueError, match="larger than the training data"):
        bf.critical_batch_by_training(
            build,
            (inputs[:8], targets[:8]),
            (inputs, targets),
            samples=64,
            base_lr=0.1,
            batch_sizes=(16,),
            loss_fn=F.mse_loss,
        )


def test_passively_inside_gradient_accumulation_it_matches_the_active_measurement():
    model, inputs, targets = regression()
    active = bf.measure_noise_scale(
        model, loader(inputs, targets, 64), loss_fn=F.mse_loss, steps=25, micro_batch_size=8
    )
    estimator = NoiseScaleEstimator()
    accumulator = bf.GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=F.mse_loss, micro_batch_size=8, noise=estimator
    )
    data = loader(inputs, targets, 64)
    for _ in range(25):
        accumulator.step(next(data))
    passive = estimator.result()
    assert (passive.b_simple, passive.grad_norm_sq, passive.trace_sigma) == pytest.approx(
        (active.b_simple, active.grad_norm_sq, active.trace_sigma), rel=1e-9
    )
    assert (passive.small_batch_size, passive.big_batch_size) == (8, 64)


def test_the_microbatcher_measures_from_the_micro_batches_that_survived_an_oom():
    model, inputs, targets = regression()
    active = bf.measure_noise_scale(
        model, loader(inputs, targets, 64), loss_fn=F.mse_loss, steps=6, micro_batch_size=16
    )
    estimator = NoiseScaleEstimator()
    batcher = bf.Microbatcher(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice("24KiB"),
        micro_batch_size=64,
        noise=estimator,
    )
    data = loader(inputs, targets, 64)
    for _ in range(6):
        batcher.step(next(data))
    assert batcher.history[0].ooms == 2 and batcher.current_micro_batch_size == 16  # 64 and 32 ran out of memory
    passive = estimator.result()
    assert passive.steps == 6 and passive.small_batch_size == 16
    assert passive.b_simple == pytest.approx(active.b_simple, rel=1e-9)


def test_the_noise_scale_and_goodput_summarise_and_serialise():
    noise = bf.NoiseScale(300.0, 10.0, 1.0, 300.0, 50, 8, 64, (290.0, 310.0))
    assert json.loads(json.dumps(noise.to_dict()))["critical_range"] == [290.0, 310.0]
    assert noise.summary().startswith("Gradient noise scale B_simple = 300.0 ± 10.0 over 50 steps")
    points = [ThroughputPoint(b, 0.1 + 0.001 * b, b / (0.1 + 0.001 * b), None, None) for b in (1, 4, 16, 64, 256)]
    found = bf.goodput(ThroughputResult(64, 256, 256, 0.05, points, 0.1, 0.001, "synthetic"), 400.0)
    assert json.loads(json.dumps(found.to_dict()))["optimal_batch_size"] == found.optimal_batch_size == 200
    assert found.summary() == (
        "With a gradient noise scale of 400, goodput (throughput x statistical efficiency, Pollux) is best at "
        f"batch {found.best_measured_batch_size} of those measured; the fitted line peaks at 200 (sqrt(B_simple x alpha / beta))."
    )
