"""The model as the shard sees it: batches in, one token per request out.

`CausalLM.generate_token` runs either the prefill of a new batch (all prompts
flattened into one forward) or one decode step of a cached batch, then chooses
tokens, checks stopping and streams text. Requests that finish stay in the batch
until the caller filters them out (the TGI v3 contract: the router calls
FilterBatch), so the shard never drops work on its own. Batches are built, and their
KV blocks assigned and given back, by `BatchBuilder` (engine/batch_builder.py); a
prefill-shaped step's tokens are laid out by engine/prefill.py. A decode step's inputs go up in
one copy and what the step needs back comes down in one transfer (engine/readback.py); a batch
of greedy rows is chosen with the forward (in its CUDA graph when one serves it), so its step
issues a handful of launches and one sync (tests/test_step_budget.py). With decode graphs on CUDA,
a decode step also launches its successor as soon as its tokens are on the host (`LaunchedStep`,
tests/test_launch_ahead.py): the device computes step N+1 while the host detokenizes, checks
stopping and answers for step N, and the next `generate_token` takes it if its batch is the same
rows as they now stand (rows finished and filtered out in between are skipped).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.generation.sampling import greedy_choice
from text_generation_server.generation.speculation import MAX_SPECULATE, Run, ngram_proposals, speculation_limit
from text_generation_server.generation.stopping import FinishReason
from text_generation_server.kernels.kv_fp8 import KVScales
from text_generation_server.layers.attention import AttentionMetadata, AttentionSpec, KVCache, KVLayout
from text_generation_server.layers.attention_backends import choose_attention_backend, log_choice
from text_generation_server.engine.batch import Batch, BlockAllocator, RequestState
from text_generation_server.engine.batch_builder import BatchBuilder
from text_generation_server.engine.cuda_graphs import PAD_SLOT, CudaGraphCapturer, DecodeGraphs, GraphCapturer
from text_generation_server.engine.prefill import PromptSpan, advance_prompts, flatten_step, plan_chunks
from text_generation_server.engine.readback import (
    DeviceClock, EmulatedStream, Readback, UploadBuffer, to_host, unpack_choices,
)
from text_generation_server.engine.types import (
    GeneratedText,
    Generation,
    Completion,
    GenerationRequest,
    StepTimings,
    Tokens,
)
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.engine.warmup import run_warmup
from text_generation_server.models.adapters import AdapterSlots

LAUNCH_AHEAD_ENV = "TGS_LAUNCH_AHEAD"  # "0": never enqueue a decode step before the last one's host work


@dataclass
class LaunchedStep:
    """A decode step enqueued on the device before the host did the step before it (launch ahead).

    The outputs are views of the decode graphs' static buffers: the next replay overwrites them, so
    a launched step is good only for the next `generate_token`, which takes it or drops it."""

    request_ids: list[int]
    lengths: list[int]  # each row's sequence length with the step's input token (0: a row left out)
    inputs: list[int]  # each row's input token (filled once on the host when launched from the device's)
    logits: torch.Tensor  # [rows, vocab] (device): rows that sample, or ask for top-n, choose from them
    tokens: torch.Tensor  # [rows] greedy ids (device)
    picked: torch.Tensor  # [rows, 2] (id, logprob) pairs (device)
    clock: DeviceClock | None = None  # times its forward

    def rows_for(self, batch: Batch) -> list[int] | None:
        """Where each of the batch's rows sits in this step, or None when a row was not launched as
        the batch now stands (another length or token: the batch moved on another way)."""
        where = {rid: i for i, rid in enumerate(self.request_ids)}
        rows = []
        for state in batch.states:
            i = where.get(state.request.id)
            if i is None or self.lengths[i] != state.length or self.inputs[i] != state.last_token:
                return None
            rows.append(i)
        return rows


class CausalLM:
    def __init__(
        self,
        model_id: str,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        device: torch.device,
        dtype: torch.dtype,
        process_group: ProcessGroup,
        block_size: int = 16,
        quantize: str | None = None,
        attention_backend: str | None = None,
        cuda_graphs: Sequence[int] = (),
        max_batch_size: int | None = None,
        graph_capturer: GraphCapturer | None = None,
        model_impl: str = "native",
        kv_dtype: torch.dtype | None = None,
        kv_scales: list[KVScales] | None = None,
    ):
        """cuda_graphs: decode batch sizes warmup captures as CUDA graphs (empty: none); on CPU
        they are ignored unless `graph_capturer` is given (tests emulate graphs through it).
        max_batch_size: the most requests a decode step can hold (the router's limit), which
        warmup measures; None: derived from the other limits (`decode_batch_limit`).
        kv_dtype: the KV cache's dtype (None: the model's; an fp8 one with `kv_scales`, one per
        layer, None for a layer kept in the model's dtype, or 1.0 everywhere without)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if any(b < 1 for b in cuda_graphs):
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {list(cuda_graphs)}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_id = model_id
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.kv_scales = kv_scales
        self.process_group = process_group
        self.builder = BatchBuilder(tokenizer, eos_token_ids, self.config.vocab_size, self.config.max_context,
                                    block_size, device, self.config.context_name)
        self.quantize = quantize
        self.model_impl = model_impl  # "native" or "transformers": reported in Info
        rope = self.config.rope
        # longrope (Phi-3): a sequence that grows past this length switches from the short to the
        # long factors, and transformers then recomputes its whole cache with them.
        self._rope_switch = rope.original_max_position_embeddings if rope is not None and \
            rope.rope_type == "longrope" else None
        self.kv_cache: KVCache | None = None
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._vocab_size = self.config.vocab_size
        # Many checkpoints pad vocab_size past the tokenizer (Qwen2, Phi-3); those ids have no
        # text, so they are never chosen (the detokenizer could not stream them).
        self._text_vocab = min(self._vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        # Prompt tokens one forward may compute (set by warmup); later chunks of a long prompt
        # are sized within it. None: no limit (the CLI and tests without warmup).
        self.max_prefill_tokens: int | None = None
        # The benchmarks' emulated device (engine/standin.py, stream mode): a GPU's timing on a CPU,
        # its queue waited on by the readback, its graphs recorded by the stand-in's capturer.
        stream = getattr(model, "stream", None)
        stream = stream if isinstance(stream, EmulatedStream) else None
        if stream is not None and graph_capturer is None:
            graph_capturer = model.graph_capturer()
        self.readback = Readback(device, stream)
        self.clock = DeviceClock(device, stream)  # the forward's own time, reported as forward_ns
        # A step launched ahead times its forward on the other clock: it is launched before this
        # step's clock is read (`_launch_next`), and becomes `clock` when a step takes it.
        self._spare_clock = DeviceClock(device, stream)
        self._inputs: UploadBuffer | None = None  # an eager decode step's inputs (_decode_forward)
        # Launch ahead (decode graphs on CUDA): once a decode step's tokens are on the host, the next
        # step is enqueued at once, and the Python work of this one (detokenizing, stopping, the
        # answer, the shard's decode ahead) runs while the device computes it. Not on a CPU, where
        # a launch is the forward itself and would only delay this step's answer.
        self.launch_ahead = (device.type == "cuda" or stream is not None) and \
            os.environ.get(LAUNCH_AHEAD_ENV, "1") not in ("0", "false", "no")
        self._launched: LaunchedStep | None = None
        self._launched_rows: UploadBuffer | None = None  # rows taken from a launched step (a filtered batch)
        self.launched_taken = 0  # launched steps a decode step used, and dropped ones (logs, benchmarks, tests)
        self.launched_dropped = 0
        self.last_device_ns = 0  # the last step's forward on the device (DeviceClock), for benchmarks
        self._launch_logged = False
        self.adapters: AdapterSlots | None = None  # LoRA slots (models/adapters.py enable_lora); None: off
        layout = self.kv_layout
        spec = AttentionSpec(
            device_type=device.type, dtype=dtype, heads=self.config.num_attention_heads // process_group.size,
            kv_heads=model.local_kv_heads, head_dim=self.config.head_dim, block_size=block_size,
            windowed=any(w is not None for w in self.config.layer_windows),
            softcap=model.attention_softcap, sinks=getattr(model, "attention_sinks", False),
            device_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            latent_dim=layout.head_dim if layout.latent else 0,
            kv_dtype=self.kv_dtype if self.kv_dtype != dtype else None,
        )
        self.attention, rejected = choose_attention_backend(spec, attention_backend)
        if process_group.rank == 0:
            log_choice(self.attention, rejected)
            logger.info("KV cache: {} bytes per token ({}, {})", self.kv_bytes_per_token, layout.describe(),
                        layout.describe_dtypes(self.kv_dtype, self.kv_scales, dtype))
        self.max_batch_size = max_batch_size
        self.graph_buckets = sorted(set(cuda_graphs))
        self._graph_capturer = graph_capturer
        self.graphs: DecodeGraphs | None = None  # captured by warmup (capture_decode_graphs)
        if self.graph_buckets and device.type != "cuda" and graph_capturer is None:
            logger.debug("CUDA graphs {} ignored on {}", self.graph_buckets, device)
            self.graph_buckets = []
        elif self.graph_buckets and self.graphs_off_reason() is not None and process_group.rank == 0:
            logger.info("CUDA graphs off: {}", self.graphs_off_reason())

    # -- KV cache ------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        """What the cache holds per token and layer, as the model says (one latent for multi-head
        latent attention); a model that does not say holds K and V per head."""
        layout = getattr(self.model, "kv_layout", None)
        if layout is None:
            layout = KVLayout(self.config.num_hidden_layers, self.model.local_kv_heads, self.config.head_dim)
        return layout

    @property
    def kv_bytes_per_token(self) -> int:
        """What warmup sizes the cache by: in the cache's dtype (an fp8 cache holds twice a 16-bit
        one's tokens in the same bytes)."""
        return self.kv_layout.bytes_per_token(self.kv_dtype, self.kv_scales, self.dtype)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_layout.bytes_per_block(self.block_size, self.kv_dtype, self.kv_scales, self.dtype)

    def new_kv_cache(self, num_blocks: int, block_size: int | None = None) -> KVCache:
        """A cache of this model's layout, dtype and scales (warmup's, and tools' own)."""
        return self.kv_layout.allocate(num_blocks, block_size or self.block_size, self.kv_dtype, self.device,
                                       self.kv_scales, wide=self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.drop_kv_cache()  # free the old pool (and the graphs that point into it) first
        self.kv_cache = self.new_kv_cache(num_blocks)
        self.builder.allocator = BlockAllocator(num_blocks)
        logger.debug("KV cache: {} blocks of {} tokens", num_blocks, self.block_size)

    def drop_kv_cache(self) -> None:
        """Lets go of the KV cache and of the graphs captured against it (warmup sizes a new one)."""
        if self.graphs is not None:
            self.graphs.release()  # captured against this cache; buffers and pool stay
        self._launched = None
        self.kv_cache = None
        self.builder.allocator = None

    # -- batches (engine/batch_builder.py builds them) -----------------------------
    @property
    def block_size(self) -> int:
        return self.builder.block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self.builder.block_size = value

    @property
    def allocator(self) -> BlockAllocator | None:
        """The current KV cache's free list, which the builder assigns blocks from."""
        return self.builder.allocator

    def blocks_for(self, tokens: int) -> int:
        return self.builder.blocks_for(tokens)

    def _route(self, states: list[RequestState], counts: list[int], graph: bool = False) -> None:
        if self.adapters is not None:
            self.adapters.routing.route([s.adapter for s in states], counts, graph)

    def make_batch(self, batch_id: int, requests: list[GenerationRequest]) -> Batch:
        """New requests as a batch (`BatchBuilder.make_batch`: rejections are RequestErrors)."""
        return self.builder.make_batch(batch_id, requests)

    def filter(self, batch: Batch, request_ids: list[int]) -> Batch | None:
        return self.builder.filter(batch, request_ids)

    def release(self, batch: Batch) -> None:
        self.builder.release(batch)

    # -- speculation (generation/speculation.py) ---------------------------------------
    _speculate = 0
    speculated_tokens = 0  # proposed tokens fed to forwards (counters for logs and benchmarks)
    accepted_tokens = 0  # of those, the ones the row's own choice confirmed

    @property
    def speculate(self) -> int:
        """Most n-gram tokens a decoding row proposes per step (`serve --speculate`); 0: none."""
        return self._speculate

    @speculate.setter
    def speculate(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SPECULATE:
            raise ValueError(f"speculate must be an integer in [0, {MAX_SPECULATE}], got {value!r}")
        if value and value != self._speculate and self.process_group.rank == 0:
            graphs = " (CUDA graphs serve the steps without one)" if self.graph_buckets else ""
            logger.info("speculation: up to {} n-gram tokens per row and step; steps with proposals run eagerly as "
                        "one prefill-shaped forward{}", value, graphs)
        self._speculate = value

    # -- the step --------------------------------------------------------------
    @torch.inference_mode()
    def generate_token(self, batch: Batch) -> tuple[list[Generation], Batch | None, StepTimings]:
        """One forward over the batch: decoding requests get their next token (with speculation,
        up to 1 + speculate of them); requests still prefilling compute their next prompt chunk and
        get a token only with their last one."""
        start = time.perf_counter_ns()
        # A step launched ahead is good for this call only: any other forward overwrites its outputs.
        launched, self._launched = self._launched, None
        # Grammar rows' masks fill on the compiler's worker while the forward runs.
        masks = self.builder.grammar_masks(batch.chooser)
        taken = self._take_launched(launched, batch) if launched is not None else None
        chosen = picked_rows = None
        if taken is not None:
            # Its forward ran (or runs) on the device already; its clock holds its times.
            logits, chosen, picked_rows = taken
            self.clock, self._spare_clock = launched.clock, self.clock
            emit, prompt_spans, speculative = None, [], None
        else:
            self.clock.start()
            try:
                proposals = self._proposals(batch)
                if batch.prefilling or proposals or (self._rope_switch is not None and
                                                     any(map(self._recomputes, batch.states))):
                    logits, emit, prompt_spans, speculative = self._prefill_forward(batch, proposals)
                else:
                    (logits, chosen), emit, prompt_spans, speculative = self._decode_forward(batch), None, [], None
            except BaseException:
                if masks is not None:
                    masks.done()  # the worker must let go of the matchers before anyone else steps them
                raise
            self.clock.stop()

        emitting = batch.states if emit is None else [batch.states[i] for i in emit]
        top_n = [s.request.top_n_tokens for s in emitting]
        chooser = batch.chooser
        if chosen is not None:
            # Greedy rows without processors or top-n: chosen with the forward. The history update
            # is enqueued before the readback waits, so the device runs it meanwhile.
            next_ids, pairs = chosen
            self._append(batch, next_ids)
            # The successor goes to the device before this step's tokens come to the host: it reads
            # them on the device (the overlap schedulers' order), so the device never waits for the
            # sync, the host's wake-up or the Python between them.
            pending = self.readback.start(pairs)
            launched = self._launch_next(batch, None, next_ids)
            next_list, chosen_logprobs = unpack_choices(self.readback.wait(pending))
            if picked_rows is not None:  # a launched step ran rows this batch no longer has
                next_list = [next_list[i] for i in picked_rows]
                chosen_logprobs = [chosen_logprobs[i] for i in picked_rows]
            if launched is not None:
                launched.inputs = [t if n else 0 for t, n in zip(next_list, launched.lengths)]
            self._launched = launched
            tops = None
            prompt_lps: list[list[float]] = []
            device_ns = self.clock.elapsed_ns()
        else:
            if self._text_vocab < logits.shape[-1]:
                logits = logits[:, : self._text_vocab]  # a view: ids keep their meaning
            if emit is None:
                history, lengths, emit_rows = batch.history, batch.history_lengths, None
            else:
                # Only requests that finish their prompt draw: a seeded request's random stream must
                # not advance while its prompt is still being prefilled.
                emit_rows = torch.tensor(emit, dtype=torch.long, device=self.device)
                chooser = batch.chooser.filter(emit)
                history = batch.history.index_select(0, emit_rows)
                lengths = batch.history_lengths.index_select(0, emit_rows)
                masks = masks.select(emit) if masks is not None else None
            next_ids, logprobs = chooser(logits, history, lengths, masks)
            self._append(batch, next_ids, emit_rows, lengths)
            next_list, chosen_logprobs, tops, prompt_lps = to_host(self.readback, next_ids, logprobs, top_n,
                                                                   [span.values for span in prompt_spans])
            device_ns = self.clock.elapsed_ns()
            if emit is None and speculative is None:  # a decode step: its successor's inputs are known
                self._launched = self._launch_next(batch, next_list)
        seeds = chooser.seeds
        grammar_complete = chooser.accept(next_list)  # None without grammar rows

        advance_prompts(batch, prompt_spans, prompt_lps)
        generations: list[Generation] = []
        for i, state in enumerate(emitting):
            gen = Generation(request_id=state.request.id, tokens=Tokens())
            if state.prompt_logprobs is not None and len(state.prompt_logprobs) == state.input_length:
                gen.prefill_tokens = self._prefill_tokens(state)
                state.prompt_logprobs = None  # sent once, with the first token
            self._emit_token(state, gen, next_list[i], chosen_logprobs[i], tops[i] if tops is not None and top_n[i]
                             else None, grammar_complete is not None and grammar_complete[i], seeds[i])
            generations.append(gen)
        if speculative is not None:
            self._verify(batch, *speculative, next_list, generations)
        plan_chunks(batch, self.max_prefill_tokens)
        all_stopped = all(s.finished for s in batch.states)
        if all_stopped:
            self.builder.release(batch)
        end = time.perf_counter_ns()
        # The forward's device time (the readback above waited for it): on CUDA what the GPU spent,
        # not the host's time to enqueue it; the rest of the step's wall time is the host's.
        self.last_device_ns = device_ns  # unclamped: a launched forward may have run before this call began
        forward_ns = min(device_ns, end - start)
        timings = StepTimings(forward_ns=forward_ns, decode_ns=end - start - forward_ns, total_ns=end - start)
        return generations, (None if all_stopped else batch), timings

    @staticmethod
    def _append(batch: Batch, next_ids: torch.Tensor, rows: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> None:
        """Writes the chosen ids into the device history (the next prefill-shaped step, penalties
        and n-gram proposals read it): every row's (two launches), or those of `rows`, whose
        lengths before the token are `lengths`."""
        if rows is None:
            batch.history.scatter_(1, batch.history_lengths[:, None], next_ids[:, None])
            batch.history_lengths += 1
        else:
            batch.history[rows, lengths] = next_ids
            batch.history_lengths.index_add_(0, rows, torch.ones_like(rows))

    def _emit_token(self, state: RequestState, gen: Generation, token: int, logprob: float,
                    top: tuple[list[int], list[float]] | None, grammar_complete: bool, seed: int) -> None:
        """Adds one chosen token to the request and to its Generation of this step (a speculative
        step adds several, each checked for stopping in order); ends the request when it stops."""
        state.length += 1
        state.last_token = token
        text = state.detokenizer.step(token)
        stop, reason = state.stopping(token, text)
        if not stop and grammar_complete:
            # Nothing can follow: the output is a complete document (EOS is all the mask allows).
            stop, reason = True, FinishReason.EOS_TOKEN
        if stop:
            text += state.detokenizer.flush()
        tokens = gen.tokens
        tokens.ids.append(token)
        tokens.logprobs.append(logprob)
        tokens.texts.append(text)
        tokens.is_special.append(token in self.special_ids)
        if top is not None:
            ids, lps = top
            gen.top_tokens.append(Tokens(ids, lps, [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                                         [t in self.special_ids for t in ids]))
        if stop:
            state.finished = True
            generated = state.detokenizer.generated_ids
            gen.generated_text = GeneratedText(
                text=self.tokenizer.decode(generated, skip_special_tokens=True),
                generated_tokens=len(generated),
                finish_reason=reason,
                seed=seed if state.request.sampling.do_sample else None,
            )

    def _proposals(self, batch: Batch) -> dict[int, list[int]]:
        """Row -> the n-gram tokens it proposes this step (none without `speculate`).

        Rows still prefilling, finished, recomputing across a longrope switch, or with a grammar
        do not propose: a grammar's matcher would have to be stepped through guesses and rolled
        back, for outputs that are short anyway. The guesses share what is left of the tokens one
        forward may compute (max_prefill_tokens, which warmup measured) after the prompt chunks
        and one token per decoding row, first rows first, so a speculative step is never a
        larger forward than the server was sized for."""
        if not self._speculate:
            return {}
        matchers = batch.chooser.matchers
        candidates, limits = [], []
        for i, state in enumerate(batch.states):
            if state.prefilling or state.finished or matchers[i] is not None or self._recomputes(state):
                continue
            limit = speculation_limit(self._speculate, state.length, state.max_length, self._rope_switch)
            if limit:
                candidates.append(i)
                limits.append(limit)
        budget = math.inf
        if self.max_prefill_tokens is not None:
            budget = self.max_prefill_tokens - sum(s.step_tokens for s in batch.states)
        if not candidates or budget < 1:
            return {}
        index = torch.tensor(candidates, dtype=torch.long, device=self.device)
        found = ngram_proposals(batch.history.index_select(0, index), [batch.states[i].length for i in candidates],
                                limits)
        proposals: dict[int, list[int]] = {}
        for row, tokens in zip(candidates, found):
            tokens = tokens[:int(min(budget, len(tokens)))] if budget >= 1 else []
            if tokens:
                proposals[row] = tokens
                budget -= len(tokens)
        return proposals

    def _verify(self, batch: Batch, runs: list[Run], hidden: torch.Tensor, first: list[int],
                generations: list[Generation]) -> None:
        """The rest of a speculative step: each run's proposal checked position by position.

        Position k (k >= 1) is reached by the runs whose first k proposed tokens were all chosen;
        their rows' own chooser picks from that position's logits over the history holding what
        was accepted so far (penalties see it), drawing from a seeded row's generator exactly as
        the plain step for that token would. The choice is emitted like any token (stopping, text,
        logprobs); a choice that differs from the proposal, or one that stops the request, ends the
        run. Logits are computed per position for the runs still going, so a run rejected early
        costs no head matmul for its later positions.
        """
        self.speculated_tokens += sum(len(r.proposal) for r in runs)
        active = [r for r in runs if not batch.states[r.row].finished and first[r.emitted] == r.proposal[0]]
        position = 1
        while active:
            self.accepted_tokens += len(active)
            rows = [r.row for r in active]
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            at = torch.tensor([r.first + position - 1 for r in active], dtype=torch.long, device=self.device)
            logits = self.model.logits(hidden.index_select(0, at))
            if self._text_vocab < logits.shape[-1]:
                logits = logits[:, : self._text_vocab]
            chooser = batch.chooser.filter(rows)  # the same generators: their streams advance
            lengths = batch.history_lengths.index_select(0, index)
            next_ids, logprobs = chooser(logits, batch.history.index_select(0, index), lengths)
            self._append(batch, next_ids, index, lengths)
            states = [batch.states[i] for i in rows]
            top_n = [s.request.top_n_tokens for s in states]
            tokens, chosen_logprobs, tops, _ = to_host(self.readback, next_ids, logprobs, top_n, [])
            seeds = chooser.seeds
            going = []
            for j, (run, state) in enumerate(zip(active, states)):
                self._emit_token(state, generations[run.emitted], tokens[j], chosen_logprobs[j],
                                 tops[j] if tops is not None and top_n[j] else None, False, seeds[j])
                if not state.finished and position < len(run.proposal) and tokens[j] == run.proposal[position]:
                    going.append(run)
            active = going
            position += 1

    def _recomputes(self, state: RequestState) -> bool:
        """Whether this decode step crosses the longrope switch for a sequence computed with the
        short factors: then the step recomputes the whole sequence with the long ones, as
        transformers does (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache there)."""
        return (self._rope_switch is not None and not state.prefilling and state.length == self._rope_switch + 1
                and state.input_length <= self._rope_switch)

    def _prefill_forward(
        self, batch: Batch, proposals: dict[int, list[int]] | None = None,
    ) -> tuple[torch.Tensor, list[int], list[PromptSpan], tuple[list[Run], torch.Tensor] | None]:
        """One forward over every request's new tokens, flattened (`prefill.flatten_step`): prompt
        chunks for requests still prefilling (over their cached prefix), the last token for
        decoding ones, followed by its proposed tokens when it speculates (their hidden states
        come back for `_verify`)."""
        step = flatten_step(batch, proposals or {}, self._recomputes, self.config.rope_length_dependent, self.device)
        tables = batch.block_tables
        if len(step.included) != len(batch.states):
            tables = tables.index_select(0, torch.tensor(step.included, dtype=torch.long, device=self.device))
        meta = AttentionMetadata(
            is_prefill=True, slots=step.slots, prefill_lens=step.q_lens, cache_lens=step.cache_lens,
            block_tables=tables, backend=self.attention, decode_rows=step.decode_rows,
        )
        rows = torch.tensor(step.logit_rows + step.extra_rows, dtype=torch.long, device=self.device)
        self._route([batch.states[i] for i in step.included], step.q_lens)
        hidden = self.model(step.ids, step.positions, self.kv_cache, meta, rows, head=False, seq_lens=step.seq_lens)
        for span in step.spans:
            span.values = self._prompt_logprobs(span, hidden)
        speculative = (step.runs, hidden[len(step.logit_rows):]) if step.runs else None
        if len(step.last_rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(step.last_rows, dtype=torch.long, device=self.device))
        return self.model.logits(hidden), step.emit, step.spans, speculative

    # Rows of vocabulary-wide logits computed at once for prompt logprobs: a 32k-token prompt
    # over a 128k vocabulary would otherwise hold 16 GiB of float32 logits.
    PROMPT_LOGIT_ELEMENTS = 2**26

    def _prompt_logprobs(self, span: PromptSpan, hidden: torch.Tensor) -> torch.Tensor:
        """log p(token p+1 | prefix) for the span's rows, the vocabulary's logits a piece at a time."""
        first = span.state.prefilled
        wanted = torch.tensor(span.state.prompt_ids[first + 1:first + 1 + span.count], device=self.device)
        out = torch.empty(span.count, dtype=torch.float32, device=self.device)
        step = max(1, self.PROMPT_LOGIT_ELEMENTS // max(self._vocab_size, 1))
        for start in range(0, span.count, step):
            stop = min(start + step, span.count)
            logits = self.model.logits(hidden[span.row + start:span.row + stop])
            out[start:stop] = logits.gather(1, wanted[start:stop, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return out

    def _decode_forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Logits of every row's next token, from a CUDA graph when one serves the batch, else
        eagerly; and when every row is greedy without processors or top-n, their choice
        (`greedy_choice`: ids, (id, logprob) pairs), which the graph computes with the forward.

        The inputs are Python ints the states hold (each row's last token, position, slot and
        length), written into a pinned buffer and sent in one copy: the step never waits on the
        device, and builds nothing on it with gathers."""
        states = batch.states
        lengths = [s.length for s in states]
        positions = [n - 1 for n in lengths]
        block_size = self.block_size
        inputs = ([s.last_token for s in states], positions,
                  [s.slot(p, block_size) for s, p in zip(states, positions)], lengths)
        greedy = batch.chooser.greedy_only and not any(s.request.top_n_tokens for s in states)
        max_len = max(lengths)
        self._route(states, [1] * len(states), graph=self.graphs is not None)
        if self.graphs is not None:
            replayed = self.graphs.run(self.kv_cache, inputs, batch.block_tables, max_len)
            if replayed is not None:
                logits, tokens, picked = replayed
                return logits, ((tokens, picked) if greedy else None)
        rows = len(states)
        if self._inputs is None or self._inputs.tensor.shape[1] < rows:
            self._inputs = UploadBuffer((4, max(8, 1 << (rows - 1).bit_length())), torch.long, self.device)
        self._inputs.host()[:, :rows] = inputs
        self._inputs.push()
        input_ids, positions_t, slots, seq_lens = self._inputs.rows(rows)
        meta = AttentionMetadata(
            is_prefill=False, slots=slots, block_tables=batch.block_tables, seq_lens=seq_lens,
            max_seq_len=max_len, backend=self.attention,
        )
        logits = self.model(input_ids, positions_t, self.kv_cache, meta)
        return logits, (self._greedy_choice(logits) if greedy else None)

    def _launch_next(self, batch: Batch, next_ids: list[int] | None,
                     device_ids: torch.Tensor | None = None) -> LaunchedStep | None:
        """Enqueues the decode step that follows this one from the graph serving it, before this
        step's host work, so the device never waits for that work (what SGLang's overlap scheduler
        does; issue #31). Any decode step without speculation qualifies: its inputs are known once
        the tokens are (position, slot and length follow from each row's length), and rows that
        sample choose from its logits when they take it, so their random streams advance only then.
        Rows this token ends by length are padding rows (their next slot lies past their blocks);
        rows ending by EOS or a stop sequence still run, and the batch that takes the step leaves
        them out: one row-step of device work, not a wait. None when the step cannot be launched
        so; the next `generate_token` then runs it as usual. The spare clock times the launched
        forward (on CUDA: its device time, read by the step that takes it after its readback).

        next_ids: this step's tokens on the host; or None, with `device_ids` [rows] on the device:
        the launch reads them there, before the host has them (the caller fills `inputs` after)."""
        graphs = self.graphs
        if not self.launch_ahead or graphs is None or self._speculate or self._rope_switch is not None:
            return None
        states = batch.states
        block_size = self.block_size
        positions, slots, lengths = [], [], []
        for state in states:
            position = state.length  # the new token's position
            slot = -1 if state.finished or state.stopping.current_tokens + 1 >= state.stopping.max_new_tokens \
                else state.slot(position, block_size)
            if slot < 0:
                positions.append(0), slots.append(PAD_SLOT), lengths.append(0)
            else:
                positions.append(position), slots.append(slot), lengths.append(position + 1)
        max_len = max(lengths)
        if max_len == 0 or graphs.refusal(self.kv_cache, len(states), max_len) is not None:
            return None  # the step runs as usual then, and counts why it could not replay
        # Rows left out carry token 0 (from the host) or whatever this step chose (from the device):
        # either way their slot is PAD_SLOT and their length 0, so nothing reads what they compute.
        tokens = [t if n else 0 for t, n in zip(next_ids, lengths)] if next_ids is not None else [0] * len(states)
        self._route(states, [1] * len(states), graph=True)
        clock = self._spare_clock
        clock.start()
        replayed = graphs.run(self.kv_cache, (tokens, positions, slots, lengths), batch.block_tables, max_len,
                              device_ids=device_ids)
        clock.stop()
        if replayed is None:
            return None
        logits, ids, picked = replayed
        return LaunchedStep(request_ids=batch.request_ids, lengths=lengths, inputs=tokens, logits=logits, tokens=ids,
                            picked=picked, clock=clock)

    def _take_launched(self, launched: LaunchedStep, batch: Batch
                       ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, list[int] | None] | None:
        """What `_decode_forward` would give for `batch`, from the launched step, when the batch is a
        decode of rows the step ran as they now stand: (logits, None, None) for a batch that samples,
        has processors, grammar or top-n (its chooser runs on the logits as after any forward), or
        (None, (ids, pairs), rows) for greedy rows, `rows` saying which of the pairs are the batch's
        (None: all, in order). None otherwise: the step is dropped, and this one runs its own forward."""
        rows = None if batch.prefilling or self._speculate else launched.rows_for(batch)
        if rows is None:
            self.launched_dropped += 1
            return None
        self.launched_taken += 1
        count = len(rows)
        greedy = batch.chooser.greedy_only and not any(s.request.top_n_tokens for s in batch.states)
        if rows == list(range(len(launched.request_ids))):
            return (None, (launched.tokens, launched.picked), None) if greedy else (launched.logits, None, None)
        if rows == list(range(count)):
            if greedy:
                return None, (launched.tokens[:count], launched.picked), rows
            return launched.logits[:count], None, None
        # Rows left the batch (finished and filtered): the kept ones, gathered on the device with an
        # index that goes up like the step's inputs (no synchronous torch.tensor(list)).
        if self._launched_rows is None or self._launched_rows.tensor.shape[1] < count:
            self._launched_rows = UploadBuffer((1, max(8, 1 << (count - 1).bit_length())), torch.long, self.device)
        self._launched_rows.host()[0, :count] = rows
        self._launched_rows.push()
        index = self._launched_rows.rows(count)[0]
        if greedy:
            return None, (launched.tokens.index_select(0, index), launched.picked), rows
        return launched.logits.index_select(0, index), None, None

    def _greedy_choice(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_choice` over the ids the tokenizer can decode (a padded vocabulary's tail is
        never chosen)."""
        return greedy_choice(logits[:, : self._text_vocab])

    def _prefill_tokens(self, state: RequestState) -> Tokens:
        ids = state.prompt_ids
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return Tokens(list(ids), list(state.prompt_logprobs), texts, [t in self.special_ids for t in ids])

    # -- CUDA graphs -------------------------------------------------------------
    def graphs_off_reason(self) -> str | None:
        """Why decode steps cannot run from CUDA graphs here, or None when they can."""
        if not self.graph_buckets:
            return "no batch sizes asked for (--cuda-graphs 0)" if self.device.type == "cuda" else \
                f"not on CUDA ({self.device.type})"
        if not self.attention.graph_safe and not getattr(self.model, "attention_free", False):
            return (f"attention backend {self.attention.name} is not graph-safe (its decode reads sequence "
                    "lengths on the host); --attention-backend triton-paged is")
        for module in self.model.modules():
            blocker = getattr(module, "graph_blocker", None)
            if isinstance(blocker, str):
                return blocker
        return None

    @torch.inference_mode()
    def capture_decode_graphs(self, max_total_tokens: int, buckets: Sequence[int] | None = None) -> int:
        """Captures decode graphs for `buckets` (default: all asked for) against the current KV
        cache, for sequences of up to max_total_tokens; returns the bytes the capture took.

        The static buffers are kept across captures of the same shape, so re-capturing after a
        new KV cache (warmup does) allocates no new ones.
        """
        if self.kv_cache is None:
            raise RuntimeError("capture_decode_graphs needs the KV cache the graphs will read")
        reason = self.graphs_off_reason()
        if reason is not None:
            raise ValueError(f"CUDA graphs cannot be captured: {reason}")
        buckets = sorted(set(self.graph_buckets if buckets is None else buckets))
        graphs = self.graphs
        if graphs is None or graphs.buckets != buckets or graphs.max_seq_len != max_total_tokens:
            if self._graph_capturer is None:
                self._graph_capturer = CudaGraphCapturer(self.device)
            graphs = DecodeGraphs(buckets, max_total_tokens, self.block_size, self.device, self._graph_capturer)
        self.graphs = None  # not replayed while it captures (the probe forward runs eagerly)
        self._launched = None
        if self.adapters is not None:
            self.adapters.routing.capture()  # every LoRA hook captures its per-row path
        grown = graphs.capture(self.model, self.kv_cache, self.attention, choose=self._greedy_choice)
        self.graphs = graphs
        if self.launch_ahead and self.process_group.rank == 0 and not self._launch_logged:
            self._launch_logged = True
            logger.info("launch ahead: a decode step's successor is enqueued from its graph before the "
                        "step's host work ({}=0 turns it off)", LAUNCH_AHEAD_ENV)
        return grown

    # -- warmup ----------------------------------------------------------------
    def warmup(
        self,
        requests: list[GenerationRequest],
        max_input_tokens: int,
        max_prefill_tokens: int,
        max_total_tokens: int,
        memory_fraction: float,
        max_batch_total_tokens: int | None = None,
        max_batch_size: int | None = None,
    ) -> int:
        """Runs the largest forwards the limits allow, then gives the KV cache what is left
        (engine/warmup.py says how); returns the tokens the KV cache holds."""
        return run_warmup(self, requests, max_input_tokens, max_prefill_tokens, max_total_tokens, memory_fraction,
                          max_batch_total_tokens, max_batch_size)

    # -- convenience for the CLI and tests -----------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Runs requests to completion as one batch, filtering finished ones out as it goes.

        Allocates a KV cache just large enough when none exists (the CLI path).
        """
        needed = sum(self.blocks_for(len(self.builder.tokenize(r)) + r.max_new_tokens)
                     for r in requests if not r.blocks)
        idle = self.allocator is not None and self.allocator.free_blocks == self.allocator.num_blocks - 1
        if self.kv_cache is None or (idle and self.allocator.free_blocks < needed):
            self.allocate_kv_cache(needed + 1)
        batch: Batch | None = self.make_batch(0, requests)
        steps: dict[int, list[Generation]] = {r.id: [] for r in requests}
        while batch is not None:
            generations, batch, _ = self.generate_token(batch)
            finished = set()
            for gen in generations:
                steps[gen.request_id].append(gen)
                if gen.generated_text is not None:
                    finished.add(gen.request_id)
            if batch is not None and finished:
                batch = self.filter(batch, [r for r in batch.request_ids if r not in finished])
        return [Completion.from_steps(r.id, steps[r.id]) for r in requests]
