"""The parallel settings, the fake world's life cycle, models from configs, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel import LLM_PRESETS
from batchfit.parallel import Parallelism
from batchfit.parallel import TinyTransformer
from batchfit.parallel import fake_world
from batchfit.parallel import model_config
from batchfit.parallel import trace_rank
from batchfit.parallel.models import model_builder


def _one_line_error(error_type: type[Exception], call, *args, **kwargs) -> str:
    with pytest.raises(error_type) as raised:
        call(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"world_size": 0}, "world_size must be at least 1"),
        ({"world_size": 12, "gpus_per_node": 8, "sharding": "hybrid"}, "not a multiple of gpus_per_node 8"),
        ({"world_size": 8, "sharding": "hybrid"}, "give gpus_per_node"),
        ({"world_size": 4, "rank": 4}, "rank must be an integer from 0 to world_size - 1 = 3"),
        ({"world_size": 2, "sharding": "zero3"}, "sharding must be one of"),
        ({"activation_checkpointing": "Selective"}, "must be 'none' or 'full' or 'selective'"),
        ({"activation_checkpointing": "some"}, "must be 'none' or 'full'"),
        ({"world_size": 2, "sharding": "ddp", "param_dtype": "bf16"}, "use sharding='fsdp' or 'hybrid'"),
        ({"world_size": 2, "sharding": "none"}, "give world_size=1"),
        ({"param_dtype": "int8"}, "param_dtype must be"),
    ],
)
def test_bad_parallelism_is_a_one_line_input_error(options: dict, words: str) -> None:
    assert words in _one_line_error(InputError, Parallelism, **options)


def test_parallelism_types_dtypes_and_mesh() -> None:
    assert "integer" in _one_line_error(InputTypeError, Parallelism, world_size=True)
    settings = Parallelism(world_size=16, gpus_per_node=8, sharding="hybrid", param_dtype="bf16", reduce_dtype="fp32")
    assert (settings.param_dtype, settings.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert settings.mesh_shape() == (2, 8) and settings.shard_ranks() == 8
    assert Parallelism(world_size=8).mesh_shape() == (8,) and Parallelism().shard_ranks() == 1
    assert Parallelism(world_size=4, sharding="ddp").shard_ranks() == 1
    assert json.loads(json.dumps(settings.to_dict()))["reduce_dtype"] == "float32"


def test_the_fake_world_is_destroyed_after_success_and_after_an_error() -> None:
    with fake_world(Parallelism(world_size=8, gpus_per_node=4, sharding="hybrid", rank=5)) as mesh:
        assert dist.is_initialized() and (dist.get_world_size(), dist.get_rank()) == (8, 5)
        assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (2, 4)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="inside the world"), fake_world(Parallelism(world_size=2)):
        raise RuntimeError("inside the world")
    assert not dist.is_initialized()
    with pytest.raises(InputTypeError):  # an error raised by the model's build, inside the world
        trace_rank(lambda: "not a module", 1, 8, parallelism=Parallelism(world_size=2))
    assert not dist.is_initialized()


def test_the_fake_world_refuses_an_existing_process_group() -> None:
    with fake_world(Parallelism(world_size=2)):
        message = _one_line_error(InputError, lambda: fake_world(Parallelism(world_size=4)).__enter__())
        assert "already initialised" in message
        assert dist.get_world_size() == 2  # the existing group is left alone
    assert not dist.is_initialized()


def test_presets_have_their_published_parameter_counts_and_build_without_memory() -> None:
    # The totals the model cards publish: 8.03B, 70.6B, 7.24B, 7.62B and 1.56B parameters.
    published = {
        "llama-3-8b": 8_030_261_248,
        "llama-3-70b": 70_553_706_496,
        "mistral-7b": 7_241_732_096,
        "qwen2.5-7b": 7_615_616_512,
        "gpt2-xl": 1_557_611_200,
    }
    assert set(published) == set(LLM_PRESETS)
    for name, count in published.items():
        with FakeTensorMode():
            model = model_builder(name, torch.bfloat16)()
        assert sum(p.numel() for p in model.parameters()) == count, name
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_configs_from_a_dict_a_file_or_an_object_with_overrides(tmp_path: Path) -> None:
    small = {"num_hidden_layers": 2, "hidden_size": 64}
    config = model_config("Llama-3-8B", **small)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, 128256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLM_PRESETS["qwen2.5-7b"], "architectures": ["Qwen2ForCausalLM"]}))
    assert model_config(path, num_hidden_layers=1).num_hidden_layers == 1
    assert model_config(tmp_path).model_type == "qwen2"  # the folder holding config.json
    assert model_config({"model_type": "gpt2", "n_layer": 3}).n_layer == 3
    copied = model_config(config, num_hidden_layers=1)
    assert (copied.num_hidden_layers, config.num_hidden_layers) == (1, 2)  # the caller's config is unchanged


def test_bad_models_are_one_line_input_errors(tmp_path: Path) -> None:
    not_a_config = tmp_path / "settings.json"
    not_a_config.write_text(json.dumps({"learning_rate": 0.1}))
    assert "is not a model config" in _one_line_error(InputError, model_config, not_a_config)
    not_json = tmp_path / "notes.json"
    not_json.write_text("hello")
    assert "is not JSON" in _one_line_error(InputError, model_config, not_json)
    assert "unknown model 'llama-9b'" in _one_line_error(InputError, model_config, "llama-9b")
    assert "unknown model_type" in _one_line_error(InputError, model_config, {"model_type": "no-such-model"})
    assert "no model config at" in _one_line_error(InputError, model_config, tmp_path / "missing.json")
    assert "a model is a preset name" in _one_line_error(InputTypeError, model_config, 3)


def test_bad_trace_inputs_are_one_line_input_errors() -> None:
    two = Parallelism(world_size=2)
    assert "sharding='ddp' cannot be traced" in _one_line_error(
        InputError, trace_rank, TinyTransformer, 1, 8, parallelism=Parallelism(world_size=2, sharding="ddp")
    )
    assert "steps must be at least 2" in _one_line_error(InputError, trace_rank, TinyTransformer, 1, 8, steps=1)
    assert "batch_size must be at least 1" in _one_line_error(InputError, trace_rank, TinyTransformer, 0, 8)
    assert "seq_len must be an integer" in _one_line_error(InputTypeError, trace_rank, TinyTransformer, 1, 8.0)
    assert "Parallelism" in _one_line_error(InputTypeError, trace_rank, TinyTransformer, 1, 8, parallelism=2)
    assert "no token embedding" in _one_line_error(
        InputError, trace_rank, lambda: torch.nn.Linear(4, 4), 1, 8, parallelism=two
    )
    no_blocks = Parallelism(world_size=2, activation_checkpointing="full")
    assert "has none" in _one_line_error(
        InputError, trace_rank, lambda: torch.nn.Sequential(torch.nn.Embedding(8, 4)), 1, 8, parallelism=no_blocks
    )
    assert not dist.is_initialized()
