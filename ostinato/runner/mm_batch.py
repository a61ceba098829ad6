"""Image inputs of an extend batch: run the vision encoder once for every request whose images are not
encoded yet (all of them in one encoder batch), keep the output on the request (the encoder cache) until its
prefill is done, and slice it to the chunk being computed, with the chunk's M-RoPE positions."""

from dataclasses import dataclass, field

import torch

from ostinato.models.qwen_vl import MMForward


@dataclass
class EncoderStats:
    calls: int = 0  # encoder forwards
    images: int = 0  # images encoded
    cached_tokens: int = 0  # vision embeddings held by the requests' encoder-cache entries now
    peak_cached_tokens: int = 0
    holders: set = field(default_factory=set)


@torch.inference_mode()
def build_mm_forward(model, reqs: list, prefix_lens: list[int], extend_lens: list[int],
                     device: torch.device, stats: EncoderStats, encode=None) -> MMForward | None:
    """None when no request of the batch has images. `reqs`: the engine's Requests (their `mm` inputs).
    `encode(pixels, grids)`: the vision encoder to use (a graph runner's), `model.encode_images` by default."""
    if all(r.mm is None for r in reqs):
        return None
    # 1. encode, in one batch, the images of requests whose chunk reaches image tokens and that hold no cache entry
    todo = [r for r, s, n in zip(reqs, prefix_lens, extend_lens, strict=True)
            if r.mm is not None and r.mm.embeds is None and _image_span(r, s, s + n)[1] > _image_span(r, s, s + n)[0]]
    if todo:
        pixels = torch.cat([r.mm.pixel_values for r in todo]).to(device)
        grids = [g for r in todo for g in r.mm.image_grid_thw]
        embeds, deepstack = (encode or model.encode_images)(pixels, grids)
        sizes = [r.mm.num_image_tokens for r in todo]
        for i, r in enumerate(todo):
            r.mm.embeds = embeds.split(sizes)[i]
            r.mm.deepstack = None if deepstack is None else deepstack.split(sizes, dim=1)[i]
            stats.holders.add(r)
        stats.calls += 1
        stats.images += len(grids)
    # 2. positions and image rows of the chunk
    positions, rows, embeds, deepstack, offset = [], [], [], [], 0
    for r, s, n in zip(reqs, prefix_lens, extend_lens, strict=True):
        e = s + n
        if r.mm is None:
            positions.append(torch.arange(s, e).expand(3, -1))
        else:
            plen = r.mm.mrope_positions.shape[1]
            positions.append(r.mm.mrope_positions[:, s:min(e, plen)])
            if e > plen:
                positions.append(torch.arange(max(s, plen), e).expand(3, -1) + r.mm.rope_delta)
            lo, hi = _image_span(r, s, e)
            if hi > lo:
                rows.append(r.mm.image_rows[lo:hi] - s + offset)
                embeds.append(r.mm.embeds[lo:hi])
                if r.mm.deepstack is not None:
                    deepstack.append(r.mm.deepstack[:, lo:hi])
            # no image token left past this chunk: drop the cache entry (the slices above live on)
            if r.mm.embeds is not None and (r.mm.num_image_tokens == 0 or int(r.mm.image_rows[-1]) < e):
                r.mm.embeds = r.mm.deepstack = None
                stats.holders.discard(r)
        offset += n
    stats.holders = {r for r in stats.holders if r.mm is not None and r.mm.embeds is not None and not r.is_finished}
    stats.cached_tokens = sum(r.mm.num_image_tokens for r in stats.holders)
    stats.peak_cached_tokens = max(stats.peak_cached_tokens, stats.cached_tokens)
    hidden = model.language_model.embed_tokens.weight
    return MMForward(
        rows=torch.cat(rows).to(device) if rows else torch.empty(0, dtype=torch.int64, device=device),
        embeds=torch.cat(embeds) if embeds else hidden.new_empty(0, hidden.shape[1]),
        positions=torch.cat(positions, dim=1).to(device),
        deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
    )


def _image_span(r, start: int, end: int) -> tuple[int, int]:
    """Indices [lo, hi) into the request's image rows that fall in prompt positions [start, end)."""
    rows = r.mm.image_rows
    return int(torch.searchsorted(rows, start)), int(torch.searchsorted(rows, end))
