"""The router's GenerateStream messages: one per token, built in place from the shard's Generation
(router/service.py `_stream`), exactly the messages a Token built first and copied in gave: every
field, top tokens per token, the generated text on the last one, and a token whose fields are all
defaults still present on the wire."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.scheduler import Entry
from text_generation_server.router.service import TextGenerationService, _tokens


def expected(gens: list[spb.Generation]) -> list[cpb.GenerateStreamResponse]:
    """The messages as the router built them before (a cpb.Token per token, copied into its message)."""
    out = []
    for g in gens:
        tokens = _tokens(g.tokens)
        for i, token in enumerate(tokens):
            msg = cpb.GenerateStreamResponse(token=token)
            if i < len(g.top_tokens):
                msg.top_tokens.extend(_tokens(g.top_tokens[i]))
            if i == len(tokens) - 1 and g.HasField("generated_text"):
                msg.generated_text = g.generated_text.text
            out.append(msg)
    return out


def test_stream_messages_are_the_tokens_of_each_generation():
    top = spb.Tokens(ids=[7, 8], texts=["x", "y"], logprobs=[-0.1, -2.0], is_special=[False, False])
    gens = [
        spb.Generation(request_id=0, tokens=spb.Tokens(ids=[0], texts=[""], logprobs=[0.0], is_special=[False])),
        spb.Generation(request_id=0, tokens=spb.Tokens(ids=[5, 6, 2], texts=["a", "b", "</s>"],
                                                       logprobs=[-0.5, -0.25, -1.0], is_special=[False, False, True]),
                       top_tokens=[top, top]),  # a speculative step: three tokens, top tokens for two
        spb.Generation(request_id=0, tokens=spb.Tokens(ids=[9], texts=["c"], logprobs=[-3.0], is_special=[False]),
                       generated_text=spb.GeneratedText(text="abc", generated_tokens=5, finish_reason=0)),
    ]
    service = TextGenerationService.__new__(TextGenerationService)  # _stream needs no model, tokenizer or shard
    service.scheduler = SimpleNamespace(cancel=lambda entry: None)
    entry = Entry(id=0, request=SimpleNamespace(details=False, adapter_id=""))
    for g in gens:
        entry.events.put_nowait(g)

    async def main():
        return [m async for m in service._stream(entry, context=None)]

    got = asyncio.run(main())
    want = expected(gens)
    assert len(got) == len(want) == 5
    assert [m.SerializeToString() for m in got] == [m.SerializeToString() for m in want]
    assert got[0].HasField("token") and got[0].SerializeToString() == b"\n\x00"  # all defaults, still sent
    assert [m.token.id for m in got] == [0, 5, 6, 2, 9] and got[3].token.special
    assert len(got[1].top_tokens) == 2 and not got[3].top_tokens
    assert [m.generated_text for m in got] == ["", "", "", "", "abc"]
