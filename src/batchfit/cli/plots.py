"""A picture of a search: peak memory against batch size (matplotlib, an optional extra)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from batchfit.errors import InputError
from batchfit.files import atomic_write_bytes
from batchfit.search.memory_model import MemoryModel
from batchfit.search.result import SearchResult

MIB = 2**20
PLOT_SIZE_PX = (1000, 600)


def load_pyplot():
    """matplotlib's pyplot on the Agg backend, or a ``ValueError`` naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'batchfit[plot]' (or pip install matplotlib)") from None
    return pyplot


def plot_search(result: SearchResult, path: str | Path) -> Path:
    """Write a PNG of every trial's peak, the fitted memory model, the capacity and the answer."""
    pyplot = load_pyplot()
    dpi = 100
    figure, axes = pyplot.subplots(figsize=(PLOT_SIZE_PX[0] / dpi, PLOT_SIZE_PX[1] / dpi), dpi=dpi)
    fitting = [t for t in result.trials if t.fits]
    failed = [t for t in result.trials if not t.fits]
    capacity_mib = result.capacity_bytes / MIB if result.capacity_bytes else None
    largest = max(t.batch_size for t in result.trials)
    model = MemoryModel.fit(result.trials)
    if model is not None:  # a max of lines: 400 points and the trial sizes draw it faithfully
        sizes = sorted({*np.linspace(1, largest + 1, 400).astype(int).tolist(), *(t.batch_size for t in result.trials)})
        axes.plot(
            sizes,
            [model.predict_peak_bytes(b) / MIB for b in sizes],
            color="tab:blue",
            alpha=0.5,
            label=f"memory model ({model.kind})",
        )
    axes.scatter(
        [t.batch_size for t in fitting],
        [t.peak_bytes / MIB for t in fitting],
        color="tab:green",
        zorder=3,
        label="fits (measured peak)",
    )
    if failed:
        top = [t.peak_bytes / MIB if t.peak_bytes else capacity_mib or 0 for t in failed]
        axes.scatter(
            [t.batch_size for t in failed], top, color="tab:red", marker="x", s=80, zorder=3, label="out of memory"
        )
    if capacity_mib:
        axes.axhline(capacity_mib, color="black", linestyle="--", label=f"capacity {capacity_mib:,.1f} MiB")
    if result.limit_bytes and result.limit_bytes != result.capacity_bytes:
        axes.axhline(result.limit_bytes / MIB, color="grey", linestyle=":", label="capacity minus margin")
    axes.axvline(result.batch_size, color="tab:green", linestyle="-.", label=f"chosen: {result.batch_size}")
    for order, trial in enumerate(result.trials, 1):
        y = trial.peak_bytes / MIB if trial.peak_bytes else capacity_mib or 0
        axes.annotate(str(order), (trial.batch_size, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set(
        xlabel="batch size",
        ylabel="peak memory (MiB)",
        title=f"{result.workload} on {result.device}: largest batch {result.batch_size}",
    )
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    pyplot.close(figure)
    return atomic_write_bytes(path, buffer.getvalue())


def plot_throughput(result, path: str | Path) -> Path:
    """Write a PNG of samples/s and peak memory against batch size, with the knee and the choice."""
    pyplot = load_pyplot()
    dpi = 100
    figure, rate_axes = pyplot.subplots(figsize=(PLOT_SIZE_PX[0] / dpi, PLOT_SIZE_PX[1] / dpi), dpi=dpi)
    sizes = [p.batch_size for p in result.points]
    rate_axes.plot(sizes, [p.samples_per_second for p in result.points], "o-", color="tab:blue", label="samples/s")
    rate_axes.set(
        xscale="log",
        xlabel="batch size",
        ylabel="samples/s",
        title=f"Throughput: use {result.batch_size} (best {result.best_batch_size})",
    )
    memory_axes = rate_axes.twinx()
    memory_axes.plot(
        sizes, [(p.peak_bytes or 0) / MIB for p in result.points], "s--", color="tab:orange", label="peak memory (MiB)"
    )
    memory_axes.set_ylabel("peak memory (MiB)")
    rate_axes.axvline(result.batch_size, color="tab:green", linestyle="-.", label=f"chosen: {result.batch_size}")
    knee = result.knee(0.9)
    if knee is not None and min(sizes) <= knee <= 4 * max(sizes):
        rate_axes.axvline(knee, color="grey", linestyle=":", label=f"90% knee of the fit: {knee:,.0f}")
    handles = rate_axes.get_legend_handles_labels()[0] + memory_axes.get_legend_handles_labels()[0]
    rate_axes.legend(handles=handles, loc="lower right")
    rate_axes.grid(alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    pyplot.close(figure)
    return atomic_write_bytes(path, buffer.getvalue())


def plot_frontier(frontier, path: str | Path) -> Path:
    """Write a PNG of the checkpointing frontier: samples/s against peak memory, one line per policy through
    the micro-batches it timed, with the choice marked."""
    pyplot = load_pyplot()
    dpi = 100
    figure, axes = pyplot.subplots(figsize=(PLOT_SIZE_PX[0] / dpi, PLOT_SIZE_PX[1] / dpi), dpi=dpi)
    for policy in frontier.policies:
        points = [p for p in (policy.throughput.points if policy.throughput else []) if p.peak_bytes]
        if points:
            memory = [p.peak_bytes / MIB for p in points]
            axes.plot(memory, [p.samples_per_second for p in points], "o-", label=f"{policy.policy}")
    chosen = frontier.choice
    policy = next(p for p in frontier.policies if p.policy == chosen.policy)
    point = policy.point(chosen.micro_batch_size)
    if point is not None and point.peak_bytes:
        axes.plot([point.peak_bytes / MIB], [point.samples_per_second], "*", markersize=18, color="black")
    target = f", global batch {frontier.global_batch_size}" if frontier.global_batch_size else ""
    axes.set(
        xlabel="peak memory (MiB)",
        ylabel="samples/s (one device)",
        title=f"Activation checkpointing on {frontier.device}{target}\nchosen (star): {chosen.policy}, {chosen.split}",
    )
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    pyplot.close(figure)
    return atomic_write_bytes(path, buffer.getvalue())
