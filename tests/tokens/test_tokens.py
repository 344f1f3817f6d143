"""Token budgets: every bucket's answer tried with one more failing, the fit's guesses, packed budgets,
forward budgets, the loop a user writes over a variable-length loader, and the command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import batchfit as bf
from batchfit.cli import app
from batchfit.search.trial import Trial
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.builtin_workloads import lm_tiny
from batchfit.tokens import TokenMemoryFit
from batchfit.tokens import bucket_lengths
from batchfit.tokens import token_budget_of_workload
from batchfit.tokens.budget import search_order
from batchfit.tokens.lengths import parse_buckets
from batchfit.tokens.memory_fit import LengthLine
from batchfit.tokens.samples import PackedRows
from batchfit.tokens.samples import at_length
from batchfit.tokens.samples import packed_rows

pytestmark = pytest.mark.xdist_group("tokens")  # one worker computes the module's budget once

DEVICE = "sim:16MiB"
LENGTHS = [16, 32, 64, 128]


def tried_sizes(trials) -> list[tuple[int, bool]]:
    return [(trial.batch_size, trial.fits) for trial in trials]


def tried(search) -> list[tuple[int, bool]]:
    return tried_sizes(search.trials)


def confirmed(search) -> None:
    """The answer fitted in a trial and one more failed in a trial, both at this length."""
    outcomes = dict(tried(search))
    assert outcomes[search.batch_size] is True
    assert outcomes[search.batch_size + 1] is False


@pytest.fixture(scope="module")
def budget():
    return token_budget_of_workload(lm_tiny(seq_len=128, layers=1), LENGTHS, device=DEVICE, forward=True)


def test_buckets_are_given_or_made_by_halving_and_bad_ones_are_refused_in_one_line():
    assert bucket_lengths(max_seq_len=1000, count=3) == [250, 500, 1000]
    assert bucket_lengths([64, 16, 32]) == [16, 32, 64]
    for bad in ({"buckets": [16, 16]}, {"buckets": [0, 16]}, {"buckets": []}, {}, {"buckets": [8], "max_seq_len": 8}):
        with pytest.raises(bf.InputError) as error:
            bucket_lengths(**bad)
        assert "\n" not in str(error.value)
    with pytest.raises(bf.InputError, match="separated by commas"):
        parse_buckets("16,abc")


def test_samples_are_cut_or_padded_to_a_length_and_packed_as_rows_of_tokens():
    sample = {"input_ids": torch.arange(12).view(2, 6), "attention_mask": torch.ones(2, 6), "label": torch.ones(2)}
    assert at_length(sample, 4)["input_ids"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    padded = at_length(sample, 8)
    assert padded["input_ids"].shape == (2, 8) and padded["attention_mask"].sum().item() == 15  # one padded position
    assert padded["label"].shape == (2,)
    rows = packed_rows(sample, 4)
    assert sorted(rows) == ["input_ids", "position_ids"]  # no mask: position_ids bound the sequences
    assert rows["input_ids"].tolist() == [0, 1, 2, 3] and rows["position_ids"].tolist() == [0, 1, 2, 3]
    model = PackedRows(torch.nn.Embedding(12, 3))
    assert model(input=rows["input_ids"]).shape == (1, 4, 3)
    assert list(model.parameters()) == list(model.model.parameters())


def phased(batch_size: int, peak: int) -> Trial:
    return Trial(batch_size, True, peak, 0.1, phase_peak_bytes={"forward": peak // 2, "backward": peak})


def test_the_fit_recovers_per_token_and_per_squared_bytes_and_never_a_negative_square():
    lines = [LengthLine(length, 1000.0, 40 * length + 0.5 * length**2) for length in (16, 64, 256)]
    fit = TokenMemoryFit.of(lines)
    assert fit.bytes_per_token == pytest.approx(40) and fit.bytes_per_squared_token == pytest.approx(0.5)
    assert fit.largest_batch_size(128, 1000 + 5 * (40 * 128 + 0.5 * 128**2)) == 5
    concave = TokenMemoryFit.of([LengthLine(16, 0.0, 16 * 50.0), LengthLine(64, 0.0, 64 * 40.0)])
    assert concave.bytes_per_squared_token == 0.0 and concave.bytes_per_token > 0
    line = LengthLine.through(8, [phased(1, 700), phased(3, 1100), Trial(9, False, None, 0.1)], 10_000)
    assert (line.fixed_bytes, line.bytes_per_row) == (500.0, 200.0)


def test_the_searches_run_longest_then_shortest_then_between():
    assert search_order([16, 32, 64, 128]) == [128, 16, 64, 32]
    assert search_order([64]) == [64] and search_order([16, 64]) == [64, 16]


def test_every_bucket_is_tried_at_its_answer_and_one_above(budget):
    for mode in budget.modes:
        assert [bucket.seq_len for bucket in mode.buckets] == LENGTHS
        for bucket in mode.buckets:
            confirmed(bucket.search)
            assert bucket.tokens == bucket.batch_size * bucket.seq_len
        sizes = [bucket.batch_size for bucket in mode.buckets]
        assert sizes == sorted(sizes, reverse=True)  # a longer sequence never fits more rows


def test_the_fit_of_two_buckets_sends_the_others_straight_to_their_edge(budget):
    """The longest and shortest are searched; the middle two start at the fit's guess. Where the guess is the
    answer, the search runs exactly two trials: the guess, and one more that fails."""
    for mode in budget.modes:
        first, middle, last = mode.buckets[0], mode.buckets[1:3], mode.buckets[3]
        assert first.guess is None and last.guess is None
        for bucket in middle:
            assert bucket.guess is not None
            if bucket.guess == bucket.batch_size:
                assert tried(bucket.search) == [(bucket.guess, True), (bucket.guess + 1, False)]
            assert abs(bucket.guess - bucket.batch_size) <= max(2, bucket.batch_size // 20)
        assert mode.trials == sum(len(bucket.search.trials) for bucket in mode.buckets) + mode.packed.trials
    assert budget.trials == budget.training.trials + budget.forward.trials


@pytest.mark.slow  # a cross-check; benchmarks/tokens.py runs it on every bucket of three models
def test_each_answer_is_the_one_a_binary_search_of_its_own_finds(budget):
    work = lm_tiny(seq_len=128, layers=1)
    for bucket in budget.training.buckets[1:3]:
        at = dataclasses.replace(work, sample_batch=at_length(work.sample_batch, bucket.seq_len), accumulating=True)
        assert bf.search_workload(at, device=DEVICE, strategy="binary").batch_size == bucket.batch_size


def test_the_packed_budget_is_tried_in_tokens_with_one_more_failing(budget):
    for mode in budget.modes:
        packed = mode.packed
        assert sorted(packed.searches) == [16, 128] and packed.skipped is None
        confirmed(packed.search)
        assert packed.tokens == min(search.batch_size for search in packed.searches.values())
        assert packed.tokens >= 128  # the longest sequence alone fits packed
    assert budget.forward.packed.tokens > budget.training.packed.tokens
    for train, forward in zip(budget.training.buckets, budget.forward.buckets, strict=True):
        assert forward.batch_size > train.batch_size  # no gradients, no optimizer state, no saved activations


def test_the_answers_hold_in_a_hand_written_loop_over_variable_lengths(budget):
    """A loader that draws each sequence's length within its bucket and pads the batch to its longest, at the
    bucket's answer, trains 5 steps on the same device without running out of memory; packed micro-batches of
    the packed budget, sequences of random lengths, do too."""
    work = lm_tiny(seq_len=128, layers=1)
    device = bf.SimulatedDevice("16MiB")
    model, optimizer = work.model, work.optimizer
    generator = torch.Generator().manual_seed(0)
    edges = [0, *LENGTHS]
    with device.measuring():
        device.register([*model.parameters(), *model.buffers()])
        for low, bucket in zip(edges, budget.training.buckets, strict=False):
            for _ in range(5):
                lengths = torch.randint(low + 1, bucket.seq_len + 1, (bucket.batch_size,), generator=generator)
                ids = torch.randint(0, 512, (bucket.batch_size, int(lengths.max())), generator=generator)
                outputs = model(input_ids=ids, labels=ids)
                outputs["loss"].backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del outputs
        tokens = budget.training.packed.tokens
        for _ in range(5):
            lengths, total = [], 0
            while total < tokens:
                lengths.append(min(int(torch.randint(1, 129, (1,), generator=generator)), tokens - total))
                total += lengths[-1]
            ids = torch.randint(0, 512, (1, tokens), generator=generator)
            positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
            outputs = model(input_ids=ids, labels=ids, position_ids=positions)
            outputs["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del outputs


def test_a_search_leaves_the_model_and_optimizer_as_they_were():
    work = lm_tiny(seq_len=32, layers=1)
    before = {name: value.clone() for name, value in work.model.state_dict().items()}
    token_budget_of_workload(work, [16, 32], device=DEVICE, packed=False)
    after = work.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert work.optimizer.state == {} and all(p.grad is None for p in work.model.parameters())


def test_a_sample_that_cannot_be_packed_is_skipped_with_why_or_refused_when_packing_is_asked():
    work = gpt_tiny(seq_len=32)
    budget = token_budget_of_workload(work, [32], device=DEVICE)
    assert budget.training.packed.tokens is None and "mapping sample" in budget.training.packed.skipped
    assert "verl" not in budget.lines and "fairseq" in budget.lines  # padded lines only
    with pytest.raises(bf.InputError, match="cannot measure a packed budget"):
        token_budget_of_workload(work, [32], device=DEVICE, packed=True)


def test_the_library_function_takes_a_model_and_sample_as_find_max_batch_size_does():
    work = lm_tiny(seq_len=64, layers=1)
    budget = bf.find_token_budget(
        work.model, work.sample_batch, max_seq_len=64, optimizer=work.optimizer, device=DEVICE, packed=False
    )
    assert budget.lengths == [2, 4, 8, 16, 32, 64]
    assert budget.to_dict()["training"]["buckets"][-1]["batch_size"] == budget.training.buckets[-1].batch_size


def test_the_command_prints_each_bucket_and_the_stacks_lines_and_writes_json(tmp_path):
    out = tmp_path / "tokens.json"
    args = ["tokens", "lm-tiny", "--buckets", "32,64", "--device", DEVICE, "--json", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    sizes = [bucket["batch_size"] for bucket in document["training"]["buckets"]]
    packed = document["training"]["packed"]["tokens"]
    assert f"ppo_max_token_len_per_gpu={packed}" in result.output
    assert f"bucket_batch_size=[{','.join(map(str, sizes))}]" in result.output
    trials = [
        *(trial for b in document["training"]["buckets"] for trial in b["trials"]),
        *document["training"]["packed"]["trials"],
    ]
    assert document["trials"] == len(trials)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--buckets", "32,x"], "separated by commas"),
        (["--buckets", "32", "--max-seq-len", "64"], "or the longest length"),
        (["--max-seq-len", "0"], "max_seq_len must be at least 1"),
    ],
)
def test_bad_input_to_the_command_is_one_line_and_exit_code_2(args, message):
    result = CliRunner().invoke(app, ["tokens", "lm-tiny", "--device", DEVICE, *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_a_model_from_its_config_needs_a_capacity_per_rank_and_own_workloads_refuse_rank_options():
    result = CliRunner().invoke(app, ["tokens", "llama-3-8b", "--max-seq-len", "64"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "give --gpu h100-80gb" in result.output
    result = CliRunner().invoke(app, ["tokens", "lm-tiny", "--buckets", "16", "--verify"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "a model from its config per rank" in result.output


def test_the_microbatcher_keeps_the_padded_budget_over_a_variable_length_batch():
    """A padded token budget, measured with the bytes of the global batch the loop keeps on the device as
    margin, given to the Microbatcher: it packs a global batch of mixed lengths (right-padded to the longest)
    into micro-batches of rows x widest row within the budget, each cut to its widest row, and trains 3 steps
    on the same device without an out-of-memory error."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 129, (64,), generator=generator)
    mask = (torch.arange(128)[None, :] < lengths[:, None]).long()
    ids = torch.randint(0, 512, (64, 128), generator=generator)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    held = sum(tensor.untyped_storage().nbytes() for tensor in batch.values())
    work = lm_tiny(seq_len=128, layers=1)
    measured = token_budget_of_workload(work, [128], bf.SearchSettings(margin=held), device=DEVICE, packed=False)
    tokens = measured.training.buckets[0].tokens
    seen: list[tuple[int, int]] = []
    work.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    batcher = bf.Microbatcher(work.model, work.optimizer, device=bf.SimulatedDevice("16MiB"), max_tokens=tokens)
    for _ in range(3):
        batcher.step(batch)
    assert all(record.ooms == 0 for record in batcher.history) and batcher.current_max_tokens == tokens
    assert all(rows * width <= tokens for rows, width in seen)
    slices = batcher._slices(batch, tokens)
    assert seen[: len(slices)] == [(stop - start, int(lengths[start:stop].max())) for start, stop in slices]
    assert sum(rows for rows, _ in seen[: len(slices)]) == 64


def test_a_token_budget_packs_rows_by_their_widest_and_refuses_a_longer_row_before_any_step():
    lengths = [4, 16, 9, 12, 3, 16, 7, 10, 5, 14, 8, 11]
    mask = (torch.arange(16)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": torch.randint(0, 512, (12, 16)), "attention_mask": mask}
    work = lm_tiny(seq_len=16, layers=1)
    batcher = bf.Microbatcher(work.model, work.optimizer, max_tokens=32)
    assert batcher._slices(batch, 32) == [(0, 2), (2, 4), (4, 6), (6, 9), (9, 11), (11, 12)]
    with pytest.raises(RuntimeError, match=r"a single sample holds more tokens \(16 here\) than the budget of 15"):
        bf.Microbatcher(work.model, work.optimizer, max_tokens=15).step(batch)
    assert all(p.grad is None for p in work.model.parameters()) and work.optimizer.state == {}


@pytest.mark.slow  # the token-budgets guide runs the same command with --verify in every make test
def test_a_model_from_its_config_is_traced_per_rank_and_proved_by_one_ranks_real_trials(tmp_path):
    from batchfit.parallel.settings import Parallelism
    from batchfit.workflows.sharded_tokens import sharded_token_budget

    found = sharded_token_budget("examples/llama-tiny.json", [16, 32], "4MiB", Parallelism(world_size=4), verify=True)
    for bucket in found.buckets:
        confirmed(bucket.verified)
        assert bucket.traced.batch_size > 0 and bucket.verified.device == "sim:4.0MiB"
        if bucket.traced.batch_size == bucket.batch_size:  # an exact trace: the size and one more, nothing else
            assert tried(bucket.verified) == [(bucket.batch_size, True), (bucket.batch_size + 1, False)]
    assert found.buckets[0].batch_size > found.buckets[1].batch_size
    assert found.trials == sum(len(bucket.verified.trials) for bucket in found.buckets)
    sizes = ",".join(str(bucket.batch_size) for bucket in found.buckets)
    assert found.lines["lhotse (NeMo train_ds, bins in tokens)"][-1] == f"bucket_batch_size=[{sizes}]"
    out = tmp_path / "ranks.json"
    args = ["tokens", "examples/llama-tiny.json", "--gpus", "4", "--gpu", "4MiB", "--buckets", "32"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert [bucket["traced_batch_size"] for bucket in document["buckets"]] == [found.buckets[1].traced.batch_size]
    assert document["parallelism"]["world_size"] == 4 and document["trials"] == 0  # traced only, no --verify
    refused = CliRunner().invoke(app, [*args, "--forward"], env={"COLUMNS": "200"})
    assert refused.exit_code == 2 and "drop --forward" in refused.output


@pytest.mark.slow  # traces two bucket sets sharded and accumulating: about 6 s (make reliability)
@pytest.mark.xdist_group("sharded_tokens")  # needs no module budget: any worker may run it
def test_sharded_token_budgets_hold_the_windows_gradient_shards_as_accumulation_does():
    """Per rank, a later micro-batch of an accumulation window runs with the window's reduced gradient shards held:
    the budget traced within the capacity less their bytes is what one rank's real trials of a later micro-batch
    find, and the whole step's budget runs out of memory there."""
    from batchfit.parallel.one_rank import probe_rank_batch_size
    from batchfit.parallel.settings import Parallelism
    from batchfit.workflows.sharded_tokens import sharded_token_budget

    config, parallelism = "examples/llama-tiny.json", Parallelism(world_size=2)
    found = sharded_token_budget(config, [8], "3MiB", parallelism, verify=True)
    bucket = found.buckets[0]
    whole_step = bucket.whole_step.batch_size
    assert found.accumulating and bucket.held_gradient_bytes > 0 and 0 < bucket.traced.batch_size < whole_step
    assert tried(bucket.verified) == [(bucket.batch_size, True), (bucket.batch_size + 1, False)]  # the trace, exact
    later = probe_rank_batch_size(config, 8, whole_step, parallelism=parallelism, device="sim:3MiB", accumulating=True)
    assert not later.fits
    plain = sharded_token_budget(config, [8], "3MiB", parallelism, accumulating=False).buckets[0]
    assert (plain.batch_size, plain.whole_step, plain.held_gradient_bytes) == (whole_step, None, 0)
    assert bucket.traces == plain.traces + bucket.traced.traces  # the whole step's trace, then the held one


@pytest.mark.xdist_group("too_long")  # needs no module budget: any worker may run it
def test_a_bucket_too_long_for_one_sequence_is_reported_and_the_shorter_ones_still_measured(tmp_path):
    work = lm_tiny(seq_len=128, layers=1)
    found = token_budget_of_workload(work, [16, 64, 128], device="sim:7MiB", packed=False)
    assert (found.lengths, found.too_long) == ([16, 64], [128])
    assert tried_sizes(found.training.too_long[128]) == [(2, False), (1, False)]  # the lines' first size, then 1
    for bucket in found.training.buckets:
        confirmed(bucket.search)
    assert found.trials == sum(len(b.search.trials) for b in found.training.buckets) + 2
    tokens = min(bucket.tokens for bucket in found.training.buckets)  # the lines cover the lengths that fit
    assert found.lines["fairseq"] == [f"--max-tokens {tokens} --max-tokens-valid {tokens}"]
    document = found.to_dict()
    assert document["too_long"] == [128] and document["training"]["too_long"][0]["seq_len"] == 128
    with pytest.raises(bf.NoBatchFitsError, match="not even one sequence of 16 tokens fits in training") as error:
        token_budget_of_workload(work, [16, 128], device="sim:5MiB", packed=False)
    assert tried_sizes(error.value.trials) == [(2, False), (1, False)]
    out = tmp_path / "tokens.json"
    args = ["tokens", "lm-tiny", "--device", "sim:24MiB", "--buckets", "64,256,1024", "--no-packed", "--json", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Not even one sequence of 1024 tokens fits: cap sequences at 256 tokens here" in result.output
    assert json.loads(out.read_text())["too_long"] == [1024]
