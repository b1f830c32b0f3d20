"""Startup time and resident memory of `serve` (issue #33), median of N starts per model.

For each model: the time from running `serve` to the client API's health check answering
SERVING (the router serves only after every rank's warmup); each rank's resident memory then
(VmRSS of every `--shard-only` process of the server's session, the launcher's reported apart)
against the rank's weights + KV cache (from its "resident memory after warmup" log line: the
parameters' bytes at the served dtype, the KV cache's allocated bytes); and the first request's
latency against a warm one's (median of 3 after it). Every request is a different prompt of the
same length whose first block differs (one letter near its start), and the client's channel is
connected before the first is timed: with one prompt repeated, the warm requests took its full
blocks from the prefix cache and prefilled only the tokens past them (on Qwen2.5's tokenizer 8
of 40; the first prefilled all 40), which was most of the gap measured before; and a channel's
connection is the client's cost, not the server's. Targets (the issue's):
serving within 3 s on the embedded model and 10 s on a 1.5B bf16 model, resident <= 1.15 x
(weights + KV) + 300 MiB, first request within 1.2x of a warm one.

    python benchmarks/startup.py                                  # the embedded model
    python benchmarks/startup.py --write-qwen 1.5b /tmp/q15       # + a random Qwen2.5-1.5B-shaped bf16 folder
    python benchmarks/startup.py --model /path/to/folder --dtype bfloat16
    python benchmarks/startup.py --compare-tree /tmp/base     # + another checkout's code, side by side
    python benchmarks/startup.py --llama-server ./llama-server --gguf model.gguf   # + llama-server's start

The random folder has the real model's shapes and tensor names (and the embedded model's
tokenizer, whose ids all fall inside the vocabulary): what loading and warmup cost depends on
those, not on the values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import StartedServer, command_line, free_port, machine_line, md_table, now_iso  # noqa: E402

MIB = 2**20
PROMPT = "def fibonacci(n):\n    " * 8
PROMPT_TAIL = "fibonacci(n):\n    " + "def fibonacci(n):\n    " * 7


def distinct_prompts(count: int) -> list[str]:
    """`count` prompts of one length (PROMPT with its first `fibonacci` replaced by one letter, a
    different one each), no two sharing a first block: the prefix cache serves none from another."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    if count > len(letters):
        raise ValueError(f"at most {len(letters)} requests per start, asked for {count}")
    return [f"def {letters[i]}{PROMPT_TAIL}" for i in range(count)]
QWEN_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}
RESIDENT = re.compile(r"weights (\d+) MiB(?: \([^)]*\))? \+ KV cache (\d+) MiB")
PHASE = re.compile(r"startup: (.+?)(?:: \d+ \w+)? in ([\d.]+) s")
WARMUP_PHASES = re.compile(r"warmup phases: (.*)")
KV_MIB = re.compile(r"bytes per token, ([\d.]+) MiB")  # the warmup line, in every version


def write_qwen(folder: Path, shape: str) -> Path:
    """A random-init bf16 Qwen2.5-shaped checkpoint (tied embeddings, q/k/v biases) with the
    embedded model's tokenizer; written once (kept when config.json exists)."""
    import torch
    from safetensors.torch import save_file

    from text_generation_server.utils.locate import embedded_model_path

    if (folder / "config.json").exists():
        return folder
    dims = QWEN_SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(embedded_model_path() / name, folder / name)
    hidden, inter = dims["hidden_size"], dims["intermediate_size"]
    kv = dims["num_key_value_heads"] * hidden // dims["num_attention_heads"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape_):
        return (torch.randn(*shape_, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(151936, hidden), "model.norm.weight": torch.ones(hidden).bfloat16()}
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.q_proj.bias": rand(hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden), p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(hidden, hidden), p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden), p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                  tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=0,
                  use_sliding_window=False, **dims)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every process in session `sid`."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def wait_serving(server: StartedServer, started: float, timeout_s: float) -> float:
    """Seconds from `started` until health answers SERVING (polled every 50 ms)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - started < timeout_s:
            if server.returncode is not None:
                raise RuntimeError(f"serve exited with {server.returncode}:\n{server.log_tail()}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - started
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"not SERVING after {timeout_s:.0f} s:\n{server.log_tail()}")


async def request_latencies(server: StartedServer, new_tokens: int, warm: int = 3) -> tuple[float, float]:
    """(first request's seconds, median of the `warm` identical ones after it)."""
    import grpc

    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    async with grpc.aio.insecure_channel(server.target) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = cpb_grpc.TextGenerationStub(channel)
        times = []
        for prompt in distinct_prompts(1 + warm):
            request = cpb.GenerateRequest(inputs=prompt, parameters=cpb.GenerateParameters(
                max_new_tokens=new_tokens, ignore_eos_token=True))
            started = time.perf_counter()
            await stub.Generate(request, timeout=600)
            times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:])


def tree_env(tree: str | None) -> dict[str, str]:
    """The environment that runs another checkout's code (its three source folders first on the path)."""
    if tree is None:
        return {}
    portions = [str(Path(tree) / part) for part in ("kernels", "quantizers", "server")]
    return {"PYTHONPATH": os.pathsep.join([*portions, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def one_start(model: str, extra: list[str], new_tokens: int, timeout_s: float, tree: str | None = None,
              warm: int = 3) -> dict:
    started = time.monotonic()
    with StartedServer(model, extra, startup_timeout_s=timeout_s, env=tree_env(tree)) as server:
        ready = asyncio.run(wait_serving(server, started, timeout_s))
        procs = session_processes(server.proc.pid)
        ranks = {pid: rss_mib(pid) for pid, cmd in procs.items() if "--shard-only" in cmd}
        launcher = sum(rss_mib(pid) for pid in procs if pid not in ranks)
        log = server.log_path.read_text(errors="replace")
        weights_kv = [(int(w), int(k)) for w, k in RESIDENT.findall(log)]
        kv = [float(k) for k in KV_MIB.findall(log)]
        phases = {name: float(sec) for name, sec in PHASE.findall(log)}
        for line in WARMUP_PHASES.findall(log)[-1:]:
            for part in line.split(", "):
                name, _, sec = part.rpartition(" ")[0].rpartition(" ")
                phases[f"warmup: {name}"] = float(sec)
        first, warm_s = asyncio.run(request_latencies(server, new_tokens, warm))
    return dict(ready=ready, ranks=list(ranks.values()), launcher=launcher, weights_kv=weights_kv,
                kv=kv[-1] if kv else 0, first=first, warm=warm_s, phases=phases)


def llama_server_start(binary: str, gguf: str, timeout_s: float) -> tuple[float, float]:
    """(seconds until llama-server's /health answers 200, its RSS in MiB then)."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < timeout_s:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                    if reply.status == 200:
                        return time.monotonic() - started, rss_mib(proc.pid)
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("llama-server did not answer /health")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[], help="a checkpoint folder (repeatable); "
                        "the embedded model is always measured")
    parser.add_argument("--write-qwen", nargs=2, metavar=("SHAPE", "FOLDER"), help="write a random Qwen2.5 "
                        f"folder of SHAPE ({', '.join(QWEN_SHAPES)}) and measure it")
    parser.add_argument("--dtype", default="bfloat16", help="--dtype for the folders given (default bfloat16)")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--warm", type=int, default=3, help="warm requests after the first (their median)")
    parser.add_argument("--skip-embedded", action="store_true", help="only the folders given")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--serve-args", default="", help="extra serve flags for every model")
    parser.add_argument("--compare-tree", help="another checkout (e.g. `git archive <commit> | tar -x -C DIR`) "
                        "whose code is started the same way, row by row beside this tree's")
    parser.add_argument("--llama-server", help="a llama-server binary, to time on --gguf")
    parser.add_argument("--gguf", help="the GGUF llama-server loads (the same weights as the folder)")
    args = parser.parse_args()

    models = [] if args.skip_embedded else [("tiny-pycoder", [])]
    folders = list(args.model)
    if args.write_qwen:
        folders.append(str(write_qwen(Path(args.write_qwen[1]), args.write_qwen[0])))
    models += [(f, ["--dtype", args.dtype]) for f in folders]
    extra = args.serve_args.split()
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    if args.compare_tree:
        trees.append((f"{args.compare_tree} (compared)", args.compare_tree))
    rows, phase_rows = [], []
    for model, flags in models:
        weights = 0
        for label, tree in trees:
            runs = [one_start(model, [*flags, *extra], args.new_tokens, args.timeout, tree, args.warm)
                    for _ in range(args.starts)]
            ready = statistics.median(r["ready"] for r in runs)
            rank = statistics.median(max(r["ranks"]) for r in runs)
            weights = runs[-1]["weights_kv"][0][0] if runs[-1]["weights_kv"] else weights  # the model's, either tree
            kv = statistics.median(r["kv"] for r in runs)
            bound = 1.15 * (weights + kv) + 300
            first = statistics.median(r["first"] for r in runs)
            warm = statistics.median(r["warm"] for r in runs)
            if tree is None:
                names = list(dict.fromkeys(n for r in runs for n in r["phases"]))
                phase_rows += [[Path(model).name, name,
                                f"{statistics.median(r['phases'].get(name, 0.0) for r in runs):.2f}"] for name in names]
            rows.append([Path(model).name, label, f"{ready:.2f}", " / ".join(f"{r['ready']:.2f}" for r in runs),
                         f"{rank:.0f}", f"{weights} + {kv:.0f}",
                         f"{rank / (weights + kv):.2f}" if weights + kv else "n/a",
                         f"{bound:.0f}", "yes" if rank <= bound else "NO",
                         f"{statistics.median(r['launcher'] for r in runs):.0f}", f"{first * 1e3:.0f}",
                         f"{warm * 1e3:.0f}", f"{first / warm:.2f}"])
    print(f"# startup ({now_iso()})\n\n`{command_line(script='benchmarks/startup.py')}`\n\n{machine_line()}\n")
    print("\n".join(md_table(
        ["model", "code", "serve -> SERVING s (median)", "each start s", "rank RSS MiB", "weights + KV MiB",
         "RSS / (W+KV)", "1.15x(W+KV)+300", "within", "launcher RSS MiB", "first request ms",
         "warm request ms", "first / warm"], rows)))
    if phase_rows:
        print("\nWhere this tree's start goes (rank 0's log, medians; warmup's own phases inside `warmup`):\n")
        print("\n".join(md_table(["model", "phase", "s"], phase_rows)))
    if args.llama_server and args.gguf:
        starts = [llama_server_start(args.llama_server, args.gguf, args.timeout) for _ in range(args.starts)]
        print(f"\nllama-server on {args.gguf}: /health after {statistics.median(s for s, _ in starts):.2f} s "
              f"(median of {len(starts)}), RSS {statistics.median(r for _, r in starts):.0f} MiB")


if __name__ == "__main__":
    main()
