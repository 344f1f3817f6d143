"""Benchmark: every method when trials are cheap and when they are expensive, side by side.

Two regimes on ``SimulatedDevice``: cheap trials (the CPU step as it is, ``step_seconds=0``) and
expensive ones (``step_seconds=1``: every completed training step also sleeps a second, as a
large model's step on a GPU takes seconds). For each case (a workload on a simulated capacity)
and method: the size found against the true edge, real trials, OOM trials, completed training
steps and wall seconds, and the wall time over the fastest exact method's on that case.

Cases: the peer benchmark's (bench_workloads.CASES) plus models from outside the project built
from small configs with random weights (no download): Hugging Face GPT-2, BERT, T5 and Llama,
and a two-layer CPU ``nn.LSTM``. The expensive regime runs a subset (``EXPENSIVE``) to keep the
run affordable. True edges: a linear scan (bench_workloads.scan_edge), read from
benchmarks/true_edges.json where present, else from the last regimes.json, else scanned here.
Writes benchmarks/REGIMES.md and benchmarks/regimes.json (atomically).

With ``--vision`` it runs only the vision models instead (``VISION``: torchvision's resnet18 and
mobilenet_v3_small and a timm ViT, built from code with ``weights=None`` / ``pretrained=False``),
every one in both regimes, and writes benchmarks/REGIMES-VISION.md and regimes-vision.json; the
edges it scans are added to true_edges.json (keyed with the torch version, as every edge there).
torchvision cannot be installed beside this repo's torch, so that run needs a venv of its own
with torch and torchvision that go together, timm, and this package (see REGIMES-VISION.md).

    make bench            # or: .venv/bin/python benchmarks/regimes.py   (needs transformers;
                          #     Lightning and accelerate are compared where importable)
    VENV/bin/python benchmarks/regimes.py --vision    # needs torchvision; timm for the ViT
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.cleanup import drain_autograd_queue
from batchfit.files import atomic_write_text
from batchfit.search.prober import Prober
from batchfit.search.runner import probe_workload
from batchfit.search.strategies import Grow
from batchfit.step.batching import tensor_leaves

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
from bench_workloads import CASES  # noqa: E402
from bench_workloads import EDGES_PATH  # noqa: E402
from bench_workloads import Case  # noqa: E402
from bench_workloads import scan_edge  # noqa: E402
from peer_methods import STEPS_PER_CALL  # noqa: E402
from peer_methods import Run  # noqa: E402
from peer_methods import Tally  # noqa: E402
from peers import git_state  # noqa: E402

from hf_models import Size  # noqa: E402
from hf_models import bert  # noqa: E402
from hf_models import gpt2  # noqa: E402
from hf_models import llama  # noqa: E402
from hf_models import t5  # noqa: E402
from hf_models import workload  # noqa: E402

CHEAP_SECONDS, EXPENSIVE_SECONDS = 0.0, 1.0  # simulated seconds per completed training step
BINARY_MAX, GROW_START, GROW_TRIALS = 512, 32, 5  # binary and grow as benchmarks/peers.py runs them

WITHIN = 1.10  # "within 10% of the fastest exact method"
MISSED_LISTED = 5  # the "what this shows" paragraph names at most this many cases auto missed
SEQ, VOCAB = 64, 1024  # the outside language models: tokens per row and vocabulary

# -- outside models: small configs, random weights, no download ----------------------------------


HF_SIZE = Size(width=128, layers=2, heads=4, ffn=256, vocab=VOCAB, seq=SEQ, rows=4, kv_heads=2)


def hf_gpt2() -> bf.Workload:
    """Hugging Face GPT-2, 2 layers of width 128, next-token loss on 64 tokens."""
    return workload(gpt2, HF_SIZE, "hf-gpt2")


def hf_bert() -> bf.Workload:
    """Hugging Face BERT for 3-way sequence classification, 2 layers of width 128, 64 tokens."""
    return workload(bert, HF_SIZE, "hf-bert")


def hf_t5() -> bf.Workload:
    """Hugging Face T5, 2 encoder and 2 decoder layers of width 128, 64 tokens in, 32 out."""
    return workload(t5, HF_SIZE, "hf-t5")


def hf_llama() -> bf.Workload:
    """Hugging Face Llama, 2 layers of width 128 with grouped-query attention, 64 tokens."""
    return workload(llama, HF_SIZE, "hf-llama")


class StackedLSTM(nn.Module):
    """Two stacked ``nn.LSTM`` layers (CPU: the ``mkldnn_rnn_layer`` kernel) and a linear head."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, sequences: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(sequences)[0][:, -1])


def lstm_2x128() -> bf.Workload:
    """The stacked LSTM with Adam on 32 steps of 64 features."""
    torch.manual_seed(0)
    model = StackedLSTM()
    batch = (torch.randn(4, 32, 64), torch.randint(0, 10, (4,)))
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.Adam(model.parameters()), name="lstm-2x128")


@dataclass(frozen=True)
class OutsideCase(Case):
    """A case whose builder lives here: its true-edge key names this file, however it is run."""

    @property
    def key(self) -> str:
        return f"regimes.{self.build.__name__}@{self.capacity}/torch{torch.__version__}"


OUTSIDE = [
    OutsideCase("HF GPT-2", hf_gpt2, "80MiB"),
    OutsideCase("HF BERT", hf_bert, "48MiB"),
    OutsideCase("HF T5", hf_t5, "96MiB"),
    OutsideCase("HF Llama", hf_llama, "64MiB"),
    OutsideCase("CPU nn.LSTM 2x128", lstm_2x128, "24MiB"),
]
CHEAP = [*CASES, *OUTSIDE]


def case_named(label: str, capacity: str) -> Case:
    return next(case for case in CHEAP if (case.label, case.capacity) == (label, capacity))


# -- vision models (``--vision`` only): torchvision and timm from code, random weights, no download --

IMAGE_PIXELS, IMAGE_CLASSES = 64, 10  # the vision models: square RGB images of this side, classes


def image_workload(model: nn.Module, optimizer: torch.optim.Optimizer, name: str) -> bf.Workload:
    """``model`` on 64x64 RGB images with 10-way cross-entropy (the model is built seeded)."""
    batch = (torch.randn(4, 3, IMAGE_PIXELS, IMAGE_PIXELS), torch.randint(0, IMAGE_CLASSES, (4,)))
    return bf.Workload(model, batch, F.cross_entropy, optimizer, name=name)


def tv_resnet18() -> bf.Workload:
    """torchvision's resnet18 (``weights=None``, 10 classes) with SGD and momentum on 64x64 images."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(weights=None, num_classes=IMAGE_CLASSES)
    return image_workload(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "tv-resnet18")


def tv_mobilenet_v3_small() -> bf.Workload:
    """torchvision's mobilenet_v3_small (``weights=None``, 10 classes) with AdamW on 64x64 images."""
    from torchvision.models import mobilenet_v3_small

    torch.manual_seed(0)
    model = mobilenet_v3_small(weights=None, num_classes=IMAGE_CLASSES)
    return image_workload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "tv-mobilenet-v3-small")


def timm_vit_tiny() -> bf.Workload:
    """timm's ViT-Tiny (width 192, 3 heads; ``pretrained=False``) cut to 4 blocks, on 64x64 images
    in 8x8 patches (64 tokens and a class token), 10 classes, with AdamW."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=IMAGE_PIXELS,
        patch_size=8,
        depth=4,
        num_classes=IMAGE_CLASSES,
    )
    return image_workload(model, torch.optim.AdamW(model.parameters(), lr=3e-4), "timm-vit-tiny")


# Capacities picked so the true edges fall between about 10 and 60.
VISION = [
    OutsideCase("torchvision resnet18", tv_resnet18, "176MiB"),
    OutsideCase("torchvision mobilenet_v3_small", tv_mobilenet_v3_small, "64MiB"),
    OutsideCase("timm ViT-Tiny", timm_vit_tiny, "128MiB"),
]
VISION_NEEDS = {tv_resnet18: "torchvision", tv_mobilenet_v3_small: "torchvision", timm_vit_tiny: "timm"}


def importable(module: str) -> bool:
    """Whether ``module`` imports here (PyPI's torchvision is found beside a torch it does not
    match, and fails only on import)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


# A second of sleep per completed step makes each case cost a minute or more: a subset with small
# edges, one built-in model, one transformer from outside and the CPU LSTM.
EXPENSIVE = [
    case_named("gpt-tiny (built-in)", "22MiB"),
    case_named("HF GPT-2", "80MiB"),
    case_named("CPU nn.LSTM 2x128", "24MiB"),
]
WARM_UP = case_named("mlp (built-in)", "7.5MiB")  # cheap; its runs are not recorded

# -- methods: (case, step_seconds) -> Run ----------------------------------------------------------

Method = Callable[[Case, float], Run]


def fresh(case: Case, step_seconds: float) -> tuple[bf.Workload, bf.SimulatedDevice]:
    """A fresh workload and simulated device; nothing left over from the method before."""
    drain_autograd_queue()
    gc.collect()
    return case.build(), bf.SimulatedDevice(case.capacity, step_seconds=step_seconds)


def batchfit_method(strategy: str, **options: object) -> Method:
    """``bf.search_workload`` with ``strategy`` and ``options``, everything else at its default."""

    def run(case: Case, step_seconds: float) -> Run:
        work, device = fresh(case, step_seconds)
        chosen = Grow(start=GROW_START) if strategy == "grow" else strategy
        start = time.perf_counter()
        try:
            result = bf.search_workload(work, device=device, strategy=chosen, **options)
        except bf.NoBatchFitsError as error:  # grow's 5 trials can run out before anything fits
            trials = error.trials
            tally = Tally([t.batch_size for t in trials], [], sum(t.oom for t in trials), sum(t.steps for t in trials))
            return Run(None, tally, time.perf_counter() - start, {"error": str(error)})
        seconds = time.perf_counter() - start
        trials = result.trials
        fitted = [t.batch_size for t in trials if t.fits]
        tally = Tally([t.batch_size for t in trials], fitted, result.oom_trials, result.steps)
        return Run(result.batch_size, tally, seconds, auto_extra(result.extra))

    return run


def auto_extra(extra: dict) -> dict:
    """What ``result.extra`` says about the trace (its estimate, fake trials, seconds) and any
    choice ``auto`` reports, as plain values."""
    traced = extra.get("trace") or {}
    kept = {f"trace_{key}": traced.get(key) for key in ("batch_size", "trials", "seconds") if key in traced}
    kept.update({key: value for key, value in extra.items() if isinstance(value, str) and key != "trace"})
    return kept


def accelerate_method(starting_batch_size: int) -> Method:
    """accelerate's ``find_executable_batch_size`` around real training steps at its size, as
    benchmarks/peer_methods.py runs it."""

    def run(case: Case, step_seconds: float) -> Run:
        from peer_methods import accelerate_run

        work, device = fresh(case, step_seconds)
        device.register([*work.state_tensors(), *tensor_leaves(work.sample_batch)])
        return accelerate_run(work, device, starting_batch_size)

    return run


def lightning_method(mode: str) -> Method:
    """``Tuner(trainer).scale_batch_size(module, mode=mode)`` on a CPU ``Trainer``, as
    benchmarks/peer_methods.py runs it; each completed step ends with ``device.synchronize()``."""

    def run(case: Case, step_seconds: float) -> Run:
        from lightning.pytorch.tuner import Tuner
        from lightning.pytorch.tuner import batch_size_scaling
        from lightning_peer import counting_trials
        from lightning_peer import make_trainer
        from peer_methods import _where

        work, device = fresh(case, step_seconds)
        device.register([*work.state_tensors(), *tensor_leaves(work.sample_batch)])
        module, tally = timed_module(work, device), Tally()
        with (
            tempfile.TemporaryDirectory() as root,
            counting_trials(batch_size_scaling, tally, around_each=drain_autograd_queue),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
            trainer = make_trainer(root)
            found, extra, start = None, {}, time.perf_counter()
            try:
                with device.measuring():
                    found = Tuner(trainer).scale_batch_size(module, mode=mode)
            except Exception as error:  # e.g. an OOM raised by Lightning's own code after a trial's OOM
                extra["error"] = f"crashed: {type(error).__name__} in {_where(error)}"
            seconds = time.perf_counter() - start
        tally.steps = module.completed_steps
        return Run(found, tally, seconds, extra)

    return run


def timed_module(work: bf.Workload, device: bf.SimulatedDevice) -> object:
    """lightning_peer's module for ``work`` whose every completed step ends with ``device.synchronize()``."""
    from lightning_peer import WorkloadModule

    class TimedModule(WorkloadModule):
        def on_train_batch_end(self, *args: object) -> None:
            super().on_train_batch_end(*args)
            device.synchronize()

    return TimedModule(work)


AUTO, NO_TRACE = "auto", "auto, trace=False"


def methods() -> list[tuple[str, Method]]:
    """batchfit's methods, then the peers that are importable here."""
    chosen = [
        (AUTO, batchfit_method("auto")),
        (NO_TRACE, batchfit_method("auto", trace=False)),
        ("power", batchfit_method("power", trace=False)),
        (f"binary (max {BINARY_MAX})", batchfit_method("binary", trace=False, max_batch_size=BINARY_MAX)),
        (
            f"grow (from {GROW_START}, {GROW_TRIALS} trials)",
            batchfit_method("grow", trace=False, max_batch_size=BINARY_MAX, max_trials=GROW_TRIALS),
        ),
    ]
    if importlib.util.find_spec("lightning") is not None:
        chosen += [
            ("Lightning power", lightning_method("power")),
            ("Lightning binsearch", lightning_method("binsearch")),
        ]
    if importlib.util.find_spec("accelerate") is not None:
        chosen += [("accelerate from 128", accelerate_method(128)), ("accelerate from 1024", accelerate_method(1024))]
    return chosen


# -- running ---------------------------------------------------------------------------------------


def true_edges(
    cases: list[Case], previous: Path = HERE / "regimes.json", save_scans: bool = False
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Each case's true edge, and the cached edges that had moved (key -> [cached, now]).

    A cached edge (the last results, ``previous``, else true_edges.json) is rechecked: it fits and
    one more does not. Where the accounting has moved it since, it is walked one size at a time
    from the cached value to the first failure (the peak grows with the batch: scan_edge checked
    that); a case never scanned gets a full linear scan (bench_workloads.scan_edge), added to
    true_edges.json with ``save_scans``.
    """
    known = json.loads(EDGES_PATH.read_text()) if EDGES_PATH.exists() else {}
    if previous.exists():
        known = {**known, **json.loads(previous.read_text()).get("true_edges", {})}
    edges, moved = {}, {}
    for case in cases:
        if case.key not in known:
            print(f"linear scan for {case.key} ...", flush=True)
            edges[case.key] = scan_edge(case.build, case.capacity)
            if save_scans:
                save_edge(case.key, edges[case.key])
            continue
        edges[case.key] = walk_to_edge(case, known[case.key])
        if edges[case.key] != known[case.key]:
            moved[case.key] = [known[case.key], edges[case.key]]
            print(f"true edge of {case.key} moved from {known[case.key]} to {edges[case.key]}", flush=True)
    return edges, moved


def save_edge(key: str, edge: int) -> None:
    """Add one scanned edge to true_edges.json (read afresh, written atomically, keys sorted as
    bench_workloads writes them)."""
    edges = json.loads(EDGES_PATH.read_text()) if EDGES_PATH.exists() else {}
    edges[key] = edge
    atomic_write_text(EDGES_PATH, json.dumps(edges, indent=1, sort_keys=True) + "\n")


def walk_to_edge(case: Case, start: int) -> int:
    """The largest size that fits, walking one size at a time from ``start`` (up while it fits,
    else down until one does)."""
    device = bf.SimulatedDevice(case.capacity)
    with Prober(case.build(), device, limit_bytes=device.capacity_bytes()) as prober:
        size = start
        if prober.probe(size).fits:
            while prober.probe(size + 1).fits:
                size += 1
            return size
        while size > 1 and not prober.probe(size - 1).fits:
            size -= 1
        return size - 1


def run_regime(cases: list[Case], step_seconds: float, edges: dict[str, int]) -> list[dict]:
    rows = []
    for case in cases:
        warm_case(case)
        for name, method in methods():
            run = method(case, step_seconds)
            rows.append(row_of(case, name, run, edges[case.key], step_seconds))
            r = rows[-1]
            print(
                f"{step_seconds:g} s/step  {case.label:22} {case.capacity:>7} {name:26} {run.found!s:>5}/{r['true']:<5} "
                f"{r['trials']:3} trials {r['oom_trials']:3} OOM {r['steps']:3} steps {run.seconds:7.2f} s",
                flush=True,
            )
    return with_ratios(rows)


def row_of(case: Case, name: str, run: Run, truth: int, step_seconds: float) -> dict:
    return {
        "case": f"{case.label} @ {case.capacity}",
        "workload": case.label,
        "capacity": case.capacity,
        "step_seconds": step_seconds,
        "method": name,
        "true": truth,
        "found": run.found,
        "exact": run.found == truth,
        "trials": len(run.tally.sizes),
        "oom_trials": run.tally.ooms,
        "steps": run.tally.steps,
        "seconds": round(run.seconds, 4),
        "sizes": run.tally.sizes,
        **{key: value for key, value in run.extra.items() if value is not None},
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's wall time over the fastest exact method's on its case (``None``: none was exact)."""
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        exact = [r["seconds"] for r in mine if r["exact"]]
        for r in mine:
            r["time_over_fastest_exact"] = round(r["seconds"] / min(exact), 3) if exact else None
    return rows


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    summary = []
    for name in names:
        mine = [r for r in rows if r["method"] == name]
        ratios = [r["time_over_fastest_exact"] for r in mine if r["time_over_fastest_exact"] is not None]
        summary.append(
            {
                "method": name,
                "cases": len(mine),
                "exact": sum(r["exact"] for r in mine),
                "median_trials": statistics.median(r["trials"] for r in mine),
                "worst_trials": max(r["trials"] for r in mine),
                "median_oom_trials": statistics.median(r["oom_trials"] for r in mine),
                "median_seconds": round(statistics.median(r["seconds"] for r in mine), 3),
                "total_seconds": round(sum(r["seconds"] for r in mine), 2),
                "median_time_over_fastest_exact": statistics.median(ratios) if ratios else None,
                "worst_time_over_fastest_exact": max(ratios, default=None),
                "fastest_exact_on": sum(r["exact"] and r["time_over_fastest_exact"] == 1.0 for r in mine),
                "within_10_percent_and_exact_on": sum(
                    r["exact"] and r["time_over_fastest_exact"] <= WITHIN for r in mine
                ),
            }
        )
    return summary


def warm_up() -> None:
    """Run each method once on a cheap case, unrecorded, so none pays the process's first-call
    costs (imports, Lightning's first fit, dispatch and fake-tensor set-up) in the timed runs."""
    for _, method in methods():
        method(WARM_UP, CHEAP_SECONDS)


def warm_case(case: Case) -> None:
    """One real trial of ``case`` at batch 1 (two steps), unrecorded, before its first method: the
    model's own first-call costs (its ops' first dispatch, lazy set-up in the model's code) would
    otherwise fall on whichever method runs first, always ``auto``."""
    work, device = fresh(case, CHEAP_SECONDS)
    probe_workload(work, 1, device=device)


# -- report ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """What one run covers and where it writes: the default run, or ``--vision``'s."""

    title: str
    command: str
    cheap: list[Case]
    expensive: list[Case]
    results_path: Path
    report_path: Path
    models: tuple[str, ...]  # the model libraries whose versions the report gives
    cases_note: str = ""  # a paragraph on the cases, where the report needs one


DEFAULT = Mode(
    "# Cheap and expensive trials: every method side by side",
    "make bench  (.venv/bin/python benchmarks/regimes.py)",
    CHEAP,
    EXPENSIVE,
    HERE / "regimes.json",
    HERE / "REGIMES.md",
    ("transformers",),
)


def vision_mode() -> Mode:
    """``--vision``: the vision cases whose library imports here, in both regimes."""
    cases = [case for case in VISION if importable(VISION_NEEDS[case.build])]
    if not any(case.build is not timm_vit_tiny for case in cases):
        sys.exit("benchmarks/regimes.py --vision needs torchvision that imports beside this torch (see its docstring)")
    return Mode(
        "# Vision models, cheap and expensive trials: every method side by side",
        "VENV/bin/python benchmarks/regimes.py --vision  (VENV: torch, torchvision and timm that go together)",
        cases,
        cases,
        HERE / "regimes-vision.json",
        HERE / "REGIMES-VISION.md",
        tuple(dict.fromkeys(VISION_NEEDS[case.build] for case in cases)),
        "Cases: models from outside the project built from code with random weights (no download), on "
        f"{IMAGE_PIXELS}x{IMAGE_PIXELS} RGB images with {IMAGE_CLASSES}-way cross-entropy: torchvision's "
        "`resnet18(weights=None)` with SGD and momentum, `mobilenet_v3_small(weights=None)` with AdamW, and "
        "timm's `vit_tiny_patch16_224` (`pretrained=False`) at image size 64 in 8x8 patches, cut to 4 "
        "blocks, with AdamW. torchvision cannot be installed beside the project's torch, so this runs in a "
        "venv of its own: `python3 -m venv VENV && VENV/bin/pip install torch==2.14.1 torchvision==0.29.1 timm "
        "&& VENV/bin/pip install -e '.[test,lightning,transformers]' torch==2.14.1`. Capacities are chosen so "
        "the true edges fall between about 10 and 60.",
    )


def environment(started: float, mode: Mode = DEFAULT) -> dict:
    versions = {"batchfit": bf.__version__, "torch": torch.__version__}
    for library in mode.models:
        versions[library] = importlib.import_module(library).__version__
    for peer in ("lightning", "accelerate"):
        if importlib.util.find_spec(peer) is not None:
            versions[peer] = __import__(peer).__version__
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "versions": versions,
        "torch_threads": torch.get_num_threads(),
        "git": git_state(),
        "command": mode.command,
    }


def cell(row: dict) -> str:
    """A case's cell in a regime's ratio table: the time ratio, and found/true when not exact."""
    ratio = row["time_over_fastest_exact"]
    text = "n/a" if ratio is None else f"{ratio:.2f}"
    if row["found"] is None:
        return f"{text} (no answer)"
    if not row["exact"]:
        return f"{text} ({row['found']}/{row['true']})"
    return f"**{text}**" if ratio == 1.0 else text


def ratio_table(rows: list[dict], names: list[str]) -> list[str]:
    lines = [
        "| case | true | fastest exact | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = {r["method"]: r for r in rows if r["case"] == case}
        exact = [r for r in mine.values() if r["exact"]]
        fastest = min(exact, key=lambda r: r["seconds"]) if exact else None
        best = f"{fastest['method']}, {fastest['seconds']:.2f} s" if fastest else "none"
        first = next(iter(mine.values()))
        lines.append(f"| {case} | {first['true']} | {best} | " + " | ".join(cell(mine[n]) for n in names) + " |")
    return lines


def headline(cheap: list[dict], expensive: list[dict]) -> list[str]:
    lines = [
        "| method | cheap: exact | cheap: trials, median (worst) | cheap: OOM trials, median | cheap: time / fastest "
        "exact, median (worst) | cheap: fastest exact on | expensive: exact | expensive: trials, median (worst) | "
        "expensive: time / fastest exact, median (worst) | expensive: fastest exact on | expensive: seconds, median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(cheap, expensive, strict=True):
        lines.append(
            f"| {a['method']} | {a['exact']}/{a['cases']} | {a['median_trials']:g} ({a['worst_trials']}) | "
            f"{a['median_oom_trials']:g} | {spread(a)} | "
            f"{a['fastest_exact_on']} | {b['exact']}/{b['cases']} | {b['median_trials']:g} ({b['worst_trials']}) | "
            f"{spread(b)} | "
            f"{b['fastest_exact_on']} | {b['median_seconds']:.1f} |"
        )
    return lines


def spread(summary: dict) -> str:
    """A method's time over the fastest exact method's: median (worst) over the cases."""
    median, worst = summary["median_time_over_fastest_exact"], summary["worst_time_over_fastest_exact"]
    return "n/a" if median is None else f"{median:.2f} ({worst:.2f})"


def runs_table(rows: list[dict]) -> list[str]:
    lines = [
        "| case | method | found/true | trials | OOM | steps | seconds | / fastest exact | trace s | sizes tried |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "n/a" if r["time_over_fastest_exact"] is None else f"{r['time_over_fastest_exact']:.2f}"
        trace = f"{r['trace_seconds']:.2f}" if r.get("trace_seconds") is not None else ""
        lines.append(
            f"| {r['case']} | {r['method']} | {r['found']}/{r['true']} | {r['trials']} | {r['oom_trials']} | "
            f"{r['steps']} | {r['seconds']:.2f} | {ratio} | {trace} | {' '.join(map(str, r['sizes']))} |"
        )
    return lines


def facts(results: dict) -> list[str]:
    """The "what this shows" paragraph: measured facts only, computed from the rows."""
    out = []
    for regime in ("cheap", "expensive"):
        rows, summary = results[regime]["runs"], results[regime]["summary"]
        auto = next(s for s in summary if s["method"] == AUTO)
        wins: dict[str, int] = {}
        for s in summary:
            if s["fastest_exact_on"]:
                wins[s["method"]] = s["fastest_exact_on"]
        cases = len({r["case"] for r in rows})
        missed = sorted(
            {
                r["case"]
                for r in rows
                if r["method"] == AUTO and (not r["exact"] or r["time_over_fastest_exact"] > WITHIN)
            }
        )
        traced = [r["trace_seconds"] / r["seconds"] for r in rows if r["method"] == AUTO and r.get("trace_seconds")]
        out.append(
            f"- **{regime} trials** ({results[regime]['step_seconds']:g} s per step, {cases} cases): the fastest exact "
            f"method was {', '.join(f'{name} on {n}' for name, n in sorted(wins.items(), key=lambda kv: -kv[1]))}. "
            f"`auto` (default) was exact on {auto['exact']}/{auto['cases']} cases in {auto['median_trials']:g} real "
            f"trials at the median ({auto['worst_trials']} at worst), and within 10% of the fastest exact method's "
            f"wall time on {auto['within_10_percent_and_exact_on']}/{auto['cases']}"
            + (f" (not on: {'; '.join(missed)})." if 0 < len(missed) <= MISSED_LISTED else ".")
            + (
                f" Its trace on fake tensors took {statistics.median(traced):.0%} of its wall time at the median."
                if traced
                else ""
            )
            + f" {peers_exact(summary)}"
        )
    return out


def peers_exact(summary: list[dict]) -> str:
    """How many cases each peer was exact on, as a sentence."""
    peers = [s for s in summary if s["method"].startswith(("Lightning", "accelerate"))]
    if not peers:
        return "No peer was importable."
    return "The peers were exact on: " + ", ".join(f"{s['method']} {s['exact']}/{s['cases']}" for s in peers) + "."


def moved_note(moved: dict[str, list[int]]) -> str:
    """Which cached edges the recheck found moved (the accounting changed since they were scanned)."""
    if not moved:
        return ""
    return "; it moved " + ", ".join(f"{key} from {old} to {new}" for key, (old, new) in moved.items())


def expensive_note(results: dict) -> str:
    """Which cases the expensive regime ran, as a sentence."""
    expensive_cases = sorted({r["case"] for r in results["expensive"]["runs"]}, key=str)
    if set(expensive_cases) == {r["case"] for r in results["cheap"]["runs"]}:
        return "The expensive regime runs every case."
    return f"The expensive regime runs a subset of the cases to keep the run affordable: {'; '.join(expensive_cases)}."


def report(results: dict, mode: Mode = DEFAULT) -> str:
    names = [s["method"] for s in results["cheap"]["summary"]]
    env = results["environment"]
    return "\n".join(
        [
            mode.title,
            "",
            f"Generated by `{env['command']}` on {env['date']}: {env['machine']}, load average "
            f"{env['load_average_at_start']} at the start, one torch thread; "
            + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
            + f"; git {env['git']}. The whole run took {results['benchmark_seconds']:.0f} s.",
            "",
            "Every method runs on a fresh workload and a fresh `SimulatedDevice` (real CPU compute, every live "
            "tensor byte counted against the capacity); before a case's first method, one unrecorded real trial "
            "of it at batch 1 takes the model's first-call costs, which would otherwise fall on whichever method "
            "runs first. **Cheap trials**: the CPU step as it is "
            f"(`step_seconds={CHEAP_SECONDS:g}`). **Expensive trials**: `SimulatedDevice(capacity, "
            f"step_seconds={EXPENSIVE_SECONDS:g})`, every completed training step also sleeps "
            f"{EXPENSIVE_SECONDS:g} s (batchfit's trials and the peers' steps alike call `device.synchronize()` "
            "once a step has completed; a step that ends in an OOM costs nothing extra, which favours the methods "
            f"that run into many OOMs). {expensive_note(results)}",
            "",
            *([mode.cases_note, ""] if mode.cases_note else []),
            "Methods: `auto` with its defaults (`trace='auto'`: the trace on fake tensors first where a step is "
            "expensive, else decided after the first real trial; the trace's time is in its seconds), `auto` with `trace=False`, `power`, and `binary` and `grow` as benchmarks/peers.py runs "
            f"them (`binary` capped at {BINARY_MAX}; `grow` from {GROW_START}, at most {GROW_TRIALS} trials); the "
            "peers as benchmarks/peer_methods.py runs them: Lightning's `Tuner.scale_batch_size` (`power`, "
            f"`binsearch`, 3 steps a trial) on a CPU `Trainer`, and accelerate's `find_executable_batch_size` from "
            f"128 and from 1024 around {STEPS_PER_CALL} training steps. `true` is the largest size that fits: "
            "a linear scan (bench_workloads.scan_edge), cached, and each cached edge rechecked at the start of the "
            f"run (it fits, one more does not){moved_note(results['true_edges_moved'])}. Trials, OOM trials and steps are real ones (steps: completed training "
            "steps). Wall times are one run each on a shared 2-core machine: read them as ratios.",
            "",
            "An answer above `true` counts as not exact: the peers' own steps let the model's output die inside "
            "the loss, where batchfit's trials keep it alive until after backward as a hand-written loop does "
            "(`Workload.keep_output=True`, the default), so a peer can report a size a loop holding its outputs "
            "would not fit.",
            "",
            "**time / fastest exact** is a method's wall time over the fastest exact method's on the same case "
            "(1.00 in bold: the fastest exact method; a method that missed the edge shows found/true beside its "
            "ratio).",
            "",
            "## Headline",
            "",
            *headline(results["cheap"]["summary"], results["expensive"]["summary"]),
            "",
            "## What this shows",
            "",
            *facts(results),
            "",
            f"## Cheap trials ({CHEAP_SECONDS:g} s per step): time / fastest exact, per case",
            "",
            *ratio_table(results["cheap"]["runs"], names),
            "",
            f"## Expensive trials ({EXPENSIVE_SECONDS:g} s per step): time / fastest exact, per case",
            "",
            *ratio_table(results["expensive"]["runs"], names),
            "",
            "## Every run",
            "",
            *runs_table(results["cheap"]["runs"] + results["expensive"]["runs"]),
            "",
        ]
    )


def chosen_mode(argv: list[str] | None = None) -> Mode:
    """The run the command line asks for: the default, or ``--vision``."""
    parser = argparse.ArgumentParser(description="Every method in cheap and expensive trials, side by side.")
    parser.add_argument(
        "--vision",
        action="store_true",
        help="run only the vision models (torchvision resnet18 and mobilenet_v3_small, a timm ViT) in both "
        "regimes and write benchmarks/REGIMES-VISION.md; needs torchvision (and timm for the ViT)",
    )
    if parser.parse_args(argv).vision:
        return vision_mode()
    if importlib.util.find_spec("transformers") is None:
        sys.exit("benchmarks/regimes.py needs transformers: pip install 'batchfit[bench]'")
    return DEFAULT


def main(argv: list[str] | None = None) -> None:
    mode = chosen_mode(argv)
    torch.set_num_threads(1)  # timings on a shared 2-core machine: one thread is stable, two thrash
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    started, clock = time.time(), time.perf_counter()
    environment_now = environment(started, mode)
    edges, moved = true_edges(mode.cheap, mode.results_path, save_scans=mode is not DEFAULT)
    warm_up()
    names = [name for name, _ in methods()]
    results: dict = {"environment": environment_now, "true_edges": edges, "true_edges_moved": moved}
    regimes = (("cheap", mode.cheap, CHEAP_SECONDS), ("expensive", mode.expensive, EXPENSIVE_SECONDS))
    for regime, cases, seconds in regimes:
        rows = run_regime(cases, seconds, edges)
        results[regime] = {"step_seconds": seconds, "summary": summarize(rows, names), "runs": rows}
    results["benchmark_seconds"] = round(time.perf_counter() - clock, 1)
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    atomic_write_text(mode.results_path, json.dumps(results, indent=1) + "\n")
    atomic_write_text(mode.report_path, report(results, mode))
    print("\n".join(headline(results["cheap"]["summary"], results["expensive"]["summary"])))
    print("\n".join(facts(results)))
    print(f"benchmark: {results['benchmark_seconds']} s")


if __name__ == "__main__":
    main()
