"""Granite-4.0-H (hybrid Mamba2 + attention): the torch mixer pieces against float64 references, and a tiny
random-weight checkpoint through the normal loader and engine against transformers (chunked prefill,
retraction, reused Mamba slots)."""

import json

import pytest
import torch
import torch.nn.functional as F

from ostinato.layers.mamba2 import causal_conv_extend, causal_conv_step, ssd_scan, ssm_step
from ostinato.mem.mamba_pool import HybridReqToTokenPool, MambaPool

transformers = pytest.importorskip("transformers")

VOCAB = 160


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: intra-op threads only add overhead (and stall badly on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
NEW_TOKENS = 20


def sequential_scan(x, dt, A, B, C, state):
    """The SSM recurrence token by token in float64: the oracle for the chunked scan."""
    x, dt, A, B, C, state = (t.double() for t in (x, dt, A, B, C, state))
    ys = []
    for t in range(x.shape[0]):
        state = torch.exp(dt[t] * A)[:, None, None] * state + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, C[t]))
    return torch.stack(ys), state


@pytest.mark.parametrize("n,chunk", [(1, 8), (7, 8), (8, 8), (29, 8), (40, 16)])
def test_ssd_scan_matches_sequential_recurrence(n, chunk):
    g = torch.Generator().manual_seed(n * 100 + chunk)
    H, P, N = 3, 5, 4
    x, B, C = torch.randn(n, H, P, generator=g), torch.randn(n, H, N, generator=g), torch.randn(n, H, N, generator=g)
    dt = F.softplus(torch.randn(n, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    s0 = torch.randn(H, P, N, generator=g)
    y, s = ssd_scan(x, dt, A, B, C, s0, chunk)
    y_ref, s_ref = sequential_scan(x, dt, A, B, C, s0)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, atol=1e-4, rtol=1e-4)
    # the step form, token by token from the same state, agrees too
    state = s0[None]
    for t in range(n):
        y_t, state = ssm_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], state)
        torch.testing.assert_close(y_t[0].double(), y_ref[t], atol=1e-4, rtol=1e-4)


def test_causal_conv_split_anywhere_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    D, K, n = 6, 4, 11
    x, w, b = torch.randn(n, D, generator=g), torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    full, state = causal_conv_extend(x, torch.zeros(D, K - 1), w, b)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], b, padding=K - 1, groups=D)[0, :, :n]).t()
    torch.testing.assert_close(full, ref)
    for cut in (1, 2, 5):  # a prefill chunk, then the rest as chunks or single steps
        a, st = causal_conv_extend(x[:cut], torch.zeros(D, K - 1), w, b)
        b1, st1 = causal_conv_extend(x[cut:], st, w, b)
        torch.testing.assert_close(torch.cat([a, b1]), ref)
        torch.testing.assert_close(st1, state)
        outs, s = [], st[None]
        for t in range(cut, n):
            o, s = causal_conv_step(x[t : t + 1], s, w, b)
            outs.append(o)
        torch.testing.assert_close(torch.cat([a, *outs]), ref)


def test_varlen_conv_equals_per_request_conv():
    from ostinato.layers.mamba2 import causal_conv_varlen, extend_conv_indices

    g = torch.Generator().manual_seed(1)
    D, K, lens = 6, 4, [1, 7, 2, 3]
    x, w, b = torch.randn(sum(lens), D, generator=g), torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    state = torch.randn(6, D, K - 1, generator=g)
    slots = torch.tensor([5, 2, 0, 3])
    ref_state = state.clone()
    refs, start = [], 0
    for s, n in zip(slots.tolist(), lens, strict=True):
        out, ref_state[s] = causal_conv_extend(x[start : start + n], state[s], w, b)
        refs.append(out)
        start += n
    taps, new_rows, cu = extend_conv_indices(lens, K)
    assert cu.tolist() == [0, 1, 8, 10, 13]
    out = causal_conv_varlen(x, state, slots, taps, new_rows, w, b)
    torch.testing.assert_close(out, torch.cat(refs))
    torch.testing.assert_close(state, ref_state)


def test_mamba_pool_zero_fills_on_alloc_and_frees_with_the_request_row():
    pool = MambaPool(3, num_layers=2, conv_dim=5, conv_kernel=4, num_heads=2, head_dim=3, state_size=4,
                     conv_dtype=torch.float32, ssm_dtype=torch.float32, device="cpu")
    reqs = HybridReqToTokenPool(3, 16, "cpu", pool)
    rows = [reqs.alloc() for _ in range(3)]
    assert reqs.alloc() is None and pool.available_size() == 0
    slots = reqs.mamba_slots(torch.tensor(rows)).tolist()
    assert sorted(slots) == [1, 2, 3], "slot 0 is the sink"
    pool.conv.normal_()
    pool.ssm.normal_()
    reqs.free(rows[1])
    with pytest.raises(RuntimeError, match="Mamba state leak"):
        reqs.check_all_free()
    again = reqs.alloc()
    s = reqs.mamba_slots(torch.tensor([again])).item()
    assert s == slots[1] and not pool.conv[:, s].any() and not pool.ssm[:, s].any()
    assert pool.conv[:, slots[0]].any(), "other slots are untouched"
    for r in (rows[0], rows[2], again):
        reqs.free(r)
    reqs.check_all_free()


# ----------------------------------------------------------------------------------- the tiny model
def tiny_config():
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=96, intermediate_size=96, num_local_experts=0, num_experts_per_tok=0,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, position_embedding_type="nope",
        embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=1.5,
        tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["GraniteMoeHybridForCausalLM"],
    )


def _randomize_(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1)
            elif name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else 0.15))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("granite_tiny")
    model = transformers.GraniteMoeHybridForCausalLM(tiny_config())
    _randomize_(model)
    model.save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")
    fast.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    import inspect

    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite

    if "group_size" not in inspect.signature(hf_granite.GraniteMoeHybridRMSNormGated.__init__).parameters:
        # transformers 5.17 normalizes the gated output over all channels at once; later versions per group, as
        # Mamba2 defines it (and as we do). The tiny config has 2 groups; the real checkpoints have 1.
        pytest.skip(f"transformers {transformers.__version__}: its Mamba2 gated norm ignores mamba_n_groups")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from ostinato import LLM

    # 16 requests of up to 45 prompt tokens + 20 outputs need ~1000 KV slots: 256 forces retraction
    return LLM(tiny_dir, dtype="float32", device="cpu", max_total_tokens=256, chunked_prefill_size=32, page_size=4,
               max_running_requests=16)


def prompts(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(5, 46, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_greedy(hf_model, ids, n):
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_config_and_loader(tiny_dir, tiny_llm):
    cfg = json.load(open(f"{tiny_dir}/config.json"))
    assert cfg["architectures"] == ["GraniteMoeHybridForCausalLM"]
    r = tiny_llm.engine.runner
    assert r.kv_cache.layer_num == 1, "only the attention layer gets KV"
    assert r.mamba_pool.num_layers == 3 and r.mamba_pool.size == r.req_to_token_pool.size
    # the residual multiplier is folded into the branch outputs' weights (the logits tests below then check
    # the folded model against transformers)
    assert all(layer.folded for layer in r.model.layers)


def test_greedy_matches_transformers_with_chunking_and_retraction(tiny_llm, hf_tiny):
    from ostinato import SamplingParams

    ps = prompts()
    before = tiny_llm.engine.scheduler.num_retractions
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in ps],
                             SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert tiny_llm.engine.scheduler.num_retractions > before, "the KV pool was meant to force retraction"
    assert max(len(p) for p in ps) > tiny_llm.engine.runner.chunked_prefill_size // 2, "prompts cut mid-way"
    for p, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny, p, NEW_TOKENS)
    tiny_llm.engine.check_memory_leak()


def test_teacher_forced_logits(tiny_llm, hf_tiny):
    from test_models import teacher_forced_logits

    seqs = [p + q for p, q in zip(prompts(3, seed=1), prompts(3, seed=2), strict=True)]
    seqs = [s[: min(len(x) for x in seqs)] for s in seqs]  # teacher_forced_logits decodes all in step
    prefill = [len(s) - 6 for s in seqs]
    ours = teacher_forced_logits(tiny_llm.engine.runner, seqs, prefill)
    with torch.no_grad():
        for seq, p, got in zip(seqs, prefill, ours, strict=True):
            ref = hf_tiny(torch.tensor([seq])).logits[0, p - 1 : len(seq) - 1]
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_poisoned_reused_mamba_slot_gives_the_same_tokens(tiny_llm):
    from ostinato import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    p = prompts(1, seed=3)[0]
    fresh = tiny_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
    pool = tiny_llm.engine.runner.mamba_pool
    pool.conv.fill_(float("nan"))  # every free slot, the reused one among them, holds garbage
    pool.ssm.normal_(0, 100)
    again = tiny_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == fresh


def test_decode_graphs_read_mamba_slots_from_static_buffers(tiny_dir):
    """Through the CPU graph stand-in (replay re-runs the captured step over the static buffers): tokens equal
    eager ones, batches pad to captured sizes with padded rows on the sink slot, whose garbage changes nothing."""
    from ostinato import LLM, SamplingParams
    from ostinato.graphs.decode import DecodeGraphRunner

    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_total_tokens=2048, page_size=4, max_running_requests=8,
              cuda_graph_bs=[1, 2, 4, 8], skip_tokenizer_init=True)
    ps = [{"prompt_token_ids": p} for p in prompts(6, seed=4)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    runner = llm.engine.runner
    graphs = runner.graph_runner = DecodeGraphRunner(runner)
    pool = runner.mamba_pool
    replayed = []
    replay = graphs.replay

    def poisoned_replay(batch):
        replayed.append(batch.batch_size)
        # the sink slot, which only padded rows touch, holds (finite) garbage. Not NaN: padded rows' K/V go to
        # the KV sink slot, which the torch backend reads (masked, weight 0) for real rows, and 0 * NaN is NaN
        pool.conv[:, 0].normal_(0, 10)
        pool.ssm[:, 0].normal_(0, 10)
        return replay(batch)

    graphs.replay = poisoned_replay
    graphed = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert graphed == eager
    assert replayed and max(replayed) == 6 and graphs.padded_size(6) == 8
    llm.engine.check_memory_leak()


def test_abort_mid_decode_frees_the_mamba_slot(tiny_llm):
    from ostinato import SamplingParams

    engine = tiny_llm.engine
    pool = engine.runner.mamba_pool
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=5)):
        engine.add_request(f"abort-{i}", p, sp)
    for _ in range(4):
        engine.step()
    assert pool.available_size() == pool.size - 3, "each running request holds a Mamba slot"
    engine.abort("abort-1")
    assert pool.available_size() == pool.size - 2
    while engine.has_unfinished():
        engine.step()
    assert pool.available_size() == pool.size
    engine.check_memory_leak()


@pytest.mark.parametrize("name,attn,params", [("granite-4.0-h-350m", [10, 13, 17, 27], 340e6),
                                              ("granite-4.0-h-1b", [5, 15, 25, 35], 1.46e9)])
def test_presets_build_with_the_transformers_config(name, attn, params):
    from ostinato.loader.dummy import preset_path
    from ostinato.models.granite_hybrid import GraniteMoeHybridForCausalLM

    cfg = transformers.AutoConfig.from_pretrained(preset_path(name))
    assert isinstance(cfg, transformers.GraniteMoeHybridConfig)
    with torch.device("meta"):
        model = GraniteMoeHybridForCausalLM(cfg, 4096)
    assert [i for i, ly in enumerate(model.layers) if ly.self_attn is not None] == attn
    assert model.num_kv_layers == 4 and model.num_mamba_layers == cfg.num_hidden_layers - 4
    assert abs(sum(p.numel() for p in model.parameters()) - params) / params < 0.01


@pytest.mark.parametrize("capture_mixer", [True, False])
@pytest.mark.parametrize("lens,prefix_lens", [([9, 30, 20], [0, 0, 0]), ([13, 1, 27, 1], [5, 0, 17, 3])])
def test_piecewise_replay_equals_eager(tiny_llm, lens, prefix_lens, capture_mixer):
    """Piecewise graphs on a hybrid, the mixer captured inside the pieces (reading the step's tables: the
    padding is one more request, on the sink slot) or a split op between them (run eagerly on the real rows).
    Logits and the requests' Mamba states after a replay equal an eager forward's from the same states, with
    every static buffer and the tables' unused entries poisoned."""
    from test_piecewise import poison

    from ostinato.graphs.piecewise import PiecewiseGraphRunner

    runner = tiny_llm.engine.runner
    graphs = PiecewiseGraphRunner(runner, max_tokens=64, sizes=[16, 64], compiler="eager",
                                  capture_mixer=capture_mixer)
    # 3 mixers and 1 attention layer: split at the attention only, or at all four
    assert graphs.backend.splits[0].num_split_calls == (1 if capture_mixer else 4)
    assert graphs.num_pieces == graphs.backend.splits[0].num_split_calls + 1
    assert (graphs.mamba_tables is not None) == capture_mixer

    def poison_buffers(gen):
        poison(graphs, gen)
        if graphs.mamba_tables is not None:  # what a step does not fill must not matter
            graphs.mamba_tables.buf.random_(-1000, 1000, generator=gen)
            graphs.mamba_tables.slots.random_(0, 1000, generator=gen)

    replay_equals_eager(runner, graphs, lens, prefix_lens, poison_buffers, tol=0)


def replay_equals_eager(runner, graphs, lens, prefix_lens, poison_buffers, tol: float) -> None:
    """A padded extend batch replayed twice from `graphs`, each time from the same Mamba states and after
    `poison_buffers(generator)`: the logits and the requests' states equal an eager forward's (within `tol`)."""
    from batch_helpers import extend_batch
    from test_piecewise import release

    gen = torch.Generator().manual_seed(sum(lens))
    seqs = [torch.randint(3, VOCAB, (p + n,), generator=gen).tolist() for p, n in zip(prefix_lens, lens, strict=True)]
    sched, reqs = extend_batch(runner, seqs, prefix_lens)
    batch = runner.prepare(sched)
    assert graphs.can_run(batch) and graphs.padded_size(batch.num_tokens) > batch.num_tokens  # it pads
    pool, slots = runner.mamba_pool, runner.req_to_token_pool.mamba_slots(batch.req_pool_indices)
    before = [t[:, slots].clone() for t in (pool.conv, pool.ssm)]
    eager = runner.forward(batch).clone()  # no graph runner attached to the runner: eager
    after = [t[:, slots].clone() for t in (pool.conv, pool.ssm)]
    for _ in range(2):  # from the same states again, each time over poisoned static buffers
        for t, b in zip((pool.conv, pool.ssm), before, strict=True):
            t[:, slots] = b
        poison_buffers(gen)
        torch.testing.assert_close(graphs.replay(batch), eager, rtol=tol, atol=tol)
        for t, a in zip((pool.conv, pool.ssm), after, strict=True):
            torch.testing.assert_close(t[:, slots], a, rtol=tol, atol=tol)
    release(runner, reqs)


def test_hybrid_models_take_the_full_extend_graph():
    """The rule, without a GPU: a hybrid's extends are captured in the full extend graph as any model's are (its
    mixer reading the step's tables); piecewise graphs when asked for, or for its mixed steps."""
    from types import SimpleNamespace

    from ostinato.config import EngineArgs
    from ostinato.runner.model_runner import ModelRunner

    def host(hybrid: bool = True, device: str = "cuda", **kw):
        return SimpleNamespace(args=EngineArgs(**kw), mamba_pool=object() if hybrid else None,
                               device=torch.device(device), chunked_prefill_size=8192,
                               backend=SimpleNamespace(supports_extend_graphs=True))

    def piecewise(**kw) -> bool:
        return ModelRunner.piecewise_graphs_wanted.fget(host(**kw))

    assert ModelRunner.extend_graph_max_tokens.fget(host()) == EngineArgs().extend_cuda_graph_max_tokens > 0
    assert ModelRunner.extend_graph_max_tokens.fget(host(extend_cuda_graph_max_tokens=0)) == 0
    assert not piecewise() and piecewise(enable_piecewise_cuda_graph=True)
    assert piecewise(device="cpu", enable_piecewise_cuda_graph=True)  # the CPU stand-in, when asked for
    # mixed steps (which the full graph cannot take) replay piecewise for hybrids on CUDA, unless graphs are off
    assert piecewise(enable_mixed_chunk=True)
    assert not piecewise(enable_mixed_chunk=True, hybrid=False) and not piecewise(enable_mixed_chunk=True, device="cpu")
    assert not piecewise(enable_mixed_chunk=True, disable_cuda_graph=True)
    assert not piecewise(enable_mixed_chunk=True, extend_cuda_graph_max_tokens=0)


@pytest.fixture(scope="module")
def tiny_triton_llm(tiny_dir):
    from ostinato import LLM

    # the Triton attention backend (Triton's interpreter on the CPU): the full extend graph needs its fixed grid
    return LLM(tiny_dir, dtype="float32", device="cpu", attention_backend="triton", max_total_tokens=1024,
               chunked_prefill_size=64, page_size=4, max_running_requests=16, extend_cuda_graph_max_tokens=0)


@pytest.mark.parametrize("lens,prefix_lens", [([9, 30, 20], [0, 0, 0]), ([13, 1, 27, 1], [5, 0, 17, 3])])
def test_extend_graph_replay_equals_eager(tiny_triton_llm, lens, prefix_lens):
    """The full extend graph on a hybrid, the mixer reading the step's tables (the padding is one more request,
    on the sink slot). Logits and the requests' Mamba states after a replay equal an eager forward's from the
    same states, with the static inputs and the tables' unused entries poisoned."""

    from ostinato.graphs.extend import ExtendGraphRunner
    from ostinato.layers.mamba_tables import GRAPH_MAX_REQS

    runner = tiny_triton_llm.engine.runner
    graphs = ExtendGraphRunner(runner, max_tokens=64)
    assert graphs.max_reqs == min(runner.max_running_requests, GRAPH_MAX_REQS)
    assert graphs.mamba_tables.max_reqs == graphs.max_reqs + 1  # room for the padding request

    def poison_buffers(gen):
        graphs.tokens.random_(1, 200, generator=gen)
        graphs.mamba_tables.buf.random_(-1000, 1000, generator=gen)  # what a step does not fill must not matter
        graphs.mamba_tables.slots.random_(0, 1000, generator=gen)

    replay_equals_eager(runner, graphs, lens, prefix_lens, poison_buffers, tol=1e-5)


def test_piecewise_steps_past_the_mixer_tables_run_eagerly(tiny_llm):
    """With the mixer captured, a step with no room for the padding request in the tables runs eagerly."""
    import dataclasses

    from batch_helpers import extend_batch
    from test_piecewise import release

    from ostinato.graphs.piecewise import PiecewiseGraphRunner

    runner = tiny_llm.engine.runner
    graphs = PiecewiseGraphRunner(runner, max_tokens=64, sizes=[64], compiler="eager", capture_mixer=True)
    max_reqs = graphs.mamba_tables.max_reqs
    assert max_reqs == min(runner.max_running_requests, 16) + 1
    sched, reqs = extend_batch(runner, [[5, 6, 7]] * (max_reqs - 1), [0] * (max_reqs - 1))
    batch = runner.prepare(sched)
    assert graphs.can_run(batch)
    assert not graphs.can_run(dataclasses.replace(batch, batch_size=max_reqs))  # no room left for the padding
    release(runner, reqs)
