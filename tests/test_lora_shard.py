"""LoRA on the shard's wire (generate.v3): LoadAdapter, UnloadAdapter, Info.adapters, Request.adapter_id
and watermark, every refusal with its status and a message naming what is wrong; and the serve flags.

The contract with the router (its side lives in router/): a load of a name already loaded is
ALREADY_EXISTS, over --max-loras RESOURCE_EXHAUSTED, a rank over --max-lora-rank, DoRA, embedding /
lm_head targets, modules_to_save and shapes of another base INVALID_ARGUMENT; an unknown adapter (in
a request or an unload) NOT_FOUND, never the base model; an unload while a cached batch still has
a row of it FAILED_PRECONDITION. The shard keeps serving after each.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import grpc
import pytest
import torch
from helpers import Aborted, write_checkpoint
from helpers import AbortingContext as Context
from safetensors.torch import load_file, save_file

from text_generation_server.models.adapters import enable_lora, start_lora
from text_generation_server.models.loader import get_model
from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.settings.serve_args import ServeArgs, parse_lora_adapters
from text_generation_server.shard.service import TextGenerationService

peft = pytest.importorskip("peft")
torch.set_num_threads(1)


def save_adapter(base, folder: Path, targets: list[str], seed: int = 0, **fields) -> Path:
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=targets, **fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_shard")
    hf = write_checkpoint(root / "base", "llama")
    good = save_adapter(hf, root / "good", ["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=8)
    return root, hf, good


@pytest.fixture
def service(setup):
    root, _, good = setup
    lm = get_model(str(root / "base"), dtype="float32")
    enable_lora(lm, 2, 8)
    lm.allocate_kv_cache(64)
    svc = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    svc.decode_ahead = False
    yield svc
    svc._executor.shutdown(wait=True)


def call(coro):
    try:
        return asyncio.run(coro)
    except Aborted as exc:
        return exc


def load(svc, name: str, path) -> pb.LoadAdapterResponse | Aborted:
    return call(svc.LoadAdapter(pb.LoadAdapterRequest(name=name, path=str(path)), Context()))


def request(rid: int, **fields) -> pb.Request:
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0,
                                           watermark=fields.pop("watermark", False))
    return pb.Request(id=rid, inputs="def add(a, b):", parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=4), **fields)


def prefill(svc, batch_id: int, *requests: pb.Request):
    batch = pb.Batch(id=batch_id, requests=list(requests), size=len(requests))
    return call(svc.Prefill(pb.PrefillRequest(batch=batch), Context()))


def refused(result, code: grpc.StatusCode, *words: str) -> None:
    assert isinstance(result, Aborted), result
    assert result.code == code, (result.code, result.details)
    for word in words:
        assert word in result.details, (word, result.details)


def test_load_info_use_and_unload(service, setup):
    _, _, good = setup
    answer = load(service, "good", good)
    assert answer.adapter.name == "good" and answer.adapter.rank == 4 and answer.adapter.alpha == 8.0
    assert sorted(answer.adapter.target_modules) == ["down_proj", "q_proj", "v_proj"]
    assert answer.adapter.path == str(good)
    info = asyncio.run(service.Info(pb.InfoRequest(), Context()))
    assert [a.name for a in info.adapters] == ["good"]
    refused(load(service, "good", good), grpc.StatusCode.ALREADY_EXISTS, "good")
    first = prefill(service, 1, request(1, adapter_id="good"), request(2))
    assert len(first.generations) == 2
    # A row of the adapter is still in a cached batch: its slot must not change under it.
    refused(call(service.UnloadAdapter(pb.UnloadAdapterRequest(name="good"), Context())),
            grpc.StatusCode.FAILED_PRECONDITION, "good", "in use")
    asyncio.run(service.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[2]), Context()))
    asyncio.run(service.UnloadAdapter(pb.UnloadAdapterRequest(name="good"), Context()))
    assert not asyncio.run(service.Info(pb.InfoRequest(), Context())).adapters
    refused(call(service.UnloadAdapter(pb.UnloadAdapterRequest(name="good"), Context())),
            grpc.StatusCode.NOT_FOUND, "good")
    refused(prefill(service, 2, request(3, adapter_id="good")), grpc.StatusCode.NOT_FOUND, "adapter 'good'")


def test_unknown_adapter_and_watermark_are_refused_by_name(service):
    refused(prefill(service, 1, request(1, adapter_id="nope")), grpc.StatusCode.NOT_FOUND, "nope", "not loaded")
    refused(prefill(service, 2, request(2, watermark=True)), grpc.StatusCode.INVALID_ARGUMENT, "watermark")
    # Our router asks for per-request answers: the refused one is answered alone, the other served.
    batch = pb.Batch(id=3, requests=[request(3, adapter_id="nope"), request(4)], size=2)
    answer = asyncio.run(service.Prefill(pb.PrefillRequest(batch=batch, per_request_errors=True), Context()))
    errors = {g.request_id: g.error for g in answer.generations if g.HasField("error")}
    assert set(errors) == {3} and "nope" in errors[3]
    assert list(answer.batch.request_ids) == [4]
    # An empty adapter_id is the base model (a TGI router may send "").
    assert len(prefill(service, 5, request(5, adapter_id="")).generations) == 1


def test_warmup_ignores_the_watermark_a_tgi_router_sets(setup):
    root, _, _ = setup
    lm = get_model(str(root / "base"), dtype="float32")
    svc = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    warm = pb.WarmupRequest(batch=pb.Batch(id=0, requests=[request(0, watermark=True)], size=1),
                            max_input_tokens=32, max_prefill_tokens=64, max_total_tokens=64)
    assert asyncio.run(svc.Warmup(warm, Context())).max_total_tokens == 64
    svc._executor.shutdown(wait=True)


def test_slots_and_lora_off(service, setup):
    root, hf, good = setup
    assert load(service, "a", good).adapter.name == "a"
    assert load(service, "b", good).adapter.name == "b"
    refused(load(service, "c", good), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-loras 2")
    lm = get_model(str(root / "base"), dtype="float32")
    svc = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    refused(load(svc, "a", good), grpc.StatusCode.FAILED_PRECONDITION, "--lora-adapters", "--max-loras")
    lm.allocate_kv_cache(16)
    refused(prefill(svc, 1, request(1, adapter_id="a")), grpc.StatusCode.NOT_FOUND, "LoRA adapters are off")
    svc._executor.shutdown(wait=True)


def _edit(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(state) if tensors else state, str(dst / "adapter_model.safetensors"))
    return dst


def test_what_is_refused_and_why(service, setup, tmp_path):
    root, hf, good = setup
    cases = {
        "dora": (_edit(good, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "save": (_edit(good, tmp_path / "save", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "bias": (_edit(good, tmp_path / "bias", {"bias": "all"}), "biases"),
        "rank": (save_adapter(hf, tmp_path / "rank", ["q_proj"], r=16, lora_alpha=16), "--max-lora-rank 8"),
        "embed": (save_adapter(hf, tmp_path / "embed", ["embed_tokens", "q_proj"], r=4), "embedding"),
        "head": (save_adapter(hf, tmp_path / "head", ["lm_head"], r=4), "lm_head"),
        "magnitude": (_edit(good, tmp_path / "magnitude", tensors=lambda s: s | {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(48)}), "DoRA"),
        "shape": (_edit(good, tmp_path / "shape", tensors=lambda s: {
            k: torch.cat([v, v], dim=1) if k.endswith("lora_A.weight") else v for k, v in s.items()}),
            "different base"),
        "module": (_edit(good, tmp_path / "module", tensors=lambda s: {
            k.replace("layers.0.", "layers.7."): v for k, v in s.items()}), "layers.7"),
        "missing": (tmp_path / "nowhere", "does not exist"),
        "no_config": (tmp_path, "adapter_config.json is missing"),
    }
    for name, (folder, words) in cases.items():
        refused(load(service, name, folder), grpc.StatusCode.INVALID_ARGUMENT, words)
    info = asyncio.run(service.Info(pb.InfoRequest(), Context()))
    assert not info.adapters  # nothing half-loaded
    assert load(service, "good", good).adapter.name == "good"  # still serving, slots intact


def test_serve_flags(setup, tmp_path):
    root, _, good = setup
    assert parse_lora_adapters([f"x={good}, {good}"], "--lora-adapters") == [f"x={good}", f"good={good}"]
    with pytest.raises(ValueError, match="'good' is given twice"):
        parse_lora_adapters([f"{good},good={good}"], "--lora-adapters")
    args = ServeArgs(lora_adapters=[f"x={good}"])
    assert args.lora_slots == 1 and ServeArgs().lora_slots == 0 and args.max_lora_rank == 64
    with pytest.raises(ValueError, match="over --max-loras 1"):
        ServeArgs(lora_adapters=[f"x={good}", f"y={good}"], max_loras=1).validate()
    assert ServeArgs.from_json(args.to_json()).lora_adapters == [f"x={good}"]  # what the ranks get
    lm = get_model(str(root / "base"), dtype="float32")
    slots = start_lora(lm, 3, 8, [f"x={good}"])
    assert sorted(slots.by_name) == ["x"] and slots.max_loras == 3
    with pytest.raises(ValueError, match="--lora-adapters y=.*does not exist"):
        start_lora(get_model(str(root / "base"), dtype="float32"), 1, 8, [f"y={tmp_path / 'gone'}"])


def test_decode_ahead_forks_keep_each_rows_adapter(setup):
    """The shard steps ahead on forks of the batch (decode ahead): every row keeps its adapter, so the
    tokens equal the engine's plain steps, and the fork's rows count as users of the adapter."""
    root, _, good = setup

    def tokens(ahead: bool) -> dict[int, list[int]]:
        lm = get_model(str(root / "base"), dtype="float32")
        enable_lora(lm, 2, 8)
        lm.adapters.load("good", str(good))
        lm.allocate_kv_cache(64)
        svc = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
        svc.decode_ahead = ahead
        out: dict[int, list[int]] = {}
        answer = prefill(svc, 1, request(1, adapter_id="good"), request(2), request(3, adapter_id="good"))
        while True:
            for g in answer.generations:
                out.setdefault(g.request_id, []).extend(g.tokens.ids)
            if not answer.HasField("batch"):
                break
            answer = asyncio.run(svc.Decode(pb.DecodeRequest(batches=[answer.batch]), Context()))
        if ahead:
            assert svc.ahead_hits > 0
        svc._executor.shutdown(wait=True)
        return out

    plain, ahead = tokens(False), tokens(True)
    assert plain == ahead and plain[1] == plain[3] != plain[2]
