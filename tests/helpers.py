"""Test-side builders and runners shared by the test files.

- small random checkpoints and tokenizers, written to disk: transformers is used here
  (test time only) to create reference models and to save them in the exact Hugging
  Face layout our loader reads;
- what the end-to-end tests ask of a loaded model (prompt log-probs, greedy tokens,
  the kernel each linear runs) and the kernel modes they compare;
- world size N: gloo ranks in spawned processes (`run_ranks`, `rank_process_group`);
- the loader matrix: one tensor loaded whole, by columns, fused or by rows, and the
  shards put back together.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from text_generation_server.launcher.shard_procs import free_port

SAMPLE_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé: 日本語 テキスト 😀 — ok.",
    "import os\nimport sys\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n",
]


def build_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE tokenizer with <|endoftext|> as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE_TEXT * 20, trainer=trainer)
    return tok


ARCH_CONFIGS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama3_rope": dict(
        model_type="llama",
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    ),
    "llama_linear_rope_tied": dict(
        model_type="llama", num_attention_heads=3, num_key_value_heads=3,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True,
    ),
    "mistral_window": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=7),
    "qwen2_bias": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=3),
    "phi3_fused": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2),
}


def hf_config(name: str, vocab_size: int, **overrides):
    import transformers

    spec = dict(ARCH_CONFIGS[name])
    model_type = spec.pop("model_type")
    base = dict(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=0, pad_token_id=0,
    )
    base.update(spec)
    base.update(overrides)
    if model_type == "phi3":
        base.setdefault("sliding_window", None)
    cls = transformers.AutoConfig.for_model(model_type, **base)
    return cls


def write_checkpoint(folder: Path, name: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """Writes a random model of architecture `name` and a tokenizer; returns the HF model."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = hf_config(name, tokenizer.get_vocab_size(), **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen weights so tests see real differences between positions.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return model


PT = {"format": "pt"}  # the safetensors metadata torch-side tools write


def write_model_folder(folder: Path, original: Path, tensors: dict[str, torch.Tensor], config: dict,
                       metadata: dict[str, str] | None = PT) -> Path:
    """A new checkpoint folder: `tensors`, `config` as config.json, and the tokenizer and generation config
    of the checkpoint in `original`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for extra in ("tokenizer.json", "generation_config.json"):
        shutil.copy(original / extra, folder / extra)
    save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- end to end: what the tests ask of a loaded model ------------------------------------------------
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)", "import os\nimport sys"]


def prompt_logprobs(lm) -> torch.Tensor:
    """log p(token_i | prefix) of every prompt token after the first, all prompts concatenated."""
    from text_generation_server.engine.types import GenerationRequest

    requests = [GenerationRequest(id=i, inputs=p, max_new_tokens=1, prefill_logprobs=True, ignore_eos_token=True)
                for i, p in enumerate(PROMPTS)]
    lm.allocate_kv_cache(16)  # generate() sizes a cache for its first call only
    return torch.cat([torch.tensor(done.steps[0].prefill_tokens.logprobs[1:]) for done in lm.generate(requests)])


def greedy(lm, tokens: int = 8) -> list[list[int]]:
    from text_generation_server.engine.types import GenerationRequest

    requests = [GenerationRequest(id=i, inputs=p, max_new_tokens=tokens, ignore_eos_token=True)
                for i, p in enumerate(PROMPTS)]
    lm.allocate_kv_cache(16)
    return [done.token_ids for done in lm.generate(requests)]


def kernel_names(lm) -> dict[str, str]:
    """module name -> the kernel its linear runs."""
    modules = lm.model.named_modules()
    return {name: m.kernel_name for name, m in modules if isinstance(getattr(m, "kernel_name", None), str)}


def kernels_used(lm) -> set[str]:
    return set(kernel_names(lm).values())


def fast_kernels(*extra: str) -> str:
    """Every CPU kernel of quantized weights but the reference (and `extra`), as TGS_DISABLE_KERNELS
    wants them to leave only the reference."""
    from text_generation_server.kernels.table import CPU

    return ",".join([k.name for k in CPU if k.family == "quantized" and k.name != "reference"] + list(extra))


def assert_bfloat16_close(lm, reference: Path | str, atol: float = 0.1) -> None:
    """`lm`, loaded with bfloat16 activations, gives finite prompt log-probs within `atol` of those of the dense
    float32 checkpoint `reference` (its weights dequantized)."""
    from text_generation_server.models.loader import get_model

    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(reference), dtype="float32"))
    assert torch.isfinite(got).all(), got
    assert (got - want).abs().max() < atol, kernel_names(lm)


# Two ranks against one process: float32 summation order on the reference kernel, bf16 activations on the
# chosen kernels.
MODE_ATOL = {"reference": 1e-4, "chosen": 0.05}


def kernel_modes(setenv: Callable[[str, str], None] = os.environ.__setitem__, extra: tuple[str, ...] = ()
                 ) -> Iterator[str]:
    """Yields "reference" after disabling every fast CPU kernel (`fast_kernels(*extra)`), then "chosen" after
    disabling none; `setenv` sets TGS_DISABLE_KERNELS (monkeypatch.setenv in a test, os.environ in a rank)."""
    from text_generation_server.kernels.select import DISABLE_ENV

    for mode in MODE_ATOL:
        setenv(DISABLE_ENV, fast_kernels(*extra) if mode == "reference" else "")
        yield mode


def _logprobs_and_tokens_per_mode(pg, folders: dict[str, str], tokens: int) -> dict:
    """A rank's work in `run_ranks_per_mode`."""
    from text_generation_server.models.loader import get_model

    results = {}
    for mode in kernel_modes():
        for name, folder in folders.items():
            lm = get_model(folder, dtype="float32", process_group=pg)
            results[mode, name] = {"logprobs": prompt_logprobs(lm), "tokens": greedy(lm, tokens)}
    return results


def run_ranks_per_mode(folders: dict, names, world: int, out_dir: Path | str, timeout_s: float, tokens: int = 8
                       ) -> list[dict]:
    """Each rank's prompt log-probs and greedy tokens of the checkpoints `folders[name]` for `names`, per kernel
    mode: {(mode, name): {"logprobs": ..., "tokens": ...}}, in rank order."""
    paths = {name: str(folders[name]) for name in names}
    return run_ranks(_logprobs_and_tokens_per_mode, (paths, tokens), world, out_dir, timeout_s)


def assert_ranks_match_one_process(ranks: list[dict], name: str, folder: str, monkeypatch, tokens: int = 8) -> None:
    """What `run_ranks_per_mode` gave on each rank equals one process: the same greedy tokens on the
    reference kernel, log-probs within MODE_ATOL."""
    from text_generation_server.models.loader import get_model

    for mode in kernel_modes(monkeypatch.setenv):
        lm = get_model(folder, dtype="float32")
        want_logprobs, want_tokens = prompt_logprobs(lm), greedy(lm, tokens)
        for rank in ranks:
            got = rank[mode, name]
            if mode == "reference":
                assert got["tokens"] == want_tokens, (mode, got["tokens"], want_tokens)
            assert math.isfinite(got["logprobs"].sum().item()), (mode, got["logprobs"])
            torch.testing.assert_close(got["logprobs"], want_logprobs, atol=MODE_ATOL[mode], rtol=0)


# -- world size N: gloo ranks in spawned processes ---------------------------------------------------
# Each collective's bound. On a 2-core machine running other jobs beside the suite, one rank loading a
# model ran more than 60 s behind its peer, which then timed out in the forward's first all_reduce
# (gloo "Timed out waiting 60000ms for recv"): 8 world-size-2 tests failed at once. A hung collective
# still fails the test, later; run_ranks' own timeout_s bounds the whole run.
GROUP_TIMEOUT_S = 180.0
@contextmanager
def rank_process_group(rank: int, port: int, world: int, timeout_s: float = GROUP_TIMEOUT_S):
    """In a spawned rank: one torch thread, the gloo group on 127.0.0.1:`port` (yielded), destroyed on exit."""
    from text_generation_server.quantizers.dist import initialize_process_group

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    pg = initialize_process_group(rank, world, torch.device("cpu"), timeout_s=timeout_s)
    try:
        yield pg
        # Every rank done before any tears its connections down: a rank that destroyed its group while
        # its peer was still finishing aborted at exit in CI now and then ("terminate called without an
        # active exception", the two-rank fixture of test_transformers_fallback.py).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, target: Callable, args: tuple, world: int, port: int, out_dir: str,
                group_timeout_s: float) -> None:
    with rank_process_group(rank, port, world, group_timeout_s) as pg:
        torch.save(target(pg, *args), Path(out_dir) / f"rank{rank}.pt")


def run_ranks(target: Callable, args: tuple, world: int, out_dir: Path | str, timeout_s: float,
              group_timeout_s: float = GROUP_TIMEOUT_S) -> list:
    """Runs `target(pg, *args)` in `world` spawned gloo ranks and returns what each rank returned, in rank
    order (saved as out_dir/rank{r}.pt). `target` must be a module-level function (the ranks unpickle it).
    Past `timeout_s` the ranks are killed and the test fails; `group_timeout_s` bounds each collective."""
    ctx = mp.spawn(_rank_entry, args=(target, args, world, free_port(), str(out_dir), group_timeout_s),
                   nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"the {world} gloo ranks did not finish within {timeout_s} s")
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


# -- the loader matrix: "m.qkv" (and its parts "m.q", "m.k", ...) loaded every way a layer asks --------
METHODS = ["full", "col", "col_packed", "multi_col", "row"]


def load_qkv(weights, method: str, parts: dict[str, int]):
    """The typed weight that `method` loads from `weights`: whole, by output columns, by columns of each part
    (col_packed: of the fused tensor; multi_col: of the separate part tensors, fused) or by input rows."""
    if method == "full":
        return weights.get_weights("m.qkv")
    if method == "col":
        return weights.get_weights_col("m.qkv")
    if method == "col_packed":
        return weights.get_weights_col_packed("m.qkv", list(parts.values()))
    if method == "multi_col":
        return weights.get_multi_weights_col([f"m.{p}" for p in parts], dim=0)
    return weights.get_weights_row("m.qkv")


def join_shards(method: str, shards: list[torch.Tensor], parts: dict[str, int]) -> torch.Tensor:
    """The ranks' dense shards put back together (full: rank 0's)."""
    if method == "full":
        return shards[0]
    if method == "col":
        return torch.cat(shards)
    if method == "row":
        return torch.cat(shards, dim=1)
    local = [n // len(shards) for n in parts.values()]  # fused: each rank holds its share of every part, in order
    return torch.cat([torch.cat([s.split(local)[i] for s in shards]) for i in range(len(parts))])


def qkv_of(method: str, dense: dict[str, torch.Tensor], parts: dict[str, int]) -> torch.Tensor:
    """What the joined shards of `method` must equal, from the dense weights by prefix."""
    return torch.cat([dense[f"m.{p}"] for p in parts]) if method == "multi_col" else dense["m.qkv"]


# -- kernels ------------------------------------------------------------------------------------------
def make_weight(k: int, n: int, bits: int, group_size: int, sym: bool, act_order: bool, seed: int = 0,
                g_idx: torch.Tensor | None = None):
    """A random canonical QuantizedWeight [n, k] (act_order: a shuffled g_idx; `g_idx` given: that one)."""
    from text_generation_server.kernels.base import QuantizedWeight

    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size) if g_idx is None else int(g_idx.max()) + 1
    q = torch.randint(0, 2**bits, (k, n), generator=gen).to(torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) + 0.5) / 2**bits
    zeros = None if sym else torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // group_size
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(q, scales, zeros, g_idx.to(torch.int32), bits, group_size)


def rank_kernel_names(pg, folders: dict[str, str]) -> dict[str, dict[str, str]]:
    """A rank's work for `run_ranks`: the kernel of every linear of each checkpoint (float32 activations)."""
    from text_generation_server.models.loader import get_model

    return {name: kernel_names(get_model(folder, dtype="float32", process_group=pg)) for name, folder in folders.items()}


def needs_gpu(test):
    """A GPU-only test: marked `cuda` (`pytest -m cuda` on a GPU machine) and skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


# -- driving the engine by hand with token-id prompts (tests of prefix caching, chunking, backends) ------
def random_ids(n: int, seed: int, vocab: int = 290) -> list[int]:
    """A prompt of `n` token ids in [1, vocab) (the test tokenizer's range), reproducible by seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def ids_request(rid: int, prompt: list[int], new: int, seed: int | None = None, **kw):
    """A request for exactly `new` tokens of `prompt` (ids, as the router sends them); greedy, or
    sampled with every processor when `seed` is given."""
    from text_generation_server.generation.sampling import SamplingParams
    from text_generation_server.engine.types import GenerationRequest

    sampling = SamplingParams()
    if seed is not None:
        sampling = SamplingParams(do_sample=True, seed=seed, temperature=0.9, top_k=20, repetition_penalty=1.1)
    return GenerationRequest(id=rid, inputs="", input_ids=list(prompt), max_new_tokens=new, ignore_eos_token=True,
                             sampling=sampling, **kw)


def collect_generations(out: dict, generations) -> list[int]:
    """Adds a step's generations to `out` (per request: ids, logprobs, prompt logprobs); returns
    the requests that finished."""
    done = []
    for g in generations:
        entry = out.setdefault(g.request_id, {"ids": [], "lps": [], "prompt": None})
        entry["ids"] += g.tokens.ids
        entry["lps"] += g.tokens.logprobs
        if g.prefill_tokens is not None:
            entry["prompt"] = g.prefill_tokens.logprobs
        if g.generated_text is not None:
            done.append(g.request_id)
    return done


def run_to_end(lm, batch, out: dict | None = None) -> dict:
    """Steps a batch until every request finished, filtering finished ones out as a router does."""
    out = {} if out is None else out
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        done = collect_generations(out, generations)
        if batch is not None and done:
            batch = lm.filter(batch, [r for r in batch.request_ids if r not in done])
    return out


# -- a servicer context for calling the shard service's handlers directly -------------------------------
class Aborted(Exception):
    """What `AbortingContext.abort` raises: the status code and details the handler aborted with."""

    def __init__(self, code, details: str):
        super().__init__(f"{getattr(code, 'name', code)}: {details}")
        self.code = code
        self.details = details


class AbortingContext:
    """A gRPC servicer context whose abort raises `Aborted`, for handlers called without a server."""

    async def abort(self, code, details):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata):
        pass


# -- a shard service in this process, called as the router's ShardClient calls it -------------------------
class Context:
    """A gRPC servicer context: abort raises, done callbacks wait for `end()` (the call ending)."""

    def __init__(self):
        self.done_callbacks: list = []

    async def abort(self, code, details):
        raise StepFailedInShard(code, details)

    def set_trailing_metadata(self, metadata):
        pass

    def add_done_callback(self, callback) -> None:
        self.done_callbacks.append(callback)

    def end(self) -> None:
        for callback in self.done_callbacks:
            callback(self)


class StepFailedInShard(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class InProcessClient:
    """ShardClient's calls, answered by one shard service in this process (`calls`: what was called)."""

    def __init__(self, service):
        self.service = service
        self.ctx = Context()
        self.calls: list[str] = []

    async def prefill(self, batch, cached=None):
        from text_generation_server.router.client import ShardClient

        self.calls.append("prefill+cached" if cached is not None else "prefill")
        return await self.service.Prefill(ShardClient.prefill_request(batch, cached), self.ctx)

    async def decode(self, batches):
        from text_generation_server.pb.generate.v3 import generate_pb2 as pb

        self.calls.append("decode")
        return await self.service.Decode(pb.DecodeRequest(batches=batches), self.ctx)

    async def filter_batch(self, batch_id, request_ids):
        from text_generation_server.pb.generate.v3 import generate_pb2 as pb

        resp = await self.service.FilterBatch(pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids),
                                              self.ctx)
        return resp.batch if resp.HasField("batch") else None

    async def clear_cache(self, batch_id=None):
        from text_generation_server.pb.generate.v3 import generate_pb2 as pb

        req = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self.service.ClearCache(req, self.ctx)

    # LoRA adapters (router/adapter_admin.py): a refusal comes back as the grpc error ShardClient raises.
    async def load_adapter(self, name, path):
        from text_generation_server.pb.generate.v3 import generate_pb2 as pb

        self.calls.append(f"load {name}")
        response = await self._adapter_call(self.service.LoadAdapter, pb.LoadAdapterRequest(name=name, path=path))
        return response.adapter

    async def unload_adapter(self, name, missing_ok=False):
        import grpc

        from text_generation_server.pb.generate.v3 import generate_pb2 as pb

        self.calls.append(f"unload {name}")
        try:
            await self._adapter_call(self.service.UnloadAdapter, pb.UnloadAdapterRequest(name=name))
        except grpc.aio.AioRpcError as exc:
            if not (missing_ok and exc.code() == grpc.StatusCode.NOT_FOUND):
                raise

    async def _adapter_call(self, method, request):
        import grpc

        try:
            return await method(request, self.ctx)
        except StepFailedInShard as exc:
            raise grpc.aio.AioRpcError(exc.code(), None, None, details=exc.details()) from None


def decode_three_requests(lm) -> tuple[list, list]:
    """Three prompts of 20-38 ids decoded 12 tokens each on a fresh KV cache of 48 blocks: each step's
    (request id, token ids, logprobs), and a copy of the whole cache after (what a fused path must equal)."""
    lm.allocate_kv_cache(48)
    batch = lm.make_batch(0, [ids_request(i, random_ids(20 + 9 * i, i, 1000), 12) for i in range(3)])
    tokens = []
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        tokens.append([(g.request_id, g.tokens.ids, g.tokens.logprobs) for g in generations])
    return tokens, [t.clone() for t in (*lm.kv_cache.keys, *lm.kv_cache.values)]
