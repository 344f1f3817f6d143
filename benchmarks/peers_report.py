"""benchmarks/RESULTS.md from the results of benchmarks/peers.py: everything in it is read off the run."""

from __future__ import annotations

AUTO = "batchfit auto, trace first"


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**no**")


def _num(value: float) -> str:
    return f"{value:g}" if isinstance(value, int) or float(value).is_integer() else f"{value:.2f}"


def header(results: dict) -> list[str]:
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    return [
        "# batchfit against the peers, side by side",
        "",
        f"Generated on {results['date']} by `{results['command']}` in {results['benchmark_seconds']} s "
        f"(the true edges were read from `true_edges.json`; scanning them the first time takes longer).",
        "",
        f"- Machine: {results['machine']}; load average {results['load_average_at_start']} at the start and "
        f"{results['load_average_at_end']} at the end (the machine is shared).",
        f"- batchfit at commit {results['git']}.",
        f"- Python {results['python']}; {versions}; `torch.set_num_threads({results['torch_threads']})` for every "
        "method alike (two threads on two shared cores thrash and make timings meaningless).",
        "- Every method runs on `batchfit.SimulatedDevice`: real CPU compute, every live tensor byte counted "
        "(parameters, buffers, gradients, optimizer state, batch, activations), 512-byte allocator rounding, "
        "`torch.OutOfMemoryError` past the capacity. Each method gets a fresh, seeded workload and a fresh device. "
        "Before the timed runs one method of each kind (batchfit with its trace, Lightning, accelerate, "
        "Ultralytics-style) runs once on an extra cheap case (`mlp` on 6MiB), unrecorded, so none pays the "
        "process's first-call costs. Wall times are one run each on a shared machine: read them as ratios, not "
        "absolutes, and expect a ratio near a threshold to move between runs.",
        "",
    ]


def target_table(results: dict) -> list[str]:
    lines = [
        "## Targets for `auto, trace first` (the default where a trial is expensive)",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for t in results["targets"]:
        context = f" ({t['context']})" if t.get("context") else ""
        lines.append(f"| {t['target']} | {t['value']}{context} | {'yes' if t['met'] else '**no**'} |")
    auto = [r for r in results["runs"] if r["method"] == AUTO and r.get("trace_seconds")]
    if auto:
        share = sorted(r["trace_seconds"] / r["seconds"] for r in auto)[len(auto) // 2]
        lines += [
            "",
            f"The trace on fake tensors is a median {share:.0%} of `auto`'s wall time here: on these tiny CPU "
            "models one real trial costs milliseconds, so the trace costs more than the trials it saves. On a "
            "GPU, where a real model's trial costs seconds, the trials are what cost; that is not measured here.",
        ]
    return [*lines, ""]


def summary_table(results: dict) -> list[str]:
    lines = [
        "## Summary (medians over the cases)",
        "",
        "`found/true` counts a run with no answer as 0. `auto's time / this time` is the median, over the cases "
        "where the method returned an answer, of `auto`'s seconds divided by the method's.",
        "",
        "| method | exact | found/true (worst) | trials (worst) | OOM trials | steps | seconds | no answer | 20-step "
        "failures | answers never tested | auto's time / this time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summary"]:
        lines.append(
            f"| {s['method']} | {s['exact']}/{s['cases']} | {s['median_found_over_true']:.2f} "
            f"({s['worst_found_over_true']:.2f}) | {_num(s['median_trials'])} ({s['worst_trials']}) | "
            f"{_num(s['median_oom_trials'])} | {_num(s['median_steps'])} | {s['median_seconds']:.2f} | "
            f"{s['no_answer']} | {s['twenty_step_failures']} | {s['untested_answers']} | {s['auto_time_ratio']:.2f}x |"
        )
    peers = [s for s in results["summary"] if s["method"] in results["peers"]]
    lines += [
        "",
        "**batchfit `auto` time as a ratio of each peer's time** (median over the cases of auto's seconds "
        "divided by the peer's; below 1 means `auto` is faster):",
        "",
        "| " + " | ".join(s["method"] for s in peers) + " |",
        "|" + "---|" * len(peers),
        "| " + " | ".join(f"{s['auto_time_ratio']:.2f}x" for s in peers) + " |",
        "",
    ]
    return lines


def case_matrix(results: dict) -> list[str]:
    methods = [s["method"] for s in results["summary"]]
    lines = [
        "## Found / true, and trials, per case",
        "",
        "Each cell: the size found, then `(trials/OOM trials)`. A `!` marks a size that failed the 20-step check; "
        "`crash` a run that raised instead of answering.",
        "",
        "| workload | capacity | true | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for case in results["cases"]:
        where = (case["workload"], case["capacity"])
        mine = {r["method"]: r for r in results["runs"] if (r["workload"], r["capacity"]) == where}
        cells = []
        for method in methods:
            r = mine[method]
            mark = "!" if r["twenty_steps_ok"] is False else ""
            found = r["found"] if r["found"] is not None else ("crash" if r.get("error") else "none")
            cells.append(f"{found}{mark} ({r['trials']}/{r['oom_trials']})")
        lines.append(f"| {case['workload']} | {case['capacity']} | {case['true']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def every_run(results: dict) -> list[str]:
    lines = [
        "## Every run",
        "",
        "<details><summary>All runs, with the sizes each one tried in order</summary>",
        "",
        "| workload | capacity | method | found/true | trials | OOM | steps | seconds | 20 steps ok | sizes tried |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        traced = f" (trace: {r['trace_estimate']}, {r['trace_seconds']:.2f} s)" if r.get("trace_seconds") else ""
        traced += f" ({r['error']})" if r.get("error") else ""
        lines.append(
            f"| {r['workload']} | {r['capacity']} | {r['method']} | {r['found']}/{r['true']} | {r['trials']} | "
            f"{r['oom_trials']} | {r['steps']} | {r['seconds']:.2f} | {_yes(r['twenty_steps_ok'])} | "
            f"{' '.join(map(str, r['sizes']))}{traced} |"
        )
    return [*lines, "", "</details>", ""]


def auto_misses(results: dict) -> list[str]:
    """The cases where ``auto`` needed more than 4 trials or missed the edge, read off the runs."""
    misses = [r for r in results["runs"] if r["method"] == AUTO and (r["trials"] > 4 or r["found"] != r["true"])]
    if not misses:
        return []
    lines = ["### Where `auto` needed more than 4 trials", ""]
    if any(r["workload"] == "lstm" for r in misses):
        lines += [
            "On the LSTM the trace over-estimates the edge: a CPU `nn.LSTM` runs as `aten.mkldnn_rnn_layer`, whose "
            "real output includes a workspace saved for backward (about 96 KB per sample here) that the op's fake "
            "kernel returns empty, so the trace misses most of the forward's memory. `auto` then recovers from "
            "the failed guess with real trials (below), paying OOM trials for it. A batchfit bug to fix in the "
            "trace device, left as is here.",
            "",
        ]
    for r in misses:
        lines.append(
            f"- {r['workload']} on {r['capacity']}: the trace estimated {r.get('trace_estimate')} against a true "
            f"edge of {r['true']}; the real trials then went {' '.join(map(str, r['sizes']))} "
            f"({r['trials']} trials, {r['oom_trials']} OOM, {r['seconds']:.2f} s)."
        )
    return [*lines, ""]


def method_notes(results: dict) -> list[str]:
    wording = results["oom_wording"]
    return [
        "## How each method ran",
        "",
        "- **batchfit `auto` (default)**: `bf.search_workload(workload, device=SimulatedDevice(capacity))` with its "
        "defaults (`trace='auto'`): a trial here costs milliseconds, so it starts with real trials at 2 and 3, whose "
        "storages' lines put the edge, then tries it and one more.",
        "- **`auto, trace first`** (`trace=True`): the edge is traced on fake tensors (`TraceDevice`) first, as the "
        "default does where a trial is expensive (a GPU), then real trials verify it and one more. Trials, OOMs and "
        "steps count real trials only; the trace's estimate and time are in the run's row, and its time is in the "
        "seconds. The targets below are this method's.",
        "- **`auto, no trace`**: `trace=False`. **`power`**: batchfit's doubling, then bisection.",
        "- **`binary`**: the classic bisection of `[1, 512]` from the middle, run by batchfit with full training steps "
        "(the classic recipe skips the optimizer step). Its cap of 512 caps its answer.",
        f"- **`grow`**: estimate-then-grow: start at an estimate, x1.5 up, bisect after a failure, at most "
        f"{results['settings']['grow_attempts']} attempts. With no rule table to estimate from, it starts at "
        f"{results['settings']['grow_start']} and is capped at 512.",
        '- **Lightning**: `Tuner(Trainer(accelerator="cpu")).scale_batch_size(module, mode=...)` with Lightning\'s '
        "defaults: `steps_per_trial=3`, `init_val=2`, `max_trials=25`, `max_val=8192`, and in `binsearch` mode "
        "`margin=0.05`, which cuts the answer by 5% after the search (to a size usually never tested); the "
        "`margin 0` row shows the search alone. The `LightningModule` wraps the workload's model, loss and "
        "optimizer; its `train_dataloader` reads `self.batch_size` and serves the same sample rows batchfit's trials "
        "use. The whole call, Lightning's checkpoint save and restore included, runs inside "
        "`device.measuring()` with the model's state registered, so its OOMs are the simulated device's. Trials "
        "are counted by wrapping Lightning's `_try_loop_run` (one call per trial), steps by `on_train_batch_end`. "
        "Lightning's loop holds a little more than a plain step (it prefetches the next batch), so its own edge "
        "can sit just below the plain loop's.",
        f"- **accelerate**: `find_executable_batch_size(train, starting_batch_size=128 or 1024)`; `train(batch_size)` "
        f"runs {results['settings']['accelerate_steps_per_call']} real training steps inside `device.measuring()`. "
        f"The installed accelerate multiplies the size by {accelerate_factor(results)} after each OOM. It never "
        "tries a size above its start, so from 128 it cannot find an edge above 128.",
        "- **Ultralytics-style 60%**: written here from Ultralytics' documented `autobatch` (no code copied): "
        "forward and backward (no optimizer step, as Ultralytics profiles) at 1, 2, 4, 8 and 16; a least-squares "
        "line of peak bytes against batch size; the batch whose predicted peak is 60% of the capacity; below the "
        "first profiled size that failed, if one did; 16 if the pick falls outside [1, 1024]. Its `steps` are "
        "those forward and backward passes.",
        f"- **20-step check**: a fresh workload and device, the state and sample registered, then "
        f"{results['settings']['check_steps']} plain training steps (forward, loss, backward, optimizer step, "
        "`zero_grad`) at the size found, inside `device.measuring()`. Run once per case and size, shared by the "
        "methods that found the same size.",
        "- **After an OOM in backward**: on the CPU, backward runs on the calling thread, and after an error the "
        "autograd engine keeps the failed graph's pending tasks, with their activations, in that thread's queue "
        "until the next backward; no garbage collection frees them. On a GPU the device's own autograd thread "
        "drops them at once. batchfit's prober drains the queue (a one-element backward) after each trial; the "
        "benchmark does the same when each peer trial ends (accelerate's call, Lightning's `_try_loop_run`, each "
        "Ultralytics profile), outside the device's accounting, so no peer is charged for this CPU-only effect. "
        "Without it, accelerate from 128 on `resnet-bn` at 2.5MiB kept the leaked activations and walked down to 1.",
        *lightning_crashes(results),
        "",
        "## The true edge",
        "",
        "A linear scan on the simulated device: batchfit's `Prober` runs 2 full training steps at 1, 2, 3, ... "
        "(state restored after each) until the first size that does not fit; the edge is the size before it. "
        "The scan also checks that the measured peak never decreases as the batch grows. Edges are cached in "
        "`true_edges.json` under the key format of `search_strategies.py` (three of them were already there from "
        "it); delete an entry to scan it again.",
        "",
        "## Peers see the simulated OOM as an OOM",
        "",
        "Lightning and accelerate decide whether to retry by matching the error's message. The simulated device's "
        f"message reads: `{wording['message']}`. It contains `DefaultCPUAllocator: can't allocate memory`, which "
        "Lightning's `is_out_of_cpu_memory` (`lightning/pytorch/utilities/memory.py`, part of `is_oom_error`) and "
        "accelerate's `should_reduce_batch_size` (`accelerate/utils/memory.py`, its CPU entry) both look for in a "
        "one-argument `RuntimeError` (`torch.OutOfMemoryError` is one). Their GPU entries would not match it "
        "(Lightning's needs `CUDA` in the message, accelerate's ` out of memory.` a full stop). Called on a real "
        f"simulated OOM in this run: Lightning `is_oom_error` -> {wording['lightning_is_oom_error']}, accelerate "
        f"`should_reduce_batch_size` -> {wording['accelerate_should_reduce_batch_size']}.",
        "",
    ]


def accelerate_factor(results: dict) -> str:
    """accelerate's back-off as this run saw it: the second size over the first."""
    for r in results["runs"]:
        if r["method"].startswith("accelerate") and len(r["sizes"]) > 1:
            return f"about {r['sizes'][1] / r['sizes'][0]:.2f}"
    return "a fixed factor"


def lightning_crashes(results: dict) -> list[str]:
    crashed = [r for r in results["runs"] if str(r.get("error", "")).startswith("crashed")]
    if not crashed:
        return []
    where = "; ".join(sorted({f"{r['workload']} on {r['capacity']} ({r['method']})" for r in crashed}))
    return [
        f"- **Lightning crashed** in {len(crashed)} run(s): {where} (`{crashed[0]['error']}`). After a trial's "
        "OOM, Lightning's scaler calls `_reset_dataloaders` inside its `except` block, which builds a new "
        "DataLoader and a small tensor (`has_len_all_ranks`) while the exception's traceback still holds the "
        "failed trial's activations. When that trial died within a block or two of the capacity, the small "
        "allocation fails as well and the OOM escapes `scale_batch_size`: the user gets an exception, not a size. "
        "The simulated device counts every byte; a CUDA caching allocator may still have a free 512-byte slot "
        "there, so read this as an exposure of Lightning's at the edge, not a certain GPU failure. batchfit's "
        "prober records the OOM and frees the trial after leaving its `except` block.",
    ]


def write_report(results: dict) -> str:
    lines = [
        *header(results),
        *target_table(results),
        *auto_misses(results),
        *summary_table(results),
        *case_matrix(results),
        *method_notes(results),
        *every_run(results),
    ]
    return "\n".join(lines)
