"""The offline API, shaped like vLLM's `LLM`."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from ostinato.config import EngineArgs
from ostinato.engine.engine_core import EngineCore
from ostinato.engine.output_processor import OutputProcessor, prompt_logprob_dicts
from ostinato.entrypoints.chat_utils import check_conversation, check_unicode
from ostinato.loader import load_model_source
from ostinato.multimodal.processor import chat_images, make_image_input_processor
from ostinato.outputs import RequestOutput
from ostinato.runner.model_runner import offline_chunked_prefill_size
from ostinato.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams(...))` -> list[RequestOutput], in prompt order."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.args = EngineArgs(model=model, **engine_args)  # validated first: a bad device is named as such
        if self.args.chunked_prefill_size is None:  # larger offline on a large GPU, as vLLM's LLM
            chunk = offline_chunked_prefill_size(self.args.device)
            self.args = dataclasses.replace(self.args, chunked_prefill_size=chunk) if chunk else self.args
        self.source = load_model_source(self.args.model, self.args.load_format, self.args.trust_remote_code)
        self.tokenizer = None if self.args.skip_tokenizer_init else self.source.tokenizer
        self.engine = EngineCore(self.args, self.source)
        self.mm_processor = make_image_input_processor(self.source, self.args.limit_mm_per_prompt,
                                                       self.args.allowed_local_media_path)
        self._counter = 0

    def shutdown(self) -> None:
        """Free the engine's memory (GPU: KV pool, graphs and their pool, workspaces, weights). Called on
        leaving a `with LLM(...) as llm:` block and when the LLM is dropped; the LLM is unusable afterwards."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - at interpreter exit torch may already be torn down
            pass

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, so that the next prompts are computed from scratch (benchmarks). False while
        requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        elif not isinstance(prompts, list | tuple):
            raise ValueError(f"prompts: expected a prompt (a string or a dict with 'prompt_token_ids') or a list of "
                             f"them, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, list | tuple) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params: expected a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}; e.g. SamplingParams(temperature=0)")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Validate everything before queuing anything, so a bad prompt leaves the engine unchanged.
        encoded = [self._encode(p) for p in prompts]
        for (_, ids, _), sp in zip(encoded, params, strict=True):
            self.engine.validate(ids, sp)
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no tokenizer chat template")
        if isinstance(messages, list | tuple) and messages and all(isinstance(c, list | tuple) for c in messages):
            conversations = list(messages)  # a batch of conversations
        else:
            conversations = [messages]
        for i, conv in enumerate(conversations):
            check_conversation(conv, "messages" if len(conversations) == 1 else f"messages[{i}]")
        prompts = []
        for conv in conversations:
            conv, images = chat_images(conv)
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids, **({"multi_modal_data": {"image": images}}
                                                                         if images else {})})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------------------
    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int], Any]:
        """(text, token ids, MultiModalInputs or None); a prompt's images are expanded to their tokens here."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            data = prompt["multi_modal_data"]
            if self.mm_processor is None:
                raise ValueError(f"multi_modal_data: {self.source.hf_config.architectures} takes no images")
            if not isinstance(data, dict) or set(data) - {"image"}:
                raise ValueError("multi_modal_data: only {'image': image or [images]} is supported")
            images = data["image"] if isinstance(data["image"], list | tuple) else [data["image"]]
            text, ids, _ = self._encode({k: v for k, v in prompt.items() if k != "multi_modal_data"})
            ids, mm = self.mm_processor.process(ids, list(images))
            return text, ids, mm
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            return self._encode(prompt["prompt"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
            if not prompt:
                raise ValueError("prompt: must not be empty")
            check_unicode(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise ValueError("prompt_token_ids: must be a list of ints")
            return prompt.get("prompt"), list(ids), None
        raise ValueError(f"prompt: expected a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _run(self, encoded: list[tuple[str | None, list[int], Any]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer, incremental=False)  # text read at the end only
        results: dict[str, RequestOutput] = {}
        child_index: dict[str, tuple[str, int]] = {}
        for (text, ids, mm), sp in zip(encoded, params, strict=True):
            rid = str(self._counter)
            self._counter += 1
            results[rid] = RequestOutput(rid, text, ids, [None] * sp.n)
            for j in range(sp.n):  # n > 1: independent samples, seeds offset so they differ but stay reproducible
                child = f"{rid}-{j}" if sp.n > 1 else rid
                child_sp = sp if sp.n == 1 else _child_params(sp, j)
                child_index[child] = (rid, j)
                processor.add(child, ids, child_sp)
                child_mm = mm if sp.n == 1 or mm is None else dataclasses.replace(mm)  # own encoder cache
                self.engine.add_request(child, ids, child_sp, mm=child_mm)
        bar = tqdm(total=len(child_index), desc="Generating", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished():
                states, to_abort = processor.process(self.engine.step())
                for rid in to_abort:
                    self.engine.abort(rid)
                for state in states:
                    if state.finish_reason is None:
                        continue
                    parent, j = child_index[state.rid]
                    results[parent].outputs[j] = state.completion(j)
                    if j == 0:
                        results[parent].num_cached_tokens = state.num_cached_tokens
                        if state.prompt_logprobs is not None:
                            results[parent].prompt_logprobs = prompt_logprob_dicts(
                                self.tokenizer, state.prompt_token_ids, state.prompt_logprobs)
                    bar.update(1)
            processor.process(self.engine.step())  # flush abort acknowledgements
        except BaseException:
            for child in child_index:
                self.engine.abort(child)
            self.engine.step()
            raise
        finally:
            bar.close()
        for out in results.values():
            out.finished = True
        return list(results.values())


def _child_params(sp: SamplingParams, j: int) -> SamplingParams:
    seed = None if sp.seed is None else sp.seed + j
    # the prompt's logprobs are the same for every sample: the first one computes them
    return dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=sp.prompt_logprobs if j == 0 else None)
