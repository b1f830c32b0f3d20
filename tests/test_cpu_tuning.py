"""The CPU chooser (kernels/cpu_tuning.py) with stand-in timings, never the clock: per layer shape and
row bucket the fastest variant that computes the same, put into every layer of the shape, kept in
the machine's preferences and read back instead of measuring; prompts keep one path; a failed
measurement leaves torch's op; TGS_CPU_TUNING=0 measures nothing; warmup's tune_kernels runs it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_weight
from loguru import logger

from text_generation_server.kernels import cpu_native, select
from text_generation_server.kernels.cpu_tuning import TUNING_ENV, not_worth_timing, tune_cpu_layers
from text_generation_server.kernels.phase import choose_variant, forward_phase
from text_generation_server.kernels.select import build_linear, preferences, shape_key
from text_generation_server.kernels.tuning import tune_kernels

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(select.CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv(TUNING_ENV, raising=False)
    select._PREFERENCES.clear()
    yield
    select._PREFERENCES.clear()


@pytest.fixture
def native():
    module = cpu_native.native()
    if module is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    if not cpu_native.int4_native_ok(module):
        pytest.skip("the stand-in timings name the int4 kernel's variants, used on AVX-512 builds only")
    return module


RAN: list[str] = []  # the variant of every layer call, in order


def watched(module: torch.nn.Module, fail: str | None = None) -> torch.nn.Module:
    run = module.run

    def recorded(x, variant):
        RAN.append(variant)
        if variant == fail:
            raise RuntimeError(f"{variant} cannot run here")
        return run(x, variant)

    module.run = recorded
    return module


def model(seed: int = 0, fail: str | None = None) -> torch.nn.Module:
    """Two int4 layers of one shape, one of another, and an int8 layer."""
    int4 = lambda k, n, s: watched(build_linear(make_weight(k, n, 4, 64, False, False, seed=s), None,
                                                torch.bfloat16, "cpu"), fail)
    return torch.nn.ModuleList([
        int4(256, 128, seed), int4(256, 128, seed + 1), int4(128, 256, seed + 2),
        watched(build_linear(make_weight(128, 64, 8, 128, True, False, seed=seed + 3), None, torch.bfloat16, "cpu"),
                fail),
    ])


def stand_in_timer(seconds, calls: list[int] | None = None):
    """Seconds by the variant the measured call ran and its row count (`seconds(variant, rows)`)."""

    def timer(fn):
        RAN.clear()
        y = fn()
        if calls is not None:
            calls.append(1)
        return seconds(RAN[-1], y.shape[0])
    return timer


def int4_seconds(variant: str, rows: int) -> float:
    # Stand-ins: native-r2 fastest at 1-2 rows, torch's op at 4-8, dequantized at 64 (r6 second there).
    table = {"native-r2": 1.0 if rows <= 2 else 5.0, "op": 0.5 if 4 <= rows <= 8 else 9.0,
             "dequant": 0.1 if rows >= 64 else 9.0, "native-r6": 0.2 if rows >= 64 else 6.0}
    return table.get(variant, 3.0)


def test_each_shape_is_measured_once_and_every_layer_takes_the_winners(native):
    m = model()
    calls: list[int] = []
    chosen = tune_cpu_layers(m, timer=stand_in_timer(int4_seconds, calls))
    int4_key = shape_key(m[0].linear_spec)
    assert chosen[int4_key] == {1: "native-r2", 2: "native-r2", 4: "op", 8: "op", 64: "dequant"}
    assert m[0].measured == m[1].measured == chosen[int4_key]
    assert shape_key(m[2].linear_spec) in chosen and shape_key(m[3].linear_spec) in chosen
    per_shape = len(calls)
    # Decode follows the buckets; prompts stay on the native kernel, under the fastest native name.
    assert choose_variant(m[1], 1) == "native-r2" and choose_variant(m[1], 3) == "op"
    assert choose_variant(m[1], 40) == "dequant"
    with forward_phase(prefill=True):
        assert m[1].prompt_variant() == cpu_native.INT4_NATIVE  # "dequant" won bucket 64: not a native name
    # The file holds what was measured; a new process (layers built anew) reads it and times nothing.
    prefs = preferences("cpu")
    data = json.loads(prefs.path.read_text())
    assert data["choices"][int4_key]["rows<=1"]["choice"] == "native-r2"
    assert set(data["choices"][int4_key]["rows<=1"]["ms"]) == {*cpu_native.INT4_NATIVE_VARIANTS, "op"}
    # Not worth timing (a first start stays short): the dequantized GEMM at decode sizes, the native
    # kernel's names but two at the prompt bucket.
    assert set(data["choices"][int4_key]["rows<=64"]["ms"]) == {"native", "native-r6", "op", "dequant"}
    select._PREFERENCES.clear()
    again = model()
    assert again[0].measured == chosen[int4_key]  # build_linear reads the file
    calls.clear()
    assert tune_cpu_layers(again, timer=stand_in_timer(int4_seconds, calls)) == chosen and calls == []
    assert per_shape > 0


def test_a_native_name_measured_for_prompts_is_the_prompt_path(native):
    m = model(seed=5)
    seconds = lambda variant, rows: 0.1 if variant == "native-r6" else 1.0
    tune_cpu_layers(m, timer=stand_in_timer(seconds))
    assert m[0].measured[cpu_native.INT4_PROMPT_BUCKET] == "native-r6"
    with forward_phase(prefill=True):
        assert choose_variant(m[0], 3) == choose_variant(m[0], 300) == "native-r6"
    assert m[3].prompt_variant() == "dequant"  # int8 prompts keep their one path


def test_a_failed_measurement_leaves_torchs_op(native):
    m = model(seed=7, fail=cpu_native.INT4_NATIVE)  # the int4 static choice raises under 64 rows
    lines: list[str] = []
    sink = logger.add(lambda msg: lines.append(str(msg)), level="WARNING")
    try:
        chosen = tune_cpu_layers(m, timer=stand_in_timer(lambda v, r: 1.0))
    finally:
        logger.remove(sink)
    key = shape_key(m[0].linear_spec)
    assert {chosen[key][b] for b in (1, 2, 4, 8)} == {"op"}
    assert any("failed" in line for line in lines)
    x = torch.randn(2, 256).bfloat16()
    RAN.clear()
    with forward_phase(prefill=False):
        m[0](x)
    assert RAN == ["op"]
    assert preferences("cpu").row_choices(m[0].linear_spec).get(1) is None  # nothing recorded: measured again


def test_switched_off_nothing_is_measured(native, monkeypatch):
    monkeypatch.setenv(TUNING_ENV, "0")
    m = model(seed=9)
    calls: list[int] = []
    assert tune_cpu_layers(m, timer=stand_in_timer(int4_seconds, calls)) == {
        shape_key(layer.linear_spec): {} for layer in m}
    assert calls == [] and m[0].measured == {}
    assert choose_variant(m[0], 1) == cpu_native.INT4_NATIVE  # the static thresholds


def test_warmups_kernel_timing_tunes_cpu_layers(native, monkeypatch):
    import text_generation_server.kernels.cpu_tuning as cpu_tuning

    m = model(seed=11)
    seen = []
    real = cpu_tuning.tune_rows
    monkeypatch.setattr(cpu_tuning, "tune_rows", lambda module, spec, rows, timer, store, skip, **kw:
                        seen.append(spec) or real(module, spec, rows, stand_in_timer(int4_seconds), store, skip, **kw))
    result = tune_kernels(m, [])  # on a CPU warmup passes no CUDA graph sizes
    assert len(seen) == 3 and result[shape_key(m[0].linear_spec)][1] == "native-r2"


def test_timed_calls_go_round_the_layers_of_a_shape(native):
    """Each timed call runs on another layer of the shape (its weights cold, as in a decode step); each
    variant's check against the static choice runs on the first layer, so the results compare."""
    int4 = lambda s: build_linear(make_weight(256, 128, 4, 64, False, False, seed=s), None, torch.bfloat16, "cpu")
    m = torch.nn.ModuleList([int4(s) for s in range(3)])
    called: list[tuple[int, str]] = []
    for index, layer in enumerate(m):
        run = layer.run
        layer.run = lambda x, variant, index=index, run=run: called.append((index, variant)) or run(x, variant)
    timed: list[list[tuple[int, str]]] = []
    positions: set[int] = set()

    def timer(fn):
        start = len(called)
        for _ in range(4):
            fn()
        timed.append(called[start:])
        positions.update(range(start, len(called)))
        return {"native-r2": 1.0}.get(called[-1][1], 2.0)

    chosen = tune_cpu_layers(m, rows=(1,), timer=timer)
    assert chosen == {shape_key(m[0].linear_spec): {1: "native-r2"}}
    assert len(timed) >= 3
    for calls in timed:
        assert len({variant for _, variant in calls}) == 1  # one variant per timing
        layers = [index for index, _ in calls]
        assert all(a != b for a, b in zip(layers, layers[1:])) and set(layers) == {0, 1, 2}
    checks = [c for i, c in enumerate(called) if i not in positions]
    assert checks and {index for index, _ in checks} == {0}
    # the forced choice is put back on every layer after the timing
    assert all(layer.measured == {1: "native-r2"} for layer in m)


@pytest.fixture
def int8_activations(native, monkeypatch):
    """The int8-activation layers (kernels/cpu_act_int8.py) for int4 and int8 weights alike."""
    from text_generation_server.kernels import cpu_act_int8

    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    if cpu_act_int8.native_isa(native) < 0:
        pytest.skip("no native int8-activation kernels")
    watch_q8_calls(cpu_act_int8, monkeypatch)
    return cpu_act_int8


def watch_q8_calls(cpu_act_int8, monkeypatch) -> None:
    """The int4 layer's one-call path names its variant to cpu_act_int8.int4_q8_linear (int4_q8_tiled_linear
    on the tiled layout), not to `run`."""
    for name in ("int4_q8_linear", "int4_q8_tiled_linear"):
        real = getattr(cpu_act_int8, name)

        def recorded(*args, real=real, **kwargs):
            RAN.append(args[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_act_int8, name, recorded)


def q8_model(seed: int = 0) -> torch.nn.Module:
    """An int4 layer and an int8 layer taking int8 activations, and a second int4 one of the same shape."""
    int4 = lambda s: watched(build_linear(make_weight(256, 128, 4, 64, False, False, seed=s), None,
                                          torch.bfloat16, "cpu"))
    return torch.nn.ModuleList([
        int4(seed), int4(seed + 1),
        watched(build_linear(make_weight(128, 64, 8, 128, True, False, seed=seed + 2), None, torch.bfloat16, "cpu")),
    ])


def q8_seconds(variant: str, rows: int) -> float:
    # Stand-ins: one row per pass fastest at 1 row, the far prefetch at 2, two rows (the static name)
    # at 4-8, four rows per pass at 64.
    table = {"q8-r1": 0.1 if rows == 1 else 5.0, "q8-pf0": 0.2 if rows == 2 else 5.0,
             "q8-r4": 0.3 if rows >= 64 else 6.0, "q8": 1.0}
    return table.get(variant, 3.0)


def test_int8_activation_layers_are_measured_and_take_the_winners(int8_activations):
    m = q8_model()
    assert [layer.kernel_name for layer in m] == ["cpu-int4pack-q8", "cpu-int4pack-q8", "cpu-int8-q8"]
    chosen = tune_cpu_layers(m, timer=stand_in_timer(q8_seconds))
    int4_key, int8_key = (f"{shape_key(m[i].linear_spec)} {int8_activations.SCOPE}" for i in (0, 2))
    assert chosen[int4_key] == chosen[int8_key] == {1: "q8-r1", 2: "q8-pf0", 4: "q8", 8: "q8", 64: "q8-r4"}
    assert m[0].measured == m[1].measured == chosen[int4_key]
    RAN.clear()
    x = torch.randn(1, 256).bfloat16()
    with forward_phase(prefill=False):
        m[1](x)
        m[1](torch.randn(5, 256).bfloat16())
    with forward_phase(prefill=True):
        m[1](torch.randn(3, 256).bfloat16())  # prompts: the name measured at the prompt bucket, any length
        m[2](torch.randn(3, 128).bfloat16())
    assert RAN == ["q8-r1", "q8", "q8-r4", "q8-r4"]
    assert choose_variant(m[1], 1) == "q8-r1" and choose_variant(m[1], 5) == "q8"
    with forward_phase(prefill=True):
        assert choose_variant(m[1], 300) == choose_variant(m[2], 3) == "q8-r4"
    # The file keeps them under their own scope, every name timed at decode sizes, the prompt bucket
    # only the default and the longest passes.
    data = json.loads(preferences("cpu").path.read_text())["choices"][shape_key(m[0].linear_spec)]
    assert set(data) == {f"q8 rows<={b}" for b in (1, 2, 4, 8, 64)}
    assert set(data["q8 rows<=1"]["ms"]) == set(int8_activations.VARIANTS)
    assert set(data["q8 rows<=64"]["ms"]) == {"q8", "q8-r4"}
    # Every name gives the same bits (the check tune_rows makes against the static choice passed).
    with forward_phase(prefill=False):
        outs = []
        for name in int8_activations.VARIANTS:
            m[0].measured[1] = name
            outs.append(m[0](x))
    assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_exact_and_int8_activation_choices_of_one_shape_stay_apart(native, monkeypatch):
    from text_generation_server.kernels import cpu_act_int8

    if cpu_act_int8.native_isa(native) < 0:
        pytest.skip("no native int8-activation kernels")
    exact = model(seed=13)  # the suite's policy: exact activations
    tune_cpu_layers(exact, timer=stand_in_timer(int4_seconds))
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    watch_q8_calls(cpu_act_int8, monkeypatch)
    q8 = q8_model(seed=13)
    calls: list[int] = []
    chosen = tune_cpu_layers(q8, timer=stand_in_timer(q8_seconds, calls))
    assert calls and chosen[f"{shape_key(q8[0].linear_spec)} q8"][1] == "q8-r1"  # measured, not the exact names
    assert choose_variant(q8[0], 1) == "q8-r1"
    monkeypatch.setenv(cpu_act_int8.ENV, "off")
    select._PREFERENCES.clear()
    again = model(seed=13)
    calls.clear()
    # the exact layers read their own choices back and measure nothing
    assert tune_cpu_layers(again, timer=stand_in_timer(int4_seconds, calls))[shape_key(again[0].linear_spec)][1] \
        == "native-r2" and calls == []


def test_dense_bf16_layers_choose_between_the_native_product_and_torchs_gemm():
    from text_generation_server.quantizers.weights import UnquantizedWeight

    if cpu_native.native() is None:  # any build: the AVX2 one offers the product at 1-8 rows too
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    g = torch.Generator().manual_seed(11)

    def dense(dtype: torch.dtype, n: int = 96) -> torch.nn.Module:
        weight = UnquantizedWeight(torch.randn(n, 128, generator=g).to(dtype))
        return watched(build_linear(weight, None, dtype, "cpu"))

    m = torch.nn.ModuleList([dense(torch.bfloat16), dense(torch.bfloat16), dense(torch.float32)])
    # Stand-ins: the native product fastest at 1-2 rows, torch's GEMM at 4-8 (as with AMX).
    seconds = lambda variant, rows: {"gemv": 1.0 if rows <= 2 else 3.0, "gemm": 2.0}.get(variant, 9.0)
    # At 1-2 rows the GEMMs are not timed (warm timings favour them; a cold step reads the weights once)
    assert not_worth_timing(1, "gemm") and not_worth_timing(2, "native-gemm") and not not_worth_timing(4, "gemm")
    assert not not_worth_timing(1, "gemv")
    calls: list[int] = []
    chosen = tune_cpu_layers(m, timer=stand_in_timer(seconds, calls))
    key = shape_key(m[0].linear_spec)
    # decode buckets only (prompts keep one path); the float32 layer is never timed (its bits stay pinned)
    assert chosen == {key: {1: "gemv", 2: "gemv", 4: "gemm", 8: "gemm"}}
    assert m[0].measured == m[1].measured == chosen[key] and m[2].measured == {}
    assert choose_variant(m[1], 3) == "gemm" and choose_variant(m[1], 2) == "gemv"
    assert choose_variant(m[1], 9) == m[1].static_variant(9)  # past 8 rows: the static choice
    assert "padded-gemm" not in json.loads(preferences("cpu").path.read_text())["choices"][key]["rows<=8"]["ms"]
    x = torch.randn(8, 128).bfloat16()
    with torch.inference_mode(), forward_phase(prefill=True):
        assert m[0].prompt_variant() in ("padded-gemm", "native-gemm")  # not measured: one prompt path
        assert torch.equal(m[0](x), m[0].run(x, m[0].prompt_variant()))
    # The product wins everywhere (another shape): chosen up to 8 rows on any build (also where 2 rows
    # is its default, without AVX512-BF16).
    m = torch.nn.ModuleList([dense(torch.bfloat16, n=64)])
    assert tune_cpu_layers(m, timer=stand_in_timer(lambda v, r: 1.0 if v == "gemv" else 2.0)) == {
        shape_key(m[0].linear_spec): {1: "gemv", 2: "gemv", 4: "gemv", 8: "gemv"}}


def test_page_in_reads_every_page_of_every_tensor(monkeypatch):
    """The tensors of a shape's layers are read once before the timings go round them (tune_rows'
    peers): weights mapped from the checkpoint would otherwise time their first read from the file."""
    layers = [torch.nn.Linear(4096, 3, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)]
    layers[0].register_buffer("codes", torch.zeros(5000, dtype=torch.int8))
    layers[1].register_buffer("fp8", torch.zeros(4, 1500).to(torch.float8_e4m3fn))
    seen: list[tuple[int, int]] = []
    real = torch.Tensor.sum

    def spying(t, *args, **kwargs):
        seen.append((t.data_ptr(), t.numel()))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", spying)
    select.page_in(layers)
    tensors = [*layers[0].parameters(), *layers[0].buffers(), *layers[1].parameters(), *layers[1].buffers()]
    assert sorted(seen) == sorted((t.data_ptr(), -(-t.numel() * t.element_size() // 4096)) for t in tensors)
