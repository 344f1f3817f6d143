"""Activation checkpointing applied without editing the model (batchfit.step.checkpointing): the gradients with
each policy equal those without, bitwise, and the model is as it was afterwards (parameters, buffers, forward,
hooks, training flags, every module attribute), also after an error inside. A Hugging Face model's own
checkpointing (and per-block checkpointing of it) gives the same gradients up to float32 reassociation, since
the recompute changes the order in which backward sums its residual paths (measured: one ulp)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.errors import InputError
from batchfit.step.checkpointing import CheckpointedForward
from batchfit.step.checkpointing import available_policies
from batchfit.step.checkpointing import checkpointing
from batchfit.step.checkpointing import parse_policies

POLICIES = ("full", "full:2", "selective", "selective-matmuls")


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """Blocks in a ModuleList, called with a keyword, a BatchNorm buffer and a forward hook of the user's."""

    def __init__(self, blocks: int = 4, width: int = 16):
        super().__init__()
        self.inp, self.bn = nn.Linear(8, width), nn.BatchNorm1d(width)
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))
        self.seen = []
        self.layers[1].register_forward_hook(lambda module, args, out: self.seen.append(out.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.inp(x))
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return h.square().mean()


def _gradients(model: nn.Module, batch: torch.Tensor, policy: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks for every policy
    with checkpointing(model, policy):
        model(batch).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _state(model: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "attributes": [(name, dict(vars(m))) for name, m in model.named_modules()],
        "hooks": [(name, list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()],
        "training": [m.training for m in model.modules()],
    }


def _assert_same_state(before: dict, after: dict) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    assert all(torch.equal(before["tensors"][k], after["tensors"][k]) for k in before["tensors"])
    assert before["hooks"] == after["hooks"] and before["training"] == after["training"]
    assert [(n, a.keys()) for n, a in before["attributes"]] == [(n, a.keys()) for n, a in after["attributes"]]
    for (_, was), (_, now) in zip(before["attributes"], after["attributes"], strict=True):
        assert all(now[key] is value or now[key] == value for key, value in was.items() if not isinstance(value, dict))


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_with_each_policy_equal_those_without_bitwise(policy) -> None:
    torch.manual_seed(0)
    model, batch = Stack(), torch.randn(6, 8)
    plain = _gradients(model, batch, "none")
    checkpointed = _gradients(model, batch, policy)
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_model_is_as_it_was_afterwards(policy) -> None:
    torch.manual_seed(0)
    model, batch = Stack(), torch.randn(6, 8)
    model.layers[0].eval()  # a mixed train/eval model
    before = _state(model)
    with torch.no_grad():
        torch.manual_seed(3)
        forward_before = model(batch)
    with checkpointing(model, policy):
        assert isinstance(model.layers[3].forward, CheckpointedForward)
        model(batch).backward()
    model.zero_grad(set_to_none=True)
    model.load_state_dict(before["tensors"])  # the step moved BatchNorm's statistics; the rest is checkpointing's
    _assert_same_state(before, _state(model))
    assert all("forward" not in vars(block) for block in model.layers)
    with torch.no_grad():
        torch.manual_seed(3)
        assert torch.equal(model(batch), forward_before)


def test_an_error_inside_leaves_the_model_as_it_was() -> None:
    model = Stack()
    before = _state(model)
    with pytest.raises(RuntimeError, match="inside"), checkpointing(model, "selective"):
        raise RuntimeError("inside")
    _assert_same_state(before, _state(model))


def test_every_kth_block_is_checkpointed_as_torchtitan_counts_them() -> None:
    model = Stack(blocks=4)
    with checkpointing(model, "full:2"):
        wrapped = [isinstance(vars(block).get("forward"), CheckpointedForward) for block in model.layers]
    assert wrapped == [False, True, False, True]  # the 2nd and 4th


def test_a_forward_the_user_replaced_is_wrapped_and_given_back() -> None:
    model = Stack(blocks=2)
    own = model.layers[0].forward
    model.layers[0].forward = own  # an instance attribute of the user's
    with checkpointing(model, "full"):
        assert model.layers[0].forward.forward is own
    assert vars(model.layers[0])["forward"] is own


def test_bad_policies_are_one_line_naming_the_choices() -> None:
    for spec in ("bogus", "full:0", "none,", ""):
        with pytest.raises(InputError) as caught:
            parse_policies(spec)
        assert "\n" not in str(caught.value) and ("none" in str(caught.value))
    with pytest.raises(InputError, match="has none"), checkpointing(nn.Linear(2, 2), "full"):
        pass
    with pytest.raises(InputError, match="Hugging Face"), checkpointing(Stack(), "hf"):
        pass


def test_auto_names_what_the_model_has() -> None:
    assert parse_policies("auto", Stack()) == ["none", "selective", "full"]
    assert available_policies(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ["none"]
    assert parse_policies(" None , FULL:3 ,none") == ["none", "full:3"]


def test_a_hugging_face_models_own_checkpointing_is_undone() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    before = _state(model)
    plain = {}
    for policy in ("none", "hf", "full", "selective"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with checkpointing(model, policy):
            if policy == "hf":
                assert model.is_gradient_checkpointing
            model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        plain = plain or grads
        for name in plain:  # equal up to float32 reassociation: the recompute reorders the sums of the residual path
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")
    model.zero_grad(set_to_none=True)
    _assert_same_state(before, _state(model))
    assert not model.is_gradient_checkpointing and model.config.use_cache is True
