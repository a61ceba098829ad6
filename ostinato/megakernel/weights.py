"""What the one-launch decode step reads from a Llama-family model: its shape and each layer's tensors, and whether
a model, cache and device can run it at all."""

from dataclasses import dataclass

import torch

from ostinato.layers.cuda_ops.ring import SLOT_BYTES, WARPS, rows_per_tile

# The kernel's limits (decode_bs1.cu; its ring's in layers/cuda_ops/ring.py): head dims it is built for; query heads
# a KV head it is built for; gate outputs a block holds (kGateMax) times the blocks.
HEAD_DIMS = (64, 128)
MAX_GROUP = 4
GATE_MAX = 512
RESIDUAL_ROWS_MAX = 256  # residual-stream rows a block adds to (one consumer thread loads each)
PART_MAX = 1024  # a block's (row, k part) sums of one projection (kPartMax)
DOWN_HIDDEN_MAX = 2 * 8 * 256  # DOWN's split-K: kDownChunks 8-column chunks of h a consumer thread
KV_HEADS_MAX = 28  # a layer's per-head counters (the kernel's kCountStride - kHead)
MIN_SPLIT_TOKENS = 32  # cached keys a split of one KV head takes at least (the kernel's kMinSplitTokens)


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    qk_eps: float

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the kernel reads it: [out, in] matrices with the layer's two RMSNorm weights folded in
    (qkv: [q; k; v] rows; gate_up: gate rows then up rows), optional qkv bias and per-head q/k norm weights."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def model_shape(model) -> Shape:
    layer = model.layers[0]
    attn = layer.self_attn
    q_norm = attn.q_norm
    return Shape(len(model.layers), model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                 layer.mlp.down_proj.weight.shape[1], layer.input_layernorm.eps,
                 q_norm.eps if q_norm is not None else layer.input_layernorm.eps)


def model_layers(model) -> list[LayerWeights]:
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(LayerWeights(
            attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            attn.qkv_proj.bias, None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight))
    return out


def part_sums(s: Shape, grid: int) -> int:
    """The most (row, k part) sums a block keeps for one projection (QKV, O, gate, up; DOWN keeps none): its rows
    times the warps that share a row."""
    ops = [(s.q_size + 2 * s.kv_size, s.hidden), (s.hidden, s.q_size), (s.inter, s.hidden)]
    return max(-(-rows // grid) * (WARPS // rows_per_tile(k)) for rows, k in ops)


def unsupported_reason(model, kv_cache, grid: int) -> str | None:
    """Why the one-launch step cannot run this model, cache and grid of `grid` blocks; None where it can."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0], "mlp"):
        return f"{type(model).__name__} is not a Llama-family decoder"
    s = model_shape(model)
    for layer in layers:
        if not (layer.input_layernorm.weight_folded and layer.post_attention_layernorm.weight_folded):
            return "the layers' norms are not folded into their projections (tensor parallel?)"
    params = [t for lw in model_layers(model) for t in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() or t.data_ptr() % 16 for t in params):
        return "weights must be contiguous, 16-byte aligned bf16"
    if s.head_dim not in HEAD_DIMS:
        return f"head dim {s.head_dim} (built for {HEAD_DIMS})"
    if s.heads % s.kv_heads or not 1 <= s.group <= MAX_GROUP:
        return f"{s.group} query heads a KV head (built for 1-{MAX_GROUP})"
    for k in (s.hidden, s.q_size):
        if 2 * k > SLOT_BYTES or k % 64:
            return f"a projection's input width {k} (must be a multiple of 64, at most {SLOT_BYTES // 2})"
    if s.hidden > DOWN_HIDDEN_MAX:
        return f"hidden size {s.hidden} (DOWN's split-K is built for at most {DOWN_HIDDEN_MAX})"
    if -(-s.inter // grid) > GATE_MAX:
        return f"intermediate size {s.inter} over {grid} blocks (at most {GATE_MAX} gate rows a block)"
    if -(-s.hidden // grid) > RESIDUAL_ROWS_MAX:
        return f"hidden size {s.hidden} over {grid} blocks (at most {RESIDUAL_ROWS_MAX} residual rows a block)"
    if part_sums(s, grid) > PART_MAX:
        return f"{part_sums(s, grid)} row x part sums a block over {grid} blocks (at most {PART_MAX})"
    if s.kv_heads > grid:
        return f"{s.kv_heads} KV heads over {grid} blocks"
    if s.kv_heads > KV_HEADS_MAX:
        return f"{s.kv_heads} KV heads (at most {KV_HEADS_MAX})"
    if kv_cache.dtype != torch.bfloat16 or kv_cache.head_major or kv_cache.layout.group:
        return "the KV cache must be bf16, token-major"
    return None
