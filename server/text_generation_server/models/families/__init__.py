"""The registry of native model families: model_type -> the family that builds it.

Adding a family is one module here (its config reading and its decoder block, built from
the shared layers) plus one line in FAMILIES.
"""

from __future__ import annotations

from text_generation_server.models.families.base import Family
from text_generation_server.models.families.cohere import CohereFamily
from text_generation_server.models.families.deepseek import DeepseekFamily
from text_generation_server.models.families.falcon import FalconFamily
from text_generation_server.models.families.gemma import GemmaFamily
from text_generation_server.models.families.gpt2 import GPT2Family
from text_generation_server.models.families.gpt_neox import GPTNeoXFamily
from text_generation_server.models.families.granite import GraniteFamily
from text_generation_server.models.families.llama import LlamaFamily
from text_generation_server.models.families.moe import GptOssFamily, MixtralFamily, Qwen2MoeFamily, Qwen3MoeFamily
from text_generation_server.models.families.olmo2 import Olmo2Family
from text_generation_server.models.families.phi import PhiFamily
from text_generation_server.models.families.qwen3 import Qwen3Family
from text_generation_server.models.families.starcoder2 import Starcoder2Family
from text_generation_server.quantizers.sources import CheckpointError

FAMILIES: list[Family] = [
    LlamaFamily(),  # llama, mistral, qwen2, phi3
    Qwen3Family(),
    GemmaFamily(),  # gemma, gemma2, gemma3_text
    PhiFamily(),
    Starcoder2Family(),
    GPTNeoXFamily(),
    FalconFamily(),
    GPT2Family(),  # gpt2, gpt_bigcode
    CohereFamily(),
    Olmo2Family(),
    GraniteFamily(),
    MixtralFamily(),
    Qwen2MoeFamily(),
    Qwen3MoeFamily(),
    GptOssFamily(),
    DeepseekFamily(),  # deepseek_v2, deepseek_v3
]

BY_MODEL_TYPE: dict[str, Family] = {t: family for family in FAMILIES for t in family.model_types}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(BY_MODEL_TYPE))


def family_for(model_type: object, source: str = "config.json") -> Family:
    """The family of `model_type`; an unknown type is refused naming it and what is supported."""
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise CheckpointError(f"{source}: model_type '{model_type}' is not supported "
                              f"(supported: {', '.join(supported_model_types())})")
    return family
