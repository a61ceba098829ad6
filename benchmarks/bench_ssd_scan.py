"""The Mamba2 extend pieces of one granite-4.0-h-1b layer (48 heads x 64, state 128, 1 group, conv 4, bf16
activations), in GPU us per call (replays of a CUDA graph of 20 calls, as the engine's piecewise graphs run the
mixer): the token-serial scan kernel (`ssm_scan`) against the chunked SSD kernels (`ssd_chunk_scan`: the
default, chunks of 128, float32 operands at tf32 and ieee; `--sweep` its knobs on 1 request; for 1 x 2,048 and the
mixed step, each of its kernels), the torch gather conv against the Triton varlen conv (`--conv-sweep` its tiles),
and the gated norm (`--norm-sweep` its warps). `x36` is the per-forward figure (36 Mamba layers). `err` is
max |y - y_serial| / max |y_serial| from the same starting state (the serial kernel is float32 FMAs).

`--host` adds what each piece costs the host per call (the launch path, no GPU wait: 16 tokens, so the GPU
keeps up) and a cProfile of the whole mixer: an eager extend of 36 layers pays it 36 times.

python benchmarks/bench_ssd_scan.py [--sweep] [--conv-sweep] [--norm-sweep] [--host] [--out PATH]   # ~1 min on an H200
"""

import argparse
import cProfile
import functools
import itertools
import pstats
import time

import torch
from common import RESULTS, capture, device_tag, kernel_times, replay_us, write_report

from ostinato.layers.mamba2 import SSD_CHUNK, _extend_indices, causal_conv_varlen, mamba_mixer_forward, ssd_chunk_table
from ostinato.layers.triton_ops import ssd_scan as ssd_module
from ostinato.layers.triton_ops.conv_extend import conv_extend
from ostinato.layers.triton_ops.gated_rms_norm import gated_rms_norm
from ostinato.layers.triton_ops.ssd_scan import ssd_chunk_scan
from ostinato.layers.triton_ops.ssm_scan import ssm_scan

H, P, G, N, K, LAYERS = 48, 64, 1, 128, 4, 36
COPIES = 4  # input copies the conv and the gated norm rotate through (see `rotating`)
CASES = {"1x512": [512], "1x2048": [2048], "8x256": [256] * 8, "64x32": [32] * 64,
         "2000+32x1": [2000] + [1] * 32}  # last: a mixed step


def us(fn, calls: int = 20) -> float:
    """GPU us per call of `fn`, captured `calls` times in a CUDA graph (as the engine's piecewise graphs run the
    mixer): no host launch cost, which for the multi-launch forms exceeds their GPU time."""
    return replay_us(capture(fn, calls), calls)


def rotating(fn, arg_sets: list[tuple]):
    """`fn` over each of `arg_sets` in turn, call after call: the memory-bound pieces (conv, gated norm) then read
    inputs that are not in L2 from the call before (four copies of a 2,048-token step's exceed the H200's 50 MB
    L2), as in the model, where other layers' work runs between them."""
    turn = itertools.cycle(arg_sets)
    return lambda: fn(*next(turn))


def bench_case(case: str, lens: list[int], sweep: bool, conv_sweep: bool, norm_sweep: bool, row) -> None:
    dev = torch.device("cuda")
    inter, gn = H * P, G * N
    conv_dim = inter + 2 * gn
    T, R = sum(lens), len(lens)
    g = torch.Generator().manual_seed(T)
    zxbcdt = torch.randn(T, inter + conv_dim + H, generator=g).to(dev, torch.bfloat16)
    z, xbc, dt = zxbcdt.split([inter, conv_dim, H], dim=-1)
    conv_w = (torch.randn(conv_dim, K, generator=g) * 0.5).to(dev, torch.bfloat16)
    conv_b = torch.randn(conv_dim, generator=g).to(dev, torch.bfloat16)
    A_log = torch.log(torch.rand(H, generator=g) * 4 + 0.5).to(dev)
    D = torch.randn(H, generator=g).to(dev)
    dt_bias = (torch.randn(H, generator=g) * 0.5 - 1).to(dev)
    norm_w = torch.ones(inter, device=dev, dtype=torch.bfloat16)
    conv0 = torch.randn(R + 1, conv_dim, K - 1, generator=g).to(dev, torch.bfloat16)
    state0 = (0.1 * torch.randn(R + 1, H, P, N, generator=g)).to(dev)
    slots = torch.arange(1, R + 1, device=dev)
    taps, new_rows, cu, *_ = _extend_indices(lens, K, dev)
    copies = [zxbcdt] + [zxbcdt.clone() for _ in range(COPIES - 1)]

    conv = conv0.clone()
    row(case, "conv: torch gather", us(lambda: causal_conv_varlen(xbc, conv, slots, taps, new_rows, conv_w, conv_b)))
    conv_sets = [(c.split([inter, conv_dim, H], dim=-1)[1], conv, slots, cu, conv_w, conv_b) for c in copies]
    row(case, "conv: triton varlen", us(rotating(conv_extend, conv_sets)))
    if sweep or conv_sweep:
        for bt, bd, w in [(32, 64, 4), (32, 64, 8), (64, 64, 4), (64, 64, 8), (32, 128, 4), (64, 128, 8),
                          (16, 128, 4), (128, 64, 8), (32, 256, 8), (16, 256, 4)]:
            fn = functools.partial(conv_extend, block_t=bt, block_d=bd, num_warps=w)
            row(case, f"conv: triton varlen block_t={bt} block_d={bd} num_warps={w}",
                us(rotating(fn, conv_sets)))
    conv_out = conv_extend(xbc, conv0.clone(), slots, cu, conv_w, conv_b)
    x, Bm, Cm = conv_out.split([inter, gn, gn], dim=-1)
    args = (A_log, D, dt_bias, 0.0, float("inf"), H, P, G)

    y_ref = ssm_scan(x, dt, Bm, Cm, state0.clone(), slots, *args, cu)
    scale = y_ref.abs().max().item()
    state = state0.clone()
    row(case, "scan: serial (ssm_scan)", us(lambda: ssm_scan(x, dt, Bm, Cm, state, slots, *args, cu)))
    configs = [dict(), dict(chunk=128), dict(precision="tf32"), dict(precision="ieee")]
    if sweep:
        configs += [dict(chunk=c, num_warps=w, block_m=m, block_s=bs)
                    for c, w, m, bs in [(256, 4, 32, 64), (256, 8, 32, 64), (256, 4, 16, 64), (256, 8, 64, 64),
                                        (256, 4, 16, 32), (128, 4, 32, 64), (64, 4, 32, 32)]]
        configs += [dict(block_p=32, num_warps=w) for w in (4, 8)]
        configs += [dict(state_block=sb, state_warps=w) for sb, w in [((64, 128), 8), ((64, 64), 8)]]
    if case in ("1x2048", "2000+32x1"):  # where the time goes, kernel by kernel
        chunks = tuple(t.to(dev) for t in ssd_chunk_table(lens, SSD_CHUNK))
        for name, (t, _) in kernel_times(lambda: ssd_chunk_scan(x, dt, Bm, Cm, state, slots, *args, cu,
                                                                    chunks)).items():
            row(case, f"ssd kernel: {name[:40]}", t)
    for cfg in configs:
        kw = {k: v for k, v in cfg.items() if k != "precision"}
        kw.setdefault("chunk", SSD_CHUNK)
        chunks = tuple(t.to(dev) for t in ssd_chunk_table(lens, kw["chunk"]))
        fn = functools.partial(ssd_chunk_scan, chunks=chunks, **kw)
        ssd_module.DOT_PRECISION = cfg.get("precision", "tf32")
        ssd_module.SIXTEEN_BIT_DOTS = "precision" not in cfg  # bf16 operands unless a precision is named
        try:
            y = fn(x, dt, Bm, Cm, state0.clone(), slots, *args, cu)
            err = (y - y_ref).abs().max().item() / scale
            t = us(lambda fn=fn: fn(x, dt, Bm, Cm, state, slots, *args, cu))
        except Exception as e:  # a config past the registers / shared memory: say so, go on
            print(f"{case:>7} ssd {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        finally:
            ssd_module.DOT_PRECISION, ssd_module.SIXTEEN_BIT_DOTS = "tf32", True
        name = "scan: ssd " + (" ".join(f"{k}={v}" for k, v in cfg.items()) or "(default)")
        row(case, name, t, err=f"{err:.1e}")
    y = y_ref.to(torch.bfloat16)  # the scan's output as the engine passes it on (the model dtype)
    norm_sets = [(y.clone(), c[:, :inter], norm_w, G, 1e-5, torch.bfloat16) for c in copies]
    row(case, "gated norm", us(rotating(gated_rms_norm, norm_sets)))
    for w in (4, 8, 16) if norm_sweep else ():
        row(case, f"gated norm num_warps={w}", us(rotating(functools.partial(gated_rms_norm, num_warps=w),
                                                           norm_sets)))


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of `fn` (launches only: the GPU work of a 16-token call is shorter)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def host_costs(row) -> None:
    """The host cost of each extend piece and of the whole mixer (mamba_mixer_forward), at 16 tokens."""
    dev = torch.device("cuda")
    inter, gn = H * P, G * N
    conv_dim = inter + 2 * gn
    lens = [16]
    T, R = sum(lens), len(lens)
    zxbcdt = torch.randn(T, inter + conv_dim + H, device=dev, dtype=torch.bfloat16)
    z, xbc, dt = zxbcdt.split([inter, conv_dim, H], dim=-1)
    conv_w = torch.randn(conv_dim, K, device=dev, dtype=torch.bfloat16)
    conv_b = torch.randn(conv_dim, device=dev, dtype=torch.bfloat16)
    A_log, D, dt_bias = (torch.rand(H, device=dev) for _ in range(3))
    norm_w = torch.ones(inter, device=dev, dtype=torch.bfloat16)
    conv = torch.randn(R + 1, conv_dim, K - 1, device=dev, dtype=torch.bfloat16)
    state = torch.zeros(R + 1, H, P, N, device=dev)
    slots = torch.arange(1, R + 1, device=dev)
    taps, new_rows, cu, *chunks = _extend_indices(lens, K, dev)
    x, Bm, Cm = conv_extend(xbc, conv, slots, cu, conv_w, conv_b).split([inter, gn, gn], dim=-1)
    args = (A_log, D, dt_bias, 0.0, float("inf"), H, P, G, cu)
    y = ssd_chunk_scan(x, dt, Bm, Cm, state, slots, *args, tuple(chunks))
    mixer = functools.partial(mamba_mixer_forward, zxbcdt, conv, state, conv_w, conv_b, dt_bias, A_log, D, norm_w,
                              H, P, G, N, 256, 1e-5, 0.0, float("inf"), slots, lens, use_triton=True)
    pieces = {
        "host: torch.empty": lambda: torch.empty(T, inter, device=dev),
        "host: conv_extend": lambda: conv_extend(xbc, conv, slots, cu, conv_w, conv_b),
        "host: ssd": lambda: ssd_chunk_scan(x, dt, Bm, Cm, state, slots, *args, tuple(chunks)),
        "host: gated norm": lambda: gated_rms_norm(y, z, norm_w, G, 1e-5, torch.bfloat16),
        "host: mixer": mixer,
    }
    for name, fn in pieces.items():
        row("1x16", name, host_us(fn))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        mixer()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="sweep the SSD kernels' knobs")
    ap.add_argument("--conv-sweep", action="store_true", help="sweep the varlen conv's tiles")
    ap.add_argument("--norm-sweep", action="store_true", help="sweep the gated norm's warps")
    ap.add_argument("--host", action="store_true", help="also the host cost per call (see the module doc)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []

    def row(case, what, t, **kw):
        rows.append(dict(case=case, what=what, us=round(t, 1), x36_ms=round(t * LAYERS / 1e3, 3), **kw))
        extra = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{case:>7} {what:<40} {t:9.1f} us  x36 {t * LAYERS / 1e3:7.3f} ms  {extra}", flush=True)

    if a.host:
        host_costs(row)
    for case, lens in CASES.items():
        one = case.startswith("1x")
        bench_case(case, lens, a.sweep and one, a.conv_sweep and one, a.norm_sweep and one, row)
    dev = torch.device("cuda")
    write_report(dict(device=device_tag(dev), shape=dict(heads=H, head_dim=P, groups=G, state=N, conv=K),
                      rows=rows), a.out or f"{RESULTS}/ssd-scan-{device_tag(dev)}.json")


if __name__ == "__main__":
    main()
