"""The body of ``batchfit list-workloads``: the built-in workloads and the LLM presets: it imports the library (and torch), so the command's face
(``batchfit.cli.commands``) imports it only when the command runs."""

from __future__ import annotations

from batchfit.cli.builtin_list import describe_builtins
from batchfit.cli.common import Framework
from batchfit.cli.common import console
from batchfit.parallel.llm_presets import LLM_PRESETS


def run_list_workloads(
    *,
    framework: Framework,
) -> None:
    """The body of ``batchfit list-workloads`` (see its help): name the built-in workloads, one line each, and the LLM shapes estimate builds from their configs."""
    for name, line in describe_builtins(framework.value).items():
        console.print(f"[bold]{name:10}[/] {line}", highlight=False)
    if framework is Framework.torch:
        console.print("LLMs built from their published configs, on fake tensors (batchfit estimate NAME --gpus N):")
        for name in LLM_PRESETS:
            console.print(f"[bold]{name:12}[/] {preset_line(name)}", highlight=False)


def preset_line(name: str) -> str:
    """What the LLM preset ``name`` is: its layers, width and vocabulary, from its config."""

    config = LLM_PRESETS[name]
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    width = config.get("hidden_size", config.get("n_embd"))
    return f"{config['model_type']}: {layers} layers, width {width}, vocabulary {config['vocab_size']}"
