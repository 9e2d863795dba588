"""A real model runtime as a worker: a Hugging Face causal LM run token by token.

Each request is its own decode loop with its own KV cache. The loop is driven
from the event loop one step at a time: every step (the prefill, then one
token each) is a job for a small thread pool, so the event loop never waits on
the model, steps of concurrent requests interleave, and a cancelled request
simply never asks for its next step. There is no batching across requests:
concurrent requests share the model by taking turns.

Models and tokenizers are read from a local folder only (`local_files_only`):
a worker never reaches a model hub. Sampling follows OpenAI's parameters as
vLLM applies them: presence and frequency penalties over the generated tokens,
then temperature, top-k and top-p; temperature 0 is greedy. Text is decoded
incrementally and released only once stable, so a character split over several
tokens is never sent in halves.

Requires the `transformers` extra (torch and transformers); the rest of the
gateway does not import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gateway.protocol.errors import Invalid
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Started,
    Text,
)
from gateway.worker.engine import Engine, check_context

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in vLLM
_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def pick_device(device: str) -> torch.device:
    """`auto` is the GPU when there is one: a worker is meant for GPUs, CPU is the fallback."""
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    """`auto` keeps the checkpoint's dtype on a GPU but uses float32 on CPU, where
    half-precision matmuls are slow or missing."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    named: torch.dtype = getattr(torch, dtype)
    return named


def context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """The model's context from its config; the tokenizer's limit when the config has none."""
    config = model.config.get_text_config()
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**9:  # transformers' "no limit" is ~1e30
        return limit
    raise ValueError("the model's config does not say its context length: pass max_context")


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's additive penalties, which transformers lacks (its repetition penalty
    is multiplicative): each generated token's logit loses `presence` once and
    `frequency` per time it was generated. The prompt is not counted (as in vLLM)."""

    def __init__(self, presence: float, frequency: float, prompt_tokens: int) -> None:
        self.presence = presence
        self.frequency = frequency
        self.prompt_tokens = prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Penalized scores for the next token."""
        generated = input_ids[:, self.prompt_tokens :]
        if generated.numel() == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        # transformers types processors with the legacy FloatTensor, which no tensor op returns
        penalized = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        return penalized  # type: ignore[return-value]


def logits_processors(sampling: SamplingParams, prompt_tokens: int) -> LogitsProcessorList:
    """The processors a request's sampling settings call for, in vLLM's order."""
    processors = LogitsProcessorList()
    presence = sampling.presence_penalty or 0.0
    frequency = sampling.frequency_penalty or 0.0
    if presence or frequency:
        processors.append(PresenceFrequencyPenalty(presence, frequency, prompt_tokens))
    temperature = 1.0 if sampling.temperature is None else sampling.temperature
    if temperature >= _GREEDY_BELOW:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if sampling.top_k is not None and sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


class IncrementalDetokenizer:
    """Turns generated tokens into text deltas that never change afterwards.

    Decodes a short window of recent tokens twice (with and without the newest)
    and releases the difference only when it is longer and does not end in
    U+FFFD, the mark of a character whose bytes have not all arrived. The window
    keeps tokenizers that drop a word's leading space at the start of a decode
    (SentencePiece) from losing spaces. This is the scheme of TGI and vLLM.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window
        self._read = 0  # end of what has been released
        self._unsent = 0  # tokens not yet in a released delta

    def _decode(self, ids: list[int]) -> str:
        # one sequence of ids decodes to one str (transformers types it `str | list[str]`)
        return self.tokenizer.decode(  # type: ignore[return-value]
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def push(self, token: int) -> tuple[str, int]:
        """Adds a token; returns the text now stable and the tokens it holds."""
        self.ids.append(token)
        self._unsent += 1
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            tokens, self._unsent = self._unsent, 0
            return after[len(before) :], tokens
        return "", 0

    def flush(self) -> tuple[str, int]:
        """What is held back at the end (an unfinished character decodes to U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        tokens, self._unsent = self._unsent, 0
        return after[len(before) :], tokens


class _Step:
    """What one decode step produced."""

    __slots__ = ("finished", "text", "tokens")

    def __init__(self, text: str, tokens: int, finished: FinishReason | None) -> None:
        self.text = text
        self.tokens = tokens
        self.finished = finished


class _Sequence:
    """One request's decode state: its tokens, KV cache, sampler and detokenizer.
    Only one step of a sequence runs at a time (the event loop awaits each)."""

    def __init__(
        self, engine: TransformersEngine, prompt: list[int], sampling: SamplingParams, budget: int
    ) -> None:
        self.engine = engine
        self.prompt_tokens = len(prompt)
        self.budget = budget
        device = engine.device
        self.ids = torch.empty((1, len(prompt) + budget), dtype=torch.long, device=device)
        self.ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
        self.length = len(prompt)
        self.cache: Any = None
        self.processors = logits_processors(sampling, len(prompt))
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        self.greedy = temperature < _GREEDY_BELOW
        self.generator = torch.Generator(device=device)
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.detokenizer = IncrementalDetokenizer(engine.tokenizer)
        self.generated = 0

    def step(self) -> _Step:
        """Runs the model once (the whole prompt first, then the newest token) and samples."""
        engine = self.engine
        with torch.inference_mode():
            if self.cache is None:
                inputs = self.ids[:, : self.length]
            else:
                inputs = self.ids[:, self.length - 1 : self.length]
            kwargs = {engine.cache_arg: self.cache, **engine.forward_kwargs}
            output = engine.hf_model(input_ids=inputs, use_cache=True, **kwargs)
            self.cache = output[engine.cache_arg]
            scores = output.logits[:, -1, :].float()
            # transformers wants the legacy LongTensor type; `ids` is a torch.long tensor
            scores = self.processors(self.ids[:, : self.length], scores)  # type: ignore[arg-type]
            if self.greedy:
                token = int(scores.argmax(dim=-1))
            else:
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.ids[0, self.length] = token
        self.length += 1
        self.generated += 1
        engine.count_step()
        finished = None
        if token in engine.eos_token_ids:
            finished = FinishReason.STOP
        elif self.generated >= self.budget:
            finished = FinishReason.LENGTH
        text, tokens = self.detokenizer.push(token)
        if finished is not None:
            rest, rest_tokens = self.detokenizer.flush()
            text, tokens = text + rest, tokens + rest_tokens
        return _Step(text, tokens, finished)

    def release(self) -> None:
        """Drops the KV cache now rather than when the generator is collected."""
        self.cache = None


class TransformersEngine(Engine):
    """A Hugging Face causal LM from a local folder, served as a worker's engine.

    `running` (requests generating now), `aborted` (requests stopped before their
    end) and `steps` (decode steps run, all requests together) let tests and
    operators see that cancelled requests really stop.
    """

    def __init__(
        self,
        model_path: str | Path,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_context: int | None = None,
        capacity: int = 64,
        threads: int = 1,
    ) -> None:
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"model path {str(path)!r} is not a folder")
        self.model = model or path.resolve().name
        self.device = pick_device(device)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, local_files_only=True
        )
        loaded = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=pick_dtype(dtype, self.device)
        )
        # transformers' decorator on `to` hides its signature from type checkers
        self.hf_model: PreTrainedModel = loaded.to(self.device).eval()  # type: ignore[arg-type]
        own = context_length(self.hf_model, self.tokenizer)
        self.max_context = own if max_context is None else min(max_context, own)
        self.capacity = capacity
        eos = self.hf_model.generation_config.eos_token_id
        ids = {eos} if isinstance(eos, int) else set(eos or ())
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        parameters = inspect.signature(self.hf_model.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; older model code takes the old.
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are needed: skip the rest on a long prefill.
        self.forward_kwargs: dict[str, Any] = (
            {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        )
        # Every tokenization and model step runs here, off the event loop.
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="furnace-transformers")
        self._lock = threading.Lock()
        self.running = 0
        self.aborted = 0
        self.steps = 0

    def count_step(self) -> None:
        """Counts a decode step; called from the pool's threads."""
        with self._lock:
            self.steps += 1

    def encode(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids: the chat template for messages, the plain text otherwise."""
        tokenizer = self.tokenizer
        if request.messages is not None:
            if tokenizer.chat_template is None:
                raise Invalid(
                    "This model has no chat template; use /v1/completions.", param="messages"
                )
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            try:
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except jinja2.TemplateError as error:  # e.g. "roles must alternate user/assistant"
                message = f"The chat template refused the messages: {error}"
                raise Invalid(message, param="messages") from None
            return list(ids)
        return list(tokenizer(request.prompt or "").input_ids)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Tokenize, check the context, then decode step by step until EOS or the budget."""
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._executor, self.encode, request)
        param = "messages" if request.messages is not None else "prompt"
        prompt_tokens = len(prompt)
        if prompt_tokens == 0:
            raise Invalid("The prompt is empty.", param=param)
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise Invalid("max_tokens must be at least 1.", param="max_tokens")
        budget = check_context(request, prompt_tokens, self.max_context)
        sequence = _Sequence(self, prompt, request.sampling, budget)
        self.running += 1
        done = False
        pending: Future[_Step] | None = None
        try:
            yield Started(prompt_tokens)
            while True:
                pending = self._executor.submit(sequence.step)
                step = await asyncio.wrap_future(pending)
                if step.text:
                    yield Text(step.text, step.tokens)
                if step.finished is not None:
                    done = True
                    yield Finished(step.finished, sequence.generated)
                    return
        finally:
            if not done:
                self.aborted += 1
            if pending is None or pending.done():
                self._release(sequence)
            else:
                # Cancelled while a step runs in its thread, which cannot be interrupted:
                # the request counts as running until that step ends (no further one starts).
                pending.add_done_callback(lambda _: self._release_soon(loop, sequence))

    def _release(self, sequence: _Sequence) -> None:
        self.running -= 1
        sequence.release()

    def _release_soon(self, loop: asyncio.AbstractEventLoop, sequence: _Sequence) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to count
            loop.call_soon_threadsafe(self._release, sequence)

    def close(self) -> None:
        """Stops the thread pool once the steps already queued have run."""
        self._executor.shutdown(wait=True, cancel_futures=True)
