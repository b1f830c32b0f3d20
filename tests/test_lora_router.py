"""The router with LoRA adapters over a real shard in this process (the embedded tiny model):
requests name their adapter and get the engine's tokens for it, the base model's are unchanged,
the prefix cache never hands one adapter's KV to another (or to the base), a batch mixes
adapters, and adapters load and unload between steps while others stream. The wire and the
`serve` flags are covered by integration-tests/test_lora_serve.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from adapter_writer import write_adapter
from helpers import InProcessClient

from text_generation_server.engine.types import GenerationRequest
from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.models.adapters import enable_lora
from text_generation_server.models.loader import get_model
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.adapter_admin import AdapterAdmin
from text_generation_server.router.adapters import AdapterSet, LoadPolicy
from text_generation_server.router.block_pool import BlockPool
from text_generation_server.router.metrics import Metrics
from text_generation_server.router.scheduler import Scheduler, SchedulerLimits, StepFailed
from text_generation_server.router.validation import Limits, validate
from text_generation_server.shard.service import TextGenerationService
from text_generation_server.utils.locate import resolve_model

torch.set_num_threads(1)

PROMPT = "# A helper module for parsing configuration files.\nimport os\nimport json\n\ndef load(path):"
OTHER = "class Config:\n    def __init__(self"
NEW = 12
LIMITS = Limits(max_input_tokens=400, max_total_tokens=512, max_stop_sequences=4, max_stop_sequence_length=64,
                max_top_n_tokens=5, max_input_chars=100_000)


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    base = resolve_model(None)[1]
    write_adapter(root / "sql", base, seed=1)
    write_adapter(root / "docs", base, seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj"), scale=0.8)
    return root


@pytest.fixture(scope="module")
def lm(adapters_dir):
    lm = get_model(None)
    slots = enable_lora(lm, max_loras=4, max_rank=8)
    slots.load("sql", str(adapters_dir / "sql"))
    slots.load("docs", str(adapters_dir / "docs"))
    return lm


@pytest.fixture(scope="module")
def engine(lm):
    """The engine's own greedy tokens for (prompt, adapter), each request alone."""
    cache: dict = {}

    def tokens(prompt: str, adapter: str = "") -> list[int]:
        if (prompt, adapter) not in cache:
            request = GenerationRequest(id=0, inputs=prompt, sampling=SamplingParams(), max_new_tokens=NEW,
                                        adapter_id=adapter or None)
            cache[prompt, adapter] = list(lm.generate([request])[0].token_ids)
        return cache[prompt, adapter]

    for adapter in ("", "sql", "docs"):
        tokens(PROMPT, adapter)
        tokens(OTHER, adapter)
    lm.adapters.unload("sql")  # the router's tests load them through the router
    lm.adapters.unload("docs")
    return tokens


def make(lm, adapters_dir: Path, caching: bool = True):
    lm.block_size = 16
    lm.allocate_kv_cache(120)
    lm.max_prefill_tokens = 1024
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1, prefix_caching=caching)
    client = InProcessClient(service)
    metrics = Metrics(model_name="test")
    scheduler = Scheduler(client, BlockPool(120, 16, prefix_caching=caching), SchedulerLimits(1024, None, 64),
                          metrics, support_chunking=True, adapters=AdapterSet(reserved={"tiny-pycoder"}))
    policy = LoadPolicy.from_settings(str(adapters_dir), api_key_required=True, without_api_key=False)
    admin = AdapterAdmin(scheduler, policy, metrics, drain_timeout_s=30)
    return scheduler, admin, client, metrics


def request(lm, prompt: str, adapter: str = "", new: int = NEW):
    """A validated request naming `adapter`, as the service hands it to the scheduler."""
    valid = validate(cpb.GenerateRequest(inputs=prompt, parameters=cpb.GenerateParameters(max_new_tokens=new)),
                     lm.tokenizer, LIMITS)
    valid.adapter_id = adapter
    return valid


async def tokens_of(entry) -> list[int]:
    ids: list[int] = []
    while True:
        event = await entry.events.get()
        if isinstance(event, StepFailed):
            raise event
        ids += list(event.tokens.ids)
        if event.HasField("generated_text"):
            return ids


def run_router(lm, adapters_dir, body, caching: bool = True):
    async def go():
        scheduler, admin, client, metrics = make(lm, adapters_dir, caching)
        scheduler.start()
        try:
            return await body(scheduler, admin, client, metrics)
        finally:
            for name in scheduler.adapters.names():
                await admin.unload(name)
            await scheduler.stop()

    return asyncio.run(go())


def test_requests_get_their_adapters_tokens_and_never_share_kv(lm, adapters_dir, engine):
    assert engine(PROMPT, "sql") != engine(PROMPT), "the test adapter must change greedy tokens"
    assert engine(PROMPT, "docs") != engine(PROMPT, "sql")

    async def body(scheduler, admin, client, metrics):
        await admin.load("sql", "sql")
        await admin.load("docs", str(adapters_dir / "docs"))
        out = {}
        for name, adapter in (("base", ""), ("sql", "sql"), ("docs", "docs"), ("sql again", "sql"),
                              ("base again", "")):
            entry = scheduler.submit(request(lm, PROMPT, adapter))
            out[name] = (await tokens_of(entry), entry.allocation.cache_len)
        return out

    out = run_router(lm, adapters_dir, body)
    assert out["base"][0] == engine(PROMPT)
    assert out["sql"][0] == engine(PROMPT, "sql") and out["docs"][0] == engine(PROMPT, "docs")
    # The same prompt under another adapter (or the base) reuses none of the cached blocks...
    assert out["base"][1] == 0 and out["sql"][1] == 0 and out["docs"][1] == 0
    # ...the same adapter (or the base again) reuses its own, and gets the same tokens.
    assert out["sql again"][1] > 0 and out["sql again"][0] == out["sql"][0]
    assert out["base again"][1] > 0 and out["base again"][0] == out["base"][0]


def test_one_batch_mixes_adapters_and_the_base(lm, adapters_dir, engine):
    cases = [(PROMPT, ""), (PROMPT, "sql"), (OTHER, "docs"), (OTHER, ""), (PROMPT, "docs"), (OTHER, "sql")]

    async def body(scheduler, admin, client, metrics):
        await admin.load("sql", "sql")
        await admin.load("docs", "docs")
        entries = [scheduler.submit(request(lm, p, a)) for p, a in cases]
        return await asyncio.gather(*(tokens_of(e) for e in entries))

    got = run_router(lm, adapters_dir, body, caching=False)
    assert got == [engine(p, a) for p, a in cases]


def test_load_and_unload_while_others_stream(lm, adapters_dir, engine):
    async def body(scheduler, admin, client, metrics):
        await admin.load("sql", "sql")
        long_new = 60
        streams = [scheduler.submit(request(lm, PROMPT, "", long_new)),
                   scheduler.submit(request(lm, OTHER, "sql", long_new))]
        base_first = await streams[0].events.get()  # both are running
        sql_first = await streams[1].events.get()
        loaded = await admin.load("docs", "docs")  # between two steps of the running streams
        docs = await tokens_of(scheduler.submit(request(lm, PROMPT, "docs")))
        unloading = asyncio.create_task(admin.unload("sql"))  # its stream is still running: it drains
        await asyncio.sleep(0.05)
        assert not unloading.done()
        with pytest.raises(StepFailed) as refused:
            scheduler.submit(request(lm, PROMPT, "sql"))
        rest = await asyncio.gather(tokens_of(streams[0]), tokens_of(streams[1]))
        await unloading
        calls = list(client.calls)
        return (loaded, docs, list(base_first.tokens.ids) + rest[0], list(sql_first.tokens.ids) + rest[1],
                refused.value, calls)

    loaded, docs, base, sql, refused, calls = run_router(lm, adapters_dir, body)
    assert loaded.name == "docs" and loaded.rank == 4 and set(loaded.target_modules) == {"q_proj", "v_proj",
                                                                                         "down_proj"}
    assert docs == engine(PROMPT, "docs")
    assert base[:NEW] == engine(PROMPT)  # the running streams were undisturbed
    assert refused.code == grpc.StatusCode.NOT_FOUND and "being unloaded" in str(refused)
    # Each adapter call sits between two steps, and the unload waited for the last sql row to go.
    load_at = calls.index("load docs")
    assert calls[load_at - 1] in ("decode", "prefill", "prefill+cached") and "unload sql" in calls
    assert len(sql) == 60 and sql[:NEW] == engine(OTHER, "sql")


def test_an_adapter_the_shard_refuses_is_not_loaded(lm, adapters_dir, tmp_path):
    bad = adapters_dir / "too-big"
    write_adapter(bad, resolve_model(None)[1], seed=3, rank=16)  # over max_rank 8

    async def body(scheduler, admin, client, metrics):
        refused = (await asyncio.gather(admin.load("big", "too-big"), return_exceptions=True))[0]
        return refused, scheduler.adapters.names()

    refused, names = run_router(lm, adapters_dir, body)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "rank 16" in refused.message and names == []
