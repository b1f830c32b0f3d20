"""Which code serves a checkpoint: model_type -> the native family that builds it, else
transformers' modeling code over our cache (`--model-impl`), and the config the engine reads.

Adding a family is one module in families/ (its config reading and its decoder block, built
from the shared layers) plus one line in FAMILIES.
"""

from __future__ import annotations

from text_generation_server.models.decoder import DecoderConfig
from text_generation_server.quantizers.config_reader import ConfigReader
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
from text_generation_server.settings.serve_args import MODEL_IMPLS

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


def model_impl(config: dict, requested: str = "auto", source: str = "config.json") -> str:
    """Which implementation serves a checkpoint: "native" (a family here) or "transformers"
    (transformers' modeling code over our cache). auto: native when a family covers the
    model_type; native: refuses any other; transformers: always the fallback."""
    if requested not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {requested!r}")
    if requested == "transformers":
        return "transformers"
    if config.get("model_type") in BY_MODEL_TYPE:
        return "native"
    if requested == "native":
        family_for(config.get("model_type"), source)  # raises, naming what is supported
    from text_generation_server.models import transformers_impl

    transformers_impl.refuse_unsupported(config, source)
    if not transformers_impl.knows(config.get("model_type")):  # raises with what to install when missing
        try:
            family_for(config.get("model_type"), source)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; transformers {transformers_impl.transformers_version()} does not "
                                  "implement it either") from None
    return "transformers"


def read_model_config(config: dict, source: str = "config.json", impl: str = "auto"
                      ) -> tuple[Family | None, DecoderConfig]:
    """The family of a checkpoint's config.json (None when transformers' code serves it) and the
    config the engine reads from it."""
    if model_impl(config, impl, source) == "transformers":
        from text_generation_server.models import transformers_impl

        return None, transformers_impl.decoder_config(config, source)
    family = family_for(config.get("model_type"), source)
    return family, family.read_config(ConfigReader(config, source))
