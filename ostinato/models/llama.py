"""Llama-family decoder (Llama, Qwen2, Qwen3 differ in q/k/v bias and per-head q/k norm).

Forward takes flat tokens: `input_ids` and `positions` are [num_tokens] for the whole batch; the
attention op and the forward context know which request each token belongs to. No branch depends on
tensor values, so the forward can be compiled and captured.

The layers pass a residual stream: layer(positions, hidden, residual) -> (hidden, residual), where the
residual add is fused into the next RMSNorm, and the norm into the projection after it at decode sizes
(layers/norm_linear.py). On CUDA at bs 1-2 a layer issues: add+norm+qkv GEMV, rotary (with Qwen3's q/k norm) fused
with the KV store, attention, o_proj GEMV, add+norm+gate_up GEMV with silu_and_mul, down GEMV; at larger batches
silu_and_mul is a launch of its own, and so are the norms but at 5-32 rows: there o_proj's and down's kernels add
the residual, silu_and_mul applies the post-attention norm's per-row scale to gate_up's outputs, and attention the
input norm's to q, k and v (the layer then returns the residual stream whole, with residual None). With
`use_one_row_mlp` (opt-in, Hopper), a one-row layer's MLP from the residual add after o_proj to down's output is one
CUDA kernel (layers/cuda_ops/mlp_bs1.py).
"""

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from ostinato.attention.base import AttentionSpec
from ostinato.attention.op import attention
from ostinato.distributed.parallel_state import tp_size
from ostinato.layers.linear import gate_up_silu
from ostinato.layers.norm import RMSNorm, scale_by_inv_rms
from ostinato.layers.norm_linear import (
    attn_out_norm_gate_up_silu,
    defers_input_norm,
    down_add_residual,
    fold_norm_weight,
    norm_linear,
)
from ostinato.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    float_logits,
)
from ostinato.layers.rotary import RotaryEmbedding


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head width: explicit in Qwen3-style configs, hidden_size / heads otherwise."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        # tensor parallelism: this rank's heads (all of them at tp_size 1)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.layer_id = layer_id
        self.attn_spec = AttentionSpec(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                       self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               x_rms: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """Everything between the qkv projection and o_proj (the decoder layer runs those two fused with their
        neighbours): the attention output, [T, heads x head_dim]. `x_rms` (rows, eps): qkv is the projection of
        these residual-stream rows bare, the layer's input norm deferred (layers/norm_linear.defers_input_norm)."""
        # strided views into the qkv output (row stride q_size + 2 * kv_size), never copied: both attention
        # backends read them through their strides. Sliced, not split: autograd forbids in-place writes to
        # split()'s views, and the CPU graph stand-in replays outside inference mode.
        q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : -self.kv_size], qkv[:, -self.kv_size :]
        if positions.dim() == 1:  # plain RoPE: the attention op rotates q and k, fused with its KV store where it can
            norm = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            x = {} if x_rms is None else dict(x_rms=x_rms[0], x_rms_eps=x_rms[1])
            return attention(q, k, v, self.layer_id, positions, self.rotary.cos_sin, *norm, **x)
        if x_rms is not None:
            q, k, v = scale_by_inv_rms(*x_rms, q, k, v)
        # M-RoPE's [3, T] positions (a vision model's image extend): rotated here
        q_heads, k_heads = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            self.rotary(positions, q_heads, k_heads)
        else:  # Qwen3: per-head RMSNorm, fused into the rotary op
            self.rotary(positions, q_heads, k_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return attention(q, k, v, self.layer_id)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, intermediate)
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.one_row = None  # an MlpBs1 once the model's use_one_row_mlp installs it: the layer's MLP at one row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(self.gate_up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, rotary, qkv_bias, qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x is the previous layer's MLP output, with the residual stream it still has to be added to (residual None:
        x is the stream itself, the embeddings or a deferring layer's output); returns the same for this layer."""
        attn = self.self_attn
        defer = defers_input_norm(x, self.input_layernorm, attn.qkv_proj, self.mlp.down_proj)
        if defer and residual is None:  # x is the residual stream itself: its norm deferred into attention
            a = attn.attend(positions, attn.qkv_proj(x), x_rms=(x, self.input_layernorm.eps))
            residual = x
        else:
            qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
            a = attn.attend(positions, qkv)
        if self.mlp.one_row is not None and a.shape[0] == 1 and not torch.compiler.is_compiling():
            return self.mlp.one_row(attn.o_proj(a), residual)  # (down's output, o_proj's + residual) in one launch
        x, residual = attn_out_norm_gate_up_silu(attn.o_proj, a, residual, self.post_attention_layernorm,
                                                 self.mlp.gate_up_proj)
        if defer:  # the next layer (or the final norm) takes the stream whole: residual None
            return down_add_residual(self.mlp.down_proj, x, residual), None
        return self.mlp.down_proj(x), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    supports_tp = True  # built for this process's tensor-parallel rank (layers/parallel_linear.py)

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, self.qkv_bias, self.qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.attention_specs = {layer.self_attn.layer_id: layer.self_attn.attn_spec for layer in self.layers}
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits; with `out`, written into it (see `float_logits`)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return float_logits(hidden, weight, self.config.vocab_size, out)

    # HF checkpoint name fragment -> (our fused parameter, shard index) for fused projections
    _stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def after_load(self) -> None:
        """Once the weights are in (checkpoint or dummy): each layer's two norm weights into the projections after
        them, so that at decode sizes the norms run inside those GEMVs (layers/norm_linear.py)."""
        for layer in self.layers:
            fold_norm_weight(layer.input_layernorm, layer.self_attn.qkv_proj)
            fold_norm_weight(layer.post_attention_layernorm, layer.mlp.gate_up_proj)

    def use_one_row_mlp(self, grid: int) -> str | None:
        """Runs each layer's MLP at one row as one CUDA kernel over `grid` blocks (layers/cuda_ops/mlp_bs1.py), from
        the post-attention residual add to down's output; returns why not (and installs nothing) where it cannot."""
        from ostinato.layers.cuda_ops import mlp_bs1

        mlps = [layer.mlp for layer in self.layers]
        device = mlps[0].down_proj.weight.device
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            return "it needs a Hopper GPU (sm_90)"
        if tp_size() > 1:
            return "tensor parallel: each rank's MLP ends in an all-reduce"
        if not all(layer.post_attention_layernorm.weight_folded for layer in self.layers):
            return "the post-attention norms are not folded into gate_up"
        for mlp in mlps:
            if (reason := mlp_bs1.unsupported_reason(mlp.gate_up_proj.weight, mlp.down_proj.weight, grid)) is not None:
                return reason
        scratch = mlp_bs1.MlpScratch(self.config.hidden_size, device)
        kernels = [mlp_bs1.MlpBs1(mlp.gate_up_proj.weight, mlp.down_proj.weight, layer.post_attention_layernorm.eps,
                                  scratch, grid) for mlp, layer in zip(mlps, self.layers, strict=True)]
        for mlp, kernel in zip(mlps, kernels, strict=True):
            mlp.one_row = kernel
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise if a parameter of ours was never written."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name.startswith("lm_head") and self.lm_head is None):
                continue
            parts = name.split(".")
            fused = next((self._stacked[p] for p in parts if p in self._stacked), None)
            if fused is None:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__}")
                loader = getattr(params[name], "weight_loader", None)  # tensor parallel: this rank's slice
                if loader is not None:
                    loader(params[name], tensor, None)
                else:
                    params[name].data.copy_(tensor)
                loaded.add(name)
                continue
            target, shard = fused
            name = name.replace(parts[[p in self._stacked for p in parts].index(True)], target)
            param = params[name]
            param.weight_loader(param, tensor, shard)  # the fused layers' loaders (layers/parallel_linear.py)
            loaded.add(f"{name}#{shard}")
        missing = [n for n in params if n not in loaded and not any(f"{n}#" in x for x in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:3]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
