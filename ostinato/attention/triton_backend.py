"""Attention in Triton kernels over the paged cache: a one-launch K/V store, split-KV decode that a CUDA
graph can capture, and causal extend over the cached prefix plus the new tokens."""

import itertools
import os

import torch

from ostinato.attention.base import AttentionBackend, AttentionSpec, Rope
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode, mixed_decode_rows
from ostinato.attention.triton_ops import decode_attention, extend_attention, rope_store_kv, store_kv
from ostinato.attention.triton_ops.decode_attention import (
    NewTokens,
    compute_num_kv_splits,
    decode_kwargs,
    table_entry,
)
from ostinato.attention.triton_ops.extend_attention import extend_block_table, max_extend_blocks
from ostinato.mem.kv_cache import KVCache
from ostinato.mem.req_to_token_pool import ReqToTokenPool


class TritonAttentionBackend(AttentionBackend):
    """Decode splits each request's KV into clamp(ceil(seq_len / min_tokens_per_split), 1, kv_splits_cap(bs))
    parts, counted on the device; the launch grid always has max_kv_splits in its split dimension.

    `num_heads` (the model's largest query-head count) sizes the graph path's scratch.
    """

    max_kv_splits = 16  # the grid's split dimension and the scratch depth
    cpu_num_sms = 8  # kv_splits_cap's SM count off CUDA (the interpreter): a lone request of 2 KV heads gets 8 splits
    # From combine_min_bs rows, each decode request's last split program combines the splits (no stage-2 launch;
    # counters all 0 between launches, one per batch row and KV head). H200, Llama-3.2-1B ms a step, stage 2 ->
    # combined: bs 8 x 128 1.060 -> 1.041, bs 16 x 1024 1.218 -> 1.194, bs 32 x 128 1.170 -> 1.156, bs 256 x
    # 1024 3.78 -> 3.67, fp8 cache bs 128 x 4096 4.17 -> 4.07, bs 32 x 4096 level; bs 1 slower (0.888 -> 0.894,
    # at 1,024 tokens 0.920 -> 0.938). A table entry's `combine` overrides the rule for its batch sizes (combined
    # at bs 3-7 at head dim 64 and 5-7 at 128; stage 2 for an fp8 cache at head dim 64 and 9-32 rows:
    # decode_tables). OSTINATO_DECODE_COMBINE=0: never.
    combine_min_bs = 8
    # Up to this many rows a decode step's stage 1 also does rope_store's work (rope_attend): one launch a layer
    # fewer. By head dim (decode_rope_max_bs_by_dim, else 4) unless decode_rope_max_bs overrides it for every dim.
    # Figures in docs/gpu-notes.md. H200: bs 1 x 128 Llama-3.2-1B 0.881 -> 0.865 ms a step, Qwen3-0.6B 0.761 ->
    # 0.745; taken up to 32 rows, Qwen3-0.6B (dim 128, q/k norm) was 1% slower at bs 8 and Llama-3.2-1B (dim 64)
    # 0.7% faster. H100, dim 64 up to 32 rows (Llama-3.2-1B): 0.5-1.2% faster steps at bs 8-32, but bf16 bs 16
    # (0.3% slower). Dim 64 up to 64 rows (H200, Llama-3.2-1B x 288 tokens, two runs each alternating,
    # decode-rope-cap-h200-20261126-s19.txt): bs 48 1.216 / 1.213 -> 1.209 / 1.207, bs 64 1.270 / 1.270 ->
    # 1.265 / 1.265. Dim 128 up to 32 rows in the same runs (Qwen3-0.6B): bs 8 0.929 / 0.926 -> 0.943 / 0.942,
    # bs 16 0.971 / 0.970 -> 0.960 / 0.958, bs 32 1.219 / 1.216 -> 1.213 / 1.213; not taken (slower at bs 8).
    decode_rope_max_bs: int | None = None
    decode_rope_max_bs_by_dim = {64: 64}
    min_tokens_per_split = 64  # one 64-key block: a split's programs then run a single loop iteration
    decode_block_n = 64
    # The decode kernel's launch settings, by KV dtype and head dim (decode_table_for), then by batch size: a
    # batch takes the entry of the largest key <= its next power of two (decode_attention.table_entry), so a
    # padded graph replay and an eager pass agree. An entry holds the kernel settings (block_n, warps, stages,
    # whole_blocks; for fp8 the variant, decode_attention.FP8_DECODE_VARIANTS) and may set the split knobs:
    # programs_per_sm (replaces kv_splits_cap's 2) and min_tokens_per_split (replaces the class's), `combine`
    # (whether stage 1 combines the splits at the entry's batch sizes, in place of combine_min_bs's rule), and maxnreg
    # (a register cap for ptxas, so more one-warp programs fit an SM), and early_kv (decode_attention's: stage 1
    # reads its split's bounds and asks L2 for its first key block, an int: that many, before its PDL wait), and
    # balance (compute_num_kv_splits': a split at least the batch's mean length, so at one length for all a request
    # keeps one split and only the longer ones split; counted once a step, by begin_graph_step in a captured one:
    # the bf16 head-dim-128 table's 256 entry). early_kv is on
    # where it measured faster (H100, `bench_decode.py ... --decode-entry "1:early_kv=True;...;256:early_kv=True"`
    # against OSTINATO_DECODE_EARLY_KV=0, decode-earlykv-*-h100-20261126-s17*.json, docs/gpu-notes.md); at bs 4-8,
    # Llama-3.2-1B's bs 128 and fp8 bs 256 it was slower (0.3-2.4%), and it is off where untimed. Four blocks at bs
    # 1 (Qwen3-0.6B 1 x 4096 1.337 / 1.204 / 1.152 ms for 1 / 2 / 4), one at bs 32. The final tables, GPU forward ms,
    # off -> on: Qwen3-0.6B bs 1 x 128 / 1024 / 4096 0.822 / 0.969 / 1.364 -> 0.822 / 0.898 / 1.159, bs 16 / 32 / 64
    # 1.088 / 1.231 / 1.576 -> 1.080 / 1.217 / 1.568; Llama-3.2-1B bs 1 x 1024 / 4096 1.111 / 1.203 -> 1.101 /
    # 1.187, bs 64 1.477 -> 1.467, bs 32 level.
    # A captured graph serves every context length of its batch size with one entry, so entries are chosen over
    # contexts 128, 1024 and 4096 together (least geometric-mean slowdown against each context's best:
    # `bench_decode_attention.py --robust`). Entries from 8 rows up come from the H200 sweep of 2026-11-26, run
    # with the kernel as the engine launches it (splits combined in stage 1, PDL);
    # benchmarks/results/decode-attention-robust-{64,128}-h200-20261126.json. Kernel us at contexts 128 / 1024 /
    # 4096, the entry before -> now: Llama-3.2-1B heads, fp8 bs 16 5.7 / 11.6 / 45.2 -> 5.2 / 11.5 / 32.4, bs 64
    # 7.1 / 31.6 / 106.4 -> 6.6 / 29.0 / 91.6, bs 128 12.0 / 54.3 / 182.1 -> 8.8 / 54.3 / 182.1; bf16 bs 16 5.7 /
    # 9.8 / 37.8 -> 4.9 / 9.0 / 38.2; Qwen3-0.6B heads, bf16 bs 16 5.8 / 26.8 / 85.8 -> 5.7 / 21.6 / 67.1. The
    # fp8 dim-128 rows were not reached in that sweep's time budget. The rest: head dim 64's bs 1 and 4 and head
    # dim 128's from the H100 sweep (decode-attention-robust-{64,128}-h100.json, contexts 128 / 1024 / 4096), and
    # bf16 bs 128 / 256 at dim 64 from the H200 sweep at one long context per batch size
    # (decode-attention-fp8-h200.json). fp8 bs 128 keeps 3 splits at 4,096 tokens (programs_per_sm 16), which
    # end to end took bs 128 x 4096 from 5.03 to 4.29 ms a step (H200; kv_splits_cap's 2 programs per SM gave 1).
    decode_tables: dict[tuple[bool, int], dict[int, dict]] = {
        # combine=True below combine_min_bs (bs 3-7 at head dim 64, 5-7 at 128, both caches). H200, bf16 cache, ms
        # a step, stage 2 (the table's first and last pass) -> combined: Llama-3.2-1B bs 3 x 128 0.967 / 0.969 ->
        # 0.954, bs 4 x 128
        # 0.981 / 0.980 -> 0.958, bs 4 x 1024 1.015 / 1.011 -> 0.996, bs 6 x 128 0.906 / 0.905 -> 0.897, bs 6 x
        # 1024 0.948 / 0.948 -> 0.938; Qwen3-0.6B bs 6 x 128 0.876 / 0.879 -> 0.855, x 1024 1.053 / 1.053 -> 1.027.
        # Slower at bs 2 (Llama 0.880 / 0.875 -> 0.898, Qwen3 0.760 / 0.756 -> 0.772) and at Qwen3's bs 3-4 (0.826
        # / 0.827 -> 0.845, 0.842 / 0.842 -> 0.863), which keep stage 2 (`bench_decode.py --models llama-3.2-1b
        # qwen3-0.6b --cases 2:128 3:128 4:128 4:1024 6:128 6:1024 --modes graph --no-launches --iters 100
        # --decode-entry table "4:combine=True;8:combine=True" "2:combine=True;4:combine=True;8:combine=True"
        # table`, decode-combine-small-h200-20261127-s23.json). fp8 caches the same way (`--kv-cache-dtype fp8_e4m3
        # --decode-entry table "4:combine=True;8:combine=True" table`, decode-combine-small-fp8-h200-20261127-s23
        # .json): Llama-3.2-1B bs 4 x 128 0.984 / 0.983 -> 0.965, x 1024 1.034 / 1.029 -> 1.004, bs 6 x 128 0.903 /
        # 0.900 -> 0.891, x 1024 0.932 / 0.927 -> 0.919; Qwen3-0.6B bs 6 x 128 0.888 / 0.887 -> 0.856, x 1024 1.027
        # / 1.026 -> 0.993, its bs 4 slower (0.854 / 0.851 -> 0.866, 0.961 / 0.960 -> 0.982).
        (False, 64): {
            1: dict(num_warps=2, num_stages=2, whole_blocks=True, early_kv=4),
            4: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, programs_per_sm=4,
                    min_tokens_per_split=32, combine=True),
            8: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, programs_per_sm=4, combine=True),
            16: dict(num_warps=1, num_stages=5, whole_blocks=True, programs_per_sm=4),
            32: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, early_kv=True),
            64: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, programs_per_sm=4,
                     min_tokens_per_split=128, early_kv=True),
            128: dict(num_warps=1, num_stages=2),
            256: dict(num_warps=2, num_stages=2, whole_blocks=True),
        },
        (True, 64): {
            # From 8 rows V is widened in its loaded layout (fp16_vcvt; paged_softmax's V_CVT), 3-14% faster
            # kernels than "fp16" at every batch size and context timed (H200, `bench_decode_entries.py --kv fp8`,
            # decode-entries-fp8-h200-20261126.json): bs 32 6.99 / 16.07 / 49.40 -> 6.23 / 14.15 / 43.56 us, bs
            # 256 13.88 / 84.08 / 300.61 -> 13.49 / 79.59 / 281.68. bs 1-2 and 5-7 were not timed with it.
            1: dict(variant="fp16", block_n=64, num_warps=4, num_stages=2, whole_blocks=True, early_kv=True),
            # 3-4 rows: fp16_vcvt and 5 stages (was "fp16", 2 stages): H200, Llama-3.2-1B, step ms at bs 3 x 4096
            # / 4 x 128 / 4 x 1024 / 4 x 4096 1.124 / 0.959 / 1.007 / 1.135 -> 1.029 / 0.954 / 0.982 / 1.041
            # (decode-fp8-bs4-llama-h200-20261127-s24.json); at bs 4 x 4096 the old entry had been slower than a
            # bf16 cache (1.127 against 1.084 ms, decode-wave-scan-h200-20261127-s24.json)
            4: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True, programs_per_sm=4,
                    min_tokens_per_split=32, combine=True),
            # programs_per_sm 4, not the sweep's pick of 8 (9 splits at bs 9-16, the same kernel time to 3%): with 8,
            # tests/test_fp8_kv.py's graph and eager engines parted in the last bits (see docs/gpu-notes.md)
            8: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True,
                    programs_per_sm=4, combine=True),
            # entry 8's settings at 9-16 rows, stage 2 merging the splits: H200, Llama-3.2-1B, step ms combined in
            # stage 1 -> stage 2, two passes each in one process: bs 12 x 128 / 1024 0.930 / 0.994 -> 0.921 / 0.978,
            # bs 16 x 128 / 1024 / 4096 0.934 / 1.017 / 1.273 -> 0.931 / 1.004 / 1.248
            # (decode-fp8-bs16-stage2-llama-3.2-1b-h200-20261127-s24.json)
            16: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True,
                     programs_per_sm=4, combine=False),
            # programs_per_sm 6 (4 splits at 32 rows, was 3): 1,024 one-warp programs, 7.8 an SM of the 13 its
            # 152 registers allow. H200, Llama-3.2-1B heads, kernel alone at contexts 1024 / 4096 / 8192, 3 -> 4
            # splits: 13.71 / 44.61 / 79.89 -> 13.40 / 40.13 / 78.82 us (6 and 8 splits slower); step at
            # bs 32 x 128 / 1024 / 4096 0.993 / 1.127 / 1.565 -> 0.994 / 1.117 / 1.501 ms
            # (decode-entries-splits-h200-20261127-s20.json, decode-bs32-fp8-splits-h200-20261127-s20.json).
            # Stage 2 merges the splits here (combine=False): H200, Llama-3.2-1B, step ms with the splits combined
            # in stage 1 -> stage 2, twice each in one process: bs 32 x 128 0.987 / 0.989 -> 0.976 / 0.975, x 1024
            # 1.109 / 1.107 -> 1.092 / 1.092, x 4096 1.472 / 1.473 -> 1.464 / 1.464
            # (decode-combine-llama-3.2-1b-fp8_e4m3-h200-20261127-s24.json; bf16 was level or slower with stage 2,
            # and keeps the rule)
            32: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True,
                     programs_per_sm=6, early_kv=True, combine=False),
            # 5 stages and 2 splits at 33-64 rows (was 2 stages, 3 splits): 1,024 programs again. H200, kernel
            # alone at 1024 / 4096 tokens 25.09 / 75.52 -> 22.62 / 67.88 us (decode-entries-fp8-bs64-h200-
            # 20261127-s20.json); step at bs 64 x 128 / 1024 / 4096 1.172 / 1.422 / 2.241 -> 1.145 / 1.386 / 2.104
            # ms (decode-bs64-fp8-entry-h200-20261127-s20.json, the table first and last)
            64: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True,
                     programs_per_sm=4),
            # 5 stages since fp8 caches went head-major (a head's slots one run): H200, Llama-3.2-1B, bs 128 at
            # contexts 128 / 1024 / 4096, kernel 8.15 / 47.35 / 156.15 -> 8.40 / 45.39 / 147.60 us
            # (`bench_decode_entries.py --kv fp8 --dims 64 --bs 32 128 256`, decode-entries-fp8-head-major-h200-
            # 20261126.json) and step 1.408 / 1.995 / 3.760 -> 1.438 / 1.947 / 3.505 ms (decode-fp8-bs128-stages-
            # h200-20261126.json, two runs each)
            # programs_per_sm 4 (was 16): one split a request at 65-128 rows, 1,024 programs in one wave, where 16
            # gave 3 splits, 3,072 programs, about 2.1 waves. H200, Llama-3.2-1B, step ms at bs 96 x 1024 / 128 x 128
            # / 128 x 1024 / 128 x 4096: 1.775 / 1.432 / 1.915 / 3.364 -> 1.630 / 1.339 / 1.795 / 3.296
            # (decode-fp8-bs128-splits-h200-20261127-s24.json)
            128: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=5, whole_blocks=True,
                      programs_per_sm=4),
            # the sweep's bs-256 pick (1 split, 3 stages) matched this entry's kernel time at 1,024 tokens but made
            # the step 11% slower end to end (bs 256 x 1024: 3.215 -> 3.572 ms, H200). Capped at 128 registers
            # (ptxas gave ~134-154) for 16 programs an SM instead of 12-15: kernel us at contexts 128 / 1024 / 4096,
            # 19.6 / 103.4 / 364.4 -> 14.4 / 85.8 / 305.8 (H200, docs/gpu-notes.md). One split a request at 256-511
            # rows (programs_per_sm 8, was 16: two splits), timed in the step (H200, Llama-3.2-1B, the table and
            # then this alternating, decode-bs256-fp8-pps8-h200-20261126-s19.json): bs 256 x 128 / 1024 / 4096
            # 1.795 / 2.774 / 6.034 and 1.789 / 2.778 / 6.045 -> 1.707 / 2.677 / 5.939 and 1.713 / 2.690 / 5.939 ms
            256: dict(variant="fp16_vcvt", block_n=32, num_warps=1, num_stages=2, whole_blocks=True,
                      programs_per_sm=8, min_tokens_per_split=128, maxnreg=128),
        },
        (False, 128): {
            1: dict(num_warps=4, num_stages=2, whole_blocks=True, early_kv=4),
            4: dict(num_warps=4, num_stages=2, whole_blocks=True, programs_per_sm=4),
            8: dict(num_warps=2, num_stages=2, whole_blocks=True, programs_per_sm=4, combine=True),
            16: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, min_tokens_per_split=32,
                     early_kv=True),
            32: dict(block_n=32, num_warps=1, num_stages=5, whole_blocks=True, early_kv=True),
            128: dict(block_n=32, num_warps=1, num_stages=3, whole_blocks=True),
            # entry 128's kernel, balanced at 129-256 rows (on 132 SMs up to 2 splits, only for requests longer than
            # the batch's mean): the offline shape's long requests no longer run on alone. H200, Qwen3-0.6B,
            # offline nano-vllm shape at T=0.6, in turns (table / this / table / programs_per_sm 32): 69.1 / 70.7 /
            # 69.5 / 70.8% of the floor, its 129-256-row steps 3.651 / 3.582 / 3.701 / 3.580 s. One context for
            # all, level: bs 256 x 1024 / 4096 and 200 x 2048, the table's second pass -> this, 8.093 / 27.672 /
            # 12.064 -> 8.081 / 27.656 / 12.024 ms (offline-balance256-h200-20261128-s43.log,
            # decode-balance256-uniform-h200-20261128-s43.json). Balanced at 65-128 rows too, those steps were 3%
            # slower and the one-context ones 0.1-0.9% (offline-balance-h200-20261128-s43.log)
            256: dict(block_n=32, num_warps=1, num_stages=3, whole_blocks=True, balance=True, programs_per_sm=16),
        },
        (True, 128): {
            # fp16_vcvt at bs 8-127: 1-3% faster kernels at bs 8, 32 and 64 (bs 64 9.73 / 42.07 / 143.87 -> 9.63
            # / 41.71 / 140.50 us), 1-5% slower at bs 128 and 256, which keep "fp16" (same file as above)
            # the sweep's pick (128-key blocks) was 12% slower at context 128, faster only past 1024
            # 1-2 rows: 3 stages (was 2): H200, Qwen3-0.6B, step ms at bs 1 x 128 / 1 x 1024 / 1 x 4096 / 2 x 4096
            # 0.719 / 0.835 / 1.172 / 1.214 -> 0.731 / 0.804 / 1.028 / 1.090 (decode-fp8-bs1-qwen3-h200-20261127-
            # s24.json): 2% slower at 128 tokens for 4-12% from 1,024 tokens (at bs 2 x 4096 the old entry had been
            # slower than a bf16 cache: 1.193 against 1.150 ms, decode-wave-scan-h200-20261127-s24.json)
            1: dict(variant="fp16", block_n=32, num_warps=4, num_stages=3, min_tokens_per_split=32),
            4: dict(variant="fp16_vcvt", block_n=64, num_warps=2, num_stages=3, whole_blocks=True,
                    programs_per_sm=4),
            8: dict(variant="fp16_vcvt", block_n=64, num_warps=2, num_stages=3, whole_blocks=True,
                    programs_per_sm=4, combine=True),  # entry 4's settings, splits combined at bs 5-7
            # 9-16 rows: programs_per_sm 3 (4 splits, 512 programs) where entry 8's 4 gave 5 splits, 640 programs
            # for about 528 resident (48 KB of shared memory each): a second wave doubled the kernel at long
            # contexts. H200, Qwen3-0.6B, step ms (decode-fp8-bs16-qwen3-splits-h200-20261127-s24.json): bs 16 x 128
            # / 1024 / 4096 0.944 / 1.295 / 2.703 -> 0.896 / 1.216 / 2.059, bs 12 x 128 0.911 -> 0.880, but bs 12 x
            # 4096 1.857 -> 1.918
            16: dict(variant="fp16_vcvt", block_n=64, num_warps=2, num_stages=3, whole_blocks=True,
                     programs_per_sm=3),
            32: dict(variant="fp16_vcvt", block_n=64, num_warps=2, num_stages=5, whole_blocks=True),
            128: dict(variant="fp16", block_n=32, num_warps=1, num_stages=2, whole_blocks=True),
        },
    }
    extend_block_m = 64
    extend_block_n = 64

    # How new K/V reach the cache: "fused" (one Triton kernel for K and V, quantizing fp8), or through the
    # cache's own indexed writes (`set_kv_buffer`: K then V on one stream; on two streams under capture when
    # the cache has an alt_stream). benchmarks/bench_kv_store.py measures the three inside a decode graph.
    kv_store = "fused"
    # Rotary (and Qwen3's q/k norm) in the store kernel, decode and extend alike (`rope_store.py`): one launch
    # per layer fewer. False: the rotary kernel, then the store. Only with kv_store "fused". None: on CUDA only
    # (Triton's interpreter runs the fused kernel ~2.5x slower than the store alone, and the rotary's torch twin
    # costs nothing: the CPU tests of other features keep their speed; tests/test_rope_store.py sets it).
    fuse_rope_store: bool | None = None

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache, num_heads: int,
                 page_size: int = 1) -> None:
        super().__init__(req_to_token_pool, kv_cache)
        self.num_heads = num_heads
        self.page_size = page_size  # the pool's page size: the kernels then read one table entry per page
        self.kv_fp8 = kv_cache.dtype if kv_cache.is_fp8 else None
        self.device = req_to_token_pool.req_to_token.device
        self.graph_mode = False
        self.graph_max_bs = 0
        self.num_kv_heads, head_dim = kv_cache.get_kv_buffer(0)[0].shape[1:]
        self.decode_table = self.decode_table_for(head_dim, self.kv_fp8 is not None)
        self._kv_args_by_layer: dict[int, dict] = {}
        cuda = self.device.type == "cuda"
        # Off CUDA the kernels run in Triton's interpreter, one program after another: a small stand-in SM count
        # keeps the split cap (and so the grid's mostly empty split programs) small there
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else self.cpu_num_sms
        self.combine_splits = os.environ.get("OSTINATO_DECODE_COMBINE", "1") != "0"
        # one counter per (batch row, KV head): an eager batch has at most one row per request row; a graph's
        # padded batch may have more, and init_cuda_graph_state grows them before any capture
        self.decode_counters = self._zero_counters(req_to_token_pool.req_to_token.shape[0])

    def _zero_counters(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows * self.num_kv_heads, dtype=torch.int32, device=self.device)

    @classmethod
    def decode_table_for(cls, head_dim: int, fp8: bool) -> dict[int, dict]:
        """The settings table of the largest head dim <= `head_dim` for this KV dtype (else the smallest)."""
        dims = sorted(d for f, d in cls.decode_tables if f == fp8)
        return cls.decode_tables[(fp8, max([d for d in dims if d <= head_dim], default=dims[0]))]

    def kv_splits_cap(self, bs: int) -> int:
        """Most splits a request gets in a batch of `bs`: enough stage-1 programs (bs x kv heads x splits) for
        two per SM, at most max_kv_splits. Small batches split finely (a short context's latency is then one
        loop iteration); large ones little or not at all (less stage-2 traffic, the grid is full anyway).

        It depends on bs only through the next power of two, which padding to a captured size does not change
        for the default sizes (every power of two is captured), so a padded replay splits each request as
        an eager pass of the same batch does and gives bitwise the same output."""
        per_sm = table_entry(self.decode_table, bs).get("programs_per_sm", 2)
        return self.split_cap(bs, per_sm, self.num_kv_heads, self.num_sms, self.max_kv_splits)

    @staticmethod
    def entry_combines(entry: dict, bs: int, min_bs: int = combine_min_bs) -> bool:
        """Whether stage 1 combines the splits of a batch of `bs` that takes settings-table entry `entry`: the
        entry's `combine` where it says, else from `min_bs` rows (a backend's combine_min_bs)."""
        return entry.get("combine", bs >= min_bs)

    @staticmethod
    def split_cap(bs: int, programs_per_sm: int, num_kv_heads: int, num_sms: int, max_splits: int) -> int:
        """kv_splits_cap's rule: ceil(programs_per_sm x SMs / (bs's next power of two x KV heads)) splits, in
        [1, max_splits]."""
        bucket = 1 << (max(bs, 1) - 1).bit_length()
        return max(1, min(max_splits, -(-programs_per_sm * num_sms // (bucket * num_kv_heads))))

    def _min_tokens_per_split(self, bs: int) -> int:
        return table_entry(self.decode_table, bs).get("min_tokens_per_split", self.min_tokens_per_split)

    def _count_splits(self, seq_lens: torch.Tensor, out: torch.Tensor, bs: int) -> None:
        """out[b]: request b's split count in a batch of `bs` (the table entry's min_tokens_per_split, kv_splits_cap,
        and its `balance`: compute_num_kv_splits)."""
        compute_num_kv_splits(seq_lens, out, self._min_tokens_per_split(bs), self.kv_splits_cap(bs),
                              table_entry(self.decode_table, bs).get("balance", False))

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.graph_mode = False
        self.req_pool_indices = batch.req_pool_indices
        self.seq_lens = batch.seq_lens
        if batch.mode is ForwardMode.DECODE:
            self.num_kv_splits = torch.empty(batch.batch_size, dtype=torch.int32, device=self.device)
            self._count_splits(batch.seq_lens, self.num_kv_splits, batch.batch_size)  # the cap the grid has
            return
        prefix, extend = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
        assert prefix is not None and extend is not None
        # A mixed step's decoding requests (the trailing 1-token rows) take the split-KV decode kernel: in the
        # extend kernel one program per query head would walk each one's whole context serially.
        tail = mixed_decode_rows(extend)
        head = batch.batch_size - tail
        self.decode_tail = tail
        if tail:
            self.tail_start = sum(extend[:head])
            # copies, not views: a view's start moves with `head`, and Triton specializes kernels on pointer
            # alignment (an odd `head` would compile a new decode variant mid-serving: a 0.45 s stall on an H200)
            self.tail_req_pool_indices = batch.req_pool_indices[head:].clone()
            self.tail_seq_lens = batch.seq_lens[head:].clone()
            self.num_kv_splits = torch.empty(tail, dtype=torch.int32, device=self.device)
            self._count_splits(self.tail_seq_lens, self.num_kv_splits, tail)
            prefix, extend = prefix[:head], extend[:head]
        # one host->device copy for the five per-request and per-block int vectors, each padded to a multiple
        # of 4 entries so every one starts 16-byte aligned (Triton specializes kernels on pointer alignment;
        # an alignment that varied with the batch would compile new variants while serving)
        num_reqs = _round4(head)
        bm = self.extend_block_m
        num_blocks = _round4(sum(-(-n // bm) for n in extend))
        flat = torch.tensor(self._extend_meta(prefix, extend, num_reqs, num_blocks), dtype=torch.int32)
        self._set_extend_views(flat.to(self.device, non_blocking=True), num_reqs)

    def _extend_meta(self, prefix: list[int], extend: list[int], num_reqs: int, num_blocks: int | None) -> list[int]:
        """q_start, prefix_lens, extend_lens (each padded with zeros to `num_reqs`), then the block table
        (padded to `num_blocks` when given), as one flat list."""
        pad = [0] * (num_reqs - len(extend))
        q_start = list(itertools.accumulate(extend, initial=0))[:-1]
        block_req, block_m0 = extend_block_table(extend, self.extend_block_m, num_blocks)
        return q_start + pad + list(prefix) + pad + list(extend) + pad + block_req + block_m0

    def _set_extend_views(self, flat: torch.Tensor, num_reqs: int) -> None:
        n = num_reqs
        self.q_start, self.prefix_lens, self.extend_lens = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        num_blocks = (flat.shape[0] - 3 * n) // 2
        self.block_req, self.block_m0 = flat[3 * n : 3 * n + num_blocks], flat[3 * n + num_blocks :]

    # ------------------------------------------------------------------ extend graphs
    supports_extend_graphs = True

    def init_extend_graph_state(self, max_reqs: int, max_tokens: int) -> None:
        self.extend_graph_max_reqs = max_reqs = _round4(max_reqs)
        blocks = _round4(max_extend_blocks(max_tokens, max_reqs, self.extend_block_m))
        self.extend_graph_meta = torch.zeros(3 * max_reqs + 2 * blocks, dtype=torch.int32, device=self.device)

    def init_forward_metadata_extend_graph(self, batch: ForwardBatch, num_tokens: int) -> None:
        # The grid (one program per block-table entry) is fixed by `num_tokens`, the captured token count:
        # entries past this batch's blocks hold request -1 and exit at once.
        n = self.extend_graph_max_reqs
        assert batch.batch_size <= n, (batch.batch_size, n)
        blocks = _round4(max_extend_blocks(num_tokens, n, self.extend_block_m))
        meta = self._extend_meta(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, n, blocks)
        flat = self.extend_graph_meta[: len(meta)]
        flat.copy_(torch.tensor(meta, dtype=torch.int32), non_blocking=True)
        self.graph_mode = False
        self.decode_tail = 0  # the captured step is one extend launch: mixed steps do not come here
        self.req_pool_indices, self.seq_lens = batch.req_pool_indices, batch.seq_lens
        self._set_extend_views(flat, n)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        num_heads = self.num_heads
        head_dim = self.kv_cache.get_kv_buffer(0)[0].shape[2]
        self.graph_max_bs = max_bs
        if self.decode_counters.numel() < max_bs * self.num_kv_heads:
            self.decode_counters = self._zero_counters(max_bs)
        self.graph_mid_o = torch.empty(max_bs, num_heads, self.max_kv_splits, head_dim, dtype=torch.float32,
                                       device=self.device)
        self.graph_mid_lse = torch.empty(max_bs, num_heads, self.max_kv_splits, dtype=torch.float32,
                                         device=self.device)
        self.graph_num_kv_splits = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        assert self.graph_max_bs > 0, "init_cuda_graph_state must run first"
        assert bs <= self.graph_max_bs, f"bs={bs} > max_bs={self.graph_max_bs}"
        self.graph_mode = True
        self.graph_bs = bs
        self.graph_req_pool_indices, self.graph_seq_lens = req_pool_indices[:bs], seq_lens[:bs]
        # a balancing entry's split counts depend on the whole batch (its mean length): counted once a step by
        # begin_graph_step, inside the capture; else each kernel counts a request's splits from its own length
        self.graph_balance = table_entry(self.decode_table, bs).get("balance", False)

    def begin_graph_step(self) -> None:
        if self.graph_balance:
            self._count_splits(self.graph_seq_lens, self.graph_num_kv_splits[: self.graph_bs], self.graph_bs)

    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        # everything derived from the buffers is recomputed inside the captured region
        self.init_forward_metadata_capture(bs, req_pool_indices, seq_lens)

    # ------------------------------------------------------------------ forward
    def _fuses_rope_store(self, q: torch.Tensor) -> bool:
        """Whether rotary and the K/V store run in one of our kernels (rope_store_kv, or stage 1 in rope_attend)."""
        fuse = self.fuse_rope_store if self.fuse_rope_store is not None else q.is_cuda
        return fuse and self.kv_store == "fused"

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionSpec, batch: ForwardBatch,
              rope: Rope | None = None) -> torch.Tensor:
        if rope is None or not self._fuses_rope_store(q):
            return super().store(q, k, v, layer, batch, rope)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        k = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v = v.view(-1, layer.num_kv_heads, layer.head_dim)
        q = self.rope_store_kv(layer.layer_id, batch.out_cache_loc, q, k, v, rope)
        return q.view(-1, layer.num_heads * layer.head_dim)

    def rope_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionSpec,
                    batch: ForwardBatch, rope: Rope) -> torch.Tensor | None:
        """Decode batches up to the cap (decode_rope_max_bs, else by head dim): stage 1 rotates q and stores the new
        K/V itself (decode_attention's `new`), one launch a layer fewer than rope_store_kv then the decode kernel."""
        bs = q.shape[0]
        d = layer.head_dim
        # stage 1 joins the rotated halves into the row: power-of-two head dims
        cap = self.decode_rope_max_bs
        cap = self.decode_rope_max_bs_by_dim.get(d, 4) if cap is None else cap
        if batch.mode is not ForwardMode.DECODE or not self._fuses_rope_store(q) or bs > cap or d & (d - 1):
            return None
        new = NewTokens(rope.positions, batch.out_cache_loc, k.view(bs, layer.num_kv_heads, d),
                        v.view(bs, layer.num_kv_heads, d), rope.cos_sin, rope.q_norm_weight, rope.k_norm_weight,
                        rope.eps, rope.x_rms, rope.x_rms_eps)
        out = self.forward_decode(q.view(bs, layer.num_heads, d), layer, batch, new)
        return out.view(bs, layer.num_heads * d)

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.kv_store != "fused":
            self.kv_cache.set_kv_buffer(layer_id, loc, k, v)
            return
        a = self._kv_args(layer_id)
        store_kv(a["k_buf"], a["v_buf"], loc, k, v, self.kv_fp8, a["k_scale"], a["v_scale"])

    def rope_store_kv(self, layer_id: int, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rope: Rope) -> torch.Tensor:
        """Rotates pre-rope q [T, H, D] and k, stores k and v at `loc`: one launch. Returns the rotated q."""
        a = self._kv_args(layer_id)
        return rope_store_kv(rope.positions, q, k, v, rope.cos_sin, a["k_buf"], a["v_buf"], loc, rope.q_norm_weight,
                             rope.k_norm_weight, rope.eps, self.kv_fp8, a["k_scale"], a["v_scale"], rope.x_rms,
                             rope.x_rms_eps)

    def _kv_args(self, layer_id: int) -> dict:
        """The cache as the kernels read it: stored bytes, page size, fp8 dtype and scales. Built once per layer
        (the buffers and the scale views never move; scales are updated in place), since every eager launch of a
        layer needs them and each view costs the host microseconds."""
        args = self._kv_args_by_layer.get(layer_id)
        if args is None:
            cache = self.kv_cache
            k_buf, v_buf = cache.get_store_buffer(layer_id)
            args = dict(k_buf=k_buf, v_buf=v_buf, page_size=self.page_size, kv_fp8=self.kv_fp8,
                        k_scale=cache.k_scale(layer_id), v_scale=cache.v_scale(layer_id))
            self._kv_args_by_layer[layer_id] = args
        return args

    def forward_extend(self, q: torch.Tensor, layer: AttentionSpec, batch: ForwardBatch,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        if self.decode_tail:  # rows past the real tokens (a piecewise graph's padding) are never read
            rows = slice(self.tail_start, self.tail_start + self.decode_tail)
            self._decode(q[rows], out[rows], layer, self.tail_req_pool_indices, self.tail_seq_lens,
                         self.num_kv_splits)
        extend_attention(
            q=q, out=out, req_to_token=self.req_to_token_pool.req_to_token, req_pool_indices=self.req_pool_indices,
            q_start=self.q_start, prefix_lens=self.prefix_lens, extend_lens=self.extend_lens,
            block_req=self.block_req, block_m0=self.block_m0, scale=layer.scaling,
            block_m=self.extend_block_m, block_n=self.extend_block_n, **self._kv_args(layer.layer_id),
        )
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionSpec, batch: ForwardBatch,
                       new: NewTokens | None = None) -> torch.Tensor:
        """`new`: q before rotary, and the new tokens' K/V still to store (rope_attend)."""
        bs, num_heads, head_dim = q.shape
        splits = self.kv_splits_cap(bs)  # the grid's split dimension: no program past the cap
        if self.graph_mode:
            cap = self.graph_mid_o.shape
            assert bs == self.graph_bs and num_heads <= cap[1] and head_dim <= cap[3], (bs, num_heads, head_dim)
            # the kernels count each request's splits from seq_lens (no launches for them inside the capture),
            # unless the entry balances (begin_graph_step counted them before the forward)
            num_kv_splits = self.graph_num_kv_splits[:bs] if self.graph_balance else None
            req_pool_indices, seq_lens = self.graph_req_pool_indices, self.graph_seq_lens
            mid_o = self.graph_mid_o[:bs, :num_heads, :splits, :head_dim]
            mid_lse = self.graph_mid_lse[:bs, :num_heads, :splits]
        else:
            num_kv_splits, req_pool_indices, seq_lens = self.num_kv_splits, self.req_pool_indices, self.seq_lens
            mid_o = mid_lse = None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # splits_ready: seq_lens, the tables and num_kv_splits (init_forward_metadata's) were written before the
        # forward, so every layer's stage 1 may read them before its PDL wait
        self._decode(q, out, layer, req_pool_indices, seq_lens, num_kv_splits, mid_o, mid_lse, new, splits_ready=True)
        return out

    def _decode(self, q: torch.Tensor, out: torch.Tensor, layer: AttentionSpec, req_pool_indices: torch.Tensor,
                seq_lens: torch.Tensor, num_kv_splits: torch.Tensor | None, mid_o: torch.Tensor | None = None,
                mid_lse: torch.Tensor | None = None, new: NewTokens | None = None, splits_ready: bool = False) -> None:
        """Split-KV decode of q [bs, H, D] (rows may be a view) into out; fresh scratch unless given.
        `num_kv_splits` None: the kernels count them from seq_lens (the table's min_tokens_per_split and the
        scratch's split capacity, kv_splits_cap: what compute_num_kv_splits gives eagerly). `splits_ready`:
        num_kv_splits, seq_lens and the tables were written before the kernel just ahead (decode_attention's
        `early_kv`)."""
        bs, num_heads, head_dim = q.shape
        if mid_o is None:
            splits = self.kv_splits_cap(bs)
            mid_o = torch.empty(bs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            mid_lse = torch.empty(bs, num_heads, splits, dtype=torch.float32, device=q.device)
        entry = table_entry(self.decode_table, bs)
        combine = self.combine_splits and self.entry_combines(entry, bs, self.combine_min_bs)
        kwargs = dict(block_n=self.decode_block_n) | decode_kwargs(entry)
        kwargs["early_kv"] = kwargs.get("early_kv", False) if splits_ready else False
        decode_attention(
            q=q, out=out, req_to_token=self.req_to_token_pool.req_to_token, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, num_kv_splits=num_kv_splits, mid_o=mid_o, mid_lse=mid_lse, scale=layer.scaling,
            counters=self.decode_counters if combine else None, new=new, **self._kv_args(layer.layer_id), **kwargs,
            min_tokens_per_split=self._min_tokens_per_split(bs) if num_kv_splits is None else None,
        )


def _round4(n: int) -> int:
    return -(-n // 4) * 4
