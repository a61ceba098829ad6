"""Engine arguments: one frozen dataclass; the CLI flags are generated from its fields."""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = _arg(None, "HF model dir, hub id, .gguf file, or dummy preset; default SmolLM2-135M")
    load_format: str = _arg("auto", "auto | safetensors | gguf | dummy")
    dtype: str = _arg("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on GPU)")
    device: str = _arg("auto", "auto | cpu | cuda")
    seed: int = _arg(0, "seed for dummy weights and for requests without a seed")
    max_model_len: int | None = _arg(None, "longest prompt + output; default: the model's, capped by KV")
    max_total_tokens: int | None = _arg(None, "KV pool size in tokens (overrides memory-based sizing)")
    mem_fraction_static: float = _arg(0.85, "GPU memory fraction for weights + KV pool")
    page_size: int = _arg(1, "tokens per KV page")
    kv_cache_dtype: str = _arg("auto", "auto (the model dtype) | fp8_e4m3 | fp8_e5m2")
    chunked_prefill_size: int | None = _arg(None, "most prompt tokens prefilled in one step (default 8192 GPU, "
                                            "2048 CPU; offline, as LLM, generate and chat run: 16384 on a GPU of "
                                            "70 GiB or more, A100s excepted)")
    max_running_requests: int | None = _arg(None, "most requests running at once (default 256 GPU, 128 CPU)")
    attention_backend: str = _arg("auto", "auto (triton on GPU, torch on CPU) | triton | torch")
    cuda_graph_max_bs: int | None = _arg(None, "largest decode batch captured (default by GPU memory)")
    cuda_graph_bs: list[int] | None = _arg(None, "decode batch sizes to capture (overrides cuda_graph_max_bs)")
    disable_cuda_graph: bool = _arg(False, "run decode eagerly")
    disable_cuda_graph_padding: bool = _arg(False, "replay only batches whose size was captured exactly")
    disable_sampler_cuda_graph: bool = _arg(False, "sample decode steps that have min_p, top_k, top_p or penalties "
                                            "with the fused kernels launched one by one (by default a graph per "
                                            "batch size and filter set replays them; a temperature-only step is "
                                            "drawn inside the decode graph either way)")
    sampler_warm_up: str = _arg("all", "GPU: the sampler kernels compiled at start-up. all: a draw with every min_p / "
                                "top_k / top_p combination at every batch-size class (270 kernels for Llama-3.2-1B: "
                                "~31 s over 8 worker processes with an empty Triton cache, ~2 s from it, H200). "
                                "temperature: a plain draw only (18 kernels); a filter's first use at a batch-size "
                                "class then compiles mid-serving: seconds in which no running request advances. "
                                "none: nothing")
    sampler_warm_up_workers: int | None = _arg(None, "GPU: child processes that compile the sampler kernels at "
                                               "start-up, in parallel (default: a core each, less one, up to 8, "
                                               "1 GiB of free GPU memory each); 0 or 1: the engine compiles alone")
    extend_cuda_graph_max_tokens: int = _arg(2048, "largest extend (prefill) step replayed from a CUDA graph, "
                                             "in tokens; 0 runs every extend eagerly")
    disable_overlap_schedule: bool = _arg(False, "wait for each step's tokens before scheduling the next (by "
                                          "default the next step is scheduled while the GPU runs this one)")
    enable_torch_compile: bool = _arg(False, "torch.compile the model for captured sizes <= torch_compile_max_bs")
    torch_compile_max_bs: int = _arg(32, "largest decode batch size compiled")
    enable_cudagraph_gc: bool = _arg(False, "keep the garbage collector running during capture")
    decode_megakernel: str = _arg("off", "auto | on | off: run a captured decode step of one request as one "
                                  "persistent kernel over every layer (Hopper GPUs, bf16 Llama / Qwen2 / Qwen3 with a "
                                  "bf16 KV cache; built with nvcc at start-up; keeps a transposed copy of each layer's "
                                  "down weight; its sums are not bit-reproducible). Experimental: on the H200 it is "
                                  "slower than the layers' kernels today (docs/gpu-notes.md). auto: where supported; "
                                  "on: an error where not")
    decode_mlp_kernel: str = _arg("off", "auto | on | off: run each decoder layer's MLP at one row (decode at "
                                  "batch size 1) as one CUDA kernel that streams gate_up and down together (Hopper "
                                  "GPUs, bf16 Llama / Qwen2 / Qwen3; built with nvcc at start-up; keeps a transposed "
                                  "copy of each layer's down weight; its sums are not bit-reproducible). "
                                  "Experimental: on the H200 level with the layers' kernels for Llama-3.2-1B and "
                                  "slower for Qwen3-0.6B (docs/gpu-notes.md). auto: where supported; on: an error "
                                  "where not")
    skip_tokenizer_init: bool = _arg(False, "token ids in and out, no tokenizer")
    trust_remote_code: bool = _arg(False, "allow custom code in HF configs and tokenizers")
    disable_leak_check: bool = _arg(False, "skip the KV leak check the engine runs when idle")
    limit_mm_per_prompt: int = _arg(4, "vision models: most images in one prompt")
    allowed_local_media_path: str | None = _arg(None, "vision models: file:// image URLs are read only under this dir")
    enable_piecewise_cuda_graph: bool = _arg(False, "replay extend and mixed steps from piecewise CUDA graphs "
                                             "(torch.compile split at attention; CPU: the graph stand-in); the full "
                                             "extend graph still takes the steps it can run. On by default for "
                                             "hybrid (Mamba) models with --enable-mixed-chunk")
    piecewise_cuda_graph_tokens: list[int] | None = _arg(None, "token counts to capture piecewise (default: 4..256 "
                                                         "by powers of two, then every 256)")
    piecewise_cuda_graph_max_tokens: int = _arg(2048, "largest piecewise-captured step, in tokens")
    piecewise_cuda_graph_compiler: str = _arg("eager", "eager | inductor: how pieces between attention calls "
                                              "are compiled (hybrid models: eager pieces also capture the Mamba "
                                              "mixer; with inductor it runs eagerly between the pieces)")
    enable_mixed_chunk: bool = _arg(False, "run the decoding requests' tokens in the same step as a prefill chunk")
    disable_radix_cache: bool = _arg(False, "turn off prefix caching (the radix tree over the KV pool)")
    schedule_policy: str = _arg("lpm", "order of waiting requests: lpm (longest cached prefix first) | fcfs")
    kv_store_two_stream: bool = _arg(False, "write K/V with indexed copies, V on a second stream inside captured "
                                     "graphs (seed 001), instead of the fused Triton store kernel")
    enable_vit_cuda_graph: bool = _arg(False, "vision models: replay the vision encoder's blocks and mergers from CUDA "
                                       "graphs, one per padded patch count, captured on a size's second sight")
    vit_cuda_graph_max_mb: int = _arg(4096, "memory cap of the vision-encoder graphs in MiB (least recently used "
                                      "evicted past it; set aside when the KV pool is sized)")
    vit_cuda_graph_max_patches: int = _arg(16384, "largest vision-encoder batch captured, in patches (larger ones "
                                           "run eagerly)")
    tp_size: int = _arg(1, "tensor parallelism: one worker process per GPU (gloo ranks on the CPU), each holding "
                        "1/tp_size of the heads, MLP and vocabulary (Llama, Qwen2, Qwen3)",
                        aliases=("--tensor-parallel-size",))
    disable_custom_all_reduce: bool = _arg(False, "tensor parallel on GPUs: NCCL for every all-reduce (by default "
                                           "small messages take a one-shot all-reduce over peer GPU memory)")

    def __post_init__(self) -> None:
        checks = [
            ("page_size", self.page_size >= 1, ">= 1"),
            ("chunked_prefill_size", self.chunked_prefill_size is None or self.chunked_prefill_size >= 1, ">= 1"),
            ("max_running_requests", self.max_running_requests is None or self.max_running_requests >= 1, ">= 1"),
            ("cuda_graph_max_bs", self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, ">= 1"),
            ("cuda_graph_bs", self.cuda_graph_bs is None or (bool(self.cuda_graph_bs) and min(self.cuda_graph_bs) >= 1),
             "a non-empty list of sizes >= 1"),
            ("torch_compile_max_bs", self.torch_compile_max_bs >= 1, ">= 1"),
            ("extend_cuda_graph_max_tokens", self.extend_cuda_graph_max_tokens >= 0, ">= 0"),
            ("mem_fraction_static", 0.0 < self.mem_fraction_static < 1.0, "in (0, 1)"),
            ("max_total_tokens", self.max_total_tokens is None or self.max_total_tokens >= 1, ">= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, ">= 1"),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"),
             "one of auto, float32, bfloat16, float16"),
            ("device", self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             "auto, cpu or cuda[:N]"),
            ("kv_cache_dtype", self.kv_cache_dtype in ("auto", "fp8_e4m3", "fp8_e5m2"),
             "one of auto, fp8_e4m3, fp8_e5m2"),
            ("attention_backend", self.attention_backend in ("auto", "triton", "torch"), "one of auto, triton, torch"),
            ("limit_mm_per_prompt", self.limit_mm_per_prompt >= 0, ">= 0"),
            ("piecewise_cuda_graph_max_tokens", self.piecewise_cuda_graph_max_tokens >= 1, ">= 1"),
            ("piecewise_cuda_graph_tokens", self.piecewise_cuda_graph_tokens is None
             or (bool(self.piecewise_cuda_graph_tokens) and min(self.piecewise_cuda_graph_tokens) >= 1),
             "a non-empty list of token counts >= 1"),
            ("piecewise_cuda_graph_compiler", self.piecewise_cuda_graph_compiler in ("eager", "inductor"),
             "one of eager, inductor"),
            ("schedule_policy", self.schedule_policy in ("lpm", "fcfs"), "one of lpm, fcfs"),
            ("decode_megakernel", self.decode_megakernel in ("auto", "on", "off"), "one of auto, on, off"),
            ("decode_mlp_kernel", self.decode_mlp_kernel in ("auto", "on", "off"), "one of auto, on, off"),
            ("sampler_warm_up", self.sampler_warm_up in ("none", "temperature", "all"),
             "one of none, temperature, all"),
            ("sampler_warm_up_workers", self.sampler_warm_up_workers is None or self.sampler_warm_up_workers >= 0,
             ">= 0"),
            ("vit_cuda_graph_max_mb", self.vit_cuda_graph_max_mb >= 1, ">= 1"),
            ("vit_cuda_graph_max_patches", self.vit_cuda_graph_max_patches >= 1, ">= 1"),
            ("tp_size", self.tp_size >= 1, ">= 1"),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            if f.type is bool or f.type == "bool":
                parser.add_argument(*flags, action="store_true", help=f.metadata["help"])
                continue
            typ, nargs = f.type, None
            if get_origin(typ) is not None:  # X | None
                typ = next(a for a in get_args(typ) if a is not type(None))
            if get_origin(typ) is list:  # list[int]
                typ, nargs = get_args(typ)[0], "+"
            parser.add_argument(*flags, type=typ, nargs=nargs, default=f.default, help=f.metadata["help"])

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        kw.update(overrides)
        return cls(**kw)
