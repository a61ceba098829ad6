"""Model loading: resolve a `model` string into config, tokenizer and HF-named weights."""

from ostinato.loader.dummy import dummy_init_, list_presets
from ostinato.loader.source import (
    LOAD_FORMATS,
    ModelSource,
    check_model_exists,
    default_model_path,
    load_model_source,
)

__all__ = [
    "check_model_exists",
    "LOAD_FORMATS", "ModelSource", "default_model_path", "dummy_init_", "list_presets", "load_model_source",
]
