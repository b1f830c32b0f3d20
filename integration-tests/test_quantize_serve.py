"""A checkpoint written by `quantize` round-trips through `serve`: it loads, turns healthy, and generates.

The quantized folder is produced by the real CLI (a subprocess, as a user runs it)
from the random tiny Llama, then served by a real `serve` process; the tokens it
returns over gRPC must be the ones the same checkpoint gives in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env
from serve_client import client_stub, generate, request

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.models.loader import get_model
from text_generation_server.settings.serve_args import LM_HEAD_AUTO
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.shard.service import model_kernels

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEW_TOKENS = 8


def quantize_cli(model: Path, out: Path, *flags: str) -> None:
    exe = Path(sys.executable).parent / "text-generation-server"
    cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "text_generation_server.cli"])
    done = subprocess.run(cmd + ["quantize", str(model), str(out), *flags], capture_output=True, text=True,
                          timeout=180, env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:]


def test_quantized_checkpoint_serves(tiny_model, tmp_path, start_serve):
    out = tmp_path / "tiny-gptq"
    # The tiny model's hidden size is 48 and its MLP 88: groups of 8 divide both.
    quantize_cli(tiny_model, out, "--bits", "4", "--groupsize", "8", "--no-sym", "--act-order",
                 "--nsamples", "8", "--seqlen", "64", "--logger-level", "WARNING")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sym"] is False

    server = start_serve(out)
    server.wait_serving()
    served = generate(client_stub(server), request(PROMPT, max_new_tokens=NEW_TOKENS))
    assert "quantization: gptq" in server.log()
    info = client_stub(server).Info(cpb.InfoRequest(), timeout=10)

    lm = get_model(str(out), quantize_lm_head=LM_HEAD_AUTO)  # serve's default head for it
    # Which kernels the layers run on reaches clients (8-row groups: the reference kernel here).
    assert list(info.kernels) == model_kernels(lm.model) and "dense" not in info.kernels, list(info.kernels)
    local = lm.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=NEW_TOKENS)])[0]
    assert served.token_ids == local.token_ids
    assert len(served.token_ids) >= 1


@pytest.mark.parametrize("method", ["fp8", "eetq", "bitsandbytes-nf4"])
def test_quantize_on_load_serves_sharded(tiny_model, start_serve, method):
    """`serve --quantize METHOD` on a dense checkpoint: quantized while each rank loads its
    shard; two ranks answer with the tokens one in-process model gives."""
    server = start_serve(tiny_model, "--quantize", method, num_shard=2)
    server.wait_serving()
    stub = client_stub(server)
    served = generate(stub, request(PROMPT, max_new_tokens=NEW_TOKENS))
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert info.num_shard == 2 and info.quantize, info

    lm = get_model(str(tiny_model), quantize=method, quantize_lm_head=LM_HEAD_AUTO)
    local = lm.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=NEW_TOKENS)])[0]
    assert served.token_ids == local.token_ids
    assert list(info.kernels) == model_kernels(lm.model), list(info.kernels)
