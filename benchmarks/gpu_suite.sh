#!/usr/bin/env bash
# Everything the GPU issue asks to be shown, in two device calls of under 10 minutes each:
#   bash benchmarks/gpu_suite.sh decode    GPU tests, decode ms/step (eager, graph; + torch.compile at bs 1, 32)
#   bash benchmarks/gpu_suite.sh offline   the offline nano-vllm shape, a profile of steady offline decode,
#                                          and the start-up capture time of the default batch-size list
#   bash benchmarks/gpu_suite.sh serving   serving overhead: streamed TPOT at concurrency 1 and output tok/s
#                                          at 64 against the offline engine (needs the .whl wheels carried)
# Writes logs and JSON under $OUT (or ./gpu-out).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
part=${1:-decode}
quiet() { grep -vE "it/s\]|Generating"; }
if [ "$part" = decode ]; then
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_attention.py \
    tests/test_layer_kernels.py -s 2>&1 | quiet | tail -30 | tee "$OUT/tests.log"
timeout 220 python benchmarks/bench_decode.py --iters 30 --profile 1:128 32:128 --out "$OUT/decode.json" 2>&1 | quiet | tee "$OUT/decode.log"
timeout 150 python benchmarks/bench_decode.py --models llama-3.2-1b --compile --cases 1:128 32:128 \
    --out "$OUT/decode-compile.json" 2>&1 | quiet | tail -6 | tee "$OUT/decode-compile.log"
exit 0
fi
if [ "$part" = serving ]; then
timeout 120 python benchmarks/bench_sse_ceiling.py --concurrency 1 64 --num-prompts 256 --output-len 128 2>&1 \
    | tail -3 | tee "$OUT/sse-ceiling.log"
timeout 500 python benchmarks/bench_serving_overhead.py --model llama-3.2-1b --load-format dummy --dtype bfloat16 \
    --out "$OUT/serving-overhead.json" 2>&1 | quiet | tail -20 | tee "$OUT/serving-overhead.log"
exit 0
fi
timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
    --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --out "$OUT/offline.json" 2>&1 | quiet \
    | tail -4 | tee "$OUT/offline.log"
timeout 120 python benchmarks/profile_offline.py --model qwen3-0.6b 2>&1 | quiet | head -40 | tee "$OUT/profile.log"
timeout 90 python -c "
import logging; logging.basicConfig(level=logging.INFO)
from ostinato import LLM
LLM('llama-3.2-1b', load_format='dummy')  # default sizes: logs capture time and graph memory
" 2>&1 | grep -E "captured|KV pool|memory:" | tee "$OUT/startup.log"
