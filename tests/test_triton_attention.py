"""The Triton backend against the torch backend on the same pool contents.

Without a GPU the kernels run in Triton's interpreter at tiny shapes (fp32); with one, at model shapes
in bf16 against the torch backend computed in fp32.
"""

import bisect
import importlib
import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402

from ostinato.attention.base import AttentionSpec  # noqa: E402
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from ostinato.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.mem.kv_cache import MHATokenToKVPool  # noqa: E402
from ostinato.mem.kv_manager import KVManager  # noqa: E402
from ostinato.mem.req_to_token_pool import ReqToTokenPool  # noqa: E402
from ostinato.mem.token_allocator import TokenToKVPoolAllocator  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TINY_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tiny fp32 cases run on the GPU when there is one


@dataclass
class Env:
    kv: KVManager
    cache: MHATokenToKVPool
    tri: TritonAttentionBackend
    ref: TorchAttentionBackend
    spec: AttentionSpec
    gen: torch.Generator
    device: str
    dtype: torch.dtype


def make_env(page: int, heads: int, kv_heads: int, dim: int, *, dtype=torch.float32, device=TINY_DEVICE,
             slots=1024, max_reqs=8, max_ctx=128, seed=0, small_blocks=True, cache_dtype=None,
             head_major=None) -> Env:
    gen = torch.Generator(device).manual_seed(seed)
    req_pool = ReqToTokenPool(max_reqs, max_ctx, device)
    cache = MHATokenToKVPool(slots, cache_dtype or dtype, kv_heads, dim, 1, device, head_major=head_major)
    alloc = TokenToKVPoolAllocator(slots, page, device, cache.layout)  # fp8: slot numbers in groups (SlotLayout)
    # hand pages out in a random order, so a request's slots are scattered over the pool
    alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), generator=gen, device=device)]
    tri = TritonAttentionBackend(req_pool, cache, num_heads=heads, page_size=page)
    tri.num_sms = 132  # an H200's, for the split counts these tests expect (off CUDA the backend assumes fewer)
    if small_blocks:  # the interpreter's shapes: several blocks and splits per request
        tri.decode_block_n = tri.extend_block_m = tri.extend_block_n = 16
        tri.min_tokens_per_split = 16
        # the tuned entries' kernel settings, but these blocks, the default split rule (two programs an SM) and
        # combine_min_bs's rule for where stage 1 combines (tests set it)
        tri.decode_table = {bs: {k: v for k, v in e.items()
                                 if k not in ("block_n", "programs_per_sm", "min_tokens_per_split", "combine")}
                            for bs, e in tri.decode_table.items()}
    spec = AttentionSpec(0, heads, kv_heads, dim, dim**-0.5)
    return Env(KVManager(req_pool, alloc), cache, tri, TorchAttentionBackend(req_pool, cache), spec, gen, device,
               dtype)


def randn(env: Env, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=env.gen, device=env.device, dtype=torch.float32).to(env.dtype)


def new_requests(env: Env, prefix_lens: list[int]) -> list[int]:
    """Allocate a row per request and fill its cached prefix with random K/V."""
    rows = []
    for p in prefix_lens:
        row = env.kv.req_pool.alloc()
        if p:
            loc = env.kv.extend(row, 0, p)
            env.cache.set_kv_buffer(0, loc, randn(env, p, env.spec.num_kv_heads, env.spec.head_dim),
                                    randn(env, p, env.spec.num_kv_heads, env.spec.head_dim))
        rows.append(row)
    return rows


def make_batch(env: Env, mode: ForwardMode, rows: list[int], prefix: list[int], new: list[int]) -> ForwardBatch:
    locs = [env.kv.extend(r, p, p + n) for r, p, n in zip(rows, prefix, new, strict=True)]
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    t, dev = sum(new), env.device
    return ForwardBatch(
        mode, len(rows), torch.zeros(t, dtype=torch.int64, device=dev), torch.zeros(t, dtype=torch.int64, device=dev),
        torch.tensor(rows, device=dev), torch.tensor(seq, dtype=torch.int32, device=dev), torch.cat(locs),
        torch.tensor(new, device=dev).cumsum(0) - 1, seq, list(prefix), list(new),
    )


def qkv(env: Env, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, hk, d = env.spec.num_heads, env.spec.num_kv_heads, env.spec.head_dim
    return randn(env, t, h, d), randn(env, t, hk, d), randn(env, t, hk, d)


def run_triton(env: Env, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    env.tri.init_forward_metadata(batch)
    s = env.spec
    out = env.tri.forward(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), s, batch)
    return out.view(-1, s.num_heads, s.head_dim)


def run_reference(env: Env, batch: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """The torch backend in fp32 over the pool as it is now (the new K/V already stored)."""
    env.ref.init_forward_metadata(batch)
    if batch.mode is ForwardMode.DECODE:
        return env.ref.forward_decode(q.float(), env.spec, batch)
    return env.ref.forward_extend(q.float(), env.spec, batch)


def check(env: Env, batch: ForwardBatch, out: torch.Tensor, q: torch.Tensor, atol: float) -> None:
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = run_reference(env, batch, q)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


def check_stored(env: Env, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    k_buf, v_buf = env.cache.get_kv_buffer(0)
    assert torch.equal(k_buf[batch.out_cache_loc].float(), k.to(env.cache.dtype).float())
    assert torch.equal(v_buf[batch.out_cache_loc].float(), v.to(env.cache.dtype).float())


# ---------------------------------------------------------------- tiny shapes, fp32 (the interpreter on a CPU)
def test_store_kv_casts_to_cache_dtype():
    env = make_env(4, 4, 2, 16, dtype=torch.float16)
    rows = new_requests(env, [0, 0])
    batch = make_batch(env, ForwardMode.EXTEND, rows, [0, 0], [7, 5])
    k, v = randn(env, 12, 2, 16), randn(env, 12, 2, 16)  # fp32 into an fp16 cache
    env.tri.store_kv(0, batch.out_cache_loc, k, v)
    check_stored(env, batch, k, v)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("combine", [False, True])
def test_decode_matches_torch(page, group, combine):
    """combine: the splits combined by each request's last split program (the backend's rule for large batches,
    here from 1 row) instead of stage 2."""
    env = make_env(page, 2 * group, 2, 32 if group == 2 else 16, seed=page * 10 + group)
    env.tri.combine_min_bs = 1 if combine else 10**9
    prefix = [0, 16, 79, 44]  # seq lens 1, 17 (2 splits), 80 (5 splits), 45
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1] * 4)
    q, k, v = qkv(env, 4)
    out = run_triton(env, batch, q, k, v)
    assert not env.tri.decode_counters.any()
    check_stored(env, batch, k, v)
    assert env.tri.num_kv_splits.tolist() == [1, 2, 5, 3]
    check(env, batch, out, q, atol=1e-4)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("page", [1, 4])
def test_kv_layouts_give_the_same_bits(mode, page):
    """A token-major and a head-major pool (the kernels take the buffers' strides) hold the same K/V and give the
    same output bits, with the same requests, pages and inputs."""
    outs, stored = [], []
    for head_major in (False, True):
        env = make_env(page, 4, 2, 16, seed=page + 3, head_major=head_major)
        k_buf, _ = env.cache.get_kv_buffer(0)
        assert (k_buf.stride(0), k_buf.stride(1)) == ((16, k_buf.shape[0] * 16) if head_major else (32, 16))
        prefix, new = ([0, 16, 79], [1, 1, 1]) if mode is ForwardMode.DECODE else ([0, 21, 50], [37, 19, 1])
        rows = new_requests(env, prefix)
        batch = make_batch(env, mode, rows, prefix, new)
        q, k, v = qkv(env, sum(new))
        outs.append(run_triton(env, batch, q, k, v))
        stored.append([b.clone() for b in env.cache.get_kv_buffer(0)])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(stored[0], stored[1], strict=True))


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("head_major", [False, True])
def test_int32_offsets_give_the_int64_bits(monkeypatch, page, head_major):
    """Stage 1 addresses K/V rows with int32 offsets where the cache allows (decode_attention.OFFS32): the same
    output bits as with int64 offsets, for whole and partial key blocks."""
    da = importlib.import_module("ostinato.attention.triton_ops.decode_attention")  # the package's is the function

    outs = []
    for offs32 in (True, False):
        monkeypatch.setattr(da, "OFFS32", offs32)
        env = make_env(page, 4, 2, 16, seed=page + 7, head_major=head_major)
        assert da.int32_offsets(*env.cache.get_kv_buffer(0))
        prefix = [0, 16, 79, 44]
        batch = make_batch(env, ForwardMode.DECODE, new_requests(env, prefix), prefix, [1] * 4)
        q, k, v = qkv(env, 4)
        outs.append(run_triton(env, batch, q, k, v))
        check(env, batch, outs[-1], q, atol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_int32_offsets_refuse_a_cache_past_two_to_the_31():
    from ostinato.attention.triton_ops.decode_attention import int32_offsets

    small = torch.empty(2**20, 8, 128, device="meta")  # 2**30 elements: the last at offset 2**30 - 1
    assert int32_offsets(small, small)
    big = torch.empty(2**21 + 1, 8, 128, device="meta")
    assert not int32_offsets(small, big)
    exact = torch.empty(8, 2**21, 128, device="meta").transpose(0, 1)  # [slots, heads, dim], heads outermost
    assert exact.stride(1) == 2**28 and int32_offsets(exact)  # 2**31 elements: the last at offset 2**31 - 1
    assert not int32_offsets(torch.empty(8, 2**21 + 1, 128, device="meta").transpose(0, 1))
    assert int32_offsets(torch.empty(0, 8, 128, device="meta"))


def test_one_split_combined_in_stage1_gives_stage2_bits():
    """A request of one split writes its output straight from stage 1 when combining there (no scratch, no count):
    the bits stage 2 would have written, its one split weighted by exactly 1."""
    env = make_env(1, 4, 2, 16, seed=11)
    prefix = [5, 40, 0]  # 1, 3 and 1 splits
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1] * 3)
    q, k, v = qkv(env, 3)
    outs = []
    for combine_min_bs in (1, 10**9):  # the same step twice (its K/V stored again, unchanged)
        env.tri.combine_min_bs = combine_min_bs
        outs.append(run_triton(env, batch, q, k, v))
        assert not env.tri.decode_counters.any()
    assert env.tri.num_kv_splits.tolist() == [1, 3, 1]
    assert torch.equal(outs[0][[0, 2]], outs[1][[0, 2]])
    check(env, batch, outs[0], q, atol=1e-4)


def test_decode_clamped_splits_with_empty_tail():
    env = make_env(4, 4, 2, 16, seed=3)
    env.tri.max_kv_splits = 4  # seq len 80 -> 4 splits of 32 tokens: the last one is empty
    rows = new_requests(env, [79, 9])
    batch = make_batch(env, ForwardMode.DECODE, rows, [79, 9], [1, 1])
    q, k, v = qkv(env, 2)
    out = run_triton(env, batch, q, k, v)
    assert env.tri.num_kv_splits.tolist() == [4, 1]
    check(env, batch, out, q, atol=1e-4)


def test_decode_split_cap_follows_batch_size():
    """Few SMs per request: the cap drops to one split (a grid with one program per request and KV head)."""
    env = make_env(4, 4, 2, 16, seed=4)
    assert env.tri.kv_splits_cap(1) == env.tri.max_kv_splits
    env.tri.num_sms = 4  # 2 * 4 programs wanted, 4 requests x 2 KV heads already give them
    assert env.tri.kv_splits_cap(4) == env.tri.kv_splits_cap(3) == 1 and env.tri.kv_splits_cap(2) == 2
    prefix = [40, 3, 77, 20]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1] * 4)
    q, k, v = qkv(env, 4)
    out = run_triton(env, batch, q, k, v)
    assert env.tri.num_kv_splits.tolist() == [1, 1, 1, 1]
    check(env, batch, out, q, atol=1e-4)


def test_decode_settings_table_by_head_dim():
    """The backend reads the table of its KV dtype and head dim (the largest dim at or below its own, else the
    smallest), and a bf16 entry's blocks and split knobs apply: the output still equals the torch backend's."""
    tables = TritonAttentionBackend.decode_tables
    for fp8 in (False, True):
        dims = sorted(d for f, d in tables if f == fp8)
        assert TritonAttentionBackend.decode_table_for(dims[0] // 2, fp8) is tables[(fp8, dims[0])]
        for d in dims:
            assert TritonAttentionBackend.decode_table_for(d, fp8) is tables[(fp8, d)]
            assert TritonAttentionBackend.decode_table_for(d + 16, fp8) is tables[(fp8, d)]
    env = make_env(1, 4, 2, 16, seed=5, small_blocks=False)
    assert env.tri.decode_table is TritonAttentionBackend.decode_table_for(16, False)
    env.tri.decode_table = {1: dict(block_n=16, num_warps=1, num_stages=1, whole_blocks=True, programs_per_sm=8,
                                    min_tokens_per_split=16)}
    assert env.tri.kv_splits_cap(2) == env.tri.max_kv_splits and env.tri._min_tokens_per_split(2) == 16
    prefix = [44, 8]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1, 1])
    q, k, v = qkv(env, 2)
    out = run_triton(env, batch, q, k, v)
    assert env.tri.num_kv_splits.tolist() == [3, 1]
    check(env, batch, out, q, atol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_every_tuned_decode_entry_matches_torch(fp8):
    """Every distinct entry of the tuned decode tables (blocks, warps, stages, fp8 variant, split knobs) gives the
    torch backend's output at its head dim, with the splits combined in stage 1 and with stage 2: a table edit
    that breaks a setting fails here, not on the GPU."""
    entries = {repr(sorted((k, v) for k, v in e.items() if k != "combine")) + str(dim): (dim, e)
               for (f, dim), table in TritonAttentionBackend.decode_tables.items() if f == fp8 for e in table.values()}
    for i, (dim, entry) in enumerate(entries.values()):
        # fp16 queries: an fp8 entry's fp16 dots apply (fp32 queries skip them)
        env = make_env(1, 4, 2, dim, seed=40 + i, small_blocks=False, max_ctx=256,
                       dtype=torch.float16 if fp8 else torch.float32,
                       cache_dtype=torch.float8_e4m3fn if fp8 else None)
        if fp8:
            env.cache.set_scales({0: (0.5, 2.5)})
        env.tri.num_sms = 8  # the entry's split knobs still give several splits; a smaller grid for the interpreter
        prefix = [0, 70, 200]
        rows = new_requests(env, prefix)
        batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1] * 3)
        q, k, v = qkv(env, 3)
        for combine in (True, False):  # the same step twice (its K/V stored again, unchanged)
            env.tri.decode_table = {1: entry | dict(combine=combine)}
            out = run_triton(env, batch, q, k, v)
            assert not env.tri.decode_counters.any() and env.tri.num_kv_splits.max() > 1
            check(env, batch, out, q, atol=2e-2 if fp8 else 1e-4)


@pytest.mark.parametrize("num_sms", [8, 78, 132])
def test_padding_to_a_captured_size_keeps_the_split_cap(num_sms):
    """What makes a padded replay bitwise equal to eager: the cap of bs and of its padded size agree."""
    from ostinato.graphs.decode import capture_batch_sizes

    env = make_env(4, 32, 8, 16, small_blocks=False)  # the tuned tables' split knobs
    env.tri.num_sms = num_sms
    sizes = capture_batch_sizes(None, 256, 256)
    for bs in range(1, 257):
        padded = sizes[bisect.bisect_left(sizes, bs)]
        assert env.tri.kv_splits_cap(bs) == env.tri.kv_splits_cap(padded), (bs, padded)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_extend_matches_torch(page, group):
    env = make_env(page, 2 * group, 2, 32 if group == 2 else 16, seed=page * 10 + group)
    prefix, new = [0, 21, 0, 50], [37, 19, 1, 30]  # with and without a cached prefix, odd chunk lengths
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    q, k, v = qkv(env, sum(new))
    out = run_triton(env, batch, q, k, v)
    check_stored(env, batch, k, v)
    check(env, batch, out, q, atol=1e-4)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("prefix,new", [
    ([0, 21, 40, 70, 33], [37, 19, 1, 1, 1]),  # a mixed step: prefill chunks, then decoding rows
    ([45, 3], [1, 1]),  # only 1-token rows
    ([0, 60], [1, 1]),  # a 1-token prompt among them
])
def test_mixed_step_decode_rows_match_torch(page, prefix, new):
    """The trailing 1-token rows of an extend step go through the split-KV decode kernel; with padding rows
    past the real tokens (as a piecewise graph pads), the real rows still equal the torch reference."""
    env = make_env(page, 4, 2, 16, seed=sum(prefix) + page)
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    t = sum(new)
    q, k, v = qkv(env, t)
    env.tri.init_forward_metadata(batch)
    assert env.tri.decode_tail == {5: 3, 2: 0}[len(new)]  # only 1-token rows: not a mixed step
    q2, k2, v2 = qkv(env, 5)  # padded rows (their K/V go to the sink slot 0): never read by the real rows
    q_pad, k_pad, v_pad = torch.cat([q, q2.fill_(1e4)]), torch.cat([k, k2]), torch.cat([v, v2])
    batch_padded = ForwardBatch(batch.mode, batch.batch_size, q_pad[:, 0, 0].long(), q_pad[:, 0, 0].long(),
                                batch.req_pool_indices, batch.seq_lens,
                                torch.cat([batch.out_cache_loc, torch.zeros(5, dtype=torch.int64,
                                                                            device=env.device)]),
                                batch.logits_indices, batch.seq_lens_cpu, batch.extend_prefix_lens_cpu,
                                batch.extend_seq_lens_cpu)
    s = env.spec
    out = env.tri.forward(q_pad.reshape(t + 5, -1), k_pad.reshape(t + 5, -1), v_pad.reshape(t + 5, -1), s,
                          batch_padded).view(-1, s.num_heads, s.head_dim)[:t]
    check(env, batch, out, q, atol=1e-4)


def decode_step(env: Env, rows: list[int], lens: list[int]) -> tuple[ForwardBatch, tuple]:
    """A decode batch of requests whose KV holds `lens` tokens, plus its fresh q/k/v."""
    batch = make_batch(env, ForwardMode.DECODE, rows, lens, [1] * len(rows))
    return batch, qkv(env, len(rows))


def graph_path(env: Env, max_bs: int, steps: list[tuple[ForwardBatch, tuple]], pad_to: int) -> list[torch.Tensor]:
    """Run decode steps through the graph path with static buffers padded to `pad_to` rows (padded rows:
    seq_len 1, req_pool_idx 0, loc 0, huge q/k/v). On CUDA the first step is captured and later steps are
    replays; on the CPU each step calls forward in graph mode. Returns the real rows' outputs."""
    s, dev = env.spec, env.device
    env.tri.init_cuda_graph_state(max_bs)
    rpi = torch.zeros(max_bs, dtype=torch.int64, device=dev)
    seq = torch.ones(max_bs, dtype=torch.int32, device=dev)
    loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
    q_in = torch.empty(max_bs, s.num_heads * s.head_dim, dtype=env.dtype, device=dev)
    k_in = torch.empty(max_bs, s.num_kv_heads * s.head_dim, dtype=env.dtype, device=dev)
    v_in = torch.empty(max_bs, s.num_kv_heads * s.head_dim, dtype=env.dtype, device=dev)
    static = ForwardBatch(ForwardMode.DECODE, pad_to, loc[:pad_to], loc[:pad_to], rpi[:pad_to], seq[:pad_to],
                          loc[:pad_to], torch.arange(pad_to, device=dev), [1] * pad_to)

    def run() -> torch.Tensor:  # as the decode graph runner's step: begin_graph_step, then the layers
        env.tri.begin_graph_step()
        return env.tri.forward(q_in[:pad_to], k_in[:pad_to], v_in[:pad_to], s, static)

    outs, graph, out = [], None, None
    for i, (batch, (q, k, v)) in enumerate(steps):
        n = batch.batch_size
        rpi[:n], seq[:n], loc[:n] = batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc
        q_in[:n], k_in[:n], v_in[:n] = q.flatten(1), k.flatten(1), v.flatten(1)
        rpi[n:], seq[n:], loc[n:] = 0, 1, 0  # the padded rows, as the graph runner fills them
        q_in[n:], k_in[n:], v_in[n:] = 1e4, 1e4, -1e4
        if i == 0:
            env.tri.init_forward_metadata_capture(pad_to, rpi, seq)
            if env.device == "cuda":
                # warm up (compiles the kernels) on a side stream, then capture
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = run()
        else:
            env.tri.init_forward_metadata_replay(pad_to, rpi, seq)
        if graph is not None:
            graph.replay()
        else:
            out = run()
        outs.append(out.view(pad_to, s.num_heads, s.head_dim)[:n].clone())
    return outs


def check_graph_path(env: Env, lens_a: list[int], lens_b: list[int], pad_to: int, max_bs: int, atol: float) -> None:
    rows = new_requests(env, lens_a)
    step_a = decode_step(env, rows, lens_a)
    # the next step: partly other requests, other lengths, another row count
    lens_b = [lens_a[0] + 1] + lens_b
    rows_b = [rows[0]] + new_requests(env, lens_b[1:])
    step_b = decode_step(env, rows_b, lens_b)
    outs = graph_path(env, max_bs, [step_a, step_b], pad_to)
    for (batch, (q, k, v)), out in zip([step_a, step_b], outs, strict=True):
        check_stored(env, batch, k, v)  # the real rows' K/V, not the padded rows' poison
        check(env, batch, out, q, atol=atol)
        eager = run_triton(env, batch, q, k, v)  # eager path, real rows only: bitwise the same
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_early_kv_where_the_table_asks_and_graph_passes_count_their_splits(monkeypatch):
    """Stage 1 reads its split bounds before its PDL wait wherever the table entry asks for it: eagerly (the splits
    counted at metadata time) and in graph mode at every layer, the first included, since the captured kernels
    count each request's splits from seq_lens themselves (num_kv_splits None, the entry's min_tokens_per_split)
    and no kernel inside the capture writes what they read."""
    import ostinato.attention.triton_backend as backend

    env = make_env(1, 4, 2, 16)
    rows = new_requests(env, [20, 7])
    batch, (q, k, v) = decode_step(env, rows, [20, 7])
    seen = []
    monkeypatch.setattr(backend, "decode_attention", lambda **kw: seen.append(
        (kw["early_kv"], kw["num_kv_splits"] is None, kw["min_tokens_per_split"])))
    table = {bs: dict(e) for bs, e in env.tri.decode_table.items()}
    table[1]["early_kv"] = True
    table[1]["min_tokens_per_split"] = 48
    env.tri.decode_table = table
    env.tri.init_forward_metadata(batch)
    env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)
    env.tri.init_cuda_graph_state(4)
    env.tri.init_forward_metadata_capture(2, batch.req_pool_indices, batch.seq_lens)
    env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)  # a pass's first layer
    env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)
    table[1]["early_kv"] = 3  # key blocks to ask L2 for
    env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)
    table[1]["early_kv"] = False
    env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)
    assert seen == [(True, False, None), (True, True, 48), (True, True, 48), (3, True, 48), (False, True, 48)]


def test_a_table_entry_decides_where_stage_1_combines(monkeypatch):
    """Stage 1 combines the splits (counters passed, no stage-2 launch) from combine_min_bs rows, unless the table
    entry the batch takes says `combine`; the key is not passed on to the kernel."""
    import ostinato.attention.triton_backend as backend

    env = make_env(1, 4, 2, 16)
    rows = new_requests(env, [20, 7])
    batch, (q, k, v) = decode_step(env, rows, [20, 7])
    seen = []
    monkeypatch.setattr(backend, "decode_attention",
                        lambda **kw: seen.append((kw["counters"] is not None, "combine" in kw)))
    table = {bs: dict(e) for bs, e in env.tri.decode_table.items()}
    env.tri.decode_table = table
    env.tri.init_forward_metadata(batch)
    for combine in (None, True, False):
        if combine is not None:
            table[1]["combine"] = combine
        for min_bs in (8, 1):
            env.tri.combine_min_bs = min_bs
            env.tri.forward(q.flatten(1), k.flatten(1), v.flatten(1), env.spec, batch)
    assert seen == [(False, False), (True, False), (True, False), (True, False), (False, False), (False, False)]


def test_graph_path_follows_buffers_and_ignores_padded_rows():
    env = make_env(4, 8, 2, 16, seed=7, max_reqs=6)
    check_graph_path(env, lens_a=[40, 3, 70], lens_b=[0, 22], pad_to=4, max_bs=5, atol=1e-4)


def test_balanced_split_counts():
    """balance: a split holds at least the mean length of the rows longer than 1 (a graph's padded rows hold 1),
    so one length for all keeps one split a request and only the longer requests split."""
    from ostinato.attention.triton_ops.decode_attention import compute_num_kv_splits

    gen = torch.Generator().manual_seed(3)
    for i in range(20):  # seq_lens int32 or int64 (the kernel counts in int64), batches past 128 rows
        n, min_tokens, cap = int(torch.randint(1, 250, (1,), generator=gen)), 16, 4
        dtype = (torch.int32, torch.int64)[i % 2]
        lens = torch.randint(2, 3000, (n,), generator=gen, dtype=dtype)
        pads = torch.ones(int(torch.randint(0, 8, (1,), generator=gen)), dtype=dtype)
        out = torch.empty(n + len(pads), dtype=torch.int32, device=TINY_DEVICE)
        compute_num_kv_splits(torch.cat([lens, pads]).to(TINY_DEVICE), out, min_tokens, cap, balance=True)
        per = max(min_tokens, -(-int(lens.sum()) // n))
        assert out.tolist() == [min(cap, max(1, -(-t // per))) for t in lens.tolist()] + [1] * len(pads)
    out = torch.empty(8, dtype=torch.int32, device=TINY_DEVICE)
    same = torch.full((8,), 1025, dtype=torch.int32, device=TINY_DEVICE)
    compute_num_kv_splits(same, out, 16, 4, balance=True)
    assert out.tolist() == [1] * 8
    compute_num_kv_splits(same, out, 16, 4)
    assert out.tolist() == [4] * 8  # the plain rule: ceil(1025 / 16), capped


def test_balancing_entry_matches_torch_eagerly_and_through_the_graph_path():
    """A table entry with `balance`: the long request alone splits (3 splits, where the plain rule gives it 6),
    the output matches torch, and the graph path (begin_graph_step counting the splits, padded rows) gives the
    eager pass's bits."""
    env = make_env(4, 8, 2, 16, seed=11, max_reqs=12)
    env.tri.decode_table = {bs: e | {"balance": True} for bs, e in env.tri.decode_table.items()}
    rows = new_requests(env, [90, 10, 12, 8])
    batch, (q, k, v) = decode_step(env, rows, [90, 10, 12, 8])
    out = run_triton(env, batch, q, k, v)
    assert env.tri.num_kv_splits.tolist() == [3, 1, 1, 1]  # seq_lens 91, 11, 13, 9: a split >= their mean, 31
    check_stored(env, batch, k, v)
    check(env, batch, out, q, atol=1e-4)
    check_graph_path(env, lens_a=[60, 5, 9], lens_b=[3, 40], pad_to=4, max_bs=6, atol=1e-4)


# ---------------------------------------------------------------- CUDA at model shapes, bf16
SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3": (16, 8, 128)}


def cuda_env(page: int, shape: str, seed: int, slots: int = 64 * 4096 + 4096, max_reqs: int = 72,
             cache_dtype: torch.dtype | None = None, head_major: bool | None = None) -> Env:
    heads, kv_heads, dim = SHAPES[shape]
    return make_env(page, heads, kv_heads, dim, dtype=torch.bfloat16, device="cuda", slots=slots,
                    max_reqs=max_reqs, max_ctx=4096 + 32, seed=seed, small_blocks=False, cache_dtype=cache_dtype,
                    head_major=head_major)


@cuda
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bs", [1, 7, 64])
@pytest.mark.parametrize("head_major", [False, True])
def test_cuda_decode_matches_torch(page, shape, bs, head_major):
    env = cuda_env(page, shape, seed=bs + page, head_major=head_major)
    lens = torch.randint(1, 4096, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
    lens[0] = 4095  # seq len 4096: all 16 splits
    if bs > 1:
        lens[1] = 0  # seq len 1
    rows = new_requests(env, lens)
    batch, (q, k, v) = decode_step(env, rows, lens)
    out = run_triton(env, batch, q, k, v)
    check_stored(env, batch, k, v)
    check(env, batch, out, q, atol=2e-2)


@cuda
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_extend_matches_torch(page, shape):
    env = cuda_env(page, shape, seed=page, slots=16 * 4096, max_reqs=8)
    prefix = [0, 0, 1000, 3000, 17, 0, 2048, 511]
    new = [1, 4096, 333, 1096, 1, 700, 64, 129]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    q, k, v = qkv(env, sum(new))
    out = run_triton(env, batch, q, k, v)
    check_stored(env, batch, k, v)
    check(env, batch, out, q, atol=2e-2)


@cuda
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_graph_path(page, shape):
    env = cuda_env(page, shape, seed=5, slots=80 * 4096, max_reqs=80)
    gen = torch.Generator().manual_seed(page)
    lens_a = torch.randint(1, 4000, (40,), generator=gen).tolist()
    lens_b = torch.randint(0, 4000, (35,), generator=gen).tolist()  # 36 rows: 36, 40 and 48 share a cap
    check_graph_path(env, lens_a=lens_a, lens_b=lens_b, pad_to=48, max_bs=64, atol=2e-2)


@cuda
def test_cuda_fp8_cache():
    """An fp8 cache: the store falls back to the cache's own cast, the kernels read fp8 and upcast."""
    env = cuda_env(16, "qwen3", seed=9, slots=16 * 4096, max_reqs=8, cache_dtype=torch.float8_e4m3fn)
    prefix, new = [0, 700, 3000], [300, 129, 1]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    q, k, v = qkv(env, sum(new))
    out = run_triton(env, batch, q, k, v)
    check_stored(env, batch, k, v)
    check(env, batch, out, q, atol=2e-2)
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    batch, (q, k, v) = decode_step(env, rows, lens)
    check(env, batch, run_triton(env, batch, q, k, v), q, atol=2e-2)
