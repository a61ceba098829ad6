"""Triton kernels of the model layers, one module per kernel. Each is also registered as a `torch.library`
custom op (`*_op`), which the public function calls only under torch.compile (an opaque node there); eager
calls skip the op's dispatch. No host syncs, shapes fixed by the inputs: capturable in a CUDA graph.

Import this package only for CUDA tensors (the layer modules do so lazily): Triton decides at decoration
time whether a kernel runs in its CPU interpreter (TRITON_INTERPRET=1), so importing it early would fix
that choice before a test could set the variable.
"""

from ostinato.layers.triton_ops.rms_norm import fused_add_rms_norm, fused_add_rms_norm_op, rms_norm, rms_norm_op
from ostinato.layers.triton_ops.rotary import rotary_embedding_, rotary_embedding_op
from ostinato.layers.triton_ops.silu_and_mul import silu_and_mul, silu_and_mul_op

__all__ = [
    "fused_add_rms_norm", "fused_add_rms_norm_op", "rms_norm", "rms_norm_op", "rotary_embedding_",
    "rotary_embedding_op", "silu_and_mul", "silu_and_mul_op",
]
