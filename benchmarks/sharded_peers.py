"""Benchmark: what each method says ONE rank needs to train a model under FSDP2, side by side on the
same models and settings, against the real figure where one exists.

Methods, each on the same model (a Hugging Face causal LM built from its config), micro-batch,
sequence length, world size, mixed-precision policy and activation checkpointing:

- real: one rank's real training step at that world size over torch's fake process group
  (``trace_rank(..., fake=False)``: real tensors, collectives that move nothing), which was
  measured equal, byte for byte, to real multi-rank FSDP2 under torchrun (gloo). Small models only.
- batchfit: ``trace_rank`` (FSDP2 itself on fake tensors), the peak of the later step.
- FSDPMemTracker: torch's ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, used the
  way torchtitan's ``scripts/estimate/estimation.py`` uses it: a fake process group on a
  ``FakeStore``, the device mesh made before ``FakeTensorMode``, the model built inside it,
  ``fully_shard`` on each block and then the root, two training steps with ``reset_mod_stats``
  after the first. Reported twice: the peak over both steps (what that script prints as
  "Tracker Max") and the peak of the later step alone (the tracker re-entered for it, which starts
  its peak afresh).
- DeepSpeed: ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (ZeRO-3, no
  offload): ``4 * largest_layer_params + 18 * total_params / gpus`` bytes per GPU. Model states only.
- torch-kitsune: ``kitsune.predict.estimate_multi_gpu(strategy="zero3")``.

The training loop is the same for every traced method: Hugging Face's own loss, backward, AdamW
(``foreach``), ``zero_grad(set_to_none=True)``, the output and loss kept alive into the next step
as a hand-written loop keeps them. Llama-3-8B at 8 ranks runs batchfit and FSDPMemTracker each in a
subprocess limited to ``BIG_LIMIT_SECONDS``; a method that takes longer is reported as skipped.
Writes benchmarks/SHARDED-PEERS.md and benchmarks/sharded-peers.json (atomically).

    .venv/bin/python benchmarks/sharded_peers.py       # needs transformers; deepspeed, torch-kitsune optional
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchfit.files import atomic_write_text
from batchfit.parallel import Parallelism
from batchfit.parallel import model_config
from batchfit.parallel import trace_rank

HERE = Path(__file__).parent
MD_PATH, JSON_PATH = HERE / "SHARDED-PEERS.md", HERE / "sharded-peers.json"
BATCH_SIZE, SEQ_LEN = 2, 512
WORLD_SIZES = (2, 4, 8)
CHECKPOINTING = ("none", "full")
PRECISIONS = {"bf16/fp32": ("bf16", "fp32"), "fp32": (None, None)}  # (param_dtype, reduce_dtype) of FSDP2's policy
SMALL_LLAMA_LIKE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}
SMALL_GPT2 = {"n_layer": 2, "n_embd": 256, "n_head": 8, "vocab_size": 4096, "bos_token_id": 0, "eos_token_id": 0}
SMALL_MODELS = {  # the family's published config (batchfit.parallel.LLM_PRESETS) made small
    "Llama-3 (small)": ("llama-3-8b", SMALL_LLAMA_LIKE),
    "Mistral (small)": ("mistral-7b", SMALL_LLAMA_LIKE),
    "Qwen2.5 (small)": ("qwen2.5-7b", SMALL_LLAMA_LIKE),
    "GPT-2 (small)": ("gpt2-xl", SMALL_GPT2),
}
FP32_TOO = ("Llama-3 (small)",)  # the models also run without a mixed-precision policy
BIG = {"model": "Llama-3-8B", "preset": "llama-3-8b", "world_size": 8, "batch_size": 1, "seq_len": 2048}
BIG_LIMIT_SECONDS = 120
DEEPSPEED_SOURCE = "deepspeed/runtime/zero/stage3.py"
DEEPSPEED_DOC = (
    "DeepSpeed's documentation, Memory Requirements (https://deepspeed.readthedocs.io/en/latest/memory.html, "
    "docs/code-docs/source/memory.rst in deepspeedai/DeepSpeed)"
)
KITSUNE_PARTS = (
    "param_bytes",
    "gradient_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "comm_buffer_bytes",
    "overhead_bytes",
)
MIB = 2**20


# -- the settings -----------------------------------------------------------------------------


def parallelism_for(world_size: int, precision: str, checkpointing: str) -> Parallelism:
    param_dtype, reduce_dtype = PRECISIONS[precision]
    return Parallelism(
        world_size=world_size,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=checkpointing,
    )


def compute_dtype(parallelism: Parallelism) -> torch.dtype:
    return parallelism.param_dtype or torch.float32


def build_model(config: Any) -> nn.Module:
    """The causal LM of ``config`` in fp32 (FSDP2 keeps fp32 shards; its policy sets the compute
    dtype), SDPA attention, as batchfit builds it. Call inside a fake mode or a meta device."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


# -- torchtitan's method: FSDPMemTracker over a fake world -------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """torch's fake process group on a FakeStore and its 1-D device mesh, made before any fake mode."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def plain_batch_packing(batch_size: int, seq_len: int, decide: bool) -> Iterator[None]:
    """transformers decides whether a batch is packed by reading ``position_ids`` values, which fake
    tensors do not have; it then treats any fake batch as packed. With ``decide``, the check answers
    what it answers for this plain batch on real tensors (computed here before any fake mode)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    answer = original(torch.arange(seq_len).expand(batch_size, seq_len))
    if decide:
        masking_utils.find_packed_sequence_indices = lambda position_ids: answer
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def shard_blocks_then_root(model: nn.Module, mesh: Any, parallelism: Parallelism) -> nn.Module:
    """Common practice (torchtitan's): each transformer block (the model's ``_no_split_modules``)
    optionally wrapped for non-reentrant activation checkpointing, ``fully_shard`` on each, then the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard

    names = set(model._no_split_modules)
    blocks = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    blocks = [(parent, name, child) for parent, name, child in blocks if type(child).__name__ in names]
    policy = MixedPrecisionPolicy(param_dtype=parallelism.param_dtype, reduce_dtype=parallelism.reduce_dtype)
    for parent, name, block in blocks:
        if parallelism.activation_checkpointing == "full":
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            parent.register_module(name, block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _tracker_total(tracker: Any) -> tuple[int, dict[str, int]]:
    snapshot = tracker.get_tracker_snapshot("peak")
    total = sum(per_device["Total"] for per_device in snapshot.values())
    parts: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            if key != "Total":
                parts[key.value] = parts.get(key.value, 0) + nbytes
    return total, parts


def tracker_peaks(config: Any, batch_size: int, seq_len: int, parallelism: Parallelism, decide: bool = True) -> dict:
    """FSDPMemTracker's peaks of one rank: each step's, their maximum (torchtitan's "Tracker Max"),
    and the later step's breakdown by the tracker's categories."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    start = time.perf_counter()
    with (
        plain_batch_packing(batch_size, seq_len, decide),
        fake_process_group(parallelism.world_size) as mesh,
        FakeTensorMode(),
    ):
        model = shard_blocks_then_root(build_model(config), mesh, parallelism)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs((input_ids,))
        step_peaks, output = [], None
        for _ in range(2):
            with tracker:  # entering starts the tracker's peak from the memory held now
                output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
                output.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_peaks.append(_tracker_total(tracker))
            tracker.reset_mod_stats()  # as torchtitan's script does: the tracker refuses a second iteration otherwise
    return {
        "step_peaks_bytes": [total for total, _ in step_peaks],
        "global_peak_bytes": max(total for total, _ in step_peaks),
        "later_step_bytes": step_peaks[-1][0],
        "later_step_breakdown": step_peaks[-1][1],
        "seconds": round(time.perf_counter() - start, 2),
    }


# -- batchfit and the real step -----------------------------------------------------------------


def batchfit_peak(config: Any, batch_size: int, seq_len: int, parallelism: Parallelism, fake: bool) -> dict:
    start = time.perf_counter()
    estimate = trace_rank(config, batch_size, seq_len, parallelism=parallelism, fake=fake)
    return {
        "peak_bytes": estimate.peak_bytes,
        "step_peaks_bytes": list(estimate.step_peaks_bytes),
        "peak_phase": estimate.peak_phase,
        "breakdown": dict(estimate.breakdown),
        "seconds": round(time.perf_counter() - start, 2),
    }


# -- the formulas: DeepSpeed and torch-kitsune ---------------------------------------------------


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` as DeepSpeed's ``model_to_params`` counts them (shared
    parameters once; a layer is one module's own parameters). Counted by identity here, because that
    function tells shared parameters apart by ``data_ptr``, which is 0 for every meta tensor."""
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def deepspeed_bytes(counts: tuple[int, int], world_size: int) -> int | None:
    """DeepSpeed's per-GPU figure for ZeRO-3 without offload on one node of ``world_size`` GPUs."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        total, largest = counts
        return 4 * largest + int(18 * total / world_size)  # the same published formula (DEEPSPEED_SOURCE)
    _, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
        *counts, num_gpus_per_node=world_size, num_nodes=1, cpu_offload=False, cpu_offload_params=False
    )
    return gpu_bytes


def kitsune_figures(meta_model: nn.Module, batch_size: int, seq_len: int, parallelism: Parallelism) -> dict | None:
    """torch-kitsune's per-GPU total for ZeRO-3 and its parts (``None`` when it is not installed): it
    takes the global batch, which it divides by the world size, and one input's shape without the batch."""
    try:
        from kitsune.predict import estimate_multi_gpu
    except ImportError:
        return None
    result = estimate_multi_gpu(
        meta_model,
        (seq_len,),
        total_batch_size=batch_size * parallelism.world_size,
        dtype=compute_dtype(parallelism),
        optimizer="adamw",
        strategy="zero3",
        world_size=parallelism.world_size,
    )
    return {"total_bytes": result.total_bytes, **{part: getattr(result, part) for part in KITSUNE_PARTS}}


def formula_figures(config: Any, batch_size: int, seq_len: int, parallelism: Parallelism) -> dict:
    with torch.device("meta"):
        meta_model = build_model(config)
    counts = parameter_counts(meta_model)
    kitsune = kitsune_figures(meta_model, batch_size, seq_len, parallelism)
    return {
        "parameters": counts[0],
        "largest_layer_parameters": counts[1],
        "deepspeed_bytes": deepspeed_bytes(counts, parallelism.world_size),
        "kitsune_bytes": None if kitsune is None else kitsune["total_bytes"],
        "kitsune": kitsune,
    }


# -- the runs -----------------------------------------------------------------------------------


def small_row(model_name: str, config: Any, world_size: int, precision: str, checkpointing: str) -> dict:
    parallelism = parallelism_for(world_size, precision, checkpointing)
    row = {
        "model": model_name,
        "world_size": world_size,
        "precision": precision,
        "activation_checkpointing": checkpointing,
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "real": batchfit_peak(config, BATCH_SIZE, SEQ_LEN, parallelism, fake=False),
        "batchfit": batchfit_peak(config, BATCH_SIZE, SEQ_LEN, parallelism, fake=True),
        "fsdp_mem_tracker": tracker_peaks(config, BATCH_SIZE, SEQ_LEN, parallelism),
        **formula_figures(config, BATCH_SIZE, SEQ_LEN, parallelism),
    }
    print(f"  {model_name} N={world_size} {precision} AC={checkpointing}: {row_summary(row)}", flush=True)
    return row


def row_summary(row: dict) -> str:
    figures = {name: figure(row, name) for name in ("real", "batchfit", "tracker later", "tracker global")}
    return ", ".join(f"{name} {mib(value)} MiB" for name, value in figures.items())


def naive_tracker_rows(configs: dict[str, Any]) -> list[dict]:
    """FSDPMemTracker on each model as torchtitan's recipe runs on a Hugging Face model when nothing
    decides transformers' packed-sequence check: the fake batch is taken as packed."""
    parallelism = parallelism_for(8, "bf16/fp32", "none")
    rows = []
    for name, config in configs.items():
        run = tracker_peaks(config, BATCH_SIZE, SEQ_LEN, parallelism, decide=False)
        rows.append({"model": name, "world_size": 8, "precision": "bf16/fp32", "fsdp_mem_tracker": run})
    return rows


def big_method(method: str) -> dict:
    """One method on Llama-3-8B (run in a subprocess, under a time limit)."""
    parallelism = Parallelism(world_size=BIG["world_size"], param_dtype="bf16", reduce_dtype="fp32")
    config = model_config(BIG["preset"])
    if method == "batchfit":
        return batchfit_peak(config, BIG["batch_size"], BIG["seq_len"], parallelism, fake=True)
    if method == "tracker":
        return tracker_peaks(config, BIG["batch_size"], BIG["seq_len"], parallelism)
    return formula_figures(config, BIG["batch_size"], BIG["seq_len"], parallelism)


def big_in_subprocess(method: str) -> dict:
    """``big_method(method)`` in a fresh interpreter; ``{"skipped": why}`` past ``BIG_LIMIT_SECONDS``."""
    start = time.perf_counter()
    command = [sys.executable, __file__, "--big", method]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BIG_LIMIT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return {"skipped": f"took over {BIG_LIMIT_SECONDS} s (stopped)"}
    if done.returncode != 0:
        return {"skipped": f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds_with_imports"] = round(time.perf_counter() - start, 1)
    return result


def big_row() -> dict:
    row = {**BIG, "precision": "bf16/fp32", "activation_checkpointing": "none"}
    for key, method in (("batchfit", "batchfit"), ("fsdp_mem_tracker", "tracker")):
        print(f"  {BIG['model']}: {key} (limit {BIG_LIMIT_SECONDS} s)...", flush=True)
        row[key] = big_in_subprocess(method)
    row.update(big_in_subprocess("formulas"))
    return row


# -- the report ---------------------------------------------------------------------------------


def figure(row: dict, name: str) -> int | None:
    """The bytes one method reports for ``row`` (``None`` where it was not run)."""
    if name in ("real", "batchfit"):
        return row.get(name, {}).get("peak_bytes")
    if name in ("tracker later", "tracker global"):
        tracker = row.get("fsdp_mem_tracker", {})
        return tracker.get("later_step_bytes" if name == "tracker later" else "global_peak_bytes")
    return row.get({"DeepSpeed": "deepspeed_bytes", "kitsune": "kitsune_bytes"}[name])


def mib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / MIB:,.1f}"


def error(value: int | None, real: int | None) -> str:
    if value is None or real is None:
        return "—"
    if value == real:
        return "exact"
    return f"{100 * (value - real) / real:+.2f}%"


METHODS = ("batchfit", "tracker later", "tracker global", "DeepSpeed", "kitsune")


def table(rows: list[dict]) -> list[str]:
    head = ["model", "ranks", "precision", "AC", "real MiB"]
    for name in METHODS:
        head += [f"{name} MiB", "err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        real = figure(row, "real")
        cells = [row["model"], str(row["world_size"]), row["precision"], row["activation_checkpointing"], mib(real)]
        for name in METHODS:
            value = figure(row, name)
            cells += [mib(value), error(value, real)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


SECONDS_KEYS = {"batchfit": ("batchfit", "seconds"), "tracker later": ("fsdp_mem_tracker", "seconds")}


def _mean_seconds(rows: list[dict], name: str) -> str:
    source, key = SECONDS_KEYS.get(name, (None, None))
    if source is None:
        return "—"
    return f"{sum(row[source][key] for row in rows) / len(rows):.2f}"


def error_summary(rows: list[dict]) -> list[str]:
    real_seconds = sum(row["real"]["seconds"] for row in rows) / len(rows)
    lines = [
        f"Mean seconds per row (one intra-op thread): real {real_seconds:.2f}, batchfit {_mean_seconds(rows, 'batchfit')}, "
        f"FSDPMemTracker (both steps) {_mean_seconds(rows, 'tracker later')}; the formulas take milliseconds.",
        "",
        "| method | rows | mean abs err | min err | max err |",
        "|---|---|---|---|---|",
    ]
    for name in METHODS:
        errors = [
            100 * (figure(row, name) - figure(row, "real")) / figure(row, "real")
            for row in rows
            if figure(row, name) is not None and figure(row, "real")
        ]
        if not errors:
            lines.append(f"| {name} | 0 | — | — | — |")
            continue
        mean_abs = sum(abs(e) for e in errors) / len(errors)
        lines.append(f"| {name} | {len(errors)} | {mean_abs:.2f}% | {min(errors):+.2f}% | {max(errors):+.2f}% |")
    return lines


def breakdown_lines(row: dict) -> list[str]:
    """The later step's peak by category: the real run and batchfit (batchfit's names) side by side,
    then the tracker's (its own names)."""
    real, fit = row["real"]["breakdown"], row["batchfit"]["breakdown"]
    title = f"{row['model']}, {row['world_size']} ranks, {row['precision']}, AC {row['activation_checkpointing']}"
    lines = [f"| {title} | real MiB | batchfit MiB |", "|---|---|---|"]
    lines += [f"| {key} | {mib(real.get(key))} | {mib(fit.get(key))} |" for key in real if real[key] or fit.get(key)]
    lines += ["", "| FSDPMemTracker, later step | MiB |", "|---|---|"]
    parts = row["fsdp_mem_tracker"]["later_step_breakdown"]
    lines += [f"| {key} | {mib(nbytes)} |" for key, nbytes in parts.items() if nbytes]
    return lines


def big_lines(row: dict) -> list[str]:
    """The 8B case: no real figure, so each method against batchfit (equal to real on the small models)."""
    fit, tracker = row.get("batchfit", {}), row.get("fsdp_mem_tracker", {})
    reference = fit.get("peak_bytes")
    lines = ["| method | per-rank MiB | against batchfit | note |", "|---|---|---|---|"]
    lines.append(_big_line("batchfit", "peak_bytes", fit, reference))
    lines.append(_big_line("FSDPMemTracker later step", "later_step_bytes", tracker, reference))
    lines.append(_big_line("FSDPMemTracker global peak", "global_peak_bytes", tracker, reference))
    for name, key in (("DeepSpeed model states", "deepspeed_bytes"), ("torch-kitsune", "kitsune_bytes")):
        lines.append(f"| {name} | {mib(row.get(key))} | {error(row.get(key), reference)} | formula |")
    lines.append("| real | — | — | not run: one rank of an 8B model needs about 30 GB of real memory |")
    return lines


def _big_line(name: str, key: str, run: dict, reference: int | None) -> str:
    if "skipped" in run:
        return f"| {name} | — | — | skipped: {run['skipped']} |"
    steps = ", ".join(mib(b) for b in run.get("step_peaks_bytes", []))
    seconds = f"{run.get('seconds')} s traced, {run.get('wall_seconds_with_imports')} s with imports"
    return f"| {name} | {mib(run.get(key))} | {error(run.get(key), reference)} | {seconds}; step peaks {steps} MiB |"


def versions() -> str:
    found = []
    for package in ("torch", "transformers", "deepspeed", "torch-kitsune"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def report(results: dict) -> str:
    rows, big = results["rows"], results["big"]
    lines = [
        "# One rank's memory under FSDP2: batchfit and its peers side by side",
        "",
        f"Written by `benchmarks/sharded_peers.py` in {results['seconds']:.0f} s on {results['machine']} "
        f"({results['versions']}). Small models: the family's published config (`batchfit.parallel.LLM_PRESETS`) "
        f"with {results['small_overrides']}; micro-batch {BATCH_SIZE} x {SEQ_LEN} tokens per rank; AdamW "
        "(`foreach`); FSDP2 `fully_shard` on each block, then the root; precision `bf16/fp32` is FSDP2's "
        "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` over fp32 shards, `fp32` is no policy; AC "
        "`full` wraps each block in torch's non-reentrant `checkpoint_wrapper`. Every traced method runs the same "
        "loop (Hugging Face's loss, backward, optimizer step, `zero_grad(set_to_none=True)`, output and loss kept "
        "into the next step); torchtitan's script runs its own models with `del pred` before backward and "
        "`clip_grad_norm_`, so only the method differs here, not the work. Figures in MiB (2^20 bytes), errors "
        "against the real figure; one intra-op thread (see `quiet_and_one_thread`).",
        "",
        "## The table",
        "",
        *table(rows),
        "",
        *error_summary(rows),
        "",
        f"## Llama-3-8B, {BIG['world_size']} ranks, micro-batch {BIG['batch_size']} x {BIG['seq_len']}, bf16/fp32, no AC",
        "",
        *big_lines(big),
        "",
        "## What each method counts and misses",
        "",
        *method_notes(results),
        "",
        "## Where the figures come from",
        "",
        *breakdown_lines(results["breakdown_row"]),
        "",
        "FSDPMemTracker run as torchtitan's recipe runs on a Hugging Face model when transformers' packed-sequence "
        "check is left to the fake tensors (the batch is then treated as packed), against the same tracker with the "
        "check decided as on real tensors (the table above):",
        "",
        *naive_lines(results),
        "",
    ]
    return "\n".join(lines)


def naive_lines(results: dict) -> list[str]:
    decided = {(row["model"]): row for row in results["rows"] if _is_naive_twin(row)}
    lines = ["| model | real MiB | tracker, check decided | tracker, check left to fake tensors | its err |"]
    lines.append("|---|---|---|---|---|")
    for naive in results["naive_tracker"]:
        row = decided[naive["model"]]
        real, value = figure(row, "real"), naive["fsdp_mem_tracker"]["later_step_bytes"]
        lines.append(
            f"| {naive['model']} | {mib(real)} | {mib(figure(row, 'tracker later'))} | {mib(value)} | {error(value, real)} |"
        )
    return lines


def _is_naive_twin(row: dict) -> bool:
    return row["world_size"] == 8 and row["precision"] == "bf16/fp32" and row["activation_checkpointing"] == "none"


def _worst(rows: list[dict], name: str) -> str:
    errors = [
        100 * (figure(row, name) - figure(row, "real")) / figure(row, "real")
        for row in rows
        if figure(row, name) is not None and figure(row, "real")
    ]
    if not errors:
        return "not run"
    if all(figure(row, name) == figure(row, "real") for row in rows if figure(row, "real")):
        return f"equal to real to the byte in all {len(errors)} rows"
    low, high = min(errors), max(errors)
    return f"{low:+.2f}% to {high:+.2f}%" if abs(high - low) >= 0.005 else f"{low:+.2f}%"


def _first_step_ratio(run: dict) -> str:
    peaks = run.get("step_peaks_bytes") or []
    return "not run" if len(peaks) < 2 else f"{peaks[0] / peaks[-1]:.2f}x"


def method_notes(results: dict) -> list[str]:
    """A paragraph per method: what it counts and misses, with this run's numbers."""
    rows, big = results["rows"], results["big"]
    return [
        REAL_NOTE,
        "",
        f"**batchfit** (`trace_rank`: FSDP2 itself on fake tensors, the later step's peak): the same categories as "
        f"the real run, from the same loop: {_worst(rows, 'batchfit')}. It answers transformers' packed-sequence "
        "check as real execution answers it for a plain batch, and its counter does not see the tensors DTensor's "
        "sharding propagation makes (and it reports the later step anyway). It misses what fake kernels do not "
        "allocate (ops whose fake version under-counts, which batchfit's trace lists and warns about) and what the "
        "real run misses on a GPU.",
        "",
        *tracker_note(rows, big),
        "",
        *deepspeed_note(rows, big),
        "",
        *kitsune_note(rows, big),
    ]


REAL_NOTE = (
    "**real** (one rank's real step over the fake process group, counted by batchfit's storage counter, each "
    "storage rounded up to the CUDA caching allocator's 512-byte blocks): every storage the rank holds: its "
    "parameter shards, the all-gathered parameters of the block in use, FSDP2's all-gather and reduce-scatter "
    "buffers, gradients, AdamW state, activations, backward and optimizer temporaries, the logits and Hugging "
    "Face's fp32 copy of them in the loss. It is the real figure on this CPU; a GPU adds what no tensor "
    "accounting sees: the CUDA context, NCCL's own communication buffers, cuBLAS/cuDNN workspaces and the caching "
    "allocator's fragmentation. No GPU has checked these figures."
)


def tracker_note(rows: list[dict], big: dict) -> list[str]:
    ratios = [
        row["fsdp_mem_tracker"]["step_peaks_bytes"][0] / row["fsdp_mem_tracker"]["later_step_bytes"] for row in rows
    ]
    tracker, fit = big.get("fsdp_mem_tracker", {}), big.get("batchfit", {})
    eight_b = "it was not run on Llama-3-8B this time (see above), where this distorts the figure"
    if "step_peaks_bytes" in tracker and "step_peaks_bytes" in fit:
        eight_b = (
            f"on Llama-3-8B its first step reads {_first_step_ratio(tracker)} its later one "
            f"({mib(tracker['step_peaks_bytes'][0])} MiB, where batchfit's first step, which does not count them, "
            f"reads {mib(fit['step_peaks_bytes'][0])} MiB)"
        )
    return [
        "**FSDPMemTracker** (torch's tracker in torchtitan's recipe): counts the same tensors by its own categories "
        "(sharded and unsharded parameters and gradients, activations, temporaries, all-gather and reduce-scatter "
        f"buffers, optimizer state, inputs). Its later step is {_worst(rows, 'tracker later')} from real: it counts "
        "each storage's exact bytes, without the 512-byte rounding, hence a few KiB below. Its global peak over both "
        f'steps, the figure torchtitan\'s script prints as "Tracker Max", is {_worst(rows, "tracker global")} '
        f"here only because on these small models the first step stays below the later one (first/later "
        f"{min(ratios):.2f}x to {max(ratios):.2f}x: no optimizer state yet). But {eight_b}: the global-shape fake "
        "tensors DTensor's sharding propagation makes on its cache misses in the first optimizer step are made in "
        "the user's own `FakeTensorMode`, which the tracker cannot tell apart from the rank's own work. Run on a "
        "Hugging Face model as-is, it also counts what transformers does with a fake batch it takes as packed (an "
        "explicit mask, K and V repeated for every head; last table). It refuses a second iteration unless "
        "`reset_mod_stats()` is called between steps, and it misses what the real run misses on a GPU."
    ]


def deepspeed_note(rows: list[dict], big: dict) -> list[str]:
    return [
        f"**DeepSpeed** (`estimate_zero3_model_states_mem_needs` in {DEEPSPEED_SOURCE}, ZeRO-3 without offload; "
        f"{DEEPSPEED_DOC}): `4 x largest_layer_params + 18 x total_params / GPUs` bytes: per parameter 16 bytes of "
        "fp32 parameter, gradient, momentum and variance plus 2 of fp16 parameter, sharded, and one gathered layer "
        "in fp16 with its fp16 gradient. Model states only, as its documentation says (activations and temporaries "
        f"are left to the user): {_worst(rows, 'DeepSpeed')} from real here, {error(big.get('deepspeed_bytes'), figure(big, 'batchfit'))} "
        "from batchfit on Llama-3-8B. No activations, no temporaries, no logits or loss, no all-gathered block "
        "beyond the largest layer, and nothing that depends on the micro-batch, the sequence length, activation "
        "checkpointing or FSDP2's mixed-precision policy: one figure per model and world size. Nothing runs, so no "
        "first-step distortion."
    ]


def kitsune_note(rows: list[dict], big: dict) -> list[str]:
    activations = [row["kitsune"]["activation_bytes"] for row in rows if row.get("kitsune")]
    if not activations:
        return ["**torch-kitsune**: not run: not installed here (`pip install torch-kitsune` leaves torch as it is)."]
    parts = big.get("kitsune") or {}
    eight_b = ""
    if parts:
        eight_b = (
            f" On Llama-3-8B it lands {error(parts['total_bytes'], figure(big, 'batchfit'))} from batchfit by "
            f"coincidence: its communication buffer ({mib(parts['comm_buffer_bytes'])} MiB, two fp32 parameter "
            f"shards, where FSDP2 gathers one bf16 block at a time) and 15% overhead ({mib(parts['overhead_bytes'])} "
            f"MiB) stand in for activations it puts at {mib(parts['activation_bytes'])} MiB."
        )
    return [
        '**torch-kitsune** (`kitsune.predict.estimate_multi_gpu(strategy="zero3")`): parameters, gradients and '
        "optimizer state divided by the world size, a communication buffer of two parameter shards, activations, "
        f"and 15% on top: {_worst(rows, 'kitsune')} from real here. On these Hugging Face causal LMs its "
        "activation estimate falls to its last resort: `torch.fx` cannot trace the model and its meta-device "
        "forward feeds floating-point numbers as token ids, which the embedding refuses, so its per-layer formula "
        "counts each Linear's output as batch x out_features, without the sequence dimension: at most "
        f"{max(activations, default=0) / 1024:,.0f} KiB of activations in these rows, no attention, no logits, no "
        "loss. It has no activation-checkpointing input (the same figure with and without) and no mixed-precision "
        f"policy (`dtype` only sets the activations' element size).{eight_b}"
    ]


def _overrides_text() -> str:
    llama_like = ", ".join(f"{key}={value}" for key, value in SMALL_LLAMA_LIKE.items())
    gpt2 = ", ".join(f"{key}={value}" for key, value in SMALL_GPT2.items())
    return f"{llama_like} (GPT-2: {gpt2})"


def quiet_and_one_thread() -> None:
    """One intra-op thread: on two shared cores, torch's two threads wait on each other's spin and a
    real step of these small models took 10x longer. Quiet kitsune's debug log."""
    torch.set_num_threads(1)
    logging.getLogger("kitsune").setLevel(logging.WARNING)


def main() -> None:
    quiet_and_one_thread()
    start = time.perf_counter()
    configs = {name: model_config(preset, **overrides) for name, (preset, overrides) in SMALL_MODELS.items()}
    rows = []
    for name, config in configs.items():
        for world_size in WORLD_SIZES:
            for precision in PRECISIONS if name in FP32_TOO else ("bf16/fp32",):
                for checkpointing in CHECKPOINTING:
                    rows.append(small_row(name, config, world_size, precision, checkpointing))
    print("FSDPMemTracker with the packed-sequence check left to fake tensors...", flush=True)
    naive = naive_tracker_rows(configs)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        "versions": versions(),
        "small_overrides": _overrides_text(),
        "deepspeed_formula": {"source": DEEPSPEED_SOURCE, "doc": DEEPSPEED_DOC},
        "rows": rows,
        "naive_tracker": naive,
        "big": big_row(),
    }
    results["breakdown_row"] = next(row for row in rows if _is_naive_twin(row))
    results["seconds"] = round(time.perf_counter() - start, 1)
    atomic_write_text(JSON_PATH, json.dumps(results, indent=1) + "\n")
    atomic_write_text(MD_PATH, report(results))
    print(f"wrote {MD_PATH.name} and {JSON_PATH.name} in {results['seconds']} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--big"]:
        quiet_and_one_thread()
        print(json.dumps(big_method(sys.argv[2])))
    else:
        main()
