"""`batchfit find` on MLX workloads: the built-ins, --framework mlx for a user's function, the JSON
against the schema, and one clear line where MLX is missing. Skipped, with one reason, without MLX."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import resources

import jsonschema
import pytest

from cli_runner import invoke

pytest.importorskip("mlx.core", reason='MLX is not installed: pip install "batchfit[mlx]"')

USER_WORKLOAD = """
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from batchfit.integrations.mlx import MlxWorkload

def make(width: int = 32):
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    batch = (mx.random.normal((4, 8)), mx.random.randint(0, 3, (4,)))
    loss = lambda out, y: nn.losses.cross_entropy(out, y, reduction="mean")
    return MlxWorkload(model, batch, loss, optim.Adam(learning_rate=1e-3))
"""


@pytest.fixture
def user_workload(tmp_path):
    path = tmp_path / "mlx_workload.py"
    path.write_text(textwrap.dedent(USER_WORKLOAD))
    return f"{path}:make"


def test_find_mlx_mlp_writes_json_that_matches_the_schema(tmp_path):
    out = tmp_path / "out.json"
    result = invoke("find", "mlx-mlp", "--device", "mlx:12MiB", "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schema = json.loads(resources.files("batchfit").joinpath("search/schemas/search_result.schema.json").read_text())
    jsonschema.validate(document, schema)
    assert document["device"] == {"name": "mlx:cpu:12.0MiB", "simulated": True, "capacity_bytes": 12 << 20}
    assert document["workload"]["name"] == "mlx-mlp" and document["exact"]
    fitted = {t["batch_size"] for t in document["trials"] if t["fits"]}
    assert document["batch_size"] in fitted and document["batch_size"] + 1 not in fitted
    assert "mlx-mlp (0.33M parameters, Adam) on mlx:cpu:12.0MiB" in result.output
    assert "(choose with --device mlx:CAPACITY)" in result.output  # an MLX device's own spelling, not sim:
    assert f"Largest batch size that fits on mlx:cpu:12.0MiB: {document['batch_size']}" in result.output


def test_a_users_mlx_function_runs_with_framework_mlx_and_prints_just_the_number(user_workload):
    result = invoke("find", user_workload, "--framework", "mlx", "--device", "mlx:2MiB", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.output.strip().isdigit()


def test_a_workload_of_the_other_framework_is_one_clear_line(user_workload):
    cases = [
        (["find", user_workload, "--framework", "torch"], "returned MlxWorkload, not a batchfit.Workload"),
        (["find", "gpt-tiny", "--framework", "mlx"], "gpt-tiny is a torch workload, not an MLX one"),
        (["estimate", "mlx-mlp", "--capacity", "1GiB"], "only `batchfit find` runs MLX workloads"),
        (["find", "mlx-mlp", "--device", "cuda:0"], "for MLX use 'auto', 'mlx'"),
    ]
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_list_workloads_names_the_mlx_built_ins():
    result = invoke("list-workloads", "--framework", "mlx")
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.strip().splitlines() if line[0] != " "] == [
        "mlx-mlp",
        "mlx-gpt-tiny",
    ]


def test_without_mlx_find_says_how_to_install_it_in_one_line(monkeypatch, user_workload):
    for name in [name for name in sys.modules if name.startswith("batchfit.integrations.mlx")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("mlx", "mlx.core", "mlx.nn", "mlx.optimizers", "mlx.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # `import mlx` now fails as it does where it is not installed
    for args in (["find", "mlx-mlp"], ["find", user_workload, "--framework", "mlx"], ["find", user_workload]):
        result = invoke(*args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and 'pip install "batchfit[mlx]"' in lines[0], result.stderr


def test_import_batchfit_and_its_cli_never_import_mlx():
    code = "import batchfit, batchfit.cli.app, sys; assert not [m for m in sys.modules if m.split('.')[0] == 'mlx']"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_measures_the_micro_batch_of_an_mlx_workload(user_workload, tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("plan", user_workload, "--device", "mlx:2MiB", "--global-batch-size", "4096", "--json", str(out))
    assert result.exit_code == 0, result.output
    measured = int(result.output.split("the largest micro-batch is ")[1].split(".")[0])
    configuration = json.loads(out.read_text())["batch_configuration"]
    assert configuration["per_gpu_batch_size"] <= measured and configuration["total_batch_size"] == 4096
