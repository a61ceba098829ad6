"""A tiny random-weight Llama (2 layers, hidden 64) that speaks SmolLM2's tokenizer, saved as an HF directory.

Engine tests that compare two of Ostinato's own paths (overlap vs synchronous steps, mixed vs unmixed batches,
prefix cache on vs off) run on it: every scheduler, KV and sampling path is the same as on SmolLM2, at a
hundredth of the CPU time per step. Tests that compare against transformers' SmolLM2 keep the real model.
"""

import os

import torch


def make_tiny_llama(path: str, tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        # std 0.2 (HF's default is 0.02): logits spread by ~1.6, so greedy picks are not near-ties that batch
        # composition could flip
        initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF leaves norms at 1: perturb them so the loaded values matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
