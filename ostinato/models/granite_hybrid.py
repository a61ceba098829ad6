"""IBM Granite-4.0-H (`GraniteMoeHybridForCausalLM`, dense): a plain stack where each layer is a Mamba2
mixer or a GQA attention layer, then a SwiGLU MLP.

No positional encoding. Four µP multipliers: the embeddings are scaled by `embedding_multiplier`, the
attention softmax scale is `attention_multiplier`, each branch output (mixer/attention, MLP) is scaled by
`residual_multiplier` before it joins the residual stream, and the logits are divided by `logits_scaling`.

Attention layers get compact KV-layer ids 0..A-1 (only they have KV); Mamba layers get compact ids
0..M-1 into the MambaPool, bound by `bind_mamba_pool` once the runner made it.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ostinato.attention.base import AttentionSpec
from ostinato.attention.op import attention
from ostinato.layers.linear import Linear, gate_up_silu
from ostinato.layers.mamba2 import mamba_mixer
from ostinato.layers.norm import RMSNorm
from ostinato.layers.norm_linear import fold_norm_weight, norm_gate_up_silu, norm_linear
from ostinato.mem.mamba_pool import MambaPool

MAMBA_LAYER_TYPES = ("mamba", "linear_attention")  # the legacy and the current transformers name


def _is_attention(config: PretrainedConfig) -> list[bool]:
    return [t not in MAMBA_LAYER_TYPES for t in config.layer_types]


def mamba_shape(config: PretrainedConfig) -> dict[str, int]:
    """The per-layer state shape facts MambaPool needs."""
    inter = int(config.mamba_expand * config.hidden_size)
    return {
        "num_layers": sum(not a for a in _is_attention(config)),
        "conv_dim": inter + 2 * config.mamba_n_groups * config.mamba_d_state,
        "conv_kernel": config.mamba_d_conv,
        "num_heads": config.mamba_n_heads,
        "head_dim": config.mamba_d_head,
        "state_size": config.mamba_d_state,
    }


class GraniteAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, kv_layer_id: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.layer_id = kv_layer_id
        self.attn_spec = AttentionSpec(kv_layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                       float(config.attention_multiplier))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv_proj(x))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after qkv_proj (the layer runs that one fused with its norm)."""
        q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : -self.kv_size], qkv[:, -self.kv_size :]
        return self.o_proj(attention(q, k, v, self.layer_id))


class Mamba2Mixer(nn.Module):
    """in_proj -> `ostinato::mamba_mixer` (conv, SSM, gated norm, with the pooled state) -> out_proj."""

    def __init__(self, config: PretrainedConfig, mamba_layer_id: int) -> None:
        super().__init__()
        shape = mamba_shape(config)
        self.num_heads, self.head_dim = shape["num_heads"], shape["head_dim"]
        self.groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.intermediate = self.num_heads * self.head_dim
        self.conv_dim = shape["conv_dim"]
        self.chunk = config.mamba_chunk_size
        self.eps = config.rms_norm_eps
        limit = config.time_step_limit or (0.0, float("inf"))
        self.dt_min, self.dt_max = float(limit[0]), float(limit[1])
        self.in_proj = Linear(config.hidden_size, self.intermediate + self.conv_dim + self.num_heads,
                              bias=bool(config.mamba_proj_bias))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.mamba_d_conv, groups=self.conv_dim,
                                bias=bool(config.mamba_conv_bias))  # parameters only (HF names and shapes)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNorm(self.intermediate, self.eps)  # its weight only: the op applies the gated norm
        self.out_proj = Linear(self.intermediate, config.hidden_size, bias=bool(config.mamba_proj_bias))
        self.layer_id = mamba_layer_id
        self.conv_state: torch.Tensor | None = None  # views of the MambaPool, see bind_mamba_pool
        self.ssm_state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.in_proj(x))

    def mix(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """Everything after in_proj (the layer runs that one fused with its norm)."""
        y = mamba_mixer(zxbcdt, self.conv_state, self.ssm_state, self.conv1d.weight.squeeze(1),
                        self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight, self.num_heads,
                        self.head_dim, self.groups, self.state_size, self.chunk, self.eps, self.dt_min, self.dt_max)
        return self.out_proj(y)


class SharedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden, 2 * intermediate, bias=False)  # [gate; up], as HF stores it
        self.output_linear = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(gate_up_silu(self.input_linear, x))


class GraniteHybridLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, is_attention: bool, sub_id: int) -> None:
        super().__init__()
        self.self_attn = GraniteAttention(config, sub_id) if is_attention else None
        self.mamba = None if is_attention else Mamba2Mixer(config, sub_id)
        self.shared_mlp = SharedMLP(config.hidden_size, config.shared_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = float(config.residual_multiplier)
        self.folded = False  # True once fold_residual_multiplier has scaled the branch outputs' weights

    def fold_residual_multiplier(self) -> None:
        """Scale the two branch output projections (o_proj or out_proj, and the MLP's output_linear) by
        residual_multiplier, so the forward needs no multiply before each norm: two launches per layer fewer."""
        branch = self.self_attn.o_proj if self.self_attn is not None else self.mamba.out_proj
        for linear in (branch, self.shared_mlp.output_linear):
            linear.weight.data.mul_(self.residual_multiplier)
            if linear.bias is not None:
                linear.bias.data.mul_(self.residual_multiplier)
        self.folded = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, scaled by residual_multiplier once folded (or the scaled
        embeddings, residual None)."""
        x = x if residual is None else self.scaled(x)
        if self.mamba is not None:
            zxbcdt, residual = norm_linear(self.input_layernorm, self.mamba.in_proj, x, residual)
            x = self.mamba.mix(zxbcdt)
        else:
            qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
            x = self.self_attn.attend(qkv)
        x, residual = norm_gate_up_silu(self.post_attention_layernorm, self.shared_mlp.input_linear, self.scaled(x),
                                        residual)
        return self.shared_mlp.output_linear(x), residual

    def scaled(self, branch_out: torch.Tensor) -> torch.Tensor:
        """A branch output as it joins the residual stream (already scaled once folded into the weights)."""
        return branch_out if self.folded else branch_out * self.residual_multiplier


class GraniteMoeHybridForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        if getattr(config, "num_local_experts", 0):
            raise ValueError(f"num_local_experts: {config.num_local_experts} (a MoE Granite-4.0-H) is not supported; "
                             "only dense checkpoints (num_local_experts 0)")
        if getattr(config, "position_embedding_type", None) == "rope":
            raise ValueError("position_embedding_type: 'rope' is not supported for GraniteMoeHybrid; only 'nope'")
        self.config = config
        is_attn = _is_attention(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        ids, n_attn, n_mamba = [], 0, 0
        for a in is_attn:
            ids.append(n_attn if a else n_mamba)
            n_attn, n_mamba = n_attn + a, n_mamba + (not a)
        self.layers = nn.ModuleList(GraniteHybridLayer(config, a, i) for a, i in zip(is_attn, ids, strict=True))
        self.num_kv_layers = n_attn  # the KV pool holds these only
        self.num_mamba_layers = n_mamba
        self.attention_specs = {ly.self_attn.layer_id: ly.self_attn.attn_spec for ly in self.layers if ly.self_attn}
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                       bias=False)

    def bind_mamba_pool(self, pool: MambaPool) -> None:
        for layer in self.layers:
            if layer.mamba is not None:
                layer.mamba.conv_state = pool.conv[layer.mamba.layer_id]
                layer.mamba.ssm_state = pool.ssm[layer.mamba.layer_id]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (positions unused: no positional encoding)."""
        x, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm(self.layers[-1].scaled(x), residual)[0]

    def after_load(self) -> None:
        """Once the weights are in (checkpoint or dummy): fold the residual multiplier into them, and each layer's
        two norm weights into the projections after them (layers/norm_linear.py)."""
        for layer in self.layers:
            layer.fold_residual_multiplier()
            branch = layer.mamba.in_proj if layer.mamba is not None else layer.self_attn.qkv_proj
            fold_norm_weight(layer.input_layernorm, branch)
            fold_norm_weight(layer.post_attention_layernorm, layer.shared_mlp.input_linear)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight) / self.logits_scaling
        return logits.float() if out is None else out.copy_(logits)

    _qkv = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise if a parameter of ours was never written."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.startswith("lm_head") and self.lm_head is None:
                continue
            parts = name.split(".")
            proj = next((p for p in parts if p in self._qkv), None)
            if proj is None:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__}")
                params[name].data.copy_(tensor.view_as(params[name]))
                loaded.add(name)
                continue
            name = name.replace(proj, "qkv_proj")
            attn = self.layers[int(parts[1])].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            shard = self._qkv[proj]
            offset = sum(sizes[:shard])
            params[name].data[offset : offset + sizes[shard]].copy_(tensor)
            loaded.add(f"{name}#{shard}")
        missing = [n for n in params if n not in loaded and not any(f"{n}#" in x for x in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:3]}")
