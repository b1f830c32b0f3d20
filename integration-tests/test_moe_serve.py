"""Mixtures of experts through `serve`: a dense gpt-oss checkpoint (attention sinks, biased
experts, alternating windows) on two ranks, and a Qwen3-MoE checkpoint quantized to 4 bits by the
real `quantize` CLI (every expert calibrated on the tokens routed to it): both answer over gRPC
with the tokens the same checkpoint gives in-process, and Info names the experts' path."""

from __future__ import annotations

import json

from family_cases import write_family_checkpoint
from serve_client import client_stub, generate, request
from test_quantize_serve import quantize_cli

from text_generation_server.models.loader import get_model
from text_generation_server.settings.serve_args import LM_HEAD_AUTO
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEW_TOKENS = 10


def local_tokens(folder) -> list[int]:
    lm = get_model(str(folder), dtype="float32", quantize_lm_head=LM_HEAD_AUTO)  # serve's default head
    return lm.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=NEW_TOKENS,
                                          ignore_eos_token=True)])[0].token_ids


def test_gpt_oss_serves_on_two_ranks(tmp_path, start_serve):
    folder = tmp_path / "gpt_oss"
    write_family_checkpoint(folder, "gpt_oss", seed=11)
    server = start_serve(folder, num_shard=2)
    server.wait_serving(timeout_s=180)
    stub = client_stub(server)
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert info.num_shard == 2 and "moe-grouped" in info.kernels, list(info.kernels)
    served = generate(stub, request(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos_token=True))
    assert list(served.token_ids) == local_tokens(folder)


def test_quantized_qwen3_moe_serves(tmp_path, start_serve):
    dense = tmp_path / "qwen3_moe"
    write_family_checkpoint(dense, "qwen3_moe", seed=12)
    out = tmp_path / "qwen3_moe-gptq"
    quantize_cli(dense, out, "--bits", "4", "--groupsize", "8", "--nsamples", "8", "--seqlen", "64",
                 "--logger-level", "WARNING")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.down_proj.qweight" in names
    server = start_serve(out)
    server.wait_serving(timeout_s=180)
    served = generate(client_stub(server), request(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos_token=True))
    assert list(served.token_ids) == local_tokens(out)


def test_compressed_tensors_w4a16_qwen3_moe_serves(tmp_path, start_serve):
    """A W4A16 checkpoint packed as llmcompressor writes compressed-tensors (every expert and
    attention linear, group 8, symmetric; packed by the test-side packer): `serve` answers with the
    tokens the same checkpoint gives in-process, and its experts run on this machine's int4 kernel."""
    from quant_packers import ct_tensors, quantize_rtn
    from safetensors.torch import load_file
    from test_family_quantization import ct_config

    from helpers import write_model_folder

    dense = tmp_path / "qwen3_moe"
    write_family_checkpoint(dense, "qwen3_moe", seed=13)
    state = load_file(str(dense / "model.safetensors"))
    packed = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            packed |= ct_tensors(name.removesuffix(".weight"), quantize_rtn(tensor.float(), 4, 8, sym=True),
                                 with_g_idx=False)
        else:
            packed[name] = tensor
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = ct_config(4, 8, True, None)
    out = write_model_folder(tmp_path / "qwen3_moe-w4a16", dense, packed, config)
    assert "model.layers.1.mlp.experts.5.up_proj.weight_packed" in packed
    server = start_serve(out)
    server.wait_serving(timeout_s=180)
    stub = client_stub(server)
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert "moe-grouped" in info.kernels, list(info.kernels)
    served = generate(stub, request(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos_token=True))
    assert list(served.token_ids) == local_tokens(out)
