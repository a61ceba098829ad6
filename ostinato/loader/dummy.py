"""Dummy weights: shipped config presets and a deterministic random init, to run without checkpoints."""

import os

import torch

PRESETS_DIR = os.path.join(os.path.dirname(__file__), "presets")


def list_presets() -> list[str]:
    return sorted(n.removesuffix(".json") for n in os.listdir(PRESETS_DIR) if n.endswith(".json"))


def preset_path(name: str) -> str | None:
    path = os.path.join(PRESETS_DIR, f"{name}.json")
    return path if os.path.isfile(path) else None


@torch.no_grad()
def dummy_init_(module: torch.nn.Module, seed: int = 0) -> None:
    """Fill every float parameter in place: N(0, 0.02) for matrices/embeddings, 1 + N(0, 0.02) for norm
    weights, N(0, 0.01) for biases. Values come from a seeded generator on each parameter's own device (one
    per device, in parameter order), so they depend on the seed, the order, the shapes and the device type;
    filling on the GPU takes well under a second where a CPU generator took ~40 s for 1.2B parameters."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            continue
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        # tensor parallel: a shard is drawn at its full shape and sliced, so the model is the same at any tp_size
        full_shape = getattr(p, "full_shape", None)
        t = p if full_shape is None else torch.empty(full_shape, dtype=p.dtype, device=p.device)
        if name.endswith("norm.weight"):  # also matches "layernorm.weight"
            t.normal_(1.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            t.normal_(0.0, 0.01, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        if full_shape is not None:
            p.load_full(p, t)
