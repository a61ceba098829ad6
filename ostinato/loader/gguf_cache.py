"""A converted copy of each GGUF checkpoint, so that only the first load pays for parsing it.

Reading a GGUF file through `gguf`/transformers parses every metadata field in Python (SmolLM2's 49k-token
vocabulary and merges) once for the config, once for the tokenizer and once for the weights: about 15 s of a
20 s start-up on a small CPU. The first load writes what it read as an HF directory (config.json, the
tokenizer files, float32 safetensors); later loads of the same file read that directory in about a second.

The key is the GGUF file's absolute path, size and modification time plus CONVERSION_VERSION (bump it when
the conversion changes), so an edited or replaced file is converted again. The cache lives in
`$OSTINATO_CACHE_DIR` (default `$XDG_CACHE_HOME/ostinato`, else `~/.cache/ostinato`); `OSTINATO_GGUF_CACHE=0`
turns it off. A cache that cannot be written only costs speed: the GGUF file is read directly.
"""

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CONVERSION_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
_DONE_MARK = "converted.ok"  # written last: a directory without it is incomplete and ignored


def cache_root() -> str:
    if root := os.environ.get("OSTINATO_CACHE_DIR"):
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ostinato")


def cache_enabled() -> bool:
    return os.environ.get("OSTINATO_GGUF_CACHE", "1").strip().upper() not in ("0", "OFF", "NO", "FALSE")


def converted_dir(gguf_path: str) -> str:
    """Where the conversion of this exact file (path, size, mtime) lives, whether or not it exists yet."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{digest}")


def find_converted(gguf_path: str) -> str | None:
    """The complete converted directory for `gguf_path`, or None."""
    if not cache_enabled():
        return None
    path = converted_dir(gguf_path)
    return path if os.path.isfile(os.path.join(path, _DONE_MARK)) else None


def write_converted(gguf_path: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None,
                    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> str | None:
    """Convert into the cache; returns the directory, or None (logged) where the cache cannot be written.

    Written into a temporary sibling and renamed into place, so concurrent loaders never see half a copy."""
    if not cache_enabled():
        return None
    target = converted_dir(gguf_path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file({name: t.contiguous() for name, t in weights()}, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={"source": os.path.abspath(gguf_path)})
        open(os.path.join(tmp, _DONE_MARK), "w").close()
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first (target exists and is not empty)
            shutil.rmtree(tmp, ignore_errors=True)
        tmp = None
        logger.info("converted %s into %s (later loads read that copy)", gguf_path, target)
        return target if os.path.isfile(os.path.join(target, _DONE_MARK)) else None
    except OSError as e:
        logger.warning("GGUF cache not written (%s); loading %s directly", e, gguf_path)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
