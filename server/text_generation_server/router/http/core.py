"""What both HTTP APIs share: the core they submit to, the server's names and limits, reading a
request's generations to the end (cancelled when the client goes away), and the text of a step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.router.http.errors import HttpError, from_status
from text_generation_server.router.scheduler import Entry
from text_generation_server.router.service import Refused, TextGenerationService


# What clients put in `model` when they address a server by its URL rather than a model: TGI's
# documentation's "tgi", huggingface_hub's InferenceClient's "dummy". TGI ignores `model`; these
# are accepted, any other name not served is 404, as OpenAI and vLLM answer.
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})


@dataclass
class HttpContext:
    """The HTTP APIs' view of the server. `model_names`: what a request's `model` may say (the
    model id, the folder it was loaded from); `healthy`: whether new requests are served."""

    service: TextGenerationService
    model_id: str
    model_names: frozenset[str]
    max_body_bytes: int
    max_client_batch_size: int
    healthy: Callable[[], bool]
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        """OpenAI's `model`: absent, or a name this server serves (404 otherwise, as OpenAI answers)."""
        self.model_adapter(model)

    def model_adapter(self, model: str | None) -> str:
        """The LoRA adapter OpenAI's `model` names, as vLLM reads it: "" for the base model (absent,
        its names, a placeholder), the adapter's name for a loaded adapter; 404 naming it otherwise."""
        if model is None or model in self.model_names or model in PLACEHOLDER_MODELS:
            return ""
        if model in self.service.scheduler.adapters:
            return model
        adapters = self.service.scheduler.adapters.names()
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise HttpError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}{also}",
                        "not_found_error", "model", "model_not_found")


T = TypeVar("T")


async def submit(call: Awaitable[T]) -> T:
    """Runs a core call (submit / submit_chat), its refusal as an HttpError."""
    try:
        return await call
    except Refused as exc:
        raise from_status(exc.code, exc.message) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(ctx: HttpContext, request: Request, entries: list[Entry]) -> list[list[spb.Generation]]:
    """Every entry's generations to its end; all cancelled if the client disconnects first."""
    async def one(entry: Entry) -> list[spb.Generation]:
        return [g async for g in ctx.service.events(entry)]

    work: asyncio.Future = asyncio.gather(*(one(e) for e in entries))
    watcher: asyncio.Future = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise HttpError(499, "the client closed the connection", "cancelled")
    except Refused as exc:
        raise from_status(exc.code, exc.message) from None
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        for entry in entries:
            ctx.service.cancel(entry)


async def merged(ctx: HttpContext, entries: list[Entry]) -> AsyncIterator[tuple[int, spb.Generation]]:
    """The generations of several entries as they come, with the entry's index; a failed step
    raises Refused. Leaving early (the client went away) cancels every entry."""
    if len(entries) == 1:  # the common case: no task and queue between the core and the client
        try:
            async for g in ctx.service.events(entries[0]):
                yield 0, g
        finally:
            ctx.service.cancel(entries[0])
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, entry: Entry) -> None:
        try:
            async for g in ctx.service.events(entry):
                queue.put_nowait((index, g))
        except Refused as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, e)) for i, e in enumerate(entries)]
    try:
        running = len(entries)
        while running:
            item = await queue.get()
            if isinstance(item, Refused):
                raise item
            if item[1] is None:
                running -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for entry in entries:
            ctx.service.cancel(entry)


def finished(g: spb.Generation) -> bool:
    return g.HasField("generated_text")


def eos_at_end(g: spb.Generation) -> bool:
    """The step's last token is the EOS that ended the answer (a grammar that is complete ends it
    with no EOS token: then the last token is text)."""
    return (finished(g) and g.generated_text.finish_reason == spb.FINISH_REASON_EOS_TOKEN
            and bool(g.tokens.is_special) and g.tokens.is_special[-1])


def step_texts(g: spb.Generation) -> tuple[str, str]:
    """(visible, raw) text of one step: visible leaves special tokens out, as generated_text
    does; raw keeps them (a tool-call marker may be one) but not the EOS that ends the answer."""
    texts = list(g.tokens.texts)
    visible = "".join(t for t, special in zip(texts, g.tokens.is_special) if not special)
    if eos_at_end(g) and texts:
        texts = texts[:-1]
    return visible, "".join(texts)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


class StopTrimmer:
    """OpenAI ends the text where a stop sequence begins (this engine keeps the token that made
    it, as TGI does): a streamed answer holds back a tail that may still become a stop sequence,
    and never sends text from one on."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0

    def _limit(self) -> int:
        first = _first_stop(self.text, self.stops)
        if first is not None:
            return first
        limit = len(self.text)
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if stop.startswith(self.text[-size:]):
                    limit = min(limit, len(self.text) - size)
                    break
        return limit

    def feed(self, piece: str) -> str:
        self.text += piece
        limit = self._limit()
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self, stopped: bool) -> str:
        end = len(self.text)
        if stopped:
            first = _first_stop(self.text, self.stops)
            end = first if first is not None else end
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = len(self.text)
        return out


def trim_stop(text: str, stops: list[str], stopped: bool) -> str:
    """The text up to the first stop sequence, when one stopped it (OpenAI's semantics)."""
    first = _first_stop(text, stops) if stopped else None
    return text if first is None else text[:first]
