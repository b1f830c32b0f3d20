"""Checkpoint loading: broken folders, sharded files, pickle conversion, and the Weights sharding API.

A user pointing the server at a half-downloaded or hand-edited folder must be
told which file and which tensor or key to fix, so every bad-checkpoint case
checks the message, not only the exception type.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from safetensors.torch import load_file, save_file

from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.jobs.convert import convert_folder
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import DefaultWeightsLoader, Weights

torch.set_num_threads(1)

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    write_checkpoint(folder, "llama", seed=31)
    return folder


def prompt_logprobs(folder: Path) -> torch.Tensor:
    lm = get_model(str(folder), dtype="float32")
    done = lm.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=4, prefill_logprobs=True,
                                          ignore_eos_token=True)])[0]
    return torch.tensor(done.steps[0].prefill_tokens.logprobs[1:] + [float(t) for t in done.token_ids])


def edit_tensors(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _only_bin(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")


def _index_missing_file(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _duplicate_tensor(folder: Path) -> None:
    save_file({"model.norm.weight": torch.ones(48)}, str(folder / "extra.safetensors"))


def _del(key: str):
    return lambda tensors: tensors.pop(key)


def _cut(key: str, rows: int | None = None, cols: int | None = None):
    def change(tensors):
        t = tensors[key]
        tensors[key] = t[: rows or t.shape[0], : cols or t.shape[1]] if t.dim() == 2 else t[:rows]
    return change


# case -> (how to break the folder, substrings the message must hold; "{folder}" is the folder path)
BAD = {
    "missing tensor": (lambda f: edit_tensors(f, _del("model.layers.1.mlp.up_proj.weight")),
                       ["model.layers.1.mlp.up_proj.weight", "{folder}/model.safetensors"]),
    "missing lm_head": (lambda f: edit_tensors(f, _del("lm_head.weight")), ["lm_head.weight", "tie_word_embeddings"]),
    "q_proj in-features": (lambda f: edit_tensors(f, _cut("model.layers.0.self_attn.q_proj.weight", cols=40)),
                           ["model.layers.0.self_attn.q_proj.weight", "[48, 40]", "{folder}/model.safetensors"]),
    "k_proj rows": (lambda f: edit_tensors(f, _cut("model.layers.1.self_attn.k_proj.weight", rows=20)),
                    ["model.layers.1.self_attn.k_proj", "{folder}/model.safetensors"]),
    "down_proj in-features": (lambda f: edit_tensors(f, _cut("model.layers.1.mlp.down_proj.weight", cols=80)),
                              ["model.layers.1.mlp.down_proj", "{folder}/model.safetensors"]),
    "norm shape": (lambda f: edit_tensors(f, _cut("model.norm.weight", rows=40)),
                   ["model.norm.weight", "[40]", "{folder}/model.safetensors"]),
    "embedding rows": (lambda f: edit_tensors(f, _cut("model.embed_tokens.weight", rows=299)),
                       ["model.embed_tokens.weight", "[299, 48]", "{folder}/model.safetensors"]),
    "unknown model_type": (lambda f: edit_config(f, lambda c: c.update(model_type="mamba")),
                           ["{folder}/config.json", "model_type 'mamba'"]),
    "missing config key": (lambda f: edit_config(f, lambda c: c.pop("intermediate_size")),
                           ["{folder}/config.json", "'intermediate_size'"]),
    "unsupported rope": (lambda f: edit_config(f, lambda c: c.update(rope_parameters={"rope_type": "proportional"})),
                         ["{folder}/config.json", "'proportional'"]),
    "rope without its factor": (lambda f: edit_config(f, lambda c: c.update(rope_parameters={"rope_type": "dynamic"})),
                                ["{folder}/config.json", "'dynamic'", "factor"]),
    "unknown activation": (lambda f: edit_config(f, lambda c: c.update(hidden_act="mish")),
                           ["{folder}/config.json", "hidden_act", "'mish'"]),
    "no config.json": (lambda f: (f / "config.json").unlink(), ["{folder}/config.json", "missing"]),
    "config not json": (lambda f: (f / "config.json").write_text("{oops"), ["{folder}/config.json", "not valid JSON"]),
    "truncated safetensors": (_truncate, ["{folder}/model.safetensors"]),
    "missing tokenizer": (lambda f: (f / "tokenizer.json").unlink(), ["{folder}/tokenizer.json", "missing"]),
    "corrupt tokenizer": (lambda f: (f / "tokenizer.json").write_text('{"model": 3}'),
                          ["{folder}/tokenizer.json", "cannot be loaded"]),
    "only .bin files": (_only_bin, ["pytorch_model.bin", "text-generation-server convert {folder}"]),
    "index names a missing file": (_index_missing_file,
                                   ["{folder}/model.safetensors.index.json", "model-00002-of-00002.safetensors"]),
    "tensor in two files": (_duplicate_tensor, ["model.norm.weight", "extra.safetensors", "model.safetensors"]),
    "bad eos id": (lambda f: (f / "generation_config.json").write_text('{"eos_token_id": 5000}'),
                   ["eos_token_id", "5000"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_names_file_and_key(base, tmp_path, case):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    breaker, needles = BAD[case]
    breaker(folder)
    with pytest.raises(CheckpointError) as info:
        get_model(str(folder))
    message = str(info.value)
    for needle in needles:
        assert needle.format(folder=folder) in message, message


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="never downloaded"):
        get_model(str(tmp_path / "nowhere"))


def test_sharded_checkpoint_equals_single_file(base, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(base, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = [f"model-0000{i + 1}-of-00003.safetensors" for i in range(3)]
    weight_map = {}
    for i, file in enumerate(files):
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A stray file the index does not name is ignored.
    save_file({"unused": torch.zeros(1)}, str(folder / "leftover.safetensors"))
    assert torch.equal(prompt_logprobs(folder), prompt_logprobs(base))


def _bin_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A tied-embedding model as safetensors (the reference) and as one pytorch_model.bin."""
    reference = tmp_path / "reference"
    model = write_checkpoint(reference, "llama_linear_rope_tied", seed=33)
    state = model.state_dict()
    # torch.save keeps the tie: one storage under two names, which safetensors refuses.
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(reference / name, folder / name)
    torch.save(state, folder / "pytorch_model.bin")
    return reference, folder


def test_convert_pickle_with_tied_weights(tmp_path):
    reference, folder = _bin_folder(tmp_path)
    with pytest.raises(CheckpointError, match="convert"):
        get_model(str(folder))
    written = convert_folder(folder, folder, max_shard_bytes=1 << 30)
    assert written == [folder / "model.safetensors"]
    assert torch.equal(prompt_logprobs(folder), prompt_logprobs(reference))
    # Converting again would overwrite: refused.
    with pytest.raises(CheckpointError, match="already has safetensors"):
        convert_folder(folder, folder, max_shard_bytes=1 << 30)


def test_convert_into_shards(tmp_path):
    reference, folder = _bin_folder(tmp_path)
    out = tmp_path / "out"
    written = convert_folder(folder, out, max_shard_bytes=40_000)
    shards = [p for p in written if p.suffix == ".safetensors"]
    assert len(shards) >= 2 and (out / "model.safetensors.index.json") in written
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(folder / name, out / name)
    assert torch.equal(prompt_logprobs(out), prompt_logprobs(reference))


class NotATensor:
    """Pickled by reference: a weights_only unpickler must refuse to rebuild it."""

    def __init__(self):
        self.payload = "anything"


@pytest.mark.parametrize(
    "extra, message",
    [(NotATensor(), "weights_only=True"), (7, "does not hold a flat dict of tensors")],
)
def test_convert_refuses_pickles_with_other_objects(tmp_path, extra, message):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(2, 2), "extra": extra}, path)
    with pytest.raises(CheckpointError, match=message) as info:
        convert_folder(tmp_path, tmp_path, max_shard_bytes=1 << 30)
    assert str(path) in str(info.value)
    assert not list(tmp_path.glob("*.safetensors"))


def test_convert_needs_pickle_files(tmp_path):
    with pytest.raises(CheckpointError, match="no .bin or .pt"):
        convert_folder(tmp_path, tmp_path, max_shard_bytes=1 << 30)


# -- Weights over an in-memory source ---------------------------------------------

class RecordingLoader(DefaultWeightsLoader):
    def __init__(self):
        self.seen: list[str] = []

    def get_weights_col_packed(self, weights, prefix, block_sizes):
        self.seen.append(prefix)
        return super().get_weights_col_packed(weights, prefix, block_sizes)


def weights_at(tensors: dict[str, torch.Tensor], rank: int, world: int, **kw) -> Weights:
    return Weights(DictTensorSource(tensors, name="memory.safetensors"), torch.device("cpu"), torch.float32,
                   ProcessGroup(rank=rank, size=world), **kw)


def test_use_loader_swaps_only_inside_the_block():
    tensors = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(4, 3)}
    weights = weights_at(tensors, 0, 1)
    default = weights.loader
    other = RecordingLoader()
    with weights.use_loader(other):
        assert weights.loader is other
        weights.get_weights_col("a")
    assert weights.loader is default
    weights.get_weights_col("b")
    assert other.seen == ["a"]
    with pytest.raises(RuntimeError, match="boom"):
        with weights.use_loader(other):
            raise RuntimeError("boom")
    assert weights.loader is default


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharding_reassembles_the_full_tensor(world):
    g = torch.Generator().manual_seed(world)
    full = torch.randn(8, 12, generator=g)
    odd = torch.randn(10, 3, generator=g)  # 10 rows: ceil blocks 3,3,3,1 at world 4
    packed = torch.randn(16, 6, generator=g)  # parts q 8 | k 4 | v 4
    gate_up = torch.randn(8, 6, generator=g)  # two equal parts
    parts = {"q.weight": torch.randn(8, 8, generator=g), "k.weight": torch.randn(4, 8, generator=g)}
    tensors = {"full": full, "odd": odd, "qkv": packed, "gate_up": gate_up, **parts}
    ranks = [weights_at(tensors, r, world) for r in range(world)]

    assert torch.equal(torch.cat([w.get_sharded("full", dim=0) for w in ranks], dim=0), full)
    assert torch.equal(torch.cat([w.get_sharded("full", dim=1) for w in ranks], dim=1), full)
    assert torch.equal(torch.cat([w.get_partial_sharded("odd", dim=0) for w in ranks], dim=0), odd)

    shards = [w.get_packed_sharded("qkv", dim=0, block_sizes=[8, 4, 4]) for w in ranks]
    q, k, v = 8 // world, 4 // world, 4 // world
    assert all(s.shape == (q + k + v, 6) for s in shards)
    rebuilt = torch.cat([torch.cat([s[:q] for s in shards]), torch.cat([s[q:q + k] for s in shards]),
                         torch.cat([s[q + k:] for s in shards])])
    assert torch.equal(rebuilt, packed)
    halves = [w.get_packed_sharded("gate_up", dim=0, block_sizes=2) for w in ranks]
    h = 4 // world
    assert torch.equal(torch.cat([s[:h] for s in halves] + [s[h:] for s in halves]), gate_up)

    # Through the loader: fused q+k and row-parallel weights.
    multi = [w.get_multi_weights_col(["q", "k"]).weight for w in ranks]
    assert torch.equal(torch.cat([m[: 8 // world] for m in multi]), parts["q.weight"])
    assert torch.equal(torch.cat([m[8 // world:] for m in multi]), parts["k.weight"])
    assert torch.equal(torch.cat([w.get_weights_row("q").weight for w in ranks], dim=1), parts["q.weight"])


def test_non_divisible_shapes_name_the_tensor():
    tensors = {"layer.odd": torch.zeros(10, 3), "fused": torch.zeros(12, 2)}
    w4 = weights_at(tensors, 1, 4)
    with pytest.raises(CheckpointError, match=r"'layer.odd' has 10 entries along dim 0.*4 shards"):
        w4.get_sharded("layer.odd", dim=0)
    with pytest.raises(CheckpointError, match=r"'layer.odd'.*no dimension 2"):
        w4.get_sharded("layer.odd", dim=2)
    w2 = weights_at(tensors, 0, 2)
    with pytest.raises(CheckpointError, match=r"'fused': a fused part of 3 entries"):
        w2.get_packed_sharded("fused", dim=0, block_sizes=[6, 3, 3])
    with pytest.raises(CheckpointError, match=r"'fused' has 12 entries along dim 0, expected 10"):
        w2.get_packed_sharded("fused", dim=0, block_sizes=[6, 2, 2])
    with pytest.raises(CheckpointError, match=r"'fused' dim 0 \(12\) does not split into 5 parts"):
        w2.get_packed_sharded("fused", dim=0, block_sizes=5)
    with pytest.raises(CheckpointError, match=r"'nothing' not found.*memory.safetensors"):
        w2.get_tensor("nothing")


def test_dtypes_and_aliases():
    tensors = {"f": torch.randn(2, 2), "packed": torch.tensor([[1, 2]], dtype=torch.int32)}
    weights = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.bfloat16,
                      aliases={"lm_head.weight": ["f"]})
    assert weights.get_tensor("f").dtype == torch.bfloat16
    assert weights.get_tensor("f", to_dtype=False).dtype == torch.float32
    assert weights.get_tensor("packed").dtype == torch.int32  # integer data is never cast
    assert weights.has_tensor("lm_head.weight")
    assert torch.equal(weights.get_tensor("lm_head.weight"), tensors["f"].to(torch.bfloat16))


def test_zero_dim_tensors_from_a_safetensors_file(tmp_path):
    """AutoFP8's per-tensor scales and bitsandbytes' weight_format are stored 0-dim: `[:]` cannot read them."""
    path = tmp_path / "model.safetensors"
    save_file({"scale": torch.tensor(0.25), "fmt": torch.tensor(0, dtype=torch.uint8),
               "fp8": torch.tensor(1.5).to(torch.float8_e4m3fn), "w": torch.arange(6.0).reshape(2, 3)}, str(path))
    weights = Weights([path], torch.device("cpu"), torch.bfloat16, ProcessGroup(rank=1, size=2),
                      aliases={"layer.input_scale": ["scale"]})
    scale = weights.get_tensor("layer.input_scale")
    assert scale.shape == () and scale.dtype == torch.bfloat16 and scale.item() == 0.25
    assert weights.get_tensor("scale", to_dtype=False).dtype == torch.float32
    fmt = weights.get_tensor("fmt")
    assert fmt.shape == () and fmt.dtype == torch.uint8 and fmt.item() == 0
    assert weights.get_tensor("fp8").dtype == torch.float8_e4m3fn and weights.get_tensor("fp8").float().item() == 1.5
    assert torch.equal(weights.get_tensor("w", to_dtype=False), torch.arange(6.0).reshape(2, 3))
    # Sharding a scalar is a clear error naming the tensor and the file, whichever sharding call asks.
    for shard in (lambda: weights.get_sharded("scale", dim=0), lambda: weights.get_partial_sharded("scale", dim=0),
                  lambda: weights.get_packed_sharded("scale", dim=0, block_sizes=2)):
        with pytest.raises(CheckpointError, match=r"'scale' has shape \[\]: no dimension 0 .*model\.safetensors"):
            shard()


@pytest.mark.parametrize("on_disk", [False, True])
def test_get_slice_reads_a_window(tmp_path, on_disk):
    g = torch.Generator().manual_seed(5)
    tensors = {"packed": torch.randint(-2**31, 2**31 - 1, (6, 8), dtype=torch.int32, generator=g),
               "s": torch.randn(3, 8, generator=g), "flat": torch.arange(10, dtype=torch.uint8),
               "scalar": torch.tensor(2.0)}
    if on_disk:
        save_file(tensors, str(tmp_path / "model.safetensors"))
        source = [tmp_path / "model.safetensors"]
        where = "model.safetensors"
    else:
        source = DictTensorSource(tensors, name="memory.safetensors")
        where = "memory.safetensors"
    weights = Weights(source, torch.device("cpu"), torch.bfloat16, aliases={"layer.B": ["packed"]})

    window = weights.get_slice("layer.B", (slice(2, 4), slice(1, 7)))  # alias resolved
    assert torch.equal(window, tensors["packed"][2:4, 1:7]) and window.dtype == torch.int32
    assert torch.equal(weights.get_slice("packed", slice(4, None)), tensors["packed"][4:])
    assert torch.equal(weights.get_slice("packed", (..., slice(6, 8))), tensors["packed"][:, 6:8])
    assert torch.equal(weights.get_slice("packed", -1), tensors["packed"][-1])
    assert torch.equal(weights.get_slice("flat", slice(3, 10)), tensors["flat"][3:])
    s = weights.get_slice("s", (slice(1, 2), slice(None)))
    assert s.dtype == torch.float32 and torch.equal(s, tensors["s"][1:2])  # no cast unless asked
    cast = weights.get_slice("s", (slice(1, 2), slice(0, 4)), to_dtype=True)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, tensors["s"][1:2, :4].to(torch.bfloat16))
    assert weights.get_slice("scalar", ...).item() == 2.0

    # Python would clip these to a shorter window; a checkpoint read must refuse instead.
    bad = [((slice(4, 7), slice(None)), r"window \[4:7, :\] reaches past dimension 0 \(size 6\)"),
           ((slice(0, 1), slice(0, 9)), r"window \[0:1, 0:9\] reaches past dimension 1 \(size 8\)"),
           ((6,), r"window \[6\] reaches past dimension 0"),
           ((0, 0, 0), r"window \[0, 0, 0\] indexes 3 dimensions")]
    for index, message in bad:
        with pytest.raises(CheckpointError, match=rf"tensor 'packed' \(in .*{where}\) has shape \[6, 8\]: {message}"):
            weights.get_slice("layer.B", index)
    with pytest.raises(CheckpointError, match=r"'missing' not found"):
        weights.get_slice("missing", slice(0, 1))
    with pytest.raises(TypeError, match="ints, slices or"):
        weights.get_slice("packed", [0, 1])
