"""The host's budget for one steady decode step: at most 1 device sync and 8 eager launches.

Counted on the CUDA-emulating CPU path (tests/test_cuda_graphs.py: `EagerReplayCapturer` replays
a "graph" by running the recorded forward again), for batches of greedy rows at 1 and 32, the
shape of a served request without processors, grammar, speculation or top-n:

- launches: every operator the dispatcher sees outside the graph that would run a kernel on a
  device (views and bare allocations run none; what the graph replays is not counted);
- syncs: every read of a device value on the host (`.item()`, `.tolist()`, `bool()` of a tensor,
  `.cpu()`, nonzero, ...), and `torch.tensor(data)`, which is a synchronous copy on CUDA.

The step is counted both as `generate_token` runs it and as the shard runs it ahead of its
Decode, on a fork of the batch (shard/service.py, decode ahead). Before the issue-31 work a
step issued about 18 such launches here (25 on CUDA) and, with its fork, three syncs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import write_checkpoint
from test_cuda_graphs import MAX_TOTAL, GraphSafePadded, load, request
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.generation.sampling import SamplingParams

MAX_SYNCS = 1
MAX_LAUNCHES = 8
BUCKETS = [1, 2, 4, 8, 16, 32]

# Tensor methods and torch functions that read a device value on the host, or (torch.tensor)
# copy host data to the device synchronously.
SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select",
                   "unique", "numpy", "cpu", "tensor", "as_tensor"})
# Operators that allocate without running a kernel.
ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                         "aten.new_empty.default"})


class StepCounter:
    """Counts syncs (torch function level) and launches (dispatcher level) outside the graph."""

    def __init__(self, capturer: EagerReplayCapturer | None):
        self.capturer = capturer
        self.syncs: list[str] = []
        self.launches: list[str] = []
        counter = self

        class Syncs(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in SYNCS and not counter._in_graph():
                    counter.syncs.append(name)
                return func(*args, **(kwargs or {}))

        class Launches(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if not func.is_view and name not in ALLOCATIONS and name != "aten._local_scalar_dense.default" \
                        and not counter._in_graph():
                    counter.launches.append(name)
                return func(*args, **(kwargs or {}))

        self._modes = (Syncs(), Launches())

    def _in_graph(self) -> bool:
        return self.capturer is not None and self.capturer.inside

    def __enter__(self) -> "StepCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def steady_batch(lm, rows: int, params: SamplingParams | None = None, top_n: int = 0):
    """A batch of `rows` requests after their prefill and two decode steps."""
    requests = [request(i, 3 + i % 5, 12) for i in range(rows)]
    if params is not None or top_n:
        requests = [GenerationRequest(id=r.id, inputs="", input_ids=r.input_ids, max_new_tokens=12,
                                      ignore_eos_token=True, sampling=params or SamplingParams(), top_n_tokens=top_n)
                    for r in requests]
    batch = lm.make_batch(0, requests)
    for _ in range(3):
        _, batch, _ = lm.generate_token(batch)
    return batch


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("budget") / "llama"
    write_checkpoint(path, "llama", seed=41)
    return str(path)


@pytest.fixture(scope="module")
def graphed(folder):
    capturer = EagerReplayCapturer()
    return load(folder, buckets=BUCKETS, capturer=capturer), capturer


@pytest.mark.parametrize("rows", [1, 32])
def test_a_steady_greedy_step_stays_within_one_sync_and_eight_launches(graphed, rows):
    lm, capturer = graphed
    batch = steady_batch(lm, rows)
    replays = sum(lm.graphs.stats.replays.values())
    with StepCounter(capturer) as step:
        generations, batch, _ = lm.generate_token(batch)
    assert sum(lm.graphs.stats.replays.values()) == replays + 1  # the forward came from the graph
    assert len(generations) == rows and all(len(g.tokens.ids) == 1 for g in generations)
    assert len(step.syncs) <= MAX_SYNCS, step.syncs
    assert len(step.launches) <= MAX_LAUNCHES, step.launches

    # The same step as the shard computes it ahead of its Decode: on a fork of the batch.
    with StepCounter(capturer) as ahead:
        lm.generate_token(batch.fork(batch.request_ids))
    lm.release(batch)
    assert len(ahead.syncs) <= MAX_SYNCS, ahead.syncs
    assert len(ahead.launches) <= MAX_LAUNCHES, ahead.launches


def test_the_counter_sees_what_it_counts(graphed):
    """The budget test cannot pass by not looking: a sync and launches outside the graph count,
    the graph's own operators do not."""
    lm, capturer = graphed
    batch = steady_batch(lm, 2)
    with StepCounter(capturer) as step:
        lm.generate_token(batch)
        (batch.history_lengths + 1).tolist()
    assert step.syncs[-1] == "tolist" and "aten.add.Tensor" in step.launches
    with StepCounter(None) as everything:
        lm.generate_token(batch)
    lm.release(batch)
    # the forward's operators, when not excluded (on the CPU a float32 layer's linears, norms, rotary
    # and silu * up are native calls no dispatcher counter sees: ~28 operators a step are left here)
    assert len(everything.launches) > 5 * len(step.launches)


@pytest.mark.parametrize("case", ["sampled", "top_n", "eager"])
def test_other_steps_still_read_back_once(graphed, folder, case):
    """Rows with processors or top-n are chosen eagerly after the graph, and a step without
    graphs runs the whole forward eagerly: more launches, still one transfer back."""
    lm, capturer = graphed
    if case == "eager":
        lm, capturer = load(folder, backend=GraphSafePadded), None
    params = SamplingParams(do_sample=True, seed=5, temperature=0.8, top_k=20) if case == "sampled" else None
    batch = steady_batch(lm, 4, params, top_n=3 if case == "top_n" else 0)
    with StepCounter(capturer) as step:
        lm.generate_token(batch)
    lm.release(batch)
    assert len(step.syncs) == 1, step.syncs


def test_graph_inputs_from_the_host_match_the_batch(graphed):
    """The inputs the host sends (each row's last token, position, slot, length) are what the
    device history and slot table hold: the step reads the same K/V a gathered input would."""
    lm, _ = graphed
    batch = steady_batch(lm, 5)
    lm.generate_token(batch)
    lm.release(batch)
    graphs = lm.graphs
    lengths = batch.history_lengths - 1  # after the step: the position its input was at
    rows = torch.arange(5)
    assert graphs.input_ids[:5].tolist() == batch.history[rows, lengths - 1].tolist()
    assert graphs.positions[:5].tolist() == (lengths - 1).tolist()
    assert graphs.slots[:5].tolist() == batch.slot_table[rows, lengths - 1].tolist()
    assert graphs.seq_lens[:5].tolist() == lengths.tolist()
    assert lengths.max().item() < MAX_TOTAL
