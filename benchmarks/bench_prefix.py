"""Prefix caching on vs off, in one run on one engine (the cache is swapped between runs; each run starts with
an empty tree, so the first requests of a run still compute everything):

(a) shared system prompt: N requests = one S-token system prompt + a Q-token question each, O output tokens
    (ignore_eos); output tok/s over the whole batch (prefill included).
(b) multi-turn chat: C conversations, T turns; each turn appends U new user tokens to the conversation so far
    (earlier prompts and answers) and generates A tokens. TTFT of a request = from add_request to the engine
    step that returns its first token (engine-level stepping, host clock, overlap scheduling on as in
    serving); reported as the mean over the requests of each turn and of all turns.
(c) the nano-vllm random shape (nothing shared): random prompts of 100-1024 ids, outputs 100-1024 (ignore_eos),
    seed 0; output tok/s. The cache can only cost here (matching, inserting, evicting).

GPU: python benchmarks/bench_prefix.py                    (dummy Llama-3.2-1B bf16; ~3 min on an H200)
CPU smoke: python benchmarks/bench_prefix.py --model <SmolLM2 .gguf> --small
"""

import argparse
import os
import platform
import random
import sys
import time

import torch
from common import RESULTS, device_tag, write_report

from ostinato import LLM, SamplingParams
from ostinato.engine.prefix_cache import PrefixCache


def set_prefix_cache(llm: LLM, enabled: bool) -> PrefixCache:
    """A fresh, empty prefix cache (on or off) for the (idle) engine; the old one's pages go back first."""
    engine, sched = llm.engine, llm.engine.scheduler
    assert not engine.has_unfinished()
    if sched.cache.tree is not None:
        sched.cache.tree.evict(1 << 40)
    engine.check_memory_leak()
    sched.cache = PrefixCache(sched.kv, enabled=enabled)
    return sched.cache


def run_batch(llm: LLM, prompts: list[list[int]],
              params: list[SamplingParams]) -> tuple[list[list[int]], list[float], float]:
    """Outputs, TTFT of each request (s) and the batch's wall time, stepping the engine directly."""
    engine = llm.engine
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rid = f"b{llm._counter}"
        llm._counter += 1
        engine.add_request(rid, p, sp)
        rids.append(rid)
    outs: dict[str, list[int]] = {r: [] for r in rids}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        step_out = engine.step()
        now = time.perf_counter()
        for o in step_out:
            if o.new_token_ids and o.rid not in first:
                first[o.rid] = now
            outs[o.rid].extend(o.new_token_ids)
    sync()
    elapsed = time.perf_counter() - start
    return [outs[r] for r in rids], [first[r] - start for r in rids], elapsed


def shared_prompt(llm: LLM, a, vocab: int) -> dict:
    rng = random.Random(1)
    system = [rng.randrange(100, vocab - 100) for _ in range(a.system_len)]
    prompts = [system + [rng.randrange(100, vocab - 100) for _ in range(a.question_len)] for _ in range(a.num_shared)]
    params = [SamplingParams(temperature=0.0, max_tokens=a.shared_output_len, ignore_eos=True)] * len(prompts)
    row: dict = {"case": "shared_system_prompt", "num_requests": a.num_shared, "system_len": a.system_len,
                 "question_len": a.question_len, "output_len": a.shared_output_len}
    results = {}
    for enabled in (False, True):
        cache = set_prefix_cache(llm, enabled)
        outs, _, elapsed = run_batch(llm, prompts, params)
        n_out = sum(len(o) for o in outs)
        key = "on" if enabled else "off"
        row[f"{key}_seconds"] = elapsed
        row[f"{key}_output_tok_s"] = n_out / elapsed
        if enabled:
            row["on_hit_rate"] = cache.hit_tokens / max(cache.query_tokens, 1)
        results[key] = outs
    row["speedup"] = row["on_output_tok_s"] / row["off_output_tok_s"]
    same = sum(x == y for x, y in zip(results["on"], results["off"], strict=True))
    row["outputs_equal_fraction"] = same / len(prompts)
    return row


def multi_turn(llm: LLM, a, vocab: int) -> dict:
    row: dict = {"case": "multi_turn_chat", "conversations": a.conversations, "turns": a.turns,
                 "turn_len": a.turn_len, "answer_len": a.answer_len}
    for enabled in (False, True):
        cache = set_prefix_cache(llm, enabled)
        rng = random.Random(2)  # the same user turns in both runs
        convs: list[list[int]] = [[] for _ in range(a.conversations)]
        per_turn = []
        total = 0.0
        for _ in range(a.turns):
            prompts = [c + [rng.randrange(100, vocab - 100) for _ in range(a.turn_len)] for c in convs]
            params = [SamplingParams(temperature=0.0, max_tokens=a.answer_len, ignore_eos=True)] * len(prompts)
            outs, ttfts, elapsed = run_batch(llm, prompts, params)
            total += elapsed
            per_turn.append(sum(ttfts) / len(ttfts))
            convs = [p + o for p, o in zip(prompts, outs, strict=True)]
        key = "on" if enabled else "off"
        row[f"{key}_ttft_mean_s"] = sum(per_turn) / len(per_turn)
        row[f"{key}_ttft_per_turn_s"] = per_turn
        row[f"{key}_seconds"] = total
        if enabled:
            row["on_hit_rate"] = cache.hit_tokens / max(cache.query_tokens, 1)
    row["ttft_ratio_off_over_on"] = row["off_ttft_mean_s"] / row["on_ttft_mean_s"]
    return row


def random_shape(llm: LLM, a, vocab: int) -> dict:
    rng = random.Random(0)
    lo, hi = a.random_input_len
    olo, ohi = a.random_output_len
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(a.num_seqs)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(olo, ohi), ignore_eos=True) for _ in prompts]
    row: dict = {"case": "nano_vllm_random", "num_seqs": a.num_seqs, "input_len": [lo, hi], "output_len": [olo, ohi]}
    for enabled in (False, True):
        set_prefix_cache(llm, enabled)
        outs, _, elapsed = run_batch(llm, prompts, params)
        key = "on" if enabled else "off"
        row[f"{key}_seconds"] = elapsed
        row[f"{key}_output_tok_s"] = sum(len(o) for o in outs) / elapsed
    row["on_over_off"] = row["on_output_tok_s"] / row["off_output_tok_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--load-format", default=None, help="default: dummy for a preset name, auto otherwise")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke test")
    ap.add_argument("--num-shared", type=int, default=256)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--question-len", type=int, default=100)
    ap.add_argument("--shared-output-len", type=int, default=128)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-len", type=int, default=300)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--num-seqs", type=int, default=256, help="requests of the nano-vllm random shape")
    ap.add_argument("--random-input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--random-output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--cases", nargs="+", default=["shared", "multi_turn", "random"])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/prefix-<device>.json)")
    a = ap.parse_args()
    if a.small:
        a.num_shared, a.system_len, a.question_len, a.shared_output_len = 8, 64, 8, 4
        a.conversations, a.turns, a.turn_len, a.answer_len = 2, 3, 16, 4
        a.num_seqs, a.random_input_len, a.random_output_len = 8, [16, 64], [4, 16]
    preset = os.path.sep not in a.model and not a.model.endswith(".gguf")
    load_format = a.load_format or ("dummy" if preset else "auto")
    llm = LLM(a.model, load_format=load_format, dtype=a.dtype)
    runner = llm.engine.runner
    device, vocab = runner.device, runner.vocab_size
    warm = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (8, 300)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    rows = []
    cases = {"shared": shared_prompt, "multi_turn": multi_turn, "random": random_shape}
    for name in a.cases:
        t = time.perf_counter()
        rows.append(cases[name](llm, a, vocab))
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
    set_prefix_cache(llm, True)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {"device": dev_name, "device_type": device.type, "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": a.model,
              "load_format": load_format, "dtype": str(runner.dtype), "max_total_tokens": runner.max_total_tokens,
              "page_size": runner.kv_manager.page_size,
              "targets": {"shared_speedup": ">= 3", "multi_turn_ttft_ratio": ">= 2", "random_on_over_off": ">= 0.98"},
              "rows": rows}
    print(f"{'case':<22}{'off':>14}{'on':>14}{'on vs off':>12}  metric")
    for r in rows:
        if r["case"] == "multi_turn_chat":
            print(f"{r['case']:<22}{r['off_ttft_mean_s'] * 1e3:>12.1f}ms{r['on_ttft_mean_s'] * 1e3:>12.1f}ms"
                  f"{r['ttft_ratio_off_over_on']:>11.2f}x  mean TTFT (off/on; hit rate {r['on_hit_rate']:.1%})")
        else:
            ratio = r.get("speedup", r.get("on_over_off"))
            print(f"{r['case']:<22}{r['off_output_tok_s']:>14.1f}{r['on_output_tok_s']:>14.1f}{ratio:>11.3f}x"
                  "  output tok/s (on/off)")
    write_report(report, a.out or os.path.join(RESULTS, f"prefix-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
