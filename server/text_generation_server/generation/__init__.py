"""Token selection, stopping and streaming detokenisation, shared by every model's generate_token."""

from text_generation_server.generation.detokenize import IncrementalDetokenizer
from text_generation_server.generation.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarType
from text_generation_server.generation.sampling import (
    HeterogeneousNextTokenChooser,
    SamplingParams,
    prefill_logprobs,
    top_n_logprobs,
)
from text_generation_server.generation.stopping import FinishReason, StoppingCriteria

__all__ = [
    "FinishReason",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "GrammarType",
    "HeterogeneousNextTokenChooser",
    "IncrementalDetokenizer",
    "SamplingParams",
    "StoppingCriteria",
    "prefill_logprobs",
    "top_n_logprobs",
]
