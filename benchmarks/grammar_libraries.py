"""The three structured-generation libraries side by side, on a tokenizer's vocabulary.

Why the server uses llguidance (README, "Structured output"): a schema sent by a client is
compiled while that request waits, so compile time counts as much as the per-token mask.
For each library installed (llguidance, xgrammar, outlines-core; only llguidance is a
dependency, `pip install xgrammar outlines-core` for the others), and each schema, this prints
the time from schema text to the first mask, and the per-token mask time while walking a
document of the schema token by token (median, p90, max). JSON is compiled compact (no
whitespace) in every library. One thread each, in this process.

    python benchmarks/grammar_libraries.py
    python benchmarks/grammar_libraries.py --tokenizer /models/Llama-3.1-8B/tokenizer.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from bench_common import command_line, load_line, machine_line, md_table, now_iso  # noqa: E402

SCHEMAS = {
    "small: enum, boolean, bounded strings and array, integer": (
        {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "kind": {"enum": ["function", "class", "module"]},
            "public": {"type": "boolean"},
            "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "lines": {"type": "integer", "minimum": 0, "maximum": 1000}},
         "required": ["name", "kind", "public", "args", "lines"], "additionalProperties": False},
        {"name": "parse", "kind": "function", "public": True, "args": ["text", "pos"], "lines": 42}),
    "larger: 200-char string, 20 x 30-char array, nested object, email, number": (
        {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 20},
            "author": {"type": "object", "properties": {"name": {"type": "string"},
                                                       "email": {"type": "string", "format": "email"}},
                       "required": ["name", "email"], "additionalProperties": False},
            "score": {"type": "number"}},
         "required": ["title", "tags", "author", "score"], "additionalProperties": False},
        {"title": "A tiny parser", "tags": ["python", "parsing"], "author": {"name": "Ada", "email": "ada@x.org"},
         "score": 4.5}),
}


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (outlines-core wants raw token bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def walk(first_mask: Callable[[], None], step: Callable[[int], None], tokens: list[int]) -> tuple[float, list[float]]:
    """(seconds to the first mask, per-token mask seconds) along `tokens`."""
    started = time.perf_counter()
    first_mask()
    compile_s = time.perf_counter() - started
    times = []
    for token in tokens:
        started = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - started)
    return compile_s, times


def llguidance_run(tok_json: str, vocab: int, eos: int, schema: str, tokens: list[int]):
    import llguidance
    import torch

    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    mask = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    state: dict = {}

    def first() -> None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        state["m"] = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        state["m"].unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def step(token: int) -> None:
        state["m"].consume_token(token)
        state["m"].unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    return walk(first, step, tokens)


def xgrammar_run(tok_json: str, vocab: int, eos: int, schema: str, tokens: list[int]):
    import xgrammar

    encoded = [""] * vocab
    data = json.loads(tok_json)
    for text, index in data["model"]["vocab"].items():
        encoded[index] = text
    for added in data.get("added_tokens", []):
        encoded[added["id"]] = added["content"]
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    state: dict = {}

    def first() -> None:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        state["m"] = xgrammar.GrammarMatcher(compiled)
        state["m"].fill_next_token_bitmask(mask)

    def step(token: int) -> None:
        state["m"].accept_token(token)
        state["m"].fill_next_token_bitmask(mask)

    return walk(first, step, tokens)


def outlines_run(tok_json: str, vocab: int, eos: int, schema: str, tokens: list[int]):
    import outlines_core
    import torch

    decode = byte_level_decoder()
    by_bytes: dict[bytes, list[int]] = {}
    for text, index in json.loads(tok_json)["model"]["vocab"].items():
        if index != eos:
            by_bytes.setdefault(bytes(decode[c] for c in text), []).append(index)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    mask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    state: dict = {}

    def first() -> None:
        regex = outlines_core.json_schema.build_regex_from_schema(schema, "")  # no whitespace
        state["g"] = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        state["g"].write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def step(token: int) -> None:
        state["g"].advance(token)
        state["g"].write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    return walk(first, step, tokens)


LIBRARIES = {"llguidance": ("llguidance", llguidance_run), "xgrammar": ("xgrammar", xgrammar_run),
             "outlines-core": ("outlines_core", outlines_run)}


def main() -> int:
    from tokenizers import Tokenizer

    from text_generation_server.utils.locate import embedded_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=embedded_model_path() / "tokenizer.json",
                        help="a byte-level BPE tokenizer.json (default: the embedded model's)")
    parser.add_argument("--eos", type=int, default=0, help="the end-of-sequence token id")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tok_json = args.tokenizer.read_text()
    tokenizer = Tokenizer.from_str(tok_json)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    rows = []
    for label, (schema, document) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False).ids
        for name, (module, run) in LIBRARIES.items():
            if importlib.util.find_spec(module) is None:
                rows.append([label, name, "not installed", "", "", ""])
                continue
            compile_s, times = run(tok_json, vocab, args.eos, json.dumps(schema), tokens)
            times.sort()
            rows.append([label, name, f"{compile_s * 1e3:.1f}", f"{statistics.median(times) * 1e6:.0f}",
                         f"{times[int(len(times) * 0.9)] * 1e6:.0f}", f"{times[-1] * 1e6:.0f}"])
    print(f"# grammar libraries ({now_iso()})\n")
    print(f"`{command_line()}`\n")
    print(machine_line(f"{args.tokenizer} ({vocab} tokens)"))
    print(load_line(__import__("os").getloadavg()[0]) + "\n")
    print("\n".join(md_table(["schema", "library", "schema to first mask (ms)", "mask median (us)", "p90 (us)",
                              "max (us)"], rows, "llrrrr")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
