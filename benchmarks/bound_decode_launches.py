"""An upper bound, not an engine path: decode step time with the RMSNorm launches and/or the silu_and_mul launches
of a step replaced by no-ops that launch nothing (timing only: the numerics are wrong). What a fusion that removes
those launches could give at most, measured in the graph as bench_decode.py measures a step.

SKIP="norm" / "silu" / "stage2" / "attention" / "norm,silu" / "" (none), then bench_decode.py's arguments:

SKIP=norm,silu python benchmarks/bound_decode_launches.py --models llama-3.2-1b qwen3-0.6b --cases 32:128 32:288 \
    --modes graph --no-launches

- "norm": the fused residual add + RMSNorm (`layers.norm.fused_add_rms_norm`) returns its inputs. When the figures
  in docs/gpu-notes.md were taken, that was the input norm of every layer but the first at 5-32 rows; since the
  input norm is deferred there (`layers.norm_linear.defers_input_norm`) no layer calls it at those rows, and the
  option bounds the norms of other batch sizes.
- "silu": the MLP's activation where the post-attention norm is deferred into it (`layers.norm_linear`, 5-32 rows)
  returns gate_up's first half as a view.
- "stage2": the split-KV decode kernel's second launch (merging a request's splits where stage 1 does not combine
  them: `TritonAttentionBackend.entry_combines`) launches nothing: what folding that merge into o_proj's x loads
  could give at most.
- "attention": both launches of the split-KV decode kernel (stage 1, with the rotary and KV store it does at small
  batches, and stage 2) launch nothing: the share of a step that decode attention holds on its critical path.
"""

import importlib
import os
import runpy
import sys

import ostinato.layers.norm as norm
import ostinato.layers.norm_linear as norm_linear

# the module itself: the package's `decode_attention` attribute is the function it exports
decode_attention = importlib.import_module("ostinato.attention.triton_ops.decode_attention")


class _NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def skip_launches(skip: str) -> None:
    """Replace the launches named in `skip` (see the module doc) for this process."""
    if "norm" in skip:
        norm.fused_add_rms_norm = lambda x, residual, weight, eps: (x, residual)
    if "silu" in skip:
        norm_linear.silu_and_mul = lambda x, norm=None: x[:, : x.shape[1] // 2]
    if "stage2" in skip or "attention" in skip:
        decode_attention._decode_stage2_kernel = _NoLaunch()
    if "attention" in skip:
        decode_attention._decode_stage1_kernel = _NoLaunch()


if __name__ == "__main__":
    skip_launches(os.environ.get("SKIP", ""))
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.argv = [os.path.join(here, "bench_decode.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
