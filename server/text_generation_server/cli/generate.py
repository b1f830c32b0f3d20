"""`generate`: completions for prompts from a local model, or from a running server (--server)."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.cli.common import LEVEL_HELP, fail, setup_logging
from text_generation_server.cli.remote import (
    CLIENT_API_KEY,
    CLIENT_API_KEY_FILE,
    CLIENT_TLS,
    CLIENT_TLS_CA,
    CLIENT_TLS_CERT,
    CLIENT_TLS_KEY,
    CLIENT_TLS_NAME,
    client_options,
    generate_remote,
)


def generate(
    prompts: List[str] = typer.Argument(..., metavar="PROMPT...", help="One or more prompts; all run as one batch."),
    model: Optional[str] = typer.Option(
        None, "--model", help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default)."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens generated per prompt."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="Quantization method; must agree with the checkpoint (default: from the checkpoint)."
    ),
    model_impl: str = typer.Option(
        "auto", "--model-impl", metavar="auto|native|transformers",
        help="Which code computes the model (as for serve).",
    ),
    do_sample: bool = typer.Option(False, "--do-sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(1.0, "--temperature", help="Divide the logits by this (with --do-sample)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k likeliest tokens; 0 keeps all."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample from the likeliest tokens holding this mass; 1 keeps all."
    ),
    typical_p: float = typer.Option(1.0, "--typical-p", help="Locally typical sampling mass; 1 keeps all."),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", help="Penalise tokens already seen (CTRL-style); 1 is off."
    ),
    frequency_penalty: float = typer.Option(
        0.0, "--frequency-penalty", help="Subtract this per earlier occurrence of a token; 0 is off."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help="Seed for sampling (default: a random one)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop sequence (repeatable)."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON object per prompt, one per line."),
    chat: bool = typer.Option(
        False, "--chat", help="Each PROMPT is a user message of its own conversation, rendered with the model's "
        "chat template (the Chat RPC with --server).",
    ),
    adapter_id: Optional[str] = typer.Option(
        None, "--adapter-id", metavar="NAME",
        help="With --server: generate with the server's LoRA adapter of this name (loaded with serve "
        "--lora-adapters or LoadAdapter); an unknown name fails, never falls back to the base model.",
    ),
    logger_level: str = typer.Option("WARNING", "--logger-level", help=LEVEL_HELP),
    server: Optional[str] = typer.Option(
        None, "--server", metavar="HOST:PORT",
        help="Send the prompts to a running serve (its client API) instead of loading a model here.",
    ),
    timeout_s: float = typer.Option(300.0, "--timeout-s", min=0.1, help="With --server: deadline of each request."),
    api_key: Optional[str] = CLIENT_API_KEY,
    api_key_file: Optional[str] = CLIENT_API_KEY_FILE,
    tls: bool = CLIENT_TLS,
    tls_ca_path: Optional[str] = CLIENT_TLS_CA,
    tls_client_cert_path: Optional[str] = CLIENT_TLS_CERT,
    tls_client_key_path: Optional[str] = CLIENT_TLS_KEY,
    tls_server_name: Optional[str] = CLIENT_TLS_NAME,
) -> None:
    """Generate completions for PROMPTS with a local model, or with a running server (--server)."""
    setup_logging(logger_level)
    if server is not None:
        if model is not None or dtype is not None or quantize is not None or model_impl != "auto":
            fail("--server uses the server's model: --model, --dtype, --quantize and --model-impl do not apply")
        client = client_options(api_key, api_key_file, tls, tls_ca_path, tls_client_cert_path,
                                tls_client_key_path, tls_server_name)
        from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

        params = cpb.GenerateParameters(max_new_tokens=max_new_tokens, do_sample=do_sample, stop=stop, details=True)
        # Only what differs from the server's defaults (1 / 0 / off), so its own validation applies as written.
        for name, value, default in (("temperature", temperature, 1.0), ("top_k", top_k, 0), ("top_p", top_p, 1.0),
                                     ("typical_p", typical_p, 1.0), ("repetition_penalty", repetition_penalty, 1.0),
                                     ("frequency_penalty", frequency_penalty, 0.0), ("seed", seed, None)):
            if value != default:
                setattr(params, name, value)
        if adapter_id:
            params.adapter_id = adapter_id
        model_id, rows = generate_remote(server, prompts, params, client, timeout_s, chat)
        _echo_completions(model_id, prompts, rows, json_lines)
        return
    if adapter_id:
        fail("--adapter-id needs --server: adapters are served by `serve --lora-adapters` (or loaded into it)")
    from text_generation_server.generation.sampling import SamplingParams
    from text_generation_server.models.loader import get_model
    from text_generation_server.engine.types import GenerationRequest

    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p, do_sample=do_sample,
        seed=seed, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
    )
    try:
        sampling.validate()
        inputs = _chat_prompts(model, prompts) if chat else prompts
        lm = get_model(model, dtype=dtype, quantize=quantize, model_impl=model_impl)
        requests = [
            GenerationRequest(id=i, inputs=p, sampling=sampling, max_new_tokens=max_new_tokens, stop_sequences=stop,
                              add_special_tokens=not chat)  # a chat template writes its special tokens itself
            for i, p in enumerate(inputs)
        ]
        completions = lm.generate(requests)
    except ValueError as exc:  # CheckpointError is a ValueError
        fail(str(exc))
    rows = [(done.text, done.token_ids, done.finish_reason.name.lower(), done.seed) for done in completions]
    _echo_completions(lm.model_id, prompts, rows, json_lines)


def _echo_completions(model_id: str, prompts: List[str], rows: List[tuple], json_lines: bool) -> None:
    """(text, token_ids, finish_reason, seed) per prompt, as JSON lines or as prompt + text."""
    for prompt, (text, token_ids, finish_reason, seed) in zip(prompts, rows):
        if json_lines:
            typer.echo(json.dumps({
                "model": model_id,
                "prompt": prompt,
                "text": text,
                "token_ids": token_ids,
                "generated_tokens": len(token_ids),
                "finish_reason": finish_reason,
                "seed": seed,
            }))
        else:
            typer.echo(prompt + text)
            if len(prompts) > 1:
                typer.echo("")


def _chat_prompts(model: Optional[str], prompts: List[str]) -> List[str]:
    """Each prompt as a one-message conversation rendered by the model's chat template; a model
    without one (or a template that refuses the message) fails with the template's reason."""
    from text_generation_server.generation.chat_template import ChatTemplate, ChatTemplateMissing
    from text_generation_server.utils.locate import resolve_model

    try:
        template = ChatTemplate.load(resolve_model(model)[1])
        return [template.render([{"role": "user", "content": p}]) for p in prompts]
    except ChatTemplateMissing as exc:
        fail(str(exc))

