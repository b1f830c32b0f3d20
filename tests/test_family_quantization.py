"""Quantization of every native family: `quantize` writes it, the loaders read it.

The tiny random checkpoints of family_cases.CASES (written by transformers' own classes) go
through three paths:

1. `quantize` (GPTQ with a few calibration samples, and RTN) on the dense checkpoint: the
   output loads with `get_model`, every linear is stored as GPTQ tensors under the family's own
   names, every other tensor (and any linear left dense) is the input's, byte for byte (GPT-2's
   Conv1D weights in their stored [in, out] layout); RTN's tensors are exactly what the
   test-side packer writes; each linear's calibration inputs are exactly what inference feeds
   it; the quantized model stays within quantization error of the dense one.
2. GPTQ, AWQ and compressed-tensors checkpoints of the families, quantized and packed here
   (tests/quant_packers.py) under the family's own tensor names: on the reference kernel they
   give the prompt log-probs of a dense checkpoint holding the dequantized weights; on this
   machine's kernels they stay close.
3. Two gloo ranks give what one rank gives for a few of those checkpoints (multi-query ones
   included: their single KV head is replicated, the fused q/k/v output cut per rank).

Which tensors are linears is read off a loaded dense model (its parallel linears record the
checkpoint tensors they came from); which are Conv1D is read off transformers' model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_cases import CASES, write_family_checkpoint
from helpers import (PROMPTS, SAMPLE_TEXT, assert_ranks_match_one_process, greedy, kernel_modes, kernel_names,
                     prompt_logprobs, run_ranks_per_mode, write_model_folder)
from quant_packers import Quantized, awq_tensors, ct_tensors, gptq_tensors, quantize_rtn
from safetensors import safe_open

from text_generation_server.layers.attention import AttentionMetadata, KVCache
from text_generation_server.models.loader import get_model
from text_generation_server.jobs.quantize.options import QuantizeOptions
from text_generation_server.jobs.quantize.pipeline import quantize
from text_generation_server.jobs.quantize import pipeline

torch.set_num_threads(1)

# DeepSeek (multi-head latent attention) is not calibrated by `quantize` yet: layers/mla.py absorbs
# kv_b_proj at load, and its linear_stages() refuses by name (test_mla.py loads its FP8 checkpoints).
NAMES = [n for n, (t, _) in CASES.items() if t not in ("deepseek_v2", "deepseek_v3")]
# Mixtures of experts: quantization error (or bf16 activations) flips a router's top-k at near-ties,
# and a flipped expert moves that position's log-probs much more than the error itself would.
MOE = {n for n, (t, _) in CASES.items() if t in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")}
GROUP = 8  # divides every input size of the tiny models (48, 64, 88, 192)
NSAMPLES, SEQLEN = 4, 32
WORLD = 2
SPAWN_TIMEOUT_S = 240


# -- the dense checkpoints and what a loaded model says about them ------------------------------------
class Case:
    """One case's dense checkpoint and its linears."""

    def __init__(self, root: Path, name: str, seed: int):
        self.name = name
        self.folder = root / name
        hf = write_family_checkpoint(self.folder, name, seed=seed)
        self.config = json.loads((self.folder / "config.json").read_text())
        # transformers' GPT-2 stores its linears as Conv1D ([in, out]); every other layout is Linear's.
        self.conv1d = {n for n, m in hf.named_modules() if type(m).__name__ == "Conv1D"}
        lm = get_model(str(self.folder), dtype="float32")
        # Each parallel linear's checkpoint tensors (those of one matmul share its input), and its sizes.
        self.groups: list[tuple[str, ...]] = []
        self.rows: dict[str, int] = {}
        self.in_features: dict[str, int] = {}
        self.layer_of: dict[str, int] = {}
        for module, m in lm.model.named_modules():
            tensors = getattr(m, "tensors", ())
            if not tensors:
                continue
            self.groups.append(tuple(tensors))
            for tensor, rows in zip(tensors, m.rows):
                self.rows[tensor], self.in_features[tensor] = rows, m.in_features
                self.layer_of[tensor] = int(module.split(".")[1])
        self.layers = lm.config.num_hidden_layers
        self.logprobs = prompt_logprobs(lm)
        # How far bf16 activations move this model's prompt log-probs: the scale of the error of kernels
        # that run their matmuls in bf16 (the widened tiny models are more sensitive than real ones).
        self.bf16_error = float((prompt_logprobs(get_model(str(self.folder), dtype="bfloat16")) - self.logprobs)
                                .abs().max())
        prompts = [lm.tokenizer.encode(p).ids for p in PROMPTS]
        self.sequences = [p + t for p, t in zip(prompts, greedy(lm, 16))]  # prompt + dense greedy tokens
        self.prompt_lengths = [len(p) for p in prompts]
        self.logits = sequence_logits(lm, self.sequences)
        self.state = readable(self.folder, self.config)

    @property
    def linears(self) -> list[str]:
        return [t for group in self.groups for t in group]

    def linear_layout(self, prefix: str, tensor: torch.Tensor) -> torch.Tensor:
        """A stored linear weight as [out, in] (Conv1D's transposed)."""
        return tensor.t().contiguous() if prefix in self.conv1d else tensor

    def stored_layout(self, prefix: str, weight: torch.Tensor) -> torch.Tensor:
        """An [out, in] weight as the family stores it."""
        return weight.t().contiguous() if prefix in self.conv1d else weight

    def last_mlp(self) -> str:
        """The checkpoint prefix of the last layer's MLP (its linears' common parent: the MoE block
        for a mixture of experts)."""
        parents = [t.rsplit(".", 1)[0].split(".") for t in self.linears
                   if self.layer_of[t] == self.layers - 1 and any(m in t for m in (".mlp.", ".block_sparse_moe."))]
        assert parents
        common = parents[0]
        for p in parents[1:]:
            common = [a for a, b in zip(common, p) if a == b][:next((i for i, (a, b) in enumerate(zip(common, p))
                                                                      if a != b), min(len(common), len(p)))]
        return ".".join(common)


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, as stored."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def readable(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    """The tensors as stored, but stacked ones (gpt-oss experts) as the parts the family reads:
    what `quantize` writes for a dense tensor it keeps."""
    from text_generation_server.models.registry import read_model_config
    from text_generation_server.quantizers.sources import safetensors_files
    from text_generation_server.quantizers.weights import Weights

    family, decoder = read_model_config(config)
    weights = Weights(safetensors_files(folder), torch.device("cpu"), torch.float32)
    family.prepare(decoder, weights)
    derived = weights.derived
    if not derived:
        return stored(folder)
    stacks = {view.stored for view in derived.values()}
    out = {k: v for k, v in stored(folder).items() if k not in stacks}
    out.update({name: weights.source.get_slice(name)[...] for name in derived})
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(
        b.reshape(-1).view(torch.uint8))


def sequence_logits(lm, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of each sequence, each prefilled whole as a prompt (as calibration
    runs its samples: length-dependent rope sees the sequence's length at every token)."""
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    lengths = torch.cat([torch.full((len(s),), len(s)) for s in sequences])
    cache = KVCache(lm.config.num_hidden_layers, 1, len(ids), lm.model.local_kv_heads, lm.config.head_dim,
                    torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slots=torch.arange(len(ids)), prefill_lens=[len(s) for s in sequences])
    with torch.inference_mode():
        logits = lm.model(ids, positions, cache, meta, seq_lens=lengths)
    return list(logits.split([len(s) for s in sequences]))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family_quant")


@pytest.fixture(scope="module")
def families(root):
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            cache[name] = Case(root / "dense", name, seed=200 + NAMES.index(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def text_file(root) -> Path:
    path = root / "calib.txt"
    path.write_text("\n".join(SAMPLE_TEXT * 30))
    return path


# -- 1. `quantize` on every family ------------------------------------------------------------------
# name -> QuantizeOptions fields; "keep_last_mlp" leaves the last layer's MLP dense (--modules-to-not-convert).
QUANTIZE = {
    "gptq-8bit-sym": dict(bits=8, keep_last_mlp=True),
    "gptq_v2-4bit-asym-actorder": dict(bits=4, sym=False, act_order=True, checkpoint_format="gptq_v2"),
    "rtn-4bit-sym": dict(bits=4, method="rtn"),
}
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class Run:
    """A `quantize` output and what its calibration saw: each linear's Hessian by (layer, module)
    and the calibration ids."""

    def __init__(self, folder: Path, hessians: dict, ids: torch.Tensor | None, kept: str | None):
        self.folder, self.hessians, self.ids, self.kept = folder, hessians, ids, kept


def quantize_options(family: Case, variant: str, text_file: Path) -> QuantizeOptions:
    spec = dict(QUANTIZE[variant])
    kept = (family.last_mlp(),) if spec.pop("keep_last_mlp", False) else ()
    return QuantizeOptions(group_size=GROUP, nsamples=NSAMPLES, dataset=text_file, modules_to_not_convert=kept,
                           seqlen=min(SEQLEN, family.config.get("max_position_embeddings", SEQLEN)), **spec)


@pytest.fixture(scope="module")
def runs(root, families, text_file):
    cache: dict[tuple[str, str], Run] = {}

    def get(name: str, variant: str) -> Run:
        if (name, variant) in cache:
            return cache[name, variant]
        family = families(name)
        options = quantize_options(family, variant, text_file)
        kept = options.modules_to_not_convert[0] if options.modules_to_not_convert else None
        hessians, ids = {}, []
        quantize_group, samples = pipeline.Quantizer._quantize_group, pipeline.calibration_samples

        def record_group(self, index, layer, group, hessian, errors):
            if hessian is not None:
                hessians[index, group.module] = hessian.detach().clone().double()
            return quantize_group(self, index, layer, group, hessian, errors)

        def record_samples(*args, **kwargs):
            ids.append(samples(*args, **kwargs))
            return ids[-1]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline.Quantizer, "_quantize_group", record_group)
            mp.setattr(pipeline, "calibration_samples", record_samples)
            out = quantize(str(family.folder), root / "quantized" / f"{name}-{variant}", options)
        cache[name, variant] = Run(out, hessians, ids[0] if ids else None, kept)
        return cache[name, variant]

    return get


@pytest.mark.parametrize("variant", list(QUANTIZE))
@pytest.mark.parametrize("name", NAMES)
def test_quantize_writes_the_family_names_and_copies_the_rest(families, runs, name, variant):
    family, run = families(name), runs(name, variant)
    spec = QUANTIZE[variant]
    out = stored(run.folder)
    index = json.loads((run.folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(out)
    kept = [t for t in family.linears if run.kept and t.startswith(run.kept + ".")]
    quantized = [t for t in family.linears if t not in kept]
    assert quantized and (kept or not run.kept)
    expected = {k for k in family.state if k not in {f"{t}.weight" for t in quantized}}
    expected |= {f"{t}.{suffix}" for t in quantized for suffix in GPTQ_SUFFIXES}
    assert set(out) == expected, sorted(set(out) ^ expected)
    for key, tensor in family.state.items():
        if key in out:  # embeddings, norms, biases, the head, and linears left dense: as stored
            assert same_bytes(out[key], tensor), key
    for prefix in kept:  # Conv1D ones included: [in, out], not transposed
        assert out[f"{prefix}.weight"].shape == family.state[f"{prefix}.weight"].shape
    for prefix in quantized:
        k, n = family.in_features[prefix], family.rows[prefix]
        assert family.linear_layout(prefix, family.state[f"{prefix}.weight"]).shape == (n, k), prefix
        assert out[f"{prefix}.qweight"].shape == (k * spec["bits"] // 32, n), prefix
        assert out[f"{prefix}.scales"].shape == (k // GROUP, n) and out[f"{prefix}.g_idx"].shape == (k,)
    config = json.loads((run.folder / "config.json").read_text())
    assert config["model_type"] == family.config["model_type"]
    assert config["quantization_config"]["bits"] == spec["bits"]
    assert config["quantization_config"].get("modules_to_not_convert", []) == ([run.kept] if run.kept else [])
    for side in ("tokenizer.json", "generation_config.json"):
        assert (run.folder / side).read_bytes() == (family.folder / side).read_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_rtn_writes_what_the_reference_packer_writes(families, runs, name):
    """Every linear, under its own name, holds exactly the test-side RTN and GPTQ v1 packing of
    its stored weight (Conv1D's read as [out, in])."""
    family, run = families(name), runs(name, "rtn-4bit-sym")
    out = stored(run.folder)
    for prefix in family.linears:
        weight = family.linear_layout(prefix, family.state[f"{prefix}.weight"]).float()
        for key, value in gptq_tensors(prefix, quantize_rtn(weight, 4, GROUP, sym=True)).items():
            assert torch.equal(out[key], value), key


def test_checkpoints_read_through_aliases_keep_their_names(root, families, runs, text_file):
    """GPT2Model checkpoints (the hub's gpt2) store "h.0.attn.c_attn.weight" for the family's
    "transformer.h.0.attn.c_attn.weight": every layer is still quantized, and every tensor written
    under the checkpoint's own names, exactly as for the prefixed checkpoint."""
    family, run = families("gpt2"), runs("gpt2", "rtn-4bit-sym")
    folder = write_model_folder(root / "gpt2-model-names", family.folder,
                                {k.removeprefix("transformer."): v for k, v in family.state.items()}, family.config)
    out = quantize(str(folder), root / "gpt2-model-names-rtn", quantize_options(family, "rtn-4bit-sym", text_file))
    got = stored(out)
    want = {k.removeprefix("transformer."): v for k, v in stored(run.folder).items()}
    assert "h.0.attn.c_attn.qweight" in got and got.keys() == want.keys()
    assert all(same_bytes(got[k], want[k]) for k in want)
    torch.testing.assert_close(prompt_logprobs(get_model(str(out), dtype="float32")),
                               prompt_logprobs(get_model(str(run.folder), dtype="float32")), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_calibration_inputs_are_what_inference_feeds_each_linear(families, runs, name):
    """Each linear's Hessian in the GPTQ run equals 2 X^T X / n of the inputs the quantized model
    feeds that linear on the calibration samples: with true-sequential order every linear is
    quantized after the ones its inputs depend on, so the final model reproduces them."""
    family, run = families(name), runs(name, "gptq_v2-4bit-asym-actorder")
    lm = get_model(str(run.folder), dtype="float32")
    inputs: dict = {key: [] for key in run.hessians}
    hooks = [lm.model.layers[i].get_submodule(module).linear.register_forward_pre_hook(
        lambda _m, args, key=(i, module): inputs[key].append(args[0].double()))
        for i, module in run.hessians]
    expected = {(i, g) for i in range(family.layers) for g in ("self_attn.qkv", "self_attn.o_proj")}
    assert expected <= set(run.hessians)
    # Every linear has its Hessian but experts the router sent too few calibration tokens (RTN then).
    experts = sum(".experts." in group[0] for group in family.groups)
    assert len(family.groups) - experts == sum("experts." not in m for _, m in run.hessians)
    assert len(run.hessians) <= len(family.groups)
    try:
        sequence_logits(lm, run.ids.tolist())
    finally:
        for hook in hooks:
            hook.remove()
    for key, hessian in run.hessians.items():
        x = torch.cat(inputs[key])
        want = 2 * x.t() @ x / x.shape[0]
        assert (hessian - want).abs().max() <= 1e-5 * want.abs().max(), key


# Mean absolute prompt log-prob error against the dense model (the tiny models' weights are wide,
# so 4-bit error is large), and the dense greedy margin past which 8-bit must pick the same token.
MEAN_ERROR = {"gptq-8bit-sym": 0.05, "gptq_v2-4bit-asym-actorder": 0.45, "rtn-4bit-sym": 1.0}
MARGIN_8BIT = 0.1


@pytest.mark.parametrize("variant", list(QUANTIZE))
@pytest.mark.parametrize("name", NAMES)
def test_quantized_model_stays_within_quantization_error(families, runs, name, variant):
    family, run = families(name), runs(name, variant)
    lm = get_model(str(run.folder), dtype="float32")
    assert lm.quantize == "gptq"
    kernels = {m: k for m, k in kernel_names(lm).items() if m.startswith("layers.") and not m.endswith(".experts")}
    assert len(kernels) == len(family.groups), kernels
    last = f"layers.{family.layers - 1}.mlp."
    for module, kernel in kernels.items():
        assert (kernel == "dense") == bool(run.kept and module.startswith(last)), (module, kernel)
    error = (prompt_logprobs(lm) - family.logprobs).abs()
    assert torch.isfinite(error).all()
    assert 0 < error.mean() < MEAN_ERROR[variant] * (2.5 if name in MOE else 1), error.mean()
    if QUANTIZE[variant]["bits"] == 8:
        # The dense model's greedy continuation, teacher-forced: 8-bit picks the same token at every
        # step but near-ties, and at nearly every step overall.
        agree = total = 0
        for start, want, got in zip(family.prompt_lengths, family.logits, sequence_logits(lm, family.sequences)):
            want, got = want[start - 1:-1], got[start - 1:-1]
            top = want.topk(2).values
            same = want.argmax(-1) == got.argmax(-1)
            if name not in MOE:  # (a flipped expert moves logits past any margin)
                assert same[top[:, 0] - top[:, 1] > MARGIN_8BIT].all(), (same, top)
            agree, total = agree + int(same.sum()), total + len(same)
        assert agree >= (0.8 if name in MOE else 0.9) * total, (agree, total)


# -- 2. GPTQ, AWQ and compressed-tensors checkpoints of the families --------------------------------
def gptq_config(bits: int, group: int, sym: bool, desc_act: bool, fmt: str) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": fmt}


def ct_config(bits: int, group: int | None, sym: bool, actorder: str | None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if group else "channel",
               "group_size": group, "dynamic": False, "actorder": actorder, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


# name -> how to quantize, pack and describe it ("config.json": its quantization_config; other files as named).
FORMATS = {
    "gptq-4bit-g8-asym-actorder": dict(
        bits=4, group=GROUP, sym=False, act_order=True, pack=lambda p, q: gptq_tensors(p, q, "gptq"),
        files={"config.json": gptq_config(4, GROUP, False, True, "gptq"),
               "quantize_config.json": gptq_config(4, GROUP, False, True, "gptq")}),
    "gptq_v2-8bit-channel-sym": dict(
        bits=8, group=-1, sym=True, act_order=False, pack=lambda p, q: gptq_tensors(p, q, "gptq_v2"),
        files={"config.json": gptq_config(8, -1, True, False, "gptq_v2")}),
    "awq-4bit-g8": dict(
        bits=4, group=GROUP, sym=False, act_order=False, pack=awq_tensors,
        files={"config.json": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                               "version": "gemm"},
               "quant_config.json": {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}}),
    "ct-w4a16-channel-asym": dict(
        bits=4, group=-1, sym=False, act_order=False, pack=lambda p, q: ct_tensors(p, q, with_g_idx=False),
        files={"config.json": ct_config(4, None, False, None)}),
    "ct-w4a16-g8-sym-actorder": dict(
        bits=4, group=GROUP, sym=True, act_order=True, pack=lambda p, q: ct_tensors(p, q, with_g_idx=True),
        files={"config.json": ct_config(4, GROUP, True, "group")}),
}


def write_format(family: Case, folder: Path, reference: Path, spec: dict, seed: int) -> None:
    """`folder`: every linear of `family` quantized and packed under its own name; `reference`: the
    same model with the dequantized weights, dense, in the family's own layout."""
    g = torch.Generator().manual_seed(seed)
    quantized, dense = {}, {}
    for name, tensor in family.state.items():
        quantized[name] = dense[name] = tensor.half()  # what the tools store for everything left dense
    for group in family.groups:
        # The tensors of one matmul see the same inputs: one act-order permutation for all of them.
        perm = torch.randperm(family.in_features[group[0]], generator=g) if spec["act_order"] else None
        for prefix in group:
            name = f"{prefix}.weight"
            weight = family.linear_layout(prefix, family.state[name]).float()  # GPTQ/AWQ/CT store Linear's layout
            q: Quantized = quantize_rtn(weight, spec["bits"], spec["group"], spec["sym"], perm=perm)
            del quantized[name]
            quantized |= spec["pack"](prefix, q)
            dense[name] = family.stored_layout(prefix, q.dense())
    config = family.config | {"torch_dtype": "float16"}
    write_model_folder(reference, family.folder, dense, config)
    if "config.json" in spec["files"]:
        config = config | {"quantization_config": spec["files"]["config.json"]}
    write_model_folder(folder, family.folder, quantized, config)
    for file, content in spec["files"].items():
        if file != "config.json":
            (folder / file).write_text(json.dumps(content))


@pytest.fixture(scope="module")
def formats(root, families):
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(name: str, fmt: str) -> tuple[Path, Path]:
        if (name, fmt) not in cache:
            folder, reference = root / "formats" / f"{name}-{fmt}", root / "formats" / f"{name}-{fmt}.dense"
            write_format(families(name), folder, reference, FORMATS[fmt], seed=NAMES.index(name))
            cache[name, fmt] = folder, reference
        return cache[name, fmt]

    return get


FAST_KERNELS = {"cpu-int4pack", "cpu-int8"}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", NAMES)
def test_loaders_read_the_family_checkpoint_exactly(families, formats, monkeypatch, name, fmt):
    """Reference kernel: the prompt log-probs of the dense checkpoint of dequantized weights (up to
    float32 summation order). This machine's kernels: close to them, within what bf16 activations do
    to the dense model (the CPU integer kernels run their matmuls in bf16)."""
    family = families(name)
    folder, reference = formats(name, fmt)
    want = prompt_logprobs(get_model(str(reference), dtype="float32"))
    for mode in kernel_modes(monkeypatch.setenv):
        lm = get_model(str(folder), dtype="float32")
        assert lm.quantize is not None
        kernels = {m: k for m, k in kernel_names(lm).items() if m.startswith("layers.") and not m.endswith(".experts")}
        assert len(kernels) == len(family.groups) and "dense" not in kernels.values(), kernels
        got = prompt_logprobs(lm)
        if mode == "reference":
            assert set(kernels.values()) == {"reference"}, kernels
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        else:
            if fmt.startswith("ct-w4a16-channel"):
                # Per-channel 4-bit: every o_proj (out = hidden, a multiple of 16) runs the int4 kernel.
                assert set(kernels.values()) & FAST_KERNELS, kernels
            error = (got - want).abs()
            # (a mixture of experts: all but the positions where a router flips, a tenth at most)
            worst = error.quantile(0.9) if name in MOE else error.max()
            assert worst < max(0.05, 1.5 * family.bf16_error), (kernels, family.bf16_error, error)


# -- 3. two ranks ------------------------------------------------------------------------------------
# Multi-query families keep their single KV head on both ranks: a quantized fused q/k/v is loaded
# whole and its output cut. (Families whose intermediate size is 88 split it into 44 columns per rank,
# which 4-bit zero points packed 8 to a word cannot be cut at: the loader refuses those, rightly.)
WORLD_2 = {"gpt2 gptq (quantize)": ("gpt2", "gptq_v2-4bit-asym-actorder"),
           "falcon_mqa awq": ("falcon_mqa", "awq-4bit-g8"),
           "gpt_bigcode_mqa ct": ("gpt_bigcode_mqa", "ct-w4a16-g8-sym-actorder"),
           "falcon gptq": ("falcon", "gptq-4bit-g8-asym-actorder"),  # per KV group q/k/v: a group per rank
           # experts split along their intermediate size (32: 16 columns, two groups, per rank)
           "qwen3_moe ct": ("qwen3_moe", "ct-w4a16-g8-sym-actorder"),
           "gpt_oss gptq 8-bit (quantize)": ("gpt_oss", "gptq-8bit-sym")}  # (its 12-wide k/v shards need 8-bit)


@pytest.fixture(scope="module")
def world2_folders(runs, formats) -> dict[str, str]:
    out = {}
    for label, (name, variant) in WORLD_2.items():
        out[label] = str(runs(name, variant).folder if variant in QUANTIZE else formats(name, variant)[0])
    return out


@pytest.fixture(scope="module")
def world2(world2_folders, tmp_path_factory) -> list[dict]:
    return run_ranks_per_mode(world2_folders, list(WORLD_2), WORLD, tmp_path_factory.mktemp("ranks"), SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("label", list(WORLD_2))
def test_world_size_2_matches_world_size_1(world2_folders, world2, monkeypatch, label):
    assert_ranks_match_one_process(world2, label, world2_folders[label], monkeypatch)
