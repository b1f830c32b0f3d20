"""CPU tests of the GPU decode benchmark (benchmarks/gpu_bench_logic.py, benchmarks/gpu_decode.py).

The GPU run cannot happen here, so what decides its figures (bytes per step, the checkpoint it
builds, the tokenizer, the phase plan, the summaries, the targets and the table) is checked on a
tiny model instead."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_bench_logic as gl  # noqa: E402
import gpu_decode as gd  # noqa: E402

TINY = gl.ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=1024, max_positions=4096)


# -- shapes and bytes ---------------------------------------------------------------------------
def test_llama3_8b_shape_counts():
    shape = gl.ModelShape()
    # Llama-3-8B: 8.03e9 parameters; 6.98e9 of them in the decoder's linears.
    assert shape.params() == 8_030_261_248
    dense = gl.dense_step_bytes(shape)
    assert dense["linears"] == 2 * 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert dense["lm_head"] == 2 * 128256 * 4096
    assert dense["total"] == dense["linears"] + dense["lm_head"] + dense["norms"]


def test_gptq_bytes_are_codes_scales_and_the_dense_head():
    shape = gl.ModelShape()
    q = gl.gptq_step_bytes(shape, bits=4, group_size=128, sym=True)
    dense = gl.dense_step_bytes(shape)
    assert q["codes"] == dense["linears"] // 4  # 4 of 16 bits
    assert q["scales"] == dense["linears"] // 2 // 128 * 2  # one fp16 per 128 weights
    assert q["zeros"] == 0  # symmetric: triton-gemm reads no zero points
    assert q["lm_head"] == dense["lm_head"]
    asym = gl.gptq_step_bytes(shape, bits=4, group_size=128, sym=False)
    assert asym["zeros"] == q["codes"] // 128
    assert asym["total"] == q["total"] + asym["zeros"]
    # The 4-bit model reads 3.2x fewer bytes: the 2.5x target leaves room for the dense head.
    assert 3.1 < dense["total"] / q["total"] < 3.3
    per_channel = gl.gptq_step_bytes(shape, bits=8, group_size=-1)
    assert per_channel["codes"] == dense["linears"] // 2
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        gl.gptq_step_bytes(shape, bits=3, group_size=128)


def test_bandwidth_share_and_limit():
    bw = gl.bandwidth(15e9, 0.006, 3000.0)
    assert bw["gbs"] == pytest.approx(2500.0)
    assert bw["share"] == pytest.approx(2500 / 3000)
    assert bw["limit_tok_s"] == pytest.approx(200.0)
    assert gl.bandwidth(15e9, None, 3000.0)["share"] is None
    assert gl.bandwidth(15e9, 0.006, None) == {"gbs": pytest.approx(2500.0), "share": None, "limit_tok_s": None}


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_heads"):
        gl.ModelShape(heads=32, kv_heads=5)
    with pytest.raises(ValueError, match="layers must be positive"):
        gl.ModelShape(layers=0)


def test_shard_plan_respects_the_limit():
    shapes = {"a": (10,), "b": (10,), "c": (30,), "d": (5,)}
    assert gl.shard_plan(shapes, max_bytes=40, element_bytes=1) == [["a", "b"], ["c", "d"]]
    assert gl.shard_plan(shapes, max_bytes=10, element_bytes=1) == [["a"], ["b"], ["c"], ["d"]]  # c: alone, too big
    assert gl.shard_plan(shapes, max_bytes=40) == [["a", "b"], ["c"], ["d"]]  # fp16: 20 + 20, 60, 10
    plan = gl.shard_plan(gl.ModelShape().tensor_shapes(), 4 << 30)
    assert sum(len(s) for s in plan) == len(gl.ModelShape().tensor_shapes())
    assert len(plan) == 4  # 16 GB in shards of at most 4 GiB
    with pytest.raises(ValueError):
        gl.shard_plan(shapes, 0)


# -- the checkpoint it builds, quantized by our quantize ------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from text_generation_server.jobs.quantize.options import QuantizeOptions
    from text_generation_server.jobs.quantize.pipeline import quantize

    root = tmp_path_factory.mktemp("gpu-bench")
    record = gd.build_checkpoint(root / "fp16", TINY, seed=3, device="cpu", max_shard_bytes=200_000)
    quantize(str(root / "fp16"), root / "int4", QuantizeOptions(method="rtn", bits=4, group_size=128))
    return root, record


def test_built_checkpoint_loads_and_counts_like_the_formula(tiny_checkpoints):
    from safetensors import safe_open

    from text_generation_server.models.registry import read_model_config
    from text_generation_server.utils.locate import open_checkpoint

    root, record = tiny_checkpoints
    assert record["shards"] == len(list((root / "fp16").glob("*.safetensors"))) > 1
    assert record["bytes"] == 2 * TINY.params()
    ckpt = open_checkpoint(str(root / "fp16"))
    _, config = read_model_config(ckpt.config)
    assert (config.hidden_size, config.num_key_value_heads, config.rope.rope_type) == (128, 2, "llama3")
    assert ckpt.eos_token_ids == {gl.eos_id(TINY.vocab)}
    index = json.loads((root / "fp16" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(TINY.tensor_shapes())
    assert gl.folder_step_bytes(root / "fp16", read_zeros=False) == gl.dense_step_bytes(TINY)["total"]
    name = "model.layers.1.mlp.down_proj.weight"
    with safe_open(str(root / "fp16" / index["weight_map"][name]), "pt") as f:
        w = f.get_tensor(name)
    assert str(w.dtype) == "torch.float16" and tuple(w.shape) == (128, 256)
    assert 0.015 < float(w.float().std()) < 0.025  # INIT_STD, not zeros or garbage


def test_build_is_deterministic_per_tensor(tmp_path):
    import torch
    from safetensors.torch import load_file

    a = gd.build_checkpoint(tmp_path / "a", TINY, seed=1, device="cpu", max_shard_bytes=1 << 30)
    b = gd.build_checkpoint(tmp_path / "b", TINY, seed=1, device="cpu", max_shard_bytes=100_000)  # other sharding
    assert a["shards"] == 1 and b["shards"] > 1
    ta = load_file(str(next((tmp_path / "a").glob("*.safetensors"))))
    tb = {k: v for p in (tmp_path / "b").glob("*.safetensors") for k, v in load_file(str(p)).items()}
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.layers.0.self_attn.q_proj.weight"], ta["model.layers.1.self_attn.q_proj.weight"])


def test_quantized_checkpoint_counts_like_the_gptq_formula(tiny_checkpoints):
    root, _ = tiny_checkpoints
    formula = gl.gptq_step_bytes(TINY, bits=4, group_size=128, sym=True)
    assert gl.folder_step_bytes(root / "int4", read_zeros=False) == formula["total"]
    asym = gl.gptq_step_bytes(TINY, bits=4, group_size=128, sym=False)
    assert gl.folder_step_bytes(root / "int4", read_zeros=True) == asym["total"]
    config = json.loads((root / "int4" / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 4
    assert (root / "int4" / "tokenizer.json").exists()  # quantize copied the side files


def test_safetensors_header_reader_rejects_a_truncated_file(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        gl.read_safetensors_header(bad)
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        gl.checkpoint_step_bytes({"w": ("Q9", [2])}, read_zeros=False)


def test_tied_head_counts_the_embedding():
    tensors = {"model.embed_tokens.weight": ("F16", [10, 4]), "model.norm.weight": ("F16", [4])}
    assert gl.checkpoint_step_bytes(tensors, read_zeros=False) == 2 * (40 + 4)
    tensors["lm_head.weight"] = ("F16", [10, 4])
    assert gl.checkpoint_step_bytes(tensors, read_zeros=False) == 2 * (40 + 4)


# -- tokenizer --------------------------------------------------------------------------------------
def test_word_tokenizer_is_one_token_per_word_and_decodes_any_id():
    tok = gl.word_tokenizer(1024)
    assert tok.get_vocab_size(with_added_tokens=True) == 1024
    rng = random.Random(0)
    prompt = gl.random_prompt(rng, 500, 1024)
    ids = tok.encode(prompt, add_special_tokens=True).ids
    assert len(ids) == 500 and max(ids) < gl.word_ids(1024)
    assert tok.decode(ids) == prompt
    special = gl.special_ids(1024)
    assert tok.token_to_id("<|end_of_text|>") == special["eos"]
    assert tok.encode("_test _test").ids == [special["unk"]] * 2  # the router's warmup prompt
    assert tok.decode([special["eos"]], skip_special_tokens=False) == "<|end_of_text|>"


def test_full_vocabulary_uses_llama3_special_ids():
    assert gl.special_ids(128256) == {"bos": 128000, "eos": 128001, "unk": 128002}
    assert gl.word_ids(128256) == 128000
    assert gl.llama_config(gl.ModelShape())["eos_token_id"] == 128001
    with pytest.raises(ValueError, match="too small"):
        gl.special_ids(4)


# -- phase planner ----------------------------------------------------------------------------------
@pytest.mark.parametrize("requested, done, force, plan", [
    ("serve-int4", set(), False, ["build", "quantize", "serve-int4"]),
    ("serve-int4", {"build"}, False, ["quantize", "serve-int4"]),
    ("serve-int4", {"build", "quantize"}, False, ["serve-int4"]),
    ("serve-int4", {"quantize"}, False, ["build", "quantize", "serve-int4"]),  # a rebuild makes int4 stale
    ("serve-fp16", {"build", "quantize"}, False, ["serve-fp16"]),
    ("build", {"build"}, False, []),
    ("build", {"build", "quantize"}, True, ["build"]),
    ("quantize", {"build", "quantize"}, True, ["quantize"]),
    ("all", set(), False, ["build", "quantize", "serve-fp16", "serve-int4", "report"]),
    ("all", {"build", "quantize"}, False, ["serve-fp16", "serve-int4", "report"]),
    ("report", set(), False, ["report"]),
])
def test_plan_phases(requested, done, force, plan):
    assert gl.plan_phases(requested, done, force) == plan


def test_plan_phases_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown phase"):
        gl.plan_phases("serve", set())
    with pytest.raises(ValueError, match="only artifact phases"):
        gl.plan_phases("all", {"serve-fp16"})


def test_workspace_done_needs_a_matching_fingerprint(tmp_path):
    ws = gd.Workspace(tmp_path, tmp_path / "out")
    prints = {"build": gl.fingerprint(TINY, 0), "quantize": gl.fingerprint(TINY, 0, {"bits": 4})}
    assert ws.done(prints) == set()
    (tmp_path / "fp16").mkdir()
    (tmp_path / "fp16" / "config.json").write_text("{}")
    ws.marker("build").write_text(json.dumps({"fingerprint": prints["build"]}))
    assert ws.done(prints) == {"build"}
    assert ws.done({**prints, "build": gl.fingerprint(TINY, 1)}) == set()  # another seed: rebuild


# -- summaries, targets, table ----------------------------------------------------------------------
def _stream(start: float, ttft: float, step: float, tokens: int, error: str | None = None) -> gl.Stream:
    first = start + ttft
    return gl.Stream(sent=start, stamps=[first + i * step for i in range(tokens)], error=error)


def test_summarize_decode_per_stream_and_aggregate():
    streams = [_stream(0.0, 0.05, 0.010, 101), _stream(0.0, 0.06, 0.010, 101)]
    steps = {"tgi_batch_forward_duration": (0.8, 100.0), "tgi_batch_inference_duration": (1.0, 100.0)}
    s = gl.summarize_decode(streams, 101, steps)
    assert s["per_stream_tok_s"] == pytest.approx(100.0)
    assert s["aggregate_tok_s"] == pytest.approx(200 / 1.01)  # 200 decode tokens over 0.05 .. 1.06 s
    assert s["ttft_ms_p50"] == pytest.approx(55.0)
    assert s["itl_ms_p50"] == pytest.approx(10.0)
    assert s["forward_ms"] == pytest.approx(8.0) and s["step_ms"] == pytest.approx(10.0)
    assert s["host_gap_ms"] == pytest.approx(2.0)  # 10 ms between tokens, 8 of them the device's forward
    assert s["mean_batch"] == pytest.approx(2.0)
    assert s["short_streams"] == [] and s["error_count"] == 0


def test_summarize_decode_flags_errors_and_short_streams():
    streams = [_stream(0.0, 0.05, 0.01, 50), gl.Stream(sent=0.0, error="RESOURCE_EXHAUSTED: out of memory")]
    s = gl.summarize_decode(streams, 101, {})
    assert s["short_streams"] == [50]
    assert s["error_count"] == 1 and "out of memory" in s["errors"][0]
    assert s["forward_ms"] is None and s["mean_batch"] is None and s["host_gap_ms"] is None
    empty = gl.summarize_decode([gl.Stream(sent=0.0, error="x")], 10, {})
    assert empty["per_stream_tok_s"] is None and empty["aggregate_tok_s"] is None


def test_summarize_prefill_uses_medians():
    s = gl.summarize_prefill(8192, [1.0, 0.5, 0.6], [0.4, 0.45, 0.5], [])
    assert s["ttft_ms"] == pytest.approx(600.0)
    assert s["tok_s"] == pytest.approx(8192 / 0.6)
    assert s["forward_tok_s"] == pytest.approx(8192 / 0.45)
    assert gl.summarize_prefill(1024, [], [], ["boom"])["tok_s"] is None


def test_oom_lines_finds_allocator_failures():
    log = "ok\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nfine\n"
    assert gl.oom_lines(log) == ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert gl.oom_lines("all good\n") == []


def _model(kind: str, tok_s_1: float, aggregate_64: float, prefill_errors: list[str] | None = None) -> dict:
    shape = gl.ModelShape()
    per_step = gl.dense_step_bytes(shape) if kind == "fp16" else gl.gptq_step_bytes(shape, 4, 128)
    level = {"per_stream_tok_s": tok_s_1, "aggregate_tok_s": tok_s_1, "ttft_ms_p50": 20.0, "forward_ms": 1e3 / tok_s_1,
             "errors": [], "error_count": 0, "short_streams": []}
    return {
        "bytes_per_step": per_step,
        "checkpoint_step_bytes": per_step["total"],
        "server": {"command": f"serve {kind}"},
        "decode": {"1": level, "64": {**level, "per_stream_tok_s": aggregate_64 / 64, "aggregate_tok_s": aggregate_64}},
        "prefill": {"32768": gl.summarize_prefill(32768, [2.0, 2.1, 2.2], [1.9, 2.0, 2.1], prefill_errors or []),
                    "1024": gl.summarize_prefill(1024, [0.05], [0.04], [])},
        "oom_lines": [],
    }


def _results(fp16_tok_s: float, int4_tok_s: float, copy_gbs: float = 3000.0, **kw) -> dict:
    return {"device": {"name": "NVIDIA H100 80GB HBM3", "copy_gbs": copy_gbs, "torch": "2.11.0"},
            "shape": {"hidden": 4096, "layers": 32}, "date": "2026-11-24",
            "models": {"fp16": _model("fp16", fp16_tok_s, 5000.0), "int4": _model("int4", int4_tok_s, 9000.0, **kw)}}


def test_targets_met_and_missed():
    # Limits at 3000 GB/s: fp16 15.01 GB/step -> 199.9 tok/s, int4 4.65 GB/step -> 645.2 tok/s.
    met = {t.name: t for t in gl.check_targets(_results(170.0, 530.0))}
    assert all(t.status == "MET" for t in met.values()), met
    share = met["int4 decode at batch 1 >= 80% of its weight-bandwidth limit"].value
    assert share == pytest.approx(530 * 4_649_918_464 / 1e9 / 3000)
    assert met["int4 decode at batch 1 >= 2.5x fp16"].value == pytest.approx(530 / 170)
    missed = {t.name: t.status for t in gl.check_targets(_results(150.0, 360.0, prefill_errors=["OOM"]))}
    assert missed["fp16 decode at batch 1 >= 80% of its weight-bandwidth limit"] == "MISSED"  # 75%
    assert missed["int4 decode at batch 1 >= 80% of its weight-bandwidth limit"] == "MISSED"  # 56%
    assert missed["int4 decode at batch 1 >= 2.5x fp16"] == "MISSED"  # 2.4x
    assert missed["int4: 32k-token prefill runs"] == "MISSED"
    assert missed["fp16: 32k-token prefill runs"] == "MET"


def test_targets_not_run_without_data_and_oom_missed():
    results = _results(170.0, 530.0)
    del results["models"]["int4"]
    results["models"]["fp16"]["oom_lines"] = ["CUDA out of memory"]
    status = {t.name: t.status for t in gl.check_targets(results)}
    assert status["int4 decode at batch 1 >= 2.5x fp16"] == "NOT RUN"
    assert status["int4: no OOM after warmup at any load"] == "NOT RUN"
    assert status["fp16: no OOM after warmup at any load"] == "MISSED"
    no_copy = _results(170.0, 530.0, copy_gbs=None)
    assert {t.name: t.status for t in gl.check_targets(no_copy)}[
        "fp16 decode at batch 1 >= 80% of its weight-bandwidth limit"] == "NOT RUN"


def test_report_table_has_ratios_bandwidth_and_statuses():
    table = gl.format_report(_results(170.0, 530.0))
    assert "NVIDIA H100 80GB HBM3" in table and "2026-11-24" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "| 170.0 | 170 | 530.0 | 530 | 3.12x |" in rows["1"]
    assert "| 5000 | 140.6 | 9000 | 1.80x |" in rows["64"]
    assert "| 15.01 | 200 | 170.0 | 2552 | 85% |" in rows["fp16"]
    assert "| 4.65 | 645 | 530.0 | 2464 | 82% |" in rows["int4"]
    assert "| 32768 | 2100 | 15604 |" in rows["32768"]
    assert table.count("**MET**") == 7 and "MISSED" not in table


def test_merge_keeps_both_models_and_latest_device():
    a = {"device": {"name": "A"}, "models": {"fp16": {"x": 1}}, "build_s": 10.0, "quantize_s": None}
    b = {"device": {"name": "B"}, "models": {"int4": {"y": 2}}, "build_s": None, "quantize_s": 20.0}
    merged = gl.merge_results([a, b])
    assert merged["models"] == {"fp16": {"x": 1}, "int4": {"y": 2}}
    assert merged["device"] == {"name": "B"} and merged["build_s"] == 10.0 and merged["quantize_s"] == 20.0


def test_serve_flags_fit_the_longest_prompt_and_batch():
    flags = gl.serve_flags("cuda", "float16", 32768, 256, 64, "1,2,4,8,16,32,64", ["--attention-backend", "x"])
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--max-input-tokens"] == "32768" and pairs["--max-total-tokens"] == "33024"
    assert pairs["--max-batch-prefill-tokens"] == "32768"  # the 32k prompt is one prefill
    assert pairs["--cuda-graphs"] == "1,2,4,8,16,32,64" and pairs["--attention-backend"] == "x"
    assert "--cuda-graphs" not in gl.serve_flags("cpu", "float32", 64, 8, 2, "1,2", [])
    with pytest.raises(ValueError, match="max_batch"):
        gl.serve_flags("cuda", "float16", 64, 8, 0, "", [])


def test_report_phase_merges_inputs_on_a_machine_without_gpu(tmp_path, capsys):
    fp16 = _results(170.0, 530.0)
    int4 = {**fp16, "models": {"int4": fp16["models"].pop("int4")}}
    (tmp_path / "a.json").write_text(json.dumps(fp16))
    (tmp_path / "b.json").write_text(json.dumps(int4))
    code = gd.main(["--phase", "report", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                    "--inputs", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert code == 0
    assert "| 1 | 170.0 | 170 | 530.0 | 530 | 3.12x |" in capsys.readouterr().out
    summary = json.loads((tmp_path / "o" / "gpu_decode_summary.json").read_text())
    assert {t["status"] for t in summary["targets"]} == {"MET"}
    assert (tmp_path / "o" / "gpu_decode_table.md").exists()


def test_chunked_prefill_flags_and_retry_rule():
    flags = gl.serve_flags("cuda", "float16", 32768, 256, 64, "", [], prefill_tokens=8192)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--max-input-tokens"] == "32768" and pairs["--max-batch-prefill-tokens"] == "8192"
    warmup_oom = ("RouterError: warmup failed: a forward pass over max_batch_prefill_tokens=32768 does not fit in "
                  "memory (CUDA out of memory. Tried to allocate 15.66 GiB); lower --max-batch-prefill-tokens")
    assert gl.retry_chunked(warmup_oom, None, 8192)
    assert not gl.retry_chunked(warmup_oom, 8192, 8192)  # already chunked that small
    assert not gl.retry_chunked(warmup_oom, None, 0)  # retry turned off
    assert not gl.retry_chunked("the server exited with code 1: KeyError 'lm_head.weight'", None, 8192)
    assert not gl.retry_chunked(None, None, 8192)


def test_summarize_decode_flags_streams_delivered_in_bursts():
    steps = {"tgi_batch_forward_duration": (0.5, 50.0)}  # 10 ms per forward
    paced = gl.summarize_decode([_stream(0.0, 0.05, 0.010, 51)], 51, steps)
    burst = gl.summarize_decode([_stream(0.0, 0.55, 0.0001, 51)], 51, steps)  # 50 tokens in 5 ms
    assert paced["bunched_streams"] == 0 and burst["bunched_streams"] == 1
    results = _results(170.0, 530.0)
    results["models"]["fp16"]["decode"]["1"]["bunched_streams"] = 1
    assert "fp16 batch 1: 1 stream(s) received their tokens in bursts" in gl.format_report(results)


def test_bandwidth_target_is_not_judged_on_bursty_delivery():
    results = _results(170.0, 530.0)
    results["models"]["int4"]["decode"]["1"]["bunched_streams"] = 1
    target = next(t for t in gl.check_targets(results) if t.name.startswith("int4 decode at batch 1 >= 80%"))
    assert target.status == "NOT RUN" and "forward-only share 82%" in target.detail
