"""Tensor parallelism's processes: the engine core is rank 0 and starts one worker process per other rank.

Rank 0 schedules. For each step it sends every worker a plain description of the batch (`StepPlan`, over a
pipe) and broadcasts, as one int64 tensor on the device, the KV slots the step writes and, when the
requests' `req_to_token` rows may have changed since the last step (any extend step, and the first decode
step after one: admission points a row at a cached prefix, chunk boundaries re-point it at the prefix
cache's copy), their whole rows. Every rank then runs the same `ModelRunner.step` on its shard, with its
own KV shard holding the same slots (the pool is the smallest any rank has room for). Every rank samples
from the same gathered logits with the same seeds, so the workers' next-token buffers match rank 0's and
overlap scheduling works unchanged; only rank 0 reads the tokens back.

A worker that dies is seen by a watcher thread: the engine raises a RuntimeError naming the rank at its next
call (`check`, from `has_unfinished`, or the step that failed), which ends `ostinato serve`'s engine core
with an error. On CUDA a rank blocked in an NCCL collective never returns (nor does a read of its tokens), so
the process exits `GRACE_S` to `2 * GRACE_S` seconds after the death. Workers die with rank 0
(PR_SET_PDEATHSIG, and the pipe's EOF).
"""

import atexit
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from ostinato.attention.forward_batch import ForwardMode
from ostinato.config import EngineArgs
from ostinato.distributed.parallel_state import destroy_tp, init_tp, tp_group
from ostinato.loader import ModelSource
from ostinato.mem.kv_manager import row_index
from ostinato.models.registry import model_class
from ostinato.proc_util import die_with_parent
from ostinato.runner.model_runner import ModelRunner, resolve_device
from ostinato.runner.penalties import resets_row
from ostinato.runner.sampler import SampledTensors
from ostinato.runner.scheduled_batch import ScheduledBatch
from ostinato.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GRACE_S = 10.0  # CUDA: how long a dead worker may leave rank 0 without raising before the process exits


@dataclass
class StepPlan:
    """One step, as the workers need it (the fields ModelRunner.prepare and .sample read of the requests)."""

    mode: ForwardMode
    rows: list[int]  # req_to_token rows
    prefix_lens: list[int]
    extend_lens: list[int]
    sample_mask: list[bool]
    token_ids: list[int]  # the step's input ids, flat (decode: may hold PENDING_TOKEN, resolved on the device)
    rope_deltas: list[int]
    num_pending: list[int]
    num_outputs: list[int]
    # the rows a worker sets from the host this step (runner/penalties.resets_row): batch index -> output ids, and
    # -> prompt ids of those with a repetition penalty
    penalty_outputs: dict[int, list[int]]
    penalty_prompts: dict[int, list[int]]
    new_params: dict[int, tuple[SamplingParams, int]]  # row -> (params, seed) of a request new to that row
    full_rows: bool  # the payload also holds req_to_token[row, :prefix_len] of each request


def check_tp_config(source: ModelSource, size: int) -> None:
    """Raise ValueError before any process starts if the model cannot be split `size` ways."""
    cfg = source.hf_config.get_text_config()
    cls = model_class(source.hf_config)
    if not getattr(cls, "supports_tp", False):
        raise ValueError(f"tp_size: {cls.__name__} has no tensor-parallel layers (Llama, Qwen2 and Qwen3 do)")
    kv = cfg.num_key_value_heads
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"tp_size must divide {name} ({n}), got {size}")
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"tp_size must divide num_key_value_heads ({kv}) or be a multiple of it, got {size}")


class TPWorkers:
    """Rank 0's side: the worker processes, the step broadcast and the watch over them."""

    def __init__(self, args: EngineArgs, source: ModelSource) -> None:
        size = args.tp_size
        check_tp_config(source, size)
        device = rank_device(args.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < device.index + size:
            raise ValueError(f"tp_size must be <= the number of GPUs from {device} on "
                             f"({torch.cuda.device_count() - device.index}), got {size}")
        self.device = device
        self.error: str | None = None
        self._stopping = threading.Event()
        self._acknowledged = threading.Event()
        self._sent: dict[int, tuple[SamplingParams, int]] = {}  # row -> what its worker copy holds
        self._last_mode: ForwardMode | None = None
        self.runner: ModelRunner | None = None
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=run_tp_worker, args=(dataclasses.asdict(args), rank, init_method, child),
                               name=f"ostinato-tp-{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(conn)
        logger.info("tensor parallel: %d worker processes started (pids %s)", size - 1,
                    ", ".join(str(p.pid) for p in self.procs))
        self._watcher = threading.Thread(target=self._watch, name="ostinato-tp-watch", daemon=True)
        self._watcher.start()
        # before multiprocessing's own exit handler, which would wait forever for workers never told to stop
        atexit.register(self.stop)
        try:
            init_tp(0, size, init_method, device, custom_all_reduce=not args.disable_custom_all_reduce)
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------------ steps
    def step(self, sched: ScheduledBatch) -> SampledTensors:
        """Send the step to the workers, then run rank 0's part (ModelRunner.step)."""
        self.check()
        try:
            self._send(sched)
            return self.runner.step(sched)
        except Exception as e:
            if self._wait_for_death(3.0):
                self._acknowledged.set()
                raise RuntimeError(self.error) from e
            raise

    def _send(self, sched: ScheduledBatch) -> None:
        reqs, runner = sched.reqs, self.runner
        full = sched.mode is not ForwardMode.DECODE or self._last_mode is not ForwardMode.DECODE
        self._last_mode = sched.mode
        rows = [r.req_pool_idx for r in reqs]
        if sched.mode is ForwardMode.DECODE:
            ids = [r.token_at(s) for r, s in zip(reqs, sched.prefix_lens, strict=True)]
        else:
            ids = [t for r, s, n in zip(reqs, sched.prefix_lens, sched.extend_lens, strict=True)
                   for t in r.token_slice(s, s + n)]
        new_params = {}
        for row, r in zip(rows, reqs, strict=True):
            prev = self._sent.get(row)
            if prev is None or prev[0] is not r.params or prev[1] != r.seed:
                new_params[row] = self._sent[row] = (r.params, r.seed)
        # the rows the workers' prepare sets from the host (extend steps only)
        resets = [] if sched.mode is ForwardMode.DECODE else [
            i for i, (r, samples) in enumerate(zip(reqs, sched.sample_mask, strict=True)) if resets_row(r, samples)]
        plan = StepPlan(
            sched.mode, rows, list(sched.prefix_lens), list(sched.extend_lens), list(sched.sample_mask), ids,
            [r.rope_delta for r in reqs], [r.num_pending for r in reqs], [len(r.output_token_ids) for r in reqs],
            {i: list(reqs[i].output_token_ids) for i in resets},
            {i: list(reqs[i].prompt_token_ids) for i in resets if reqs[i].params.repetition_penalty != 1.0},
            new_params, full)
        payload = [sched.out_cache_loc.to(self.device, torch.int64)]
        if full and sum(sched.prefix_lens):
            r, c = row_index(rows, [0] * len(rows), plan.prefix_lens, self.device)
            payload.append(runner.req_to_token_pool.req_to_token[r, c].to(torch.int64))
        for conn in self.conns:
            conn.send(plan)
        dist.broadcast(torch.cat(payload) if len(payload) > 1 else payload[0], src=0, group=tp_group())

    # ------------------------------------------------------------------ failure
    def check(self) -> None:
        """Raise RuntimeError if a worker died."""
        if self.error is not None:
            self._acknowledged.set()
            raise RuntimeError(self.error)

    def _wait_for_death(self, timeout: float) -> bool:
        """Whether a worker is (or within `timeout` turns out to be) dead: a failed collective may be seen
        before the watcher has seen the exit and named it."""
        deadline = time.monotonic() + timeout
        while self.error is None and time.monotonic() < deadline:
            if any(not p.is_alive() for p in self.procs):  # the watcher names it, then returns
                self._watcher.join(max(deadline - time.monotonic(), 0.0))
            else:
                wait([p.sentinel for p in self.procs], 0.1)
        return self.error is not None

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        conns = {c: rank for rank, c in enumerate(self.conns, start=1)}
        messages: dict[int, str] = {}
        while not self._stopping.is_set():
            ready = wait(list(sentinels) + list(conns), timeout=0.5)
            for c in [c for c in ready if c in conns]:
                try:
                    messages[conns[c]] = c.recv()  # a worker's last words: why it failed
                except (EOFError, OSError):
                    del conns[c]
            dead = [sentinels[s] for s in ready if s in sentinels]
            if not dead or self._stopping.is_set():
                continue
            rank, proc = dead[0]
            proc.join(1.0)
            why = messages.get(rank) or f"exit code {proc.exitcode}"
            self.error = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({why}); the engine is stopped"
            logger.error(self.error)
            self._kill_workers()
            if self.device.type == "cuda":  # NCCL: rank 0's stream may never leave a collective with a dead peer
                self._acknowledged.wait(GRACE_S)
                time.sleep(GRACE_S)  # time for the engine to report it (the server answers 503 meanwhile)
                logger.critical("%s: exiting", self.error)
                os._exit(1)
            return

    def _kill_workers(self, timeout: float = 0.0) -> None:
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    def stop(self) -> None:
        """Stop the workers (asked to exit, killed after a few seconds) and leave the process group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._acknowledged.set()
        atexit.unregister(self.stop)
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        self._kill_workers(timeout=10.0)
        for conn in self.conns:
            conn.close()
        if self.device.type != "cuda":
            destroy_tp()
            return
        # NCCL's teardown can hang (a dead peer; collectives once captured in graphs: pytorch#115388): give it
        # a few seconds, then leave it behind (this process then cannot start another tensor-parallel engine)
        teardown = threading.Thread(target=destroy_tp, name="ostinato-tp-teardown", daemon=True)
        teardown.start()
        teardown.join(0 if self.error is not None else 10.0)
        if teardown.is_alive():
            logger.warning("tensor parallel: the NCCL process group did not tear down; left behind")


def start_runner(args: EngineArgs, source: ModelSource) -> tuple[ModelRunner, TPWorkers | None]:
    """The engine's ModelRunner; with tp_size > 1 rank 0's, after its workers started (they build theirs
    alongside: model construction, profiling and graph capture run collectives in lockstep)."""
    if args.tp_size == 1:
        return ModelRunner(args, source), None
    tp = TPWorkers(args, source)
    try:
        tp.runner = ModelRunner(args, source)
    except BaseException as e:
        died = not isinstance(e, ValueError) and tp._wait_for_death(1.0)  # a bad argument fails every rank alike
        tp.stop()
        if died:
            raise RuntimeError(tp.error) from e
        raise
    return tp.runner, tp


# ---------------------------------------------------------------------- worker side
class _Window:
    """A request's token ids as far as one step reads them: `[start, start + len(ids))`."""

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start : s.stop - self.start]


class _Count:
    """An output list only counted (requests without penalties)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _RemoteRequest:
    """What ModelRunner.prepare and .sample read of a request (runner/scheduled_batch.ScheduledRequest)."""

    def __init__(self, params: SamplingParams, seed: int, row: int, start: int, ids: list[int], rope_delta: int,
                 num_pending: int, outputs: Any, prompt: list[int]) -> None:
        self.params, self.seed, self.req_pool_idx = params, seed, row
        self.all_token_ids = _Window(start, ids)
        self.rope_delta, self.num_pending, self.output_token_ids = rope_delta, num_pending, outputs
        self.prompt_token_ids = prompt  # a repetition-penalized request's, in a step that resets its row; else empty

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]

    def token_at(self, i: int) -> int:
        return self.all_token_ids[i : i + 1][0]


def run_plan(runner: ModelRunner, plan: StepPlan, params: dict[int, tuple[SamplingParams, int]]) -> None:
    """A worker's step: receive the broadcast slots, write them into its req_to_token rows, run the step."""
    params.update(plan.new_params)
    dev = runner.device
    n_new = sum(plan.extend_lens)
    n_rows = sum(plan.prefix_lens) if plan.full_rows else 0
    payload = torch.empty(n_new + n_rows, dtype=torch.int64, device=dev)
    dist.broadcast(payload, src=0, group=tp_group())
    table = runner.req_to_token_pool.req_to_token
    decode = plan.mode is ForwardMode.DECODE
    if not decode:  # a decode step records its new slots itself (NextTokenBuffer.begin_decode_)
        table[row_index(plan.rows, plan.prefix_lens, plan.extend_lens, dev)] = payload[:n_new].to(table.dtype)
    if n_rows:
        table[row_index(plan.rows, [0] * len(plan.rows), plan.prefix_lens, dev)] = payload[n_new:].to(table.dtype)
    reqs, offset = [], 0
    for i, (row, start, n) in enumerate(zip(plan.rows, plan.prefix_lens, plan.extend_lens, strict=True)):
        width = 1 if decode else n
        sp, seed = params[row]
        outputs = plan.penalty_outputs.get(i, _Count(plan.num_outputs[i]))
        reqs.append(_RemoteRequest(sp, seed, row, start, plan.token_ids[offset : offset + width],
                                   plan.rope_deltas[i], plan.num_pending[i], outputs, plan.penalty_prompts.get(i, [])))
        offset += width
    sched = ScheduledBatch(plan.mode, reqs, plan.prefix_lens, plan.extend_lens, payload[:n_new], plan.sample_mask)
    runner.step(sched)  # the tokens stay on the device (next-token buffer); rank 0 reads its own copy back



def _report_failure(conn, rank: int, what: str, e: BaseException) -> None:
    """Log a worker's exception and send it to rank 0, which names it in the error it raises."""
    logging.getLogger(__name__).exception("tensor-parallel worker rank %d %s", rank, what)
    try:
        conn.send(f"{type(e).__name__}: {e}")
    except OSError:
        pass


def run_tp_worker(args: dict[str, Any], rank: int, init_method: str, conn) -> None:
    """Process entry point (spawn): join the group, build this rank's runner, run the steps rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{rank} %(name)s: %(message)s")
    from ostinato.loader import load_model_source

    engine_args = EngineArgs(**args)
    device = rank_device(engine_args.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        engine_args = dataclasses.replace(engine_args, device=str(device))
    try:
        init_tp(rank, engine_args.tp_size, init_method, device,
                custom_all_reduce=not engine_args.disable_custom_all_reduce)
        source = load_model_source(engine_args.model, engine_args.load_format, engine_args.trust_remote_code)
        runner = ModelRunner(engine_args, source)
    except BaseException as e:
        _report_failure(conn, rank, "failed to start", e)
        sys.exit(1)
    params: dict[int, tuple[SamplingParams, int]] = {}
    while True:
        try:
            plan = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            os._exit(1)
        if plan is None:
            break
        try:
            run_plan(runner, plan, params)
        except BaseException as e:
            _report_failure(conn, rank, "failed", e)
            os._exit(1)
    runner.shutdown()
    if device.type == "cuda":  # NCCL's teardown can hang (pytorch#115388); exiting frees everything
        os._exit(0)
    destroy_tp()


def rank_device(name: str, rank: int) -> torch.device:
    """The device of a rank: CUDA ranks take consecutive GPUs from the one asked for (cuda: GPU 0)."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
