"""bench_offline.py's step log (`logged_steps`: each step's mode, rows and context, timed by the step() call after
it) and its table by batch rows (`bucket_table`), on the CPU engine."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_offline import bucket_table, logged_steps, step_split  # noqa: E402


def test_bucket_table_sums_by_rows_and_floors_each_step():
    log = [("extend", 3, 90, 0.5), ("decode", 3, 93, 0.1), ("extend", 1, 12, 0.25), ("decode", 2, 70, 0.2),
           ("decode", 40, 4000, 0.3), ("decode", 1, 36, 0.05)]
    table = bucket_table(log, weight_bytes=1000, kv_token=10, bw=1e4)
    assert table == [
        {"rows": "1-8", "steps": 3, "seconds": pytest.approx(0.35), "floor_s": pytest.approx((3000 + 1990) / 1e4)},
        {"rows": "33-64", "steps": 1, "seconds": pytest.approx(0.3), "floor_s": pytest.approx(41000 / 1e4)},
        {"rows": "extend", "steps": 2, "seconds": pytest.approx(0.75), "floor_s": None, "step_seconds": [0.5, 0.25]},
    ]


def test_logged_steps_records_what_each_step_ran(tiny_llama_path):
    from ostinato import LLM, SamplingParams

    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=512)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 9, 14)]
    outs = [3, 6, 9]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
    core = llm.engine
    before = step_split(llm)
    with logged_steps(llm) as log:
        llm.generate(prompts, params, use_tqdm=False)
    split = step_split(llm, before)
    assert "step" not in vars(core) and "schedule" not in vars(core.scheduler)  # the class's methods again

    decode = [(n, ctx) for mode, n, ctx, sec in log if mode == "decode"]
    assert [mode for mode, *_ in log].count("extend") == split["extend_steps"] >= 1
    assert len(decode) == split["decode_steps"]
    assert all(sec > 0 for *_, sec in log)
    # rows fall as requests finish: 3 rows until the first has its 3 tokens, then 2, then 1
    rows = [n for n, _ in decode]
    assert rows == sorted(rows, reverse=True) and rows[0] == 3 and rows[-1] == 1
    assert rows.count(3) == 2 and rows.count(2) == 3 and rows.count(1) == 3  # the extend step samples each first token
    # the context a decode step reads: every row's prompt and outputs so far, growing by one a row each step
    assert decode[0][1] == (5 + 1) + (9 + 1) + (14 + 1)
    assert decode[1][1] == decode[0][1] + 3


def test_logged_steps_times_a_step_by_the_call_after_it():
    """Under overlap scheduling a step() call launches its step and returns once the one before it is done: so a
    step's seconds are the next call's. A fake engine whose call i sleeps as long as step i - 1 ran pins that."""
    import time
    from types import SimpleNamespace

    from ostinato.attention.forward_batch import ForwardMode

    plan = [(ForwardMode.EXTEND, 2, 0.0), (ForwardMode.DECODE, 2, 0.08), (ForwardMode.DECODE, 1, 0.01), None]

    class Scheduler:
        def __init__(self):
            self.i = 0

        def schedule(self):
            item = plan[self.i]
            self.i += 1
            if item is None:
                return None
            reqs = [SimpleNamespace(seq_len=10 * self.i)] * item[1]
            return SimpleNamespace(mode=item[0], reqs=reqs)

    class Core:
        def __init__(self):
            self.scheduler = Scheduler()

        def step(self):
            i = self.scheduler.i
            self.scheduler.schedule()
            if i > 0 and plan[i - 1] is not None:
                time.sleep(plan[i - 1][2] + 0.02)  # reading back step i - 1: as long as it ran
            return []

    llm = SimpleNamespace(engine=Core())
    with logged_steps(llm) as log:
        for _ in plan:
            llm.engine.step()
    assert [(mode, n, ctx) for mode, n, ctx, _ in log] == [("extend", 2, 20), ("decode", 2, 40), ("decode", 1, 30)]
    seconds = [sec for *_, sec in log]
    assert 0.02 <= seconds[0] < 0.1 and 0.1 <= seconds[1] < 0.3 and 0.03 <= seconds[2] < 0.1
