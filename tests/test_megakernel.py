"""The one-launch decode step's logic (ostinato/megakernel): its torch twin, step by step over a sequence, against HF
transformers' logits; its split attention against one softmax; what it supports. The kernel itself is checked
against this twin on the GPU (tests/test_megakernel_gpu.py)."""

import pytest
import torch
import transformers

from ostinato.layers.cuda_ops.ring import rows_per_tile
from ostinato.megakernel import reference
from ostinato.megakernel.weights import (
    MIN_SPLIT_TOKENS,
    Shape,
    model_layers,
    model_shape,
    part_sums,
    unsupported_reason,
)
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

COMMON = dict(vocab_size=300, num_hidden_layers=2, intermediate_size=384, initializer_range=0.1,
              max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# (ours, HF's model, HF's config): Qwen3's per-head q/k norm at head dim 128 and 2 query heads a KV head (tied
# embeddings); Llama at head dim 64, 4 a KV head and llama3 rope scaling; Qwen2's qkv bias
FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, transformers.Qwen3ForCausalLM,
              lambda: transformers.Qwen3Config(hidden_size=256, head_dim=128, num_attention_heads=4,
                                               num_key_value_heads=2, tie_word_embeddings=True, **COMMON)),
    "llama": (LlamaForCausalLM, transformers.LlamaForCausalLM,
              lambda: transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                               rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False, **COMMON)),
    "qwen2": (Qwen2ForCausalLM, transformers.Qwen2ForCausalLM,
              lambda: transformers.Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                               tie_word_embeddings=False, **COMMON)),
}


def build(family: str, seed: int, dtype: torch.dtype = torch.float32):
    ours_cls, hf_cls, make_config = FAMILIES[family]
    config = make_config()
    torch.manual_seed(seed)
    hf = hf_cls(config).eval()
    with torch.no_grad():  # norms and biases away from their defaults, so each one's use is checked
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf = hf.to(dtype).float()  # the weights rounded to `dtype`, computed in float32
    ours = ours_cls(config, 512)
    ours.load_weights(hf.state_dict().items())
    ours.after_load()
    for p in ours.parameters():  # the parameters only: the rotary table stays float32, as the engine builds it
        p.data = p.data.to(dtype)
    return hf, ours.eval()


def twin_logits(ours, ids: list[int], splits: int, cache_dtype: torch.dtype) -> torch.Tensor:
    """The twin run as decode, one token at a time from an empty cache (slots shuffled), each step's logits."""
    shape, layers = model_shape(ours), model_layers(ours)
    n = len(ids)
    slots = torch.randperm(n + 5)[:n] + 1
    caches = [(torch.zeros(n + 6, shape.kv_heads, shape.head_dim, dtype=cache_dtype),
               torch.zeros(n + 6, shape.kv_heads, shape.head_dim, dtype=cache_dtype)) for _ in layers]
    out = []
    for t, tok in enumerate(ids):
        x = ours.embed_tokens.weight[tok]
        h = reference.decode_step(shape, layers, x, t, slots[:t], int(slots[t]), [k for k, _ in caches],
                                  [v for _, v in caches], ours.rotary.cos_sin, splits)
        out.append(h.float())
    hidden = torch.stack(out)  # the final norm and the LM head in float32: the step's own rounding is what is checked
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + ours.norm.eps) * ours.norm.weight.float()
    head = ours.embed_tokens.weight if ours.lm_head is None else ours.lm_head.weight
    return hidden @ head.float().T


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_twin_decodes_what_transformers_computes(family, splits):
    """fp32 weights and cache: every step's logits equal HF's forward over the whole sequence (splits of the cached
    keys change only the order of the sums)."""
    hf, ours = build(family, seed=len(family) + splits)
    ids = torch.randint(0, 300, (3 * MIN_SPLIT_TOKENS + 7,), generator=torch.Generator().manual_seed(splits)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = twin_logits(ours, ids, splits, torch.float32)
    assert (got - want).abs().max().item() < 2e-4 * want.abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_twin_with_bf16_weights_and_cache_stays_close(family):
    """bf16 weights and cache, as the kernel runs: the bf16 cache moves the logits by its rounding only, and both
    stay near HF's fp32 forward over the bf16 weights (folding a norm into bf16 weights rounds their products)."""
    hf, ours = build(family, seed=7, dtype=torch.bfloat16)
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = twin_logits(ours, ids, 4, torch.bfloat16)
    exact_cache = twin_logits(ours, ids, 4, torch.float32)
    scale = want.abs().max().item()
    diff = (got - exact_cache).abs()
    assert diff.max().item() < 0.03 * scale and diff.mean().item() < 0.003 * scale
    assert (got - want).abs().mean().item() < 0.005 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("cached", [0, 1, 31, 32, 33, 100, 1000])
def test_split_attention_is_one_softmax(cached):
    gen = torch.Generator().manual_seed(cached)
    q = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    keys = torch.randn(cached + 1, 64, generator=gen, dtype=torch.float64) * 0.5
    values = torch.randn(cached + 1, 64, generator=gen, dtype=torch.float64)
    want = torch.softmax(q @ keys.T, -1) @ values
    for splits in (1, 2, 16):
        got = reference.split_attention(q, keys, values, splits)
        assert torch.allclose(got, want, atol=1e-12), splits
    assert reference.used_splits(cached, 16) == max(1, min(16, -(-cached // MIN_SPLIT_TOKENS)))


def test_what_the_kernel_supports():
    _, ours = build("qwen3", seed=1, dtype=torch.bfloat16)
    bf16 = MHATokenToKVPool(16, torch.bfloat16, 2, 128, 2, "cpu")
    assert unsupported_reason(ours, bf16, 132) is None
    assert "KV cache" in unsupported_reason(ours, MHATokenToKVPool(16, torch.float8_e4m3fn, 2, 128, 2, "cpu"), 132)
    assert "KV heads" in unsupported_reason(ours, bf16, 1)
    _, fp32 = build("qwen3", seed=1)
    assert "bf16" in unsupported_reason(fp32, bf16, 132)
    _, llama = build("llama", seed=1, dtype=torch.bfloat16)  # hidden 512: 512 residual rows for one block
    assert "residual rows" in unsupported_reason(llama, MHATokenToKVPool(16, torch.bfloat16, 2, 64, 2, "cpu"), 1)
    ours.layers[0].input_layernorm.weight_folded = False
    assert "folded" in unsupported_reason(ours, bf16, 132)
    wide = Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=4160, head_dim=128, num_attention_heads=4, num_key_value_heads=2, **COMMON), 512).to(torch.bfloat16)
    wide.after_load()  # hidden 4,160: DOWN's split-K gives a thread 2 chunks of 8 columns, 4,096 at most
    assert "split-K" in unsupported_reason(wide, bf16, 132)
    many = LlamaForCausalLM(transformers.LlamaConfig(  # 29 KV heads: one counter each on a layer's line of 32
        hidden_size=1856, num_attention_heads=29, num_key_value_heads=29, **COMMON), 512).to(torch.bfloat16)
    many.after_load()
    assert "at most 28" in unsupported_reason(many, MHATokenToKVPool(16, torch.bfloat16, 29, 64, 2, "cpu"), 132)


def test_tiles_and_part_sums():
    """A tile holds a power of two rows, at most one a consumer warp, in 16 KB; a block keeps one sum a (row, warp
    sharing the row) of QKV, O, gate and up (DOWN's split-K keeps none): the benchmark models' layers need 32 and
    126 at 132 blocks."""
    assert [rows_per_tile(k) for k in (256, 896, 1024, 1536, 2048, 3072, 8192)] == [8, 8, 8, 4, 4, 2, 1]
    qwen3 = Shape(28, 1024, 16, 8, 128, 3072, 1e-6, 1e-6)  # qkv: 32 rows x 1 warp a row
    llama = Shape(16, 2048, 32, 8, 64, 8192, 1e-5, 1e-5)  # gate: 63 rows x 2
    assert (part_sums(qwen3, 132), part_sums(llama, 132)) == (32, 126)
    assert part_sums(llama, 16) == 1024 and part_sums(llama, 15) > 1024


def test_the_launcher_refuses_tensors_off_its_device():
    """Checked before anything touches CUDA (a host pointer in the kernel is an illegal address)."""
    from ostinato.megakernel.decode_bs1 import DecodeBs1Megakernel

    _, ours = build("qwen3", seed=1, dtype=torch.bfloat16)
    kv = MHATokenToKVPool(16, torch.bfloat16, 2, 128, 2, "cpu")
    with pytest.raises(ValueError, match="must be on cuda:0"):
        DecodeBs1Megakernel(ours, kv, torch.device("cuda", 0), grid=132)


def test_the_flag_is_checked_and_on_fails_where_the_step_cannot_run(tiny_llama_path):
    """--decode-megakernel: a value outside auto / on / off names the field; "on" where the kernel cannot run (the
    CPU) stops the start-up with the reason; "auto" there starts without it."""
    from ostinato import LLM
    from ostinato.config import EngineArgs

    with pytest.raises(ValueError, match="decode_megakernel"):
        EngineArgs(decode_megakernel="sometimes")
    with pytest.raises(ValueError, match="--decode-megakernel on: .*CUDA"):
        LLM(tiny_llama_path, device="cpu", decode_megakernel="on", max_total_tokens=256)
    with LLM(tiny_llama_path, device="cpu", decode_megakernel="auto", max_total_tokens=256) as llm:
        assert llm.engine.runner.decode_megakernel is None
