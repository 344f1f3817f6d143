"""Models from their configs, built without weights: built-in LLM shapes, Hugging Face configs, and a
tiny plain-torch transformer for tests.

A model is built inside the caller's ``FakeTensorMode`` directly in its final dtype (``.to(dtype)``
on a fake-built model fails), so an 8B or 70B model costs no memory. transformers is imported
only when a Hugging Face model is asked for.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel.llm_presets import LLM_PRESETS

ModelSpec = str | os.PathLike | dict | Any  # a preset name, a config.json path, a config dict or object, a factory


def _config_dict_from_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(
            f"no model config at {str(path)!r}: give a config.json path or one of {', '.join(LLM_PRESETS)}"
        )
    try:
        loaded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(
            f"{str(path)!r} is not a model config: give a Hugging Face config.json (this is not JSON)"
        ) from None
    if not isinstance(loaded, dict) or "model_type" not in loaded:
        raise InputError(f"{str(path)!r} is not a model config: a Hugging Face config.json has a 'model_type' field")
    return loaded


def _config_from_dict(values: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    values = {**values, **overrides}
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise InputError("a model config needs a 'model_type' such as 'llama' (as in a Hugging Face config.json)")
    for key in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        values.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise InputError(
            f"unknown model_type {model_type!r} for transformers: {str(error).splitlines()[0][:160]}"
        ) from None


def model_config(spec: ModelSpec, **overrides: Any) -> Any:
    """A transformers config from a preset name (``LLM_PRESETS``), a config.json path (or its
    folder), a dict or a config object (copied, never changed), with ``overrides`` applied
    (``num_hidden_layers=2, hidden_size=64`` makes a small model of the same family).

    >>> model_config("llama-3-8b", num_hidden_layers=2).num_hidden_layers
    2
    """
    if isinstance(spec, str) and spec.strip().lower() in LLM_PRESETS:
        return _config_from_dict(LLM_PRESETS[spec.strip().lower()], overrides)
    if isinstance(spec, dict):
        return _config_from_dict(spec, overrides)
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if isinstance(spec, str) and not path.exists() and not spec.endswith(".json"):
            raise InputError(f"unknown model {spec!r}: give one of {', '.join(LLM_PRESETS)} or a config.json path")
        return _config_from_dict(_config_dict_from_file(path), overrides)
    if hasattr(spec, "to_dict") and hasattr(spec, "model_type"):
        config = copy.deepcopy(spec)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    raise InputTypeError(
        f"a model is a preset name ({', '.join(LLM_PRESETS)}), a config.json path, a config dict or object, "
        f"or a function returning an nn.Module; got {type(spec).__name__}"
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors made without a dtype are ``dtype`` inside, as before outside."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def model_builder(spec: ModelSpec, dtype: torch.dtype = torch.float32, **overrides: Any) -> Callable[[], nn.Module]:
    """A function that builds the model ``spec`` names in ``dtype`` (call it inside a
    ``FakeTensorMode`` to build without memory). ``spec`` may also be a function returning an
    ``nn.Module`` (then ``overrides`` must be empty): it runs with ``dtype`` as the default dtype."""
    if callable(spec) and not isinstance(spec, (str, os.PathLike, dict)):
        if overrides:
            raise InputError(f"config overrides ({', '.join(overrides)}) apply to configs, not to a model factory")

        def build_own() -> nn.Module:
            with default_dtype(dtype):
                model = spec()
            if not isinstance(model, nn.Module):
                raise InputTypeError(f"the model factory must return an nn.Module, got {type(model).__name__}")
            return model

        return build_own
    config = model_config(spec, **overrides)

    def build_hf() -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")

    return build_hf


# -- a tiny plain-torch transformer (no transformers needed) -------------------------------------


class TinyBlock(nn.Module):
    """Pre-norm attention (SDPA, causal) and a GELU MLP, with residuals."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.up = nn.Linear(hidden_size, 4 * hidden_size)
        self.down = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.num_heads, width // self.num_heads)
        q, k, v = (part.transpose(1, 2) for part in heads.unbind(2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """A small decoder-only language model in plain torch: ``forward(input_ids)`` returns logits.

    >>> TinyTransformer(vocab_size=64)(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 64])
    """

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_heads: int = 4, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(TinyBlock(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
