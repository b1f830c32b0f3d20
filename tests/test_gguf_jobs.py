"""`convert model.gguf` writes a dense safetensors folder; `quantize model.gguf` reads it dequantized.

The converted folder serves the same greedy tokens as the GGUF itself (reference kernel, float32)
and transformers loads it like any checkpoint, to the tokens it gets from the GGUF; quantize's RTN
output of a GGUF equals its RTN output of the converted folder, tensor for tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from gguf_writer import T, write_gguf
from helpers import fast_kernels, greedy
from safetensors import safe_open

from text_generation_server.jobs.gguf_export import convert_gguf, default_output
from text_generation_server.jobs.quantize.options import QuantizeOptions
from text_generation_server.jobs.quantize.pipeline import quantize
from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.sources import CheckpointError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-jobs")
    return write_gguf(folder / "tiny.gguf", "llama", T.Q4_K, seed=7, v_type=T.Q6_K)


@pytest.fixture(scope="module")
def converted(gguf_file) -> Path:
    written = convert_gguf(gguf_file, default_output(gguf_file), 1 << 20)
    assert len(written) > 1  # sharded at 1 MiB
    return default_output(gguf_file)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_converted_folder_serves_the_same_tokens(gguf_file, converted, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    assert converted == gguf_file.with_name("tiny-safetensors")
    assert greedy(get_model(str(converted), dtype="float32")) == greedy(get_model(str(gguf_file), dtype="float32"))
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert (converted / "tokenizer.json").exists()


def test_transformers_loads_the_converted_folder_as_it_loads_the_gguf(gguf_file, converted):
    from_folder = transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                                  dtype=torch.float32)
    want = from_gguf.state_dict()
    for name, value in from_folder.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=2e-7, rtol=1e-6, msg=name)


def test_convert_refuses_an_existing_output(gguf_file, converted):
    with pytest.raises(CheckpointError, match="already exists"):
        convert_gguf(gguf_file, converted, 1 << 20)


def test_quantize_reads_a_gguf_dequantized(gguf_file, converted, tmp_path):
    opts = QuantizeOptions(bits=4, group_size=32, method="rtn")
    from_gguf = quantize(str(gguf_file), tmp_path / "a", opts)
    from_folder = quantize(str(converted), tmp_path / "b", opts)
    a, b = tensors(from_gguf), tensors(from_folder)
    assert a.keys() == b.keys()
    for name in a:  # the same values; tensors left dense keep the GGUF's dtype (the embedding's float16)
        torch.testing.assert_close(a[name].to(b[name].dtype), b[name], atol=0, rtol=0, msg=name)
    assert a["model.embed_tokens.weight"].dtype == torch.float16
    assert (from_gguf / "tokenizer.json").exists()
    assert json.loads((from_gguf / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert greedy(get_model(str(from_gguf), dtype="float32"))
