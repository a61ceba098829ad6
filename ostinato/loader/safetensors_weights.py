"""Read HF safetensors checkpoints (single file or sharded) lazily, one tensor at a time."""

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files: from the shard index if there is one, else all in the dir."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"model: no .safetensors files in {model_dir!r}")
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", leave=False, disable=None) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)
