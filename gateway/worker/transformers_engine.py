"""A real model runtime as a worker: a Hugging Face causal LM run token by token.

Each request is its own decode loop with its own KV cache. The loop is driven
from the event loop one step at a time: every step (the prefill, then one
token each) is a job for a small thread pool, so the event loop never waits on
the model, steps of concurrent requests interleave, and a cancelled request
simply never asks for its next step. There is no batching across requests:
concurrent requests share the model by taking turns.

Models and tokenizers are read from a local folder only (`local_files_only`):
a worker never reaches a model hub. Sampling follows OpenAI's parameters as
vLLM applies them: a structured-output grammar's mask first, then logit bias,
min_tokens, the repetition, presence and frequency penalties, then
temperature, min-p, top-k and top-p; temperature 0 is greedy. Log
probabilities are the model's own (log-softmax of its raw logits, vLLM's
default `raw_logprobs`). Text is decoded incrementally and released only once
stable, so a character split over several tokens is never sent in halves.

Token ids (vLLM's `return_token_ids`): `Started` has the prompt's ids as encoded, and
each event the sampled ids of the tokens it counts, in order; `Finished` the rest (the
end of sequence, which no text holds), so a choice's ids are every token it generated.

Embeddings are the last hidden state, mean-pooled and L2-normalized.

Tokenize gives the ids `generate` encodes (those `count_tokens` counts), with
`convert_ids_to_tokens`' pieces when asked; Detokenize is `tokenizer.decode`, special
tokens kept, as vLLM's /detokenize; both in the pool's thread.

Structured output (`response_format`, `tool_choice` "required" or a named
function, and vLLM's `structured_outputs` `regex` and `choice`) is enforced by
llguidance: a grammar compiled from the JSON schema (the regex; the choices, as a
Lark grammar of their literals) masks every step's logits. `structured_outputs.grammar`
is vLLM's EBNF, which llguidance does not read: it is not listed. llguidance is a 3 MB
Rust wheel with no dependencies whose mask costs about 10 µs a token at a 300-token vocabulary
and 45 µs at 32k on CPU; xgrammar (vLLM's default) needs Triton, a GPU
compiler, on Linux. A grammar is compiled once per schema, not once per choice
(the n choices of a request share it: each gets a copy of the compiled matcher),
in a thread of its own rather than the model's, within `COMPILE_TIMEOUT`: a
430 KB schema with `n` 32 had held the model's one thread 9.2 s, stalling every
other request, and timed out as the engine's failure.

Requires the `transformers` extra (torch, transformers, llguidance); the rest
of the gateway does not import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta
import llguidance
import llguidance.hf
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gateway.protocol import features
from gateway.protocol.chat import message_dict, tool_dict
from gateway.protocol.detokenize import IncrementalDetokenizer
from gateway.protocol.errors import Failed, Invalid, TooLong
from gateway.protocol.token_ids import IdsByCount
from gateway.protocol.tool_calls import (
    PARSERS,
    ChoiceToolCalls,
    ToolCallParser,
    for_request,
    forced,
    required_schema,
)
from gateway.protocol.types import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Started,
    Text,
    TokenLogprob,
)
from gateway.worker.engine import (
    Engine,
    chat_end,
    chat_end_refused,
    check_context,
    template_kwargs,
    truncated,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("furnace.worker")

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in vLLM
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
#: Compact JSON only, as vLLM's `disable_any_whitespace`: with whitespace allowed, a
#: weak model pads the JSON with blanks until max_tokens.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
#: What every model served here takes, beyond plain generation. Of vLLM's reasoning
#: parameters, those the chat template takes (`template_kwargs`, as vLLM renders them):
#: with no reasoning parser the answer's thought stays in its text, so
#: `include_reasoning` and `thinking_token_budget` stay refused by name.
_SERVED = features.SAMPLING | {
    features.GENERATE,
    features.EMBEDDINGS,
    features.TOKENIZE,
    features.LOGPROBS,
    features.USER,
    features.REASONING_EFFORT,
    features.CHAT_TEMPLATE_KWARGS,
    *features.CHAT_END,
    features.SKIP_SPECIAL_TOKENS,
    features.TRUNCATE_PROMPT_TOKENS,
    features.RETURN_TOKEN_IDS,
}


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


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template reads the variable `tools` (transformers passes
    them to any template, and one that does not read them drops them)."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template]
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    for text in templates:
        if not isinstance(text, str):
            continue
        try:
            if "tools" in jinja2.meta.find_undeclared_variables(environment.parse(text)):
                return True
        except jinja2.TemplateSyntaxError:  # a tag of transformers' own (`generation`)
            if "tools" in text:
                return True
    return False


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


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: a fixed amount added to some tokens' logits (-100 bans
    a token in practice, +100 makes it the only choice)."""

    def __init__(self, bias: tuple[tuple[int, float], ...], device: torch.device) -> None:
        self.ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=device)
        self.values = torch.tensor([value for _, value in bias], device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Biased scores for the next token."""
        biased = scores.clone()
        biased[:, self.ids] += self.values.to(scores.dtype)
        return biased  # type: ignore[return-value]


def check_sampling(sampling: SamplingParams, vocab: int) -> None:
    """Refuses values the processors cannot take, naming the parameter."""
    if sampling.repetition_penalty is not None and not sampling.repetition_penalty > 0:
        raise Invalid("repetition_penalty must be greater than 0.", param="repetition_penalty")
    if sampling.min_p is not None and not 0.0 <= sampling.min_p <= 1.0:
        raise Invalid("min_p must be between 0 and 1.", param="min_p")
    if sampling.min_tokens is not None and sampling.min_tokens < 0:
        raise Invalid("min_tokens must be at least 0.", param="min_tokens")
    check_vocabulary([token for token, _ in sampling.logit_bias], vocab, "logit_bias")
    check_vocabulary(sampling.stop_token_ids, vocab, "stop_token_ids")


def check_vocabulary(ids: Iterable[int], vocab: int, param: str) -> None:
    """Refuses token ids outside the model's vocabulary, naming the parameter."""
    wrong = next((token for token in ids if not 0 <= token < vocab), None)
    if wrong is not None:
        message = f"Token id {wrong} is out of the vocabulary (0 to {vocab - 1})."
        raise Invalid(message, param=param)


def logits_processors(
    sampling: SamplingParams,
    prompt_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    device: torch.device | None = None,
) -> LogitsProcessorList:
    """The processors a request's sampling settings call for, in vLLM's order;
    `stop_ids` are the tokens min_tokens holds back (EOS and stop_token_ids)."""
    device = device or torch.device("cpu")
    processors = LogitsProcessorList()
    if sampling.logit_bias:
        processors.append(LogitBias(sampling.logit_bias, device))
    if sampling.min_tokens and stop_ids:
        processors.append(
            MinNewTokensLengthLogitsProcessor(
                prompt_tokens, sampling.min_tokens, sorted(stop_ids), device=str(device)
            )
        )
    if sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(sampling.repetition_penalty)))
    presence = sampling.presence_penalty or 0.0
    frequency = sampling.frequency_penalty or 0.0
    if presence or frequency:
        processors.append(PresenceFrequencyPenalty(presence, frequency, prompt_tokens))
    temperature = 1.0 if sampling.temperature is None else sampling.temperature
    if temperature >= _GREEDY_BELOW:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if sampling.min_p:
            processors.append(MinPLogitsWarper(sampling.min_p))
        if sampling.top_k is not None and sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


class Guide:
    """A grammar the answer must follow (llguidance): it masks each step's logits
    to the tokens that keep the answer inside it, and is done once nothing but
    the end may follow."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` with every token the grammar forbids now at -inf."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        forbidden = (allowed[: scores.shape[-1]] == 0).to(scores.device)
        return scores.masked_fill(forbidden, float("-inf"))

    def advance(self, token: int) -> bool:
        """Takes the sampled token; True once the grammar is complete."""
        if not self.matcher.consume_token(token):
            raise Failed(f"The grammar refused a token it allowed: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


#: Seconds a grammar may take to compile; past it the request is refused naming the
#: parameter that holds the schema (the compile thread finishes it, and caches it).
COMPILE_TIMEOUT = 10.0
#: Compiled grammars kept, by schema: the n choices of a request, and requests that
#: repeat a schema, compile it once.
COMPILED_KEPT = 32


class Guides:
    """Compiles `response_format` into grammars over one model's vocabulary."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab: int, eos: list[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def matcher(self, wanted: Constraint) -> llguidance.LLMatcher:
        """The compiled grammar holding the answer to `wanted` (CPU: a thread's work),
        never consumed itself: each answer takes a `deep_copy`."""
        kind, source, param = wanted
        what = "The JSON schema" if kind == "json" else f"The {kind}"
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    source, overrides=_JSON_OPTIONS
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(source)
        except ValueError as error:
            raise Invalid(f"{what} is not valid: {error}", param=param) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise Invalid(f"{what} cannot be enforced: {matcher.get_error()}", param=param)
        return matcher


#: What an answer must follow: "json" (a JSON schema, as text or an object), "regex"
#: or "lark" (a grammar in llguidance's Lark), its source, and the parameter that gave it.
Constraint = tuple[str, Any, str]


def constraint(request: GenerateRequest) -> Constraint | None:
    """What the answer must follow (a forced tool call's JSON schema, or
    `response_format`'s, or `structured_outputs`' regex or choice), or None."""
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        kind = response_format.type
        param = f"structured_outputs.{kind}" if kind in ("regex", "choice") else "response_format"
        if forced(request.tool_choice):
            message = f"{param} cannot be combined with a forced tool_choice."
            raise Invalid(message, param=param)
        if kind == "json_object":
            return "json", {"type": "object"}, param
        if kind == "json_schema":
            if not response_format.schema:
                raise Invalid("json_schema needs a schema.", param=param)
            return "json", response_format.schema, param
        if kind == "regex":
            return "regex", response_format.regex, param
        if kind == "choice" and response_format.choice:
            # each choice a Lark string literal (JSON's escapes are Lark's)
            return "lark", "start: " + " | ".join(map(json.dumps, response_format.choice)), param
        message = f"response_format type {kind!r} is not served."
        raise Invalid(message, param=param)
    if request.tools and forced(request.tool_choice):
        schema = required_schema(request.tools, request.tool_choice, request.parallel_tool_calls)
        return "json", schema, "tool_choice"
    return None


class _Prepared:
    """A request ready to decode: its prompt, the grammar it follows and the
    parser that finds tool calls in its text."""

    __slots__ = ("guide", "prompt", "tool_calls")

    def __init__(
        self, prompt: list[int], guide: Guide | None, tool_calls: ToolCallParser | None
    ) -> None:
        self.prompt = prompt
        self.guide = guide
        self.tool_calls = tool_calls


class _Sequence:
    """One request's decode state: its tokens, KV cache, sampler and detokenizer.
    Only one step of a sequence runs at a time (the event loop awaits each)."""

    def __init__(
        self,
        engine: TransformersEngine,
        request: GenerateRequest,
        prepared: _Prepared,
        budget: int,
    ) -> None:
        self.engine = engine
        prompt = prepared.prompt
        sampling = request.sampling
        self.prompt_tokens = len(prompt)
        self.budget = budget
        device = engine.device
        self.ids = torch.empty((1, len(prompt) + budget), dtype=torch.long, device=device)
        self.ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
        self.length = len(prompt)
        self.cache: Any = None
        eos = frozenset() if sampling.ignore_eos else engine.eos_token_ids
        self.stop_ids = eos | frozenset(sampling.stop_token_ids)
        held = engine.eos_token_ids | frozenset(sampling.stop_token_ids)
        self.processors = logits_processors(sampling, len(prompt), held, device)
        self.guide = prepared.guide
        self.top_logprobs = request.logprobs
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        self.greedy = temperature < _GREEDY_BELOW
        self.generator = torch.Generator(device=device)
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
        tokenizer = engine.tokenizer
        skip = request.skip_special_tokens

        def decode(ids: Sequence[int]) -> str:
            # one sequence of ids decodes to one str (transformers types it `str | list[str]`)
            return tokenizer.decode(  # type: ignore[return-value]
                list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )

        self.detokenizer = IncrementalDetokenizer(decode)
        self.unsent = 0  # tokens not yet in a released delta
        parser = prepared.tool_calls
        self.calls = None if parser is None else ChoiceToolCalls(parser)
        self.logprobs: list[TokenLogprob] = []  # of the tokens not yet in a Text
        self.generated = 0

    def step(self) -> list[Event]:
        """Runs the model once (the whole prompt first, then the newest token),
        samples, and returns the events the new token makes."""
        engine = self.engine
        with torch.inference_mode():
            if self.cache is None:
                inputs = self.ids[:, : self.length]
            else:
                inputs = self.ids[:, self.length - 1 : self.length]
            kwargs = {engine.cache_arg: self.cache, **engine.forward_kwargs}
            output = engine.hf_model(input_ids=inputs, use_cache=True, **kwargs)
            self.cache = output[engine.cache_arg]
            raw = output.logits[:, -1, :].float()
            scores = raw if self.guide is None else self.guide.mask(raw)
            # transformers wants the legacy LongTensor type; `ids` is a torch.long tensor
            scores = self.processors(self.ids[:, : self.length], scores)  # type: ignore[arg-type]
            if self.greedy:
                token = int(scores.argmax(dim=-1))
            else:
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
            if self.top_logprobs is not None:
                self.logprobs.append(self._logprob(raw[0], token, self.top_logprobs))
        self.ids[0, self.length] = token
        self.length += 1
        self.generated += 1
        engine.count_step()
        complete = self.guide is not None and self.guide.advance(token)
        if token in self.stop_ids:  # its text is not part of the answer (as in vLLM)
            if self.top_logprobs is not None:
                self.logprobs.pop()
            return self._finish(FinishReason.STOP, "", 0)
        text, tokens = self._detokenize(token)
        if complete:
            return self._finish(FinishReason.STOP, text, tokens)
        if self.generated >= self.budget:
            return self._finish(FinishReason.LENGTH, text, tokens)
        return self._text(text, tokens)

    def _logprob(self, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits, dim=-1)
        alternatives: tuple[tuple[str, float], ...] = ()
        if top:
            values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            alternatives = tuple(
                (self.engine.token_text(int(i)), float(v))
                for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            )
        return TokenLogprob(self.engine.token_text(token), float(logprobs[token]), alternatives)

    def _text(self, text: str, tokens: int) -> list[Event]:
        """The events of stable text: itself, or what the tool-call parser makes of it."""
        if not text:
            return []
        logprobs = None
        if self.top_logprobs is not None:
            logprobs, self.logprobs = tuple(self.logprobs), []
        if self.calls is not None:
            return self.calls.feed(text, tokens, logprobs)
        return [Text(text, tokens, logprobs=logprobs)]

    def _detokenize(self, token: int) -> tuple[str, int]:
        """The text `token` makes stable, and the tokens that text holds."""
        self.unsent += 1
        text = self.detokenizer.feed((token,))
        if not text:
            return "", 0
        tokens, self.unsent = self.unsent, 0
        return text, tokens

    def _finish(self, reason: FinishReason, text: str, tokens: int) -> list[Event]:
        rest, rest_tokens = self.detokenizer.flush(), self.unsent
        self.unsent = 0
        events = self._text(text + rest, tokens + rest_tokens)
        if self.calls is not None:
            events.extend(self.calls.finish())
            reason = self.calls.finish_reason(reason)
        events.append(Finished(reason, self.generated))
        return events

    def release(self) -> None:
        """Drops the KV cache now rather than when the generator is collected."""
        self.cache = None


class _IdsSequence(_Sequence):
    """A sequence whose events carry their tokens' ids (`return_token_ids`): each step's
    sampled id, handed out by the events' counts (`IdsByCount`). A class of its own: the
    other requests' steps read no ids."""

    def __init__(
        self,
        engine: TransformersEngine,
        request: GenerateRequest,
        prepared: _Prepared,
        budget: int,
    ) -> None:
        super().__init__(engine, request, prepared, budget)
        self.sampled = IdsByCount()

    def step(self) -> list[Event]:
        events = super().step()
        self.sampled.add((int(self.ids[0, self.length - 1]),))  # the step's token
        return self.sampled.attach(events)


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
        tool_call_parser: str | None = None,
    ) -> None:
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            known = ", ".join(sorted(PARSERS))
            raise ValueError(f"tool_call_parser: expected one of {known}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
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
        self.vocab = self.hf_model.get_output_embeddings().weight.shape[0]
        # the ids Detokenize takes: the model's or the tokenizer's, whichever has more
        # (a model's vocabulary may be padded past the tokenizer's, or lack its added
        # tokens), as vLLM's check of token ids has it
        self.decodable = max(self.vocab, len(self.tokenizer))
        served = set(_SERVED)
        # Grammars need the tokenizer's Rust core (a fast tokenizer), as llguidance reads it;
        # without them the worker serves the rest and refuses response_format by name.
        self.guides: Guides | None = None
        if isinstance(self.tokenizer, PreTrainedTokenizerFast):
            try:
                self.guides = Guides(self.tokenizer, self.vocab, sorted(self.eos_token_ids))
                served |= {
                    features.RESPONSE_FORMAT,
                    features.STRUCTURED_REGEX,
                    features.STRUCTURED_CHOICE,
                }
            except ValueError as error:
                log.warning(
                    "%s: no structured outputs, llguidance cannot read its tokenizer: %s",
                    self.model,
                    error,
                )
        else:
            log.warning("%s: no structured outputs, its tokenizer is not a fast one", self.model)
        # Tools reach the model through its chat template; calls come back through the
        # grammar (forced ones) or the model's own format (the tool-call parser).
        if renders_tools(self.tokenizer) and (self.guides or tool_call_parser):
            served.add(features.TOOLS)
        self.features = frozenset(served)
        self._token_texts: dict[int, str] = {}
        parameters = inspect.signature(self.hf_model.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; older model code takes the old.
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are needed: skip the rest on a long prefill.
        self.forward_kwargs: dict[str, Any] = (
            {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        )
        # Every tokenization and model step runs here, off the event loop.
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="furnace-transformers")
        # Grammars compile in a thread of their own: a big schema never holds the model's.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="furnace-grammar")
        self._grammars: OrderedDict[tuple[str, str], asyncio.Future[llguidance.LLMatcher]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.running = 0
        self.aborted = 0
        self.steps = 0

    def count_step(self) -> None:
        """Counts a decode step; called from the pool's threads."""
        with self._lock:
            self.steps += 1

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs show it (special tokens included)."""
        text = self._token_texts.get(token)
        if text is None:
            decoded: str = self.tokenizer.decode([token])  # type: ignore[assignment]
            text = self._token_texts[token] = decoded
        return text

    def encode(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids: the chat template for messages, the plain text otherwise."""
        tokenizer = self.tokenizer
        if request.messages is not None:
            if tokenizer.chat_template is None:
                raise Invalid(
                    "This model has no chat template; use /v1/completions.", param="messages"
                )
            messages = [message_dict(m, parsed_arguments=True) for m in request.messages]
            tools: list[Any] | None = None
            if request.tools and request.tool_choice != "none":
                tools = [tool_dict(tool) for tool in request.tools]
            try:
                ids = tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=True,
                    return_dict=False,
                    **chat_end(request),
                    **template_kwargs(request),
                )
            except jinja2.TemplateError as error:  # e.g. "roles must alternate user/assistant"
                message = f"The chat template refused the messages: {error}"
                raise Invalid(message, param="messages") from None
            except ValueError as error:  # the last message cannot be left open
                raise chat_end_refused(request, error) from None
            return list(ids)
        return list(tokenizer(request.prompt or "").input_ids)

    def prepare(self, request: GenerateRequest, guide: Guide | None = None) -> _Prepared:
        """The prompt's tokens and the request's tool-call parser, with its grammar (the
        template takes CPU: this runs off the event loop)."""
        check_sampling(request.sampling, self.vocab)
        parser = for_request(request, self.tool_call_parser)
        return _Prepared(truncated(self.encode(request), request, self.max_context), guide, parser)

    async def guide(self, request: GenerateRequest) -> Guide | None:
        """The grammar the request's answer follows, if any: compiled once per schema in
        the grammar thread (choices of one request, arriving together, wait for the same
        compile), within `COMPILE_TIMEOUT`; each answer gets its own copy."""
        wanted = constraint(request)
        if wanted is None:
            return None
        kind, source, param = wanted
        guides = self._guides(param)
        key = kind, source if isinstance(source, str) else json.dumps(source, sort_keys=True)
        compiled = self._grammars.get(key)
        if compiled is None:
            loop = asyncio.get_running_loop()
            compiled = loop.run_in_executor(self._compiler, guides.matcher, wanted)
            # read by whoever waits; retrieved here too, for a compile no one waits for now
            compiled.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._grammars[key] = compiled
            while len(self._grammars) > COMPILED_KEPT:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        try:
            matcher = await asyncio.wait_for(asyncio.shield(compiled), COMPILE_TIMEOUT)
        except TimeoutError:
            message = f"The {param} did not compile within {COMPILE_TIMEOUT:g} s."
            raise Invalid(message, param=param) from None
        return Guide(matcher.deep_copy())

    def _guides(self, param: str) -> Guides:
        if self.guides is None:  # a slow tokenizer: llguidance reads fast ones only
            raise Invalid(f"This model cannot enforce {param}.", param=param)
        return self.guides

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The prompt's tokens as `generate` encodes them (in the pool's thread)."""
        loop = asyncio.get_running_loop()
        return len(await loop.run_in_executor(self._executor, self.encode, request))

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's ids as `generate` encodes them (in the pool's thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode, request)

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's piece of each id (`convert_ids_to_tokens`, in the pool's thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._token_strs, list(ids))

    def _token_strs(self, ids: list[int]) -> list[str]:
        check_vocabulary(ids, self.decodable, "tokens")
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        # an id past the tokenizer's own (the model's padding) has no piece: ""
        return ["" if piece is None else str(piece) for piece in pieces]

    async def detokenize(self, ids: Sequence[int]) -> str:
        """`tokenizer.decode(ids)`, special tokens kept, as vLLM's /detokenize (in the
        pool's thread); an id outside the vocabulary is refused naming "tokens"."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._detokenize, list(ids))

    def _detokenize(self, ids: list[int]) -> str:
        check_vocabulary(ids, self.decodable, "tokens")
        text: str = self.tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[assignment]
        return text

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Each input's last hidden state, mean-pooled over its tokens and L2-normalized
        (one forward pass per input, in the pool's thread). `dimensions` is not listed:
        cutting such a vector short means nothing unless the model was trained for it."""
        if request.user:
            log.info("embeddings %s are for user %r", request.request_id, request.user)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._embed, request)

    def _embed(self, request: EmbedRequest) -> Embeddings:
        inputs = [self._input_ids(value) for value in request.inputs]
        vectors = []
        with torch.inference_mode():
            for ids in inputs:
                tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
                hidden = self.hf_model.base_model(input_ids=tensor).last_hidden_state[0]
                pooled = torch.nn.functional.normalize(hidden.float().mean(dim=0), dim=0)
                vectors.append(tuple(pooled.tolist()))
        return Embeddings(tuple(vectors), sum(len(ids) for ids in inputs))

    def _input_ids(self, value: str | tuple[int, ...]) -> list[int]:
        """One input's tokens (a text is tokenized as a completion prompt is), checked."""
        ids = list(self.tokenizer(value).input_ids) if isinstance(value, str) else list(value)
        if not ids:
            raise Invalid("An input is empty.", param="input")
        check_vocabulary(ids, self.vocab, "input")
        if len(ids) > self.max_context:
            raise TooLong(
                f"This model's maximum context length is {self.max_context} tokens; "
                f"an input has {len(ids)}.",
                param="input",
            )
        return ids

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Tokenize, check the context, then decode step by step until EOS or the budget."""
        if request.user:
            log.info("request %s is for user %r", request.request_id, request.user)
        loop = asyncio.get_running_loop()
        guide = await self.guide(request)
        prepared = await loop.run_in_executor(self._executor, self.prepare, request, guide)
        param = "messages" if request.messages is not None else "prompt"
        prompt_tokens = len(prepared.prompt)
        if prompt_tokens == 0:
            raise Invalid("The prompt is empty.", param=param)
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise Invalid("max_tokens must be at least 1.", param="max_tokens")
        budget = check_context(request, prompt_tokens, self.max_context)
        kind = _IdsSequence if request.return_token_ids else _Sequence
        sequence = kind(self, request, prepared, budget)
        self.running += 1
        done = False
        pending: Future[list[Event]] | None = None
        try:
            prompt_ids = tuple(prepared.prompt) if request.return_token_ids else None
            yield Started(prompt_tokens, 0, prompt_ids)
            while True:
                pending = self._executor.submit(sequence.step)
                for event in await asyncio.wrap_future(pending):
                    if isinstance(event, Finished):  # the SDK may close us at this yield
                        done = True
                    yield event
                    if done:
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
        """Stops the thread pools once the steps already queued have run."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._compiler.shutdown(wait=True, cancel_futures=True)
