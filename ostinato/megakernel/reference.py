"""The one-launch decode step's twin in torch: the same operations in the same order and precision as
decode_bs1.cu (float32 activations and residual stream, bf16-rounded new K/V where the cache is bf16, attention in
splits of a KV head's cached keys merged by their maxima and sums), for one request. It is what the CPU tests check
against the model and HF transformers, and what the GPU tests check the kernel against."""

import torch

from ostinato.megakernel.weights import MIN_SPLIT_TOKENS, LayerWeights, Shape


def used_splits(cached: int, splits: int) -> int:
    """Splits of a KV head's cached keys that hold keys (the kernel's `used`): one per MIN_SPLIT_TOKENS keys, at
    least 1, at most `splits`."""
    return max(1, min(splits, -(-cached // MIN_SPLIT_TOKENS)))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, splits: int) -> torch.Tensor:
    """softmax(q . keys) . values for one KV head's query heads q [G, D] (already scaled), over keys [T, D] whose
    last row is the new token's; the T - 1 cached keys in used_splits(T - 1, splits) splits, each reduced to its
    (unnormalised output, max, sum) and the splits merged, as the kernel does."""
    cached = keys.shape[0] - 1
    used = used_splits(cached, splits)
    chunk = -(-cached // used)
    outs, maxes, sums = [], [], []
    for s in range(used):
        idx = list(range(s * chunk, min(cached, (s + 1) * chunk))) + ([cached] if s == used - 1 else [])
        if not idx:
            continue
        scores = q @ keys[idx].T  # [G, n]
        m = scores.max(-1, keepdim=True).values
        p = torch.exp(scores - m)
        outs.append(p @ values[idx])
        maxes.append(m)
        sums.append(p.sum(-1, keepdim=True))
    m_all = torch.stack(maxes).max(0).values
    f = [torch.exp(m - m_all) for m in maxes]
    return sum(o * w for o, w in zip(outs, f, strict=True)) / sum(s * w for s, w in zip(sums, f, strict=True))


@torch.no_grad()
def decode_step(shape: Shape, layers: list[LayerWeights], x_in: torch.Tensor, position: int, cached_slots: torch.Tensor,
                new_slot: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cos_sin: torch.Tensor,
                splits: int) -> torch.Tensor:
    """One request's decode step through every layer: x_in [hidden] (the token's embedding) -> the residual stream
    after the last layer [hidden] in x_in's dtype, with the new token's K/V stored at `new_slot` of each layer's
    cache ([slots, kv_heads, head_dim]); `cached_slots` are the slots of the request's earlier tokens."""
    s = shape
    d = s.head_dim
    cos, sin = cos_sin[position].float().chunk(2)
    h = x_in.float()
    for lw, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
        qkv = lw.qkv.float() @ _rms(h, s.eps)
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias.float()
        q = qkv[: s.q_size].view(s.heads, d)
        k = qkv[s.q_size : s.q_size + s.kv_size].view(s.kv_heads, d)
        v = qkv[s.q_size + s.kv_size :].view(s.kv_heads, d)
        if lw.q_norm is not None:
            q, k = _rms(q, s.qk_eps) * lw.q_norm.float(), _rms(k, s.qk_eps) * lw.k_norm.float()
        q, k = _rotate(q, cos, sin) * d**-0.5, _rotate(k, cos, sin)
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # what the cache holds, and what the step attends to
        keys = torch.cat([k_cache[cached_slots].float(), k.float()[None]])  # [T, kv_heads, D]
        values = torch.cat([v_cache[cached_slots].float(), v.float()[None]])
        k_cache[new_slot], v_cache[new_slot] = k, v
        attn = torch.cat([split_attention(q[j * s.group : (j + 1) * s.group], keys[:, j], values[:, j], splits)
                          for j in range(s.kv_heads)]).flatten()
        h = h + lw.o.float() @ attn
        gate, up = (lw.gate_up.float() @ _rms(h, s.eps)).chunk(2)
        h = h + lw.down.float() @ (torch.nn.functional.silu(gate) * up)
    return h.to(x_in.dtype)
