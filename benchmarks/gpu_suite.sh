#!/usr/bin/env bash
# The GPU checks and figures, in device calls of under 10 minutes each:
#   bash benchmarks/gpu_suite.sh megakernel  the one-launch bs-1 decode step: build, GPU tests, the kernel alone
#                                          (probe_megakernel.py), decode ms a step off / on
#   bash benchmarks/gpu_suite.sh mlpkernel the one-row MLP as one CUDA kernel (layers/cuda_ops/mlp_bs1.py): build, GPU
#                                          tests, decode ms a step off / on / off
#   bash benchmarks/gpu_suite.sh mkprobe   the kernel alone with its phases (MEMCHECK=1: a memcheck run first)
#   bash benchmarks/gpu_suite.sh mkncu     the kernel under Nsight Compute: its stall reasons (MK_VARIANTS, MK_MODELS)
#   bash benchmarks/gpu_suite.sh mkslots   the kernel alone at 3, 6 and 11 ring slots
#   bash benchmarks/gpu_suite.sh mkab      the megakernel's GPU tests, then the kernel alone: this tree against
#                                          copies in .ab/, in turns (MK_VARIANTS)
#   bash benchmarks/gpu_suite.sh tests     every GPU test (kernels, graphs, fused sampler, fp8 KV, piecewise graphs,
#                                          Mamba kernels, VLM on CUDA, the models against transformers, PDL on vs
#                                          off, prefix cache, the CUDA C++ kernels, shutdown), in parallel
#                                          processes: ~5-7 min cold
#   bash benchmarks/gpu_suite.sh decode    ms per token through LLM.generate (greedy, T=0.6, greedy again), decode ms/step
#                                          with torch.compile for 11 sizes, bf16 vs fp8 KV and page 1 vs 16,
#                                          the KV-store variants, each sampling feature's first-use stall
#   bash benchmarks/gpu_suite.sh features  extend steps (eager / full graph / piecewise), prefix cache on vs off,
#                                          the VLM encoder and TTFT, VLM TTFT through the server with ViT
#                                          graphs off/on (needs the wheels), Granite-4.0-H decode and offline
#   bash benchmarks/gpu_suite.sh floor     decode against the HBM floor (#16's tables), one run each: ms per token
#                                          through LLM.generate at bs 1 and 32 for each sampling setting beside
#                                          greedy (SETTINGS), the offline nano-vllm shape at T=0.6 / greedy
#   bash benchmarks/gpu_suite.sh explain   launches and graph-node gaps a step, the bs-1 steps' kernel timelines and
#                                          the bs-32 step by profile, gpt-fast beside ours (.bench-deps/gpt-fast)
#   bash benchmarks/gpu_suite.sh gpt-fast  gpt-fast's decode beside ours with its sampling (T=0.6, top_k 200); needs
#                                          its model.py and generate.py in .bench-deps/gpt-fast (carried)
#   bash benchmarks/gpu_suite.sh offs32    decode stage 1 with int32 K/V offsets (OSTINATO_DECODE_OFFS32, on by
#                                          default since the fortieth session's run of this) off / on in turns, the
#                                          GPU attention tests with it on, then bs 32's entry at 3 and 4 stages
#   bash benchmarks/gpu_suite.sh fusedmlp  the one-row MLP as one kernel (benchmarks/fused_mlp_bs1.py, timing only)
#                                          against the engine's gate_up + down, in turns
#   bash benchmarks/gpu_suite.sh bs1       bs-1 steps at other settings: Llama-3.2-1B's one-row gate_up and down (the
#                                          skinny FMA kernel) at other tiles (bench_decode.py --gemm-tiles fma /
#                                          fma_gated), then the splits merged in stage 1 at one row
#   bash benchmarks/gpu_suite.sh gluongemv one launch a GEMV in Gluon, W streamed by TMA from before the PDL wait,
#                                          beside the engine's GEMVs on Llama-3.2-1B's and Qwen3-0.6B's chains
#                                          (bench_gluon_gemv.py: a one-layer run first, under a short timeout, and
#                                          a check against the engine's ops)
#   bash benchmarks/gpu_suite.sh gluonstep Llama-3.2-1B's one-row gate_up and down on that kernel in the step
#   bash benchmarks/gpu_suite.sh gluon     the warp-specialized Gluon GEMV chains (Qwen3-0.6B, Llama-3.2-1B) against
#                                          the engine's one-row GEMVs, with their parts and time stamps
#                                          (bench_gluon_gemv_chain.py: a one-layer run first, under a short timeout)
#   bash benchmarks/gpu_suite.sh attno     one decode row's attention and o_proj as one kernel (benchmarks/
#                                          fused_attn_o_bs1.py, timing only) against the engine's, in turns, and
#                                          the kernel's test compiled
#   bash benchmarks/gpu_suite.sh copyrate  the device copy rate (the floors' bandwidth) by timing method
#   bash benchmarks/gpu_suite.sh offlinesplits  the offline nano-vllm shape at T=0.6 with the 65-256-row decode entry
#                                          splitting long requests (programs_per_sm 32, 512 tokens a split) against
#                                          the table, in turns, then the same entry at uniform contexts
#   bash benchmarks/gpu_suite.sh offlinebalance  the same with the 65-256-row entry balancing (only requests longer
#                                          than the batch's mean split; programs_per_sm 16 / 32) against the table,
#                                          in turns, then at one context for all, and the balance tests compiled
#   bash benchmarks/gpu_suite.sh balance256  the same balancing at 129-256 rows only, against the table, in turns
#   bash benchmarks/gpu_suite.sh sampleprobe  what T=0.6 adds to a decode step as requests finish: GPU busy against
#                                          the wall, the runner's host ms, sampling-input rebuilds, cProfile's hot calls
#   bash benchmarks/gpu_suite.sh drawgraph  temperature-only steps drawn inside the decode graph: GPU tests, then
#                                          #16's rows through LLM.generate in turns with a base tree (.ab/base)
#   bash benchmarks/gpu_suite.sh drawoffline  the offline shape (T=0.6 and greedy) in turns with a base tree
#   bash benchmarks/gpu_suite.sh fastnoise  the Gumbel noise on the approximate log2: GPU tests, the draw and the fused
#                                          sampler alone and the offline shape, in turns with a base tree (.ab/base)
#   bash benchmarks/gpu_suite.sh secondbest  each row's second best draw checked too: the sampler's GPU tests, the
#                                          sampler alone in turns with the last commit's, top_p 0.9 at bs 32
#   bash benchmarks/gpu_suite.sh secondauto  top_p 0.9 at bs 32 with the second best's check by default against never
#   bash benchmarks/gpu_suite.sh filterprofile  the sampler's kernels at bs 32 by profile, top_k 200 end to end
#                                          with the second best's check by default and forced on
#   bash benchmarks/gpu_suite.sh samplerpdl  the sampling GPU tests, the sampler alone against .ab/fused_sample_head.py
#   bash benchmarks/gpu_suite.sh filtersab  top_k / top_p end to end at bs 32 against the tree in .ab/base
#   bash benchmarks/gpu_suite.sh keptab  top_p over what top_k keeps: sampling GPU tests, the sampler alone and
#                                          LLM.generate with both filters against .ab/ (PARTS)
#   bash benchmarks/gpu_suite.sh topkab  top_k alone's select and draw in one launch: the sampler alone against .ab/
#                                          copies (BASELINES), the sampling GPU tests, LLM.generate against .ab/base
#                                          (PARTS)
#   bash benchmarks/gpu_suite.sh topkbatch  the one-launch cut search forced at 64-256 rows against the separate
#                                          launches, in turns (prepared in the sixtieth session, not yet run)
#   bash benchmarks/gpu_suite.sh topkncu  top_k's one launch and its separate passes 0-1 under Nsight Compute
#                                          (prepared in the sixtieth session, not yet run)
#   bash benchmarks/gpu_suite.sh verdict  the sampling GPU tests, the empty-launch probe, the sampler alone against
#                                         .ab/fused_sample_head.py
#   bash benchmarks/gpu_suite.sh verdictprofile  the sampler's kernels at 256 rows by profile, against the head's
#   bash benchmarks/gpu_suite.sh hop       one GEMV-to-GEMV hand-off by its form: launch, PDL, a persistent kernel's
#                                          flag, with and without the next weights loaded first (CUDA C++)
#   bash benchmarks/gpu_suite.sh order     decode rows longest context first: mixed batches by row order (step
#                                          level), the offline shape in turns with arrival order
#   bash benchmarks/gpu_suite.sh longestfirst  engine GPU tests, the offline shape at the default, split entries
#                                          on mixed batches sorted longest first
#   bash benchmarks/gpu_suite.sh balance128  entry 128 balanced against the table: offline shape in turns, 48-128 rows
#   bash benchmarks/gpu_suite.sh profile256  a sorted mixed 256-row step kernel by kernel (first run: forty-seventh session)
#   bash benchmarks/gpu_suite.sh drawsplits  the sampler's kernels with 1,024 / 2,048 target programs (fused_sample's
#                                          _TARGET_PROGRAMS, 512 in the tree) beside the tree's, kernel us by profile
#   bash benchmarks/gpu_suite.sh offline   the offline nano-vllm shape (greedy and T=0.6, fp8 KV) and start-up
#   bash benchmarks/gpu_suite.sh serving   serving overhead at concurrency 1 / 64 / 256, mixed chunk off / on
#                                          (needs the .whl wheels carried)
#   bash benchmarks/gpu_suite.sh piecewise piecewise GPU tests, start-up split (cold / warm cache), extend steps
#   bash benchmarks/gpu_suite.sh mixed     ITL under prefill pressure (mixed chunk off / on), TTFT through
#                                          `ostinato serve` with piecewise on / off (the server needs the wheels)
# Writes logs and JSON under $OUT (or ./gpu-out); more than 8 files go into one $OUT/<part>.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
part=${1:-tests}
# (a progress bar ends its updates in \r: a row printed after one would share its line and be dropped with it)
quiet() { tr '\r' '\n' | grep --line-buffered -vE "it/s\]|Generating|Capturing|Compiling"; }
# the GPU tests of the decode graph's draw and the samplers, in three parallel groups; a line each into $OUT/$2
sampler_gpu_tests() {
  local logs=$1
  # (300 s a group: side by side, the fused and models groups ran past 200 s in the fifty-first session's third
  # call, the one-launch search's test then at two large vocabularies)
  t() { local n=$1; shift; timeout 300 python -m pytest -q -p no:cacheprovider "$@" > "$logs/$n.log" 2>&1; }
  (t models tests/test_gpu.py; t sampler tests/test_sampler.py tests/test_sample_graph.py) &
  (t sampling_features tests/test_sampling_features_gpu.py; t overlap tests/test_overlap.py) &
  (t fused tests/test_fused_sample.py -k "not warm_up") &
  wait
  for f in "$logs"/*.log; do echo "$(basename "$f" .log): $(tail -1 "$f")"; grep -h -E "^(FAILED|ERROR)" "$f"; done \
      | tee "$OUT/$2"
}
# the sampling GPU tests, their summary in $OUT/NAME.log and every group's whole log in $OUT/NAME.full.log:
# sampler_tests_kept NAME
sampler_tests_kept() {
  local logs f; logs=$(mktemp -d)
  sampler_gpu_tests "$logs" "$1.log"
  for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done | quiet > "$OUT/$1.full.log"
}
# LLM.generate at bs 1 and 32, Llama-3.2-1B and Qwen3-0.6B, each SETTING (bench_generate.py --settings), one process
# a tree in TREES (default "base new"; base: .ab/base on PYTHONPATH), in that order; one JSON a turn, the rows
# tagged in $OUT/generate-NAME-ab.log. A fresh machine's first process compiles every kernel, so it gets more time:
# generate_ab NAME SETTING...
generate_ab() {
  local name=$1 turn=0 tree limit pp; shift
  for tree in ${TREES:-base new}; do
    turn=$((turn + 1)); limit=200; [ $turn = 1 ] && limit=300
    pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
    PYTHONPATH=$pp timeout $limit python benchmarks/bench_generate.py --models llama-3.2-1b qwen3-0.6b \
        --batch-sizes 1 32 --repeats 2 --settings "$@" --out "$OUT/generate-$name-$tree-$turn.json" 2>&1 | quiet \
        | grep -E "ms/token|Error" | sed "s/^/[$tree] /" | tee -a "$OUT/generate-$name-ab.log"
  done
}
# Llama-3.2-1B bs 32 through LLM.generate, greedy beside T=0.6 with a filter, with OSTINATO_SAMPLER_SECOND=$1, its
# rows tagged into $OUT/$2.log: bench_at_second SECOND NAME FILTER-ARGS...
bench_at_second() {
  local second=$1 name=$2; shift 2
  OSTINATO_SAMPLER_SECOND=$second timeout 170 python benchmarks/bench_generate.py --models llama-3.2-1b \
      --batch-sizes 32 --temperature 0 0.6 "$@" --repeats 2 --out "$OUT/$name-$second.json" 2>&1 | quiet \
      | grep -E "ms/token|Error" | sed "s/^/[second $second] /" | tee -a "$OUT/$name.log"
}
# a group's whole output goes to $OUT/<name>.full.log as it comes (a call cut short still brings back what ran),
# and its last lines to $OUT/<name>.log and the terminal
keep() { tee "$OUT/$1.full.log" | tail -"$2" | tee "$OUT/$1.log"; }
# the offline nano-vllm shape at T=0.6 once per decode entry, one process each (in turns: give entries twice), its
# lines tagged by entry in $OUT/<name>.log; then bench_decode.py at one context for all, every entry in one process
offline_entries() {
  local name=$1 e; shift
  for e in "$@"; do
    timeout 115 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
        --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 --decode-entry "$e" \
        2>&1 | quiet | grep -E "ostinato T|129-256|65-128" | sed "s/^/[$e] /" | tee -a "$OUT/$name.log"
  done
}
uniform_entries() {
  local name=$1; shift
  timeout 150 python benchmarks/bench_decode.py --models qwen3-0.6b --cases 128:1024 256:1024 128:4096 --modes graph \
      --no-launches --iters 50 --decode-entry "$@" --out "$OUT/$name.json" 2>&1 | quiet \
      | grep -E "x of the first|Error" | tee "$OUT/$name.log"
}
# the megakernel's nvcc build, the twin check on Qwen3's shape under a short timeout (a hang stops the call there),
# then every megakernel GPU test; fails where the twin check did not pass
megakernel_tests() {
  timeout 120 python -c "from ostinato.megakernel.build import library; print(library())" 2>&1 | keep mk-build 5
  timeout 150 python -m pytest -x -q -p no:cacheprovider tests/test_megakernel_gpu.py -k "twin and qwen3" 2>&1 \
      | keep mk-smoke 25
  grep -q " passed" "$OUT/mk-smoke.log" || return 1
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_megakernel_gpu.py 2>&1 | keep mk-tests 30
}
# gpt-fast's decode beside ours with its sampling (T=0.6, top_k 200), into $OUT/gpt-fast.log; needs its model.py and
# generate.py in .bench-deps/gpt-fast (carried)
gpt_fast_rows() {
  timeout 100 python benchmarks/bench_generate.py --models llama-3.2-1b --batch-sizes 1 32 --temperature 0.6 \
      --top-k 200 --repeats 3 --out "$OUT/generate-topk200.json" 2>&1 | quiet | grep -E "ms/token|Error" \
      | tee "$OUT/gpt-fast.log"
  timeout 200 python benchmarks/bench_gpt_fast.py --gpt-fast .bench-deps/gpt-fast --batch-sizes 1 32 \
      --temperature 0.6 --out "$OUT/gpt-fast.json" 2>&1 | grep -vE "it/s\]" | tail -6 | tee -a "$OUT/gpt-fast.log"
}
case "$part" in
megakernel)
  # The one-launch bs-1 decode step (ostinato/megakernel): nvcc build, the twin check on Qwen3's shape under a
  # short timeout (a hang stops the call there), every megakernel GPU test, then decode ms a step off / on
  megakernel_tests || exit 1
  timeout 150 python benchmarks/probe_megakernel.py --models qwen3-0.6b llama-3.2-1b --contexts 128 1024 \
      --out "$OUT/probe-megakernel.json" 2>&1 | keep mk-probe 40
  timeout 200 python benchmarks/bench_decode.py --models qwen3-0.6b llama-3.2-1b --cases 1:128 1:1024 --modes graph \
      --no-launches --iters 100 --decode-megakernel off on --out "$OUT/decode-megakernel.json" 2>&1 | quiet \
      | keep mk-decode 30
  ;;
mlpkernel)
  # the one-row MLP kernel: nvcc build, the twin check at Llama-3.2-1B's shape under a short timeout (a hang stops the
  # call there), its GPU tests, then decode ms a step with it off / on / off, both models (MLP_CASES, MLP_MODES to
  # change them; e.g. MLP_MODES="off on on:probe=2 on:probe=6 off" adds the kernel without its finish and its ring
  # alone, timing probes)
  timeout 120 python -c "from ostinato.layers.cuda_ops.mlp_bs1 import library; print(library())" 2>&1 \
      | keep mlp-build 5
  timeout 120 python -m pytest -x -q -p no:cacheprovider tests/test_mlp_bs1_gpu.py -k "twin and 2048-8192-None-4" 2>&1 \
      | keep mlp-smoke 25
  grep -q " passed" "$OUT/mlp-smoke.log" || exit 1
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_mlp_bs1_gpu.py 2>&1 | keep mlp-tests 30
  # shellcheck disable=SC2086
  timeout 300 python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases ${MLP_CASES:-1:128 1:1024} \
      --modes graph --no-launches --iters 200 --decode-mlp-kernel ${MLP_MODES:-off on off} \
      --out "$OUT/decode-mlp-kernel.json" 2>&1 | quiet | keep mlp-decode 40
  ;;
mkprobe)
  # the one-launch step alone: us a step and its phases from time stamps (probe_megakernel.py), after a memcheck
  # of a two-layer Llama-3.2-1B step
  timeout 120 python -c "from ostinato.megakernel.build import library; print(library())" 2>&1 | keep mk-build 5
  { command -v compute-sanitizer || ls /usr/local/cuda/bin; } > "$OUT/sanitizer-where.log" 2>&1
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -n "${MEMCHECK:-}" ] && timeout 150 "$san" --tool memcheck --print-limit 5 python benchmarks/probe_megakernel.py --models llama-3.2-1b \
      qwen3-0.6b --layers 2 --contexts 8 40 --iters 1 --no-trace --out "$OUT/memcheck.json" 2>&1 | keep mk-memcheck 40
  timeout 200 python benchmarks/probe_megakernel.py --models qwen3-0.6b llama-3.2-1b --contexts 128 1024 \
      --out "$OUT/probe-megakernel.json" 2>&1 | keep mk-probe 40
  ;;
mkab)
  # the megakernel's GPU tests, then the kernel alone (probe_megakernel.py) for this tree against copies carried in
  # .ab/ (`git archive <commit> ostinato | tar -x -C .ab/<name>`), in turns: MK_VARIANTS="tree head tree head" by
  # default, the first run of each traced. About 3-4 minutes; like every part, it packs $OUT into $OUT/mkab.tgz at
  # the end (so write nothing else there to pack afterwards). The fifty-fourth session ran "tree head v1 s64 s128
  # tree", "tree head relaxed tree head" and "tree head tmplonly tree head" (probe-megakernel-{ilp-splits,
  # merge-relaxed,templated}-h200-20261129-s54.tgz), the fifty-fifth "tree base poll2 poll3 tree base poll3", "tree
  # base ni tree base ni", "tree base one tree base one" and "tree base basesw tree base" (probe-megakernel-
  # {m2-polls,noinline,oploop,final}-h200-20261129-s55.tgz), the fifty-sixth "tree head tree head" (head: eba84a7;
  # probe-megakernel-{splitk,final}-h200-20261129-s56.tgz); docs/gpu-notes.md says what each copy held
  megakernel_tests || exit 1
  seen= n=0
  for v in ${MK_VARIANTS:-tree head tree head}; do
    n=$((n + 1))
    src=$PWD; [ "$v" = tree ] || src=$PWD/.ab/$v
    trace=--no-trace; case " $seen " in *" $v "*) ;; *) trace= ;; esac; seen="$seen $v"
    PYTHONPATH=$src timeout 100 python benchmarks/probe_megakernel.py --models qwen3-0.6b llama-3.2-1b \
        --contexts 128 1024 --iters 50 $trace --out "$OUT/probe-megakernel-$n-$v.json" 2>&1 \
        | grep -E "ring slots|ctx|dur|Error" | sed "s/^/[$v] /" | tee -a "$OUT/mk-ab.log"
  done
  ;;
mkslots)
  # the kernel alone at 3, 6 and 11 ring slots (6 and 8 timed as 11-12 in the fifty-third session)
  timeout 120 python -c "from ostinato.megakernel.build import library; print(library())" 2>&1 | keep mk-build 5
  for sl in 3 6 11; do
    timeout 90 python benchmarks/probe_megakernel.py --models qwen3-0.6b llama-3.2-1b --contexts 128 --slots $sl \
        --out "$OUT/probe-megakernel-slots-$sl.json" 2>&1 | grep -E "ring slots|ctx|dur" | tee -a "$OUT/mk-slots.log"
  done
  ;;
mkncu)
  # the one-launch step under Nsight Compute (8 layers): the stall reasons, per issued instruction, for each copy in
  # MK_VARIANTS (default "tree"; others from .ab/<name>, as mkab) and each model in MK_MODELS (default qwen3-0.6b).
  # "tree base" (.ab/base = `git archive e03b825 ostinato`) sets the fifty-fifth session's loop form beside its
  # start, where Qwen3-0.6B's tiles slowed: no_instruction is the instruction-fetch stall a smaller kernel should cut.
  for v in ${MK_VARIANTS:-tree}; do
    src=$PWD; [ "$v" = tree ] || src=$PWD/.ab/$v
    PYTHONPATH=$src timeout 120 python -c "from ostinato.megakernel.build import library; print(library())" 2>&1 \
        | keep "mk-build-$v" 5
    for m in ${MK_MODELS:-qwen3-0.6b}; do
      PYTHONPATH=$src timeout 300 ncu --clock-control none -k regex:decode_bs1 -c 1 --set full --import-source yes \
          -o "$OUT/mk" -f python benchmarks/probe_megakernel.py --models "$m" --layers 8 --contexts 128 --iters 1 \
          --no-trace --out "$OUT/ncu-probe-$v-$m.json" 2>&1 | tail -5 > "$OUT/mk-ncu-run-$v-$m.log"
      ncu --import "$OUT/mk.ncu-rep" --page raw --csv 2>/dev/null | python -c "
import csv, sys
rows = list(csv.reader(sys.stdin)); names, vals = rows[0], rows[-1]
for n, v in zip(names, vals):
    if 'issue_stalled' in n and 'average_warp' in n and v not in ('', '0'):
        print(n, v)
" 2>&1 | sort -t' ' -k2 -g -r | keep "mk-ncu-stalls-$v-$m" 40
      rm -f "$OUT/mk.ncu-rep"
    done
  done
  ;;
tests)
  # Every GPU test file, in parallel pytest processes (one per file or per chain): Triton compiles in each
  # process on a CPU core of its own. Run one after another, the groups ran past their limits on a fresh machine
  # with Triton's cache cold (2026-11-26: logs came back empty); in parallel a cold H100 ran them all in 174 s,
  # and an H200 in 351-400 s once each engine warmed every sampler kernel at start-up (2026-11-28, the new default:
  # 270 kernels for each vocabulary the tests' models have, over 8 worker processes). So the suite's engines warm
  # the plain draw only (sampler_warm_up="temperature"), except test_sampling_features_gpu's warm-up test and
  # test_warm_up_workers.py, whose subject it is: 296 s on a fresh H200 (2026-11-28, 400 s before).
  # Files that build engines run in chains, never more than three engines at once; test_shutdown runs alone
  # after the rest, since it reads the device's free memory. One line a file in $OUT/tests.log, every output in
  # $OUT/tests.full.log (a device call brings back at most 8 files).
  # (test_sampling_features_gpu.py's structured-output test needs the xgrammar wheel carried, else it skips)
  logs=$(mktemp -d)
  t() { local n=$1; shift; timeout 540 python -m pytest -q -p no:cacheprovider "$@" > "$logs/$n.log" 2>&1
        echo "$n: $(grep -v '^$' "$logs/$n.log" | tail -1)"; }
  k="gpu or cuda or GPU or Cuda or kernel"
  {
    t attention tests/test_triton_attention.py &
    t fp8_variants tests/test_fp8_decode_variants.py &
    t layer_kernels tests/test_layer_kernels.py tests/test_skinny_gemm.py tests/test_wide_gemm.py tests/test_resident_gemv.py &
    t sampler tests/test_fused_sample.py tests/test_sample_graph.py tests/test_sampler.py tests/test_logits.py \
      tests/test_memset_hoist.py &
    (t ssm_scan tests/test_ssm_scan_kernel.py -k "$k"; t warm_up_workers tests/test_warm_up_workers.py) &
    (t decode_graph tests/test_decode_graph.py tests/test_overlap.py; t fp8_kv tests/test_fp8_kv.py; t rope_store tests/test_rope_store.py
     t extend_graph tests/test_extend_graph.py) &
    (t models tests/test_gpu.py; t pdl tests/test_pdl.py; t decode_compile tests/test_decode_compile.py) &
    (t piecewise tests/test_piecewise_gpu.py; t granite tests/test_granite_hybrid_gpu.py -k "$k"
     t vlm tests/test_vlm.py tests/test_vit_graph_gpu.py -k "$k"; t prefix tests/test_gpu_prefix.py
     t sampling_features tests/test_sampling_features_gpu.py) &
    (t megakernel tests/test_megakernel_gpu.py; t mlp_kernel tests/test_mlp_bs1_gpu.py) &  # CUDA C++ (nvcc)
    wait
    t shutdown tests/test_shutdown.py
  } | tee "$OUT/tests.log"
  for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done | quiet > "$OUT/tests.full.log"
  grep -h -E "^(FAILED|ERROR)" "$logs"/*.log | tee -a "$OUT/tests.log"
  ;;
decode)
  for m in llama-3.2-1b qwen3-0.6b; do
    timeout 100 python benchmarks/bench_generate.py --models $m --batch-sizes 1 32 --temperature 0 0.6 0 \
        --repeats 2 --out "$OUT/generate-$m.json" 2>&1 | quiet | grep -E "ms/token|Error" | tee -a "$OUT/generate.log"
  done
  timeout 200 python benchmarks/bench_decode.py --models llama-3.2-1b --compile --compile-max-bs 64 --no-launches \
      --cases 1:128 32:128 --modes graph --out "$OUT/decode-compile.json" 2>&1 | quiet | tail -8 \
      | tee "$OUT/decode-compile.log"
  (cd benchmarks && timeout 200 python bench_decode.py --models llama-3.2-1b --cases 1:128 32:4096 128:4096 256:1024 \
      --modes graph --kv-cache-dtype auto fp8_e4m3 --page-size 1 16 --no-launches --out "$OUT/decode-fp8-pages.json" 2>&1 \
      | quiet | tail -24 | tee "$OUT/decode-fp8-pages.log")
  (cd benchmarks && timeout 100 python bench_kv_store.py 2>&1 | quiet | tail -12 | tee "$OUT/kv-store.log")
  timeout 200 python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 32:128 --modes graph \
      --rope-store fused unfused --out "$OUT/decode-rope-store.json" 2>&1 | quiet | tail -8 | tee "$OUT/rope-store.log"
  # each sampling feature's first use mid-serving: its first generate's longest step against its second's
  (cd benchmarks && timeout 150 python profile_first_steps.py --model llama-3.2-1b --batch-size 32 --features 2>&1 \
      | grep " bs " | tee "$OUT/first-uses.log")
  ;;
features)
  timeout 200 python benchmarks/bench_extend.py --out "$OUT/extend.json" 2>&1 | quiet | tail -40 | tee "$OUT/extend.log"
  timeout 170 python benchmarks/bench_prefix.py --out "$OUT/prefix.json" 2>&1 | quiet | tail -12 | tee "$OUT/prefix.log"
  timeout 120 python benchmarks/bench_vlm.py --chats 32 --repeats 2 --out "$OUT/vlm.json" 2>&1 | quiet | tail -16 | tee "$OUT/vlm.log"
  # TTFT of 64 image chats through `ostinato serve`, vision graphs off then on (needs the server wheels carried)
  if python -c "import fastapi, uvicorn, pydantic, zmq, msgpack" 2>/dev/null; then
    timeout 240 python benchmarks/bench_vlm_serve.py --out "$OUT/vlm-serve.json" 2>&1 | quiet | tail -20 \
        | tee "$OUT/vlm-serve.log"
  else
    echo "bench_vlm_serve: skipped, no fastapi/uvicorn/pydantic/pyzmq/msgpack (carry the wheels)" | tee "$OUT/vlm-serve.log"
  fi
  timeout 120 python benchmarks/bench_decode.py --models granite-4.0-h-1b llama-3.2-1b --cases 1:128 32:128 128:128 --no-launches \
      --out "$OUT/decode-granite.json" 2>&1 | quiet | tail -16 | tee "$OUT/decode-granite.log"
  ;;
floor)
  # #16's rows in one run: ms a token through LLM.generate for each sampling setting beside greedy (greedy first and
  # last), both models at bs 1 and 32, every sampled run seeded; then the offline nano-vllm shape at T=0.6 / greedy
  timeout 330 python benchmarks/bench_generate.py --models llama-3.2-1b qwen3-0.6b --batch-sizes 1 32 --repeats 2 \
      --step-log --settings ${SETTINGS:-temperature=0 temperature=0.6 temperature=0.6,top_k=50 \
      temperature=0.6,top_p=0.9 temperature=0.6,min_p=0.05 temperature=0.6,top_k=50,top_p=0.9,min_p=0.05 \
      temperature=0.6,repetition_penalty=1.1 temperature=0.6,presence_penalty=0.5,frequency_penalty=0.5 \
      temperature=0} --out "$OUT/generate-rows.json" 2>&1 | quiet | grep -E "ms/token|Error" \
      | tee "$OUT/generate-rows.log"
  timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
      --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 \
      --out "$OUT/offline.json" 2>&1 | quiet | tail -5 | tee "$OUT/offline.log"
  ;;
explain)
  # what explains #16's rows: launches and graph-node gaps a step beside the floor; the bs-1 steps' first 24 kernels
  # in order and the bs-32 step kernel by kernel (profiled); gpt-fast's decode beside ours with its sampling (needs
  # .bench-deps/gpt-fast carried)
  timeout 120 python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 32:256 --modes graph \
      --iters 100 --out "$OUT/decode-launches.json" 2>&1 | quiet | grep -E "graph|Error" \
      | tee "$OUT/decode-launches.log"
  TIMELINE=24 timeout 150 python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 32:256 \
      --modes graph --no-launches --iters 100 --profile 1:128 32:256 --out "$OUT/decode-profile.json" 2>&1 | quiet \
      > "$OUT/decode-profile.log"
  gpt_fast_rows
  ;;
gpt-fast)
  gpt_fast_rows
  ;;
offs32)
  # prepared in the thirty-ninth session, run in the fortieth (391 s on a fresh machine; its test step ran past its
  # 200 s limit after 46 passing tests). Each process compiles its own variant, in turns
  for o in 1 0 1 0; do
    OSTINATO_DECODE_OFFS32=$o timeout 150 python benchmarks/bench_decode.py --models qwen3-0.6b llama-3.2-1b \
        --cases 1:128 32:256 32:1024 --modes graph --no-launches --iters 100 --out "$OUT/decode-offs32-$o.json" 2>&1 \
        | quiet | grep "graph " | sed "s/^/offs32 $o /" | tee -a "$OUT/decode-offs32.log"
  done
  OSTINATO_DECODE_OFFS32=1 timeout 200 python -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
      tests/test_decode_graph.py tests/test_fp8_kv.py 2>&1 | tail -3 | tee "$OUT/offs32-tests.log"
  # with it on, fewer pipeline stages at 17-32 rows: a split of 4 blocks computes 4 blocks' addresses ahead
  # (docs/gpu-notes.md, thirty-ninth session)
  OSTINATO_DECODE_OFFS32=1 timeout 200 python benchmarks/bench_decode.py --models qwen3-0.6b llama-3.2-1b \
      --cases 32:256 32:1024 --modes graph --no-launches --iters 100 --decode-entry table "32:num_stages=3" \
      "32:num_stages=4" table --out "$OUT/decode-offs32-stages.json" 2>&1 | quiet | grep "x of the first" \
      | tee "$OUT/decode-offs32-stages.log"
  ;;
fusedmlp)
  # one process a variant (each compiles its own kernels): the engine first and last
  i=0
  for v in "" fused:32:4 fused:16:4 fused:16:8:resident fused:32:8 ""; do
    i=$((i + 1)); name=$i-${v:-engine}
    models="qwen3-0.6b llama-3.2-1b"; [ "${v##*:}" = resident ] && models=qwen3-0.6b  # Llama's slice won't fit
    MLP=$v timeout 150 python benchmarks/fused_mlp_bs1.py --models $models --cases 1:128 1:1024 --modes graph \
        --no-launches --iters 100 --out "$OUT/decode-mlp-${name//:/-}.json" 2>&1 | quiet | grep "graph " \
        | sed "s/^/mlp ${v:-engine} /" | tee -a "$OUT/decode-fused-mlp.log"
  done
  ;;
bs1)
  # prepared in the fortieth session, run in the forty-first (162 s; no setting beat the rule: docs/gpu-notes.md).
  # In the bs-1 timeline
  # (decode-timeline-h200-20261128-s40.log) gate_up streams 67 MB in 19.0 us (3.5 TB/s) and down 33.5 MB in 10.5
  # (3.2 TB/s), at a 4.0 TB/s copy rate: 3.6 us a layer over the bytes, where #16's 0.80 ms target needs about 2.7
  # us less a layer. The tree's tiles at one row: gate_up 32 + 32 rows x K 256, 3 stages (256 programs), which
  # Triton 3.6 compiles for sm_90 at 255
  # registers with 72 bytes of spills; K 128 with 5 stages keeps the bytes in flight at 168 registers, no spills,
  # and 16 + 16 rows 153 (the sass check is in docs/gpu-notes.md, fortieth session). down: 4 rows x K 1024, 3
  # stages (512 programs, 80 registers; 2 K tiles in flight, about 62 KB an SM)
  timeout 500 python benchmarks/bench_decode.py --models llama-3.2-1b --cases 1:128 1:1024 --modes graph \
      --no-launches --iters 100 --gemm-tiles rule "fma_gated:block_k=128,num_stages=5" \
      "fma_gated:block_k=128,num_stages=4" "fma_gated:block_n=16,num_stages=5" "fma_gated:num_stages=4" \
      "fma:num_stages=4" "fma:num_stages=6" \
      "fma:block_n=8,block_k=512" rule --out "$OUT/decode-fma-tiles.json" 2>&1 \
      | quiet | grep -E "x of the first|Error" | tee "$OUT/decode-fma-tiles.log"
  # stage 2's launch holds 15-24 us of a bs-1 step (twenty-third session's bound); merging in stage 1 was slower at
  # one row in the fifteenth and twenty-third sessions, before int32 offsets, early_kv and the resident GEMVs
  timeout 300 python benchmarks/bench_decode.py --models qwen3-0.6b llama-3.2-1b --cases 1:128 1:1024 --modes graph \
      --no-launches --iters 100 --decode-entry table "1:combine=True" table --out "$OUT/decode-bs1-combine.json" 2>&1 \
      | quiet | grep -E "x of the first|Error" | tee "$OUT/decode-bs1-combine.log"
  ;;
gluongemv)
  # prepared in the fortieth session, run in the forty-first (37 s): level with the engine's GEMVs on Llama-3.2-1B,
  # slower than the resident ones on Qwen3-0.6B. A wrong ring phase would hang, so one layer first
  timeout 120 python benchmarks/bench_gluon_gemv.py --layers 1 --tiles 16x256x8 --per-sm 1 2>&1 | tail -4 \
      | tee "$OUT/gluon-gemv-smoke.log"
  timeout 120 python benchmarks/bench_gluon_gemv.py --check --tiles 16x256x8 32x128x8 2>&1 | tail -12 \
      | tee "$OUT/gluon-gemv-check.log"
  timeout 200 python benchmarks/bench_gluon_gemv.py --model llama-3.2-1b --tiles 16x256x8 32x128x8 16x128x12 \
      --per-sm 1 2 --no-pdl --out "$OUT/gluon-gemv-llama.json" 2>&1 | tail -20 | tee "$OUT/gluon-gemv-llama.log"
  timeout 150 python benchmarks/bench_gluon_gemv.py --model qwen3-0.6b --tiles 16x256x8 16x128x12 --per-sm 1 2 \
      --out "$OUT/gluon-gemv-qwen3.json" 2>&1 | tail -12 | tee "$OUT/gluon-gemv-qwen3.log"
  ;;
gluonstep)
  # prepared in the fortieth session, not yet run: Llama-3.2-1B's one-row gate_up and down (the GEMVs the resident
  # kernel does not hold) on bench_gluon_gemv.py's kernel in the step, in turns with the engine's (one process each)
  for v in "" 16:256:65536:1 "" 16:256:65536:1; do
    GLUON_GEMV=$v timeout 140 python benchmarks/bench_gluon_gemv.py --step --models llama-3.2-1b --cases 1:128 \
        1:1024 --modes graph --no-launches --iters 100 2>&1 | quiet | grep "graph " \
        | sed "s/^/gluon ${v:-engine} /" | tee -a "$OUT/decode-gluon-gemv-step.log"
  done
  ;;
gluon)
  # the thirty-eighth session's tables: each model's chain against the engine's GEMVs, with its parts (the ring
  # alone, the compute warps alone, no waits) and where the chain's time goes (--trace)
  timeout 60 python benchmarks/bench_gluon_gemv_chain.py --layers 1 --per-sm 1 2>&1 | tail -6 | tee "$OUT/gluon-1layer.log"
  for m in qwen3-0.6b llama-3.2-1b; do
    timeout 200 python benchmarks/bench_gluon_gemv_chain.py --model $m --per-sm 1 --tiles 16x256x8 16x256x6x4 \
        --modes chain "no wait" drain compute --release gemv --trace --out "$OUT/gluon-chain-$m.json" 2>&1 \
        | tail -14 | tee "$OUT/gluon-chain-$m.log"
  done
  ;;
attno)
  for v in "" 64:4 32:4 ""; do
    ATTN_O=$v timeout 150 python benchmarks/fused_attn_o_bs1.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 1:256 \
        1:1024 --modes graph --no-launches --iters 100 2>&1 | quiet | grep "graph " | grep -v "x of the first" \
        | sed "s/^/attn_o ${v:-engine} /" | tee -a "$OUT/decode-attn-o.log"
  done
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fused_attn_o_bs1.py 2>&1 | tail -3 \
      | tee "$OUT/attn-o-tests.log"
  ;;
offlinesplits)
  # The shape's contexts run 100-2,048 tokens, so at 129-256 rows one split a request (the table's) leaves the
  # longest requests' programs running alone; bench_decode.py's rows (one context for all) cannot show that.
  # Forty-second session: those steps 1-3% faster split, one-context batches 1.5-4.5% slower, so the table stayed
  # (offline-splits-h200-20261128-s42.log). About 4 minutes
  offline_entries offline-splits table "128:programs_per_sm=32,min_tokens_per_split=512" table \
      "128:programs_per_sm=32,min_tokens_per_split=512"
  uniform_entries decode-splits-uniform table "128:programs_per_sm=32,min_tokens_per_split=512" table
  ;;
offlinebalance)
  # prepared in the forty-second session, untimed: `balance` (compute_num_kv_splits) splits a request only where it
  # is longer than the batch's mean, so one-context batches keep the table's one split (where the split entry above
  # lost 1.5-4.5%) and the long requests of a mixed batch still split. About 7 minutes
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_triton_attention.py -k "balanc or graph_path" 2>&1 \
      | tail -1 | tee "$OUT/balance-tests.log"
  offline_entries offline-balance table "128:balance=True,programs_per_sm=16" table \
      "128:balance=True,programs_per_sm=32"
  uniform_entries decode-balance-uniform table "128:balance=True,programs_per_sm=16" \
      "128:balance=True,programs_per_sm=32" table
  ;;
drawgraph)
  # forty-sixth session: a temperature-only decode step drawn by the decode graph's last kernels (no sampler graph
  # after it). The GPU tests that cover it, then ms a token through LLM.generate (greedy, T=0.6), each model in
  # turns with the tree in .ab/base (the session's start: PYTHONPATH puts it first). About 8 minutes
  # (TREES="base new ..." to set the turns; NO_TESTS=1 to skip the tests)
  logs=$(mktemp -d)
  [ -z "${NO_TESTS:-}" ] && sampler_gpu_tests "$logs" drawgraph-tests.log
  i=0
  for m in llama-3.2-1b qwen3-0.6b; do
    for tree in ${TREES:-base new}; do
      i=$((i + 1)); pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
      PYTHONPATH=$pp timeout 200 python benchmarks/bench_generate.py --models $m --batch-sizes 1 32 \
          --temperature 0 0.6 --repeats 2 --out "$OUT/generate-drawgraph-$i-$m-$tree.json" > "$logs/g$i.log" 2>&1
      echo "rc $?" >> "$logs/g$i.log"
      quiet < "$logs/g$i.log" | grep -E "ms/token|Error|^rc [1-9]" | sed "s/^/[$tree] /" \
          | tee -a "$OUT/generate-drawgraph.log"
    done
  done
  ;;
fastnoise)
  # forty-seventh session: the Gumbel noise's logarithms as the hardware's approximate log2 (a series for -log(u)
  # near u = 1). The GPU tests of the draw and the sampler first (test_sampler.py holds the noise's accuracy at every
  # uniform, compiled), then the draw and the fused sampler alone (replayed graphs, Qwen3-0.6B's vocabulary) and the
  # offline shape at T=0.6 then greedy, each in turns with the tree in .ab/base. About 8 minutes (NO_TESTS=1: skip
  # the tests; PARTS="kernels offline" to pick)
  [ -z "${NO_TESTS:-}" ] && sampler_gpu_tests "$(mktemp -d)" fastnoise-tests.log
  for tree in new base; do
    pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
    case " ${PARTS:-kernels offline} " in *" kernels "*)
      PYTHONPATH=$pp timeout 120 python benchmarks/bench_fused_sample.py --vocab 151936 --batch-sizes 1 32 256 \
          --scale 3 0.3 --decode-draw --out "$OUT/fused-sample-$tree.json" 2>&1 | quiet | sed "s/^/[$tree] /" \
          | tee -a "$OUT/fused-sample.log";;
    esac
  done
  i=0
  case " ${PARTS:-kernels offline} " in *" offline "*)
    for tree in new base; do
      i=$((i + 1)); pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
      PYTHONPATH=$pp timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b \
          --dtype bfloat16 --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 \
          --out "$OUT/offline-fastnoise-$i-$tree.json" 2>&1 | quiet | grep -E "ostinato T|decode steps" \
          | sed "s/^/[$tree] /" | tee -a "$OUT/offline-fastnoise.log"
    done;;
  esac
  ;;
secondbest)
  # forty-seventh session: rejection first also checks each row's second best draw, which decides a row whose first
  # falls outside its top_k / top_p without the search (forced on: OSTINATO_SAMPLER_SECOND=1; passed on the H200 in
  # the forty-eighth session, now on by default where top_p is the batch's one filter). The sampler's GPU tests with
  # it on, then the sampler alone in turns with fused_sample.py as at 595f907 (`git show
  # 595f907:ostinato/runner/fused_sample.py > .ab/fused_sample_head.py`, carried), then top_p 0.9 through
  # LLM.generate at bs 32 (greedy beside it) with it on and off. About 5 minutes
  logs=$(mktemp -d)
  t() { local n=$1; shift; timeout 170 python -m pytest -q -p no:cacheprovider "$@" > "$logs/$n.log" 2>&1; }
  export OSTINATO_SAMPLER_SECOND=1
  (t fused tests/test_fused_sample.py -k "not warm_up") &
  (t sampler tests/test_sampler.py tests/test_sample_graph.py) &
  wait
  for f in "$logs"/*.log; do echo "$(basename "$f" .log): $(tail -1 "$f")"; grep -h -E "^(FAILED|ERROR)" "$f"; done \
      | tee "$OUT/secondbest-tests.log"
  timeout 100 python benchmarks/bench_fused_sample.py --vocab 151936 --batch-sizes 32 256 --scale 3 0.3 \
      --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-secondbest.json" 2>&1 | quiet \
      | grep -E "top_k|Error" | tee "$OUT/fused-sample-secondbest.log"
  for second in 1 0; do
    bench_at_second "$second" generate-secondbest --top-p 0.9
  done
  ;;
filterprofile)
  # forty-ninth session: where the filters' cost at bs 32 goes: the sampler's kernels by profile at Llama's
  # vocabulary, the second best's check by default (off with top_k) and forced on; then top_k 200 through
  # LLM.generate at bs 32 (greedy beside it) with the check by default and forced on, in turns. About 7 minutes
  for second in auto 1; do
    OSTINATO_SAMPLER_SECOND=$second timeout 100 python benchmarks/bench_fused_sample.py --vocab 128256 \
        --batch-sizes 32 --scale 3 0.3 --profile --out "$OUT/fused-sample-profile-$second.json" 2>&1 | quiet \
        | grep -vE "^$" | sed "s/^/[second $second] /" | tee -a "$OUT/fused-sample-profile.log"
  done
  for second in auto 1 auto 1; do
    bench_at_second "$second" generate-topk --top-k 200
  done
  ;;
samplerpdl)
  # forty-ninth session: the sampler's kernels and the decode graph's argmax / draw launched with PDL (5858f7e; the
  # PDL part reverted after filtersab), the acceptance pass on 8 mass lanes (kept). The sampling GPU tests, then the
  # sampler alone in turns with the session's starting fused_sample.py (carried: `git show
  # 1ced655:ostinato/runner/fused_sample.py > .ab/fused_sample_head.py`). About 5 minutes
  [ -z "${NO_TESTS:-}" ] && sampler_gpu_tests "$(mktemp -d)" samplerpdl-tests.log
  timeout 150 python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 1 32 256 --scale 3 0.3 \
      --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-pdl.json" 2>&1 | quiet \
      | grep -E "top_k|Error" | tee "$OUT/fused-sample-pdl.log"
  ;;
verdict)
  # fiftieth session: one program a row takes each row's verdict after the acceptance pass (6dc2c79: a flag a row,
  # read first by every later kernel; cf0ce81: a list of the rows that need their cut, which the later kernels run
  # over, splits side by side). The sampling GPU tests, the empty-launch probe (benchmarks/probe_empty_launch.py),
  # then the sampler alone in turns with the session's starting fused_sample.py (carried: `git show
  # 88a4b2a:ostinato/runner/fused_sample.py > .ab/fused_sample_head.py`). About 6 minutes (NO_TESTS=1: skip the tests)
  [ -z "${NO_TESTS:-}" ] && sampler_gpu_tests "$(mktemp -d)" verdict-tests.log
  (cd benchmarks && timeout 100 python probe_empty_launch.py --out "$OUT/probe-empty-launch-verdict.json" 2>&1 \
      | quiet | tee "$OUT/probe-empty-launch-verdict.log")
  timeout 150 python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 1 32 256 --scale 3 0.3 \
      --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-verdict.json" 2>&1 | quiet \
      | grep -E "top_k|Error" | tee "$OUT/fused-sample-verdict.log"
  ;;
persistent)
  # fifty-first session: top_p's cut search and its draw under the cut as one launch whose programs wait for each
  # other between passes (fused_sample._top_p_search_kernel; by default where top_p is the batch's one filter, up to
  # 32 rows). The sampler's GPU tests in one process, the sampler alone with the kernel everywhere
  # (OSTINATO_SAMPLER_PERSISTENT=1) in turns with the session's starting fused_sample.py (carried: `git show
  # 8f3d059:ostinato/runner/fused_sample.py > .ab/fused_sample_head.py`), then top_p 0.9 through LLM.generate at bs 1
  # and 32 (greedy beside it), this tree against the session's starting tree (.ab/base, carried: `git archive
  # 8f3d059 ostinato | tar -x -C .ab/base`), one process each. About 9 minutes (NO_TESTS=1: 6)
  [ -z "${NO_TESTS:-}" ] && timeout 240 python -m pytest -q -p no:cacheprovider tests/test_fused_sample.py \
      tests/test_sample_graph.py tests/test_sampler.py -k "not warm_up" 2>&1 | tail -4 \
      | tee "$OUT/persistent-tests.log"
  OSTINATO_SAMPLER_PERSISTENT=1 timeout 150 python benchmarks/bench_fused_sample.py --vocab 128256 \
      --batch-sizes 1 32 256 --scale 3 0.3 --baseline .ab/fused_sample_head.py \
      --out "$OUT/fused-sample-persistent-always.json" 2>&1 | quiet | grep -E "top_p|Error" \
      | tee "$OUT/fused-sample-persistent-always.log"
  for tree in new base; do
    pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
    PYTHONPATH=$pp timeout 130 python benchmarks/bench_generate.py --models llama-3.2-1b --batch-sizes 1 32 \
        --temperature 0 0.6 --top-p 0.9 --repeats 2 --out "$OUT/generate-persistent-$tree.json" 2>&1 | quiet \
        | grep -E "ms/token|Error" | sed "s/^/[$tree] /" | tee -a "$OUT/generate-persistent-ab.log"
  done
  ;;
persistentregs)
  # prepared in the fifty-first session, run once a setting in the fifty-third (gpu-notes.md): the one-launch search
  # (forced everywhere) with a 128-register cap
  # (OSTINATO_SAMPLER_PERSISTENT_MAXNREG=128: two programs an SM instead of one; ptxas: no spills without the gather,
  # about 110 bytes with it), against no cap, each beside the session's starting fused_sample.py (carried as for
  # `persistent`). The question: does the cap take back the loss where many rows are searched (top_k 50 + top_p 0.9
  # at bs 32 and 256, top_p at 256 peaked rows)? About 4 minutes
  for regs in "" 128 "" 128; do
    OSTINATO_SAMPLER_PERSISTENT=1 OSTINATO_SAMPLER_PERSISTENT_MAXNREG=$regs timeout 150 python \
        benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 1 32 256 --scale 3 0.3 \
        --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-persistent-regs${regs:-none}.json" 2>&1 | quiet \
        | grep -E "top_p|Error" | sed "s/^/[maxnreg ${regs:-none}] /" | tee -a "$OUT/fused-sample-persistent-regs.log"
  done
  ;;
persistentcap)
  # prepared in the fifty-third session: what the register-capped one launch (persistentregs' figures: top_k 50 +
  # top_p 0.9 at 32 peaked rows 159 us against 168-170 separate) buys through LLM.generate. The sampler's GPU tests
  # with the one launch forced and capped (OSTINATO_SAMPLER_PERSISTENT=1, _MAXNREG=128), then top_k 50 + top_p 0.9 at
  # T=0.6 at bs 1 and 32 (greedy beside it), the default rule and forced + capped in turns, one process each. About
  # 7 minutes. (The fifty-fourth session ran the tests and one pair: generate-persistentcap-*-h200-20261129-s54.*)
  OSTINATO_SAMPLER_PERSISTENT=1 OSTINATO_SAMPLER_PERSISTENT_MAXNREG=128 timeout 240 python -m pytest -q \
      -p no:cacheprovider tests/test_fused_sample.py tests/test_sample_graph.py tests/test_sampler.py -k "not warm_up" \
      2>&1 | tail -4 | tee "$OUT/persistentcap-tests.log"
  for mode in default capped default capped; do
    force=auto; regs=; [ "$mode" = capped ] && force=1 && regs=128
    OSTINATO_SAMPLER_PERSISTENT=$force OSTINATO_SAMPLER_PERSISTENT_MAXNREG=$regs timeout 100 python \
        benchmarks/bench_generate.py --models llama-3.2-1b --batch-sizes 1 32 --temperature 0 0.6 --top-k 50 \
        --top-p 0.9 --repeats 1 --out "$OUT/generate-persistentcap-$mode.json" 2>&1 | quiet \
        | grep -E "ms/token|Error" | sed "s/^/[$mode] /" | tee -a "$OUT/generate-persistentcap.log"
  done
  ;;
topkab)
  # sixtieth session: top_k alone's select and draw as one launch (fused_sample._top_k_search_kernel) and its resolve
  # by ranks. PARTS picks: "sampler" the sampler alone against the fused_sample.py copies in BASELINES (carried .ab
  # files) with each launch profiled (about 4 minutes); "tests" the sampling GPU tests (about 4); "generate"
  # LLM.generate with top_k 50 beside greedy against .ab/base, one process a tree in TREES
  case " ${PARTS:-sampler} " in *" sampler "*)
    timeout 400 python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 1 32 --scale 3 0.3 \
        --baseline ${BASELINES:-.ab/fused_sample_head.py} --profile --profile-order --out "$OUT/fused-sample-topk.json" \
        2>&1 | quiet | grep -vE "^$" | tee "$OUT/fused-sample-topk.log"
  esac
  case " ${PARTS:-sampler} " in *" tests "*) sampler_tests_kept topk-tests; esac
  case " ${PARTS:-sampler} " in *" generate "*) generate_ab topk temperature=0 temperature=0.6,top_k=50; esac
  ;;
topkbatch)
  # sixtieth session, prepared: the one-launch cut search and draw (top_k's, with top_p's kept-key cut) forced at
  # 33-256 rows (OSTINATO_SAMPLER_PERSISTENT=1) against the default's separate launches there, one process each, in
  # turns; the sampler alone in 10-call graphs. Read the top_k rows and top_k + top_p (top_p alone forced is top_p's
  # kernel, which lost at 256 peaked rows in the fifty-first session). About 5 minutes
  n=0
  for mode in auto 1 auto 1; do
    n=$((n + 1))
    OSTINATO_SAMPLER_PERSISTENT=$mode timeout 150 python benchmarks/bench_fused_sample.py --vocab 128256 \
        --batch-sizes 64 128 256 --scale 3 0.3 --graph-calls 10 --out "$OUT/fused-sample-batch-$mode-$n.json" 2>&1 \
        | quiet | grep -E "graph|Error" | sed "s/^/[$mode] /" | tee -a "$OUT/fused-sample-batch.log"
  done
  ;;
topkncu)
  # sixtieth session, prepared: top_k's one launch (OSTINATO_SAMPLER_PERSISTENT default) and the separate pass 0 and
  # pass 1 (=0) under Nsight Compute at 32 flat rows, top_k 50: why a pass over the row costs about three times the
  # acceptance pass's read of it (stall reasons per issued instruction, occupancy, DRAM and issue throughput)
  for form in "auto _top_k_search_kernel 1" "0 _top_k_pass_kernel 2"; do
    set -- $form
    OSTINATO_SAMPLER_PERSISTENT=$1 timeout 240 ncu --clock-control none -k "regex:$2" -c "$3" --set full \
        -o "$OUT/topk" -f python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 32 --scale 0.3 \
        --out "$OUT/ncu-bench-$2.json" 2>&1 | tail -3 > "$OUT/topk-ncu-run-$2.log"
    ncu --import "$OUT/topk.ncu-rep" --page raw --csv 2>/dev/null | python -c "
import csv, sys
rows = list(csv.reader(sys.stdin)); names = rows[0]
keys = ('issue_stalled', 'achieved_occupancy', 'dram__throughput.avg.pct', 'sm__inst_executed.sum ',
        'smsp__issue_active.avg.pct', 'registers_per_thread', 'gpu__time_duration.sum')
for vals in rows[2:]:
    print('--- launch')
    for n, v in zip(names, vals):
        if any(k.strip() in n for k in keys) and ('issue_stalled' not in n or 'average_warp' in n) and v not in ('', '0'):
            print(n, v)
" 2>&1 | keep "topk-ncu-$2" 80
    rm -f "$OUT/topk.ncu-rep"
  done
  ;;
keptab)
  # fifty-eighth session: top_p's cut found over what top_k keeps (fused_sample._kept_top_p_kernel). The sampling
  # GPU tests; the sampler alone against the session's starting sampler (.ab/fused_sample_head.py: `git show
  # 71a4495:ostinato/runner/fused_sample.py`); LLM.generate with top_k and top_p (Qwen3's own 20 / 0.95, and 50 /
  # 0.9 with min_p 0.05) beside greedy against the starting tree (.ab/base: `git archive 71a4495 ostinato | tar -x
  # -C .ab/base`), one process each. PARTS picks ("tests sampler" about 6 minutes, "generate" about 4)
  case " ${PARTS:-tests sampler} " in *" tests "*) sampler_tests_kept kept-tests; esac
  case " ${PARTS:-tests sampler} " in *" sampler "*)
    timeout 200 python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 1 32 256 --scale 3 0.3 \
        --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-kept.json" 2>&1 | quiet | grep -vE "^$" \
        | tee "$OUT/fused-sample-kept.log"
  esac
  case " ${PARTS:-tests sampler} " in *" generate "*)
    generate_ab kept temperature=0 temperature=0.6,top_k=20,top_p=0.95 temperature=0.6,top_k=50,top_p=0.9,min_p=0.05
  esac
  ;;
persistentab)
  # fifty-first session: top_p 0.9 through LLM.generate at bs 1 and 32 (greedy beside it) with the one-launch search
  # by default and off (OSTINATO_SAMPLER_PERSISTENT unset / 0), in turns, one process each. About 5 minutes
  for p in auto 0 auto 0; do
    OSTINATO_SAMPLER_PERSISTENT=$p timeout 100 python benchmarks/bench_generate.py --models llama-3.2-1b \
        --batch-sizes 1 32 --temperature 0 0.6 --top-p 0.9 --repeats 1 --out "$OUT/generate-persistentab-$p.json" \
        2>&1 | quiet | grep -E "ms/token|Error" | sed "s/^/[persistent $p] /" | tee -a "$OUT/generate-persistentab.log"
  done
  ;;
ifnode)
  # fifty-first session: what a CUDA graph IF node (benchmarks/graph_if_node.run_if) costs skipped and taken, beside
  # the plain launches it would skip (benchmarks/probe_graph_if_node.py). Its first run also had the sampler's cut
  # search under one (tried, not kept: the ifnode-* results and docs/gpu-notes.md). About 1 minute
  (cd benchmarks && timeout 100 python probe_graph_if_node.py --out "$OUT/probe-graph-if-node.json" 2>&1 \
      | quiet | tee "$OUT/probe-graph-if-node.log")
  ;;
verdictprofile)
  # fiftieth session: the sampler's kernels by profile at 256 rows of peaked logits (where top_p measured 568 -> 672 us
  # with the verdict), the session's starting fused_sample.py beside the tree. About 1 minute
  timeout 150 python benchmarks/bench_fused_sample.py --vocab 128256 --batch-sizes 256 --scale 3 --profile \
      --baseline .ab/fused_sample_head.py --out "$OUT/fused-sample-profile-verdict.json" 2>&1 | quiet \
      | grep -vE "^$" | tee "$OUT/fused-sample-profile-verdict.log"
  ;;
filtersab)
  # forty-ninth session: top_k 200 and top_p 0.9 through LLM.generate at bs 32 (greedy beside them), this tree
  # against the session's starting tree (.ab/base, carried: `git archive 1ced655 ostinato | tar -x -C .ab/base`), in
  # turns, one process each. About 6 minutes (FILTERS=p: top_p alone, 3 minutes)
  for filt in "--top-k 200" "--top-p 0.9"; do
    [ "${FILTERS:-}" = p ] && [ "$filt" = "--top-k 200" ] && continue
    for tree in new base; do
      pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
      PYTHONPATH=$pp timeout 170 python benchmarks/bench_generate.py --models llama-3.2-1b --batch-sizes 32 \
          --temperature 0 0.6 $filt --repeats 2 --out "$OUT/generate-filters-$tree-${filt// /}.json" 2>&1 | quiet \
          | grep -E "ms/token|Error" | sed "s/^/[$tree] /" | tee -a "$OUT/generate-filters-ab.log"
    done
  done
  ;;
hop)
  # what one GEMV-to-GEMV hand-off costs by its form (a launch in a graph, PDL, a persistent kernel's gpu-scope
  # flag, the flag with the next weights loaded before the wait), benchmarks/hop_latency.cu, CUDA C++ built here with
  # nvcc; the last two chains read one W (in L2). First run: forty-eighth session. About 1 minute
  nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/hop_latency benchmarks/hop_latency.cu 2>&1 \
      | tee "$OUT/hop-latency-build.log"
  for args in "1024 112" "2048 64" "1024 16" "1024 112 20 1" "2048 64 20 1"; do
    timeout 60 /tmp/hop_latency $args 20 2>&1 | tee -a "$OUT/hop-latency.log"; echo "rc $?" >> "$OUT/hop-latency.log"
  done
  ;;
secondauto)
  # forty-eighth session: the second best's check by default where top_p is the batch's one filter
  # (OSTINATO_SAMPLER_SECOND unset: "auto") against never ("0"), top_p 0.9 through LLM.generate at bs 32 (greedy
  # beside it), in turns, one process each. About 5 minutes
  for second in auto 0 auto 0; do
    bench_at_second "$second" generate-secondauto --top-p 0.9
  done
  ;;
drawoffline)
  # forty-sixth session: the offline shape at T=0.6 then greedy, in turns with the tree in .ab/base. About 5 minutes
  i=0
  for tree in new base new base; do
    i=$((i + 1)); pp=$PYTHONPATH; [ "$tree" = base ] && pp=$PWD/.ab/base:$PYTHONPATH
    PYTHONPATH=$pp timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b \
        --dtype bfloat16 --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 \
        --out "$OUT/offline-drawgraph-$i-$tree.json" 2>&1 | quiet | grep -E "ostinato T|decode steps" \
        | sed "s/^/[$tree] /" | tee -a "$OUT/offline-drawgraph.log"
  done
  ;;
order)
  # forty-fifth session: decode rows longest context first (the attention kernel's programs launch in row order),
  # first at the step level on mixed batches (the same lengths in random order, sorted longest first, shortest
  # first; every case in one process), then the offline shape in turns with arrival order (--arrival-order, as
  # before; Scheduler.longest_first, now the default). About 6 minutes
  timeout 200 python benchmarks/bench_decode.py --models qwen3-0.6b --modes graph --no-launches --iters 50 \
      --cases 256:100-1500 256:100-1500:desc 256:100-1500:asc 192:100-1500 192:100-1500:desc 128:100-1500 \
      128:100-1500:desc 256:100-1500 256:100-2000 256:100-2000:desc --out "$OUT/decode-order.json" 2>&1 | quiet \
      | tail -14 | tee "$OUT/decode-order.log"
  i=0
  for arm in arrival longest arrival longest; do
    i=$((i + 1)); flag=""; [ "$arm" = arrival ] && flag=--arrival-order
    timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
        --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 $flag \
        --out "$OUT/offline-order-$i-$arm.json" 2>&1 | quiet \
        | grep -E "ostinato T|decode steps|129-256|65-128" | sed "s/^/[$arm] /" | tee -a "$OUT/offline-order.log"
  done
  ;;
longestfirst)
  # forty-fifth session, with decode rows longest context first by default: the engine-level GPU tests (in
  # parallel, before any timing), the offline shape at the default in two processes, then the split entries at
  # mixed batches sorted that way (balancing at 65-128 rows, none at 129-256, beside the table). About 7 minutes
  logs=$(mktemp -d); k="gpu or cuda or GPU or Cuda or kernel"
  t() { local n=$1; shift; timeout 170 python -m pytest -q -p no:cacheprovider "$@" > "$logs/$n.log" 2>&1; }
  (t models tests/test_gpu.py; t overlap tests/test_overlap.py) &  # three engines at once at most (tests, above)
  (t prefix tests/test_gpu_prefix.py; t sampling_features tests/test_sampling_features_gpu.py) &
  (t granite tests/test_granite_hybrid_gpu.py -k "$k"; t vlm tests/test_vlm.py tests/test_vit_graph_gpu.py -k "$k") &
  wait
  for f in "$logs"/*.log; do echo "$(basename "$f" .log): $(tail -1 "$f")"; grep -h -E "^(FAILED|ERROR)" "$f"; done \
      | tee "$OUT/longestfirst-tests.log"
  for i in 1 2; do
    timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
        --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 \
        --out "$OUT/offline-longestfirst-$i.json" 2>&1 | quiet | grep -E "ostinato T|decode steps|129-256|65-128" \
        | tee -a "$OUT/offline-longestfirst.log"
  done
  timeout 240 python benchmarks/bench_decode.py --models qwen3-0.6b --modes graph --no-launches --iters 50 \
      --cases 256:100-1500:desc 192:100-1500:desc 128:100-1500:desc 96:100-1500:desc 256:1024 128:1024 \
      --decode-entry table "256:balance=False" "128:balance=True,programs_per_sm=16" table \
      --out "$OUT/decode-longestfirst-entries.json" 2>&1 | quiet | grep -E "graph|x of the first" \
      | tee "$OUT/decode-longestfirst-entries.log"
  ;;
balance128)
  # forty-fifth session: with rows longest first, balancing entry 128 (65-128 rows) took 2.3% / 7.1% off 128 / 96-row
  # steps of 100-1,500-token contexts and cost 0.7% at 128 x 1024 (decode-longestfirst-entries-h200-20261128-s45):
  # the offline shape in turns with the table (T=0.6 then greedy), then mixed and one-context batches of 48-128
  # rows (48 and 64 take entry 32: controls). About 5 minutes
  i=0
  for entry in table "128:balance=True,programs_per_sm=16" table "128:balance=True,programs_per_sm=16"; do
    i=$((i + 1))
    timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
        --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0.6 0 --decode-entry "$entry" \
        --out "$OUT/offline-balance128-$i.json" 2>&1 | quiet | grep -E "ostinato T|decode steps|129-256|65-128|33-64" \
        | sed "s/^/[$entry] /" | tee -a "$OUT/offline-balance128.log"
  done
  timeout 200 python benchmarks/bench_decode.py --models qwen3-0.6b --modes graph --no-launches --iters 50 \
      --cases 128:100-1500:desc 96:100-1500:desc 64:100-1500:desc 48:100-1500:desc 128:1024 64:1024 128:4096 \
      64:4096 --decode-entry table "128:balance=True,programs_per_sm=16" table \
      --out "$OUT/decode-balance128.json" 2>&1 | quiet | grep -E "graph" | grep -v "x of the first" \
      | tee "$OUT/decode-balance128.log"
  ;;
profile256)
  # prepared in the forty-fifth session, first run in the forty-seventh: where a sorted mixed 256-row step's time goes over its bytes
  # (the offline shape's 129-256-row steps: about 1.07 ms a step over a 4.94 ms floor at the new default), kernel
  # by kernel, beside one context for all. About 2 minutes
  timeout 200 python benchmarks/bench_decode.py --models qwen3-0.6b --modes graph --no-launches --iters 50 \
      --cases 256:100-1500:desc 256:1024 --profile 256:100-1500:desc 256:1024 \
      --out "$OUT/decode-profile256.json" 2>&1 | quiet | tee "$OUT/decode-profile256.full.log" \
      | grep -E "graph|profile bs" | tee "$OUT/decode-profile256.log"  # the kernel tables: the full log
  ;;
balance256)
  # forty-third session: `128:balance` (above) made the offline shape 69.0-69.3 -> 70.1-70.2% of the floor, its
  # 129-256-row steps 3% faster, but its 65-128-row steps 3% slower and one-context batches 0.1-0.9% slower
  # (offline-balance-h200-20261128-s43.log). Balancing at 129-256 rows only, its splits now counted in one launch
  # (compute_num_kv_splits' kernel) where the torch ops took eight. About 6 minutes
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_triton_attention.py -k "balanc or graph_path" 2>&1 \
      | tail -1 | tee "$OUT/balance-tests.log"
  offline_entries offline-balance256 table "256:balance=True,programs_per_sm=16" table \
      "256:balance=True,programs_per_sm=32"
  timeout 150 python benchmarks/bench_decode.py --models qwen3-0.6b --cases 256:1024 256:4096 200:2048 --modes graph \
      --no-launches --iters 50 --decode-entry table "256:balance=True,programs_per_sm=16" \
      "256:balance=True,programs_per_sm=32" table --out "$OUT/decode-balance256-uniform.json" 2>&1 | quiet \
      | grep -E "x of the first|Error" | tee "$OUT/decode-balance256-uniform.log"
  ;;
sampleprobe)
  # prepared in the forty-third session: with requests finishing at different steps, T=0.6 left the GPU idle for
  # longer than greedy (sample-step-churn-probe-h200-20261128-s43.json); the runner's host ms a call, how often the
  # sampling inputs were rebuilt, and each run once more under cProfile say where. About 2 minutes
  timeout 240 python benchmarks/probe_sample_step.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
      --batch-sizes 256 --output-len 32 224 --temperature 0 0.6 0 0.6 --cprofile \
      --out "$OUT/sample-step-host-probe.json" 2>&1 | grep -vE "USDT|UserWarning|self.profiler|warn_once" \
      | tee "$OUT/sample-step-host-probe.log" | grep -E "^bs|host "
  ;;
drawsplits)
  # prepared in the forty-second session: the plain T=0.6 draw took 15.6 us of Llama-3.2-1B's bs-32 step (thirty-fifth
  # session's boundary), about four times the read of its 16 MB of logits; at bs 32 the tree gives it 16 splits a row
  # (512 programs of 8,192 columns, four dependent 2,048-column loads each). More, shorter programs keep more loads
  # in flight. The draws are the same bits at any split count (Gumbel-max with the same noise, ties to the lowest
  # index); the cut searches' gather capacity also moves with the splits, so adopting one means the sampler tests
  for n in 1024 2048; do
    sed "s/^_TARGET_PROGRAMS = 512 /_TARGET_PROGRAMS = $n /" ostinato/runner/fused_sample.py > "/tmp/fused_sample_$n.py"
  done
  for v in 128256 151936; do
    timeout 240 python benchmarks/bench_fused_sample.py --vocab $v --batch-sizes 1 32 64 256 --profile \
        --baseline /tmp/fused_sample_1024.py /tmp/fused_sample_2048.py --out "$OUT/draw-splits-$v.json" 2>&1 \
        | grep -vE "^\s*$" | tee "$OUT/draw-splits-$v.log" | grep -A1 "top_k None top_p None" | head -40
  done
  ;;
copyrate)
  timeout 60 python benchmarks/copy_rate_probe.py "$OUT/copy-rate.json" 2>&1 | tail -8 | tee "$OUT/copy-rate.log"
  ;;
offline)
  timeout 150 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
      --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --temperature 0 0.6 \
      --out "$OUT/offline.json" 2>&1 | quiet | tail -5 | tee "$OUT/offline.log"
  timeout 100 python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b --dtype bfloat16 \
      --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf --kv-cache-dtype fp8_e4m3 \
      --out "$OUT/offline-fp8.json" 2>&1 | quiet | tail -4 | tee "$OUT/offline-fp8.log"
  for m in granite-4.0-h-1b llama-3.2-1b; do
    timeout 100 python benchmarks/bench_offline.py --load-format dummy --model $m --dtype bfloat16 --num-seqs 256 \
        --input-len 100 1024 --output-len 100 1024 --no-hf --out "$OUT/offline-$m.json" 2>&1 | quiet | tail -3 \
        | tee -a "$OUT/offline-hybrid.log"
  done
  timeout 90 python -c "
import logging; logging.basicConfig(level=logging.INFO)
from ostinato import LLM
LLM('llama-3.2-1b', load_format='dummy')  # default sizes: logs capture time and graph memory
" 2>&1 | grep -E "captured|KV pool|memory:" | tee "$OUT/startup.log"
  ;;
serving)
  # issue 18's shape: four HTTP processes, the client in four processes; mixed chunk off and on after one
  # offline phase
  timeout 500 python benchmarks/bench_serving_overhead.py --model llama-3.2-1b --load-format dummy --dtype bfloat16 \
      --concurrency 1 64 256 --num-prompts 1024 --api-server-counts 4 --client-procs 4 \
      --server-variants plain= mixed=--enable-mixed-chunk \
      --out "$OUT/serving-overhead.json" 2>&1 | quiet | tail -30 | tee "$OUT/serving-overhead.log"
  ;;
piecewise)
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_piecewise_gpu.py 2>&1 | quiet | tail -15 \
      | tee "$OUT/piecewise-tests.log"
  timeout 200 python benchmarks/bench_extend.py --models llama-3.2-1b --startup-only --out "$OUT/pw-startup.json" \
      2>&1 | quiet | grep -E "start-up|wrote|Error" | tee "$OUT/pw-startup.log"
  timeout 200 python benchmarks/bench_extend.py --models llama-3.2-1b --skip-startup --tokens 4 16 64 256 1024 2048 \
      --out "$OUT/extend-pw.json" 2>&1 | quiet | tail -16 | tee "$OUT/extend-pw.log"
  ;;
mixed)
  timeout 230 python benchmarks/bench_itl_prefill.py --model llama-3.2-1b --load-format dummy --dtype bfloat16 \
      --out "$OUT/itl-prefill.json" 2>&1 | quiet | tail -8 | tee "$OUT/itl-prefill.log"
  timeout 230 python benchmarks/bench_ttft_piecewise.py --model llama-3.2-1b --load-format dummy --dtype bfloat16 \
      --out "$OUT/ttft-piecewise.json" 2>&1 | quiet | tail -24 | tee "$OUT/ttft-piecewise.log"
  ;;
esac
# the device tool brings back at most 8 files a call: past that, one archive of them all
# (2026-11-28: the floor part's JSON files stayed behind)
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -C "$OUT" -czf "/tmp/$part.tgz" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/$part.tgz" "$OUT/"
fi
exit 0
