"""torch.compile of the decode step, one static-shape compile per captured batch size.

Why one compile per size rather than one dynamic-shape compile (batch dim marked dynamic): each decode
graph is captured at a fixed size anyway, and Inductor's kernels for a known size are its fastest (no
symbolic bounds, sizes folded into the launch grids). The cost is compile time, which grows with the
number of sizes and is logged at start-up. Dynamo stops recompiling a function after
`recompile_limit` (8 by default) variants and raises FailOnRecompileLimitHit under fullgraph, so the
limit is raised by the number of compiled sizes while the graphs are captured, and only then.
"""

import contextlib
from collections.abc import Iterator

# the current names, and those of torch < 2.6 (still present as aliases in some versions)
_PER_FUNCTION = ("recompile_limit", "cache_size_limit")
_ACCUMULATED = ("accumulated_recompile_limit", "accumulated_cache_size_limit")


@contextlib.contextmanager
def recompile_limit_for(num_sizes: int) -> Iterator[None]:
    """Within the block, dynamo may compile a function `num_sizes` more times than its default allows."""
    if num_sizes <= 0:
        yield
        return
    import torch._dynamo.config as dynamo_config

    patch = {}
    for names in (_PER_FUNCTION, _ACCUMULATED):
        for name in names:
            if hasattr(dynamo_config, name):
                patch[name] = getattr(dynamo_config, name) + num_sizes
    with dynamo_config.patch(patch):
        yield
