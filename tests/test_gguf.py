"""GGUF files: block decoding, config and tokenizer from metadata, greedy tokens against transformers.

Tiny files are written by tests/gguf_writer.py with the gguf package (the K-quants from random
blocks). On the reference kernel in float32 our greedy tokens equal transformers loading the same
file (`from_pretrained(..., gguf_file=...)`, which dequantizes every tensor); on the chosen kernels
(int4, group int8) the log-probs stay close; two gloo ranks equal one, including a row-parallel
split that falls inside a 256-wide K-quant super-block; truncated and corrupt files are refused
naming the tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_writer import T, k_quant_bytes, write_gguf
from helpers import greedy, kernel_modes, kernels_used, prompt_logprobs, run_ranks

from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.gguf_blocks import FORMATS, decode
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.utils.locate import open_checkpoint, resolve_model

torch.set_num_threads(1)

QUANT_TYPES = [T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# (architecture, linear type, attn_v type): every type on qwen2, the other architectures on a few.
CASES = [("qwen2", t, None) for t in QUANT_TYPES] + [
    ("llama", T.Q4_K, T.Q6_K),  # Q4_K_M's mix, and llama's q/k row permutation
    ("llama", T.Q8_0, None),
    ("qwen3", T.Q5_K, None),
    ("qwen2", T.Q4_K, T.Q6_K),
    ("phi3", T.Q4_K, None),  # fused qkv and gate_up tensors
    ("gemma3", T.Q8_0, None),  # norms stored as 1 + w, q/k norms, post norms
]
TOKENS = 8


def case_id(case) -> str:
    arch, t, v = case
    return f"{arch}-{t.name}" + (f"-v{v.name}" if v is not None else "")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed, case in enumerate(CASES):
        arch, t, v = case
        folder = root / case_id(case)
        folder.mkdir()
        out[case_id(case)] = write_gguf(folder / "model.gguf", arch, t, seed=seed, v_type=v)
    return out


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_blocks_decode_as_the_gguf_package_dequantizes(fmt):
    rng = np.random.default_rng(fmt.type_id)
    qtype = T(fmt.type_id)
    if fmt.block == 256:
        raw = k_quant_bytes(rng, qtype, 6, 512)
    else:
        raw = gguf.quants.quantize(rng.normal(0, 1, (6, 512)).astype(np.float32), qtype)
    want = gguf.quants.dequantize(raw, qtype)
    decoded = decode(fmt, torch.from_numpy(raw.copy()))
    assert np.array_equal(decoded.dequantize(fmt).numpy(), want)  # w = scale * q + offset, exactly
    codes, scales, zeros = decoded.canonical_zeros()
    assert int(codes.max()) < 2 ** fmt.bits
    zero = zeros if zeros is not None else torch.full_like(scales, 2.0 ** (fmt.bits - 1))
    canonical = (codes.float().view(6, -1, fmt.group) - zero[..., None]) * scales[..., None]
    np.testing.assert_allclose(canonical.view(6, 512).numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_constant_group_keeps_its_value():
    """A group with scale 0 and a nonzero minimum is all one value: kept with codes 0, zero -1."""
    from text_generation_server.quantizers.gguf_blocks import Decoded

    d = Decoded(torch.tensor([[3, 7]], dtype=torch.uint8).repeat_interleave(16, 1),
                torch.tensor([[0.0, 0.5]]), torch.tensor([[-0.25, 0.125]]))
    codes, scales, zeros = d.canonical_zeros()
    dense = ((codes.float().view(1, 2, 16) - zeros[..., None]) * scales[..., None]).view(1, 32)
    torch.testing.assert_close(dense, d.dequantize(dataclasses.replace(FORMATS[12], group=16)))
    assert dense[0, :16].eq(-0.25).all()


def hf_greedy(path: Path, ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    return out[0, len(ids):].tolist()


PROMPTS = ["the cat in the hat", "on and on and in"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_equals_transformers_on_the_reference_kernel(files, case, monkeypatch):
    path = files[case_id(case)]
    setenv = monkeypatch.setenv
    modes = kernel_modes(setenv)
    next(modes)  # "reference": every fast kernel disabled
    lm = get_model(str(path), dtype="float32")
    assert kernels_used(lm) <= {"reference", "dense"}, kernels_used(lm)
    want = [hf_greedy(path, lm.tokenizer.encode(p).ids) for p in PROMPTS]
    assert greedy_ids(lm) == want
    reference_lp = prompt_logprobs(lm)
    next(modes)  # "chosen": the kernels the tables pick
    chosen = get_model(str(path), dtype="float32")
    used = kernels_used(chosen)
    assert "reference" not in used, used
    # bfloat16 activations and scales on the int4 op: within a few percent of the float32 reference.
    got = prompt_logprobs(chosen)
    assert torch.isfinite(got).all()
    assert (got - reference_lp).abs().mean() < 0.03 * reference_lp.abs().mean(), (got, reference_lp)


def greedy_ids(lm) -> list[list[int]]:
    from helpers import ids_request, run_to_end

    lm.allocate_kv_cache(64)
    ids = [lm.tokenizer.encode(p).ids for p in PROMPTS]
    out = run_to_end(lm, lm.make_batch(0, [ids_request(i, p, TOKENS) for i, p in enumerate(ids)]))
    return [out[i]["ids"] for i in range(len(ids))]


# The group-scale int8 kernels: native where the extension has its AVX-512 code, else torch's.
GROUP_KERNELS = {"cpu-int8-group-native", "cpu-int8-group"}


def test_kernels_per_format_are_the_fast_ones(files, monkeypatch):
    # Q4_K and Q6_K: their blocks on cpu-kquant (packed at load on AVX-512BW; tests/test_gguf_kquant.py); the other formats decoded
    lm = get_model(str(files["llama-Q4_K-vQ6_K"]), dtype="float32")
    assert kernels_used(lm) - {"dense"} == {"cpu-kquant"}, kernels_used(lm)
    for name in ("qwen2-Q4_0", "qwen2-Q4_1", "qwen2-Q2_K"):
        assert "cpu-int4pack" in kernels_used(get_model(str(files[name]), dtype="float32")), name
    for name in ("qwen2-Q8_0", "qwen2-Q5_K", "qwen2-Q5_0"):
        assert kernels_used(get_model(str(files[name]), dtype="float32")) & GROUP_KERNELS, name
    # with cpu-kquant switched off, the decoded K-quants run on the int4 and group int8 kernels
    monkeypatch.setenv(DISABLE_ENV, "cpu-kquant")
    lm = get_model(str(files["qwen2-Q4_K"]), dtype="float32")
    assert kernels_used(lm) == {"cpu-int4pack", "dense"} or kernels_used(lm) == {"cpu-int4pack"}
    lm = get_model(str(files["llama-Q4_K-vQ6_K"]), dtype="float32")
    used = kernels_used(lm)
    assert "cpu-int4pack" in used and used & GROUP_KERNELS, used
    assert kernels_used(get_model(str(files["qwen2-Q6_K"]), dtype="float32")) & GROUP_KERNELS


def test_a_k_quant_head_is_read_in_place_and_equals_transformers_on_the_reference(tmp_path, monkeypatch):
    """Q4_K_M files store output.weight in Q6_K: on cpu-kquant as stored (not loaded dense); with
    the fast kernels off, its canonical form on the reference kernel gives transformers' tokens."""
    path = write_gguf(tmp_path / "model.gguf", "qwen2", T.Q4_K, seed=11, v_type=T.Q6_K, tied=False,
                      head_type=T.Q6_K)
    modes = kernel_modes(monkeypatch.setenv)
    next(modes)  # "reference"
    lm = get_model(str(path), dtype="float32")
    assert lm.model.head.projection.linear.kernel_name == "reference"
    assert greedy_ids(lm) == [hf_greedy(path, lm.tokenizer.encode(p).ids) for p in PROMPTS]
    next(modes)  # "chosen"
    lm = get_model(str(path), dtype="bfloat16")
    assert lm.model.head.projection.linear.kernel_name == "cpu-kquant"
    assert all(len(tokens) == TOKENS for tokens in greedy_ids(lm))


def test_config_and_tokenizer_come_from_the_metadata(files):
    path = files["llama-Q8_0"]
    checkpoint = open_checkpoint(str(path))
    hf = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert checkpoint.config[key] == getattr(hf, key), key
    assert checkpoint.config["model_type"] == "llama"
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the cat in the hat <|im_end|>"
    assert checkpoint.tokenizer.encode(text).ids == tok(text).input_ids
    assert checkpoint.eos_token_ids == {checkpoint.config["vocab_size"] - 3}


def test_a_folder_holding_one_gguf_and_split_files_load(tmp_path, files):
    path = files["qwen2-Q8_0"]
    assert resolve_model(str(path.parent))[1] == path
    first = write_gguf(tmp_path / "split" / "m.gguf", "qwen2", T.Q8_0, seed=CASES.index(("qwen2", T.Q8_0, None)),
                       split_max_tensors=8) if (tmp_path / "split").mkdir() is None else None
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert len(parts) > 2 and first == parts[0]
    assert greedy(get_model(str(first.parent), dtype="float32")) == greedy(get_model(str(path), dtype="float32"))
    assert resolve_model(str(parts[1]))[1] == first
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"parts {parts[-1].name} are missing"):
        resolve_model(str(first))


def test_mistral_named_llama_is_mistral(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", T.Q8_0, name="Mistral-7B-Instruct")
    assert open_checkpoint(str(path)).config["model_type"] == "mistral"


def test_rope_scaling_keys_become_rope_scaling(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", T.Q8_0, rope_scaling=("linear", 2.0))
    config = open_checkpoint(str(path)).config
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 128}
    assert config["rope_theta"] == 10000.0 and config["head_dim"] == 64
    lm = get_model(str(path), dtype="float32")
    assert greedy(lm)  # the family reads it (layers/rotary.py)
    with pytest.raises(CheckpointError, match="rope.scaling.type' = 'longrope' is not supported"):
        open_checkpoint(str(write_gguf(tmp_path / "n.gguf", "llama", T.Q8_0, rope_scaling=("longrope", 2.0))))


def test_unsupported_architecture_and_type_are_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported"):
        get_model(str(tmp_path / "m.gguf"))
    path = write_gguf(tmp_path / "iq.gguf", "qwen2", T.Q8_0)
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    field = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").field
    type_at = field.offset + field.parts[4].ctypes.data - field.parts[0].ctypes.data
    data[type_at:type_at + 4] = np.uint32(T.IQ4_NL).tobytes()  # same 32-wide blocks: 18 bytes vs 34
    (tmp_path / "iq2.gguf").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="blk.0.attn_q.weight.*IQ4_NL, which is not supported"):
        get_model(str(tmp_path / "iq2.gguf"))


def test_truncated_and_corrupt_files_are_refused_naming_the_tensor(tmp_path, files):
    data = files["qwen2-Q4_K"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1000])
    reader = gguf.GGUFReader(str(files["qwen2-Q4_K"]))
    cut = next(t.name for t in reader.tensors if t.data_offset + t.n_bytes > len(data) - 1000)  # in table order
    with pytest.raises(CheckpointError, match=f"tensor '{cut}'.*truncated"):
        get_model(str(tmp_path / "cut.gguf"))
    # NaN block scales in the first quantized tensor
    first = min((t for t in reader.tensors if t.tensor_type == T.Q4_K), key=lambda t: t.data_offset)
    bad = bytearray(data)
    bad[first.data_offset:first.data_offset + 2] = np.float16(np.nan).tobytes()
    (tmp_path / "nan.gguf").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=f"tensor '{first.name}'.*non-finite"):
        get_model(str(tmp_path / "nan.gguf"))


def test_quantize_flag_disagreeing_with_a_gguf_is_refused(files):
    from text_generation_server.quantizers.factory import read_quantization_config

    with pytest.raises(CheckpointError, match="is a GGUF model"):
        read_quantization_config(files["qwen2-Q8_0"], "gptq")


def _rank_greedy(pg, paths: dict[str, str]) -> dict:
    out = {}
    for mode in kernel_modes():
        for name, path in paths.items():
            lm = get_model(path, dtype="float32", process_group=pg)
            out[mode, name] = {"tokens": greedy(lm, TOKENS), "logprobs": prompt_logprobs(lm)}
    return out


def test_two_ranks_equal_one(files, tmp_path, monkeypatch):
    """intermediate 768 splits at 384 on two ranks: inside a 256-wide super-block, on a 32-wide
    sub-block boundary (the sharding rule of quantizers/gguf.py)."""
    names = ["llama-Q4_K-vQ6_K", "qwen2-Q2_K", "qwen2-Q8_0"]
    paths = {n: str(files[n]) for n in names}
    ranks = run_ranks(_rank_greedy, (paths,), 2, tmp_path, timeout_s=600)
    for mode in kernel_modes(monkeypatch.setenv):
        for name, path in paths.items():
            lm = get_model(path, dtype="float32")
            want_tokens, want_lp = greedy(lm, TOKENS), prompt_logprobs(lm)
            for rank in ranks:
                got = rank[mode, name]["logprobs"]
                if mode == "reference":
                    assert rank[mode, name]["tokens"] == want_tokens, (mode, name)
                    torch.testing.assert_close(got, want_lp, atol=1e-3, rtol=0)
                else:  # bfloat16 partial sums round differently per rank
                    assert (got - want_lp).abs().mean() < 0.03 * want_lp.abs().mean(), (name, got, want_lp)


def test_a_row_split_inside_a_group_is_refused(files):
    """768 columns over 16 ranks: 48 each, which would cut Q4_K's 32-wide groups."""
    from text_generation_server.quantizers.dist import ProcessGroup
    from text_generation_server.quantizers.factory import get_loader, read_quantization_config, tensor_source
    from text_generation_server.quantizers.weights import Weights

    path = files["qwen2-Q4_K"]
    weights = Weights(tensor_source(path), torch.device("cpu"), torch.float32, ProcessGroup(rank=1, size=16),
                      loader=get_loader(read_quantization_config(path, None)))
    with pytest.raises(CheckpointError, match="blk.0.ffn_down|mlp.down_proj.*cut a group"):
        weights.get_weights_row("model.layers.0.mlp.down_proj")
    part = weights.get_weights_col("model.layers.0.mlp.down_proj")  # rows split anywhere: 256 / 16
    assert part.shape == (16, 768)
