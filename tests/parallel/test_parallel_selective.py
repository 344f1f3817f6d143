"""Selective activation checkpointing (torchtitan's op-level policy, torch's own selective-checkpoint
contexts) in the per-rank FSDP2 trace: the fake trace sees the ops real execution sees and gives
its peak to the byte, and the peak lies between full checkpointing and none."""

from __future__ import annotations

import json

import pytest

from batchfit.cli.sharded import parallelisms
from batchfit.parallel import Parallelism
from batchfit.parallel import ShardedEstimate
from batchfit.parallel import trace_rank
from batchfit.parallel import wrap
from batchfit.parallel.models import LLM_PRESETS
from cli_runner import invoke
from fsdp_cases import SMALL_LLAMA
from fsdp_cases import TINY

SIZES = (2, 16)  # micro-batch x tokens of TINY (2 blocks) at world size 2


def _traced(choice: str, fake: bool = True) -> tuple[ShardedEstimate, list[tuple[str, str]]]:
    """TINY traced with ``choice`` of checkpointing, and every decision the selective policy made,
    as ``(op, policy)`` in dispatch order."""
    decisions: list[tuple[str, str]] = []
    make_policy = wrap.selective_policy

    def recording():
        policy = make_policy()

        def decide(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            decisions.append((str(op), decision.name))
            return decision

        return decide

    settings = Parallelism(world_size=2, activation_checkpointing=choice)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wrap, "selective_policy", recording)
        return trace_rank(TINY, *SIZES, parallelism=settings, fake=fake), decisions


@pytest.fixture(scope="module")
def fake_selective() -> tuple[ShardedEstimate, list[tuple[str, str]]]:
    return _traced("selective")


def test_selective_on_fake_tensors_sees_the_real_ops_and_gives_the_real_peak_to_the_byte(fake_selective) -> None:
    fake, fake_decisions = fake_selective
    real, decisions = _traced("selective", fake=False)
    assert fake_decisions == decisions  # the policy saw the same ops in the same order, and decided alike
    assert fake.step_peaks_bytes == real.step_peaks_bytes and fake.breakdown == real.breakdown
    # one block's forward (of 2 blocks x 2 steps): of its four matmuls (addmm: TinyBlock's linears
    # have biases) the 1st (qkv) and 3rd (up) are saved, and the attention kernel; the rest is recomputed
    block = decisions[: len(decisions) // 4]
    assert [op for op, _ in block].count("aten.addmm.default") == 4
    saved = [op.removeprefix("aten.").removesuffix(".default") for op, decision in block if decision == "MUST_SAVE"]
    assert saved == ["addmm", "_scaled_dot_product_flash_attention_for_cpu", "addmm"]


def test_selective_lies_between_full_and_none(fake_selective) -> None:
    """With L blocks, each keeping ``kept`` bytes for backward of ``all`` it makes (its input
    ``input``), the backward peak holds the L blocks' kept bytes plus one block's recomputed rest:
    none ``L*all``, selective ``L*kept + (all - kept)``, full ``L*input + (all - input)``. So
    none - selective = (L-1)(all - kept) and selective - full = (L-1)(kept - input): both positive
    from two blocks on, whatever the widths (TINY has two)."""
    selective, _ = fake_selective
    none, full = (_traced(choice)[0] for choice in ("none", "full"))
    assert none.peak_bytes > selective.peak_bytes > full.peak_bytes
    assert none.breakdown["activations"] > selective.breakdown["activations"] > full.breakdown["activations"]
    assert none.state_bytes == selective.state_bytes == full.state_bytes  # only what backward keeps differs


def test_the_cli_parses_selective_among_the_choices_in_order() -> None:
    choices = parallelisms((2, None), False, None, None, "none, selective,full,selective")
    assert [choice.activation_checkpointing for choice in choices] == ["none", "selective", "full"]
    assert {choice.world_size for choice in choices} == {2}


def test_an_unknown_checkpointing_choice_is_one_line_naming_selective() -> None:
    result = invoke("estimate", "llama-3-8b", "--gpu", "h100-80gb", "--activation-checkpointing", "none,some")
    assert result.exit_code == 2, result.output
    assert "'none' or 'full' or 'selective'" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.slow  # three searches of a few traces each (about 5 s)
def test_estimate_compares_none_selective_and_full_per_rank(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLM_PRESETS["llama-3-8b"], **SMALL_LLAMA}))
    out = tmp_path / "est.json"
    args = ["--capacity", "6MiB", "--gpus", "2", "--seq-len", "64", "--batch-size", "5"]
    result = invoke(
        "estimate", str(config), *args, "--activation-checkpointing", "none,selective,full", "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    assert "Activation checkpointing selective: the largest micro-batch per rank is" in result.output
    assert "Micro-batch 5 per rank fits with activation checkpointing selective or full." in result.output
    none, selective, full = json.loads(out.read_text())["choices"]
    assert [c["activation_checkpointing"] for c in (none, selective, full)] == ["none", "selective", "full"]
    assert none["largest_batch_size"] < selective["largest_batch_size"] < full["largest_batch_size"]
    peaks = [c["estimate"]["peak_bytes"] for c in (none, selective, full)]  # all at micro-batch 5
    assert peaks[0] > peaks[1] > peaks[2]


def test_selective_on_a_model_without_repeated_blocks_is_one_line() -> None:
    from torch import nn

    from batchfit.errors import InputError
    from batchfit.parallel.wrap import shard_model

    settings = Parallelism(sharding="none", activation_checkpointing="selective")
    with pytest.raises(InputError, match="activation_checkpointing='selective' checkpoints repeated blocks") as raised:
        shard_model(nn.Linear(4, 4), None, settings)
    assert "\n" not in str(raised.value) and str(raised.value).endswith("use 'none'")
