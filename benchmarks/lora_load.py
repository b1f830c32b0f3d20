"""Loading LoRA adapters at run time under load: what it costs the requests already streaming.

One `serve` with run-time loading open (--lora-load-dir) and one adapter from the start
(--lora-adapters) runs C streams at once (half on the base model, half on that adapter), each a
fixed number of tokens, twice per round: once undisturbed, once while another client loads and
unloads adapters (rank 16, every attention and MLP projection: the issue's) through the client
API's LoadAdapter / UnloadAdapter, again and again. Rounds alternate the two so a shared machine's
drift falls on both. Reported from the client side: inter-token gaps of every stream (p50, p99,
max) with and without loads, their p99 ratio (target: within 1.5x), requests failed (target: none),
and how long each load took to answer.

    flock /tmp/tgs-bench.lock python benchmarks/lora_load.py                        # embedded tiny model
    flock /tmp/tgs-bench.lock python benchmarks/lora_load.py --model qwen2.5-coder-1.5b --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

# benchmarks/ is on sys.path when a script there runs: its siblings import by name.
from bench_common import (  # noqa: E402
    StartedServer, StreamedReply, command_line, load_averages, machine_line, md_table, now_iso, pct, ratio,
    stream_generate,
)
from prompts import CODE_PROMPTS  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_P99_RATIO = 1.5


def write_adapter(folder: Path, base: Path, seed: int, rank: int) -> Path:
    """A PEFT-layout LoRA adapter (random A and B) of every projection of `base`."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
                    out_features, in_features = f.get_slice(key).get_shape()
                    a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
                    tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16)
                    b = torch.randn(out_features, rank, generator=generator) * 0.01
                    tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "bias": "none", "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(base)}))
    return folder


def model_folder(model: str) -> tuple[str, Path]:
    """(what serve is given, the checkpoint folder adapters are made for)."""
    if model == "tiny-pycoder":
        from text_generation_server.utils.locate import embedded_model_path

        return model, embedded_model_path()
    if model == "qwen2.5-coder-1.5b":
        import llamacpp_build as lb

        hf = lb.ensure_hf_from_gguf(lb.ensure_qwen_gguf(), lb.qwen_dir() / "hf")
        return str(hf), hf
    return model, Path(model)


def gaps(replies: list[StreamedReply]) -> list[float]:
    return [b - a for r in replies if r.error is None for a, b in zip(r.stamps, r.stamps[1:])]


async def streams(stub, concurrency: int, tokens: int, offset: int) -> list[StreamedReply]:
    """C streams at once, every other one on the startup adapter."""
    requests = []
    for i in range(concurrency):
        params = cpb.GenerateParameters(max_new_tokens=tokens, ignore_eos_token=True)
        if i % 2:
            params.adapter_id = "resident"
        requests.append(cpb.GenerateRequest(inputs=CODE_PROMPTS[(offset + i) % len(CODE_PROMPTS)], parameters=params))
    return list(await asyncio.gather(*(stream_generate(stub, r) for r in requests)))


async def loader(stub, names: list[str], stop: asyncio.Event, pause_s: float, durations: list[float],
                 errors: list[str]) -> None:
    """Loads and unloads the adapters in turn until `stop`, pausing between calls."""
    i = 0
    while not stop.is_set():
        name = names[i % len(names)]
        i += 1
        try:
            started = time.perf_counter()
            await stub.LoadAdapter(cpb.LoadAdapterRequest(name=name, path=name))
            durations.append(time.perf_counter() - started)
            await asyncio.sleep(pause_s)
            await stub.UnloadAdapter(cpb.UnloadAdapterRequest(name=name))
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{name}: {exc.code().name}: {exc.details()}")
        await asyncio.sleep(pause_s)


async def run(args) -> int:
    serve_id, base = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="tgs-lora-load-"))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(["resident", *names]):
        write_adapter(work / name, base, seed=i, rank=args.rank)
    extra = ["--lora-adapters", f"resident={work / 'resident'}", "--max-loras", "2", "--max-lora-rank", str(args.rank),
             "--lora-load-dir", str(work), "--lora-load-without-api-key", "--max-total-tokens",
             str(args.tokens + 256), *args.serve_flag]
    load_start = load_averages()
    with StartedServer(serve_id, extra, env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        startup = await server.wait_ready()
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)
            await streams(stub, args.concurrency, 4, 0)  # warm
            quiet: list[StreamedReply] = []
            loaded: list[StreamedReply] = []
            durations: list[float] = []
            errors: list[str] = []
            for round_ in range(args.rounds):
                quiet += await streams(stub, args.concurrency, args.tokens, round_)
                stop = asyncio.Event()
                task = asyncio.create_task(loader(stub, names, stop, args.pause_s, durations, errors))
                loaded += await streams(stub, args.concurrency, args.tokens, round_)
                stop.set()
                await task
    rows = []
    for label, replies in (("no loads", quiet), ("adapters loading", loaded)):
        g = gaps(replies)
        failed = sum(1 for r in replies if r.error is not None or r.tokens != args.tokens)
        rows.append([label, len(replies), failed, len(g), f"{pct(g, 50) * 1e3:.1f}", f"{pct(g, 99) * 1e3:.1f}",
                     f"{max(g, default=float('nan')) * 1e3:.1f}"])
    p99_ratio = pct(gaps(loaded), 99) / pct(gaps(quiet), 99)
    print(f"## LoRA adapters loaded at run time under load ({args.model})\n")
    print(f"- command: `{command_line()}`")
    print(f"- date: {now_iso()}; machine: {machine_line(f'OMP_NUM_THREADS={args.threads}')}")
    print(f"- load average: start {load_start}, end {load_averages()} (the machine is shared with other jobs)")
    print(f"- server startup {startup:.0f} s; {args.concurrency} streams of {args.tokens} tokens at once (half on "
          f"a resident adapter), {args.rounds} rounds; adapters of rank {args.rank} on {', '.join(PROJECTIONS)}\n")
    print("\n".join(md_table(["streams", "requests", "failed", "gaps", "p50 ms", "p99 ms", "max ms"], rows,
                             "lrrrrrr")))
    print(f"\np99 inter-token time with loads / without: {ratio(p99_ratio, 1.0)} (target <= {TARGET_P99_RATIO}x); "
          f"{len(durations)} loads, answered in p50 {pct(durations, 50) * 1e3:.0f} ms, max "
          f"{max(durations, default=float('nan')) * 1e3:.0f} ms; load errors: {errors or 'none'}")
    failures = sum(int(r[2]) for r in rows) + len(errors)
    return 0 if failures == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-pycoder",
                        help="tiny-pycoder (embedded), qwen2.5-coder-1.5b (the registry's GGUF in bf16), or a folder")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=2, help="adapters the loader cycles through")
    parser.add_argument("--pause-s", type=float, default=0.2, help="between a load and its unload, and after")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--serve-flag", action="append", default=[], help="extra serve flag (repeatable)")
    args = parser.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
