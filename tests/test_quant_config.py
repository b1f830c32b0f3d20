"""Quantization configs: each file and key real tools write, `--quantize`, and every refusal.

A config we cannot run must fail at startup with the file and the key named;
`--quantize` may name the method but must agree with the checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from text_generation_server.quantizers.config import AWQConfig, GPTQConfig
from text_generation_server.quantizers.factory import read_quantization_config


def write_folder(folder, **files) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if name == "tensors":
            save_file(content, str(folder / "model.safetensors"))
        else:
            (folder / f"{name}.json").write_text(json.dumps(content))
    return str(folder)


GPTQ_QC = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
           "static_groups": False, "checkpoint_format": "gptq_v2", "damp_percent": 0.01}


def test_configs_are_read_from_each_file(tmp_path):
    cfg = read_quantization_config(write_folder(tmp_path / "a", config={"quantization_config": GPTQ_QC}), None)
    assert cfg == GPTQConfig(source=str(tmp_path / "a" / "config.json"), bits=4, group_size=128, desc_act=True,
                             sym=False, checkpoint_format="gptq_v2")
    # AutoGPTQ's quantize_config.json names no method; config.json without quantization_config is skipped.
    folder = write_folder(tmp_path / "b", config={"model_type": "llama"},
                          quantize_config={"bits": 3, "group_size": -1, "desc_act": False, "sym": True})
    cfg = read_quantization_config(folder, "gptq")
    assert (cfg.bits, cfg.group_size, cfg.checkpoint_format, cfg.zero_offset) == (3, -1, "gptq", 1)
    folder = write_folder(tmp_path / "c", quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4,
                                                       "version": "GEMM"})
    assert read_quantization_config(folder, "awq") == AWQConfig(source=str(tmp_path / "c" / "quant_config.json"),
                                                                 bits=4, group_size=64)
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
          "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
    cfg = read_quantization_config(write_folder(tmp_path / "d", config={"quantization_config": ct}), None)
    assert cfg.schemes[0].bits == 8 and cfg.schemes[0].group_size == -1 and cfg.modules_to_not_convert == ("lm_head",)
    assert read_quantization_config(write_folder(tmp_path / "e", config={"model_type": "llama"}), None) is None


def test_legacy_folder_without_a_config(tmp_path):
    folder = write_folder(tmp_path, config={"model_type": "llama"},
                          tensors={"gptq_bits": torch.tensor([3]), "gptq_groupsize": torch.tensor([64]),
                                   "x.qweight": torch.zeros(3, 8, dtype=torch.int32)})
    for flag in (None, "gptq"):
        cfg = read_quantization_config(folder, flag)
        assert (cfg.bits, cfg.group_size, cfg.sym, cfg.desc_act) == (3, 64, False, False)
    with pytest.raises(ValueError, match="--quantize awq: .* is not a quantized checkpoint"):
        read_quantization_config(folder, "awq")


def ct(fmt: str = "pack-quantized", **weights) -> dict:
    scheme = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True} | weights
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"g": {"targets": ["Linear"], "weights": scheme}}}


QC = r"config\.json: 'quantization_config\."
CT_W = QC + r"config_groups\.g\.weights\."
BAD_CONFIGS = {
    "gptq-5bit": (GPTQ_QC | {"bits": 5}, QC + r"bits' = 5 is not yet supported for gptq \(supported: 2, 3, 4, 8\)"),
    "gptq-bits-string": (GPTQ_QC | {"bits": "four"}, QC + r"bits' must be an integer"),
    "gptq-group-0": (GPTQ_QC | {"group_size": 0}, QC + r"group_size' must be -1 or positive"),
    "gptq-quantized-head": (GPTQ_QC | {"lm_head": True}, QC + r"lm_head' = True is not yet supported"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
                 QC + r"version' = 'gemv' is not yet supported for awq"),
    "awq-3bit": ({"quant_method": "awq", "bits": 3, "group_size": 128}, QC + r"bits' = 3 is not yet supported"),
    "hqq": ({"quant_method": "hqq"}, QC + r"quant_method' = 'hqq' is not yet supported"),
    "unknown": ({"quant_method": "wizard"}, QC + r"quant_method' = 'wizard' is unknown"),
    "ct-float-4bit": (ct("float-quantized", type="float", num_bits=4, strategy="tensor"),
                      CT_W + r"num_bits' = 4 is not yet supported for compressed-tensors float-quantized"),
    "ct-float-type-packed": (ct(type="float"), CT_W + r"type' = 'float' is not yet supported for compressed-tensors "
                                                     r"pack-quantized \(supported: int\)"),
    "ct-tensor-strategy": (ct(strategy="tensor"), CT_W + r"strategy' = 'tensor' is not yet supported"),
    "ct-3bit": (ct(num_bits=3), CT_W + r"num_bits' = 3 is not yet supported"),
    "ct-frozen": (ct() | {"quantization_status": "frozen"}, QC + r"quantization_status' = 'frozen' is not yet"),
    "ct-w8a8": ({**ct(), "config_groups": {"g": {**ct()["config_groups"]["g"], "input_activations": {"num_bits": 8}}}},
                QC + r"config_groups\.g\.input_activations' = .* is not yet supported"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_unsupported_configs_name_file_and_key(tmp_path, name):
    config, message = BAD_CONFIGS[name]
    with pytest.raises(ValueError, match=message):
        read_quantization_config(write_folder(tmp_path, config={"quantization_config": config}), None)


def test_quantize_flag_must_agree(tmp_path):
    folder = write_folder(tmp_path / "q", config={"quantization_config": GPTQ_QC})
    assert read_quantization_config(folder, "gptq").bits == 4
    with pytest.raises(ValueError, match=r"--quantize awq disagrees with the checkpoint: .*config\.json says "
                                         r"'quantization_config\.quant_method' = 'gptq'"):
        read_quantization_config(folder, "awq")
    with pytest.raises(ValueError, match=r"--quantize aqlm: not yet supported"):
        read_quantization_config(folder, "aqlm")
    with pytest.raises(ValueError, match=r"--quantize banana: unknown quantization method"):
        read_quantization_config(folder, "banana")
    dense = write_folder(tmp_path / "d", config={"model_type": "llama"}, tensors={"w.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"--quantize gptq: .* is not a quantized checkpoint"):
        read_quantization_config(dense, "gptq")


def ct_float(**weights) -> dict:
    scheme = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False} | weights
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"g": {"targets": ["Linear"], "weights": scheme,
                                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                          "strategy": "token"}}}}


def test_flags_another_method_accepts(tmp_path):
    """A flag of another config type passes only where the checkpoint truly is of that method."""
    from text_generation_server.quantizers.marlin import MarlinConfig

    gptq_marlin = GPTQ_QC | {"checkpoint_format": "marlin", "desc_act": False, "sym": True}
    for name, config in (("marlin", gptq_marlin), ("marlin-24", gptq_marlin | {"checkpoint_format": "marlin_24"}),
                         ("is-marlin", {"bits": 4, "group_size": 128, "is_marlin_format": True})):
        folder = write_folder(tmp_path / name, config={"quantization_config": config})
        cfg = read_quantization_config(folder, "gptq")
        assert isinstance(cfg, MarlinConfig) and cfg == read_quantization_config(folder, None)
        assert read_quantization_config(folder, "marlin") == cfg
        says = (r"says 'quantization_config\.quant_method' = 'gptq' \(" if "quant_method" in config
                else r"names no 'quantization_config\.quant_method'; its keys describe ")
        with pytest.raises(ValueError, match=r"--quantize awq disagrees with the checkpoint: .*config\.json "
                                             + says + r"marlin \(marlin"):
            read_quantization_config(folder, "awq")

    fp8 = write_folder(tmp_path / "fp8", config={"quantization_config": ct_float()})
    cfg = read_quantization_config(fp8, "fp8")
    assert cfg == read_quantization_config(fp8, None) and cfg.method == "compressed-tensors"
    assert cfg == read_quantization_config(fp8, "compressed-tensors")
    with pytest.raises(ValueError, match=r"--quantize fbgemm_fp8 disagrees .*'compressed-tensors' \(compressed-tensors "
                                         r"float-quantized fp8 channel"):
        read_quantization_config(fp8, "fbgemm_fp8")


@pytest.mark.parametrize("config,flag,says", [
    (GPTQ_QC, "fp8", r"'gptq' \(gptq \(gptq_v2\) 4-bit"),
    (GPTQ_QC, "marlin", r"'gptq' \(gptq"),  # a GPTQ layout is not a Marlin one
    (ct(), "fp8", r"'compressed-tensors' \(compressed-tensors pack-quantized int4 group 128 sym\)"),
    ({**ct(), "config_groups": {"int": ct()["config_groups"]["g"] | {"targets": ["re:.*mlp.*"]},
                                "float": ct_float()["config_groups"]["g"] | {"format": "float-quantized"}}},
     "fp8", r"'compressed-tensors' \(compressed-tensors pack-quantized int4 .*, float-quantized fp8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq", r"'awq' \(awq \(gemm\)"),
])
def test_flags_of_another_method_still_disagree(tmp_path, config, flag, says):
    folder = write_folder(tmp_path, config={"quantization_config": config})
    with pytest.raises(ValueError, match=rf"--quantize {flag} disagrees with the checkpoint: .*config\.json says "
                                         rf"'quantization_config\.quant_method' = {says}"):
        read_quantization_config(folder, flag)
