export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
gen() { PYTHONPATH=$1 python3 bench_generate.py --models llama-3.2-1b qwen3-0.6b --batch-sizes 1 32 --temperature 0 0.6 --out $OUT/$2.json 2>&1 | grep -E "ms/token" ; }
dec() { PYTHONPATH=$1 python3 bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 1:1024 32:128 --modes graph --no-launches --iters 100 --out $OUT/$2.json 2>&1 | grep -E "^(llama|qwen|device)" ; }
gen $PWD/../.bench-deps/base generate-base-519b99e
gen $PWD/.. generate-new
dec $PWD/../.bench-deps/base decode-base-519b99e
dec $PWD/.. decode-new
gen $PWD/../.bench-deps/base generate-base-519b99e-run2
gen $PWD/.. generate-new-run2
