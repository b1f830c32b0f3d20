"""The `text-generation-server` command as a user runs it: a real subprocess per call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from safetensors.torch import load_file

from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest

torch.set_num_threads(1)

# The script next to this interpreter (what `pip install -e .` wrote), else whatever PATH finds.
_BESIDE = Path(sys.executable).parent / "text-generation-server"
EXE = str(_BESIDE) if _BESIDE.exists() else shutil.which("text-generation-server")


def cli(*args: str) -> subprocess.CompletedProcess:
    assert EXE is not None, "the text-generation-server entry point is not installed (pip install -e .)"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Bytes, decoded by hand: text mode would turn a generated "\r" into "\n".
    done = subprocess.run([EXE, *args], capture_output=True, timeout=120, env=env)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "tiny-llama"
    write_checkpoint(folder, "llama", seed=51)
    return folder


def test_generate_json_lines(model_dir):
    result = cli("generate", "--json", "--model", str(model_dir), "--max-new-tokens", "5", "a", "bb")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    # The same requests in-process give the same tokens: the CLI adds nothing of its own.
    lm = get_model(str(model_dir))
    expected = lm.generate([GenerationRequest(id=i, inputs=p, max_new_tokens=5) for i, p in enumerate(["a", "bb"])])
    for row, prompt, done in zip(rows, ["a", "bb"], expected):
        assert row["model"] == str(model_dir)
        assert row["prompt"] == prompt
        assert row["token_ids"] == done.token_ids and 1 <= len(row["token_ids"]) <= 5
        assert row["text"] == done.text
        assert row["generated_tokens"] == len(row["token_ids"])
        assert row["finish_reason"] in ("length", "eos_token")
        assert row["seed"] is None


def test_generate_plain_text_and_sampling(model_dir):
    args = ["generate", "--model", str(model_dir), "--max-new-tokens", "6", "--do-sample", "--temperature", "0.7",
            "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
    first = cli(*args, "def f(x):")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def f(x):")
    # A second run, with --json: the seed makes it sample the same text.
    as_json = json.loads(cli(*args, "--json", "def f(x):").stdout)
    assert first.stdout == "def f(x):" + as_json["text"] + "\n"
    assert as_json["seed"] == 3


def test_bad_model_folder_fails_cleanly(tmp_path):
    missing = tmp_path / "no-such-model"
    result = cli("generate", "--model", str(missing), "hello")
    assert result.returncode != 0
    assert "error:" in result.stderr and str(missing) in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_sampling_option_fails_cleanly(model_dir):
    result = cli("generate", "--model", str(model_dir), "--do-sample", "--top-p", "1.5", "hello")
    assert result.returncode != 0
    assert "error:" in result.stderr and "top_p" in result.stderr


def test_convert_then_generate(model_dir, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(model_dir / name, folder / name)
    torch.save(load_file(str(model_dir / "model.safetensors")), folder / "pytorch_model.bin")
    refused = cli("generate", "--model", str(folder), "--max-new-tokens", "3", "x")
    assert refused.returncode != 0 and "convert" in refused.stderr

    converted = cli("convert", str(folder))
    assert converted.returncode == 0, converted.stderr
    assert converted.stdout.strip().splitlines() == [str(folder / "model.safetensors")]

    after = json.loads(cli("generate", "--json", "--max-new-tokens", "4", "--model", str(folder), "hello").stdout)
    before = get_model(str(model_dir)).generate([GenerationRequest(id=0, inputs="hello", max_new_tokens=4)])[0]
    assert after["token_ids"] == before.token_ids

    empty = tmp_path / "empty"
    empty.mkdir()
    failed = cli("convert", str(empty))
    assert failed.returncode != 0 and "error:" in failed.stderr and str(empty) in failed.stderr


@pytest.mark.parametrize("cores,world,threads", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (16, 1, 15), (16, 2, 7), (3, 4, 1)])
def test_cpu_ranks_leave_a_core_for_the_router(cores, world, threads):
    from text_generation_server.launcher.rank import cpu_threads_per_rank

    assert cpu_threads_per_rank(cores, world) == threads
    assert cpu_threads_per_rank(cores, world, weight_bytes=2**20) == threads  # small: the same


@pytest.mark.parametrize("cores,world,threads", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (16, 1, 16), (16, 2, 8), (3, 4, 1)])
def test_matmul_bound_ranks_take_every_core(cores, world, threads):
    from text_generation_server.launcher.rank import MATMUL_BOUND_BYTES, cpu_threads_per_rank

    assert cpu_threads_per_rank(cores, world, weight_bytes=MATMUL_BOUND_BYTES) == threads


def test_version_at_the_top_level_and_on_serve():
    from importlib import metadata

    expected = f"text-generation-server {metadata.version('text-generation-server')}\n"
    for argv in (["--version"], ["serve", "--version"]):
        result = cli(*argv)
        assert (result.returncode, result.stdout) == (0, expected), result.stderr


COMMANDS = ["generate", "convert", "serve", "health", "quantize", "perplexity"]


def test_every_option_of_every_command_has_help():
    import typer

    from text_generation_server.cli.main import app

    group = typer.main.get_command(app)
    assert sorted(group.commands) == sorted(COMMANDS)
    for param in group.params:
        assert param.help, f"top-level {param.name} has no help"
    for name, command in group.commands.items():
        for param in command.params:
            assert (param.help or "").strip(), f"{name} {param.name} has no help"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_fits_80_columns_and_shows_no_bool_metavar(command):
    env = {**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1"}
    argv = [EXE, *([command] if command else []), "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) > 5
    assert [line for line in lines if len(line) > 80] == []
    assert "<bool>" not in result.stdout and "BOOLEAN" not in result.stdout


def test_generate_adapter_id_needs_a_server():
    """A local generate has no adapters: --adapter-id is refused, never ignored (the base model's answer)."""
    done = cli("generate", "--adapter-id", "sql", "--max-new-tokens", "2", "def f(")
    assert done.returncode == 2 and "--adapter-id needs --server" in done.stderr
