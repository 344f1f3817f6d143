"""The published shapes of a few LLMs, as their Hugging Face config.json files give them: data only, light to import
(``batchfit list-workloads`` names them without loading torch); ``batchfit.parallel.models`` builds models from them."""

from __future__ import annotations

from typing import Any

# The published shapes of a few LLMs: each is the model's Hugging Face config.json (the fields that
# decide memory), cited by repository; the numbers are those files' values.
LLM_PRESETS: dict[str, dict[str, Any]] = {
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json (Llama 3 paper, arXiv:2407.21783, Table 3)
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json (same paper, Table 3)
    "llama-3-70b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (Mistral 7B, arXiv:2310.06825, Table 1)
    "mistral-7b": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (Qwen2.5 technical report, arXiv:2412.15115, Table 1)
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    # huggingface.co/openai-community/gpt2-xl/blob/main/config.json (GPT-2 paper, Radford et al. 2019, Table 2)
    "gpt2-xl": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 1600,
        "n_layer": 48,
        "n_head": 25,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
    },
}
