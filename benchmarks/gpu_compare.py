"""What a GPU measured (``benchmarks/gpu_check.py``'s figures) against what batchfit predicts, on the CPU.

Reads the figures JSON (a run's folder or the file itself), builds the same models from the specs stored in it,
and traces them here for the card's preset (``trace_for`` in the JSON), with PyTorch's caching allocator modelled:

- the traced peak (``estimate_memory``) at each batch the card measured a peak at: the hand-written loop's two
  steps at the fixed batch, batchfit's own trial there, and each size the search's trials fitted;
- the traced answer (``find_max_batch_size`` on a ``TraceDevice``, the search's cap kept), for each allocator
  setting the card searched with;
- the allocator model's verdict for the hand-written loop at each size the card ran it at (``probe_batch_size``
  on ``TraceDevice(preset, allocator=...)``: the trial's steps, then the loop run on in the model until its
  state repeats): held, or out of memory at step N, beside the card's outcome.

Prints a Markdown report (real vs predicted, the error in %, whether the loop's outcome matches) and, for a folder
or with ``--out``, writes it (``comparison.md`` in the folder); ``--json`` writes the predictions as data. Figures
marked ``"fixture": true`` are a test's synthetic values, and the report says so at the top.

    python benchmarks/gpu_compare.py benchmarks/gpu-check/nvidia-h100-80gb-hbm3-2026-11-28/
    python benchmarks/gpu_compare.py tests/data/gpu_check/fixture.json --out /tmp/comparison.md

``PYTORCH_CUDA_ALLOC_CONF`` is ignored here: each prediction names its allocator.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import gpu_check  # noqa: E402
from gpu_check import AMP  # noqa: E402
from gpu_check import TRACE_ALLOCATORS  # noqa: E402
from gpu_check import ModelSpec  # noqa: E402
from gpu_check import build  # noqa: E402
from gpu_check import trace_device  # noqa: E402

PEAK_COLUMNS = [
    "model", "batch", "run", "real allocated (bytes)", "predicted allocated (bytes)", "error",
    "real reserved (bytes)", "predicted reserved (bytes)", "error", "estimate on the card's machine (bytes)",
]  # fmt: skip
ANSWER_COLUMNS = [
    "model", "allocator", "real answer", "real trials (x: out of memory)", "predicted answer", "error",
    "traced on the card's machine",
]  # fmt: skip
LOOP_COLUMNS = ["model", "allocator", "batch", "real outcome", "predicted", "match"]


def load(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The figures and the file they came from (a folder means its ``gpu-check.json``)."""
    path = Path(path)
    file = path / gpu_check.RESULTS if path.is_dir() else path
    return json.loads(file.read_text()), file


def error(real: int | None, predicted: int | None) -> float | None:
    """The prediction's error relative to the real figure (``+0.05``: 5% over)."""
    if not real or predicted is None:
        return None
    return (predicted - real) / real


def _quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


class Predictor:
    """Traces one model, built from its spec, for ``target``; every prediction is made once."""

    def __init__(self, spec: ModelSpec, target: str | int):
        self.spec, self.target = spec, target
        self.model, self.sample, self.loss_fn, self.make_optimizer = build(spec)
        self._estimates: dict[int, Any] = {}

    def options(self) -> dict[str, Any]:
        return {"loss_fn": self.loss_fn, "optimizer": self.make_optimizer(self.model), "amp_dtype": AMP}

    def estimate(self, batch: int) -> Any:
        """``estimate_memory`` at ``batch`` for the preset (the caching allocator modelled: its reserved peak)."""
        import batchfit as bf

        if batch not in self._estimates:
            device = trace_device(self.target)
            self._estimates[batch] = _quiet(
                bf.estimate_memory, self.model, self.sample, batch, device=device, **self.options()
            )
        return self._estimates[batch]

    def answer(self, allocator: str) -> int:
        """The traced answer for ``allocator`` (a ``TRACE_ALLOCATORS`` value), the search's cap kept."""
        import batchfit as bf

        device = trace_device(self.target, allocator)
        result = _quiet(
            bf.find_max_batch_size,
            self.model,
            self.sample,
            device=device,
            max_batch_size=self.spec.cap,
            **self.options(),
        )
        return result.batch_size

    def loop(self, batch: int, allocator: str) -> Any:
        """The allocator model's trial of the loop at ``batch``: a ``Trial`` (``fits``, ``loop_steps``, ...)."""
        import batchfit as bf

        device = trace_device(self.target, allocator)
        return _quiet(bf.probe_batch_size, self.model, self.sample, batch, device=device, **self.options())


def predicted_outcome(trial: Any) -> str:
    """The model's verdict for the loop, in the words the card's outcome uses."""
    if trial.fits:
        if not trial.loop_steps:
            return "held"
        return f"held (settled by step {trial.loop_steps})" if trial.settled else f"held ({trial.loop_steps} steps)"
    if trial.oom:
        step = trial.loop_steps or trial.steps + 1
        return f"OOM at step {step}" + (f" ({trial.failed_phase})" if trial.failed_phase else "")
    return "over the usable memory"


def loop_match(real: dict[str, Any], trial: Any, planned: int) -> str:
    """Whether the card's loop outcome is what the model said: ``yes``, ``no``, or ``n/a`` with why.

    A model's out-of-memory step past the steps the card ran is no contradiction of a loop that held them."""
    outcome = real.get("outcome") or ""
    if outcome.startswith("OOM"):
        if trial.fits:
            return "no"
        step = trial.loop_steps or trial.steps + 1
        return "yes" if step == real.get("oom_step") else f"yes (step {step}, not {real.get('oom_step')})"
    if outcome.startswith("held"):
        ran = real.get("steps_run", planned)
        if trial.fits:
            return "yes" if ran >= planned else f"yes ({ran} steps ran)"
        step = trial.loop_steps or trial.steps + 1
        if not trial.oom:
            return "no"
        if step <= ran:
            return "no"
        return f"n/a (the model's OOM at step {step} comes after the {ran} steps run)"
    return f"n/a ({outcome or 'no outcome'})"


def _trials(search: dict[str, Any]) -> str:
    return ", ".join(f"{t['batch_size']}{'' if t['fits'] else ' x'}" for t in search.get("trials", []))


def compare_model(entry: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The predictions for one model of the figures, beside its real figures."""
    out: dict[str, Any] = {"key": entry["key"], "name": entry.get("name"), "peaks": [], "answers": [], "loops": []}
    if entry.get("status") == "skipped" or not entry.get("spec"):
        out["skipped"] = "; ".join(entry.get("notes", [])) or "skipped on the card"
        return out
    spec = ModelSpec.from_dict(entry["spec"])
    if spec.needs and importlib.util.find_spec(spec.needs) is None:
        out["skipped"] = f"{spec.needs} is not importable here"
        return out
    target = data["trace_for"]
    predictor = Predictor(spec, target)
    card = ((data.get("estimates") or {}).get(spec.key) or {}).get("at_fixed_batch") or {}
    fixed, probe = entry.get("fixed") or {}, entry.get("probe") or {}
    runs = []
    if fixed.get("peak_allocated_bytes") is not None:
        runs.append(
            ("the loop, 2 steps", fixed["batch"], fixed["peak_allocated_bytes"], fixed.get("peak_reserved_bytes"))
        )
    if probe.get("peak_bytes") is not None:
        runs.append(("batchfit's trial", probe["batch_size"], probe["peak_bytes"], probe.get("reserved_peak_bytes")))
    for label in TRACE_ALLOCATORS:
        search = entry.get("search" if label == "default" else f"search_{label}") or {}
        for trial in search.get("trials", []):
            if trial.get("fits") and trial.get("peak_bytes") is not None:
                name = f"search trial ({label} allocator)"
                runs.append((name, trial["batch_size"], trial["peak_bytes"], trial.get("reserved_peak_bytes")))
    for run, batch, real, reserved in runs:
        estimate = predictor.estimate(batch)
        out["peaks"].append(
            {
                "run": run,
                "batch": batch,
                "real_allocated": real,
                "predicted_allocated": estimate.peak_bytes,
                "error_allocated": error(real, estimate.peak_bytes),
                "real_reserved": reserved,
                "predicted_reserved": estimate.reserved_peak_bytes,
                "error_reserved": error(reserved, estimate.reserved_peak_bytes),
                "card_estimate": card.get("peak_bytes")
                if card.get("batch") == batch and run.startswith("the loop")
                else None,
                "undercounted_ops": list(estimate.undercounted_ops),
                "not_counted": list(estimate.not_counted),
            }
        )
    labels = [
        label for label in TRACE_ALLOCATORS if any(loop.get("allocator") == label for loop in entry.get("loops", []))
    ]
    for label, allocator in TRACE_ALLOCATORS.items():
        search = entry.get("search" if label == "default" else f"search_{label}")
        if not search and label not in labels:
            continue
        predicted = predictor.answer(allocator)
        real = (search or {}).get("batch_size")
        traced_on_card = ((data.get("estimates") or {}).get(spec.key) or {}).get("traced_answer") or {}
        out["answers"].append(
            {
                "allocator": label,
                "real": real,
                "real_trials": _trials(search or {}),
                "capped": bool((search or {}).get("capped")),
                "predicted": predicted,
                "error": error(real, predicted),
                "traced_on_card": traced_on_card.get("batch_size") if label == "default" else None,
                "traced_by_the_search": (search or {}).get("traced_batch_size"),
            }
        )
    planned = (data.get("settings") or {}).get("loop_steps", gpu_check.LOOP_STEPS)
    for loop in entry.get("loops", []):
        if not str(loop.get("outcome", "")).startswith(("held", "OOM")):
            out["loops"].append({**_loop_keys(loop), "predicted": None, "match": f"n/a ({loop.get('outcome')})"})
            continue
        trial = predictor.loop(loop["batch"], TRACE_ALLOCATORS[loop["allocator"]])
        out["loops"].append(
            {
                **_loop_keys(loop),
                "predicted": predicted_outcome(trial),
                "predicted_fits": trial.fits,
                "predicted_loop_steps": trial.loop_steps,
                "predicted_reserved_peak": trial.reserved_peak_bytes,
                "match": loop_match(loop, trial, planned),
            }
        )
    return out


def _loop_keys(loop: dict[str, Any]) -> dict[str, Any]:
    return {
        "allocator": loop.get("allocator"),
        "batch": loop.get("batch"),
        "real": loop.get("outcome"),
        "real_peak_reserved": loop.get("peak_reserved_bytes"),
    }


def _traced_on_card(answer: dict[str, Any]) -> str:
    """The traced answers made on the card's machine: the estimates' and the search's own first trace."""
    words = [str(answer["traced_on_card"])] if answer["traced_on_card"] else []
    if answer["traced_by_the_search"]:
        words.append(f"the search's own trace: {answer['traced_by_the_search']}")
    return "; ".join(words) or "-"


def _bytes(value: int | None) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _percent(value: float | None) -> str:
    return f"{value:+.2%}" if value is not None else "-"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}", *(f"| {' | '.join(row)} |" for row in rows)]


def report(data: dict[str, Any], source: Path, results: list[dict[str, Any]], seconds: float) -> str:
    import torch

    import batchfit

    machine = data.get("machine") or {}
    versions = machine.get("versions") or {}
    lines = ["# batchfit's predictions against the GPU check", ""]
    if data.get("fixture"):
        lines += [
            "**TEST FIXTURE: the 'real' figures below are synthetic values written for the comparison's test, not",
            f"measurements of any GPU** ({data.get('note', '')}).",
            "",
        ]
    elif data.get("smoke"):
        lines += ["**CPU smoke run: no GPU figures** (the orchestration's check, not a measurement).", ""]
    lines += [
        f"Figures: `{source}` ({machine.get('card', '?')}, {data.get('started', '?')}; torch {versions.get('torch', '?')}"
        f"{'' if data.get('complete', True) else '; the run did not complete'}). Predictions made here on the CPU in "
        f"{seconds:.0f} s: torch {torch.__version__}, batchfit {batchfit.__version__}, traced for `{data['trace_for']}` "
        "with PyTorch's caching allocator modelled, bf16 autocast as on the card.",
        "",
        "## Peaks",
        "",
    ]
    rows = []
    for result in results:
        for peak in result["peaks"]:
            rows.append(
                [result["key"], str(peak["batch"]), peak["run"], _bytes(peak["real_allocated"]),
                 _bytes(peak["predicted_allocated"]), _percent(peak["error_allocated"]), _bytes(peak["real_reserved"]),
                 _bytes(peak["predicted_reserved"]), _percent(peak["error_reserved"]), _bytes(peak["card_estimate"])]
            )  # fmt: skip
    lines += [*_table(PEAK_COLUMNS, rows), "", "## The largest batch that fits", ""]
    rows = []
    for result in results:
        for answer in result["answers"]:
            real = "-" if answer["real"] is None else str(answer["real"]) + (" (the cap)" if answer["capped"] else "")
            rows.append(
                [result["key"], answer["allocator"], real, answer["real_trials"] or "-", str(answer["predicted"]),
                 _percent(answer["error"]), _traced_on_card(answer)]
            )  # fmt: skip
    planned = (data.get("settings") or {}).get("loop_steps", gpu_check.LOOP_STEPS)
    lines += [*_table(ANSWER_COLUMNS, rows), "", f"## The hand-written loop, {planned} steps", ""]
    rows = []
    for result in results:
        for loop in result["loops"]:
            rows.append(
                [result["key"], str(loop["allocator"]), str(loop["batch"]), str(loop["real"]), str(loop["predicted"] or "-"),
                 loop["match"]]
            )  # fmt: skip
    lines += _table(LOOP_COLUMNS, rows)
    skipped = [f"- {result['key']}: {result['skipped']}" for result in results if result.get("skipped")]
    if skipped:
        lines += ["", "Not compared:", *skipped]
    notes = sorted({op for result in results for peak in result["peaks"] for op in peak["undercounted_ops"]})
    if notes:
        lines += ["", f"Under-counted by the trace (its peaks are lower bounds there): {', '.join(notes)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figures", help="a gpu_check.py run's folder, or its JSON")
    parser.add_argument("--out", help="write the Markdown report here (default: comparison.md in a run's folder)")
    parser.add_argument("--json", help="write the predictions as JSON here")
    parser.add_argument("--models", help="a comma-separated subset of the models' keys")
    args = parser.parse_args(argv)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # each prediction names its allocator
    data, source = load(args.figures)
    started = time.perf_counter()
    wanted = set(args.models.split(",")) if args.models else None
    results = [compare_model(entry, data) for entry in data.get("models", []) if not wanted or entry["key"] in wanted]
    text = report(data, source, results, time.perf_counter() - started)
    print(text)
    out = Path(args.out) if args.out else (source.parent / "comparison.md" if Path(args.figures).is_dir() else None)
    from batchfit.files import atomic_write_text

    if out is not None:
        atomic_write_text(out, text)
    if args.json:
        payload = {"source": str(source), "fixture": bool(data.get("fixture")), "trace_for": data["trace_for"]}
        atomic_write_text(args.json, json.dumps({**payload, "models": results}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
