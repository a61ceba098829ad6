"""A request's image inputs, from the front end to the engine core, and its encoder-cache entry."""

import hashlib
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

    def placeholder_keys(self) -> list[int]:
        """Per image placeholder token (in `image_rows` order), an id that stands for its image's content in
        the prefix cache: negative (never a vocabulary id) and derived from a hash of the image's pixels and
        grid, so two different images never share KV and the same image shared by two prompts does."""
        if getattr(self, "_keys", None) is None:
            patches = [t * h * w for t, h, w in self.image_grid_thw]
            tokens_per_patch = self.num_image_tokens / max(1, sum(patches))  # 1 / merge**2
            keys, start = [], 0
            for grid, n in zip(self.image_grid_thw, patches, strict=True):
                px = self.pixel_values[start : start + n].float().contiguous().numpy().tobytes()
                digest = hashlib.blake2b(px + repr(grid).encode(), digest_size=8).digest()
                keys += [-1 - int.from_bytes(digest, "little") % 2**62] * round(n * tokens_per_patch)
                start += n
            self._keys = keys
        return self._keys


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
