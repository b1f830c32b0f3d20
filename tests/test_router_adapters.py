"""The router's LoRA adapter bookkeeping (router/adapters.py, router/adapter_admin.py): who may
load, from where (symlink and `..` escapes included), names, the loaded set, the prefix cache's
keys per adapter, the request counters' adapter label, and load/unload serialised with the steps
and draining the adapter's requests. The shards are fakes here; integration-tests/
test_lora_serve.py runs the same calls against real ones."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.adapter_admin import AdapterAdmin
from text_generation_server.router.adapters import AdapterError, AdapterSet, LoadPolicy, check_name
from text_generation_server.router.block_pool import BlockPool
from text_generation_server.router.metrics import Metrics
from text_generation_server.router.scheduler import Scheduler, SchedulerLimits, StepFailed
from text_generation_server.router.validation import ValidRequest
from text_generation_server.settings.serve_args import ServeArgs


# -- the load policy ---------------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """allowed/ with adapters, a secret outside it, and links that try to escape."""
    allowed = tmp_path / "allowed"
    good = allowed / "good"
    good.mkdir(parents=True)
    (good / "adapter_config.json").write_text("{}")
    (good / "adapter_model.safetensors").write_bytes(b"")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    leaky = allowed / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").symlink_to(secret)
    (allowed / "inner_link").symlink_to(good, target_is_directory=True)
    return {"root": tmp_path, "allowed": allowed, "good": good, "outside": outside, "secret": secret}


def open_policy(allowed: Path) -> LoadPolicy:
    return LoadPolicy.from_settings(str(allowed), api_key_required=True, without_api_key=False)


def refused(call, code: grpc.StatusCode, *words: str) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        call()
    assert info.value.code == code, info.value.message
    for word in words:
        assert word in info.value.message
    return info.value


def test_paths_inside_the_directory_resolve(tree):
    policy = open_policy(tree["allowed"])
    good = tree["good"].resolve()
    assert policy.resolve("good") == good
    assert policy.resolve(str(tree["good"])) == good
    assert policy.resolve("./good/../good") == good
    assert policy.resolve("inner_link") == good  # a link that stays inside is fine


@pytest.mark.parametrize("path", ["../outside", "escape", "good/../../outside", "/etc", "../secret.txt", "/",
                                  "..", "escape/../escape"])
def test_paths_leaving_the_directory_are_refused(tree, path):
    refused(lambda: open_policy(tree["allowed"]).resolve(path), grpc.StatusCode.INVALID_ARGUMENT,
            "outside --lora-load-dir")


def test_absolute_path_outside_and_missing_paths_say_nothing_about_existence(tree):
    policy = open_policy(tree["allowed"])
    a = refused(lambda: policy.resolve(str(tree["outside"])), grpc.StatusCode.INVALID_ARGUMENT)
    b = refused(lambda: policy.resolve(str(tree["root"] / "no-such-dir")), grpc.StatusCode.INVALID_ARGUMENT)
    assert "outside" in a.message and "outside" in b.message
    refused(lambda: policy.resolve("missing"), grpc.StatusCode.INVALID_ARGUMENT, "not an adapter folder")
    refused(lambda: policy.resolve("good/adapter_config.json"), grpc.StatusCode.INVALID_ARGUMENT,
            "not an adapter folder")
    refused(lambda: policy.resolve(""), grpc.StatusCode.INVALID_ARGUMENT)
    refused(lambda: policy.resolve("good\x00"), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_file_linking_out_of_the_directory_is_refused(tree):
    refused(lambda: open_policy(tree["allowed"]).resolve("leaky"), grpc.StatusCode.INVALID_ARGUMENT,
            "adapter_config.json links outside")


def test_a_symlink_loop_is_refused(tree):
    loop = tree["allowed"] / "loop"
    os.symlink(loop, loop)
    refused(lambda: open_policy(tree["allowed"]).resolve("loop"), grpc.StatusCode.INVALID_ARGUMENT)


def test_loading_is_off_without_the_directory_and_needs_a_key_or_the_second_switch(tree):
    off = LoadPolicy.from_settings(None, api_key_required=True, without_api_key=True)
    assert not off.open
    refused(lambda: off.resolve("good"), grpc.StatusCode.FAILED_PRECONDITION, "--lora-load-dir")
    keyless = LoadPolicy.from_settings(str(tree["allowed"]), api_key_required=False, without_api_key=False)
    assert not keyless.open
    refused(lambda: keyless.resolve("good"), grpc.StatusCode.PERMISSION_DENIED, "--lora-load-without-api-key",
            "--api-key")
    opted = LoadPolicy.from_settings(str(tree["allowed"]), api_key_required=False, without_api_key=True)
    assert opted.open and opted.resolve("good") == tree["good"].resolve()
    with pytest.raises(ValueError, match="--lora-load-dir"):
        LoadPolicy.from_settings(str(tree["secret"]), True, False)


def test_serve_flags(tree):
    args = ServeArgs(lora_load_dir=str(tree["allowed"]), lora_load_without_api_key=True)
    args.validate()
    with pytest.raises(ValueError, match="--lora-load-dir must be an existing directory"):
        ServeArgs(lora_load_dir=str(tree["secret"])).validate()
    with pytest.raises(ValueError, match="--lora-load-without-api-key .* needs --lora-load-dir"):
        ServeArgs(lora_load_without_api_key=True).validate()
    assert ServeArgs.from_json(args.to_json()).lora_load_dir == str(tree["allowed"])


# -- names and the loaded set -------------------------------------------------------------------------
def info(name: str, rank: int = 4) -> cpb.AdapterInfo:
    return cpb.AdapterInfo(name=name, path=f"/a/{name}", rank=rank, target_modules=["q_proj"], alpha=8.0)


@pytest.mark.parametrize("name", ["", "a/b", "a b", "x" * 65, "../x", "é"])
def test_bad_names_are_refused(name):
    refused(lambda: check_name(name), grpc.StatusCode.INVALID_ARGUMENT, "adapter name")


def test_the_base_models_name_is_reserved():
    adapters = AdapterSet(reserved={"org/model", "model"})
    refused(lambda: adapters.reserve("model"), grpc.StatusCode.INVALID_ARGUMENT, "base model")


def test_the_set_knows_what_is_loaded_and_keys_each_load_afresh():
    adapters = AdapterSet([info("b"), info("a")])
    assert adapters.names() == ["a", "b"] and [i.name for i in adapters.infos()] == ["a", "b"]
    first = adapters.usable("a").key
    refused(lambda: adapters.usable("c"), grpc.StatusCode.NOT_FOUND, "'c'", "loaded: a, b")
    refused(lambda: adapters.reserve("a"), grpc.StatusCode.ALREADY_EXISTS)
    adapters.reserve("c")
    refused(lambda: adapters.reserve("c"), grpc.StatusCode.ALREADY_EXISTS)  # a load under way
    assert adapters.settle("c", None) is None and "c" not in adapters
    adapters.remove("a")
    adapters.reserve("a")
    assert adapters.settle("a", info("a")).key != first  # a new life, a new prefix-cache key
    adapters.get("a").draining = True
    refused(lambda: adapters.usable("a"), grpc.StatusCode.NOT_FOUND, "being unloaded")


# -- the prefix cache keys blocks by adapter -----------------------------------------------------------
def test_the_same_prompt_under_two_adapters_never_shares_kv():
    pool = BlockPool(64, 4, prefix_caching=True)
    prompt = list(range(1, 18))  # 4 whole blocks before the last token
    held = []
    for salt in (None, 1, 2):
        a = pool.allocate(len(prompt) + 4, prompt, salt)
        assert a.cache_len == 0, f"salt {salt} reused another adapter's blocks"
        assert pool.register(a, prompt, len(prompt)) == 4
        held.append(a)
    blocks = [set(a.blocks) for a in held]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2]) and not (blocks[0] & blocks[2])
    for salt, owner in zip((None, 1, 2), held):  # each finds its own, and only its own
        again = pool.allocate(len(prompt) + 4, prompt, salt)
        assert again.cache_len == 16 and again.blocks[:4] == owner.blocks[:4]
        pool.release(again)
    for a in held:
        pool.release(a)
    assert pool.allocate(len(prompt) + 4, prompt, 3).cache_len == 0  # a reloaded adapter: a new key


def test_base_hashes_are_unchanged_by_the_salt_parameter():
    pool = BlockPool(16, 4, prefix_caching=True)
    assert pool.prefix_hashes(list(range(8))) == pool.prefix_hashes(list(range(8)), salt=None)
    assert pool.prefix_hashes(list(range(8))) != pool.prefix_hashes(list(range(8)), salt=1)


# -- the request counters' adapter label ----------------------------------------------------------------
def test_request_counters_carry_the_adapter_and_the_base_renders_as_before():
    metrics = Metrics(model_name="m")
    metrics.adapter_series("sql")
    metrics.request_count.labels(adapter="").inc(2)
    metrics.request_count.labels(adapter="sql").inc()
    metrics.request_success.labels(finish_reason="length", adapter="sql").inc()
    metrics.request_failure.labels(err="validation", adapter="").inc()
    lines = metrics.render().decode().splitlines()
    assert 'tgi_request_count{model_name="m"} 2.0' in lines
    assert 'tgi_request_count{model_name="m",adapter="sql"} 1.0' in lines
    assert 'tgi_request_success_total{model_name="m",finish_reason="length",adapter="sql"} 1.0' in lines
    assert 'tgi_request_failure{model_name="m",err="validation"} 1.0' in lines
    assert 'tgi_request_failure{model_name="m",err="decode",adapter="sql"} 0.0' in lines  # known at zero
    assert not any('adapter=""' in line for line in lines)


# -- load / unload through the scheduler ------------------------------------------------------------------
class FakeShards:
    """ShardClient's adapter calls and steps, recording the order they reach the shards."""

    def __init__(self):
        self.log: list[str] = []
        self.step_gate: asyncio.Event | None = None
        self.refuse: grpc.StatusCode | None = None
        self.busy_unloads = 0  # unloads a rank refuses (FAILED_PRECONDITION) before it accepts

    async def load_adapter(self, name: str, path: str) -> spb.AdapterInfo:
        self.log.append(f"load {name}")
        if self.refuse is not None:
            raise grpc.aio.AioRpcError(self.refuse, None, None, details=f"the shard refuses {name}")
        return spb.AdapterInfo(name=name, path=path, rank=8, target_modules=["q_proj", "v_proj"], alpha=16.0)

    async def unload_adapter(self, name: str, missing_ok: bool = False) -> None:
        self.log.append(f"unload {name}" + (" (again)" if missing_ok else ""))
        if self.busy_unloads:
            self.busy_unloads -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, None, None, details=f"{name} in use")

    async def prefill(self, batch, cached=None):
        """Each request ends with one token; the adapter each one named on the wire is logged."""
        self.log.append("prefill begins " + ",".join(r.adapter_id or "base" for r in batch.requests))
        if self.step_gate is not None:
            await self.step_gate.wait()
        self.log.append("prefill ends")
        tokens = spb.Tokens(ids=[7], logprobs=[0.0], texts=["x"], is_special=[False])
        return spb.PrefillResponse(generations=[
            spb.Generation(request_id=r.id, tokens=tokens,
                           generated_text=spb.GeneratedText(text="x", generated_tokens=1, finish_reason=0))
            for r in batch.requests])

    async def clear_cache(self, batch_id=None):
        pass


def valid(adapter_id: str = "") -> ValidRequest:
    return ValidRequest(inputs="x", input_length=1, truncate=1, input_ids=[5], max_new_tokens=2,
                        parameters=spb.NextTokenChooserParameters(), stop=[], details=False,
                        decoder_input_details=False, top_n_tokens=0, adapter_id=adapter_id)


def make_admin(tmp_path: Path, drain_s: float = 5.0) -> tuple[AdapterAdmin, FakeShards, Scheduler]:
    (tmp_path / "sql").mkdir(exist_ok=True)
    shards = FakeShards()
    scheduler = Scheduler(shards, BlockPool(64, 4), SchedulerLimits(64, None, 16), Metrics(),
                          adapters=AdapterSet(reserved={"base"}))
    return AdapterAdmin(scheduler, open_policy(tmp_path), Metrics(), drain_s), shards, scheduler


def test_load_and_unload_run_between_steps(tmp_path):
    async def run():
        admin, shards, scheduler = make_admin(tmp_path)
        scheduler.start()
        try:
            shards.step_gate = asyncio.Event()
            scheduler.submit(valid(""))
            await asyncio.sleep(0.02)  # its prefill is in flight
            load = asyncio.create_task(admin.load("sql", "sql"))
            await asyncio.sleep(0.05)
            assert shards.log == ["prefill begins base"]  # the load waits for the step...
            shards.step_gate.set()
            loaded = await load
            assert shards.log == ["prefill begins base", "prefill ends", "load sql"]  # ...and runs after it
            assert loaded.name == "sql" and loaded.rank == 8 and list(loaded.target_modules) == ["q_proj", "v_proj"]
            assert [i.name for i in admin.list()] == ["sql"]
            refused_load = await asyncio.gather(admin.load("sql", "sql"), return_exceptions=True)
            assert refused_load[0].code == grpc.StatusCode.ALREADY_EXISTS
            done = scheduler.submit(valid("sql"))
            assert (await done.events.get()).HasField("generated_text")
            assert shards.log[-2:] == ["prefill begins sql", "prefill ends"]  # the wire names the adapter
            await admin.unload("sql")
            assert shards.log[-1] == "unload sql" and admin.list() == []
            missing = await asyncio.gather(admin.unload("sql"), return_exceptions=True)
            assert missing[0].code == grpc.StatusCode.NOT_FOUND
        finally:
            await scheduler.stop()

    asyncio.run(run())


def test_a_refused_load_leaves_nothing_loaded(tmp_path):
    async def run():
        admin, shards, scheduler = make_admin(tmp_path)
        scheduler.start()
        try:
            shards.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
            error = (await asyncio.gather(admin.load("sql", "sql"), return_exceptions=True))[0]
            assert isinstance(error, AdapterError) and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the shard refuses sql" in error.message and admin.list() == []
            shards.refuse = None
            assert (await admin.load("sql", "sql")).name == "sql"  # the name was given back
            outside = (await asyncio.gather(admin.load("x", "../"), return_exceptions=True))[0]
            assert outside.code == grpc.StatusCode.INVALID_ARGUMENT and shards.log == ["load sql", "load sql"]
            base = (await asyncio.gather(admin.load("base", "sql"), return_exceptions=True))[0]
            assert base.code == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await scheduler.stop()

    asyncio.run(run())


def test_unload_drains_the_adapters_requests_and_refuses_newcomers(tmp_path):
    async def run():
        admin, shards, scheduler = make_admin(tmp_path)
        scheduler.adapters.add(info("sql"))
        entry = scheduler.submit(valid("sql"))  # queued; the loop is not running, so it stays
        assert entry.request.adapter_key == scheduler.adapters.get("sql").key
        scheduler.submit(valid(""))  # the base model's requests do not hold the adapter
        assert scheduler.uses("sql") == 1
        unload = asyncio.create_task(admin.unload("sql"))
        await asyncio.sleep(0.05)
        assert not unload.done() and "sql" in scheduler.adapters
        with pytest.raises(StepFailed) as late:
            scheduler.submit(valid("sql"))
        assert late.value.code == grpc.StatusCode.NOT_FOUND and "being unloaded" in str(late.value)
        scheduler.cancel(entry)  # its last request leaves
        scheduler.start()
        try:
            await asyncio.wait_for(unload, 5)
            assert "sql" not in scheduler.adapters and shards.log[-1] == "unload sql"
        finally:
            await scheduler.stop()

    asyncio.run(run())


def test_an_unload_a_rank_refuses_for_a_row_it_still_holds_is_tried_again(tmp_path):
    async def run():
        admin, shards, scheduler = make_admin(tmp_path)
        scheduler.adapters.add(info("sql"))
        shards.busy_unloads = 2
        scheduler.start()
        try:
            await admin.unload("sql")
            assert shards.log == ["unload sql", "unload sql (again)", "unload sql (again)"]
            assert "sql" not in scheduler.adapters
        finally:
            await scheduler.stop()

    asyncio.run(run())


def test_a_drain_that_times_out_keeps_the_adapter(tmp_path):
    async def run():
        admin, shards, scheduler = make_admin(tmp_path, drain_s=0.1)
        scheduler.adapters.add(info("sql"))
        scheduler.submit(valid("sql"))
        error = (await asyncio.gather(admin.unload("sql"), return_exceptions=True))[0]
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "stays loaded" in error.message
        assert scheduler.adapters.usable("sql") and "unload sql" not in shards.log

    asyncio.run(run())


# -- the service and the HTTP context read the adapter off each door ---------------------------------------
def make_service(tmp_path: Path):
    from tokenizers import Tokenizer

    from text_generation_server.router.service import TextGenerationService
    from text_generation_server.router.validation import Limits
    from text_generation_server.utils.locate import embedded_model_path

    _, _, scheduler = make_admin(tmp_path)
    scheduler.adapters.add(info("sql"))
    limits = Limits(max_input_tokens=100, max_total_tokens=200, max_stop_sequences=4, max_stop_sequence_length=20,
                    max_top_n_tokens=5, max_input_chars=10_000)
    tokenizer = Tokenizer.from_file(str(embedded_model_path() / "tokenizer.json"))
    metrics = Metrics(model_name="m")
    service = TextGenerationService(scheduler, tokenizer, limits, cpb.InfoResponse(model_id="base"), metrics,
                                    load_policy=open_policy(tmp_path))
    return service, scheduler, metrics


def test_the_service_refuses_unknown_adapters_and_labels_known_ones(tmp_path):
    from text_generation_server.router.service import Refused

    async def run():
        service, scheduler, metrics = make_service(tmp_path)
        with pytest.raises(Refused) as unknown:
            await service.submit(cpb.GenerateRequest(inputs="def f(", parameters=cpb.GenerateParameters(
                max_new_tokens=2, adapter_id="nope")))
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in unknown.value.message
        entry = await service.submit(cpb.GenerateRequest(inputs="def f(", parameters=cpb.GenerateParameters(
            max_new_tokens=2, adapter_id="sql")))
        base = await service.submit(cpb.GenerateRequest(inputs="def f(", parameters=cpb.GenerateParameters(
            max_new_tokens=2)))
        assert (entry.request.adapter_id, base.request.adapter_id) == ("sql", "")
        assert entry.request.adapter_key == scheduler.adapters.get("sql").key and base.request.adapter_key is None
        text = metrics.render().decode()
        assert 'tgi_request_count{model_name="m",adapter="sql"} 1.0' in text.splitlines()
        assert 'tgi_request_count{model_name="m"} 2.0' in text.splitlines()  # the base's and the refused one
        assert "nope" not in text  # a made-up name is never a series
        info_now = service.current_info()
        assert [a.name for a in info_now.adapters] == ["sql"] and info_now.adapter_loading
        assert not service.info.adapters  # the startup Info is left as it was

    asyncio.run(run())


def test_chat_takes_the_adapter_from_the_request_or_its_parameters():
    from text_generation_server.generation.tool_calls import ToolError
    from text_generation_server.router.service import conversation_of

    messages = [cpb.Message(role="user", content="hi")]
    chat = conversation_of(cpb.ChatRequest(messages=messages, adapter_id="sql"))
    assert chat.parameters.adapter_id == "sql"
    same = conversation_of(cpb.ChatRequest(messages=messages, adapter_id="sql",
                                           parameters=cpb.GenerateParameters(adapter_id="sql")))
    assert same.parameters.adapter_id == "sql"
    inner = conversation_of(cpb.ChatRequest(messages=messages, parameters=cpb.GenerateParameters(adapter_id="x")))
    assert inner.parameters.adapter_id == "x"
    with pytest.raises(ToolError, match="adapter_id 'sql' and parameters.adapter_id 'x' differ"):
        conversation_of(cpb.ChatRequest(messages=messages, adapter_id="sql",
                                        parameters=cpb.GenerateParameters(adapter_id="x")))


def test_the_openai_model_field_names_an_adapter(tmp_path):
    from text_generation_server.router.http.core import HttpContext
    from text_generation_server.router.http.errors import HttpError

    service, _, _ = make_service(tmp_path)
    ctx = HttpContext(service=service, model_id="org/base", model_names=frozenset({"org/base", "base"}),
                      max_body_bytes=1000, max_client_batch_size=1, healthy=lambda: True)
    assert [ctx.model_adapter(m) for m in (None, "org/base", "base", "tgi", "sql")] == ["", "", "", "", "sql"]
    with pytest.raises(HttpError) as unknown:
        ctx.model_adapter("nope")
    assert unknown.value.status == 404 and "'nope'" in unknown.value.message and "'sql'" in unknown.value.message


def test_tgi_parameters_adapter_id_is_carried():
    from text_generation_server.router.http.body import Fields
    from text_generation_server.router.http.errors import HttpError
    from text_generation_server.router.http.tgi_api import parameters

    p, _ = parameters(Fields({"adapter_id": "sql", "max_new_tokens": 3}))
    assert p.adapter_id == "sql" and p.max_new_tokens == 3
    assert not parameters(Fields({}))[0].HasField("adapter_id")
    with pytest.raises(HttpError, match="watermark"):
        parameters(Fields({"watermark": True}))


# -- every rank, or none ---------------------------------------------------------------------------------
class FakeRankStub:
    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.loaded: set[str] = set()

    async def LoadAdapter(self, request):  # noqa: N802 (gRPC's naming)
        if self.refuse:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None, details="no free slot")
        self.loaded.add(request.name)
        return spb.LoadAdapterResponse(adapter=spb.AdapterInfo(name=request.name, path=request.path, rank=4))

    async def UnloadAdapter(self, request, timeout=None):  # noqa: N802
        self.loaded.discard(request.name)
        return spb.UnloadAdapterResponse()


def test_a_load_one_rank_refuses_is_undone_on_the_others():
    from text_generation_server.router.client import ShardClient

    async def run():
        client = ShardClient(["unix:///tmp/unused-0", "unix:///tmp/unused-1", "unix:///tmp/unused-2"])
        try:
            client._stubs = [FakeRankStub(), FakeRankStub(refuse=True), FakeRankStub()]
            error = (await asyncio.gather(client.load_adapter("sql", "/a/sql"), return_exceptions=True))[0]
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert [s.loaded for s in client._stubs] == [set(), set(), set()]
            client._stubs[1].refuse = False
            assert (await client.load_adapter("sql", "/a/sql")).name == "sql"
            assert [s.loaded for s in client._stubs] == [{"sql"}] * 3
            await client.unload_adapter("sql")
            assert [s.loaded for s in client._stubs] == [set(), set(), set()]
        finally:
            await client.close()

    asyncio.run(run())


def test_a_load_runs_to_its_end_when_its_caller_goes_away(tmp_path):
    """Cut halfway, the ranks could hold an adapter the router does not know (or the reverse)."""

    async def run():
        admin, shards, scheduler = make_admin(tmp_path)
        shards.step_gate = asyncio.Event()
        scheduler.start()
        try:
            scheduler.submit(valid(""))
            await asyncio.sleep(0.02)  # a step in flight: the load waits behind it
            call = asyncio.create_task(admin.load("sql", "sql"))
            await asyncio.sleep(0.02)
            call.cancel()  # the client went away
            shards.step_gate.set()
            for _ in range(100):
                if "sql" in scheduler.adapters:
                    break
                await asyncio.sleep(0.01)
            assert "load sql" in shards.log and "sql" in scheduler.adapters  # loaded on both sides
        finally:
            await scheduler.stop()

    asyncio.run(run())
