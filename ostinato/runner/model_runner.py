"""ModelRunner: owns the model, the KV pools and the attention backend; turns a scheduled batch into
logits and sampled token ids."""

import dataclasses
import functools
import itertools
import logging
import operator
import time

import numpy as np
import torch

from ostinato.attention.base import AttentionBackend
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode, mixed_decode_rows
from ostinato.attention.op import forward_context
from ostinato.attention.torch_backend import TorchAttentionBackend
from ostinato.config import EngineArgs
from ostinato.device_info import usable_sms
from ostinato.distributed.parallel_state import kv_heads_per_rank, min_over_ranks, tp_size
from ostinato.graphs.decode import DecodeGraphRunner
from ostinato.graphs.extend import ExtendGraphRunner
from ostinato.graphs.graph import release_graph_pool
from ostinato.graphs.piecewise import PiecewiseGraphRunner
from ostinato.graphs.sample import SampleGraphRunner
from ostinato.graphs.vit import VitGraphRunner
from ostinato.layers.mamba2 import SSD_CHUNK, ssd_workspace_bytes
from ostinato.layers.mamba_tables import GRAPH_MAX_REQS, step_bounds
from ostinato.layers.sampling_ops import padded_vocab
from ostinato.loader import ModelSource, dummy_init_
from ostinato.loader.kv_scales import KVScaleFilter
from ostinato.megakernel.decode_bs1 import DecodeBs1Megakernel
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.mamba_pool import SINK_SLOT, HybridReqToTokenPool
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import paged_kv_pool
from ostinato.models.llama import head_dim_of
from ostinato.models.registry import model_class
from ostinato.runner.hybrid import is_hybrid, make_mamba_pool
from ostinato.runner.mm_batch import EncoderStats, build_mm_forward
from ostinato.runner.next_tokens import NextTokenBuffer
from ostinato.runner.penalties import PenaltyState, resets_row
from ostinato.runner.sampler import (
    SampledTensors,
    SamplingTensors,
    compute_logprobs,
    fused_draw,
    sample_tensors,
    warm_up_logprobs,
)
from ostinato.runner.scheduled_batch import ScheduledBatch
from ostinato.runner.warm_up_workers import warm_up_sampler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_TOKENS = 16384
PROMPT_LP_ROWS = 512  # prompt-logprob rows whose logits are computed at once
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for but CUDA is not available")
    return torch.device(name)


OFFLINE_CHUNKED_PREFILL = 16384


def offline_chunk_for(device_name: str, total_bytes: int) -> int | None:
    """The `LLM` class's prefill chunk on a GPU of this name and memory where the user set none: 16,384 tokens
    from 70 GiB, A100s excepted (vLLM's offline defaults, as its PR 17885 measured), else None (the runner's
    default, which the server keeps). An eager 8,192-token extend step's host launches take about as long as
    its GPU work (Qwen3-0.6B on an H200: ~16 ms each), so any slower host stretched it; twice the tokens a step
    keeps the GPU the bound (benchmarks/results/offline-chunk*-s42.json: 148,000 prompt tokens in 0.31 s
    against 0.38-0.48)."""
    if total_bytes >= 70 * 2**30 and "a100" not in device_name.lower():
        return OFFLINE_CHUNKED_PREFILL
    return None


def offline_chunked_prefill_size(device_arg: str) -> int | None:
    """offline_chunk_for the device that `device_arg` resolves to (None on a CPU)."""
    device = resolve_device(device_arg)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return offline_chunk_for(props.name, props.total_memory)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


class ModelRunner:
    def __init__(self, args: EngineArgs, source: ModelSource) -> None:
        self.args = args
        self.config = config = source.hf_config.get_text_config()  # a VLM's decoder config
        self.device = resolve_device(args.device)
        # the last step's requests and sampling inputs (_sampling_tensors)
        self._last_sampling: tuple[list, SamplingTensors] | None = None
        # Sampled tokens go to the host on a stream of their own, so the next step's input copies do not queue
        # behind them; the next forward waits for `_host_copies` before it overwrites what they read.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._host_copies: torch.cuda.Event | None = None
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.vocab_size = config.vocab_size
        cuda = self.device.type == "cuda"
        self.max_running_requests = args.max_running_requests or (256 if cuda else 128)
        self.chunked_prefill_size = args.chunked_prefill_size or (8192 if cuda else 2048)
        model_max = getattr(config, "max_position_embeddings", None) or 4096
        if args.max_model_len is not None and args.max_model_len > model_max:
            raise ValueError(f"max_model_len must be <= {model_max} (the model's max_position_embeddings), "
                             f"got {args.max_model_len}")
        want_len = args.max_model_len or model_max

        t0 = time.perf_counter()
        cls = model_class(source.hf_config)
        if tp_size() > 1 and not getattr(cls, "supports_tp", False):
            raise ValueError(f"tp_size: {cls.__name__} has no tensor-parallel layers (Llama, Qwen2 and Qwen3 do)")
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = cls(source.hf_config, max_positions=want_len)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.to(self.device)  # tables built on the CPU (rotary cos/sin) follow the parameters
        self.kv_scales: dict[int, tuple[float, float]] = {}  # fp8 KV scales from the checkpoint, by layer
        if source.load_format == "dummy":
            dummy_init_(self.model, seed=args.seed)
        else:
            weights = KVScaleFilter(source.iter_weights())
            self.model.load_weights(weights)
            self.kv_scales = weights.layer_scales()
        if hasattr(self.model, "after_load"):  # weight transforms a model makes once its weights are in
            self.model.after_load()
        self.model.eval()
        self.one_row_mlp = self._use_one_row_mlp()  # before the KV pool is sized: it holds copies of down's weights
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.load_seconds = time.perf_counter() - t0

        self.compiled_forward = self.model.forward
        if args.enable_torch_compile:
            self.compiled_forward = torch.compile(self.model.forward, dynamic=False, fullgraph=True)

        self.max_positions = want_len  # rows of the model's rotary table
        self._init_memory(want_len)
        self.backend = self._make_backend(self.req_to_token_pool, self.kv_cache)
        self.next_tokens = NextTokenBuffer(self.req_to_token_pool.size, self.device)
        self.penalties = PenaltyState(self.req_to_token_pool.size, self.vocab_size, self.device)
        if cuda and args.kv_store_two_stream:  # indexed K/V writes, V on its own stream under capture
            self.backend.kv_store = "indexed"
            self.kv_cache.alt_stream = torch.cuda.Stream(self.device)
        self.graph_runner: DecodeGraphRunner | None = None
        self._argmax: torch.Tensor | None = None  # argmax of the last forward's logits, when a graph computed it
        self._graph_drawn: torch.Tensor | None = None  # the last forward's tokens, when its decode graph drew them
        self.extend_graph_runner: ExtendGraphRunner | None = None
        self.encoder_stats = EncoderStats()
        self.is_multimodal = getattr(self.model, "is_multimodal", False)
        self.decode_megakernel = self._make_decode_megakernel()
        if cuda and not args.disable_cuda_graph:
            self.graph_runner = DecodeGraphRunner(self)
            if self.extend_graph_max_tokens and not self.is_multimodal:  # image extends run eager
                self.extend_graph_runner = ExtendGraphRunner(self, self.extend_graph_max_tokens)
        if cuda and args.sampler_warm_up != "none":  # the sampler's kernels now rather than mid-stream
            warm_up_sampler(args.sampler_warm_up_workers, self.max_running_requests, self.vocab_size, self.device,
                            args.sampler_warm_up == "all", (padded_vocab(self.vocab_size),))
            # the logits a penalized step reads: a decode graph's padded buffer, or an eager step's [B, V]
            self.penalties.warm_up([padded_vocab(self.vocab_size), self.vocab_size])
            warm_up_logprobs(self.vocab_size, self.device)
        self.sample_graph_runner: SampleGraphRunner | None = None  # sampled decode steps, after a decode graph
        if self.graph_runner is not None and not args.disable_sampler_cuda_graph:
            self.sample_graph_runner = SampleGraphRunner(
                self.graph_runner.logits, self.vocab_size, fused_draw,
                store=(self.next_tokens.tokens, self.graph_runner.req_pool_indices),
                steps=self.graph_runner.sample_steps, penalties=self.penalties)
        self.vit_graph_runner: VitGraphRunner | None = None  # vision-encoder graphs (CPU: the Graph stand-in)
        if args.enable_vit_cuda_graph and self.is_multimodal:
            self.vit_graph_runner = VitGraphRunner(self.model.visual, self.device, args.vit_cuda_graph_max_mb << 20,
                                                   args.vit_cuda_graph_max_patches, keep_gc=args.enable_cudagraph_gc)
        self.piecewise_graph_runner: PiecewiseGraphRunner | None = None
        if self.piecewise_graphs_wanted and self.is_multimodal:
            logger.warning("piecewise CUDA graphs are not wired for vision models yet; extends run as before")
        elif self.piecewise_graphs_wanted:  # on the CPU too (when asked for): the Graph stand-in re-runs each piece
            self.piecewise_graph_runner = PiecewiseGraphRunner(
                self, self.piecewise_graph_max_tokens, args.piecewise_cuda_graph_tokens,
                args.piecewise_cuda_graph_compiler)

    @property
    def piecewise_graphs_wanted(self) -> bool:
        """Piecewise graphs when asked for (`--enable-piecewise-cuda-graph`; on the CPU too, where the Graph
        stand-in re-runs each piece), and by default for hybrid models on CUDA with `--enable-mixed-chunk`: the
        full extend graph cannot take mixed steps, and a hybrid's eager step (a launch per Mamba kernel) took 2.25x
        the piecewise replay at 2,048 tokens (benchmarks/bench_prefill.py, H200)."""
        args = self.args
        return args.enable_piecewise_cuda_graph or (
            self.mamba_pool is not None and self.device.type == "cuda" and args.enable_mixed_chunk
            and not args.disable_cuda_graph and args.extend_cuda_graph_max_tokens > 0)

    @property
    def piecewise_graph_max_tokens(self) -> int:
        """Largest piecewise-captured step, in tokens; never past one prefill chunk."""
        return min(self.args.piecewise_cuda_graph_max_tokens, self.chunked_prefill_size)

    @property
    def extend_graph_max_tokens(self) -> int:
        """Largest captured extend, in tokens (0: none); never past one prefill chunk."""
        if not self.backend.supports_extend_graphs:
            return 0
        return min(self.args.extend_cuda_graph_max_tokens, self.chunked_prefill_size)

    def _use_one_row_mlp(self) -> bool:
        """Each layer's MLP at one row as one CUDA kernel (`--decode-mlp-kernel`); whether it is installed."""
        mode = self.args.decode_mlp_kernel
        if mode == "off":
            return False
        if not hasattr(self.model, "use_one_row_mlp"):
            why = f"{type(self.model).__name__} has no Llama-family MLP"
        elif self.device.type != "cuda":
            why = "it is a CUDA kernel"
        else:
            try:
                why = self.model.use_one_row_mlp(usable_sms(self.device))
            except (ValueError, RuntimeError) as e:  # a launch setting that does not fit; no nvcc; a failed build
                why = str(e)
        if why is None:
            return True
        if mode == "on":
            raise ValueError(f"--decode-mlp-kernel on: {why}")
        logger.info("one-row MLP kernel off: %s", why)
        return False

    def _make_decode_megakernel(self) -> DecodeBs1Megakernel | None:
        """The one-launch decode step for captured one-request steps (`--decode-megakernel`), or None."""
        mode = self.args.decode_megakernel
        if mode == "off":
            return None
        if self.device.type != "cuda" or self.args.disable_cuda_graph:
            why = "it runs inside captured decode graphs on a CUDA device"
        elif torch.cuda.get_device_capability(self.device) != (9, 0):
            why = "it needs a Hopper GPU (sm_90)"
        elif tp_size() > 1 or self.mamba_pool is not None or self.is_multimodal:
            why = "tensor parallel, hybrid and vision models run the layers' own kernels"
        else:
            try:
                return DecodeBs1Megakernel(self.model, self.kv_cache, self.device)
            except (ValueError, RuntimeError) as e:  # unsupported shape, dtype or cache; no nvcc; a failed build
                why = str(e)
        if mode == "on":
            raise ValueError(f"--decode-megakernel on: {why}")
        logger.info("decode megakernel off: %s", why)
        return None

    def _make_backend(self, req_pool: ReqToTokenPool, kv_cache: MHATokenToKVPool,
                      page_size: int | None = None) -> AttentionBackend:
        name = self.args.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if name == "triton":
            from ostinato.attention.triton_backend import TritonAttentionBackend

            num_heads = max(spec.num_heads for spec in self.model.attention_specs.values())
            return TritonAttentionBackend(req_pool, kv_cache, num_heads,
                                          page_size=self.args.page_size if page_size is None else page_size)
        return TorchAttentionBackend(req_pool, kv_cache)

    def shutdown(self) -> None:
        """Drop every device buffer this runner holds (graphs and their pool, KV pool, workspaces, the model)
        and every reference between its parts, so nothing waits for a cyclic collection. Idempotent; the
        runner is unusable afterwards."""
        for graphs in (getattr(self, "graph_runner", None), getattr(self, "extend_graph_runner", None),
                       getattr(self, "sample_graph_runner", None)):
            if graphs is not None:
                graphs.graphs.clear()
                graphs.__dict__.clear()
        if getattr(self, "vit_graph_runner", None) is not None:
            self.vit_graph_runner.entries.clear()
        device = getattr(self, "device", None)
        self.__dict__.clear()
        if device is not None:
            release_graph_pool(device)

    # ------------------------------------------------------------------ memory
    def _init_memory(self, want_len: int) -> None:
        cfg, args = self.config, self.args
        head_dim = head_dim_of(cfg)
        kv_dtype = _KV_DTYPES.get(args.kv_cache_dtype, self.dtype)
        # hybrid models: the Mamba states are allocated first (they are per request), and only the
        # attention layers get KV. Prefix caching must stay off for them: a cached prefix has no state snapshot.
        self.mamba_pool = None
        if is_hybrid(self.model):
            self.mamba_pool = make_mamba_pool(self.model, cfg, self.max_running_requests, self.dtype, self.device,
                                              args.mem_fraction_static)
            self.max_running_requests = self.mamba_pool.size
        self.supports_prefix_cache = self.mamba_pool is None  # the radix cache must check this (hybrid: off)
        self.kv_layers = getattr(self.model, "num_kv_layers", cfg.num_hidden_layers)
        self.kv_heads = kv_heads_per_rank(cfg.num_key_value_heads)  # tensor parallel: this rank's KV heads
        per_token = MHATokenToKVPool.bytes_per_token(self.kv_heads, head_dim, self.kv_layers, kv_dtype)
        # tensor parallel: every rank's pool holds the same slots, the fewest any rank has room for
        tokens = min_over_ranks(args.max_total_tokens or self._tokens_from_memory(per_token, head_dim, kv_dtype))
        page = args.page_size
        self.kv_cache, self.allocator = paged_kv_pool(tokens, page, kv_dtype, self.kv_heads, head_dim, self.kv_layers,
                                                      self.device)
        if self.kv_cache.is_fp8:
            self.kv_cache.set_scales(self.kv_scales)
            if not self.kv_scales:
                logger.warning("kv_cache_dtype=%s but the checkpoint has no KV scales: using 1.0 (values past the "
                               "fp8 range saturate)", args.kv_cache_dtype)
        elif self.kv_scales:
            logger.info("the checkpoint's KV scales are unused: kv_cache_dtype is %s", args.kv_cache_dtype)
        self.max_total_tokens = self.allocator.size
        self.max_model_len = min(want_len, self.max_total_tokens)
        if self.max_model_len < want_len:
            logger.warning("max_model_len capped at %d by the KV pool size", self.max_model_len)
        if self.mamba_pool is not None:
            self.req_to_token_pool = HybridReqToTokenPool(self.max_running_requests, self.max_model_len + page,
                                                          self.device, self.mamba_pool)
        else:
            self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.max_model_len + page, self.device)
        self.kv_manager = KVManager(self.req_to_token_pool, self.allocator)
        self.kv_manager.warm_up()
        logger.info("KV pool: %d tokens, %.2f GiB, %s (%d bytes per token%s)", self.max_total_tokens,
                    self.kv_cache.bytes() / 2**30, str(kv_dtype).removeprefix("torch."), per_token,
                    f", scales for {len(self.kv_scales)} layers from the checkpoint" if self.kv_cache.is_fp8
                    and self.kv_scales else "")

    def _tokens_from_memory(self, per_token: int, head_dim: int, kv_dtype: torch.dtype) -> int:
        """KV tokens that fit in mem_fraction_static of the GPU once weights, the activations of the largest
        prefill chunk (profiled) and room for decode graphs are set aside."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS
        activations = self._profile_prefill_bytes(head_dim, kv_dtype)
        graph_reserve = 2 * 256 * self.vocab_size * 4 + (512 << 20)  # static logits + capture workspace
        # the penalty state, made at the first penalized request (~194 MB at 256 slots and a 152k vocabulary)
        graph_reserve += PenaltyState.bytes_for(self.max_running_requests, self.vocab_size)
        extend_tokens = min(self.args.extend_cuda_graph_max_tokens, self.chunked_prefill_size)
        if not self.args.disable_cuda_graph:  # extend graphs keep the activations of their largest size
            graph_reserve += activations * extend_tokens // self.chunked_prefill_size
        if self.piecewise_graphs_wanted:  # the pieces' outputs and static inputs at the largest size
            graph_reserve += 2 * activations * self.piecewise_graph_max_tokens // self.chunked_prefill_size
        captured_mamba_tokens = max(0 if self.args.disable_cuda_graph else extend_tokens,
                                    self.piecewise_graph_max_tokens if self.piecewise_graphs_wanted else 0)
        if self.mamba_pool is not None and captured_mamba_tokens:  # a captured Mamba step's SSD workspace
            reqs = min(self.max_running_requests, GRAPH_MAX_REQS) + 1
            chunks = step_bounds(captured_mamba_tokens, reqs, SSD_CHUNK)[1]
            heads, head_dim, state_size = self.mamba_pool.ssm.shape[-3:]
            groups = (self.mamba_pool.conv.shape[2] - heads * head_dim) // (2 * state_size)  # conv: x, B, C
            graph_reserve += ssd_workspace_bytes(chunks, heads, head_dim, state_size, groups)
        if self.args.enable_vit_cuda_graph and getattr(self.model, "is_multimodal", False):
            graph_reserve += self.args.vit_cuda_graph_max_mb << 20  # the vision graphs' cap
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.args.mem_fraction_static - (total - free) - activations - graph_reserve
        logger.info("memory: %.2f GiB used after weights, %.2f GiB peak prefill activations, %.2f GiB for graphs "
                    "and the penalty state, "
                    "%.2f GiB left for KV", (total - free) / 2**30, activations / 2**30, graph_reserve / 2**30,
                    max(budget, 0) / 2**30)
        if budget < per_token * 2 * self.chunked_prefill_size:
            raise ValueError(f"mem_fraction_static={self.args.mem_fraction_static} leaves no room for the KV pool "
                             f"after weights and activations; raise it or set max_total_tokens")
        return int(budget // per_token)

    @torch.inference_mode()
    def _profile_prefill_bytes(self, head_dim: int, kv_dtype: torch.dtype) -> int:
        """Peak memory of one forward over `chunked_prefill_size` tokens, on a throwaway pool."""
        n = self.chunked_prefill_size
        req_pool = ReqToTokenPool(1, n + 1, self.device)
        kv_cache, allocator = paged_kv_pool(n + 1, 1, kv_dtype, self.kv_heads, head_dim, self.kv_layers, self.device)
        kv = KVManager(req_pool, allocator)
        slot = req_pool.alloc()
        loc = kv.extend(slot, 0, n)
        backend = self._make_backend(req_pool, kv_cache, page_size=1)
        ids = torch.randint(0, self.vocab_size, (n,), device=self.device)
        # positions wrap at the rotary table's rows: a model whose max_model_len is under the chunk would read past
        # the table (an illegal address on the GPU); the peak memory does not depend on them
        positions = torch.arange(n, device=self.device) % self.max_positions
        batch = ForwardBatch(ForwardMode.EXTEND, 1, ids, positions,
                             torch.tensor([slot], device=self.device), torch.tensor([n], dtype=torch.int32,
                                                                                     device=self.device),
                             loc, torch.tensor([n - 1], device=self.device), [n], [0], [n],
                             mamba_slots=torch.full((1,), SINK_SLOT, device=self.device))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with forward_context(backend, batch, self.model.attention_specs):
            backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions)
        self.model.compute_logits(hidden[batch.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del kv_cache, backend, hidden
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------ forward
    def _to_device(self, rows: list[list[int]]) -> torch.Tensor:
        """int64 [len(rows), n] on the device, in one copy that does not wait for the GPU: pinned memory and
        a non-blocking copy, so a step can be prepared while the previous one runs (overlap scheduling)."""
        host = torch.from_numpy(np.array(_even_columns(rows), dtype=np.int64))  # (numpy: 3x torch.tensor's speed)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)[:, : len(rows[0])]

    def prepare(self, sched: ScheduledBatch) -> ForwardBatch:
        """Device tensors for a scheduled batch, in as few host->device copies as the shapes allow
        (each copy costs ~10 us of host time)."""
        dev, reqs = self.device, sched.reqs
        seq_lens = [s + n for s, n in zip(sched.prefix_lens, sched.extend_lens, strict=True)]
        req_rows = [r.req_pool_idx for r in reqs]
        out_cache_loc = sched.out_cache_loc.to(dev, torch.int64)
        if sched.mode is ForwardMode.DECODE:
            # the input is each request's token at its KV length (in the engine its last): PENDING_TOKEN while the
            # step sampling it is in flight
            ids = [r.token_at(s) for r, s in zip(reqs, sched.prefix_lens, strict=True)]
            pos = sched.prefix_lens
            if self.is_multimodal:  # M-RoPE: text-like past the prompt, shifted by the images' extent
                pos = [s + r.rope_delta for r, s in zip(reqs, pos, strict=True)]
            rows = [ids, pos, req_rows, seq_lens]
            steps = None
            if self.graph_runner is not None and (ints := self.graph_runner.load_inputs(
                    [*rows, [len(r.output_token_ids) for r in reqs]])) is not None:
                logits_indices, steps = self.graph_runner.logits_indices[: len(reqs)], ints[4]
            else:
                ints = self._to_device([*rows, list(range(len(reqs)))])
                logits_indices = ints[4]
            return ForwardBatch(ForwardMode.DECODE, len(reqs), ints[0], ints[1], ints[2], ints[3], out_cache_loc,
                                logits_indices, seq_lens, decode_ints=ints[:4], sample_slots=ints[2],
                                sample_steps=steps)
        # an extend reads prompt (or recomputed) tokens, except a decoding request in a mixed step (one token):
        # its input may be PENDING_TOKEN, resolved on the device below
        assert all(r.num_pending == 0 or n == 1 for r, n in zip(reqs, sched.extend_lens, strict=True)), \
            "extend of a request with tokens in flight"
        if fresh := [r for r, samples in zip(reqs, sched.sample_mask, strict=True) if resets_row(r, samples)]:
            self.penalties.reset_rows(fresh)
        ids, pos = [], []
        for req, start, n in zip(reqs, sched.prefix_lens, sched.extend_lens, strict=True):
            ids.extend(req.token_slice(start, start + n))
            pos.extend(range(start, start + n))
        ends = list(itertools.accumulate(sched.extend_lens, initial=-1))[1:]
        sink = self.next_tokens.sink
        slots = [r if emits else sink for r, emits in zip(req_rows, sched.sample_mask, strict=True)]
        tokens = self._to_device([ids, pos])
        per_req = self._to_device([req_rows, seq_lens, ends, slots])
        if any(r.num_pending for r in reqs):  # mixed step under overlap scheduling
            token_rows = [row for row, n in zip(req_rows, sched.extend_lens, strict=True) for _ in range(n)]
            self.next_tokens.resolve_(tokens[0], self._to_device([token_rows])[0])
        prompt_lp = None
        if sched.prompt_lp_targets is not None:  # request i's first new token sits at row ends[i] - n_i + 1
            rows = [end - n + 1 + j for end, n, targets in zip(ends, sched.extend_lens, sched.prompt_lp_targets,
                                                               strict=True) for j in range(len(targets))]
            targets = [t for ts in sched.prompt_lp_targets for t in ts]
            if rows:
                lp = self._to_device([rows, targets])
                prompt_lp = (lp[0], lp[1], sched.prompt_lp_k)
        return ForwardBatch(
            mode=sched.mode, batch_size=len(reqs), input_ids=tokens[0], positions=tokens[1],
            req_pool_indices=per_req[0], seq_lens=per_req[1], out_cache_loc=out_cache_loc,
            logits_indices=per_req[2], seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(sched.prefix_lens), extend_seq_lens_cpu=list(sched.extend_lens),
            sample_slots=per_req[3],
            mm=build_mm_forward(self.model, reqs, sched.prefix_lens, sched.extend_lens, dev, self.encoder_stats,
                                self.vit_graph_runner.encode if self.vit_graph_runner is not None else None)
            if self.is_multimodal else None,
            prompt_lp=prompt_lp,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, sampling: SamplingTensors | None = None) -> torch.Tensor:
        """Logits [bs, vocab] (float32) at each request's last token. With `batch.prompt_lp`, the step runs
        eagerly and also leaves the prompt tokens' logprobs in `self._prompt_lp`. `sampling`: the step's sampling
        inputs; a decode graph draws a temperature-only step itself (`SamplingTensors.plain_draw`)."""
        self._argmax = self._graph_drawn = None
        self._prompt_lp = None
        if self._host_copies is not None:  # the last step's outputs (a graph's static argmax) read by their copies
            torch.cuda.current_stream(self.device).wait_event(self._host_copies)
            self._host_copies = None
        if self.mamba_pool is not None and batch.mamba_slots is None:
            batch.mamba_slots = self.req_to_token_pool.mamba_slots(batch.req_pool_indices)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            draw = sampling is not None and sampling.plain_draw
            self.graph_runner.load_draw(sampling.temperatures if draw else None, sampling.seeds if draw else None)
            logits = self.graph_runner.replay(batch)  # the graph resolves pending input ids itself
            tokens = self.graph_runner.token_ids[: batch.batch_size]
            if draw:
                self._graph_drawn = tokens
            else:
                self._argmax = tokens
            return logits
        path = self.extend_path(batch) if batch.prompt_lp is None else "eager"
        if path == "extend_graph":
            return self.extend_graph_runner.replay(batch)
        if path == "piecewise":
            return self.piecewise_graph_runner.replay(batch)
        if batch.mode is ForwardMode.DECODE:
            self.next_tokens.begin_decode_(batch.input_ids, batch.req_pool_indices, batch.seq_lens,
                                           batch.out_cache_loc, self.req_to_token_pool.req_to_token)
        with forward_context(self.backend, batch, self.model.attention_specs):
            self.backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, **({"mm": batch.mm} if batch.mm is not None else {}))
        if batch.prompt_lp is not None:
            self._prompt_lp = self._prompt_logprobs(hidden, *batch.prompt_lp)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                         k: int) -> tuple[torch.Tensor, ...]:
        """compute_logprobs of `targets` from the logits at `rows`, PROMPT_LP_ROWS rows at a time (a 2,048-token
        prompt's logits over a 150k vocabulary would be 1.2 GB at once)."""
        parts = [compute_logprobs(self.model.compute_logits(hidden[rows[i : i + PROMPT_LP_ROWS]]),
                                  targets[i : i + PROMPT_LP_ROWS], k) for i in range(0, len(rows), PROMPT_LP_ROWS)]
        return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))

    def _sampling_tensors(self, reqs: list, steps: torch.Tensor | None = None,
                          slots: torch.Tensor | None = None) -> SamplingTensors:
        """The step's sampling inputs. Between arrivals and finishes, decode steps run the same requests in the
        same order, and only the index of the token being sampled moves: the rest is reused from the last step
        (unless a row has structured outputs, whose masks change every step; penalized rows' counts are read on
        the device by request slot: `slots`, int64 [B], needed then). `steps`: those indices already on
        the device (ForwardBatch.sample_steps)."""
        last = self._last_sampling
        if last is not None and len(last[0]) == len(reqs) and all(map(operator.is_, last[0], reqs)):
            tensors = last[1]
            # penalized rows: read at this step's request slots (the same slots, but maybe not the same tensor)
            changes = {"count_rows": slots} if tensors.penalized else {}
            if tensors.steps is not None:  # (all greedy: nothing else depends on the step)
                if steps is None:
                    tensors = tensors.with_steps([len(r.output_token_ids) for r in reqs])
                else:
                    changes["steps"] = steps
            return dataclasses.replace(tensors, **changes) if changes else tensors
        grammars = [getattr(r, "grammar", None) for r in reqs]  # structured outputs' matchers (engine requests)
        constrained = grammars.count(None) < len(grammars)
        tensors = SamplingTensors.from_params(
            [r.params for r in reqs], [r.seed for r in reqs], [len(r.output_token_ids) for r in reqs],
            self.vocab_size, self.device, grammars=grammars if constrained else None,
            penalty_rows=functools.partial(self.penalties.rows, slots),
        )
        self._last_sampling = None if constrained else (list(reqs), tensors)
        return tensors

    def extend_path(self, batch: ForwardBatch) -> str:
        """How a non-decode step runs: "extend_graph" (the whole step captured), "piecewise" or "eager".

        The full extend graph wherever it can run: it beat the piecewise graphs at every size from 1 to 2048
        tokens (benchmarks/bench_extend.py, H100, Llama-3.2-1B: 1.4-8.8 ms against 2.1-9.3 for inductor pieces),
        which still issue 17 graphs and an eager attention launch per layer (~2.5 ms of host time). Piecewise
        takes what the full graph cannot: more requests than it captured, other attention backends, and mixed
        steps: their decoding rows take the split-KV decode kernel beside the extend kernel
        (TritonAttentionBackend), where the full graph's one extend launch would walk each decoding row's whole
        context in one program per head."""
        mixed = mixed_decode_rows(batch.extend_seq_lens_cpu or []) > 0
        if not mixed and self.extend_graph_runner is not None and self.extend_graph_runner.can_run(batch):
            return "extend_graph"
        if self.piecewise_graph_runner is not None and self.piecewise_graph_runner.can_run(batch):
            return "piecewise"
        return "eager"

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sched: ScheduledBatch, batch: ForwardBatch,
               tensors: SamplingTensors | None = None) -> SampledTensors:
        """Token ids (and the logprobs asked for) per scheduled request, stored in `next_tokens` and on their
        way to the host; a penalized step's tokens are counted into the penalty state on the device. `tensors`:
        the step's sampling inputs, as `forward` was given them (else made here)."""
        reqs = sched.reqs
        if tensors is None:
            tensors = self.sampling_tensors(sched, batch)
        drawn = self._graph_drawn  # a decode graph's draw, stored by its replay
        if (self._argmax is not None and self.sample_graph_runner is not None and tensors.fused_ok
                and tensors.graph_drawable):  # the decode graph's logits, penalized there if asked, drawn from
            drawn = self.sample_graph_runner.replay(self.graph_runner.padded_size(len(reqs)), *tensors.fused_args(),
                                                    penalties=tensors.graph_penalties())
        # the replay's argmax belongs to the logits of the last forward, which are the ones sampled here
        sampled = sample_tensors(logits, tensors, self._argmax, drawn)
        if drawn is None and sampled.ids is not self._argmax:  # else a graph stored them (the argmax or the draw)
            self.next_tokens.store_(batch.sample_slots, sampled.ids)
        if tensors.penalized and drawn is None:  # (a sampler graph counted its own draws)
            self.penalties.count_(batch.sample_slots, sampled.ids)
        if self._prompt_lp is not None:
            sampled.prompt_logprobs = self._prompt_lp
            sampled.prompt_lp_counts = [len(t) for t in sched.prompt_lp_targets]
        sampled.copy_to_host(self._copy_stream)
        self._host_copies = sampled.done
        return sampled

    def sampling_tensors(self, sched: ScheduledBatch, batch: ForwardBatch) -> SamplingTensors:
        """The scheduled step's sampling inputs (its prepared `batch` gives the step indices and request slots)."""
        return self._sampling_tensors(sched.reqs, batch.sample_steps, batch.req_pool_indices)

    def step(self, sched: ScheduledBatch) -> SampledTensors:
        """Launch one scheduled step: inputs, sampling inputs, forward, sampling. Returns without waiting for the
        GPU; `.result()` on the return value waits and gives the tokens."""
        batch = self.prepare(sched)
        tensors = self.sampling_tensors(sched, batch)
        return self.sample(self.forward(batch, tensors), sched, batch, tensors)


def _even_columns(rows: list[list[int]]) -> list[list[int]]:
    """`rows` padded with a zero column when their length is odd, so every int64 row of the tensor made
    from them starts 16-byte aligned. Triton specializes kernels on pointer alignment: a row whose
    alignment changed with the batch size would make a new kernel variant (a compile, mid-serving)."""
    return [row + [0] for row in rows] if len(rows[0]) % 2 else rows
