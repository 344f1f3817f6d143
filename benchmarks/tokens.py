"""Token budgets on three decoders (Hugging Face Llama and GPT-2 from small configs, and batchfit's own
``lm-tiny``) over 6 sequence-length buckets, on simulated devices; writes ``benchmarks/TOKENS.md``.

For each model, in one run:

1. ``batchfit.tokens.token_budget_of_workload``: each bucket's largest padded batch and the packed budget,
   its trials counted.
2. The same buckets searched as NeMo's OOMptimizer searches each one: double from 1 until a size fails, then
   bisect (here to the exact edge, where OOMptimizer stops at a tolerance), every trial counted. Both must
   give the same answers.
3. A loop written by hand over a variable-length loader: per bucket, 20 steps of that bucket's batch size,
   each sequence's length drawn within the bucket and the batch padded to its longest; and 20 packed steps of
   the packed budget, lengths drawn over all buckets. Useful tokens per second of each (padding not counted).

Run: ``python benchmarks/tokens.py`` (about 4 minutes on two cores).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

import batchfit as bf
from batchfit.devices.resolve import resolve_device
from batchfit.search.prober import Prober
from batchfit.search.runner import usable_bytes
from batchfit.step.builtin_workloads import lm_tiny
from batchfit.tokens import token_budget_of_workload
from batchfit.tokens.samples import at_length

LENGTHS = [32, 64, 128, 256, 512, 1024]
STEPS = 20
OUT = Path(__file__).with_name("TOKENS.md")


def hf_workload(kind: str) -> bf.Workload:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LENGTHS[-1],
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=1024, n_embd=128, n_layer=2, n_head=4, n_positions=LENGTHS[-1])
        model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 512, (2, LENGTHS[-1]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}  # as a collator pads
    return bf.Workload(model, sample, optimizer=optimizer, name=f"HF {kind}")


def doubling_and_bisection(work: bf.Workload, seq_len: int, device: str) -> tuple[int, int]:
    """One bucket searched as OOMptimizer does: double until a failure, bisect to the edge. (answer, trials)."""
    at = dataclasses.replace(work, sample_batch=at_length(work.sample_batch, seq_len), accumulating=True)
    dev = resolve_device(device, at.model)
    _, limit = usable_bytes(dev, 0)
    trials = 0
    with Prober(dev.prepare(at), dev, steps=2, limit_bytes=limit) as prober:

        def fits(size: int) -> bool:
            nonlocal trials
            trials += 1
            return prober.probe(size).fits

        low, high = 0, 1
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
    return low, trials


def loop_tokens_per_second(work: bf.Workload, device: str, budget) -> tuple[list[str], float | None, str]:
    """Each bucket's 20 padded steps and 20 packed steps in a hand-written loop on a fresh device: what held,
    useful tokens per second padded (over all buckets) and packed."""
    fresh = bf.SimulatedDevice(resolve_device(device, work.model).capacity_bytes())
    model, optimizer = work.model, work.optimizer
    state = bf.StateSnapshot.take(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    held, useful, seconds = [], 0, 0.0
    edges = [0, *LENGTHS]
    # The loader's lengths are drawn on the host (Python ints, as a dataset's lengths are: a tensor made before the
    # device's accounting and touched inside it would be counted), before the loop; each batch is made on the
    # device as it is used.
    draws = [
        [
            torch.randint(low + 1, bucket.seq_len + 1, (bucket.batch_size,), generator=generator).tolist()
            for _ in range(STEPS)
        ]
        for low, bucket in zip(edges, budget.training.buckets, strict=False)
    ]
    packed = budget.training.packed
    packings = [packed_lengths(packed.tokens, generator) for _ in range(STEPS)] if packed and packed.tokens else []
    packed_text, packed_speed = "-", None
    try:
        with fresh.measuring():
            fresh.register([*model.parameters(), *model.buffers()])
            for lengths in draws:
                done, spent = run_steps(model, optimizer, (padded_batch(row, generator) for row in lengths))
                held.append(f"{done}/{STEPS}")
                useful, seconds = useful + sum(sum(row) for row in lengths[:done]), seconds + spent
            if packings:
                done, spent = run_steps(model, optimizer, (packed_batch(lengths, generator) for lengths in packings))
                packed_text, packed_speed = f"{done}/{STEPS}", packed.tokens * done / spent
    finally:
        state.restore()
    return (
        held,
        (useful / seconds if seconds else None),
        f"{packed_text}" + (f" ({packed_speed:,.0f} tok/s)" if packed_speed else ""),
    )


def padded_batch(lengths: list[int], generator: torch.Generator) -> dict:
    ids = torch.randint(0, 512, (len(lengths), max(lengths)), generator=generator)
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_lengths(tokens: int, generator: torch.Generator) -> list[int]:
    """Sequence lengths drawn over all buckets, packed end to end to ``tokens`` (the last one cut short)."""
    lengths, total = [], 0
    while total < tokens:
        lengths.append(min(int(torch.randint(1, LENGTHS[-1] + 1, (1,), generator=generator)), tokens - total))
        total += lengths[-1]
    return lengths


def packed_batch(lengths: list[int], generator: torch.Generator) -> dict:
    ids = torch.randint(0, 512, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def run_steps(model, optimizer, batches) -> tuple[int, float]:
    """Steps as a user writes them (the output held through backward), each batch made as a loader hands it over
    (one at a time, on the device); how many ran before an OOM, and the time."""
    done, start = 0, time.perf_counter()
    for batch in batches:
        try:
            outputs = model(**batch)
            outputs["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del outputs
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            break
        done += 1
    return done, time.perf_counter() - start


def main() -> None:
    cases = [("own decoder (lm-tiny)", lambda: lm_tiny(seq_len=LENGTHS[-1]), "sim:48MiB")]
    try:
        import transformers  # noqa: F401

        cases += [
            ("HF Llama (GQA, sdpa)", lambda: hf_workload("llama"), "sim:64MiB"),
            ("HF GPT-2 (sdpa)", lambda: hf_workload("gpt2"), "sim:256MiB"),
        ]
    except ImportError:
        print("transformers is not installed: the own decoder only", file=sys.stderr)
    rows, loops = [], []
    for name, make, device in cases:
        work = make()
        start = time.perf_counter()
        budget = token_budget_of_workload(work, LENGTHS, device=device)
        ours_seconds = time.perf_counter() - start
        start = time.perf_counter()
        theirs = [doubling_and_bisection(work, bucket.seq_len, device) for bucket in budget.training.buckets]
        theirs_seconds = time.perf_counter() - start
        ours = [bucket.batch_size for bucket in budget.training.buckets]
        same = ours == [answer for answer, _ in theirs]
        exact = all(bucket.search.exact for bucket in budget.training.buckets)
        packed = budget.training.packed
        bucket_trials = sum(len(bucket.search.trials) for bucket in budget.training.buckets)
        rows.append(
            f"| {name} | {device[4:]} | {', '.join(map(str, ours))} | {'yes' if exact else 'NO'} | "
            f"{'yes' if same else 'NO: ' + str([a for a, _ in theirs])} | **{bucket_trials}** ({ours_seconds:.0f} s, "
            f"packed +{packed.trials}) | {sum(t for _, t in theirs)} ({theirs_seconds:.0f} s) | "
            f"{', '.join(str(b.guess) if b.guess is not None else '-' for b in budget.training.buckets)} |"
        )
        held, padded_speed, packed_text = loop_tokens_per_second(work, device, budget)
        by_length = ", ".join(f"{length}: {search.batch_size}" for length, search in packed.searches.items())
        loops.append(
            f"| {name} | {min(b.tokens for b in budget.training.buckets)} | {packed.tokens} ({by_length}) | "
            f"{' '.join(held)} | {packed_text} | {padded_speed:,.0f} |"
        )
        print(rows[-1], loops[-1], sep="\n", flush=True)
    write(rows, loops)


def write(rows: list[str], loops: list[str]) -> None:
    text = f"""# Token budgets: per-bucket batch sizes and packed tokens per micro-batch

`python benchmarks/tokens.py` (torch {torch.__version__}, CPU, simulated devices with exact byte counting).
Buckets (each bucket's longest sequence): {", ".join(map(str, LENGTHS))}. Training: forward, backward,
AdamW step, the output held through backward as a hand-written loop holds it, measured as a later
micro-batch of an accumulation window (the window's gradients held), as batchfit measures token budgets
by default and every stack that batches by tokens runs them.

## Every bucket exact, and the trials it took

batchfit searches the longest and the shortest bucket, fits fixed + per-token + per-squared-length bytes
to their trials, and starts every other bucket's search at the fit's prediction ("first guesses").
The doubling-and-bisection column runs NeMo's OOMptimizer's search per bucket (double from 1, then
bisect; here to the exact edge) on the same buckets in the same process. "Exact": each answer fitted in
a trial and one more failed in a trial, at the bucket's longest sequence.

| model | device | batch per bucket | exact | same as doubling | batchfit trials | doubling + bisection trials | first guesses |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## Padded against packed, and the answers in a hand-written loop

Each bucket's answer runs {STEPS} steps in a loop written by hand, on a fresh device of the same capacity:
every sequence's length drawn within its bucket, the batch padded to its longest (steps that ran, per
bucket, shortest first). The packed budget runs {STEPS} steps of packed micro-batches, lengths drawn over
all buckets, `position_ids` restarting per sequence. Tokens per second count real tokens only (CPU time:
compare the two columns, not with a GPU).

| model | padded token budget (smallest over buckets) | packed budget (by composition) | padded loop, steps held | packed loop, steps held | padded useful tok/s |
|---|---|---|---|---|---|
{chr(10).join(loops)}
"""
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
