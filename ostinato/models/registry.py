"""Model classes keyed by the HF config's `architectures` name."""

from torch import nn
from transformers import PretrainedConfig

from ostinato.models.granite_hybrid import GraniteMoeHybridForCausalLM
from ostinato.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from ostinato.models.qwen_vl import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
}

_BY_MODEL_TYPE = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if not archs and config.model_type in _BY_MODEL_TYPE:  # configs built from GGUF metadata
        return _BY_MODEL_TYPE[config.model_type]
    raise ValueError(
        f"architectures: {archs or 'none given'} not supported; supported: {sorted(MODEL_REGISTRY)}"
    )
