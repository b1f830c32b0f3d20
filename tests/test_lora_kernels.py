"""The LoRA term's kernels and slots, on the CPU.

- The segmented torch path (runs of rows per adapter, each slot's own width), the all-slots path
  (one GEMM each way, other slots masked), the per-row torch path and the Triton kernels (under TRITON_INTERPRET=1) give the same sums for any mix of slots,
  base rows included, on every activation dtype.
- Slots are preallocated: loading, unloading and loading again writes into the same tensors
  (a CUDA graph keeps their pointers); a lower rank in a slot leaves the rest zero.
- Decode graphs (EagerReplayCapturer: the replay must issue the capture's operators, no host
  sync) replay with adapters in the batch and give the eager tokens, whatever adapters the rows use.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ids_request, needs_gpu, random_ids, run_to_end, write_checkpoint

from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
from text_generation_server.kernels.lora import lora_all_slots_torch, lora_rows_torch, lora_runs_torch, runs_of
from text_generation_server.kernels.lora_triton import lora_rows_triton
from text_generation_server.layers.attention import TorchAttention, padded_decode
from text_generation_server.models.adapters import enable_lora
from text_generation_server.models.loader import get_model

torch.set_num_threads(1)


def banks(slots: int, width: int, k: int, n: int, widths: list[int], dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, width, k, generator=g)
    b = torch.randn(slots, width, n, generator=g)  # B transposed, as the slots hold it
    for s, w in enumerate(widths):  # a slot's width past its rank is zero, as AdapterSlots writes it
        a[s, w:] = 0
        b[s, w:] = 0
    return a.to(dtype), b.to(dtype)


SLOTS = [0, -1, 2, 2, 1, -1, 3]  # per request (2 twice in a row: one run)
COUNTS = [3, 2, 1, 4, 1, 2, 5]


def test_runs_of_merges_neighbours_and_skips_the_base():
    assert runs_of(SLOTS, COUNTS) == [(0, 0, 3), (2, 5, 10), (1, 10, 11), (3, 13, 18)]
    assert runs_of([-1, -1], [4, 1]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_and_per_row_paths_agree(dtype):
    k, n, widths = 40, 24, [8, 3, 0, 5]
    a, b = banks(4, 8, k, n, widths, dtype)
    rows = sum(COUNTS)
    x = torch.randn(rows, k).to(dtype)
    base = torch.randn(rows, n).to(dtype)
    per_row = torch.tensor([s for s, c in zip(SLOTS, COUNTS) for _ in range(c)], dtype=torch.int32)
    want = base.double().clone()
    for r in range(rows):
        s = int(per_row[r])
        if s >= 0:
            want[r] += b[s].double().t() @ (a[s].double() @ x[r].double())
    seg = lora_runs_torch(x, base.clone(), a, b, runs_of(SLOTS, COUNTS), widths)
    row = lora_rows_torch(x, base.clone(), a, b, per_row)
    every = lora_all_slots_torch(x, base.clone(), a, b, per_row.long())
    tol = 1e-4 if dtype == torch.float32 else 0.15
    for got in (seg, row, every):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 24, 8), (130, 300, 48)])  # K and N past one block, W not a power of 2
def test_triton_kernels_equal_torch_under_the_interpreter(monkeypatch, dtype, shape):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k, n, width = shape
    a, b = banks(4, width, k, n, [width, 3, 0, width // 2], dtype, seed=3)
    rows = sum(COUNTS)
    x = torch.randn(rows, k).to(dtype)
    base = torch.randn(rows, n).to(dtype)
    per_row = torch.tensor([s for s, c in zip(SLOTS, COUNTS) for _ in range(c)], dtype=torch.int32)
    want = lora_rows_torch(x.float(), base.float().clone(), a.float(), b.float(), per_row)
    got = lora_rows_triton(x, base.clone(), a, b, per_row)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-4, torch.float16: 0.05, torch.bfloat16: 0.3}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0.02)
    base_rows = per_row < 0
    assert torch.equal(got[base_rows], base[base_rows])  # the base model's rows are untouched
    with pytest.raises(ValueError, match="row_slots must be int32"):
        lora_rows_triton(x, base.clone(), a, b, per_row.long())


# -- slots and graphs on a real (tiny) model -------------------------------------------------------
peft = pytest.importorskip("peft")


class GraphSafePadded(TorchAttention):
    """torch's padded decode: shapes from max_seq_len and the batch size only (graph-safe)."""

    name = "torch-padded"
    graph_safe = True

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
        return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)

    def capture_memo(self, batch: int, max_seq_len: int, device: torch.device) -> dict:
        return {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_graphs")
    hf = write_checkpoint(root / "base", "llama")
    folders = {}
    for i, (targets, r) in enumerate([(["q_proj", "v_proj", "o_proj"], 4), (["gate_proj", "down_proj"], 8),
                                      (["k_proj", "up_proj"], 2)]):
        pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(target_modules=targets, r=r, lora_alpha=8))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        pm.save_pretrained(root / f"a{i}")
        folders[f"a{i}"] = str(root / f"a{i}")
    return str(root / "base"), folders


def test_slots_keep_their_tensors_across_loads(model):
    base, folders = model
    lm = get_model(base, dtype="float32")
    slots = enable_lora(lm, 2, 8)
    pointers = [(h.a.data_ptr(), h.b.data_ptr()) for h in slots.linears]
    first = slots.load("x", folders["a0"])
    hook = slots.by_tensor["model.layers.0.self_attn.q_proj"]
    assert hook.widths[first.slot] == 8  # q and v, rank 4 each, side by side (k's block empty)
    assert hook.a[first.slot, 8:].abs().sum() == 0 and hook.b[first.slot, 8:].abs().sum() == 0
    slots.unload("x")
    assert all(h.a.abs().sum() == 0 and h.b.abs().sum() == 0 for h in slots.linears)
    slots.load("y", folders["a1"])
    slots.load("x", folders["a2"])
    assert [(h.a.data_ptr(), h.b.data_ptr()) for h in slots.linears] == pointers
    assert lm.adapters.nbytes == sum(h.a.numel() + h.b.numel() for h in slots.linears) * 4


def _scenario(lm) -> dict:
    """Rows of three adapters and the base joining and leaving a decoding batch."""
    rows = [("a0", 5), (None, 7), ("a1", 4), ("a2", 9), ("a0", 3), (None, 5)]
    batch = lm.make_batch(0, [ids_request(i, random_ids(n, seed=i % 5), 10, adapter_id=a)
                              for i, (a, n) in enumerate(rows)])
    out = run_to_end(lm, batch)
    assert out[0]["ids"] != out[5]["ids"]  # one prompt, with a0 and without: the adapter is applied
    return out


def test_decode_graphs_replay_with_adapters_in_the_batch(model):
    base, folders = model

    def load(**kw):
        lm = get_model(base, dtype="float32", block_size=4, **kw)
        lm.attention = GraphSafePadded(lm.attention.spec)
        enable_lora(lm, 4, 8)
        for name, folder in folders.items():
            lm.adapters.load(name, folder)
        lm.allocate_kv_cache(160)
        return lm

    eager = _scenario(load())
    lm = load(cuda_graphs=[2, 4, 8], graph_capturer=EagerReplayCapturer())
    slots = lm.adapters.routing.decode_slots
    lm.capture_decode_graphs(48)
    assert lm.adapters.routing.decode_slots is slots and slots.shape == (8,)
    got = _scenario(lm)
    assert sum(lm.graphs.stats.replays.values()) > 0 and not lm.graphs.stats.eager
    assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in eager.items()}
    # Launch ahead (on by default on CUDA): a launched step routes its rows' adapters itself.
    lm.launch_ahead = True
    got = _scenario(lm)
    assert lm.launched_taken > 0 and not lm.graphs.stats.eager
    assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in eager.items()}


@needs_gpu
def test_cuda_kernels_and_graphs(model):
    """On a GPU: the compiled Triton kernels equal torch, and captured decode graphs (real CUDA
    graphs) give the eager tokens with adapters in the batch."""
    k, n, width = 130, 300, 48
    a, b = banks(4, width, k, n, [width, 3, 0, width // 2], torch.bfloat16, seed=3)
    per_row = torch.tensor([s for s, c in zip(SLOTS, COUNTS) for _ in range(c)], dtype=torch.int32)
    x, base = torch.randn(per_row.shape[0], k).bfloat16(), torch.randn(per_row.shape[0], n).bfloat16()
    want = lora_rows_torch(x.float(), base.float().clone(), a.float(), b.float(), per_row)
    got = lora_rows_triton(x.cuda(), base.cuda().clone(), a.cuda(), b.cuda(), per_row.cuda())
    torch.testing.assert_close(got.float().cpu(), want, atol=0.3, rtol=0.02)
    base_dir, folders = model

    def load(**kw):
        lm = get_model(base_dir, dtype="float32", device=torch.device("cuda"), **kw)
        enable_lora(lm, 4, 8)
        for name, folder in folders.items():
            lm.adapters.load(name, folder)
        lm.allocate_kv_cache(160)
        return lm

    eager = _scenario(load())
    lm = load(cuda_graphs=[2, 4, 8])
    lm.capture_decode_graphs(48)
    got_tokens = _scenario(lm)
    assert sum(lm.graphs.stats.replays.values()) > 0
    assert {r: v["ids"] for r, v in got_tokens.items()} == {r: v["ids"] for r, v in eager.items()}


def test_routing_picks_a_path_per_forward():
    from text_generation_server.layers.lora import LoraRouting

    cpu = LoraRouting(torch.device("cpu"), decode_capacity=4, slots=8)
    cpu.route([-1, -1], [5, 1])
    assert not cpu.active  # no adapter row: the hooks add nothing, at no cost
    cpu.route([0, 1, 2, 3, -1], [1] * 5)  # decode rows of 4 of 8 adapters: one GEMM each way
    assert cpu.active and not cpu.use_rows and cpu.all_slots.tolist() == [0, 1, 2, 3, -1]
    cpu.route([0, 0, 1], [30, 1, 1])  # a prompt, or few adapters: runs
    assert cpu.all_slots is None and cpu.runs == [(0, 0, 31), (1, 31, 32)]
    cpu.route([2, -1], [1, 1], graph=True)  # a graph may replay: the fixed per-row buffer, padded
    assert cpu.use_rows and cpu.rows_slots is cpu.decode_slots and cpu.decode_slots.tolist() == [2, -1, -1, -1]
    cpu.route([2, -1, 1, 0, 3], [1] * 5, graph=True)  # more rows than any graph: a buffer of its own
    assert cpu.rows_slots is not cpu.decode_slots and cpu.rows_slots.tolist() == [2, -1, 1, 0, 3]
