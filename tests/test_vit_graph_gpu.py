"""Vision-encoder graphs on the GPU at real shapes (dummy weights, bf16, the qwen2.5-vl-3b and qwen3-vl-2b
towers): graph replay equals the eager tower bit for bit, for other image splits of the same total too, and
padded batches stay within bf16 rounding of eager. Skipped without CUDA."""

import pytest
import torch

from ostinato.graphs.vit import VitGraphRunner, padded_patches

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("own_graph_pool")]  # conftest: each test's runner captures into a new pool

# (t, h, w) patch grids of 1024 patches (a key of its own: no padding), split four ways
SPLITS = [[(1, 32, 32)], [(1, 32, 16), (1, 16, 32)], [(1, 16, 16)] * 4, [(1, 8, 64), (1, 16, 24), (1, 8, 16)]]


def make_tower(preset: str):
    from transformers import AutoConfig

    from ostinato.loader import dummy_init_
    from ostinato.loader.dummy import preset_path
    from ostinato.models.registry import model_class

    cfg = AutoConfig.from_pretrained(preset_path(preset))
    tower_cls = model_class(cfg).tower_cls
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            tower = tower_cls(cfg.vision_config)
    finally:
        torch.set_default_dtype(default)
    tower.to("cuda")  # the rotary's inv_freq stays float32
    dummy_init_(tower, seed=0)
    return tower.eval()


@pytest.fixture(scope="module", params=["qwen2.5-vl-3b", "qwen3-vl-2b"])
def tower(request):
    tower = make_tower(request.param)
    yield tower
    del tower
    torch.cuda.empty_cache()


def pixels(tower, grids, seed):
    cfg = tower.cfg
    n = sum(t * h * w for t, h, w in grids)
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)


def test_graph_equals_eager_bit_for_bit(tower):
    assert all(sum(h * w for _, h, w in g) == 1024 for g in SPLITS) and padded_patches(1024) == 1024
    r = VitGraphRunner(tower, torch.device("cuda"), max_bytes=8 << 30, max_patches=1 << 16)
    with torch.inference_mode():
        for i, grids in enumerate(SPLITS * 2):
            x = pixels(tower, grids, i)
            ref = tower(x, grids)
            out = r.encode(x, grids)
            for o, e in zip(out, ref, strict=True):
                assert (o is None) == (e is None)
                if e is not None:
                    assert torch.equal(o, e), f"split {grids}: max diff {(o.float() - e.float()).abs().max().item()}"
    assert r.stats.captures == 1 and r.stats.replays == 2 * len(SPLITS) - 1
    print(f"capture {r.stats.capture_ms} ms, graph memory {r.stats.graph_bytes} bytes")


def test_padded_batches_match_eager(tower):
    r = VitGraphRunner(tower, torch.device("cuda"), max_bytes=8 << 30, max_patches=1 << 16, capture_on_sight=1)
    with torch.inference_mode():
        cases = [[(1, 30, 20), (1, 10, 14)], [(1, 20, 30), (1, 14, 10)], [(1, 16, 16), (1, 16, 16), (1, 14, 14)]]
        for i, grids in enumerate(cases):
            x = pixels(tower, grids, 10 + i)
            ref = tower(x, grids)
            out = r.encode(x, grids)
            for o, e in zip(out, ref, strict=True):
                if e is not None:
                    err = ((o.float() - e.float()).abs().max() / e.float().abs().max()).item()
                    assert err < 2e-2, f"{grids}: relative error {err}"
    assert r.stats.captures == 1  # 740, 740 and 708 patches share the 768 key
