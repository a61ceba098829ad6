"""A request's image inputs, from the front end to the engine core, and its encoder-cache entry."""

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class MultiModalInputs:
    pixel_values: torch.Tensor  # [patches, C * T * P * P] float32, all the request's images packed
    image_grid_thw: list[tuple[int, int, int]]  # per image, in prompt order
    image_rows: torch.Tensor  # int64 [n]: prompt indices of the image placeholder tokens (sorted)
    mrope_positions: torch.Tensor  # int64 [3, prompt_len]
    rope_delta: int  # positions past the prompt are index + rope_delta
    # encoder cache: the tower's output, kept from the first chunk holding image tokens until the prefill ends
    embeds: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None

    @property
    def num_image_tokens(self) -> int:
        return int(self.image_rows.numel())


def mm_to_wire(mm: MultiModalInputs) -> dict:
    """Plain data (bytes, lists) for the front end -> engine-core message."""
    px = mm.pixel_values.float().contiguous()
    return {"pixels": px.numpy().tobytes(), "shape": list(px.shape), "grids": [list(g) for g in mm.image_grid_thw],
            "rows": mm.image_rows.tolist(), "positions": mm.mrope_positions.numpy().tobytes(),
            "delta": mm.rope_delta}


def mm_from_wire(d: dict) -> MultiModalInputs:
    pixels = torch.frombuffer(bytearray(d["pixels"]), dtype=torch.float32).view(*d["shape"])
    positions = torch.frombuffer(bytearray(d["positions"]), dtype=torch.int64).view(3, -1)
    return MultiModalInputs(pixels, [tuple(g) for g in d["grids"]], torch.tensor(d["rows"], dtype=torch.int64),
                            positions, int(d["delta"]))
