"""`serve --lora-adapters` on two ranks: the launcher passes the adapters to every rank, which loads
them before warmup; each rank's shard lists them in Info, serves a request naming one (and
refuses an unknown name with NOT_FOUND), and loads and unloads more at run time within
--max-loras. A refused adapter at startup stops the server naming it."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch
from serve_client import shard_stub

from text_generation_server.pb.generate.v3 import generate_pb2 as pb

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["q_proj", "down_proj"], r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("adapters") / "coder"
    model.save_pretrained(folder)
    return folder


def request(rid: int, **fields) -> pb.Request:
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    return pb.Request(id=rid, inputs="def add(a, b):", parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=2), **fields)


def test_two_ranks_load_the_startup_adapters(start_serve, tiny_model, adapter):
    server = start_serve(tiny_model, "--lora-adapters", str(adapter), "--max-loras", "2", "--max-lora-rank", "8",
                         num_shard=2)
    server.wait_serving()
    shards = [shard_stub(server, rank) for rank in range(2)]
    for shard in shards:
        assert [(a.name, a.rank) for a in shard.Info(pb.InfoRequest(), timeout=10).adapters] == [("coder", 4)]
    for shard in shards:  # as a router does: every rank gets the call
        assert shard.LoadAdapter(pb.LoadAdapterRequest(name="again", path=str(adapter)), timeout=30).adapter.rank == 4
    for shard in shards:
        with pytest.raises(grpc.RpcError) as failed:
            shard.LoadAdapter(pb.LoadAdapterRequest(name="third", path=str(adapter)), timeout=30)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for shard in shards:
        shard.UnloadAdapter(pb.UnloadAdapterRequest(name="again"), timeout=30)
        assert [a.name for a in shard.Info(pb.InfoRequest(), timeout=10).adapters] == ["coder"]
    with pytest.raises(grpc.RpcError) as failed:
        shards[0].Prefill(pb.PrefillRequest(batch=pb.Batch(id=10**12, requests=[request(1, adapter_id="nope")],
                                                           size=1)), timeout=30)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in failed.value.details()


def test_a_refused_adapter_stops_the_start(start_serve, tiny_model, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
    server = start_serve(tiny_model, "--lora-adapters", f"bad={tmp_path / 'bad'}")
    assert server.proc.wait(timeout=120) != 0
    log = server.log_path.read_text()
    assert "--lora-adapters bad=" in log and "DoRA" in log
