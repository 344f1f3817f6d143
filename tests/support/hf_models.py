"""Hugging Face GPT-2, BERT, T5 and Llama built from small configs (random weights, no downloads):
the outside models the tests and the benchmarks check batchfit on. Each builder takes a ``Size``
and returns the model and one sample batch as its loop would feed it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import batchfit as bf


@dataclass(frozen=True)
class Size:
    """Width, depth and heads of the model; feed-forward width; vocabulary; tokens and rows per sample."""

    width: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    rows: int = 2
    kv_heads: int | None = None  # Llama's grouped-query attention (None: as many as heads)


def _ids(size: Size, seq: int | None = None) -> torch.Tensor:
    return torch.randint(0, size.vocab, (size.rows, seq or size.seq))


def gpt2(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """GPT-2 with next-token loss (its feed-forward is 4x its width, as GPT-2's own)."""
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=size.layers,
        n_embd=size.width,
        n_head=size.heads,
        vocab_size=size.vocab,
        n_positions=size.seq,
        bos_token_id=0,  # inside the small vocabulary
        eos_token_id=0,
    )
    ids = _ids(size)
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def bert(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """BERT for 3-way sequence classification."""
    from transformers import BertConfig
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=size.vocab,
        hidden_size=size.width,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.ffn,
        max_position_embeddings=size.seq,
        num_labels=3,
    )
    ids = _ids(size)
    labels = torch.arange(size.rows) % 3
    return BertForSequenceClassification(config), {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
    }


def t5(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """T5 with as many decoder as encoder layers; targets half as long as the inputs."""
    from transformers import T5Config
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=size.vocab,
        d_model=size.width,
        d_kv=size.width // size.heads,
        d_ff=size.ffn,
        num_layers=size.layers,
        num_decoder_layers=size.layers,
        num_heads=size.heads,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = _ids(size)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(size, size.seq // 2)}
    return T5ForConditionalGeneration(config), batch


def llama(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Llama with next-token loss."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.width,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads or size.heads,
        max_position_embeddings=size.seq,
    )
    ids = _ids(size)
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def workload(build, size: Size, name: str, lr: float = 3e-4) -> bf.Workload:
    """``build(size)`` as a batchfit Workload with AdamW, its loss the model's own ``output.loss``."""
    model, batch = build(size)
    return bf.Workload(model, batch, None, torch.optim.AdamW(model.parameters(), lr=lr), name=name)


def vit(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """ViT for 10-way image classification; ``size.seq`` is the image side, in 8-pixel patches."""
    from transformers import ViTConfig
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=size.seq,
        patch_size=8,
        hidden_size=size.width,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.ffn,
        num_labels=10,
    )
    pixels = torch.randn(size.rows, 3, size.seq, size.seq)
    return ViTForImageClassification(config), {"pixel_values": pixels, "labels": torch.arange(size.rows) % 10}


def resnet(size: Size) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Hugging Face's ResNet (bottleneck blocks, batch norm) for 10-way classification: ``size.layers`` blocks
    per stage, stages ``size.width`` to 8x as wide; ``size.seq`` is the image side."""
    from transformers import ResNetConfig
    from transformers import ResNetForImageClassification

    torch.manual_seed(0)
    widths = [size.width * 2**stage for stage in range(4)]
    config = ResNetConfig(embedding_size=size.width, hidden_sizes=widths, depths=[size.layers] * 4, num_labels=10)
    pixels = torch.randn(size.rows, 3, size.seq, size.seq)
    return ResNetForImageClassification(config), {"pixel_values": pixels, "labels": torch.arange(size.rows) % 10}
