"""Qwen2.5-VL / Qwen3-VL: tiny random-weight checkpoints, token for token against transformers."""

import pytest
import torch

from tests.vlm_models import image, make_qwen2_5_vl, make_qwen3_vl

pytest.importorskip("PIL")

MAKERS = {"qwen2.5-vl": make_qwen2_5_vl, "qwen3-vl": make_qwen3_vl}
PH = "<|vision_start|><|image_pad|><|vision_end|>"
# (prompt, images): 1-3 images of different sizes and aspect ratios
CASES = [
    (f"<|im_start|>user\n{PH} describe the image<|im_end|>\n<|im_start|>assistant\n", [(200, 120)]),
    (f"<|im_start|>user\ncompare {PH} and {PH} please<|im_end|>\n<|im_start|>assistant\n", [(60, 150), (90, 90)]),
    (f"<|im_start|>user\n{PH} {PH} {PH} what is in this<|im_end|>\n<|im_start|>assistant\n",
     [(120, 40), (64, 64), (150, 100)]),
]


@pytest.fixture(scope="session", params=list(MAKERS))
def vlm_dir(request, tmp_path_factory) -> str:
    return MAKERS[request.param](str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="session")
def hf_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def _images(sizes, seed):
    return [image(w, h, seed * 10 + i) for i, (w, h) in enumerate(sizes)]


def test_vision_embeddings_match_transformers(vlm_dir, hf_model):
    from ostinato.loader.safetensors_weights import iter_safetensors_weights
    from ostinato.models.registry import model_class
    from ostinato.multimodal.processor import ImageInputProcessor

    cfg = hf_model.config
    model = model_class(cfg)(cfg, 1024)
    model.load_weights(iter_safetensors_weights(vlm_dir))
    imgs = _images([(200, 120), (60, 150), (90, 90)], 7)
    out = ImageInputProcessor(vlm_dir, cfg).image_processor(images=imgs, return_tensors="pt")
    grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
    with torch.no_grad():
        ref = hf_model.model.get_image_features(out["pixel_values"], out["image_grid_thw"], return_dict=True)
        mine, deepstack = model.encode_images(out["pixel_values"], grids)
    diff = (torch.cat(ref.pooler_output) - mine).abs().max().item()
    print(f"max |vision embeds - transformers| = {diff:.3g}")
    assert diff < 1e-5
    if deepstack is not None:
        for ref_ds, ds in zip(ref.deepstack_features, deepstack, strict=True):
            ref_ds = torch.cat(ref_ds) if isinstance(ref_ds, list | tuple) else ref_ds
            assert (ref_ds - ds).abs().max().item() < 1e-5


def _hf_generate(hf_model, llm, prompt, imgs, max_new):
    """transformers' greedy generate on the ids Ostinato built (its processor) and the same pixels."""
    ids, mm = llm.mm_processor.process(llm.tokenizer.encode(prompt), imgs)
    input_ids = torch.tensor([ids])
    grid = torch.tensor(mm.image_grid_thw)
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                pixel_values=mm.pixel_values, image_grid_thw=grid,
                                mm_token_type_ids=(input_ids == hf_model.config.image_token_id).int(),
                                max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist(), ids


def test_greedy_equals_transformers_with_chunked_prefill(vlm_dir, hf_model):
    from ostinato import LLM, SamplingParams

    # chunks of 16 tokens cut through the image tokens; three requests with 1-3 images go in together
    llm = LLM(vlm_dir, dtype="float32", device="cpu", chunked_prefill_size=16, max_total_tokens=2048, page_size=4)
    max_new = 6
    prompts = [{"prompt": p, "multi_modal_data": {"image": _images(sizes, i)}} for i, (p, sizes) in enumerate(CASES)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0), use_tqdm=False)
    for (p, sizes), out, i in zip(CASES, outs, range(len(CASES)), strict=True):
        ref, ids = _hf_generate(hf_model, llm, p, _images(sizes, i), max_new)
        assert out.prompt_token_ids == ids
        assert sum(t == hf_model.config.image_token_id for t in ids) > 16  # the chunks do split the images
        assert list(out.outputs[0].token_ids) == ref, f"case {i}"
    stats = llm.engine.runner.encoder_stats
    assert stats.images == 6 and stats.calls <= 3  # each image encoded once, across chunks
    assert stats.cached_tokens == 0  # the cache entries are dropped once the prefills are done


@pytest.fixture(scope="module")
def q25_llm(tmp_path_factory):
    from ostinato import LLM

    path = make_qwen2_5_vl(str(tmp_path_factory.mktemp("q25-offline")))
    return LLM(path, dtype="float32", device="cpu", chunked_prefill_size=32, max_total_tokens=512, page_size=4,
               max_model_len=64, limit_mm_per_prompt=2, allowed_local_media_path=str(tmp_path_factory.getbasetemp()))


def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_chat_content_parts_equal_generate(q25_llm, tmp_path):
    """LLM.chat with OpenAI image_url parts (a data: URL and a file:// URL) gives what generate gives for the same
    prompt and images."""
    import base64

    from ostinato import SamplingParams

    a, b = image(100, 60, 1), image(50, 120, 2)
    (tmp_path / "b.png").write_bytes(_png(b))
    url_a = "data:image/png;base64," + base64.b64encode(_png(a)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_a}},
                                             {"type": "text", "text": " compare "},
                                             {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/b.png"}}]}]
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    chat = q25_llm.chat(messages, sp, use_tqdm=False)[0]
    prompt = f"<|im_start|>user\n{PH} compare {PH}<|im_end|>\n<|im_start|>assistant\n"
    gen = q25_llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, sp, use_tqdm=False)[0]
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids and len(gen.outputs[0].token_ids) > 0


def test_prefix_cache_keys_images_by_content(q25_llm):
    """Same text, different images: nothing past the first image placeholder is shared; the same image again
    is. Outputs equal an engine without the cache."""
    from ostinato import LLM, SamplingParams

    a, b = image(80, 60, 3), image(80, 60, 4)  # same size: same placeholder tokens, different pixels
    prompt = f"<|im_start|>user\n{PH} what is it<|im_end|>\n<|im_start|>assistant\n"
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    reqs = [{"prompt": prompt, "multi_modal_data": {"image": img}} for img in (a, b, a)]
    cached = [q25_llm.generate(r, sp, use_tqdm=False)[0] for r in reqs]
    first_image_row = cached[0].prompt_token_ids.index(q25_llm.source.hf_config.image_token_id)
    n_image = cached[0].prompt_token_ids.count(q25_llm.source.hf_config.image_token_id)
    assert cached[1].num_cached_tokens <= first_image_row  # image b shares only the text before the image
    assert cached[2].num_cached_tokens >= first_image_row + n_image  # image a again: its image tokens hit
    plain = LLM(q25_llm.source.path, dtype="float32", device="cpu", max_total_tokens=512, page_size=4,
                max_model_len=64, disable_radix_cache=True)
    for r, out in zip(reqs, cached, strict=True):
        assert plain.generate(r, sp, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("images, field", [
    ([b"not an image"], "image[0]: the image could not be decoded"),
    (["ftp://example.com/a.png"], "image[0]: URL scheme 'ftp' is not allowed"),
    (["file:///etc/passwd"], "outside the allowed local media path"),
    (["data:image/png;base64,@@@"], "not valid base64"),
    ([image(30, 30, 0)] * 3, "3 images, over the limit of 2"),
    ([image(1400, 1400, 0)] * 2, "max_model_len=64"),  # too many image tokens for the context
])
def test_bad_image_input_raises_and_leaks_nothing(q25_llm, images, field):
    from ostinato import SamplingParams

    prompt = f"<|im_start|>user\n{PH * len(images)} hello<|im_end|>\n"
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        q25_llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, SamplingParams(max_tokens=2),
                         use_tqdm=False)
    engine = q25_llm.engine
    assert not engine.has_unfinished() and not engine.requests
    engine.check_memory_leak()  # every page free, or held unlocked by the prefix cache


def test_pixel_cap_and_text_only_model(tmp_path):
    import json

    from ostinato import LLM, SamplingParams
    from ostinato.multimodal.processor import MediaLimits, load_image

    with pytest.raises(ValueError, match="over the limit of 100 pixels"):
        load_image(image(20, 20, 0), MediaLimits(max_image_pixels=100))
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=128)
    (tmp_path / "text.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "text.json"), load_format="dummy", device="cpu", dtype="float32", max_total_tokens=256)
    with pytest.raises(ValueError, match="multi_modal_data: .* takes no images"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image(30, 30, 0)}},
                     SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_equals_transformers_with_decode_graphs(vlm_dir, hf_model):
    """On the GPU (Triton attention, decode CUDA graphs, fp32): same tokens as transformers on the CPU."""
    from ostinato import LLM, SamplingParams

    llm = LLM(vlm_dir, dtype="float32", device="cuda", chunked_prefill_size=16, max_total_tokens=4096,
              page_size=4, max_model_len=1024, sampler_warm_up="temperature")
    assert llm.engine.runner.graph_runner is not None
    max_new = 8
    prompts = [{"prompt": p, "multi_modal_data": {"image": _images(sizes, i)}} for i, (p, sizes) in enumerate(CASES)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0), use_tqdm=False)
    for (p, sizes), out, i in zip(CASES, outs, range(len(CASES)), strict=True):
        ref, ids = _hf_generate(hf_model, llm, p, _images(sizes, i), max_new)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == ref, f"case {i}"


def test_retraction_recomputes_image_requests_exactly(vlm_dir):
    """A KV pool too small for three image requests retracts some mid-decode; they are recomputed (images
    re-encoded, M-RoPE positions past the prompt rebuilt from the rope delta) to the same greedy tokens."""
    from ostinato import LLM, SamplingParams

    if "qwen3" in vlm_dir:
        pytest.skip("the scheduling path is the model's; one model (Qwen2.5-VL) keeps the suite short")
    prompts = [{"prompt": p, "multi_modal_data": {"image": _images(sizes, i)}} for i, (p, sizes) in enumerate(CASES)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for kv, chunk in ((2048, 256), (160, 16)):
        llm = LLM(vlm_dir, dtype="float32", device="cpu", chunked_prefill_size=chunk, max_total_tokens=kv,
                  page_size=4, max_model_len=150)
        outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if kv == 2048:  # the three prompts in one extend: their six images in one encoder batch
            stats = llm.engine.runner.encoder_stats
            assert (stats.calls, stats.images, stats.cached_tokens) == (1, 6, 0)
    assert llm.engine.scheduler.num_retractions > 0
    assert outs[160] == outs[2048]
