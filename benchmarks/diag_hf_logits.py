"""Diagnose logit agreement with transformers on the GPU: our model vs HF across dtypes and code paths.

python benchmarks/diag_hf_logits.py llama-3.2-1b
"""

import json
import os
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_gpu import hf_state_dict  # noqa: E402
from test_models import teacher_forced_logits  # noqa: E402

import ostinato.layers.activation as act  # noqa: E402
import ostinato.layers.norm as norm  # noqa: E402
import ostinato.layers.rotary as rot  # noqa: E402
import ostinato.models.llama as llama  # noqa: E402
from ostinato.config import EngineArgs  # noqa: E402
from ostinato.loader import load_model_source  # noqa: E402
from ostinato.loader.dummy import preset_path  # noqa: E402
from ostinato.runner.model_runner import ModelRunner  # noqa: E402


def run(name: str, layers: int | None, dtype: str, backend: str, torch_layers: bool, graphs: bool) -> str:
    cfg = json.load(open(preset_path(name)))
    if layers:
        cfg["num_hidden_layers"] = layers
    d = tempfile.mkdtemp()
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    saved = (norm.rms_norm, norm.fused_add_rms_norm, rot.rotary_embedding_, llama.silu_and_mul)
    if torch_layers:
        norm.rms_norm, norm.fused_add_rms_norm = norm.rms_norm_torch, norm.fused_add_rms_norm_torch
        rot.rotary_embedding_, llama.silu_and_mul = rot.rotary_embedding_torch, act.silu_and_mul_torch
    try:
        args = EngineArgs(model=d, load_format="dummy", dtype=dtype, max_total_tokens=4096, max_model_len=2048,
                          attention_backend=backend, disable_cuda_graph=not graphs, cuda_graph_bs=[1, 2, 4])
        runner = ModelRunner(args, load_model_source(d, "dummy"))
        tdt = runner.dtype
        with torch.device("cuda"):
            hf = transformers.AutoModelForCausalLM.from_config(runner.config, dtype=tdt).eval()
            hf32 = transformers.AutoModelForCausalLM.from_config(runner.config, dtype=torch.float32).eval()
        hf.load_state_dict(hf_state_dict(runner.model), strict=False)
        hf32.load_state_dict({k: v.float() for k, v in hf_state_dict(runner.model).items()}, strict=False)
        gen = torch.Generator().manual_seed(2)
        seqs = [torch.randint(0, runner.vocab_size, (300,), generator=gen).tolist() for _ in range(2)]
        ours = teacher_forced_logits(runner, seqs, [280, 280])
        out = []
        with torch.no_grad():
            for seq, got in zip(seqs, ours, strict=True):
                ids = torch.tensor([seq], device="cuda")
                ref = hf(ids).logits[0, 279:299].float()
                ref32 = hf32(ids).logits[0, 279:299].float()
                rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
                top1 = (got.argmax(-1) == ref32.argmax(-1)).float().mean()
                out.append(f"ours-vs-hf {rel(got, ref):.2e} ours-vs-hf32 {rel(got, ref32):.2e} "
                           f"hf-vs-hf32 {rel(ref, ref32):.2e} top1 {top1:.2f}")
        del runner, hf, hf32
        torch.cuda.empty_cache()
        return " | ".join(out)
    finally:
        norm.rms_norm, norm.fused_add_rms_norm, rot.rotary_embedding_, llama.silu_and_mul = saved


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    for layers, dtype, backend, torch_layers, graphs in [
        (2, "float32", "triton", False, False), (2, "bfloat16", "triton", False, False),
        (None, "float32", "triton", False, False), (None, "bfloat16", "triton", False, False),
        (None, "bfloat16", "torch", True, False), (None, "bfloat16", "triton", True, False),
        (None, "bfloat16", "torch", False, False),
    ]:
        ops = "torch" if torch_layers else "triton"
        tag = f"{name} layers={layers or 'all'} {dtype} attn={backend} layer_ops={ops} graphs={graphs}"
        print(tag, "::", run(name, layers, dtype, backend, torch_layers, graphs), flush=True)
