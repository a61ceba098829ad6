"""The vision-encoder graph runner through the CPU Graph stand-in (which re-runs the captured step over the same
static buffers): replays equal the eager tower, for equal totals with other image splits (SGLang's stale
`cu_seqlens` bug), padded batches, eviction and recapture; tiny random Qwen2.5-VL and Qwen3-VL towers."""

import pytest
import torch

from ostinato.graphs.vit import VitGraphRunner, padded_patches
from ostinato.models.vision import Qwen2_5_VisionTower, Qwen3_VisionTower

VISION = {
    # window 56 px = 2x2 merged tokens per window; block 1 is full attention
    "qwen2.5-vl": (Qwen2_5_VisionTower, "Qwen2_5_VLConfig", dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], in_channels=3)),
    "qwen3-vl": (Qwen3_VisionTower, "Qwen3VLConfig", dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        in_channels=3)),
}
# (t, h, w) patch grids: A and B have the same total (48 patches) split differently, C another total
A = [(1, 4, 8), (1, 4, 4)]
B = [(1, 6, 4), (1, 2, 2), (1, 4, 4), (1, 2, 2)]  # 24 + 4 + 16 + 4
C = [(1, 6, 6), (1, 2, 4)]


@pytest.fixture(scope="module", params=list(VISION))
def tower(request):
    import transformers

    cls, config_name, vision = VISION[request.param]
    cfg = getattr(transformers, config_name)(vision_config=vision).vision_config
    torch.manual_seed(0)
    tower = cls(cfg).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0
        for name, p in tower.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return tower


def pixels(tower, grids, seed: int) -> torch.Tensor:
    cfg = tower.cfg
    n = sum(t * h * w for t, h, w in grids)
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def eager(tower, grids, seed):
    with torch.inference_mode():
        return tower(pixels(tower, grids, seed), grids)


def check(out, ref, exact: bool = True):
    for o, r in zip(out, ref, strict=True):
        if r is None:
            assert o is None
        elif exact:
            assert torch.equal(o, r), (o - r).abs().max().item()
        else:
            assert torch.allclose(o, r, atol=1e-5, rtol=1e-5), (o - r).abs().max().item()


def runner(tower, **kw) -> VitGraphRunner:
    kw = {"max_bytes": 1 << 30, "max_patches": 1 << 20, "granularity": 4} | kw
    return VitGraphRunner(tower, torch.device("cpu"), **kw)


def test_replay_equals_eager_for_other_splits_of_the_same_total(tower):
    assert sum(h * w for _, h, w in A) == sum(h * w for _, h, w in B) == 48
    r = runner(tower)
    check(r.encode(pixels(tower, A, 0), A), eager(tower, A, 0))  # first sight: eager, nothing captured
    assert (r.stats.eager, r.stats.captures) == (1, 0)
    check(r.encode(pixels(tower, A, 1), A), eager(tower, A, 1))  # second sight: captured and replayed
    assert (r.stats.captures, r.stats.replays) == (1, 1) and list(r.entries) == [48]
    check(r.encode(pixels(tower, B, 2), B), eager(tower, B, 2))  # same key, other split: its own segments
    check(r.encode(pixels(tower, A, 3), A), eager(tower, A, 3))
    assert (r.stats.captures, r.stats.replays) == (1, 3)
    assert r.stats.capture_ms[48] > 0 and r.stats.graph_bytes[48] > 0


def test_frozen_metadata_would_be_wrong(tower, monkeypatch):
    """The check above can fail: a runner that keeps the captured cu_seqlens (SGLang's bug) replays B wrongly."""
    r = runner(tower, capture_on_sight=1)
    r.encode(pixels(tower, A, 0), A)
    monkeypatch.setattr(r, "_cu", lambda cu, buf: None)
    out = r.encode(pixels(tower, B, 2), B)
    assert not torch.equal(out[0], eager(tower, B, 2)[0])


def test_padded_batches_and_stale_padding(tower):
    """Default keys pad to 64 patches: a larger batch fills the padding rows, then a smaller one of the same key
    replays over them; both match eager (to fp32 rounding: the padded matmuls have more rows)."""
    r = runner(tower, granularity=None, capture_on_sight=1)
    assert padded_patches(52) == padded_patches(48) == 64
    check(r.encode(pixels(tower, C, 4), C), eager(tower, C, 4), exact=False)  # 44 patches
    check(r.encode(pixels(tower, B, 5), B), eager(tower, B, 5), exact=False)  # 48
    check(r.encode(pixels(tower, [(1, 2, 2)], 6), [(1, 2, 2)]), eager(tower, [(1, 2, 2)], 6), exact=False)
    assert r.stats.captures == 1 and r.stats.replays == 3 and list(r.entries) == [64]


def test_eviction_then_recapture(tower):
    """A cap that holds one graph: capturing a second key evicts the first; the first comes back on its next
    sight (an evicted key was in use, so it is captured again at once) and still equals eager."""
    probe = runner(tower, capture_on_sight=1)
    probe.encode(pixels(tower, A, 0), A)
    one = probe.stats.graph_bytes[48]
    r = runner(tower, max_bytes=one + one // 4)
    for seed in (0, 1):
        r.encode(pixels(tower, A, seed), A)
    for seed in (2, 3):
        check(r.encode(pixels(tower, C, seed), C), eager(tower, C, seed))
    assert list(r.entries) == [44] and r.stats.evictions == 1 and r.graph_bytes <= r.max_bytes
    check(r.encode(pixels(tower, B, 4), B), eager(tower, B, 4))  # key 48 recaptured on its first sight back
    assert r.stats.captures == 3 and list(r.entries) == [48] and r.stats.evictions == 2


def test_over_the_size_limit_runs_eagerly(tower):
    r = runner(tower, max_patches=40, capture_on_sight=1)
    for seed in (0, 1):
        check(r.encode(pixels(tower, A, seed), A), eager(tower, A, seed))
    assert r.stats.captures == 0 and r.stats.eager == 2


def test_flags_are_checked():
    from ostinato.config import EngineArgs

    for field in ("vit_cuda_graph_max_mb", "vit_cuda_graph_max_patches"):
        with pytest.raises(ValueError, match=field):
            EngineArgs(**{field: 0})


def test_engine_with_vit_graphs_gives_the_eager_tokens(tmp_path):
    """Through LLM.generate: the runner's encoder goes through the graph runner (captured on the second sight of a
    size, replayed on the third) and the greedy tokens equal those of an engine without it."""
    pytest.importorskip("PIL")
    from ostinato import LLM, SamplingParams
    from tests.vlm_models import image, make_qwen2_5_vl

    path = make_qwen2_5_vl(str(tmp_path / "q25"))
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    # three prompts, each with two images of the same sizes in another order: equal totals, other splits
    prompts = [{"prompt": f"<|im_start|>user\n{ph} and {ph} compare<|im_end|>\n<|im_start|>assistant\n",
                "multi_modal_data": {"image": [image(*sizes[0], i), image(*sizes[1], i + 10)]}}
               for i, sizes in enumerate([((120, 60), (60, 60)), ((60, 60), (120, 60)), ((120, 60), (60, 60))])]
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    outs = {}
    for flag in (False, True):
        llm = LLM(path, dtype="float32", device="cpu", max_total_tokens=1024, enable_vit_cuda_graph=flag)
        outs[flag] = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        if flag:
            stats = llm.engine.runner.vit_graph_runner.stats
            assert (stats.eager, stats.captures, stats.replays) == (1, 1, 2)
        llm.shutdown()
    assert outs[True] == outs[False]
