"""The Microbatcher on a model sharded with FSDP2 (real ``fully_shard`` over a one-rank gloo group): after an
out-of-memory error in forward or backward, the replay trains exactly as a run that never failed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import batchfit as bf

FAULTS = {"forward": 0, "backward": 0}


def _tick(phase: str) -> None:
    if FAULTS[phase]:
        FAULTS[phase] -= 1
        raise torch.OutOfMemoryError(f"injected in {phase}: CUDA out of memory")


def _sharded_model() -> torch.nn.Module:
    """Three linear layers, each an FSDP2 group under a root group; faults in the second layer's forward (after
    FSDP2 gathered it) and in backward (from the first layer's output gradient: the later groups done)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    model[2].register_forward_pre_hook(lambda module, args: _tick("forward"))

    def backward_fault(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.requires_grad:  # not in evaluation, under no_grad
            out.register_hook(lambda grad: _tick("backward"))

    model[0].register_forward_hook(backward_fault)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    return fully_shard(model)


def _train(micro_batch_size: int, fault: str | None) -> tuple[list[torch.Tensor], list[float], list[tuple[int, int]]]:
    """Three steps of the same global batch: the parameters after them, the losses, and each step's (micro-batch,
    OOMs)."""
    model = _sharded_model()
    batcher = bf.Microbatcher(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        micro_batch_size=micro_batch_size,
        grow_after=None,
    )
    torch.manual_seed(1)
    batch = (torch.randn(8, 8), torch.randn(8, 1))
    if fault is not None:
        FAULTS[fault] = 1
    losses = [batcher.step(batch) for _ in range(3)]
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # shards, not gathered copies
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return params, losses, [(record.micro_batch_size, record.ooms) for record in batcher.history]


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    FAULTS.update(forward=0, backward=0)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_after_an_oom_in_a_sharded_step_the_replay_trains_as_if_none_had_happened(one_rank_group, fault) -> None:
    expected, expected_losses, expected_history = _train(4, None)
    params, losses, history = _train(8, fault)
    assert expected_history == [(4, 0), (4, 0), (4, 0)]
    assert history == [(4, 1), (4, 0), (4, 0)]  # 8 ran out of memory once; 4 replayed the whole batch
    assert losses == expected_losses and expected_losses[2] < expected_losses[0]  # training goes on, and learns
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))


def test_after_an_oom_in_a_sharded_evaluation_the_outputs_and_shards_are_as_without_it(one_rank_group) -> None:
    model = _sharded_model()
    batch = torch.randn(8, 8)
    expected = bf.EvalMicrobatcher(model, micro_batch_size=4).run(batch)
    FAULTS["forward"] = 1
    evaluator = bf.EvalMicrobatcher(model, micro_batch_size=8)
    outputs = evaluator.run(batch)
    assert (evaluator.ooms, evaluator.current_micro_batch_size) == (1, 4)
    assert torch.equal(outputs, expected)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # shards, not gathered copies
    torch.nn.functional.mse_loss(model(batch), torch.zeros(8, 1)).backward()  # and FSDP2 still trains
    assert all(p.grad is not None for p in model.parameters())
