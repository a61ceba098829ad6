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
    weights, N(0, 0.01) for biases. Values come from a seeded CPU generator, so they depend only on the seed,
    the parameter order and shapes, whatever the parameters' device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            continue
        dtype = p.dtype if p.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        vals = torch.empty(p.shape, dtype=dtype)
        if name.endswith("norm.weight"):  # also matches "layernorm.weight"
            vals.normal_(1.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            vals.normal_(0.0, 0.01, generator=gen)
        else:
            vals.normal_(0.0, 0.02, generator=gen)
        p.copy_(vals)
