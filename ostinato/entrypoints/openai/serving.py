"""Request handling: prompts and sampling parameters from a request, engine output into OpenAI's shapes.

Non-streaming calls return the response dict; streaming calls return an async iterator of SSE lines
(`data: {...}` chunks, an optional usage chunk, then `data: [DONE]`). Every check that can fail runs
before anything is sent to the engine, so a bad request leaves no trace there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ostinato.engine.async_client import AsyncEngineClient, ChoiceDelta, EngineDeadError, RequestRejected
from ostinato.engine.limits import validate_request
from ostinato.engine.output_processor import decode_tokens
from ostinato.entrypoints.openai.errors import OpenAIError, engine_dead, from_value_error
from ostinato.entrypoints.openai.protocol import (
    BatchRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ostinato.runner.sampler import TokenLogprobs

Response = dict[str, Any] | AsyncIterator[str]
T = TypeVar("T")


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


_json = json.JSONEncoder(ensure_ascii=False).encode
MIN_LOGPROB = -9999.0  # what a -inf logprob (a token masked out: structured outputs, logit_bias) is sent as, as vLLM


def finite(logprob: float) -> float:
    """JSON has no -inf."""
    return max(logprob, MIN_LOGPROB)


def sse(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


class ChunkFormat:
    """The SSE frames of one stream. Its head (id, object, created, model) is rendered once, and the
    frequent chunk (one choice's text, no logprobs) is formatted directly: ~0.2 us against ~4 us through
    json.dumps of the whole dict, on the HTTP process's hottest path."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.prefix = "data: " + _json(head)[:-1] + ', "choices": ['

    def choice(self, choice: dict[str, Any]) -> str:
        return f"{self.prefix}{_json(choice)}]}}\n\n"

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        """{"index", "text", "logprobs": null, "finish_reason"}: a completions chunk."""
        return (f'{self.prefix}{{"index": {index}, "text": {_json(text)}, "logprobs": null, '
                f'"finish_reason": {_json(finish_reason)}}}]}}\n\n')

    def content(self, index: int, text: str, finish_reason: str | None) -> str:
        """{"index", "delta": {"content"}, "logprobs": null, "finish_reason"}: a chat chunk with text."""
        return (f'{self.prefix}{{"index": {index}, "delta": {{"content": {_json(text)}}}, "logprobs": null, '
                f'"finish_reason": {_json(finish_reason)}}}]}}\n\n')

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> str:
        return f"{self.prefix}], \"usage\": {_json(usage(prompt_tokens, completion_tokens, cached_tokens))}}}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(cached: dict[int, int], n: int) -> int:
    """Prompt tokens served from the prefix cache, by choice index: each prompt counted once (its first
    sample's), as the prompt tokens are."""
    return sum(c for i, c in cached.items() if i % n == 0)


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: its longest vocabulary entry (a byte-level BPE
    entry has one character per byte, a SentencePiece one its own characters), at least 16. A text longer
    than max_model_len times this needs more tokens than the context holds. (Only a normalizer that drops
    characters, e.g. one collapsing runs of spaces, could make such a text fit; it is refused all the same.)"""
    longest = 0
    with contextlib.suppress(Exception):
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    return max(16, longest)


class OpenAIServing:
    """Requests -> engine calls. Everything slow that depends on a request's size (JSON parsing, chat
    templating, tokenization) runs on one worker thread (`run_blocking`), never on the event loop, so /health
    and other clients' streams go on meanwhile; one thread, because the fast tokenizers are not safe to
    call from several threads at once, and the cheap character-count check bounds what one request costs."""

    def __init__(self, client: AsyncEngineClient, served_model_names: list[str], max_n: int = 128,
                 max_choices_in_engine: int | None = None) -> None:
        self.client = client
        self.tokenizer = client.tokenizer
        self.model_names = served_model_names
        self.limits = client.info.limits
        self._mm_processor = None  # vision models: made at the first request with images
        self.max_n = max_n
        self.max_choices_in_engine = max_choices_in_engine or max(1, client.info.max_running_requests // 4)
        self.max_prompt_chars = self.limits.max_model_len * (
            max_chars_per_token(self.tokenizer) if self.tokenizer is not None else 16)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ostinato-tokenize")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before templating or tokenizing, a text too long to fit the context in any tokenization."""
        if num_chars > self.max_prompt_chars:
            raise OpenAIError(400, f"{param}: {num_chars} characters cannot fit in the context length "
                                   f"max_model_len={self.limits.max_model_len} (at most {self.max_prompt_chars} "
                                   "characters)", param=param, code="context_length_exceeded")

    # ------------------------------------------------------------------ checks shared by the endpoints
    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist (this server serves "
                                   f"{', '.join(self.model_names)})", param="model", code="model_not_found")
        return model

    def check_alive(self) -> None:
        if self.client.dead is not None:
            raise engine_dead(self.client.dead)

    def sampling_params(self, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                        logprobs: int | None, rename: dict[str, str]) -> SamplingParams:
        if req.n > self.max_n:
            raise OpenAIError(400, f"n: at most {self.max_n} choices per request (--max-n), got {req.n}", param="n",
                              code="invalid_value")
        if max_tokens is None:  # as much as the context leaves (the prompt check below reports a full one)
            max_tokens = max(1, self.limits.max_model_len - max(len(p) for p in prompts))
        try:
            params = req.sampling_params(max_tokens, logprobs)
            for ids in prompts:
                validate_request(ids, params, self.limits)
        except ValueError as e:
            raise from_value_error(e, rename) from None
        if req.structured_field is not None:  # the engine's compile errors name the field the client used
            rename["structured_outputs"] = req.structured_field
        return params

    def encode_text(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, f"{param}: this model has no tokenizer; send token ids", param=param,
                              code="invalid_value")
        self.check_chars(len(text), param)
        return self.tokenizer.encode(text)

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest) -> Response:
        model = self.check_model(req.model)
        req.check_supported()
        for p in [req.prompt] if isinstance(req.prompt, str) else req.prompt:
            if isinstance(p, str):
                self.check_chars(len(p), "prompt")
        if isinstance(req.prompt, list) and not any(isinstance(p, str) for p in req.prompt):
            prompts = self._completion_prompts(req.prompt)  # token ids: nothing to tokenize, no thread hop
        else:
            prompts = await self.run_blocking(self._completion_prompts, req.prompt)
        rename = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}
        params = self.sampling_params(req, prompts, req.max_tokens, req.logprobs, rename)
        if req.echo and req.logprobs is not None:  # the prompt's tokens get logprobs too
            params.prompt_logprobs = req.logprobs
        echo = self._echo_texts(req.prompt, prompts) if req.echo else None
        self.check_alive()
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = self.client.generate(rid, prompts, params, self.max_choices_in_engine)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        n_prompt = sum(len(p) for p in prompts)
        if req.stream:
            return self._sse(gen, self._stream_completions(gen, head, n_prompt, req.logprobs is not None,
                                                           req.include_usage, params.n, echo, prompts), rename)
        choices = await self._collect(gen, rename)
        out = []
        for i, c in sorted(choices.items()):
            text, lp = c.text, None
            if req.logprobs is not None:
                lp = self._completion_logprobs(c.token_ids, c.logprobs, len(echo[i // params.n]) if echo else 0)
            if echo:
                text = echo[i // params.n] + text
                if lp is not None:
                    lp = self._join_logprobs(self._echo_logprobs(prompts[i // params.n], c.prompt_logprobs), lp)
            out.append({"index": i, "text": text, "finish_reason": c.finish_reason, "logprobs": lp})
        return {**head, "choices": out, "usage": usage(
            n_prompt, sum(len(c.token_ids) for c in choices.values()),
            cached_tokens({i: c.num_cached_tokens for i, c in choices.items()}, params.n))}

    def _echo_texts(self, prompt: str | list, prompts: list[list[int]]) -> list[str]:
        """`echo`: each prompt as text, as the client sent it (token ids decoded)."""
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if self.tokenizer is None:
            return ["" for _ in prompts]
        return [self.tokenizer.decode(p) for p in prompts]

    def _echo_logprobs(self, prompt_ids: list[int], entries: list[TokenLogprobs] | None) -> dict[str, Any]:
        """`echo` with `logprobs`: the prompt's part of the legacy logprobs object (null for its first token)."""
        part = self._completion_logprobs(prompt_ids[1:], entries or [], 0)
        first = decode_tokens(self.tokenizer, prompt_ids[:1])
        return {"tokens": first + part["tokens"], "token_logprobs": [None, *part["token_logprobs"]],
                "top_logprobs": [None, *part["top_logprobs"]],
                "text_offset": [0] + [o + len(first[0]) for o in part["text_offset"]]}

    @staticmethod
    def _join_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.encode_text(prompt, "prompt")]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.encode_text(p, "prompt") if isinstance(p, str) else list(p) for p in prompt]
        if not prompts or any(not p for p in prompts):
            raise OpenAIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        return prompts

    @staticmethod
    async def _sse(gen: AsyncIterator[ChoiceDelta], chunks: AsyncIterator[str],
                   rename: dict[str, str] | None = None) -> AsyncIterator[str]:
        """`chunks`, then an error chunk if the engine died or rejected the request (its field renamed as the
        client named it), then [DONE]."""
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:
            yield sse(engine_dead(str(e)).body())
        except RequestRejected as e:
            yield sse(from_value_error(e, rename).body())
        finally:
            await gen.aclose()  # aborts unfinished choices at once, even when the client went away mid-send
        yield "data: [DONE]\n\n"

    async def _stream_completions(self, gen: AsyncIterator[ChoiceDelta], head: dict[str, Any], n_prompt: int,
                                  logprobs: bool, include_usage: bool, n: int = 1, echo: list[str] | None = None,
                                  prompts: list[list[int]] | None = None) -> AsyncIterator[str]:
        """`echo`: each choice's first chunk starts with its prompt's text (and, with logprobs, its part)."""
        fmt = ChunkFormat(head)
        n_out = 0
        offsets: dict[int, int] = {}  # per choice: the text sent so far (logprobs' text_offset); a key once begun
        cached: dict[int, int] = {}
        async for d in gen:
            n_out += len(d.token_ids)
            cached[d.index] = d.num_cached_tokens
            if not d.token_ids and not d.text and d.finish_reason is None:
                continue
            if echo is None and not logprobs:  # the common chunk: nothing to track
                yield fmt.text(d.index, d.text, d.finish_reason)
                continue
            first = echo is not None and d.index not in offsets
            prefix = echo[d.index // n] if first else ""
            offset = offsets.get(d.index, 0) + len(prefix)
            offsets[d.index] = offset + len(d.text)
            if not logprobs:
                yield fmt.text(d.index, prefix + d.text, d.finish_reason)
                continue
            lp = self._completion_logprobs(d.token_ids, d.logprobs, offset)
            if first:
                lp = self._join_logprobs(self._echo_logprobs(prompts[d.index // n], d.prompt_logprobs), lp)
            yield fmt.choice({"index": d.index, "text": prefix + d.text, "logprobs": lp,
                              "finish_reason": d.finish_reason})
        if include_usage:
            yield fmt.usage(n_prompt, n_out, cached_tokens(cached, n))

    def _completion_logprobs(self, token_ids: list[int], lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens = decode_tokens(self.tokenizer, token_ids)
        top, offsets = [], []
        for tok, text, (chosen, _, ids, vals) in zip(token_ids, tokens, lps, strict=False):
            alts = dict(zip(decode_tokens(self.tokenizer, ids), map(finite, vals), strict=True))
            if tok not in ids:
                alts.setdefault(text, finite(chosen))
            top.append(alts)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [finite(lp[0]) for lp in lps], "top_logprobs": top,
                "text_offset": offsets}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, req: ChatCompletionRequest) -> Response:
        model = self.check_model(req.model)
        req.check_supported()
        self.check_chars(req.num_chars(), "messages")
        prompt, mm_wire = await self._chat_inputs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        params = self.sampling_params(req, [prompt], max_tokens, req.num_logprobs, rename)
        self.check_alive()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.client.generate(rid, [prompt], params, self.max_choices_in_engine, mm_wire)
        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
            return self._sse(gen, self._stream_chat(gen, head, len(prompt), params.n, req.logprobs,
                                                    req.include_usage), rename)
        choices = await self._collect(gen, rename)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
        return {**head, "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
             "logprobs": {"content": self._chat_logprobs(c.token_ids, c.logprobs)} if req.logprobs else None}
            for i, c in sorted(choices.items())
        ], "usage": usage(len(prompt), sum(len(c.token_ids) for c in choices.values()),
                          cached_tokens({i: c.num_cached_tokens for i, c in choices.items()}, params.n))}

    async def _chat_inputs(self, req: ChatCompletionRequest) -> tuple[list[int], dict | None]:
        """Prompt ids, and for messages with image_url parts the images as the engine takes them (fetched,
        decoded and processed in a worker thread: a URL may take up to its timeout)."""
        if not any(m.has_images for m in req.messages):
            return await self.run_blocking(self._chat_prompt, req), None
        from ostinato.multimodal.inputs import mm_to_wire  # (torch: loaded at the first request with images)
        from ostinato.multimodal.processor import chat_images

        processor = self._image_processor()
        messages, images = chat_images([m.model_dump(exclude_none=True) for m in req.messages])
        ids = await self.run_blocking(self._chat_prompt, req, messages)
        try:
            ids, mm = await asyncio.to_thread(processor.process, ids, images)
        except ValueError as e:
            raise OpenAIError(400, f"messages: {e}", param="messages", code="invalid_value") from None
        return ids, mm_to_wire(mm)

    def _image_processor(self):
        if self._mm_processor is None:
            from ostinato.loader import load_model_source
            from ostinato.multimodal.processor import make_image_input_processor

            args = self.client.args
            source = load_model_source(args.model, args.load_format, args.trust_remote_code, convert_gguf=False)
            self._mm_processor = make_image_input_processor(source, args.limit_mm_per_prompt,
                                                            args.allowed_local_media_path) or False
        if self._mm_processor is False:
            raise OpenAIError(400, "messages: image_url parts sent to a model that takes no images",
                              param="messages", code="invalid_value")
        return self._mm_processor

    def _chat_prompt(self, req: ChatCompletionRequest, messages: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise OpenAIError(400, "messages: this model has no chat template; use /v1/completions",
                              param="messages", code="invalid_value")
        try:
            messages = messages if messages is not None else [m.for_template() for m in req.messages]
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           **(req.chat_template_kwargs or {}))
        except Exception as e:
            raise OpenAIError(400, f"messages: the chat template failed: {e}", param="messages",
                              code="invalid_value") from None
        return tok.encode(text, add_special_tokens=False)

    async def _stream_chat(self, gen: AsyncIterator[ChoiceDelta], head: dict[str, Any], n_prompt: int, n: int,
                           logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
        fmt = ChunkFormat(head)
        n_out = 0
        cached: dict[int, int] = {}
        for i in range(n):
            yield fmt.choice({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None})
        async for d in gen:
            n_out += len(d.token_ids)
            cached[d.index] = d.num_cached_tokens
            if not d.token_ids and not d.text and d.finish_reason is None:
                continue
            if not logprobs and (d.text or d.finish_reason is None):
                yield fmt.content(d.index, d.text, d.finish_reason)
                continue
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            lp = {"content": self._chat_logprobs(d.token_ids, d.logprobs)} if logprobs else None
            yield fmt.choice({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
        if include_usage:
            yield fmt.usage(n_prompt, n_out, cached_tokens(cached, n))

    def _chat_logprobs(self, token_ids: list[int], lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": finite(lp), "bytes": list(text.encode("utf-8"))}

        out = []
        for text, (chosen, _, ids, vals) in zip(decode_tokens(self.tokenizer, token_ids), lps, strict=False):
            alts = [entry(t, v) for t, v in zip(decode_tokens(self.tokenizer, ids), vals, strict=True)]
            out.append({**entry(text, chosen), "top_logprobs": alts})
        return out

    # ------------------------------------------------------------------ /tokenize, /detokenize (vLLM's)
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt, or of chat messages after the chat template (what generation would take)."""
        self.check_model(req.model)
        req.check()
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                         chat_template_kwargs=req.chat_template_kwargs)
            chat.check_supported()
            if any(m.has_images for m in chat.messages):  # (their tokens come from the image processor)
                raise OpenAIError(400, "messages: /tokenize takes text only, not image_url parts", param="messages",
                                  code="invalid_value")
            self.check_chars(chat.num_chars(), "messages")
            ids = await self.run_blocking(self._chat_prompt, chat)
        else:
            self.check_chars(len(req.prompt), "prompt")
            if self.tokenizer is None:
                raise OpenAIError(400, "prompt: this model has no tokenizer", param="prompt", code="invalid_value")
            ids = await self.run_blocking(lambda: self.tokenizer.encode(req.prompt,
                                                                        add_special_tokens=req.add_special_tokens))
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise OpenAIError(400, "tokens: this model has no tokenizer", param="tokens", code="invalid_value")
        vocab = self.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                              code="invalid_value")
        return {"prompt": await self.run_blocking(self.tokenizer.decode, req.tokens)}

    # ------------------------------------------------------------------ POST /completions (Tokn's batch shape)
    async def batch(self, req: BatchRequest) -> dict[str, str]:
        self.check_model(req.model)
        req.check_supported()
        if not req.prompts:
            raise OpenAIError(400, "prompts: must not be empty", param="prompts", code="invalid_value")
        for p in req.prompts:
            self.check_chars(len(p), "prompts")
        prompts = await self.run_blocking(lambda: [self.encode_text(p, "prompts") for p in req.prompts])
        if any(not p for p in prompts):
            raise OpenAIError(400, "prompts: a prompt is empty", param="prompts", code="invalid_value")
        params = self.sampling_params(req, prompts, req.max_tokens, None, {"prompt": "prompts"})
        if params.n != 1:
            raise OpenAIError(400, "n: must be 1 on /completions", param="n", code="invalid_value")
        self.check_alive()
        # Tokn's bulk endpoint: all prompts go to the engine at once (n is 1; no fair-share window)
        choices = await self._collect(self.client.generate(f"batch-{uuid.uuid4().hex}", prompts, params), {})
        return {str(i): c.text for i, c in sorted(choices.items())}

    # ------------------------------------------------------------------
    async def _collect(self, gen: AsyncIterator[ChoiceDelta], rename: dict[str, str]) -> dict[int, _Choice]:
        choices: dict[int, _Choice] = {}
        try:
            async for d in gen:
                c = choices.setdefault(d.index, _Choice())
                c.text += d.text
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
                if d.prompt_logprobs is not None:
                    c.prompt_logprobs = d.prompt_logprobs
                c.finish_reason = d.finish_reason
                c.num_cached_tokens = d.num_cached_tokens
        except EngineDeadError as e:
            raise engine_dead(str(e)) from None
        except RequestRejected as e:
            raise from_value_error(e, rename) from None
        finally:
            await gen.aclose()
        return choices
