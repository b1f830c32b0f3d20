"""generate.v3 messages to the engine's types and back: how a shard reads a request and answers.

Decoding is wire-only: what "unset" means on v3 (0 for a proto3 scalar), the fields this server
does not support (images, logit_bias, watermark: refused by name, never dropped), and the grammar's type and text (its validator, as the
client API's). The other fields' validators run where the engine takes the request
(engine/batch_builder.py make_batch), for a shard's requests and the engine's own alike.
"""

from __future__ import annotations

from text_generation_server.engine.batch_builder import request_error
from text_generation_server.engine.types import CachedBatchInfo, Generation, GenerationRequest, RequestError, Tokens
from text_generation_server.generation import request_fields
from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.pb.generate.v3 import generate_pb2 as pb


def _or_default(value: float, default: float) -> float:
    # proto3 scalars read 0 when unset; 0 is never a valid temperature/top_p/typical_p/penalty.
    return default if value == 0 else value


def request_from_pb(req: pb.Request, warmup: bool = False) -> GenerationRequest:
    """The engine's request; a field the engine cannot honour, or a grammar that breaks its
    validator, is a RequestError naming it. The other fields' validators run in make_batch.
    `warmup`: the Warmup batch, whose watermark flag (a TGI router sets it) is ignored."""
    try:
        return _request_from_pb(req, warmup)
    except request_fields.InvalidField as exc:
        raise request_error(req.id, exc) from None


def _request_from_pb(req: pb.Request, warmup: bool) -> GenerationRequest:
    if req.inputs:
        inputs = req.inputs
    else:
        parts = []
        for chunk in req.input_chunks.chunks:
            if chunk.WhichOneof("chunk") == "image":
                raise RequestError(f"request {req.id}: image inputs are not supported by text-only models")
            parts.append(chunk.text)
        inputs = "".join(parts)
    p = req.parameters
    grammar = None
    if p.grammar_type != pb.GRAMMAR_TYPE_NONE:  # NONE: `grammar` is ignored (the protocol's rule)
        type_name = pb.GrammarType.Name(p.grammar_type) if p.grammar_type in pb.GrammarType.values() else str(
            p.grammar_type)
        grammar = request_fields.grammar(p.grammar_type, p.grammar, type_name)
    if p.logit_bias:
        raise RequestError(f"request {req.id}: logit_bias is not supported")
    if p.watermark and not warmup:  # (a TGI router's warmup batch sets every option, watermark too)
        raise RequestError(f"request {req.id}: watermark is not supported by this server")
    sampling = SamplingParams(
        temperature=_or_default(p.temperature, 1.0),
        top_k=p.top_k,
        top_p=_or_default(p.top_p, 1.0),
        typical_p=_or_default(p.typical_p, 1.0),
        do_sample=p.do_sample,
        seed=p.seed,
        repetition_penalty=_or_default(p.repetition_penalty, 1.0),
        frequency_penalty=p.frequency_penalty,
        grammar=grammar,
    ).with_tgi_sampling()  # TGI shards sample whenever a warper is set, whatever do_sample says
    s = req.stopping_parameters
    return GenerationRequest(
        id=req.id,
        inputs=inputs,
        sampling=sampling,
        max_new_tokens=s.max_new_tokens,
        stop_sequences=list(s.stop_sequences),
        ignore_eos_token=s.ignore_eos_token,
        truncate=req.truncate,
        prefill_logprobs=req.prefill_logprobs,
        top_n_tokens=req.top_n_tokens,
        blocks=list(req.blocks),
        slots=list(req.slots),
        add_special_tokens=req.add_special_tokens,
        cache_len=req.cache_len,
        chunk_len=req.chunk_len if req.HasField("chunk_len") else None,
        input_ids=list(req.input_ids) if req.input_ids else None,
        adapter_id=req.adapter_id if req.HasField("adapter_id") and req.adapter_id else None,
    )


def _tokens_pb(tokens: Tokens) -> pb.Tokens:
    return pb.Tokens(ids=tokens.ids, logprobs=tokens.logprobs, texts=tokens.texts, is_special=tokens.is_special)


def generation_to_pb(gen: Generation) -> pb.Generation:
    out = pb.Generation(request_id=gen.request_id, tokens=_tokens_pb(gen.tokens))
    if gen.prefill_tokens is not None:
        out.prefill_tokens.CopyFrom(_tokens_pb(gen.prefill_tokens))
    for top in gen.top_tokens:
        out.top_tokens.append(_tokens_pb(top))
    if gen.generated_text is not None:
        g = gen.generated_text
        out.generated_text.CopyFrom(
            pb.GeneratedText(text=g.text, generated_tokens=g.generated_tokens, finish_reason=int(g.finish_reason))
        )
        if g.seed is not None:
            out.generated_text.seed = g.seed
    return out


def cached_batch_to_pb(info: CachedBatchInfo) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=info.id, request_ids=info.request_ids, size=info.size, max_tokens=info.max_tokens,
        current_tokens=info.current_tokens,
    )
