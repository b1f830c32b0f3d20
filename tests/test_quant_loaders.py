"""The loader matrix: every quantized format x every get_weights_* x world sizes 1, 2, 4.

Checkpoints are packed by the test-side packers (quant_packers.py) into an
in-memory tensor source. Each rank's typed weight is unpacked and dequantized by
the server, the per-rank dense slices are reassembled, and the result must equal
the dense weight the test-side quantizer produced: sharding, packing, zero-point
offsets and group bookkeeping are all on that path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import METHODS, join_shards, load_qkv, qkv_of
from quant_packers import awq_tensors, ct_tensors, gptq_tensors, quantize_rtn

from text_generation_server.kernels import cpu
from text_generation_server.kernels.base import dequantize
from text_generation_server.quantizers.config import AWQConfig, CompressedTensorsConfig, GPTQConfig
from text_generation_server.quantizers.factory import get_loader
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import DictTensorSource
from text_generation_server.quantizers.weights import Weights

torch.set_num_threads(1)

K = 384  # divisible by every group size below; 96 rows per rank at world size 4
PARTS = {"q": 256, "k": 128, "v": 128}  # fused qkv: 64 + 32 + 32 columns per rank at world size 4
N = sum(PARTS.values())
WORLDS = [1, 2, 4]


@dataclass
class Case:
    """One quantized checkpoint in memory, with the dense weights it must load as."""

    tensors: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]  # prefix -> [N, K] float32
    config: object


def weights_for(case: Case, rank: int = 0, world: int = 1, tensors: dict | None = None) -> Weights:
    return Weights(DictTensorSource(tensors or case.tensors), torch.device("cpu"), torch.float32,
                   ProcessGroup(rank=rank, size=world), loader=get_loader(case.config))


def build_case(pack, config, bits: int, group_size: int, sym: bool, act_order: bool = False,
               static_groups: bool = False, seed: int = 0) -> Case:
    """Quantizes q, k, v and a fused qkv of the same inputs (shared act-order) and packs them."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(K, generator=g) if act_order else None
    tensors, dense = {}, {}
    shapes = {f"m.{name}": n for name, n in PARTS.items()} | {"m.qkv": N}
    for prefix, n in shapes.items():
        w = torch.randn(n, K, generator=g) * 0.1
        q = quantize_rtn(w, bits, group_size, sym, perm=perm, static_groups=static_groups)
        tensors |= pack(prefix, q)
        dense[prefix] = q.dense()
    return Case(tensors, dense, config)


def gptq_case(bits=4, group_size=128, sym=True, fmt="gptq", desc_act=False, static_groups=False, seed=0):
    config = GPTQConfig(source="test", bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                        static_groups=static_groups, checkpoint_format=fmt)
    return build_case(lambda p, q: gptq_tensors(p, q, fmt), config, bits, group_size, sym,
                      act_order=desc_act, static_groups=static_groups, seed=seed)


def awq_case(group_size=128, seed=0):
    config = AWQConfig(source="test", bits=4, group_size=group_size)
    return build_case(awq_tensors, config, 4, group_size, sym=False, seed=seed)


def ct_config(bits, group_size, sym, targets=("Linear",), ignore=()):
    from text_generation_server.quantizers.config import WeightScheme

    strategy = "channel" if group_size == -1 else "group"
    scheme = WeightScheme(bits=bits, strategy=strategy, group_size=group_size, symmetric=sym, targets=targets)
    return CompressedTensorsConfig(source="test", schemes=(scheme,), modules_to_not_convert=ignore)


def ct_case(bits=4, group_size=128, sym=True, g_idx=False, seed=0):
    return build_case(lambda p, q: ct_tensors(p, q, with_g_idx=g_idx), ct_config(bits, group_size, sym),
                      bits, group_size, sym, act_order=g_idx, seed=seed)


def _sym(sym: bool) -> str:
    return "sym" if sym else "asym"


CASES = {
    # GPTQ: every bits x group size (48 is the odd one; 64 and 128 straddle ranks at world size 4),
    # symmetric and asymmetric alternating.
    **{f"gptq-{b}bit-g{g}-{_sym(not (i + j) % 2)}": (gptq_case, dict(bits=b, group_size=g, sym=not (i + j) % 2))
       for i, b in enumerate((2, 3, 4, 8)) for j, g in enumerate((-1, 32, 48, 64, 128))},
    **{f"gptq-4bit-{fmt}-{_sym(sym)}": (gptq_case, dict(fmt=fmt, sym=sym))
       for fmt in ("gptq", "gptq_v2") for sym in (True, False)},
    **{f"gptq-{b}bit-actorder{'-static' if st else ''}-{_sym(sym)}":
       (gptq_case, dict(bits=b, group_size=32 if b == 3 else 64, desc_act=True, static_groups=st, sym=sym,
                        fmt="gptq_v2"))
       for b in (3, 4) for st in (False, True) for sym in (True, False)},
    **{f"awq-g{g}": (awq_case, dict(group_size=g)) for g in (32, 64, 128)},
    **{f"ct-int{b}-{'channel' if g == -1 else f'g{g}'}-{_sym(sym)}{'-gidx' if gi else ''}":
       (ct_case, dict(bits=b, group_size=g, sym=sym, g_idx=gi))
       for b in (4, 8) for g in (-1, 32, 128) for sym in (True, False)
       for gi in ((False, True) if g != -1 else (False,))},
}


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {}


def get_case(cases: dict, name: str) -> Case:
    if name not in cases:
        build, kwargs = CASES[name]
        cases[name] = build(**kwargs, seed=len(cases))
    return cases[name]


def dense_of(weight) -> torch.Tensor:
    return dequantize(weight.to_quantized(), torch.float32)


def load(case: Case, method: str, rank: int, world: int) -> torch.Tensor:
    return dense_of(load_qkv(weights_for(case, rank, world), method, PARTS))


def reassemble(method: str, shards: list[torch.Tensor], case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the ranks hold put back together, what it must equal)."""
    if method == "full":
        for s in shards[1:]:
            assert torch.equal(s, shards[0])
    return join_shards(method, shards, PARTS), qkv_of(method, case.dense, PARTS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(CASES))
def test_loader_matrix(cases, name, method, world):
    case = get_case(cases, name)
    shards = [load(case, method, rank, world) for rank in range(world)]
    for shard in shards:
        if method in ("col", "col_packed", "multi_col"):
            assert shard.shape == (N // world, K)
        elif method == "row":
            assert shard.shape == (N, K // world)
    got, want = reassemble(method, shards, case)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_typed_weight_shapes_are_the_local_partition(cases):
    case = get_case(cases, "gptq-4bit-gptq-asym")
    w = weights_for(case, rank=1, world=4)
    assert w.get_weights_col("m.qkv").shape == (N // 4, K)
    assert w.get_weights_row("m.qkv").shape == (N, K // 4)
    assert w.get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0).shape == (N // 4, K)


@pytest.mark.parametrize("name", ["gptq-4bit-g64-asym", "gptq-4bit-actorder-sym", "gptq-3bit-g32-sym",
                                  "awq-g128", "ct-int8-channel-sym", "ct-int4-g32-asym-gidx"])
def test_get_linear_runs_the_weight(cases, name):
    """The module a typed weight builds computes x @ W^T + b with the loaded weight, whatever kernel it chose."""
    case = get_case(cases, name)
    for world in (1, 2):
        for rank in range(world):
            w = weights_for(case, rank, world).get_weights_row("m.qkv")
            bias = torch.randn(N)
            module = w.get_linear(bias)
            assert isinstance(module.kernel_name, str)
            x = torch.randn(5, K // world)
            want = x @ dense_of(w).t() + bias
            got = module(x).float()
            assert (got - want).norm() / want.norm() < 2e-2, module.kernel_name


def test_act_order_row_shards_keep_full_groups(cases):
    """Under act-order any group can own rows on any rank: each rank keeps the groups it uses."""
    case = get_case(cases, "gptq-4bit-actorder-asym")
    w = weights_for(case, rank=1, world=4).get_weights_row("m.qkv")
    assert w.g_idx.shape == (K // 4,)
    assert w.scales.shape[0] > K // 4 // 64  # more groups than a naive split would keep
    q = w.to_quantized()
    assert q.act_order


def test_unaligned_group_boundaries_are_shared_by_neighbours(cases):
    # g=128, 96 rows per rank: rank 1 owns rows 96..191, i.e. the end of group 0 and the start of group 1.
    case = get_case(cases, "gptq-4bit-gptq-asym")
    w = weights_for(case, rank=1, world=4).get_weights_row("m.qkv")
    assert w.scales.shape[0] == 2
    assert w.g_idx[:32].eq(0).all() and w.g_idx[32:].eq(1).all()


@pytest.mark.parametrize("name", ["gptq-4bit-gptq-asym", "ct-int4-g128-sym", "awq-g128"])
def test_row_shards_keep_only_the_groups_their_rows_use(cases, name):
    case = get_case(cases, name)
    w = weights_for(case, rank=1, world=2).get_weights_row("m.qkv")  # rows 192..383: groups 1 and 2
    q = w.to_quantized()
    assert q.scales.shape[0] == 2
    w = weights_for(case, rank=1, world=3).get_weights_row("m.qkv")  # rows 128..255: exactly group 1
    q = w.to_quantized()
    assert q.scales.shape[0] == 1 and not q.act_order


def test_compressed_tensors_k_not_a_multiple_of_the_pack_factor():
    """weight_packed pads the last word; the loader reads K from weight_shape."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 100, generator=g)
    for bits, group in ((4, -1), (4, 20), (8, 50)):
        q = quantize_rtn(w, bits, group, sym=False)
        tensors = ct_tensors("m.lin", q, with_g_idx=False)
        assert tensors["m.lin.weight_packed"].shape == (64, -(-100 // (32 // bits)))
        case = Case(tensors, {"m.lin": q.dense()}, ct_config(bits, group, sym=False))
        weights = weights_for(case)
        for method in ("get_weights", "get_weights_col", "get_weights_row"):
            loaded = getattr(weights, method)("m.lin")
            torch.testing.assert_close(dense_of(loaded), q.dense(), rtol=1e-6, atol=1e-6)


def test_legacy_gptq_tensors_configure_the_loader():
    """Parameters stored as gptq_bits / gptq_groupsize tensors: asymmetric v1, no act-order."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 128, generator=g)
    q = quantize_rtn(w, 4, 32, sym=False)
    tensors = gptq_tensors("m.lin", q, "gptq", with_g_idx=False)
    tensors |= {"gptq_bits": torch.tensor([4]), "gptq_groupsize": torch.tensor([32])}
    plain = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32)
    config = GPTQConfig.from_tensors(plain)
    assert (config.bits, config.group_size, config.sym, config.checkpoint_format) == (4, 32, False, "gptq")
    for world in (1, 2):
        case = Case(tensors, {"m.lin": q.dense()}, config)
        shards = [dense_of(weights_for(case, r, world).get_weights_row("m.lin")) for r in range(world)]
        torch.testing.assert_close(torch.cat(shards, dim=1), q.dense(), rtol=1e-6, atol=1e-6)


def test_v1_zero_points_are_stored_minus_one():
    """The published bit patterns: a symmetric 4-bit qzeros word is 0x77777777 in v1, 0x88888888 in v2."""
    q = quantize_rtn(torch.randn(16, 64), 4, 32, sym=True)
    assert gptq_tensors("m", q, "gptq")["m.qzeros"].flatten().eq(0x77777777).all()
    assert gptq_tensors("m", q, "gptq_v2")["m.qzeros"].flatten().eq(0x88888888 - 2**32).all()
    # Read as v2, a v1 checkpoint's zero points are off by one: the loader must not be format-blind.
    case = Case(gptq_tensors("m.lin", quantize_rtn(torch.randn(16, 64), 4, 32, sym=False), "gptq"), {},
                GPTQConfig(source="t", bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"))
    v1 = GPTQConfig(source="t", bits=4, group_size=32, sym=False, checkpoint_format="gptq")
    as_v2 = dense_of(weights_for(case).get_weights("m.lin"))
    as_v1 = dense_of(weights_for(Case(case.tensors, {}, v1)).get_weights("m.lin"))
    assert not torch.allclose(as_v1, as_v2)


def test_3bit_words_follow_the_autogptq_stream():
    """Value 10 of a 32-row block straddles words 0 and 1; value 21 straddles words 1 and 2."""
    from quant_packers import pack_gptq_rows

    codes = torch.zeros(32, 1, dtype=torch.long)
    codes[0], codes[10], codes[21], codes[31] = 1, 7, 5, 6
    words = pack_gptq_rows(codes, 3).view(-1).tolist()
    as_u32 = [w & 0xFFFFFFFF for w in words]
    assert as_u32[0] == 1 | (0b11 << 30)
    assert as_u32[1] == 0b1 | (0b1 << 31)  # bit 0: top bit of value 10; bit 31: low bit of value 21 (5 = 0b101)
    assert as_u32[2] == 0b10 | (6 << 29)  # bits 0-1: top two bits of value 21; value 31 at bit 29


# -- modules left dense -------------------------------------------------------------------
def test_modules_to_not_convert_load_dense_through_use_loader(cases):
    case = get_case(cases, "gptq-4bit-gptq-asym")
    dense_w = torch.randn(32, K)
    tensors = dict(case.tensors) | {"m.gate.weight": dense_w, "m.up.weight": dense_w + 1}
    config = GPTQConfig(source="cfg.json", bits=4, group_size=128, sym=False, modules_to_not_convert=("gate", "up"))
    w = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, loader=get_loader(config))
    assert torch.equal(w.get_weights_col("m.gate").weight, dense_w)
    assert torch.equal(w.get_multi_weights_col(["m.gate", "m.up"], dim=0).weight, torch.cat([dense_w, dense_w + 1]))
    assert type(w.get_weights_col("m.qkv")).__name__ == "GPTQWeight"
    with pytest.raises(ValueError, match=r"m\.gate left unquantized but m\.q quantized \(cfg\.json\)"):
        w.get_multi_weights_col(["m.gate", "m.q"], dim=0)


def test_module_names_match_by_component_not_substring():
    config = GPTQConfig(source="c", modules_to_not_convert=("gate", "model.layers.1"))
    assert not config.quantizes("model.layers.0.mlp.gate")
    assert config.quantizes("model.layers.0.mlp.gate_proj")
    assert not config.quantizes("model.layers.1.self_attn.q_proj")
    assert config.quantizes("model.layers.10.self_attn.q_proj")


def test_compressed_tensors_targets_and_ignore():
    config = ct_config(4, 128, True, targets=("re:.*self_attn\\..*",), ignore=("re:.*layers\\.0\\..*",))
    assert config.scheme_for("model.layers.1.self_attn.q_proj") is not None
    assert config.scheme_for("model.layers.1.mlp.down_proj") is None  # not targeted
    assert config.scheme_for("model.layers.0.self_attn.q_proj") is None  # ignored
    linear = ct_config(4, 128, True, ignore=("lm_head",))
    assert linear.quantizes("model.layers.3.mlp.up_proj") and not linear.quantizes("lm_head")


# -- bad tensors ------------------------------------------------------------------------------
def broken(case: Case, **changes) -> Case:
    tensors = dict(case.tensors)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return Case(tensors, case.dense, case.config)


def test_missing_qzeros_is_named(cases):
    case = broken(get_case(cases, "gptq-4bit-gptq-asym"), m__qkv__qzeros=None)
    with pytest.raises(ValueError, match=r"'m\.qkv\.qzeros' not found"):
        weights_for(case).get_weights_col("m.qkv")
    case = broken(get_case(cases, "awq-g128"), m__qkv__qzeros=None)
    with pytest.raises(ValueError, match=r"'m\.qkv\.qzeros' not found"):
        weights_for(case).get_weights_row("m.qkv")
    case = broken(get_case(cases, "ct-int4-g128-asym"), m__qkv__weight_zero_point=None)
    with pytest.raises(ValueError, match=r"'m\.qkv\.weight_zero_point' not found.*asymmetric"):
        weights_for(case).get_weights_col("m.qkv")


def test_wrong_shapes_are_named(cases):
    case = get_case(cases, "gptq-4bit-gptq-asym")
    bad = broken(case, m__qkv__scales=case.tensors["m.qkv.scales"][:, :-8])
    with pytest.raises(ValueError, match=r"'m\.qkv\.(scales|qweight)'"):
        weights_for(bad).get_weights("m.qkv")
    bad = broken(case, m__qkv__qzeros=case.tensors["m.qkv.qzeros"][:, :-1])
    with pytest.raises(ValueError, match=r"'m\.qkv\.qzeros' has shape"):
        weights_for(bad).get_weights("m.qkv")
    bad = broken(case, m__qkv__g_idx=case.tensors["m.qkv.g_idx"][:-32])
    with pytest.raises(ValueError, match=r"'m\.qkv\.qweight'.*'m\.qkv\.g_idx' has 352 entries"):
        weights_for(bad).get_weights_row("m.qkv")
    awq = get_case(cases, "awq-g128")
    bad = broken(awq, m__qkv__scales=awq.tensors["m.qkv.scales"][:2])
    with pytest.raises(ValueError, match=r"'m\.qkv\.scales' has 2 groups"):
        weights_for(bad).get_weights("m.qkv")
    ct = get_case(cases, "ct-int4-g128-sym")
    bad = broken(ct, m__qkv__weight_scale=ct.tensors["m.qkv.weight_scale"][:-1])
    with pytest.raises(ValueError, match=r"'m\.qkv\.weight_scale' has shape"):
        weights_for(bad).get_weights("m.qkv")


def test_g_idx_out_of_range_is_named(cases):
    for name, tensor in (("gptq-4bit-actorder-asym", "m.qkv.g_idx"), ("ct-int4-g128-sym-gidx", "m.qkv.weight_g_idx")):
        case = get_case(cases, name)
        g_idx = case.tensors[tensor].clone()
        g_idx[7] = 99
        bad = broken(case, **{tensor.replace(".", "__"): g_idx})
        for method in ("get_weights", "get_weights_row"):
            with pytest.raises(ValueError, match=rf"'{tensor}' has group indices in \[0, 99\]"):
                getattr(weights_for(bad, 0, 2), method)("m.qkv")


def test_config_and_tensors_disagreeing(cases):
    case = get_case(cases, "gptq-8bit-g128-asym")  # tensors packed at 8 bits...
    as_4bit = Case(case.tensors, {}, GPTQConfig(source="quantize_config.json", bits=4, group_size=128, sym=False))
    with pytest.raises(ValueError, match=r"'m\.qkv\.qweight' has 96 rows.*bits = 4 \(quantize_config\.json\)"):
        weights_for(as_4bit).get_weights("m.qkv")
    as_g64 = Case(case.tensors, {}, GPTQConfig(source="quantize_config.json", bits=8, group_size=64, sym=False))
    with pytest.raises(ValueError, match=r"'m\.qkv\.scales' has 3 groups.*group_size = 64"):
        weights_for(as_g64).get_weights_col("m.qkv")
    asym = get_case(cases, "gptq-4bit-gptq-asym")
    as_sym = Case(asym.tensors, {}, GPTQConfig(source="c", bits=4, group_size=128, sym=True))
    with pytest.raises(ValueError, match=r"'m\.qkv\.qzeros' holds zero points other than 8.*sym: true"):
        weights_for(as_sym).get_weights("m.qkv")
    ct = get_case(cases, "ct-int8-g128-sym")
    with pytest.raises(ValueError, match=r"'m\.qkv\.weight_shape' = \[512, 384\] disagrees"):
        weights_for(Case(ct.tensors, {}, ct_config(4, 128, True))).get_weights("m.qkv")
    tensors = dict(case.tensors) | {"gptq_bits": torch.tensor([4])}
    w = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"tensor 'gptq_bits' = 4 .* disagrees with cfg \(bits = 8\)"):
        GPTQConfig(source="cfg", bits=8, group_size=128, sym=False).check_tensors(w)


def test_impossible_splits_name_the_tensor_and_world_size(cases):
    case = get_case(cases, "gptq-3bit-g32-sym")
    # 384 rows at world size 8: 48 per rank, but 3-bit words hold rows in blocks of 32.
    with pytest.raises(ValueError, match=r"'m\.qkv\.qweight': 48 input features per rank at world size 8"):
        weights_for(case, 0, 8).get_weights_row("m.qkv")
    # k_proj's 128 columns over 8 ranks: 16 per rank, but 3-bit qzeros pack columns in blocks of 32.
    with pytest.raises(ValueError, match=r"'m\.k\.qzeros': 16 output features per rank at world size 8"):
        weights_for(case, 0, 8).get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)
    with pytest.raises(ValueError, match=r"'m\.qkv\.qweight'.*does not divide into 5 shards"):
        weights_for(get_case(cases, "awq-g128"), 0, 5).get_weights_col("m.qkv")


def test_fused_act_order_parts_must_share_g_idx(cases):
    case = get_case(cases, "gptq-4bit-actorder-asym")
    bad = broken(case, m__k__g_idx=case.tensors["m.k.g_idx"].flip(0))
    with pytest.raises(ValueError, match=r"'m\.k\.g_idx' differs from 'm\.q\.g_idx'"):
        weights_for(bad).get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)
    bad = broken(case, m__qkv__g_idx=None)
    with pytest.raises(ValueError, match=r"'m\.qkv\.g_idx' not found.*desc_act is true"):
        weights_for(bad).get_weights("m.qkv")



# 64-row groups keep >= 16 rows of each group per rank at 4 ranks; 32-row groups only ~8, which
# whole 32-row blocks would more than double.
ACT_ORDER_SHARDS = [(name, world, "cpu-int4pack") for name in ("gptq-4bit-actorder-sym", "gptq-4bit-actorder-asym")
                    for world in (1, 2, 4)] + [
    (name, world, "cpu-int4pack" if world < 4 else "reference") for name in ("gptq-3bit-actorder-asym",
                                                                               "ct-int4-g32-asym-gidx")
    for world in (1, 2, 4)]


@pytest.mark.parametrize("name,world,kernel", ACT_ORDER_SHARDS)
def test_act_order_row_shards_run_on_the_compact_kernel(cases, name, world, kernel):
    """An act-order row shard holds an uneven number of rows of each group; the int4 CPU kernel sorts
    them by group and pads each group to whole 32-row blocks, so it still runs them (no dense fallback)
    unless the padding would more than double the rows, which it then says."""
    case = get_case(cases, name)
    for rank in range(world):
        w = weights_for(case, rank, world).get_weights_row("m.qkv")
        q = w.to_quantized()
        assert q.act_order
        module = w.get_linear(None)
        assert module.kernel_name == kernel, (rank, q.group_rows())
        if kernel == "reference":
            ok, reason = cpu.CpuInt4PackKernel.can_implement(q.spec(torch.float32, "cpu"))
            assert not ok and reason.startswith("act-order groups too small or uneven") and "over the 100%" in reason
        x = torch.randn(5, K // world, generator=torch.Generator().manual_seed(rank))
        want = x @ dense_of(w).t()
        assert (module(x).float() - want).norm() / want.norm() < 2e-2
