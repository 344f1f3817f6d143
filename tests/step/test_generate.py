"""mode="generate": the KV cache is in the probe, so generation fits a smaller batch than a forward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.step.builtin_workloads import TinyGPT
from batchfit.step.workload import Workload
from models import decoder

DEVICE = "sim:1MiB"


def edge(workload: Workload, trace: bool | str = False) -> bf.SearchResult:
    result = bf.search_workload(workload, device=DEVICE, trace=trace)
    assert result.exact
    sizes = {t.batch_size: t.fits for t in result.trials}
    assert sizes[result.batch_size] and sizes.get(result.batch_size + 1) is False  # a confirmed edge
    return result


def test_generation_fits_a_smaller_batch_than_a_forward_pass_because_of_the_kv_cache():
    forward = edge(decoder(seq_len=8, mode="eval", max_new_tokens=48))
    generate = edge(decoder(seq_len=8, mode="generate", max_new_tokens=48))
    longer = edge(decoder(seq_len=8, mode="generate", max_new_tokens=96))
    assert generate.batch_size < forward.batch_size
    assert longer.batch_size < generate.batch_size  # a longer generation holds a longer cache
    assert all(t.phase_peak_bytes.keys() == {"forward"} for t in generate.trials if t.fits)  # no backward, no step


@pytest.mark.slow  # a byte-exact trace of generation; generation's probes stay in make test
def test_the_trace_sees_the_kv_cache_to_the_byte():
    # A short prompt and 16 new tokens: the cache sets the edge (83 here; 126 with one new token),
    # at half the trace's work of 32 tokens after a prompt of 8.
    traced = bf.search_workload(decoder(seq_len=4, mode="generate", max_new_tokens=16), device=bf.TraceDevice("1MiB"))
    real = edge(decoder(seq_len=4, mode="generate", max_new_tokens=16), trace=True)
    assert traced.batch_size == real.batch_size
    assert real.extra["trace"]["batch_size"] == real.batch_size and len(real.trials) == 2


class Wrapped(nn.Module):
    """A Hugging Face-like model: keyword inputs and ``generate(input_ids=..., max_new_tokens=...)``."""

    def __init__(self):
        super().__init__()
        self.inner = TinyGPT(vocab=64, dim=32, heads=2, layers=1, max_len=64)
        self.calls: list[tuple] = []

    def forward(self, input_ids, labels=None):
        return {"logits": self.inner(input_ids)}

    def generate(self, input_ids, max_new_tokens):
        self.calls.append((tuple(input_ids.shape), max_new_tokens))
        return self.inner.generate(input_ids, max_new_tokens=max_new_tokens)


def test_a_mapping_batch_reaches_generate_as_keywords_without_labels():
    model = Wrapped()
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    trial = bf.probe_batch_size(model, batch, 5, device=DEVICE, mode="generate")
    assert trial.fits and model.calls == [((5, 8), 16), ((5, 8), 16)]  # two steps, the default 16 new tokens


def test_a_step_fn_is_the_generate_call():
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=1, max_len=64)
    calls = []

    def generate(m, batch):
        calls.append(batch[0].shape[0])
        return m.generate(batch[0], max_new_tokens=4)

    ids = torch.randint(0, 64, (2, 8))
    trial = bf.probe_batch_size(model, (ids, ids), 7, device=DEVICE, mode="generate", step_fn=generate)
    assert trial.fits and calls == [7, 7]


def test_state_and_train_mode_are_restored_after_generation():
    work = decoder(seq_len=8, mode="generate", max_new_tokens=8)
    work.model.train()
    bf.search_workload(work, device=DEVICE)
    assert work.model.training and all(m.training for m in work.model.modules())
    for name, value in work.model.state_dict().items():
        assert torch.equal(value, decoder(seq_len=8, mode="generate", max_new_tokens=8).model.state_dict()[name])


def test_generate_needs_something_that_generates():
    with pytest.raises(ValueError, match=r"needs a model with \.generate\(\) or step_fn"):
        Workload(nn.Linear(4, 4), torch.randn(2, 4), mode="generate")
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        decoder(mode="generate", max_new_tokens=0)
    with pytest.raises(ValueError, match="longer than the model's max_len"):
        TinyGPT(max_len=8).generate(torch.zeros(1, 6, dtype=torch.long), max_new_tokens=4)
