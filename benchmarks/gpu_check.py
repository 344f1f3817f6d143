"""The GPU check: what a session with a lent GPU runs in one go (``make gpu-check``), in under 8 minutes.

For a fixed set of models nobody here wrote (Hugging Face GPT-2 and Llama from small-but-not-tiny configs,
torchvision's resnet50 and timm's vit_base_patch16_224 where importable, an ``nn.LSTM`` language model; bf16
autocast everywhere), on the card at hand:

(a) the real peak allocated and reserved bytes of two steps of a hand-written training loop at a fixed batch
    (``torch.cuda.max_memory_allocated/reserved``, first thing in a fresh process), and batchfit's own trial
    there (``probe_batch_size`` on the GPU);
(b) batchfit's traced estimate for the card's preset at that batch (``estimate_memory(..., device=preset)``, run
    on the CPU of the card's machine beside the GPU work, and the traced answer there);
(c) batchfit's search on the card (``find_max_batch_size``, capped by ``max_batch_size``) on the default caching
    allocator, with its trials and out-of-memory errors; then the hand-written loop at the search's answer and
    one above for 20 steps, in a fresh process per allocator setting (the default, then
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which must be set before CUDA starts), each loop with
    a memory snapshot (``torch.cuda.memory._record_memory_history`` without stack traces, then
    ``_dump_snapshot``, gzipped: gunzip one before loading it in https://pytorch.org/memory_viz); and, where
    time is left, the search again with expandable segments.

Every part runs in a child process of this same file (``--child ...``) under a timeout taken from one budget
(``--budget``, 435 s by default, counted from the start: the run ends within 8 minutes however the parts go), and the output folder
(``--out``; default ``benchmarks/gpu-check/<card>-<date>/``) is rewritten whole after each part, so a run cut off
still leaves what it measured. It only ever holds a bundle that a lent GPU machine can send back from its ``$OUT``
(at most 8 files, each under 16 MiB, no subfolders): ``gpu-check.json`` (the figures), ``logs.tar.gz`` (each child's
log and figures) and ``snapshots-N.tar`` (the snapshots); the children work in a scratch folder of their own.
``python benchmarks/gpu_compare.py FOLDER`` then compares the figures with batchfit's predictions, on any machine.

    python benchmarks/gpu_check.py [--out FOLDER] [--budget SECONDS] [--models gpt2,llama,...]
    make gpu-check GPU_CHECK_ARGS="--out $OUT/gpu-check"   # on a lent machine: its python, src on the path
    python benchmarks/gpu_check.py --dry-run   # no GPU needed: builds each model, one CPU step at 2 rows
    python benchmarks/gpu_check.py --smoke --out /tmp/x   # the whole run on the CPU with tiny models

Without a GPU (and without ``--dry-run`` or ``--smoke``) it exits at once with status 2 and one line on stderr.
Nothing heavy is imported before that check: the module's top level uses the standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

STARTED = time.time()  # the budget counts from here: torch's import in the GPU check is part of the run
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCHEMA = "batchfit-gpu-check/1"
RESULTS = "gpu-check.json"
LOGS = "logs.tar.gz"
# The bundle in the output folder: RESULTS, LOGS and at most SNAPSHOT_TARS tars of snapshots, each under 16 MiB and
# all under 64 MiB: what a lent GPU machine sends back from its $OUT (at most 8 files, 16 MiB each, 64 MiB in all).
SNAPSHOT_TAR_BYTES = 14 * 2**20
SNAPSHOT_TARS = 4
LOG_TAIL_BYTES = 256 * 2**10  # of each log, in LOGS
DEFAULT_BUDGET_S = 435.0  # with the last child stopped (up to 10 s) and the bundle written, under 8 minutes
SMOKE_BUDGET_S = 180.0
LOOP_STEPS = 20
FIXED_STEPS = 2
SNAPSHOT_ENTRIES = 50_000  # the ring buffer of allocator events a snapshot keeps (the latest ones)
AMP = "bf16"
EXPANDABLE = "expandable_segments:True"
ALLOCATORS = {"default": None, "expandable": EXPANDABLE}  # label -> PYTORCH_CUDA_ALLOC_CONF (None: unset)
TRACE_ALLOCATORS = {"default": "cuda", "expandable": "cuda-expandable"}  # label -> TraceDevice(allocator=)
# The loop's order (tests/support/user_loops.py's LoopOrder; benchmarks/allocator.py's loop): the new batch is
# copied in while the last one still lives (``batch = ...`` rebinds it after), ``zero_grad`` at the top of the
# step, and the last step's output alive until the next forward rebinds it.
LOOP_ORDER = {"batch_freed_first": False, "zero_grad_first": True}

NO_CUDA = "no CUDA device: run this on a machine with an NVIDIA GPU"
DRIVER_SIGNS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")

# Time budget per part, seconds: each child's timeout is the smaller of its cap and its share of what is left,
# keeping MIN_MODEL_S for each model still to come; a model with less than MIN_PART_S left is not started.
PROBE_TIMEOUT_S = 90.0
SEARCH_CAP_S = 120.0
LOOPS_CAP_S = 80.0
MIN_MODEL_S = 40.0
PLANNED_MODEL_S = 80.0  # what a model's three children take on an H100, about: the expandable search runs only
# where that much is left for each model still to come
MIN_PART_S = 15.0
FINAL_MARGIN_S = 10.0  # kept at the end for the estimates' merge and the last write
KILL_GRACE_S = 5.0


def missing_cuda(check_driver: bool = True) -> str | None:
    """Why this machine cannot run the check, in one line, or ``None``. Without any GPU driver in sight the answer
    comes without importing torch (which takes seconds); otherwise torch says, through NVML, not starting CUDA in
    this process (the children measure the card: this one must hold no CUDA context)."""
    if check_driver and not any(os.path.exists(sign) for sign in DRIVER_SIGNS):
        return f"{NO_CUDA} (torch.cuda.is_available() is False: no GPU driver here, {DRIVER_SIGNS[0]} is absent)"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError as error:
        return f"{NO_CUDA} (torch is not importable by {sys.executable}: {error})"

    if not torch.cuda.is_available():
        return f"{NO_CUDA} (torch.cuda.is_available() is False)"
    return None


# -- the models ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model of the check: how to build it (``kind`` and ``config``: stored in the figures JSON, so that
    ``gpu_compare.py`` builds the same model), the fixed batch of part (a), and the search's ``max_batch_size``."""

    key: str
    name: str
    kind: str  # gpt2, llama (tests/support/hf_models.py), torchvision, timm, lstm
    config: dict[str, Any]
    batch: int
    cap: int
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9)
    needs: str | None = None  # the package the model comes from

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


MODELS = [
    ModelSpec(
        "gpt2", "HF GPT-2 (6 x 768, seq 512, vocab 50257), AdamW", "gpt2",
        {"width": 768, "layers": 6, "heads": 12, "ffn": 3072, "vocab": 50257, "seq": 512}, 16, 1024,
        needs="transformers",
    ),
    ModelSpec(
        "llama", "HF Llama (6 x 1024, GQA 16/4, seq 1024, vocab 32000), AdamW", "llama",
        {"width": 1024, "layers": 6, "heads": 16, "ffn": 2816, "vocab": 32000, "seq": 1024, "kv_heads": 4}, 8, 512,
        needs="transformers",
    ),
    ModelSpec(
        "vit", "timm vit_base_patch16_224, AdamW", "timm",
        {"name": "vit_base_patch16_224", "image": 224, "classes": 1000}, 64, 2048, needs="timm",
    ),
    ModelSpec(
        "lstm", "nn.LSTM LM (2 x 1024, seq 256, vocab 32000), AdamW", "lstm",
        {"vocab": 32000, "width": 1024, "layers": 2, "seq": 256}, 32, 2048,
    ),
    ModelSpec(
        "resnet50", "torchvision resnet50, 224 px, SGD momentum", "torchvision",
        {"name": "resnet50", "image": 224, "classes": 1000}, 128, 4096, optimizer="sgd", needs="torchvision",
    ),
]  # fmt: skip

# The same kinds, tiny: what --smoke runs on the CPU (and what the comparison's test fixture describes).
SMOKE_MODELS = [
    ModelSpec(
        "gpt2", "HF GPT-2 (2 x 64, seq 32, vocab 512), AdamW", "gpt2",
        {"width": 64, "layers": 2, "heads": 2, "ffn": 256, "vocab": 512, "seq": 32}, 4, 8, needs="transformers",
    ),
    ModelSpec(
        "lstm", "nn.LSTM LM (1 x 32, seq 16, vocab 256), AdamW", "lstm",
        {"vocab": 256, "width": 32, "layers": 1, "seq": 16}, 4, 8,
    ),
]  # fmt: skip


def _torch():
    import torch

    return torch


def _lstm_model(vocab: int, width: int, layers: int):
    from torch import nn

    class LstmLanguageModel(nn.Module):
        """Embedding, an ``nn.LSTM``, a vocabulary head: torch's LSTM (cuDNN's on a GPU) is the part nobody here
        wrote."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids):
            return self.head(self.lstm(self.embed(ids))[0])

    return LstmLanguageModel()


def sequence_loss(logits, targets):
    """Next-token cross-entropy over every position (the LSTM language model's loss)."""
    from torch.nn import functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def class_loss(logits, targets):
    from torch.nn import functional as F

    return F.cross_entropy(logits, targets)


def build(spec: ModelSpec) -> tuple[Any, Any, Any, Any]:
    """``spec``'s model on the CPU (seeded, random weights, nothing downloaded), a sample of 2 rows as its loop
    feeds it, the loss function (``None``: the model's own ``output.loss``) and a function making its optimizer
    over a model (called once the model is where it trains)."""
    torch = _torch()
    config = spec.config
    torch.manual_seed(0)
    if spec.kind in ("gpt2", "llama"):
        if str(ROOT / "tests" / "support") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests" / "support"))
        import hf_models

        size = hf_models.Size(
            config["width"], config["layers"], config["heads"], config["ffn"], config["vocab"], config["seq"],
            kv_heads=config.get("kv_heads"),
        )  # fmt: skip
        model, sample = getattr(hf_models, spec.kind)(size)
        loss_fn = None
    elif spec.kind in ("torchvision", "timm"):
        if spec.kind == "torchvision":
            import torchvision

            model = getattr(torchvision.models, config["name"])(num_classes=config["classes"])
        else:
            import timm

            model = timm.create_model(config["name"], pretrained=False, num_classes=config["classes"])
        side = config["image"]
        sample = (torch.randn(2, 3, side, side), torch.randint(0, config["classes"], (2,)))
        loss_fn = class_loss
    elif spec.kind == "lstm":
        model = _lstm_model(config["vocab"], config["width"], config["layers"])
        ids = torch.randint(0, config["vocab"], (2, config["seq"]))
        sample, loss_fn = (ids, ids.clone()), sequence_loss
    else:
        raise ValueError(f"unknown model kind {spec.kind!r}")

    def make_optimizer(module):
        if spec.optimizer == "sgd":
            return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(module.parameters(), lr=3e-4)

    return model, sample, loss_fn, make_optimizer


def make_batch(sample: Any, rows: int, device: str, host, generator) -> Any:
    """A new batch of ``rows`` rows shaped like ``sample``'s, on ``device``, one block per tensor as a loader's
    ``batch.to(device)`` gives: integer tensors drawn on the host (ids and labels below the sample's largest value,
    so they stay in the vocabulary) and copied in; float tensors (images) drawn on the device itself, the same
    single block of the same size, without a host-side draw of gigabytes each step."""
    torch = _torch()

    def one(tensor):
        shape = (rows, *tensor.shape[1:])
        if tensor.is_floating_point():
            return torch.randn(shape, generator=generator, device=device, dtype=tensor.dtype)
        high = int(tensor.max()) + 1
        return torch.randint(0, high, shape, generator=host, dtype=tensor.dtype).to(device)

    if isinstance(sample, dict):
        return {key: one(value) for key, value in sample.items()}
    return tuple(one(value) for value in sample)


def _forward(model, batch, loss_fn):
    if isinstance(batch, dict):
        out = model(**batch)
        return out, out.loss
    out = model(batch[0])
    return out, loss_fn(out, batch[1])


def _is_oom(error: BaseException) -> bool:
    import batchfit as bf

    return bf.is_oom(error)


def _cuda_figures(torch) -> dict[str, int]:
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def run_loop(
    spec: ModelSpec,
    rows: int,
    steps: int,
    device: str = "cuda",
    snapshot: Path | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """``steps`` steps of the training loop people write, at ``rows`` rows, with a model built now and moved to
    ``device`` (``model.to``), the optimizer made over it, bf16 autocast, the order of ``LOOP_ORDER``. On CUDA the
    peaks are ``torch.cuda.max_memory_allocated/reserved`` from after the model's move to the end (or to the
    out-of-memory error), and with ``snapshot`` the allocator's history (no stack traces) from before the move is
    dumped there, gzipped: at the error where one struck, else after the last step. ``deadline`` (``time.time()``)
    stops the loop early, said in the record."""
    torch = _torch()
    cuda = device.startswith("cuda")
    record: dict[str, Any] = {"batch": rows, "steps_planned": steps, "order": dict(LOOP_ORDER), "device": device}
    started = time.perf_counter()
    if cuda and snapshot is not None:
        _start_history(torch)
    model, sample, loss_fn, make_optimizer = build(spec)
    model.to(device)
    optimizer = make_optimizer(model)
    generator = torch.Generator(device=device).manual_seed(1)
    host = torch.Generator().manual_seed(1)
    if cuda:
        torch.cuda.synchronize()
        record["after_model_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    per_step: list[dict[str, Any]] = []
    reached, phase = 0, "batch"
    batch = out = loss = None
    try:
        for step in range(1, steps + 1):
            if deadline is not None and time.time() > deadline:
                record["cut_by_time"] = True  # said in the outcome below
                break
            reached, phase = step, "batch"
            if LOOP_ORDER["batch_freed_first"]:
                batch = None
            batch = make_batch(sample, rows, device, host, generator)
            if LOOP_ORDER["zero_grad_first"]:
                optimizer.zero_grad(set_to_none=True)
            phase = "forward"
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                out, loss = _forward(model, batch, loss_fn)
            phase = "backward"
            loss.backward()
            phase = "optimizer"
            optimizer.step()
            if not LOOP_ORDER["zero_grad_first"]:
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                per_step.append(
                    {"step": step, "seconds": round(time.perf_counter() - started, 3), **_cuda_figures(torch)}
                )
            else:
                per_step.append({"step": step, "seconds": round(time.perf_counter() - started, 3)})
        record.update(outcome="held", oom_step=None, failed_phase=None, error=None, steps_run=len(per_step))
        if record.get("cut_by_time"):
            record["outcome"] = f"held {len(per_step)} of {steps} steps (cut by time)"
    except Exception as error:  # recorded, not raised: the run goes on to the next part
        oom = _is_oom(error)
        outcome = f"OOM at step {reached}" if oom else f"error at step {reached}: {type(error).__name__}"
        record.update(outcome=outcome, oom_step=reached if oom else None, failed_phase=phase)
        record.update(error=_short(f"{type(error).__name__}: {error}", 800), steps_run=reached - 1)
        if cuda and snapshot is not None:  # while the failed step's tensors are still held: the state at the error
            record["snapshot"] = {**_dump_history(torch, snapshot), "taken": "at the error"}
    finally:
        if cuda:
            record.update(_cuda_figures(torch))
            stats = torch.cuda.memory_stats()
            for name in ("num_alloc_retries", "num_ooms", "inactive_split_bytes.all.peak", "segment.all.peak"):
                record[name.replace(".all.", "_").replace(".", "_")] = stats.get(name)
            if snapshot is not None and "snapshot" not in record:
                record["snapshot"] = {**_dump_history(torch, snapshot), "taken": "after the last step"}
        del batch, out, loss  # the last step's, which the loop kept
    record["per_step"] = per_step
    record["seconds"] = round(time.perf_counter() - started, 3)
    del model, optimizer
    _cleanup(torch, device)
    return record


def _start_history(torch) -> None:
    """The allocator's event history, without stack traces (``context=None``: no frames are gathered, so the
    snapshot stays small); cleared where this torch can."""
    options = {"enabled": "all", "context": None, "stacks": "python", "max_entries": SNAPSHOT_ENTRIES}
    try:
        torch.cuda.memory._record_memory_history(**options, clear_history=True)
    except TypeError:  # a torch without clear_history
        torch.cuda.memory._record_memory_history(**options)


def _dump_history(torch, path: Path) -> dict[str, Any]:
    """Dump the snapshot to ``path`` (gzipped, as ``path.pickle.gz``), stop recording; what was written."""
    from batchfit.files import atomic_write_bytes

    raw = path.with_suffix(".pickle")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(raw))
        data = raw.read_bytes()
        target = path.with_suffix(".pickle.gz")
        atomic_write_bytes(target, gzip.compress(data, compresslevel=6))
        raw.unlink()
        return {"file": target.name, "pickle_bytes": len(data), "gzip_bytes": target.stat().st_size}
    except Exception as error:  # a snapshot is a bonus: its failure must not lose the figures
        return {"error": _short(f"{type(error).__name__}: {error}", 300)}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _cleanup(torch, device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- presets ------------------------------------------------------------------------------------------------------


def preset_for(card: str, total_bytes: int) -> tuple[str | None, str]:
    """The batchfit preset of a card from ``torch.cuda.get_device_name()`` and its total memory, with why; ``None``
    where no preset is the card (the estimates then take the card's total less CUDA's start-up, in bytes, and run
    the CPU's kernels).

    >>> preset_for("NVIDIA H100 80GB HBM3", 85_017_493_504)[0], preset_for("NVIDIA H200", 150_109_880_320)[0]
    ('h100-80gb', 'h200-141gb')
    >>> preset_for("NVIDIA H100 NVL", 99_983_917_056)[0] is None
    True
    """
    name, gib = card.lower(), total_bytes / 2**30
    if "h200" in name:
        return "h200-141gb", f"{card}: an H200"
    if "h100" in name and 70 < gib < 85:
        return "h100-80gb", f"{card}: an H100 with {gib:.2f} GiB"
    if "a100" in name and 70 < gib < 85:
        return "a100-80gb", f"{card}: an A100 with {gib:.2f} GiB"
    if "a100" in name and 35 < gib < 45:
        return "a100-40gb", f"{card}: an A100 with {gib:.2f} GiB"
    return None, f"{card} with {gib:.2f} GiB matches no preset: the estimates take its total less CUDA's start-up"


def trace_device(target: str | int, allocator: str = "cuda") -> Any:
    """The ``TraceDevice`` the predictions run on: the card's preset (or its bytes) with PyTorch's caching allocator
    modelled (``"cuda"``, a preset's default, or ``"cuda-expandable"``)."""
    import batchfit as bf

    return bf.TraceDevice(target, allocator=allocator)


def trace_target(info: dict[str, Any]) -> str | int:
    """What the estimates trace for: the preset, else the card's total less CUDA's start-up (bytes)."""
    if info.get("preset"):
        return info["preset"]
    from batchfit.devices.presets import STARTUP_BYTES

    return int(info["total_memory"]) - STARTUP_BYTES


# -- the children -------------------------------------------------------------------------------------------------


def _write(path: Path, data: dict[str, Any]) -> None:
    from batchfit.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def _versions() -> dict[str, str | None]:
    """The versions that matter, read from the installed distributions (importing them would take seconds)."""
    from importlib import metadata

    import batchfit

    versions: dict[str, str | None] = {"python": platform.python_version(), "batchfit": batchfit.__version__}
    for package in ("torch", "transformers", "timm", "torchvision"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def child_probe(args: argparse.Namespace) -> dict[str, Any]:
    """The card: name, memory, compute capability, versions; in a process of its own (parent holds no context)."""
    torch = _torch()
    info: dict[str, Any] = {"versions": _versions(), "device": args.device}
    if args.device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(0)
        info.update(
            card=torch.cuda.get_device_name(0),
            total_memory=int(properties.total_memory),
            capability=list(torch.cuda.get_device_capability(0)),
            multiprocessors=properties.multi_processor_count,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        )
        free, _ = torch.cuda.mem_get_info(0)
        info["free_at_start_bytes"] = int(free)
        preset, why = preset_for(info["card"], info["total_memory"])
    else:
        from batchfit.devices.presets import preset as lookup

        info.update(card=f"CPU smoke run ({platform.machine()}), traced for {args.preset}", capability=None)
        info["total_memory"] = lookup(args.preset).memory_bytes
        preset, why = args.preset, "--smoke: the preset given by --preset"
    info.update(preset=preset, preset_note=why)
    if preset:
        from batchfit.devices.presets import preset as lookup

        accelerator = lookup(preset)
        info["preset_memory_bytes"], info["preset_usable_bytes"] = accelerator.memory_bytes, accelerator.usable_bytes
    return info


def child_estimate(args: argparse.Namespace, out: Path) -> None:
    """(b) on the CPU of the card's machine (no CUDA here: the parent hides the GPU): ``estimate_memory`` for the
    card's preset at each model's fixed batch, and the traced answer (the search on a ``TraceDevice``), each written
    as soon as it is known."""
    import warnings

    import batchfit as bf

    target = json.loads(args.target)
    results: dict[str, Any] = {}
    for spec in _specs(args):
        if spec.needs and importlib.util.find_spec(spec.needs) is None:
            results[spec.key] = {"skipped": f"needs {spec.needs}"}
            _write(out, results)
            continue
        entry: dict[str, Any] = {"trace_for": target}
        results[spec.key] = entry
        try:
            model, sample, loss_fn, make_optimizer = build(spec)
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                estimate = bf.estimate_memory(
                    model, sample, spec.batch, loss_fn=loss_fn, optimizer=make_optimizer(model), amp_dtype=AMP,
                    device=trace_device(target),
                )  # fmt: skip
            entry["at_fixed_batch"] = _estimate_dict(estimate, time.perf_counter() - started)
            _write(out, results)
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = bf.find_max_batch_size(
                    model, sample, loss_fn=loss_fn, optimizer=make_optimizer(model), amp_dtype=AMP,
                    device=trace_device(target), max_batch_size=spec.cap,
                )  # fmt: skip
            entry["traced_answer"] = {
                "batch_size": traced.batch_size,
                "seconds": round(time.perf_counter() - started, 2),
            }
        except Exception as error:
            entry["error"] = _short(f"{type(error).__name__}: {error}", 600)
        _write(out, results)


def _estimate_dict(estimate: Any, seconds: float) -> dict[str, Any]:
    return {
        "batch": estimate.batch_size,
        "peak_bytes": estimate.peak_bytes,
        "reserved_peak_bytes": estimate.reserved_peak_bytes,
        "peak_phase": estimate.peak_phase,
        "breakdown": dict(estimate.breakdown),
        "fits": estimate.fits,
        "served": estimate.served,
        "allocator": estimate.allocator,
        "undercounted_ops": list(estimate.undercounted_ops),
        "not_counted": list(estimate.not_counted),
        "seconds": round(seconds, 2),
    }


def _search_dict(result: Any, spec: ModelSpec, seconds: float) -> dict[str, Any]:
    data = result.to_dict()
    for trial in data.get("trials", []):
        if trial.get("error"):
            trial["error"] = _short(trial["error"], 600)
    data["capped"] = result.batch_size >= spec.cap
    data["oom_trials"] = result.oom_trials
    data["traced_batch_size"] = (result.extra.get("trace") or {}).get("batch_size")
    data["wall_seconds"] = round(seconds, 2)
    return data


def _search(spec: ModelSpec, device: str, seconds: float, on_trial=None) -> dict[str, Any]:
    """``find_max_batch_size`` on ``device`` for ``spec``, capped by ``spec.cap`` and ``seconds``; ``on_trial``
    gets each trial as a dict as soon as it ends."""
    import batchfit as bf

    torch = _torch()
    model, sample, loss_fn, make_optimizer = build(spec)
    model.to(device)
    started = time.perf_counter()
    result = bf.find_max_batch_size(
        model, sample, loss_fn=loss_fn, optimizer=make_optimizer(model), amp_dtype=AMP, device=device,
        max_batch_size=spec.cap, max_seconds=max(5.0, seconds),
        on_trial=(lambda trial: on_trial(_trial_dict(trial))) if on_trial else None,
    )  # fmt: skip
    data = _search_dict(result, spec, time.perf_counter() - started)
    del model, result
    _cleanup(torch, device)
    return data


def child_search(args: argparse.Namespace, out: Path) -> None:
    """(a) then (c) for one model, in a fresh process on the default allocator: two steps of the loop at the fixed
    batch (first: the reserved peak of a fresh allocator), batchfit's trial there, then the search."""
    import batchfit as bf

    torch = _torch()
    spec = _specs(args)[0]
    deadline = args.deadline
    results: dict[str, Any] = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    results["fixed"] = run_loop(spec, spec.batch, FIXED_STEPS, args.device)
    _write(out, results)

    def probe() -> dict[str, Any]:
        model, sample, loss_fn, make_optimizer = build(spec)
        model.to(args.device)
        started = time.perf_counter()
        trial = bf.probe_batch_size(
            model, sample, spec.batch, loss_fn=loss_fn, optimizer=make_optimizer(model), amp_dtype=AMP,
            device=args.device,
        )  # fmt: skip
        return {**_trial_dict(trial), "wall_seconds": round(time.perf_counter() - started, 2)}

    def trial_done(trial: dict[str, Any]) -> None:  # a search cut off by its timeout still leaves its trials
        results.setdefault("search_trials_so_far", []).append(trial)
        _write(out, results)

    def search() -> dict[str, Any]:
        return _search(spec, args.device, deadline - time.time() - 5, on_trial=trial_done)

    for part, work in (("probe", probe), ("search", search)):
        try:
            results[part] = work()
        except Exception as error:  # recorded: the next part still runs
            results.setdefault("errors", {})[part] = _short(f"{type(error).__name__}: {error}", 800)
        _cleanup(torch, args.device)
        _write(out, results)


def _trial_dict(trial: Any) -> dict[str, Any]:
    data = trial.to_dict()
    if data.get("error"):
        data["error"] = _short(data["error"], 600)
    return data


def child_loops(args: argparse.Namespace, out: Path) -> None:
    """(c)'s loops for one model and one allocator setting (this process's ``PYTORCH_CUDA_ALLOC_CONF``): 20 steps at
    each size, each from an emptied cache with a snapshot; then, with ``--search-after`` and time left, the search
    on this allocator."""
    spec = _specs(args)[0]
    results: dict[str, Any] = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "loops": []}
    snapshots = Path(args.snapshots) if args.snapshots else None
    for rows in args.sizes:
        if time.time() > args.deadline - 10:
            results["loops"].append({"batch": rows, "allocator": args.allocator, "outcome": "not run: out of time"})
            _write(out, results)
            continue
        path = (
            snapshots / f"{spec.key}-{args.allocator}-{rows}" if snapshots and args.device.startswith("cuda") else None
        )
        record = run_loop(spec, rows, LOOP_STEPS, args.device, snapshot=path, deadline=args.deadline - 6)
        record["allocator"] = args.allocator
        results["loops"].append(record)
        _write(out, results)
    left = args.deadline - time.time() - 5
    if args.search_after and left > MIN_PART_S:
        try:
            results["search"] = _search(spec, args.device, left)
        except Exception as error:  # recorded beside the loops
            results.setdefault("errors", {})["search"] = _short(f"{type(error).__name__}: {error}", 800)
        _write(out, results)


def _specs(args: argparse.Namespace) -> list[ModelSpec]:
    models = SMOKE_MODELS if args.smoke else MODELS
    if not args.models:
        return list(models)
    wanted = args.models.split(",")
    by_key = {spec.key: spec for spec in models}
    unknown = [key for key in wanted if key not in by_key]
    if unknown:
        raise SystemExit(f"unknown model {', '.join(unknown)}: choose from {', '.join(by_key)}")
    return [by_key[key] for key in wanted]


# -- the parent: one budget, children in turn ----------------------------------------------------------------------


@dataclass
class Run:
    """The parent's state: the figures written so far, the clock, and two folders: ``work`` (a scratch folder of
    its own: the children's parts, logs and snapshots) and ``folder``, which only ever holds the bundle (``RESULTS``,
    ``LOGS``, ``snapshots-N.tar``: at most 8 files, each under 16 MiB, no subfolder), rewritten after every part."""

    args: argparse.Namespace
    folder: Path
    work: Path
    started: float
    deadline: float
    data: dict[str, Any] = field(default_factory=dict)
    tars: list[list[Path]] = field(default_factory=list)  # the snapshots in each snapshots-N.tar

    @property
    def results(self) -> Path:
        return self.folder / RESULTS

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        """The figures, the logs and the snapshots so far into the bundle (each file replaced whole)."""
        self.data["elapsed_seconds"] = round(time.time() - self.started, 1)
        self._pack_snapshots()
        _write(self.results, self.data)
        self._pack_logs()

    def _pack_logs(self) -> None:
        from batchfit.files import atomic_write_bytes

        files = sorted([*self.work.glob("logs/*.log"), *self.work.glob("parts/*.json")])
        atomic_write_bytes(self.folder / LOGS, _tar(files, gzip_it=True, tail_bytes=LOG_TAIL_BYTES))

    def _pack_snapshots(self) -> None:
        """New snapshots into ``snapshots-N.tar`` (each under ``SNAPSHOT_TAR_BYTES``, at most ``SNAPSHOT_TARS``);
        one that fits in none is left out, said in the figures."""
        from batchfit.files import atomic_write_bytes

        placed = self.data.setdefault("snapshots", {})
        for path in sorted(self.work.glob("snapshots/*.pickle.gz")):
            if path.name in placed:
                continue
            size = path.stat().st_size
            if not self.tars or sum(p.stat().st_size for p in self.tars[-1]) + size > SNAPSHOT_TAR_BYTES:
                if len(self.tars) == SNAPSHOT_TARS or size > SNAPSHOT_TAR_BYTES:
                    placed[path.name] = f"left out: {size:,} bytes more than the bundle holds"
                    continue
                self.tars.append([])
            self.tars[-1].append(path)
            name = f"snapshots-{len(self.tars)}.tar"
            atomic_write_bytes(self.folder / name, _tar(self.tars[-1]))
            placed[path.name] = name


def _tar(files: list[Path], gzip_it: bool = False, tail_bytes: int | None = None) -> bytes:
    """A tar of ``files`` (by name; with ``tail_bytes``, each file's last bytes only), gzipped or not."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzip_it else "w") as tar:
        for path in files:
            data = path.read_bytes()
            data = data[-tail_bytes:] if tail_bytes else data
            member = tarfile.TarInfo(f"{path.parent.name}/{path.name}")
            member.size, member.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def _child_command(args: argparse.Namespace, part: str, spec: ModelSpec | None, out: Path, **extra: Any) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", part, "--child-out", str(out)]
    command += ["--device", args.device, "--preset", args.preset or ""]
    if args.smoke:
        command.append("--smoke")
    if spec is not None:
        command += ["--models", spec.key]
    for key, value in extra.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif isinstance(value, list):
            command += [flag, *map(str, value)]
        else:
            command += [flag, str(value)]
    return command


def _child_env(alloc_conf: str | None, hide_gpu: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "4")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A child in this run's process group (whatever ends the whole run ends it too), its output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen) -> None:
    """End a child this run started, by its id: SIGTERM, then SIGKILL."""
    for end in (process.terminate, process.kill):
        if process.poll() is not None:
            return
        end()
        try:
            process.wait(KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait(process: subprocess.Popen, timeout: float) -> str:
    """How the child ended within ``timeout`` (stopped past it); stopped too if this run is interrupted."""
    try:
        code = process.wait(max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _stop(process)
        return f"timed out after {timeout:.0f} s"
    except BaseException:
        _stop(process)
        raise
    return "done" if code == 0 else f"failed (exit {code})"


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _log_tail(log: Path, lines: int = 6) -> str:
    try:
        return _short(" | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:]), 900)
    except OSError:
        return ""


def run_part(run: Run, entry: dict[str, Any], part: str, spec: ModelSpec, timeout: float, env, **extra) -> dict:
    """One child for ``spec`` under ``timeout``: its figures (what it wrote, even if cut off) and how it ended,
    recorded in ``entry["parts"]``."""
    out = run.work / "parts" / f"{spec.key}-{part}.json"
    log = run.work / "logs" / f"{spec.key}-{part}.log"
    deadline = time.time() + timeout
    command = _child_command(run.args, part.split("-")[0], spec, out, deadline=f"{deadline:.1f}", **extra)
    started = time.time()
    status = _wait(_start(command, env, log), timeout)
    record = {"status": status, "timeout_seconds": round(timeout, 1), "seconds": round(time.time() - started, 1)}
    if status != "done":
        record["log_tail"] = _log_tail(log)
    entry.setdefault("parts", {})[part] = record
    return _read(out)


def _budget(run: Run, models_after: int, share: float, cap: float) -> float:
    """A child's timeout: ``share`` of what is left after keeping ``MIN_MODEL_S`` for each model still to come,
    at most ``cap``."""
    available = run.left() - models_after * MIN_MODEL_S
    return min(cap, max(0.0, share * available))


def check_model(run: Run, spec: ModelSpec, models_after: int) -> None:
    entry: dict[str, Any] = {"key": spec.key, "name": spec.name, "spec": asdict(spec), "status": "running"}
    entry["notes"] = []
    run.data["models"].append(entry)
    if spec.needs and importlib.util.find_spec(spec.needs) is None:
        entry.update(status="skipped", notes=[f"skipped: {spec.needs} is not importable here"])
        run.save()
        return
    timeout = _budget(run, models_after, 0.5, SEARCH_CAP_S)
    if timeout < MIN_PART_S:
        entry.update(status="not run: out of time")
        run.save()
        return
    got = run_part(run, entry, "search", spec, timeout, _child_env(None))
    entry.update({key: got[key] for key in ("fixed", "probe", "search", "errors") if key in got})
    if "search" not in got and got.get("search_trials_so_far"):
        entry["search_cut_off"] = {"trials": got["search_trials_so_far"]}  # its trials, no answer
    run.save()
    answer = (entry.get("search") or {}).get("batch_size")
    if not answer:
        entry.update(status="incomplete", notes=[*entry["notes"], "no search answer: the loops were not run"])
        run.save()
        return
    if entry["search"].get("capped"):
        entry["notes"].append(f"the search reached its cap ({spec.cap}): the edge is above it")
    sizes = [answer, answer + 1]
    entry["loops"] = []
    for number, (label, conf) in enumerate(ALLOCATORS.items()):
        timeout = _budget(run, models_after, 0.5 if number == 0 else 1.0, LOOPS_CAP_S)
        if timeout < MIN_PART_S:
            entry["notes"].append(f"loops on the {label} allocator not run: out of time")
            continue
        search_after = label == "expandable" and timeout >= 45 and run.left() > 45 + models_after * PLANNED_MODEL_S
        got = run_part(
            run, entry, f"loops-{label}", spec, timeout, _child_env(conf), sizes=sizes, allocator=label,
            snapshots=str(run.work / "snapshots"), search_after=search_after,
        )  # fmt: skip
        entry["loops"] += got.get("loops", [])
        if got.get("search"):
            entry[f"search_{label}"] = got["search"]
        run.save()
    parts = entry.get("parts", {}).values()
    entry["status"] = "done" if all(part["status"] == "done" for part in parts) else "incomplete"
    run.save()


def _folder(args: argparse.Namespace, card: str) -> Path:
    if args.out:
        return Path(args.out)
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") or "gpu"
    base = HERE / "gpu-check" / f"{slug}-{time.strftime('%Y-%m-%d')}"
    return base if not base.exists() else base.with_name(f"{base.name}-{time.strftime('%H%M%S')}")


def parent(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    started = STARTED
    budget = args.budget or (SMOKE_BUDGET_S if args.smoke else DEFAULT_BUDGET_S)
    sys.path.insert(0, str(ROOT / "src"))
    work = Path(tempfile.mkdtemp(prefix="batchfit-gpu-check-"))
    try:
        return _parent(args, started, budget, work)
    except KeyboardInterrupt as stop:
        print(f"interrupted ({stop or 'Ctrl-C'}): the figures so far are kept", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)  # everything worth keeping is in the bundle


def _parent(args: argparse.Namespace, started: float, budget: float, work: Path) -> int:
    signal.signal(signal.SIGTERM, _interrupted)  # a `kill` of this run stops its child too, and keeps the figures
    probe_out, probe_log = work / "parts" / "probe.json", work / "logs" / "probe.log"
    status = _wait(_start(_child_command(args, "probe", None, probe_out), _child_env(None), probe_log), PROBE_TIMEOUT_S)
    info = _read(probe_out)
    if status != "done" or not info:
        failure = f"the probe of the card {status}: {_log_tail(probe_log)}"
        folder = _folder(args, "unknown-card")
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / RESULTS, {"schema": SCHEMA, "fixture": False, "complete": False, "error": failure})
        print(failure, file=sys.stderr)
        return 1
    folder = _folder(args, info["card"])
    folder.mkdir(parents=True, exist_ok=True)
    run = Run(args, folder, work, started, started + budget - FINAL_MARGIN_S)
    specs = _specs(args)
    target = trace_target(info)
    run.data = {
        "schema": SCHEMA,
        "fixture": False,
        "smoke": bool(args.smoke),
        "note": "CPU smoke run of the orchestration: no GPU figures" if args.smoke else "measured on the card named",
        "written_by": "benchmarks/gpu_check.py",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "budget_seconds": budget,
        "complete": False,
        "machine": info,
        "preset": info.get("preset"),
        "trace_for": target,
        "settings": {
            "amp": AMP,
            "loop_steps": LOOP_STEPS,
            "fixed_steps": FIXED_STEPS,
            "loop_order": LOOP_ORDER,
            "allocators": ALLOCATORS,
            "snapshot_max_entries": SNAPSHOT_ENTRIES,
            "snapshot_stacks": "none (context=None)",
        },
        "bundle": {
            RESULTS: "these figures",
            LOGS: "every child's log and figures as it wrote them (logs/, parts/)",
            "snapshots-N.tar": "the loops' memory snapshots, <model>-<allocator>-<batch>.pickle.gz: gunzip one for "
            "https://pytorch.org/memory_viz or `batchfit allocator`; 'snapshots' below says which tar holds which",
        },
        "models": [],
        "estimates": {},
        "snapshots": {},
    }
    run.save()
    print(f"{info['card']}: preset {info.get('preset')}; figures go to {folder}", flush=True)
    estimates_out = work / "parts" / "estimates.json"
    estimator = _start(
        _child_command(args, "estimate", None, estimates_out, target=json.dumps(target), models=args.models),
        _child_env(None, hide_gpu=True),
        work / "logs" / "estimates.log",
    )
    interrupted = True
    try:
        for number, spec in enumerate(specs):
            check_model(run, spec, len(specs) - number - 1)
            run.data["estimates"] = _read(estimates_out)
            run.save()
            _print_model(run.data["models"][-1], run.data["estimates"].get(spec.key))
        interrupted = False
    finally:
        if interrupted:
            _stop(estimator)
            run.data["interrupted"] = True
            for entry in run.data["models"]:
                entry["status"] = "interrupted" if entry["status"] == "running" else entry["status"]
        status = _wait(estimator, max(1.0, run.left() + FINAL_MARGIN_S / 2))
        run.data["estimates"] = _read(estimates_out)
        run.data["estimates_status"] = status
        run.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        run.data["complete"] = status == "done" and all(m["status"] in ("done", "skipped") for m in run.data["models"])
        run.save()
    print(f"wrote {run.results} in {time.time() - started:.0f} s; compare: python benchmarks/gpu_compare.py {folder}")
    return 0


def _print_model(entry: dict[str, Any], estimate: dict[str, Any] | None) -> None:
    fixed, search = entry.get("fixed") or {}, entry.get("search") or {}
    words = [f"{entry['key']}: {entry['status']}"]
    if fixed.get("peak_allocated_bytes") is not None:
        words.append(f"fixed batch {fixed['batch']}: peak {fixed['peak_allocated_bytes']:,} allocated")
    if estimate and estimate.get("at_fixed_batch"):
        words.append(f"estimate {estimate['at_fixed_batch']['peak_bytes']:,}")
    if search.get("batch_size"):
        words.append(f"answer {search['batch_size']} ({len(search.get('trials', []))} trials)")
    words += [f"{loop['allocator']} loop at {loop['batch']}: {loop['outcome']}" for loop in entry.get("loops", [])]
    print("; ".join(words), flush=True)


# -- dry run ------------------------------------------------------------------------------------------------------


def dry_run(args: argparse.Namespace) -> int:
    """Build each model on the CPU and run one step of the loop at 2 rows there: nothing touches CUDA."""
    sys.path.insert(0, str(ROOT / "src"))
    for spec in _specs(args):
        if spec.needs and importlib.util.find_spec(spec.needs) is None:
            print(f"{spec.key}: skipped, {spec.needs} is not importable here (the GPU run skips it too)", flush=True)
            continue
        started = time.perf_counter()
        model, *_ = build(spec)
        parameters = sum(p.numel() for p in model.parameters())
        record = run_loop(spec, 2, 1, "cpu") if args.step else {"outcome": "not run (--no-step)"}
        print(
            f"{spec.key}: built {spec.name}, {parameters / 1e6:.1f}M parameters; one CPU step at 2 rows: "
            f"{record['outcome']} ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    return 0


# -- the command line ---------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the folder for the figures (default benchmarks/gpu-check/<card>-<date>/)")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--models", help="a comma-separated subset of the models' keys")
    parser.add_argument("--dry-run", action="store_true", help="build each model and step it once on the CPU")
    parser.add_argument("--no-step", dest="step", action="store_false", help="with --dry-run: only build")
    parser.add_argument("--smoke", action="store_true", help="the whole run on the CPU with tiny models")
    parser.add_argument("--preset", default="h100-80gb", help="with --smoke: the preset the estimates trace for")
    # the children's (internal)
    parser.add_argument("--child", choices=["probe", "estimate", "search", "loops"], help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--allocator", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--snapshots", help=argparse.SUPPRESS)
    parser.add_argument("--search-after", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke or args.dry_run else "cuda"
    return args


def child(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    out = Path(args.child_out)
    if args.deadline is None:
        args.deadline = time.time() + 3600
    if args.child == "probe":
        _write(out, child_probe(args))
    elif args.child == "estimate":
        child_estimate(args, out)
    elif args.child == "search":
        child_search(args, out)
    else:
        child_loops(args, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child(args)
    _specs(args)  # an unknown model's key ends the run here, before anything starts
    if args.dry_run:
        return dry_run(args)
    if not args.smoke:
        missing = missing_cuda()
        if missing:
            print(missing, file=sys.stderr)
            return 2
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
