"""Decode and prefill of a random Llama-3-8B through `serve` on a GPU: fp16 against our 4-bit RTN.

Why a random model: no model hub is reachable from the device, and speed depends on the shapes
alone (hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab 128256), not on the
values. The phases, each resumable from the artifacts the previous ones left in --work-dir
(one device command may run only 10 minutes, and a fresh machine starts bare):

- build: random fp16 weights drawn on the GPU tensor by tensor (seeded per tensor, so every
  machine builds the same model), written as safetensors shard by shard, with a Llama-3.1
  config and a word-level tokenizer of 128256 entries (`w0` .. `w127999` plus specials), so a
  prompt of N words is exactly N tokens;
- quantize: `text-generation-server quantize --method rtn --bits 4 --groupsize 128 --device cuda`,
  timed;
- serve-fp16 / serve-int4: the real launcher and router (`text-generation-server serve`) on free
  ports; requests from the client gRPC API with ignore_eos_token set, so every stream runs to
  max_new_tokens. Measures decode tok/s per stream and aggregate at each batch (that many
  requests at once), TTFT, prefill tok/s at each prompt length (one request, max_new_tokens 1),
  and the weight-bandwidth efficiency at batch 1: weight bytes read per decode step / step time,
  as a share of the device's copy bandwidth (read + write bytes of a 1 GiB device-to-device
  copy / time, benchmarks/attention_cuda.py's copy_gbs, measured in a child process before the
  server starts). The step time comes from the client (1 / tok/s per stream) and from the
  router's tgi_batch_forward_duration (decode) histogram;
- report: the ratio table (fp16 against int4, per batch, MET/MISSED per target) from whatever
  results exist (work dir, --inputs), printed and written as Markdown and JSON.

A requested phase runs the phases it needs whose artifacts are missing (serve-int4 on a bare
machine builds, quantizes, then serves). Results go to --out (default $OUT, else
WORK_DIR/results); the report runs on any machine: copy the JSONs back and
`python benchmarks/gpu_decode.py --phase report --inputs a.json b.json`.

    python benchmarks/gpu_decode.py --phase serve-fp16          # build if needed, then serve fp16
    python benchmarks/gpu_decode.py --phase serve-int4          # quantize if needed, serve, report
    python benchmarks/gpu_decode.py --phase all --device cpu --dtype float32 --layers 2 --hidden 128 \\
        --intermediate 256 --heads 4 --kv-heads 2 --vocab 1024 --batches 1,2 --prefill-lengths 64 \\
        --prompt-tokens 16 --new-tokens 8 --groupsize 64     # a CPU dry run of every phase

Weight bytes per step, summaries, targets and the table live in benchmarks/gpu_bench_logic.py
(tested on CPU by tests/test_gpu_bench_logic.py). benchmarks/gpu_all.sh is the one command a GPU
session runs; its header lists the device commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))  # gpu_bench_logic, bench_common, attention_cuda are siblings

from bench_common import (  # noqa: E402
    StartedServer, cli_entry, fmt_value, now_iso, parse_ints, scrape_steps, steps_delta, stream_generate,
)
from gpu_bench_logic import (  # noqa: E402
    BATCHES, MODELS, PHASES, PREFILL_LENGTHS, ModelShape, Stream, check_targets, dense_step_bytes, fingerprint,
    folder_step_bytes, format_report, gptq_step_bytes, llama_config, merge_results, oom_lines, plan_phases,
    random_prompt, retry_chunked, serve_flags, shard_plan, special_ids, summarize_decode, summarize_prefill,
    word_tokenizer,
)

INIT_STD = 0.02  # transformers' initializer_range for Llama: activations stay far from fp16's range


# -- build ------------------------------------------------------------------------------------------------
def write_side_files(folder: Path, shape: ModelShape, dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llama_config(shape, dtype), indent=2) + "\n")
    ids = special_ids(shape.vocab)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "do_sample": False}, indent=2) + "\n")
    word_tokenizer(shape.vocab).save(str(folder / "tokenizer.json"))


def build_checkpoint(folder: Path, shape: ModelShape, seed: int, device: str = "cuda",
                     max_shard_bytes: int = 4 << 30) -> dict:
    """Writes a random fp16 checkpoint of `shape` to `folder`, drawing each tensor on `device`.

    Each tensor has its own generator seed (seed, tensor index), so the model does not depend on
    sharding or device order; norms are ones. Written into a staging folder renamed at the end,
    so an interrupted build never looks complete.
    """
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    staging = folder.parent / f".{folder.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    write_side_files(staging, shape, "float16")
    shapes = shape.tensor_shapes()
    order = {name: i for i, name in enumerate(shapes)}
    shards = shard_plan(shapes, max_shard_bytes)
    gen = torch.Generator(device=device)
    weight_map: dict[str, str] = {}
    total = 0
    started = time.monotonic()
    for number, names in enumerate(shards, 1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                t = torch.ones(shapes[name], dtype=torch.float16, device=device)
            else:
                gen.manual_seed(seed * 1_000_003 + order[name])
                t = torch.randn(shapes[name], generator=gen, dtype=torch.float16, device=device).mul_(INIT_STD)
            tensors[name] = t.cpu()
            weight_map[name] = file_name
        save_file(tensors, str(staging / file_name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"build: shard {number}/{len(shards)} ({len(names)} tensors), {total / 1e9:.2f} GB written, "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        del tensors
    (staging / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.rename(staging, folder)
    if device == "cuda":
        torch.cuda.empty_cache()  # the server started next in this run gets the memory back
    return {"bytes": total, "shards": len(shards), "seconds": time.monotonic() - started}


# -- the server phases --------------------------------------------------------------------------------
def device_probe(device: str) -> dict:
    """GPU name, torch version and copy bandwidth, measured in a child process so this client
    process never holds a CUDA context beside the server's."""
    if device != "cuda":
        import torch

        return {"name": f"cpu ({os.cpu_count()} cores)", "copy_gbs": None, "torch": torch.__version__}
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); from attention_cuda import copy_gbs; "
            "p = torch.cuda.get_device_properties(0); "
            "print(json.dumps({'name': torch.cuda.get_device_name(0), 'copy_gbs': copy_gbs(), "
            "'torch': torch.__version__, 'memory_gib': p.total_memory / 2**30, "
            "'capability': '.'.join(map(str, torch.cuda.get_device_capability(0)))}))")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH_DIR)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"device probe failed:\n{out.stderr[-2000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        info["driver"] = q.stdout.strip() if q.returncode == 0 else None
    return info


def gpu_memory_used_mib() -> float | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    q = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True,
                       text=True, timeout=30)
    try:
        return float(q.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


async def _stream(stub, cpb, prompt: str, new_tokens: int) -> Stream:
    params = cpb.GenerateParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    return await stream_generate(stub, cpb.GenerateRequest(inputs=prompt, parameters=params))


async def _decode_level(stub, cpb, server, args: argparse.Namespace, rng: random.Random, vocab: int,
                        batch: int) -> dict:
    """`batch` streams sent at once, after a short round of the same size (its first steps may
    compile kernels for this batch size); router histograms scraped around the measured round."""
    def prompt() -> str:
        return random_prompt(rng, args.prompt_tokens, vocab)

    await asyncio.gather(*(_stream(stub, cpb, prompt(), min(8, args.new_tokens)) for _ in range(batch)))
    before = scrape_steps(server.metrics_url)
    streams = await asyncio.gather(*(_stream(stub, cpb, prompt(), args.new_tokens) for _ in range(batch)))
    level = summarize_decode(list(streams), args.new_tokens, steps_delta(before, scrape_steps(server.metrics_url)))
    level["gpu_memory_mib"] = gpu_memory_used_mib()
    print(f"batch {batch}: {fmt_value(level['per_stream_tok_s'], '{:.1f}')} tok/s per stream, "
          f"{fmt_value(level['aggregate_tok_s'])} aggregate, forward {fmt_value(level['forward_ms'], '{:.2f}')} ms, "
          f"{level['error_count']} errors", file=sys.stderr, flush=True)
    return level


async def _prefill_length(stub, cpb, server, args: argparse.Namespace, rng: random.Random, vocab: int,
                          length: int) -> dict:
    """One warm-up then --prefill-reps single requests of `length` prompt tokens and one new token."""
    ttfts, forwards, errors = [], [], []
    for rep in range(args.prefill_reps + 1):
        before = scrape_steps(server.metrics_url)
        s = await _stream(stub, cpb, random_prompt(rng, length, vocab), 1)
        steps = steps_delta(before, scrape_steps(server.metrics_url))
        if s.error or not s.stamps:
            errors.append(s.error or "no token streamed")
        elif rep > 0:
            ttfts.append(s.stamps[0] - s.sent)
            fwd_sum, fwd_n = steps.get("tgi_batch_forward_duration/prefill", (0.0, 0.0))
            if fwd_n > 0:
                forwards.append(fwd_sum)
    result = summarize_prefill(length, ttfts, forwards, errors)
    print(f"prefill {length}: TTFT {fmt_value(result['ttft_ms'])} ms, {fmt_value(result['tok_s'])} tok/s, "
          f"{result['error_count']} errors", file=sys.stderr, flush=True)
    return result


async def _client_runs(server, args: argparse.Namespace, vocab: int, out: dict) -> None:
    import grpc

    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    rng = random.Random(args.seed)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(server.target, options=options) as channel:
        stub = cpb_grpc.TextGenerationStub(channel)
        info = await stub.Info(cpb.InfoRequest(), timeout=30)
        out["server"].update({"model_dtype": info.model_dtype, "device_type": info.model_device_type,
                              "quantize": info.quantize, "kernels": list(info.kernels),
                              "attention_backend": info.attention_backend,
                              "max_batch_total_tokens": info.max_batch_total_tokens,
                              "max_batch_prefill_tokens": info.max_batch_prefill_tokens})
        probe = random_prompt(rng, args.prompt_tokens, vocab)
        counted = len((await stub.Tokenize(cpb.TokenizeRequest(inputs=probe), timeout=30)).tokens)
        if counted != args.prompt_tokens:
            raise RuntimeError(f"a {args.prompt_tokens}-word prompt tokenized to {counted} tokens: the served "
                               "tokenizer is not the word-level one this benchmark writes")
        for batch in args.batches:
            out["decode"][str(batch)] = await _decode_level(stub, cpb, server, args, rng, vocab, batch)
        for length in args.prefill_lengths:
            out["prefill"][str(length)] = await _prefill_length(stub, cpb, server, args, rng, vocab, length)


async def measure_server(args: argparse.Namespace, model_dir: Path, shape: ModelShape, out: dict,
                         prefill_tokens: int | None = None) -> None:
    """Starts `serve` on model_dir, runs every decode batch and prefill length, stops it.

    Fills `out` as it goes (the caller keeps what was measured if this is interrupted). The server
    log after warmup is searched for out-of-memory reports; the whole log goes under '_log'.
    """
    import grpc

    max_input = max([*args.prefill_lengths, args.prompt_tokens])
    flags = serve_flags(args.device, args.dtype, max_input, args.new_tokens, max(args.batches), args.cuda_graphs,
                        args.server_args, prefill_tokens)
    server = StartedServer(str(model_dir), flags, args.startup_timeout_s)
    # The server runs in its own session: if this process is killed past its SIGTERM handling,
    # gpu_all.sh stops that process group from this file.
    pgid_file = args.work_dir / "server.pgid"
    pgid_file.write_text(str(server.proc.pid))
    out.update({"server": {"command": " ".join(server.command)}, "decode": {}, "prefill": {}})
    ready_at = None  # log size when the server turned SERVING: what follows is after warmup
    try:
        out["startup_s"] = await server.wait_ready()
        ready_at = server.log_path.stat().st_size
        out["gpu_memory_mib_after_warmup"] = gpu_memory_used_mib()
        print(f"server ready in {out['startup_s']:.0f} s", file=sys.stderr, flush=True)
        await _client_runs(server, args, shape.vocab, out)
    except RuntimeError as exc:
        out["startup_error" if ready_at is None else "client_error"] = str(exc)[:4000]
    except grpc.aio.AioRpcError as exc:  # the server died or refused mid-run
        out["client_error"] = f"{exc.code().name}: {exc.details()}"
    finally:
        log = server.log_path.read_bytes() if server.log_path.exists() else b""
        after = log[ready_at:].decode(errors="replace") if ready_at is not None else ""
        out["oom_lines"] = oom_lines(after)[:10]
        out["_log"] = log.decode(errors="replace")
        server.stop()
        pgid_file.unlink(missing_ok=True)


# -- phase drivers ----------------------------------------------------------------------------------------
class Workspace:
    """The work dir: fp16/ and int4/ checkpoints, markers of finished artifact phases, results."""

    def __init__(self, root: Path, out: Path):
        self.root = root
        self.out = out
        self.fp16 = root / "fp16"
        self.int4 = root / "int4"

    def marker(self, phase: str) -> Path:
        return self.root / f"{phase}.json"

    def read_marker(self, phase: str) -> dict | None:
        path = self.marker(phase)
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None

    def done(self, prints: dict[str, dict]) -> set[str]:
        """Artifact phases whose marker matches the wanted fingerprint and whose folder exists."""
        done = set()
        for phase, folder in (("build", self.fp16), ("quantize", self.int4)):
            marker = self.read_marker(phase)
            if marker and marker.get("fingerprint") == prints[phase] and (folder / "config.json").exists():
                done.add(phase)
        return done

    def write(self, name: str, data: dict) -> Path:
        """Writes a result JSON to the work dir and to --out."""
        text = json.dumps(data, indent=2, default=str) + "\n"
        for folder in {self.root, self.out}:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        return self.out / name


def run_quantize(ws: Workspace, args: argparse.Namespace) -> dict:
    """Our quantize command on the fp16 checkpoint, timed; its log streams through."""
    entry = cli_entry()
    command = [*entry, "quantize", str(ws.fp16), str(ws.int4), "--method", "rtn", "--bits", str(args.bits),
               "--groupsize", str(args.groupsize), "--device", args.device, "--overwrite"]
    print(f"quantize: {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run(command)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"quantize exited with code {proc.returncode} after {seconds:.0f} s")
    size = sum(p.stat().st_size for p in ws.int4.glob("*.safetensors"))
    return {"seconds": seconds, "bytes": size, "command": " ".join(command[len(entry):])}


def model_entry(ws: Workspace, kind: str, shape: ModelShape, args: argparse.Namespace) -> dict:
    """Weight bytes per decode step by formula, and counted from the checkpoint's headers as a check
    (quantize writes symmetric weights by default: no zero points are read)."""
    if kind == "fp16":
        formula, folder = dense_step_bytes(shape), ws.fp16
    else:
        formula, folder = gptq_step_bytes(shape, args.bits, args.groupsize, sym=True), ws.int4
    return {"bytes_per_step": formula, "checkpoint_step_bytes": folder_step_bytes(folder, read_zeros=False)}


def serve_phase(ws: Workspace, kind: str, shape: ModelShape, args: argparse.Namespace, common: dict) -> int:
    """Measures one model through `serve` and writes gpu_decode_<kind>.json, also when stopped
    part-way (SIGTERM from gpu_all.sh's timeout): the levels measured so far are kept."""
    device = device_probe(args.device)
    entry = model_entry(ws, kind, shape, args)
    measured: dict = {}
    folder = ws.fp16 if kind == "fp16" else ws.int4
    try:
        asyncio.run(measure_server(args, folder, shape, measured))
        if retry_chunked(measured.get("startup_error"), None, args.fallback_prefill_tokens):
            # The warmup's one-chunk prefill of the longest prompt did not fit: measure with chunked
            # prefill rather than not at all, and keep why.
            first = {k: measured[k] for k in ("server", "startup_error") if k in measured}
            print(f"{kind}: warmup ran out of memory; again with --max-batch-prefill-tokens "
                  f"{args.fallback_prefill_tokens}", file=sys.stderr, flush=True)
            measured = {"first_attempt": first}
            asyncio.run(measure_server(args, folder, shape, measured, args.fallback_prefill_tokens))
    except BaseException as exc:
        measured.setdefault("client_error", f"interrupted: {type(exc).__name__} {exc}")
        raise
    finally:
        log = measured.pop("_log", "")
        (ws.out / f"server_{kind}.log").write_text(log[-(2 << 20):])
        entry.update(measured)
        build, quant = ws.read_marker("build") or {}, ws.read_marker("quantize") or {}
        ws.write(f"gpu_decode_{kind}.json", {**common, "device": device, "models": {kind: entry},
                                             "build_s": build.get("seconds"),
                                             "quantize_s": quant.get("seconds") if kind == "int4" else None})
    status = 0
    for key in ("startup_error", "client_error"):
        if entry.get(key):
            print(f"{kind}: {key.replace('_', ' ')}:\n{entry[key]}", file=sys.stderr)
            status = 1
    return status


def run_plan(args: argparse.Namespace) -> int:
    shape = ModelShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                       intermediate=args.intermediate, vocab=args.vocab)
    ws = Workspace(args.work_dir, args.out)
    prints = {"build": fingerprint(shape, args.seed),
              "quantize": fingerprint(shape, args.seed, {"bits": args.bits, "groupsize": args.groupsize})}
    plan = plan_phases(args.phase, ws.done(prints), args.force)
    print(f"plan: {' -> '.join(plan)} (work dir {ws.root}, results to {ws.out})", file=sys.stderr, flush=True)
    ws.root.mkdir(parents=True, exist_ok=True)
    ws.out.mkdir(parents=True, exist_ok=True)
    common = {"shape": asdict(shape), "date": now_iso()}
    status = 0
    for phase in plan:
        started = time.monotonic()
        if phase == "build":
            record = build_checkpoint(ws.fp16, shape, args.seed, args.device, args.max_shard_mb << 20)
            ws.marker("build").write_text(json.dumps({"fingerprint": prints["build"], **record}, indent=2))
        elif phase == "quantize":
            record = run_quantize(ws, args)
            ws.marker("quantize").write_text(json.dumps({"fingerprint": prints["quantize"], **record}, indent=2))
        elif phase in ("serve-fp16", "serve-int4"):
            status |= serve_phase(ws, phase.removeprefix("serve-"), shape, args, common)
        elif phase == "report":
            report(args, ws)
        print(f"phase {phase}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if "report" not in plan and any(p.startswith("serve-") for p in plan):
        report(args, ws)
    return status


def report(args: argparse.Namespace, ws: Workspace) -> dict:
    """Merges the result JSONs of the work dir and --inputs, prints and writes the table."""
    paths = [ws.root / f"gpu_decode_{kind}.json" for kind in MODELS] + list(args.inputs)
    parts = []
    for path in paths:
        if Path(path).exists():
            parts.append(json.loads(Path(path).read_text()))
    if not parts:
        raise RuntimeError(f"no results to report: none of {', '.join(map(str, paths))} exists")
    merged = merge_results(parts)
    merged["targets"] = [asdict(t) for t in check_targets(merged)]
    table = format_report(merged)
    ws.out.mkdir(parents=True, exist_ok=True)
    (ws.out / "gpu_decode_summary.json").write_text(json.dumps(merged, indent=2, default=str) + "\n")
    (ws.out / "gpu_decode_table.md").write_text(table + "\n")
    print(table)
    return merged


def _terminate(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", default="all", choices=[*PHASES, "all"])
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TGS_GPU_WORK", "/tmp/tgs-gpu-decode")),
                    help="checkpoints and markers (default $TGS_GPU_WORK or /tmp/tgs-gpu-decode)")
    ap.add_argument("--out", type=Path, default=None, help="result files (default $OUT, else WORK_DIR/results)")
    ap.add_argument("--inputs", nargs="*", default=[], type=Path, help="report: more result JSONs to merge")
    ap.add_argument("--force", action="store_true", help="rebuild / requantize even if current")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    shape = ModelShape()
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(shape, name))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--groupsize", type=int, default=128)
    ap.add_argument("--max-shard-mb", type=int, default=4096)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--prefill-lengths", default=",".join(map(str, PREFILL_LENGTHS)))
    ap.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per length (after one warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt of each decode stream")
    ap.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens of each decode stream")
    ap.add_argument("--cuda-graphs", default="1,2,4,8,16,32,64", help="serve --cuda-graphs ('' for its default)")
    ap.add_argument("--server-args", default="", help="extra serve flags, one shell string")
    ap.add_argument("--startup-timeout-s", type=float, default=480.0)
    ap.add_argument("--fallback-prefill-tokens", type=int, default=8192,
                    help="if warmup runs out of memory, start once more with this --max-batch-prefill-tokens "
                         "(chunked prefill); 0: no retry")
    args = ap.parse_args(argv)
    try:
        args.batches = parse_ints(args.batches, "--batches")
        args.prefill_lengths = parse_ints(args.prefill_lengths, "--prefill-lengths")
        if args.new_tokens < 2 or args.prompt_tokens < 1 or args.prefill_reps < 1:
            raise ValueError("--new-tokens must be >= 2, --prompt-tokens and --prefill-reps >= 1")
        args.server_args = shlex.split(args.server_args)
        ModelShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                   intermediate=args.intermediate, vocab=args.vocab)
    except ValueError as exc:
        ap.error(str(exc))
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else args.work_dir / "results"
    if args.phase != "report" and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchmarks/gpu_decode.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "--device cpu runs a small dry run, --phase report merges results anywhere.", file=sys.stderr)
            return 2
    try:
        if args.phase == "report":
            report(args, Workspace(args.work_dir, args.out))
            return 0
        # `timeout` stops a step with SIGTERM: unwind, so the server is stopped and partial results kept.
        signal.signal(signal.SIGTERM, _terminate)
        return run_plan(args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
