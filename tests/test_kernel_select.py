"""Kernel selection (kernels/select.py, kernels/table.py) and the forward phase (kernels/phase.py).

The tables are pinned in full: priority is behaviour. The chooser is tested with stand-in
timings (never the clock), and the prompt path is checked bitwise: a prompt computed whole, in
chunks, or after a cached prefix gives the same bits in every CPU kernel.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels import cpu, cpu_native, select
from text_generation_server.kernels.base import LinearSpec, NoKernelError
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.kernels.phase import (
    DECODE,
    PREFILL,
    PROMPT_MIN_ROWS,
    choose_variant,
    current_phase,
    forward_phase,
    row_bucket,
)
from text_generation_server.kernels.select import (
    DISABLE_ENV,
    PREFER_ENV,
    build_linear,
    choose_kernel,
    measure,
    preferences,
    tune_rows,
)
from text_generation_server.kernels.table import CPU, CUDA, FAMILY_OF_FORMAT, TIMED_PAIRS

torch.set_num_threads(2)
KERNELS_DIR = Path(select.__file__).parent
REPO = KERNELS_DIR.parents[2]


@pytest.fixture(autouse=True)
def clean_selection(monkeypatch, tmp_path):
    """No disabled or preferred kernels, preferences in a fresh folder, every log line shown again."""
    for env in (DISABLE_ENV, PREFER_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(select.CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.setattr(select, "_PREFERENCES", {})
    monkeypatch.setattr(select, "_LOGGED", set())


def spec(k=4096, n=4096, bits=4, gs=128, zeros=False, dtype=torch.bfloat16, dev="cpu", fmt="int"):
    return LinearSpec(in_features=k, out_features=n, bits=bits, group_size=gs, has_zeros=zeros, act_order=False,
                      act_dtype=dtype, device_type=dev, weight_format=fmt)


# int4 layers with int8 activations (kernels/cpu_act_int8.py) rank first on the CPU; these tests pin
# the exact path (--cpu-int8-activations off), where that kernel refuses with this reason.
Q8_OFF = ("cpu-int4pack-q8", "activations kept exact (--cpu-int8-activations off / TGS_CPU_INT8_ACTIVATIONS=off)")


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TGS_CPU_INT8_ACTIVATIONS", "off")


# -- the tables --------------------------------------------------------------------------------------
def test_the_tables_pin_every_kernel_in_priority_order():
    """Today's order per device and family, top to bottom (the order registry.py used to build)."""
    assert [(k.family, k.name) for k in CPU] == [
        ("quantized", "cpu-int4pack-q8"), ("quantized", "cpu-int4pack"), ("quantized", "cpu-int8-q8"),
        ("quantized", "cpu-int8"),
        ("quantized", "cpu-int8-group-native"),
        ("quantized", "cpu-int8-group"),
        ("quantized", "reference"), ("quantized", "marlin-layout"), ("quantized", "fp8-dense"), ("quantized", "fp8-dequant"),
        ("quantized", "cpu-kquant"),
        ("bnb-4bit", "bnb-cpu-4bit"), ("bnb-4bit", "reference"), ("bnb-4bit", "bnb-matmul-4bit"),
        ("dense", "dense"),
    ]
    assert [(k.family, k.name) for k in CUDA] == [
        ("quantized", "triton-gemm"), ("quantized", "tinygemm"), ("quantized", "sparse-2:4"),
        ("quantized", "fp8-scaled-mm"), ("quantized", "fp8-dequant"), ("quantized", "reference"),
        ("bnb-4bit", "bnb-matmul-4bit"), ("bnb-4bit", "reference"),
        ("dense", "dense"),
    ]
    assert set(FAMILY_OF_FORMAT.values()) == {k.family for k in CPU + CUDA}
    # Timed against each other at warmup where both run a layer (kernels/tuning.py): CUDA's two integer kernels.
    assert {device: [(a.name, b.name) for a, b in pairs] for device, pairs in TIMED_PAIRS.items()} == {
        "cpu": [], "cuda": [("triton-gemm", "tinygemm")]}


def test_every_linear_kernel_is_in_a_table():
    """A kernel class written but left out of the tables would never run."""
    from text_generation_server.kernels.base import QuantKernel

    defined = set()
    for path in KERNELS_DIR.glob("*.py"):
        module = __import__(f"text_generation_server.kernels.{path.stem}", fromlist=["_"])
        defined |= {v for v in vars(module).values() if isinstance(v, type) and issubclass(v, QuantKernel)
                    and v.__module__ == module.__name__ and v.name != QuantKernel.name}  # named: not a base
    assert defined == set(CPU) | set(CUDA)


def _imports(path: Path) -> set[str]:
    """Project modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("text_generation_server"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("text_generation_server")}
    return found


def test_the_kernels_package_has_no_import_cycle_and_its_init_imports_nothing():
    prefix = "text_generation_server.kernels."
    modules = {p.stem: p for p in KERNELS_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {name: {m.removeprefix(prefix).split(".")[0] for m in _imports(path) if m.startswith(prefix)} & set(modules)
             for name, path in modules.items()}
    assert not _imports(KERNELS_DIR / "__init__.py")
    assert all(not m.startswith(("text_generation_server.quantizers", "text_generation_server.server"))
               for path in modules.values() for m in _imports(path))
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_only_the_selection_module_imports_the_table():
    importers = {str(p.relative_to(REPO)) for folder in ("kernels", "quantizers", "server")
                 for p in (REPO / folder).rglob("*.py") if "text_generation_server.kernels.table" in _imports(p)}
    assert importers == {"kernels/text_generation_server/kernels/select.py"}


# -- choosing ----------------------------------------------------------------------------------------
def test_a_preferred_kernel_takes_the_layers_it_can_run(monkeypatch):
    per_channel_int4 = spec(gs=4096)
    assert choose_kernel(per_channel_int4) == (cpu.CpuInt4PackKernel, [Q8_OFF])
    monkeypatch.setenv(PREFER_ENV, " tinygemm , cpu-int8")  # tinygemm is a CUDA kernel: no say on CPU
    kernel, passed = choose_kernel(per_channel_int4)
    assert kernel is cpu.CpuInt8Kernel
    assert passed == [(name, f"cpu-int8 preferred by {PREFER_ENV}")
                      for name in ("cpu-int4pack-q8", "cpu-int4pack", "cpu-int8-q8")]
    # A layer the preferred kernel cannot run keeps the static order, with the usual reasons.
    kernel, passed = choose_kernel(spec(gs=128))
    assert kernel is cpu.CpuInt4PackKernel and passed == [Q8_OFF]
    # Disabling is stronger than preferring.
    monkeypatch.setenv(DISABLE_ENV, "cpu-int8")
    assert choose_kernel(per_channel_int4)[0] is cpu.CpuInt4PackKernel
    # A name no kernel has (a typo) is refused, naming it, rather than silently ignored.
    monkeypatch.setenv(PREFER_ENV, "cpu-int9")
    with pytest.raises(NoKernelError, match="TGS_PREFER_KERNELS names no kernel of this build: cpu-int9"):
        choose_kernel(per_channel_int4)


def test_preferring_a_lower_kernel_is_logged_with_the_reason(monkeypatch):
    from loguru import logger

    monkeypatch.setenv(PREFER_ENV, "reference")
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        module = build_linear(make_weight(256, 64, 4, 256, True, False), None, torch.bfloat16, "cpu", "t.proj")
    finally:
        logger.remove(sink)
    assert module.kernel_name == "reference"
    assert lines == [f"t.proj: 4-bit g256 sym: kernel reference (cpu-int4pack-q8: reference preferred by {PREFER_ENV}; "
                     f"cpu-int4pack: reference preferred by {PREFER_ENV}; "
                     f"cpu-int8-q8: reference preferred by {PREFER_ENV}; "
                     f"cpu-int8: reference preferred by {PREFER_ENV}; cpu-int8-group-native: reference preferred by "
                     f"{PREFER_ENV}; cpu-int8-group: reference preferred by "
                     f"{PREFER_ENV})\n"]


def test_families_never_mix():
    """A weight format is ranked only among its own family's kernels: reasons name no other family."""
    kernel, passed = choose_kernel(spec(bits=16, gs=4096, fmt="dense"))
    assert kernel.name == "dense" and passed == []
    with pytest.raises(NoKernelError, match="no kernel table for device 'mps'"):
        choose_kernel(spec(dev="mps"))


def test_a_measured_whole_layer_choice_is_taken_and_survives_the_process(tmp_path):
    s = spec(gs=4096)
    prefs = preferences("cpu")
    prefs.record(s, None, "cpu-int8", {"cpu-int4pack": 2e-3, "cpu-int8": 1e-3})
    kernel, passed = choose_kernel(s)
    assert kernel is cpu.CpuInt8Kernel
    assert passed == [(name, "cpu-int8 measured faster on this machine")
                      for name in ("cpu-int4pack-q8", "cpu-int4pack", "cpu-int8-q8")]
    data = json.loads(prefs.path.read_text())
    assert data["signature"] == select.device_signature("cpu")
    assert data["choices"][select.shape_key(s)]["layer"] == {"choice": "cpu-int8",
                                                             "ms": {"cpu-int4pack": 2.0, "cpu-int8": 1.0}}
    assert prefs.path.parent == tmp_path / "kernel-cache" and prefs.path.name.startswith("kernels-cpu-")
    select._PREFERENCES.clear()  # a new process reads the file
    assert choose_kernel(s)[0] is cpu.CpuInt8Kernel
    assert choose_kernel(spec(gs=4096, n=2048))[0] is cpu.CpuInt4PackKernel  # another shape: static order


def test_preferences_of_another_machine_are_ignored(tmp_path):
    s = spec(gs=4096)
    prefs = preferences("cpu")
    prefs.path.parent.mkdir(parents=True)
    prefs.path.write_text(json.dumps({"signature": "another CPU", "choices": {
        select.shape_key(s): {"layer": {"choice": "cpu-int8"}}}}))
    select._PREFERENCES.clear()
    assert preferences("cpu").choices == {}
    assert choose_kernel(s)[0] is cpu.CpuInt4PackKernel
    prefs.path.write_text("{not json")
    select._PREFERENCES.clear()
    assert choose_kernel(s)[0] is cpu.CpuInt4PackKernel


def test_preferences_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(select.CACHE_ENV, "off")
    prefs = preferences("cpu")
    prefs.record(spec(), 4, "op", {"op": 1e-3})  # kept in memory, written nowhere
    assert prefs.path is None and prefs.get(spec(), 4) == "op"


# -- measuring, with stand-in timings -------------------------------------------------------------------
def test_measure_takes_the_fastest_candidate_that_computes_the_same():
    x = torch.randn(4, 8)
    candidates = {
        "static": lambda: x * 2,
        "fast-but-wrong": lambda: x * 3,
        "raises": lambda: (_ for _ in ()).throw(RuntimeError("no kernel image")),
        "fast": lambda: x * 2 + 1e-6,
        "slow": lambda: x * 2,
    }
    seconds = {"static": 3.0, "fast-but-wrong": 0.5, "raises": 0.1, "fast": 1.0, "slow": 9.0}
    timer = lambda fn: seconds[next(n for n, f in candidates.items() if f is fn)]
    choice, timings = measure(candidates, timer, "test")
    assert choice == "fast"
    assert timings == {"static": 3.0, "fast": 1.0, "slow": 9.0}


def test_a_failed_measurement_keeps_the_static_order():
    def broken():
        raise RuntimeError("out of memory")

    assert measure({"static": broken, "other": lambda: torch.ones(1)}, lambda fn: 1.0) == (None, {})

    def timer(fn):
        raise RuntimeError("timer failed")

    assert measure({"static": lambda: torch.ones(1)}, timer) == (None, {})


@pytest.fixture
def native():
    module = cpu_native.native()
    if module is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    return module


def test_tune_rows_measures_variants_and_decode_follows_the_winner(native):
    w = make_weight(256, 128, 8, 256, False, False, seed=4)
    s = w.spec(torch.bfloat16, "cpu")
    module = build_linear(w, None, torch.bfloat16, "cpu")
    assert module.kernel_name == "cpu-int8" and module.measured == {}
    ran: list[str] = []
    run = module.run
    module.run = lambda x, variant: (ran.append(variant), run(x, variant))[1]  # which variant a call took
    seconds = {"gemv": 3.0, "op": 1.0, "dequant": 2.0}  # stand-in timings: torch's op "wins" at 4 rows

    def timer(fn):
        ran.clear()
        fn()
        return seconds[ran[-1]]

    chosen = tune_rows(module, s, [3], timer)
    assert chosen == {4: "op"} and module.measured == {4: "op"}
    assert preferences("cpu").row_choices(s) == {4: "op"}
    assert set(preferences("cpu").choices[select.shape_key(s)]["rows<=4"]["ms"]) == {"gemv", "op", "dequant"}
    x = torch.randn(3, 256).bfloat16()
    assert choose_variant(module, 3) == "op"
    with forward_phase(prefill=True):
        assert choose_variant(module, 3) == "dequant"  # prompts keep their one path
    assert choose_variant(module, 9) == "op" and choose_variant(module, 40) == "dequant"  # other buckets: static
    assert module(x).shape == (3, 128)
    # A module built later, in another process, starts from the recorded choice.
    select._PREFERENCES.clear()
    again = build_linear(w, None, torch.bfloat16, "cpu")
    assert again.measured == {4: "op"}
    # A recorded variant a bucket cannot run (gemv at 16 rows) is ignored.
    again.measured[16] = "gemv"
    assert choose_variant(again, 16) == "op"


# -- the phase ------------------------------------------------------------------------------------------
def test_the_phase_is_scoped_to_the_block():
    assert current_phase() is None
    with forward_phase(prefill=True):
        assert current_phase() == PREFILL
        with forward_phase(prefill=False):
            assert current_phase() == DECODE
        assert current_phase() == PREFILL
    assert current_phase() is None
    assert [row_bucket(r) for r in (0, 1, 2, 3, 8, 9, 33)] == [1, 1, 2, 4, 8, 16, 64]


def test_a_forward_with_prompt_rows_is_a_prefill_and_names_its_decoding_rows():
    """engine/causal_lm.py runs decoding rows and prompt chunks in one forward (is_prefill=True,
    `decode_rows` naming the decoding ones): the model's ForwardContext makes it a prefill with that
    split; a forward of decoding rows only (speculation) is a decode forward."""
    from text_generation_server.layers.attention import AttentionMetadata
    from text_generation_server.layers.context import ForwardContext

    for prefill, rows, phase in ((True, None, PREFILL), (True, [2], PREFILL), (True, [0, 1, 2], DECODE),
                                 (False, None, DECODE)):
        meta = AttentionMetadata(is_prefill=prefill, slots=torch.zeros(3, dtype=torch.long), prefill_lens=[2, 1],
                                 cache_lens=[0, 5], decode_rows=rows)
        ctx = ForwardContext(torch.arange(3), None, meta, torch.float32)
        with ctx.kernel_phase():
            assert current_phase() == phase
    assert current_phase() is None


def cpu_layers() -> dict[str, torch.nn.Module]:
    """One layer per CPU kernel whose row paths differ: int8, int4, dense and the reference, in bfloat16
    and (dense, reference) float32, whose GEMM changes code path for small row counts."""
    g = torch.Generator().manual_seed(0)
    k, n = 512, 320
    return {
        "cpu-int8": build_linear(make_weight(k, n, 8, k, False, False, seed=1), torch.randn(n, generator=g),
                                 torch.bfloat16, "cpu"),
        "cpu-int4pack": build_linear(make_weight(k, n, 4, 128, False, True, seed=2), None, torch.bfloat16, "cpu"),
        "dense": DenseLinear(torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()),
        "reference": build_linear(make_weight(k, n, 8, 64, True, False, seed=3), None, torch.bfloat16, "cpu"),
        "dense float32": DenseLinear(torch.randn(n, k, generator=g), torch.randn(n, generator=g)),
        "reference float32": build_linear(make_weight(k, n, 8, 64, True, False, seed=3), None, torch.float32, "cpu"),
    }


@pytest.mark.parametrize("cuts", [(40,), (44,), (32,), (1, 40), (8, 16, 30)], ids=str)
def test_a_prompt_gives_the_same_bits_whole_or_in_chunks(cuts, native):
    """A prefill of 45 rows, whole or as chunks (a 40-row chunk and a 5-row cached remainder, ...):
    every row bit for bit the same in every CPU kernel (d05298c: thresholds made them differ)."""
    x = torch.randn(45, 512, generator=torch.Generator().manual_seed(5))
    bounds = [0, *cuts, 45]
    for name, layer in cpu_layers().items():
        assert layer.kernel_name == name.split()[0]
        x = x.to(torch.float32 if "float32" in name else torch.bfloat16)
        with forward_phase(prefill=True):
            whole = layer(x)
            chunked = torch.cat([layer(x[a:b]) for a, b in zip(bounds, bounds[1:])])
        assert torch.equal(chunked, whole), name


def test_decode_rows_still_take_the_fast_paths(native):
    """Outside a prefill the row thresholds stand: the matrix-vector kernels for decode batches."""
    layers = cpu_layers()
    assert choose_variant(layers["cpu-int8"], 1) == "gemv" and choose_variant(layers["cpu-int8"], 20) == "op"
    assert choose_variant(layers["cpu-int8"], 32) == "dequant"
    in_place = cpu_native.int4_native_ok(native)  # the int4 kernel runs on AVX-512 builds
    assert choose_variant(layers["cpu-int4pack"], 8) == ("native" if in_place else "op")
    assert choose_variant(layers["cpu-int4pack"], 64) == "dequant"
    dense = layers["dense"]
    bound = cpu_native.dense_gemv_max_rows(native, dense.weight)  # bf16: 8 rows with AVX512-BF16, else 2
    past = "native-gemm" if cpu_native.bf16_gemm_fits(native, dense.weight) else "gemm"
    assert choose_variant(dense, 2) == choose_variant(dense, bound) == "gemv"
    assert choose_variant(dense, bound + 1) == past
    with forward_phase(prefill=True):
        assert {choose_variant(layers["cpu-int8"], r) for r in (1, 8, 45)} == {"dequant"}
        # int4 prompts read the packed codes in place at every row count (row-invariant: kernels/cpu.py)
        assert {choose_variant(layers["cpu-int4pack"], r) for r in (1, 8, 45, 300)} == {
            "native" if in_place else "dequant"}
        # dense prompts: one path, torch's GEMM padded, or the native GEMM on a build without AVX512-BF16
        assert {choose_variant(dense, r) for r in (1, 2, 45)} == {
            "native-gemm" if past == "native-gemm" else "padded-gemm"}
    assert PROMPT_MIN_ROWS >= 12  # torch's float32 GEMM changes path below 12 rows (kernels/phase.py)


def test_decoding_rows_riding_along_a_prompt_get_their_decode_bits(native):
    """A prefill forward that carries decoding rows (rows 3 and 7 of 12 here) runs them on their
    decode path: each equals the same rows in a plain decode step of that batch size, bit for bit,
    and the prompt rows equal the prompt run alone, so a running request answers the same whether or
    not a newcomer's prompt shares its step (prefix caching on and off change which steps do)."""
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(9))
    decoding = [3, 7]
    prompt = [r for r in range(12) if r not in decoding]
    for name, layer in cpu_layers().items():
        x = x.to(torch.float32 if "float32" in name else torch.bfloat16)
        with forward_phase(prefill=True, decode_rows=decoding, total=12):
            mixed = layer(x)
        with forward_phase(prefill=False):
            alone = layer(x[decoding])
        with forward_phase(prefill=True):
            prompt_alone = layer(x[prompt])
        assert torch.equal(mixed[decoding], alone), name
        assert torch.equal(mixed[prompt], prompt_alone), name
        with forward_phase(prefill=True, decode_rows=decoding, total=12):
            regrouped = layer(x[:10])  # not the forward's rows (an expert's tokens): all on the prompt path
        with forward_phase(prefill=True):
            assert torch.equal(regrouped, layer(x[:10])), name


@pytest.mark.parametrize("quantize", ["eetq", None], ids=["cpu-int8", "dense"])
def test_a_cached_prefix_and_its_remainder_give_the_bits_of_a_whole_prefill(quantize, native, tmp_path):
    """The engine end to end, in bfloat16: a 45-token prompt prefilled whole, then again with 40
    tokens from the cache (the router's prefix hit) and a 5-row remainder: prompt logprobs and the
    generated tokens' logprobs equal to the bit (before the phase rule, int8 took the matrix-vector
    kernel for the 5 rows and the dequantized GEMM for the 45, and they differed)."""
    from helpers import ids_request, random_ids, run_to_end, write_checkpoint

    from text_generation_server.models.loader import get_model

    write_checkpoint(tmp_path / "m", "llama", seed=3, hidden_size=64, intermediate_size=128)
    lm = get_model(str(tmp_path / "m"), dtype="bfloat16", quantize=quantize, block_size=4)
    lm.allocate_kv_cache(96)
    assert {m.kernel_name for m in lm.model.modules() if isinstance(getattr(m, "kernel_name", None), str)} == \
        {"cpu-int8" if quantize else "dense"}
    prompt = random_ids(45, 7)
    blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 3))
    request = lambda **kw: ids_request(1, prompt, 3, blocks=blocks, prefill_logprobs=True, **kw)
    whole = run_to_end(lm, lm.make_batch(0, [request()]))[1]
    hit = run_to_end(lm, lm.make_batch(1, [request(cache_len=40)]))[1]
    assert hit["ids"] == whole["ids"] and hit["lps"] == whole["lps"]
    assert hit["prompt"][41:] == whole["prompt"][41:]


def test_cpu_measurements_belong_to_the_kernels_build(monkeypatch):
    """Choices timed with one build of the native kernels (its source, its instruction set) are not read
    by another: a faster kernel, or an --cpu-isa avx2 process without the first build's variants,
    measures afresh."""
    monkeypatch.setattr(cpu_native, "build_name", lambda: "tgs_cpu_native_aaaa")
    first = select.device_signature("cpu")
    monkeypatch.setattr(cpu_native, "build_name", lambda: "tgs_cpu_native_bbbb")
    second = select.device_signature("cpu")
    assert first != second and "tgs_cpu_native_bbbb" in second
