"""The LLM class's default prefill chunk: 16,384 tokens on a large GPU (vLLM's offline default), the runner's
own default elsewhere and for the server; a chunk the user sets is kept."""

import pytest

from ostinato.runner import model_runner
from ostinato.runner.model_runner import OFFLINE_CHUNKED_PREFILL, offline_chunk_for

GIB = 2**30


@pytest.mark.parametrize(("name", "gib", "chunk"), [
    ("NVIDIA H200", 139.8, OFFLINE_CHUNKED_PREFILL),
    ("NVIDIA H100 80GB HBM3", 79.1, OFFLINE_CHUNKED_PREFILL),
    ("NVIDIA A100-SXM4-80GB", 79.1, None),  # vLLM measured the larger chunk slower there (its PR 17885)
    ("NVIDIA L4", 22.0, None),
    ("NVIDIA RTX 6000 Ada Generation", 47.5, None),
    ("NVIDIA H100 PCIe", 69.9, None),  # just under 70 GiB
])
def test_offline_chunk_by_device(name, gib, chunk):
    assert offline_chunk_for(name, int(gib * GIB)) == chunk


def test_llm_takes_the_offline_chunk_unless_one_is_given(tiny_llama_path, monkeypatch):
    from ostinato import LLM
    from ostinato.entrypoints import llm as llm_module

    assert model_runner.offline_chunked_prefill_size("cpu") is None  # a CPU keeps the runner's default
    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=512)
    assert llm.engine.runner.chunked_prefill_size == 2048
    asked = []

    def large_gpu(device: str) -> int:
        asked.append(device)
        return 96

    monkeypatch.setattr(llm_module, "offline_chunked_prefill_size", large_gpu)
    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=512)
    assert (llm.engine.runner.chunked_prefill_size, llm.args.chunked_prefill_size, asked) == (96, 96, ["cpu"])
    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=512, chunked_prefill_size=40)
    assert llm.engine.runner.chunked_prefill_size == 40 and asked == ["cpu"]  # the user's chunk, the device not asked


def test_a_bad_device_is_named_before_the_chunk_is_chosen():
    from ostinato import LLM

    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        LLM("unused", device="tpu")
