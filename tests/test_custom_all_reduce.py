"""The one-shot all-reduce (distributed/custom_all_reduce.py): which messages take it, the flag that turns it
off, the all-reduce op's dispatch and the call's host-side handling on the CPU; on 2 GPUs, its sums against
NCCL's, eagerly and replayed from a CUDA graph."""

import argparse
import multiprocessing
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist

from ostinato.config import EngineArgs
from ostinato.distributed import custom_all_reduce as car
from ostinato.distributed.comm import all_reduce
from ostinato.distributed.parallel_state import (
    destroy_tp,
    init_tp,
    one_shot_all_reduce,
    set_one_shot_all_reduce,
    tp_size,
)

KB, MB = 1 << 10, 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_threshold_table_picks_one_shot_for_small_bf16_and_fp32_messages_only():
    top = car.one_shot_max_bytes(2)
    assert top >= 8 * KB and car.one_shot_max_bytes(3) == 0  # a size without a measured row: never
    assert car.one_shot_max_bytes(2, {2: 0}) == 0
    for dtype in (torch.bfloat16, torch.float32):
        assert car.use_one_shot(8 * KB, dtype, top)  # a bs-1 decode message of an 8B model (hidden 4096)
        assert car.use_one_shot(top, dtype, top)
        assert not car.use_one_shot(top + 4, dtype, top)
        assert not car.use_one_shot(0, dtype, top)
    assert not car.use_one_shot(8 * KB, torch.float16, top)  # the kernel has no float16
    assert not car.use_one_shot(8 * KB + 2, torch.bfloat16, top)  # not whole 4-byte words
    # the table falls with the rank count: each rank reads (tp - 1) x the message
    sizes = sorted(car.ONE_SHOT_MAX_BYTES)
    assert all(car.ONE_SHOT_MAX_BYTES[a] >= car.ONE_SHOT_MAX_BYTES[b] for a, b in zip(sizes, sizes[1:], strict=False))


def test_disable_custom_all_reduce_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    on = EngineArgs.from_cli_args(parser.parse_args(["--tp-size", "2"]))
    off = EngineArgs.from_cli_args(parser.parse_args(["--tensor-parallel-size", "2", "--disable-custom-all-reduce"]))
    assert not on.disable_custom_all_reduce and off.disable_custom_all_reduce and off.tp_size == 2


class _FakeOneShot(car.OneShotAllReduce):
    """OneShotAllReduce's own __call__ and eligible() over a CPU buffer, with the kernel replaced by what it does
    on one rank (copy the input into the buffer; the sum over one rank is the buffer)."""

    def __init__(self, max_bytes: int) -> None:  # no symmetric memory, no rendezvous
        self.max_bytes, self.calls, self.kernel_args = max_bytes, 0, []
        self.buffer = torch.full((max_bytes,), 255, dtype=torch.uint8)  # poison: a stale read shows
        self.group_name = "0"
        self._copy_out = self._kernel

    def _kernel(self, buf, local, op, group_name, out) -> None:
        assert op == "sum" and group_name == self.group_name
        assert buf.shape == local.shape == out.shape and buf.dim() == 1 and buf.dtype == local.dtype == out.dtype
        assert buf.storage_offset() == 0 and local.is_contiguous()
        assert (local.storage_offset() * local.element_size()) % 16 == 0
        self.kernel_args.append(local.numel())
        buf.copy_(local)
        out.copy_(buf)


@pytest.fixture
def gloo_rank_of_one():
    init_tp(0, 1, f"tcp://127.0.0.1:{_port()}", torch.device("cpu"), custom_all_reduce=True)
    try:
        yield
    finally:
        destroy_tp()


def test_gloo_group_gets_no_one_shot_and_the_op_dispatches_by_size(gloo_rank_of_one):
    assert one_shot_all_reduce() is None and tp_size() == 1  # CPU: gloo only, whatever the flag says
    g = torch.Generator().manual_seed(0)
    small, large = torch.randn(4, 64, generator=g), torch.randn(64, 64, generator=g)  # 1 KiB, 16 KiB of float32
    assert torch.equal(all_reduce(small), small)  # gloo over one rank
    fake = _FakeOneShot(max_bytes=4 * KB)
    set_one_shot_all_reduce(fake)
    try:
        for x in (small, large, small.to(torch.bfloat16), large.to(torch.float16)):
            calls = fake.calls
            out = all_reduce(x)
            assert torch.equal(out, x) and out.shape == x.shape and out.dtype == x.dtype
            assert out.data_ptr() != x.data_ptr()  # a new tensor, as the op's schema says
            assert fake.calls - calls == (x.numel() * x.element_size() <= 4 * KB and x.dtype != torch.float16)
    finally:
        set_one_shot_all_reduce(None)
    assert fake.kernel_args == [small.numel(), small.numel()]


def test_one_shot_call_handles_views_and_offsets():
    """Inputs as the model hands them over: 2-D, a row slice at an odd offset, a transposed view, bf16 and fp32;
    the kernel always sees a flat, aligned input and a buffer view at offset 0, and the output has x's shape."""
    fake = _FakeOneShot(max_bytes=64 * KB)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, 96, generator=g)
    for x in (base, base[3:9], base[:, :32].t(), base.to(torch.bfloat16)[1:2], base[5], base.view(-1)[1:257]):
        assert fake.eligible(x)
        out = fake(x)
        assert out.shape == x.shape and torch.equal(out, x)
    assert fake.calls == 6


def test_one_shot_call_without_the_fused_copy(monkeypatch):
    """Older torch (no one_shot_all_reduce_copy_out): the input is copied into the buffer, then the op runs on it."""
    fake = _FakeOneShot(max_bytes=64 * KB)
    seen = []

    def op(buf, op, group_name, out):
        seen.append(buf.clone())
        out.copy_(buf)

    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_out", op, raising=False)
    fake._copy_out = None
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)[1:]
    out = fake(x)
    assert torch.equal(out, x) and len(seen) == 1 and torch.equal(seen[0], x.reshape(-1))


def test_create_one_shot_on_cpu_is_none_without_collectives():
    # no process group exists here: returning None must not touch one
    assert car.create_one_shot(None, None, torch.device("cpu"), 0, 2) is None
    assert car.create_one_shot(None, None, torch.device("cuda", 0), 0, 3) is None  # no threshold for 3 ranks


SCENARIOS = ("ok", "set-up fails on rank 1", "self-test fails on rank 0", "no ops on rank 1")


def _agreement_worker(rank: int, port: int, queue) -> None:
    """create_one_shot over 2 gloo ranks, with the symmetric-memory object replaced by one that fails where a
    scenario says: every rank must get the same answer, and none may wait in a collective the other skipped."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.cuda.can_device_access_peer = lambda a, b: True
        got = {}
        for scenario in SCENARIOS:
            class Fake:
                def __init__(self, group, device, max_bytes, scenario=scenario) -> None:
                    if scenario == "set-up fails on rank 1" and rank == 1:
                        raise RuntimeError("no peer mapping")
                    self.scenario, self.max_bytes, self.device = scenario, max_bytes, device

                def self_test(self, rank: int, size: int) -> bool:
                    return not (self.scenario == "self-test fails on rank 0" and rank == 0)

            car.OneShotAllReduce = Fake
            car.symm_mem_ops_available = lambda scenario=scenario: not (scenario == "no ops on rank 1" and rank == 1)
            comm = car.create_one_shot(dist.group.WORLD, dist.group.WORLD, torch.device("cuda", rank), rank, 2)
            got[scenario] = comm is not None and comm.max_bytes == car.one_shot_max_bytes(2)
        queue.put((rank, got))
    except BaseException:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def test_create_one_shot_ranks_agree_when_one_fails():
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_agreement_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    want = {s: s == "ok" for s in SCENARIOS}
    assert results[0] == want and results[1] == want, results


# ---------------------------------------------------------------------- 2 GPUs
def _gpu_worker(rank: int, size: int, port: int, queue) -> None:
    try:
        result = (rank, "ok", _gpu_checks(rank, size, port))
    except BaseException:  # noqa: BLE001
        result = (rank, "error", traceback.format_exc())
    queue.put(result)
    queue.close()
    queue.join_thread()  # the result is sent: exit without NCCL's teardown (it can hang after capture)
    os._exit(0)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    tol = {torch.bfloat16: (1.6e-2, 1e-2), torch.float32: (1e-5, 1e-5)}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1])
    return (got.float() - want.float()).abs().max().item()


def _gpu_checks(rank: int, size: int, port: int) -> dict:
    device = torch.device("cuda", rank)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", device, custom_all_reduce=True)
    comm = one_shot_all_reduce()
    assert comm is not None, "the one-shot all-reduce was not set up"
    worst: dict[str, float] = {}
    sizes = [8 * KB, 40 * KB, 256 * KB, comm.max_bytes]
    gen = torch.Generator(device).manual_seed(100 + rank)  # different inputs on each rank

    def nccl(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    # eager: random [tokens, hidden] inputs, the kernel's and NCCL's sums
    for dtype in (torch.bfloat16, torch.float32):
        for nbytes in sizes:
            x = torch.randn(nbytes // dtype.itemsize // 128, 128, device=device, dtype=dtype, generator=gen)
            calls = comm.calls
            got = all_reduce(x)  # the engine's op: takes the one-shot path
            assert comm.calls == calls + 1
            worst[f"eager {dtype} {nbytes}"] = _close(got, nccl(x))
    # over the threshold: the op goes to NCCL
    big = torch.randn(comm.max_bytes // 2 + 64, device=device, dtype=torch.bfloat16, generator=gen)
    calls = comm.calls
    _close(all_reduce(big), nccl(big))
    assert comm.calls == calls

    # a CUDA graph of many all-reduces, as in a decode step: some chained (each reads the previous sum), of
    # several sizes, mixed with an NCCL one; replayed over fresh inputs written in place
    xs = [torch.zeros(n // 2, device=device, dtype=torch.bfloat16) for n in sizes]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        all_reduce(xs[0])  # warm-up on the capture stream
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        outs = [all_reduce(x) for x in xs]
        chained = all_reduce(all_reduce(xs[0]) * 0.5)
        over = all_reduce(big)
    for replay in range(3):
        for x in xs:
            x.copy_(torch.randn(x.shape, device=device, dtype=x.dtype, generator=gen))
        big.copy_(torch.randn(big.shape, device=device, dtype=big.dtype, generator=gen))
        graph.replay()
        torch.cuda.synchronize(device)
        for nbytes, x, out in zip(sizes, xs, outs, strict=True):
            worst[f"graph {nbytes} replay {replay}"] = _close(out, nccl(x))
        want = nccl(nccl(xs[0]) * 0.5)
        worst[f"graph chained replay {replay}"] = _close(chained, want)
        _close(over, nccl(big))
    dist.barrier()
    return worst


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_one_shot_equals_nccl_on_two_gpus():
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_gpu_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < len(procs):  # the first failure is reported at once (its peer may then hang)
            rank, status, out = queue.get(timeout=180)
            assert status == "ok", f"rank {rank}:\n{out}"
            results[rank] = out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print("worst |one-shot - NCCL| per case (rank 0):", results[0])
