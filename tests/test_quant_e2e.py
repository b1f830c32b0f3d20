"""Quantized checkpoints end to end: written like the published tools write them, loaded by get_model.

A random tiny Llama is quantized (round-to-nearest, in the test) and packed by the
test-side packers into GPTQ v1/v2/legacy, AWQ and compressed-tensors folders with
the config files real tools write. For each one:
- on the reference kernel (fast kernels disabled) the prompt log-probs equal those
  of a plain checkpoint holding the dequantized weights (the ground truth);
- on the kernels chosen for this machine they stay within kernel error of that;
- they stay within quantization error of the original unquantized model;
- two gloo ranks give what one rank gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (PROMPTS, assert_bfloat16_close, assert_ranks_match_one_process, fast_kernels, greedy,
                     kernel_names, prompt_logprobs, rank_kernel_names, run_ranks, run_ranks_per_mode,
                     write_checkpoint, write_model_folder)
from quant_packers import awq_tensors, ct_tensors, gptq_tensors, quantize_rtn

from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model

torch.set_num_threads(1)

# head_dim 48; at world size 2 o_proj has 96 input rows per rank, so its 64-row groups straddle ranks.
SHAPE = dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj")
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                "mlp.up_proj": "mlp.gate_proj"}  # layers that see the same activations share an act-order
WORLD = 2
SPAWN_TIMEOUT_S = 180


def gptq_config(bits, group, sym, desc_act, fmt):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": fmt}


def ct_config(bits, group, sym, actorder):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if group else "channel",
               "group_size": group, "dynamic": False, "actorder": actorder, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


# name -> how to quantize, pack and describe it. "files": config file name -> content ("config.json"
# means config.json's quantization_config).
VARIANTS = {
    "gptq-v1-4bit-g64-asym": dict(
        bits=4, group=64, sym=False, act_order=False, pack=lambda p, q: gptq_tensors(p, q, "gptq"),
        files={"config.json": gptq_config(4, 64, False, False, "gptq"),
               "quantize_config.json": gptq_config(4, 64, False, False, "gptq")}),
    "gptq-v2-4bit-g64-sym-actorder": dict(
        bits=4, group=64, sym=True, act_order=True, pack=lambda p, q: gptq_tensors(p, q, "gptq_v2"),
        files={"quantize_config.json": gptq_config(4, 64, True, True, "gptq_v2") | {"lm_head": False}}),
    "gptq-legacy-8bit-g64": dict(
        bits=8, group=64, sym=False, act_order=False, pack=lambda p, q: gptq_tensors(p, q, "gptq", with_g_idx=False),
        files={}, extra={"gptq_bits": torch.tensor([8]), "gptq_groupsize": torch.tensor([64])}),
    "awq-g64-dense-mlp1": dict(
        bits=4, group=64, sym=False, act_order=False, pack=awq_tensors, dense=("model.layers.1.mlp",),
        files={"config.json": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                               "version": "gemm", "modules_to_not_convert": ["model.layers.1.mlp"]},
               "quant_config.json": {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}}),
    "ct-w4a16-g64-asym-actorder": dict(
        bits=4, group=64, sym=False, act_order=True, pack=lambda p, q: ct_tensors(p, q, with_g_idx=True),
        files={"config.json": ct_config(4, 64, False, "group")}),
    # Phi-3 stores qkv_proj and gate_up_proj fused: the packed (block-size) column path.
    "gptq-v1-phi3-4bit-g64-asym": dict(
        arch="phi3_fused", bits=4, group=64, sym=False, act_order=False, pack=lambda p, q: gptq_tensors(p, q, "gptq"),
        files={"config.json": gptq_config(4, 64, False, False, "gptq")}),
    "ct-w8a16-channel-sym": dict(
        bits=8, group=-1, sym=True, act_order=False, pack=lambda p, q: ct_tensors(p, q, with_g_idx=False),
        files={"config.json": ct_config(8, None, True, None)}),
}


def write_variant(original: Path, folder: Path, reference: Path, spec: dict, seed: int) -> None:
    """`folder`: the quantized checkpoint; `reference`: the same model with dequantized dense weights."""
    from safetensors.torch import load_file

    state = load_file(str(original / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    quantized, dense, perms = {}, {}, {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        kind = prefix.split(".", 3)[-1] if prefix.startswith("model.layers.") else None
        if kind not in LINEARS or any(prefix.startswith(d) for d in spec.get("dense", ())):
            quantized[name] = tensor.half()  # what the tools store for everything they leave dense
            dense[name] = tensor.half()
            continue
        perm = None
        if spec["act_order"]:
            owner = prefix.rsplit(".", 2)[0] + "." + SHARED_INPUT.get(kind, kind)
            perm = perms.setdefault(owner, torch.randperm(tensor.shape[1], generator=g))
        q = quantize_rtn(tensor.float(), spec["bits"], spec["group"], spec["sym"], perm=perm)
        quantized |= spec["pack"](prefix, q)
        dense[name] = q.dense()
    quantized |= spec.get("extra", {})
    config = json.loads((original / "config.json").read_text()) | {"torch_dtype": "float16"}
    write_model_folder(reference, original, dense, config)
    if "config.json" in spec["files"]:
        config = config | {"quantization_config": spec["files"]["config.json"]}
    write_model_folder(folder, original, quantized, config)
    for name, content in spec["files"].items():
        if name != "config.json":
            (folder / name).write_text(json.dumps(content))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant_e2e")
    out = {}
    for arch in ("llama", "phi3_fused"):
        write_checkpoint(root / arch, arch, seed=7, **SHAPE)
        out[arch] = root / arch
    out["original"] = out["llama"]
    for seed, (name, spec) in enumerate(VARIANTS.items()):
        write_variant(out[spec.get("arch", "llama")], root / name, root / f"{name}.dense", spec, seed)
        out[name] = root / name
        out[f"{name}.dense"] = root / f"{name}.dense"
    return out


@pytest.fixture(scope="module")
def original_logprobs(folders) -> dict[str, torch.Tensor]:
    return {arch: prompt_logprobs(get_model(str(folders[arch]), dtype="float32")) for arch in ("llama", "phi3_fused")}


@pytest.fixture
def reference_kernel_only(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())


# Quantization error of the prompt log-probs against the unquantized model (mean absolute difference).
QUANT_ERROR = {4: 0.25, 8: 0.02}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_path_equals_dequantized_checkpoint(folders, original_logprobs, reference_kernel_only, name):
    lm = get_model(str(folders[name]), dtype="float32")
    assert lm.quantize is not None
    kernels = kernel_names(lm)
    assert kernels and set(kernels.values()) <= {"reference", "dense"}
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    error = (got - original_logprobs[VARIANTS[name].get("arch", "llama")]).abs().mean().item()
    assert 0 < error < QUANT_ERROR[VARIANTS[name]["bits"]], error


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chosen_kernels_stay_close_to_the_reference(folders, name):
    lm = get_model(str(folders[name]), dtype="float32")
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    assert (got - want).abs().max() < 0.05, kernel_names(lm)


@pytest.mark.parametrize("name", ["gptq-v1-4bit-g64-asym", "gptq-v2-4bit-g64-sym-actorder", "ct-w8a16-channel-sym"])
def test_bfloat16_activations(folders, name):
    assert_bfloat16_close(get_model(str(folders[name]), dtype="bfloat16"), folders[f"{name}.dense"])


def test_modules_to_not_convert_stay_dense(folders):
    kernels = kernel_names(get_model(str(folders["awq-g64-dense-mlp1"]), dtype="float32"))
    assert kernels["layers.1.mlp.gate_up.linear"] == kernels["layers.1.mlp.down.linear"] == "dense"
    assert kernels["layers.0.mlp.gate_up.linear"] != "dense"


def test_wrong_zero_point_convention_is_visible(folders, tmp_path, reference_kernel_only):
    """Reading a v1 checkpoint as v2 shifts every zero point by one: the comparison above would catch it."""
    name = "gptq-v1-4bit-g64-asym"
    shutil.copytree(folders[name], tmp_path / "m")
    for file in ("config.json", "quantize_config.json"):
        config = json.loads((tmp_path / "m" / file).read_text())
        (config.get("quantization_config") or config)["checkpoint_format"] = "gptq_v2"
        (tmp_path / "m" / file).write_text(json.dumps(config))
    wrong = prompt_logprobs(get_model(str(tmp_path / "m"), dtype="float32"))
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    assert (wrong - want).abs().max() > 1e-2


def test_quantize_flag(folders):
    lm = get_model(str(folders["gptq-legacy-8bit-g64"]), dtype="float32", quantize="gptq")
    assert lm.quantize == "gptq"
    with pytest.raises(ValueError, match=r"--quantize awq disagrees with the checkpoint: .*config\.json says "
                                         r"'quantization_config\.quant_method' = 'compressed-tensors'"):
        get_model(str(folders["ct-w8a16-channel-sym"]), quantize="awq")
    with pytest.raises(ValueError, match=r"--quantize gptq: .*llama is not a quantized checkpoint"):
        get_model(str(folders["original"]), quantize="gptq")


def test_generate_cli_json(folders):
    from typer.testing import CliRunner

    from text_generation_server.cli.main import app

    folder = str(folders["gptq-v2-4bit-g64-sym-actorder"])
    result = CliRunner().invoke(app, ["generate", "--json", "--model", folder, "--max-new-tokens", "6", PROMPTS[1]])
    assert result.exit_code == 0, result.output
    line = json.loads([ln for ln in result.stdout.splitlines() if ln.startswith("{")][0])
    assert line["generated_tokens"] == 6
    assert line["token_ids"] == greedy(get_model(folder), tokens=6)[1]


# -- world size 2 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    return run_ranks_per_mode(folders, VARIANTS, WORLD, tmp_path_factory.mktemp("quant_tp"), SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_world_size_2_matches_world_size_1(folders, world2, name, monkeypatch):
    """On the reference kernel the ranks reproduce one process up to float32 summation order
    (act-order row shards and groups straddling ranks included); on the chosen kernels up to
    their bf16 activation rounding."""
    assert_ranks_match_one_process(world2, name, str(folders[name]), monkeypatch)


ACT_ORDER = [name for name, spec in VARIANTS.items() if spec["act_order"]]


@pytest.mark.parametrize("world", [1, 2])
def test_act_order_checkpoints_run_on_the_compact_kernel(folders, tmp_path, monkeypatch, world):
    """o_proj and down_proj are row-parallel: at 2 ranks each holds an uneven share of every act-order
    group. The int4 CPU kernel still runs them (rows sorted by group, padded to whole blocks)."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    paths = {name: str(folders[name]) for name in ACT_ORDER}
    if world == 1:
        ranks = [{name: kernel_names(get_model(path, dtype="float32")) for name, path in paths.items()}]
    else:
        ranks = run_ranks(rank_kernel_names, (paths,), world, tmp_path, SPAWN_TIMEOUT_S)
    for rank in ranks:
        for name in ACT_ORDER:
            layers = {module: kernel for module, kernel in rank[name].items() if module.startswith("layers.")}
            assert len(layers) == 2 * 4, layers  # qkv, o, gate_up, down in both layers
            assert set(layers.values()) == {"cpu-int4pack"}, (name, layers)
