"""Ostinato: a small LLM inference engine."""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:  # lazy, so `import ostinato.mem` does not pull in the whole engine
    if name == "LLM":
        from ostinato.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ostinato.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from ostinato import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
