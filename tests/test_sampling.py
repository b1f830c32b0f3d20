"""Token selection: each processor against a slow per-row reference, then the batched chooser."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from text_generation_server.generation import sampling
from text_generation_server.generation.sampling import (
    HeterogeneousNextTokenChooser,
    SamplingParams,
    apply_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    prefill_logprobs,
    top_n_logprobs,
)

torch.set_num_threads(1)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEG_INF = -math.inf


# ---------------------------------------------------------------- references (one row at a time)


def ref_repetition(row: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    out = row.clone()
    for token in set(ids):
        value = out[token].item()
        out[token] = value / penalty if value > 0 else value * penalty
    return out


def ref_frequency(row: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    out = row.clone()
    for token, count in Counter(ids).items():
        out[token] -= penalty * count
    return out


def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= row.numel():
        return row.clone()
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth, row, torch.tensor(NEG_INF))


def _keep_until_mass(row: torch.Tensor, order: list[int], mass: float, key: list[float], ties_le: bool):
    """Walk tokens in `order`, keep them until the kept probability reaches `mass`, plus ties with the last."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    total, kept = 0.0, []
    for token in order:
        kept.append(token)
        total += probs[token]
        if total >= mass:
            break
    last = key[kept[-1]]
    keep = [(k <= last) if ties_le else (k >= last) for k in key]
    return torch.where(torch.tensor(keep), row, torch.tensor(NEG_INF))


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1:
        return row.clone()
    values = row.tolist()
    order = sorted(range(len(values)), key=lambda t: -values[t])
    return _keep_until_mass(row, order, p, values, ties_le=False)


def ref_typical(row: torch.Tensor, mass: float) -> torch.Tensor:
    if mass >= 1:
        return row.clone()
    logp = torch.log_softmax(row.double(), dim=-1)
    probs = logp.exp()
    entropy = -sum(lp * p for lp, p in zip(logp.tolist(), probs.tolist()) if p > 0)
    distance = [abs(-lp - entropy) for lp in logp.tolist()]
    order = sorted(range(len(distance)), key=lambda t: distance[t])
    return _keep_until_mass(row, order, mass, distance, ties_le=True)


def assert_same_scores(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    actual, expected = actual.cpu().double(), expected.cpu().double()
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), (actual, expected)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], atol=atol, rtol=1e-5)


def padded_history(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    history = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        history[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return history, torch.tensor([len(r) for r in rows], dtype=torch.int64)


# ---------------------------------------------------------------- processors


@pytest.mark.parametrize("pad", [-1, 0, 10**6])
def test_penalties_use_only_the_valid_prefix(pad: int) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    scores = torch.randn(4, vocab, generator=gen) * 3
    rows = [[1, 2, 2, 5, 1, 1], [7], [], [3, 3, 39, 0]]
    history, lengths = padded_history(rows, pad)
    rep = torch.tensor([1.3, 2.0, 1.7, 0.6])
    freq = torch.tensor([0.5, -0.4, 1.0, 0.25])
    got_rep = apply_repetition_penalty(scores, history, lengths, rep)
    got_freq = apply_frequency_penalty(scores, history, lengths, freq)
    for i, ids in enumerate(rows):
        assert_same_scores(got_rep[i], ref_repetition(scores[i], ids, rep[i].item()))
        assert_same_scores(got_freq[i], ref_frequency(scores[i], ids, freq[i].item()))
    assert torch.equal(got_rep[2], scores[2]) and torch.equal(got_freq[2], scores[2])


def test_penalties_leave_the_input_untouched_and_accept_empty_history() -> None:
    scores = torch.randn(2, 10)
    before = scores.clone()
    history, lengths = padded_history([[1, 2], [3]], -1)
    apply_repetition_penalty(scores, history, lengths, torch.tensor([2.0, 2.0]))
    apply_frequency_penalty(scores, history, lengths, torch.tensor([1.0, 1.0]))
    assert torch.equal(scores, before)
    empty = torch.empty(2, 0, dtype=torch.int64)
    zero = torch.zeros(2, dtype=torch.int64)
    assert torch.equal(apply_repetition_penalty(scores, empty, zero, torch.tensor([2.0, 2.0])), scores)


def test_temperature_and_top_k_against_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 30, generator=gen)
    temps = torch.tensor([0.5, 1.0, 2.0, 0.1, 1.5])
    torch.testing.assert_close(apply_temperature(scores, temps), scores / temps[:, None])
    ks = [0, 1, 5, 29, 50]
    got = apply_top_k(scores, torch.tensor(ks), max(ks))
    for i, k in enumerate(ks):
        assert_same_scores(got[i], ref_top_k(scores[i], k))
    assert (torch.isfinite(got[2])).sum() == 5 and (torch.isfinite(got[1])).sum() == 1


def test_top_k_keeps_ties_with_the_kth() -> None:
    scores = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    got = apply_top_k(scores, torch.tensor([2]), 2)
    assert torch.isfinite(got).tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize("seed", range(5))
def test_top_p_against_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(6, 50, generator=gen) * 2.5
    ps = [1.0, 0.9, 0.5, 0.05, 0.999, 0.3]
    got = apply_top_p(scores, torch.tensor(ps))
    for i, p in enumerate(ps):
        assert_same_scores(got[i], ref_top_p(scores[i], p))
    # a tiny p still keeps the most likely token
    assert torch.isfinite(got[3]).sum() >= 1
    assert torch.isfinite(got[3, scores[3].argmax()])


def test_top_p_mass_of_kept_set_is_minimal() -> None:
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 100, generator=gen) * 2
    p = 0.8
    got = apply_top_p(scores, torch.tensor([p]))
    probs = torch.softmax(scores[0].double(), -1)
    kept = torch.isfinite(got[0])
    kept_mass = probs[kept].sum().item()
    assert kept_mass >= p
    assert kept_mass - probs[kept].min().item() < p  # dropping the least likely kept token goes below p


@pytest.mark.parametrize("seed", range(5))
def test_typical_p_against_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    scores = torch.randn(5, 64, generator=gen) * 2
    masses = [0.2, 0.5, 0.9, 1.0, 0.01]
    got = apply_typical_p(scores, torch.tensor(masses))
    for i, mass in enumerate(masses):
        assert_same_scores(got[i], ref_typical(scores[i], mass))


@pytest.mark.parametrize("seed", range(4))
def test_top_p_over_top_k_candidates_matches_full_sort(seed: int) -> None:
    gen = torch.Generator().manual_seed(50 + seed)
    scores = torch.randn(4, 300, generator=gen).mul(4).round().div(4)  # coarse values: many ties
    ks = torch.tensor([5, 20, 1, 40])
    after_k = apply_top_k(scores, ks, 40)
    assert (torch.isfinite(after_k).sum(-1) > ks).any()  # ties with the k-th really exceed k
    for p in (0.3, 0.9, 0.999):
        top_p = torch.full((4,), p)
        full = apply_top_p(after_k, top_p)
        assert torch.equal(apply_top_p(after_k, top_p, candidates=40), full)
        for i in range(4):
            assert_same_scores(full[i], ref_top_p(after_k[i], p))


def test_chooser_with_top_k_and_top_p_rows_matches_reference() -> None:
    params = [SamplingParams(top_k=10, top_p=0.7), SamplingParams(top_k=3, top_p=0.95), SamplingParams(top_k=7)]
    chooser = HeterogeneousNextTokenChooser(params, "cpu")
    assert chooser._top_p_candidates == 10  # the shortcut is taken
    scores = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)) * 2
    history, lengths = padded_history([[1], [2], [3]], 0)
    _, logprobs = chooser(scores, history, lengths)
    for i, row in enumerate(params):
        expected = torch.log_softmax(chooser_processed(row, scores[i], []).double(), -1)
        assert_same_scores(logprobs[i], expected, atol=1e-4)


def test_filters_compose_with_already_filtered_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 40, generator=gen)
    k = torch.tensor([10, 4, 20])
    after_k = apply_top_k(scores, k, 20)
    after_p = apply_top_p(after_k, torch.tensor([0.7, 0.95, 0.5]))
    after_typ = apply_typical_p(after_p, torch.tensor([0.8, 0.6, 0.99]))
    for i, (kk, p, m) in enumerate([(10, 0.7, 0.8), (4, 0.95, 0.6), (20, 0.5, 0.99)]):
        expected = ref_typical(ref_top_p(ref_top_k(scores[i], kk), p), m)
        assert_same_scores(after_typ[i], expected)
        assert torch.isfinite(after_typ[i]).any()


# ---------------------------------------------------------------- the chooser


def chooser_processed(params: SamplingParams, scores: torch.Tensor, history: list[int]) -> torch.Tensor:
    """Reference pipeline for one row, in TGI's order."""
    row = scores.clone()
    if params.repetition_penalty != 1.0:
        row = ref_repetition(row, history, params.repetition_penalty)
    if params.frequency_penalty != 0.0:
        row = ref_frequency(row, history, params.frequency_penalty)
    row = row / params.temperature
    row = ref_top_k(row, params.top_k)
    row = ref_top_p(row, params.top_p)
    return ref_typical(row, params.typical_p)


MIXED = [
    SamplingParams(),
    SamplingParams(do_sample=True, seed=11, temperature=0.7, top_k=8),
    SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3),
    SamplingParams(do_sample=True, seed=12, top_p=0.8, typical_p=0.9),
    SamplingParams(temperature=1.3, top_k=3, top_p=0.6),
    SamplingParams(do_sample=True, seed=2**64 - 1, repetition_penalty=0.8, frequency_penalty=-0.2),
]


def test_chooser_logprobs_match_reference_pipeline() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 48
    scores = torch.randn(len(MIXED), vocab, generator=gen) * 2
    rows = [[1, 2, 3], [4, 4], [5, 6, 5, 5, 9], [0], [7, 8], [3, 3, 1]]
    history, lengths = padded_history(rows, -1)
    ids, logprobs = HeterogeneousNextTokenChooser(MIXED, torch.device("cpu"))(scores, history, lengths)
    assert ids.dtype == torch.int64 and ids.shape == (len(MIXED),)
    assert logprobs.dtype == torch.float32 and logprobs.shape == scores.shape
    for i, params in enumerate(MIXED):
        expected = torch.log_softmax(chooser_processed(params, scores[i], rows[i]).double(), -1)
        assert_same_scores(logprobs[i], expected, atol=1e-4)
        assert torch.isfinite(logprobs[i, ids[i]])
        if not params.do_sample:
            assert ids[i].item() == expected.argmax().item()


def test_all_greedy_without_processors_is_plain_argmax() -> None:
    scores = torch.randn(4, 20)
    history, lengths = padded_history([[1], [2], [3], [4]], 0)
    ids, logprobs = HeterogeneousNextTokenChooser([SamplingParams()] * 4, "cpu")(scores, history, lengths)
    assert torch.equal(ids, scores.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(scores, -1))


def test_unused_processors_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("processor ran although no row uses it")

    for name in ("apply_repetition_penalty", "apply_frequency_penalty", "apply_top_k", "apply_typical_p"):
        monkeypatch.setattr(sampling, name, forbidden)
    params = [SamplingParams(temperature=0.5), SamplingParams(top_p=0.5, do_sample=True, seed=1)]
    history, lengths = padded_history([[1], [2]], 0)
    ids, _ = HeterogeneousNextTokenChooser(params, "cpu")(torch.randn(2, 16), history, lengths)
    assert ids.shape == (2,)


class FakeModel:
    """Next-token logits from the last token: a fixed random table, so streams are reproducible."""

    def __init__(self, vocab: int = 32, seed: int = 0) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5

    def step(self, chooser: HeterogeneousNextTokenChooser, rows: list[list[int]], device: str) -> None:
        history, lengths = padded_history(rows, -7)
        scores = self.table[[r[-1] for r in rows]]
        ids, _ = chooser(scores.to(device), history.to(device), lengths.to(device))
        for row, token in zip(rows, ids.tolist()):
            row.append(token)


def run_alone(params: SamplingParams, prompt: list[int], steps: int, device: str) -> list[int]:
    model, row = FakeModel(), list(prompt)
    chooser = HeterogeneousNextTokenChooser([params], torch.device(device))
    for _ in range(steps):
        model.step(chooser, [row], device)
    return row[len(prompt) :]


@pytest.mark.parametrize("device", DEVICES)
def test_heterogeneous_batch_equals_each_row_alone(device: str) -> None:
    prompts = [[1], [2, 3], [4], [5, 5, 5], [6], [7, 8]]
    rows = [list(p) for p in prompts]
    model = FakeModel()
    chooser = HeterogeneousNextTokenChooser(MIXED, torch.device(device))
    for _ in range(12):
        model.step(chooser, rows, device)
    for params, prompt, row in zip(MIXED, prompts, rows):
        assert row[len(prompt) :] == run_alone(params, prompt, 12, device)


def test_seed_reproduces_and_different_seeds_differ() -> None:
    first = run_alone(SamplingParams(do_sample=True, seed=42), [0], 25, "cpu")
    assert run_alone(SamplingParams(do_sample=True, seed=42), [0], 25, "cpu") == first
    assert run_alone(SamplingParams(do_sample=True, seed=43), [0], 25, "cpu") != first


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_stream_survives_filter_and_concatenate(device: str) -> None:
    target = SamplingParams(do_sample=True, seed=1234, top_k=10)
    expected = run_alone(target, [3], 16, device)

    model = FakeModel()
    others = [SamplingParams(do_sample=True, seed=9), SamplingParams(), SamplingParams(do_sample=True, seed=10)]
    rows = [[1], [3], [2], [4]]
    chooser = HeterogeneousNextTokenChooser([others[0], target, others[1], others[2]], torch.device(device))
    for _ in range(5):
        model.step(chooser, rows, device)
    # request 0 and 2 finish; the target moves to position 1 of the new batch
    chooser = chooser.filter([3, 1])
    rows = [rows[3], rows[1]]
    for _ in range(4):
        model.step(chooser, rows, device)
    newcomer = HeterogeneousNextTokenChooser([SamplingParams(do_sample=True, seed=77)], torch.device(device))
    chooser = HeterogeneousNextTokenChooser.concatenate([newcomer, chooser])
    rows = [[9], *rows]
    assert chooser.seeds == [77, 10, 1234]
    for _ in range(7):
        model.step(chooser, rows, device)
    assert rows[2][1:] == expected


def test_unseeded_rows_report_a_seed_that_replays() -> None:
    params = [SamplingParams(do_sample=True), SamplingParams(), SamplingParams(seed=5), SamplingParams(do_sample=True)]
    chooser = HeterogeneousNextTokenChooser(params, torch.device("cpu"))
    seeds = chooser.seeds
    assert seeds[1] == 0 and seeds[2] == 5
    assert seeds[0] != seeds[3] and all(0 <= s < 2**64 for s in seeds)
    assert seeds[0] != HeterogeneousNextTokenChooser(params, "cpu").seeds[0]
    model, rows = FakeModel(), [[1], [1], [1], [1]]
    for _ in range(15):
        model.step(chooser, rows, "cpu")
    assert rows[0][1:] == run_alone(SamplingParams(do_sample=True, seed=seeds[0]), [1], 15, "cpu")
    assert rows[3][1:] == run_alone(SamplingParams(do_sample=True, seed=seeds[3]), [1], 15, "cpu")


def test_samples_follow_the_processed_distribution() -> None:
    torch.manual_seed(0)
    vocab, draws = 12, 6000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(8))
    params = [SamplingParams(do_sample=True, seed=s, temperature=0.8, top_k=6, top_p=0.9) for s in range(draws)]
    chooser = HeterogeneousNextTokenChooser(params, "cpu")
    history, lengths = padded_history([[0]] * draws, 0)
    ids, logprobs = chooser(logits.expand(draws, vocab).contiguous(), history, lengths)
    probs = logprobs[0].exp()
    counts = torch.bincount(ids, minlength=vocab).double() / draws
    assert counts[probs == 0].sum() == 0  # never a filtered token
    torch.testing.assert_close(counts, probs.double(), atol=0.025, rtol=0)


# Upper 0.1% point of the chi-square distribution with 5 degrees of freedom.
CHI2_DF5_P001 = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_one_seeded_stream_is_unbiased() -> None:
    """4,000 steps of one request's stream: frequencies pass a chi-square test against its distribution.

    The stream is seeded, so the test is deterministic; a sampler that skews mass towards the
    likeliest tokens (argmax-leaning), away from them, or off by one token scores far above the bound.
    """
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    scores = probs.log()[None, :]
    history, lengths = padded_history([[0]], 0)
    chooser = HeterogeneousNextTokenChooser([SamplingParams(do_sample=True, seed=2024)], "cpu")
    draws = [chooser(scores, history, lengths)[0].item() for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=6)
    assert chi_square(counts, probs) < CHI2_DF5_P001, counts.tolist()


def test_exponential_race_matches_the_distribution_and_its_edges() -> None:
    generator = torch.Generator().manual_seed(5)
    probs = torch.tensor([0.05, 0.5, 0.2, 0.15, 0.0, 0.1])  # token 4 filtered
    rows = 20000
    uniforms = torch.rand(rows, 6, generator=generator)
    picks = sampling.exponential_race(probs.expand(rows, 6), uniforms)
    counts = torch.bincount(picks, minlength=6)
    assert counts[4] == 0
    kept = probs > 0
    assert chi_square(counts[kept], probs[kept]) < CHI2_DF5_P001 - 2.0  # 4 degrees of freedom: bound 18.47
    # Rows need not be normalised: scaling a row changes nothing.
    same_uniforms = torch.rand(rows, 6, generator=torch.Generator().manual_seed(5))
    again = sampling.exponential_race(7.0 * probs.expand(rows, 6), same_uniforms)
    assert torch.equal(again, picks)
    # A uniform of exactly 0 (E = +inf) must not let a filtered token win: the one token with mass
    # wins even when its own uniform is 0, and a tiny-mass token is not lifted by the largest uniform.
    only = torch.tensor([[0.0, 1.0, 0.0]])
    assert sampling.exponential_race(only, torch.zeros(1, 3)).item() == 1
    tail = torch.tensor([[1.0, 1e-12]])
    assert sampling.exponential_race(tail, torch.tensor([[0.5, 1.0 - 2.0**-24]])).item() == 0
    assert sampling.exponential_race(tail, torch.tensor([[0.0, 1.0 - 2.0**-24]])).item() == 0


def test_sampling_runs_no_float64_and_no_vocabulary_cumsum() -> None:
    """Every op of a sampling step, as the dispatcher sees it: float32 only (GPUs run float64 at a
    small fraction of the float32 rate) and no cumulative sum when no top-p/typical-p row asks for one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, set[torch.dtype]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            results = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append((str(func), {t.dtype for t in results if isinstance(t, torch.Tensor)}))
            return out

    params = [SamplingParams(do_sample=True, seed=s, temperature=0.7, top_k=20) for s in range(3)] + [SamplingParams()]
    history, lengths = padded_history([[0]] * 4, 0)
    chooser = HeterogeneousNextTokenChooser(params, "cpu")
    scores = torch.randn(4, 300)
    with Record() as record:
        ids, _ = chooser(scores, history, lengths)
    assert ids.shape == (4,)
    assert any("uniform" in op for op, _ in record.ops)  # the recorder saw the draw
    assert not [op for op, dtypes in record.ops if torch.float64 in dtypes]
    assert not [op for op, _ in record.ops if "cumsum" in op]


def test_top_n_logprobs_against_direct_sort() -> None:
    logprobs = torch.log_softmax(torch.randn(4, 15), -1)
    got = top_n_logprobs(logprobs, [0, 3, 1, 20])
    assert got[0] == ([], [])
    for i, n in enumerate([0, 3, 1, 20]):
        order = sorted(range(15), key=lambda t: -logprobs[i, t].item())[: min(n, 15)]
        ids, values = got[i]
        assert ids == order
        assert values == pytest.approx([logprobs[i, t].item() for t in order])
    assert top_n_logprobs(logprobs, [0, 0, 0, 0]) == [([], [])] * 4
    with pytest.raises(ValueError, match="top_n"):
        top_n_logprobs(logprobs, [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        top_n_logprobs(logprobs, [1, -1, 0, 0])


@pytest.mark.parametrize("chunk", [1 << 24, 7 * 10])
def test_prefill_logprobs_against_direct_computation(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(sampling, "_PREFILL_CHUNK_ELEMENTS", chunk)  # 70 // vocab 10 -> 7-row chunks
    logits = torch.randn(23, 10, dtype=torch.bfloat16)
    input_ids = torch.randint(0, 10, (23,))
    got = prefill_logprobs(logits, input_ids)
    assert got.shape == (23,) and got.dtype == torch.float32 and math.isnan(got[0].item())
    direct = torch.log_softmax(logits.float(), -1)
    expected = torch.stack([direct[i - 1, input_ids[i]] for i in range(1, 23)])
    torch.testing.assert_close(got[1:], expected)
    single = prefill_logprobs(logits[:1], input_ids[:1])
    assert single.shape == (1,) and math.isnan(single[0].item())
    with pytest.raises(ValueError, match="input_ids"):
        prefill_logprobs(logits, input_ids[:5])
    with pytest.raises(ValueError, match="at least one token"):
        prefill_logprobs(logits[:0], input_ids[:0])


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("typical_p", 0.0),
        ("seed", -1),
        ("seed", 2**64),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", math.inf),
        ("do_sample", 1),
    ],
)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    """validate() runs each field's validator (generation/request_fields.py), where a request
    enters; the chooser takes validated rows and does not check them again."""
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_with_tgi_sampling_promotes_warped_greedy_requests() -> None:
    assert SamplingParams(temperature=0.5).with_tgi_sampling().do_sample
    assert SamplingParams(top_k=4, seed=3).with_tgi_sampling() == SamplingParams(top_k=4, seed=3, do_sample=True)
    assert SamplingParams(top_p=0.9).with_tgi_sampling().do_sample
    assert SamplingParams(typical_p=0.9).with_tgi_sampling().do_sample
    plain = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    assert plain.with_tgi_sampling() is plain  # penalties alone stay greedy, as in TGI


def test_shape_and_index_errors() -> None:
    chooser = HeterogeneousNextTokenChooser([SamplingParams(), SamplingParams()], "cpu")
    history, lengths = padded_history([[1], [2]], 0)
    with pytest.raises(ValueError, match="scores"):
        chooser(torch.randn(3, 5), history, lengths)
    with pytest.raises(ValueError, match="history_lengths"):
        chooser(torch.randn(2, 5), history, lengths[:1])
    with pytest.raises(ValueError, match="out of range"):
        chooser.filter([2])
    with pytest.raises(ValueError, match="repeat"):
        chooser.filter([0, 0])
    with pytest.raises(ValueError, match="at least one"):
        HeterogeneousNextTokenChooser.concatenate([])
    empty = chooser.filter([])
    assert len(empty) == 0 and empty.seeds == []
    assert len(HeterogeneousNextTokenChooser.concatenate([empty, chooser.filter([1])])) == 1


def test_a_fork_draws_what_the_original_would_and_leaves_it_untouched() -> None:
    """Decode ahead runs a step on a fork: the fork's draws are the ones the original would
    make, and the original's streams stay where they were."""
    params = [SamplingParams(do_sample=True, seed=3), SamplingParams(), SamplingParams(do_sample=True, seed=4)]
    chooser = HeterogeneousNextTokenChooser(params, "cpu")
    history, lengths = padded_history([[1], [2], [3]], 0)
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    chooser(scores, history, lengths)
    ahead = [chooser.fork([0, 1, 2])(scores, history, lengths)[0].tolist() for _ in range(2)]
    assert ahead[0] == ahead[1]  # each fork starts where the original is
    assert chooser(scores, history, lengths)[0].tolist() == ahead[0]
    part = chooser.fork([2])
    assert part(scores[2:], history[2:], lengths[2:])[0].tolist() == chooser(scores, history, lengths)[0][2:].tolist()
