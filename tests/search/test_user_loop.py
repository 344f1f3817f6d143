"""The answer holds in the loop people write: ``outputs = model(**batch); loss = outputs.loss;
loss.backward(); optimizer.step()`` keeps ``outputs`` (the logits, a KV cache) alive through backward
and into the next forward. Checked on Hugging Face GPT-2, Llama and T5 built from small configs
(random weights, no downloads): the default answer runs three steps of that loop inside the same
simulated capacity, and one more sample runs out of memory in it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

import batchfit as bf
from hf_models import Size
from hf_models import gpt2
from hf_models import llama
from hf_models import t5
from models import mlp_tuple

CAPACITY = "12MiB"
SIZE = Size(width=32, layers=1, heads=2, ffn=64, vocab=512, seq=16, rows=2, kv_heads=1)


def sample(build) -> dict[str, torch.Tensor]:
    return build(SIZE)[1]


def built(build):
    model = build(SIZE)[0]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def hand_written_loop_fits(build, batch_size: int, steps: int = 3) -> bool:
    """Three steps of the Hugging Face course's loop at ``batch_size``, every byte counted."""
    model, optimizer = built(build)
    batch = {key: value[:1].repeat(batch_size, 1) for key, value in sample(build).items()}
    device = bf.SimulatedDevice(CAPACITY)
    device.register([*model.parameters(), *model.buffers(), *batch.values()])
    model.train()
    try:
        with device.measuring():
            for _ in range(steps):
                outputs = model(**batch)
                loss = outputs.loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    except torch.OutOfMemoryError:
        return False
    return True


@pytest.mark.parametrize("build", [gpt2, llama, t5], ids=["gpt2", "llama", "t5"])
def test_the_default_answer_is_the_edge_of_the_loop_people_write(build):
    pytest.importorskip("transformers")
    model, optimizer = built(build)
    answer = bf.find_max_batch_size(model, sample(build), optimizer=optimizer, device=bf.SimulatedDevice(CAPACITY))
    assert hand_written_loop_fits(build, answer.batch_size)
    assert not hand_written_loop_fits(build, answer.batch_size + 1)


def test_a_loop_that_drops_the_output_gets_its_own_larger_answer():
    pytest.importorskip("transformers")
    model, optimizer = built(gpt2)
    held = bf.find_max_batch_size(model, sample(gpt2), optimizer=optimizer, device=bf.SimulatedDevice(CAPACITY))
    dropped = bf.find_max_batch_size(
        model, sample(gpt2), optimizer=optimizer, device=bf.SimulatedDevice(CAPACITY), keep_output=False
    )
    assert dropped.batch_size > held.batch_size  # the logits no longer live through backward
    assert not hand_written_loop_fits(gpt2, dropped.batch_size)  # so it is not the hand-written loop's answer


def test_a_plain_torch_loop_holding_its_logits_fits_at_the_answer():
    work = mlp_tuple()
    capacity = "160KiB"
    answer = bf.search_workload(work, device=bf.SimulatedDevice(capacity), trace=False).batch_size

    def loop_fits(batch_size: int) -> bool:
        fresh = mlp_tuple()
        model, optimizer = fresh.model, fresh.optimizer
        x, y = (t[:1].repeat(batch_size, *[1] * (t.dim() - 1)) for t in fresh.sample_batch)
        device = bf.SimulatedDevice(capacity)
        device.register([*model.parameters(), x, y])
        try:
            with device.measuring():
                for _ in range(3):
                    logits = model(x)
                    loss = F.cross_entropy(logits, y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
        except torch.OutOfMemoryError:
            return False
        return True

    assert loop_fits(answer) and not loop_fits(answer + 1)


def test_keep_output_is_checked_and_named_in_the_loop_description():
    work = mlp_tuple()
    assert work.keep_output and "held through backward" in work.loop
    assert "dropped before backward" in dataclasses.replace(work, keep_output=False).loop
    assert "step_fn" in dataclasses.replace(work, step_fn=lambda m, b: m(b[0]).sum()).loop
    with pytest.raises(TypeError, match="keep_output must be True or False"):
        dataclasses.replace(work, keep_output="yes")
