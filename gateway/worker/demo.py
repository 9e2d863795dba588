"""The demo engine: deterministic, no model needed. It echoes the words of the
last message (or of the completion prompt; system messages after the last turn are
passed over), one token per word, so the whole path can be run, tested and
benchmarked without a GPU, the OpenAI surface of issue 13 included. Its rules, which
tests rely on:

- Tokens are words: the prompt counts the words of every message. The context
  is checked as vLLM's server checks it (`check_context`): a prompt that leaves
  no token of `max_context` is `TooLong`, a `max_tokens` above it `Invalid`;
  `max_tokens`, or the context the prompt leaves, cuts an answer with `length`.
- `logprobs`: every token's logprob is -1.0; its `top` has exactly `logprobs`
  entries: the token itself at -1.0, then "<alt1>" at -2.0, "<alt2>" at -3.0, ...
- `n`: the worker SDK runs it n times (it is not `native_n`): identical choices.
- `tools`: with `tool_choice` "required" or a function's name, one call (to that
  function, else the first tool); with "auto" (the default with tools), a call of
  every tool whose name is a word of the last message (only the first when
  `parallel_tool_calls` is false), else the echo; "none" echoes. A call's
  arguments are the minimal instance of its parameters' schema (see
  `minimal_instance`), compact JSON. A call streams as a `ToolCallDelta` with
  its id ("call_" and 24 hex digits) and name (no tokens), then its arguments in
  pieces of at most 8 characters, one token each; the answer ends `tool_calls`.
- `response_format`: "json_object" answers `{}`, "json_schema" the schema's
  minimal instance, compact JSON, in pieces of at most 8 characters, one token each.
  `structured_outputs.choice`: the first of the choices that the text it echoes holds,
  else the first choice, whole, as one token. It refuses `structured_outputs`' `regex`
  and `grammar` (it does not list them).
- `continue_final_message` (a prefill: Anthropic's final assistant message): the last
  message is the one it echoes, as always; it renders no template, so it takes no
  `add_generation_prompt` (refused by name).
- `skip_special_tokens`: taken; a word is never a special token, so the text is the same.
- `truncate_prompt_tokens` N: the prompt counts its last N words (-1: what the context leaves
  beside `max_tokens`), and the echo is of the last N words of its text at most.
- `return_token_ids`: a token's id is the CRC-32 of its text's UTF-8 bytes without the
  spaces before it (a word's, as Tokenize's; a piece of JSON's or of a call's arguments):
  `Started` has the prompt's ids (Tokenize's, the last N with `truncate_prompt_tokens`),
  each event its token's; it has no end of sequence, so `Finished` carries none.
- `min_tokens`: the echo's words repeat until there are that many tokens;
  `ignore_eos` (which then needs `max_tokens`) repeats them up to `max_tokens`.
- Embeddings: 32 values from the SHA-256 of the input (a text, or token ids
  joined by spaces), each byte b as (b - 127.5) / 127.5, L2-normalized;
  `dimensions` d (1 to 32) keeps the first d and renormalizes. Its tokens are
  the input's words (or ids).
- `reasoning_effort` (chat's; the Responses API's `reasoning.effort`, the Messages
  API's `output_config.effort`): with an effort other than "none" it thinks before it
  answers (the echo, the calls or the JSON): the last words of the text it echoes, one
  for "minimal" and "low", two for "medium", four for "high", "xhigh" and "max" (all
  of them when there are fewer), as `Reasoning` pieces of one word (one token) each,
  counted in the answer's tokens and its `max_tokens`, as a reasoning model's thought
  is. Effort "none", thinking turned off (`off`: Anthropic's `thinking: disabled`) or
  no effort: no thought, the answer as without one.
- It refuses `image_url`, `repetition_penalty`, `min_p`, `logit_bias`,
  `stop_token_ids`, `include_reasoning`, `chat_template_kwargs` and
  `thinking_token_budget` (it does not list them, so the worker SDK refuses them).

- Tokenize (vLLM's /tokenize): one id per word, the words the prompt counts, in order
  (each message's reasoning, then its content); a word's id is the CRC-32 of its UTF-8
  bytes, so every demo worker, and every start, gives a word the same id. A token's
  string is its word; Detokenize joins the ids' words with single spaces, from the words
  this worker has tokenized (the last `DEMO_VOCABULARY` of them, at most
  `DEMO_VOCABULARY_CHARS` characters in all): an id it has not met is `Invalid` naming
  `tokens`, never another word (behind several demo workers, an id met by another one
  is refused so).

`token_delay` seconds before each token stand in for a GPU's pace.

KV cache (`gateway.worker.kv_events.LruBlockCache`): the prompt's UTF-8 bytes (as
`gateway.protocol.kv_blocks.prompt_bytes` renders it) in blocks of 16, `kv_blocks` of
them kept, least recently used dropped first; each accepted request stores its blocks
and publishes what it stored and evicted on `SubscribeKvEvents`, with a load record
(running requests, cache use). `prefill_delay` seconds per block the cache did not hold
pass before the first token, as a GPU's prefill would (0: none). `kv_blocks=0`: no
cache, no events. `Started` says the prompt's cached tokens: the words (its tokens)
that lie in the blocks the cache held, each with the separator after it (a space, or
the NUL ending its message), so a word the last held block cuts, or ends, is not
cached; roles are not words (`cached_words`). A prompt sent again finds its whole
blocks held: 192 of a 205-byte prompt's bytes.

Its counters are for tests and the soak benchmark (a few integer adds a call):
every generation it saw ends one way, so once `running` is 0,
`calls == finished + aborted + refused`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import re
import secrets
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from gateway.protocol import errors, features
from gateway.protocol.kv_blocks import EngineLoad, prompt_bytes
from gateway.protocol.types import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Reasoning,
    Started,
    Text,
    TokenLogprob,
    Tool,
    ToolCallDelta,
)
from gateway.worker.engine import MAX_DETOKENIZED_CHARS, Engine, check_context, kept_tokens
from gateway.worker.kv_events import KvPublisher, LruBlockCache

DEMO_MODEL = "furnace-demo"
#: The length of the demo's embeddings (SHA-256's 32 bytes).
DEMO_DIMENSIONS = 32
#: The longest piece of JSON (a tool call's arguments, a structured answer) per token.
JSON_PIECE = 8
#: The most characters and items, in all, of the smallest value the demo writes for a
#: schema (a valid schema's `minLength` may ask for a terabyte).
MAX_INSTANCE = 1 << 16

#: The most words the demo's Detokenize knows (the last ones Tokenize met), and their
#: characters in all.
DEMO_VOCABULARY = 1 << 16
DEMO_VOCABULARY_CHARS = 1 << 24

_WORD = re.compile(r"[A-Za-z0-9_-]+")
#: The words the demo thinks for each effort (see the module's rules); "none": none.
THOUGHT_WORDS = {"minimal": 1, "low": 1, "medium": 2, "high": 4, "xhigh": 4, "max": 4}


def minimal_instance(schema: Any) -> Any:
    """The smallest value a JSON Schema takes: its enum's first value, "" for a
    string, 0 for a number, false, [], null, an object with its required
    properties; a string's `minLength`, a number's `minimum` and an array's
    `minItems` are met. ValueError past `MAX_INSTANCE` characters and items in all,
    TypeError (or ValueError) where a keyword's value is not of its type."""
    left = MAX_INSTANCE

    def take(value: Any) -> int:
        nonlocal left
        count = int(value)
        left -= count
        if left < 0:
            raise ValueError(f"its smallest value holds more than {MAX_INSTANCE} characters")
        return count

    def smallest(schema: Any) -> Any:
        if not isinstance(schema, dict):
            return None
        if schema.get("enum"):
            return schema["enum"][0]
        if "const" in schema:
            return schema["const"]
        for key in ("anyOf", "oneOf", "allOf"):
            if schema.get(key):
                return smallest(schema[key][0])
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind is None and "properties" in schema:
            kind = "object"
        if kind == "string":
            return "a" * take(schema.get("minLength", 0))
        if kind in ("integer", "number"):
            low, high = schema.get("minimum"), schema.get("maximum")
            if low is not None and low > 0:
                return low
            return high if high is not None and high < 0 else 0
        if kind == "boolean":
            return False
        if kind == "array":
            count = take(schema.get("minItems", 0))
            if not count:
                return []
            before = left
            item = smallest(schema.get("items", {}))
            take((count - 1) * (before - left))  # the item's characters, once per copy
            return [item] * count
        if kind == "object":
            properties = schema.get("properties", {})
            return {name: smallest(properties.get(name, {})) for name in schema.get("required", ())}
        return None

    return smallest(schema)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _smallest(text: str, param: str) -> str:
    """The compact JSON of the smallest value of the schema in JSON text ("" is no
    schema: an object of nothing); a refusal naming `param` for what is not a schema
    the demo can answer (the gateway's edge refuses most of them before)."""
    try:
        schema = json.loads(text) if text else {"type": "object"}
    except ValueError:
        raise errors.Invalid("The schema is not valid JSON.", param=param) from None
    try:
        return _compact(minimal_instance(schema))
    except (TypeError, ValueError, RecursionError) as error:
        message = f"The demo engine cannot answer this schema: {error}."
        raise errors.Invalid(message, param=param) from None


def demo_vector(item: str | tuple[int, ...], dimensions: int | None = None) -> tuple[float, ...]:
    """The demo's embedding of one input (see the module's docstring)."""
    text = item if isinstance(item, str) else " ".join(str(i) for i in item)
    digest = hashlib.sha256(text.encode()).digest()[: dimensions or DEMO_DIMENSIONS]
    values = [(b - 127.5) / 127.5 for b in digest]
    norm = math.sqrt(sum(v * v for v in values))  # never 0: no byte is 127.5
    return tuple(v / norm for v in values)


def _pieces(text: str) -> list[str]:
    return [text[i : i + JSON_PIECE] for i in range(0, len(text), JSON_PIECE)] or [""]


def _word_ids(words: Sequence[str]) -> list[int]:
    """Each word's id: the CRC-32 of its UTF-8 bytes."""
    return [zlib.crc32(word.encode()) for word in words]


def _with_id(step: Reasoning | Text | ToolCallDelta) -> Reasoning | Text | ToolCallDelta:
    """A step of the answer with its token's id (a call's first piece, no token, none)."""
    if not step.tokens:
        return step
    piece = step.arguments if type(step) is ToolCallDelta else step.text  # type: ignore[union-attr]
    return step._replace(token_ids=tuple(_word_ids([piece.lstrip(" ")])))


def cached_words(head: bytes, chat: bool) -> int:
    """The words of a prompt's cached bytes `head` (as `prompt_bytes` renders it:
    role NUL content NUL per message for a chat), each followed by its separator
    there: the module's rule for the demo's cached tokens."""
    # a text prompt is one content; a chat's contents are its odd pieces
    pieces = head.split(b"\x00") if chat else [b"", head]
    words = sum(len(piece.split()) for piece in pieces[1:-1:2])  # contents ended by NUL
    if len(pieces) % 2 == 0:  # the last piece is a content the cache cut: its last
        last = pieces[-1]  # word counts when a space follows it there
        words += len(last.split()) - (bool(last) and not last[-1:].isspace())
    return words


class DemoEngine(Engine):
    """Echoes the prompt's last text back, word by word (see the module's rules)."""

    features = frozenset(
        {
            features.GENERATE,
            features.EMBEDDINGS,
            features.N,
            features.LOGPROBS,
            features.TOOLS,
            features.RESPONSE_FORMAT,
            features.STRUCTURED_CHOICE,
            features.USER,
            features.RETURN_TOKEN_IDS,
            features.MIN_TOKENS,
            features.IGNORE_EOS,
            features.DIMENSIONS,
            features.REASONING_EFFORT,
            features.TOKENIZE,
            features.CONTINUE_FINAL_MESSAGE,
            features.SKIP_SPECIAL_TOKENS,
            features.TRUNCATE_PROMPT_TOKENS,
        }
    )

    def __init__(
        self,
        model: str = DEMO_MODEL,
        max_context: int = 4096,
        token_delay: float = 0.0,
        capacity: int = 256,
        kv_blocks: int = 4096,
        prefill_delay: float = 0.0,
    ) -> None:
        self.model = model
        self.kv_cache = LruBlockCache(kv_blocks) if kv_blocks else None
        self.prefill_delay = prefill_delay
        self.max_context = max_context
        self.token_delay = token_delay
        self.capacity = capacity
        self.calls = 0  # generate calls started
        self.refused = 0  # calls refused before Started (too long, bad parameters)
        self.finished = 0  # generations that reached Finished
        self.served = 0  # requests accepted
        self.running = 0  # generations in progress; tests watch it fall back to 0
        self.aborted = 0  # generations stopped before their end
        self.embedded = 0  # Embed calls answered
        # the words Tokenize met, by id, and their ids (see the module's rules)
        self._vocabulary: OrderedDict[int, str] = OrderedDict()  # id → word, oldest first
        self._vocabulary_chars = 0

    def _prompt(self, request: GenerateRequest) -> tuple[int, str]:
        """The prompt's tokens (its words, an assistant message's reasoning included, as
        the templates that render it count them) and the text it answers: its last
        message's, passing over system messages after the others (an agent's reminders,
        such as Claude Code's, are not the turn it answers); with `truncate_prompt_tokens`
        the last words the prompt keeps, and of that text as many."""
        if request.messages is not None:
            messages = request.messages
            prompt_tokens = sum(len(m.content.split()) + len(m.reasoning.split()) for m in messages)
            turn = next((m for m in reversed(messages) if m.role != "system"), None)
            if turn is None:  # only system messages: the last of them
                turn = messages[-1] if messages else None
            text = turn.content if turn is not None else ""
        else:
            text = request.prompt or ""
            prompt_tokens = len(text.split())
        keep = kept_tokens(request, self.max_context)
        if keep is not None and keep < prompt_tokens:
            prompt_tokens, text = keep, " ".join(text.split()[-keep:])
        return prompt_tokens, text

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The words of the prompt, as `generate` counts them."""
        return self._prompt(request)[0]

    @staticmethod
    def _words(request: GenerateRequest) -> list[str]:
        """The prompt's words, those `_prompt` counts, in order: each message's
        reasoning, then its content."""
        if request.messages is not None:
            return [
                word
                for m in request.messages
                for text in (m.reasoning, m.content)
                for word in text.split()
            ]
        return (request.prompt or "").split()

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """One id per word (see the module's rules), each word kept for Detokenize."""
        words = self._words(request)
        ids = _word_ids(words)
        vocabulary = self._vocabulary
        for token, word in zip(ids, words, strict=True):
            if token in vocabulary:
                vocabulary.move_to_end(token)
                continue
            vocabulary[token] = word
            self._vocabulary_chars += len(word)
            while (
                len(vocabulary) > DEMO_VOCABULARY or self._vocabulary_chars > DEMO_VOCABULARY_CHARS
            ):  # the oldest word forgotten
                self._vocabulary_chars -= len(vocabulary.popitem(last=False)[1])
        return ids

    def _known(self, ids: Sequence[int]) -> list[str]:
        """The ids' words; `Invalid` naming "tokens" for an id this worker has not met."""
        vocabulary = self._vocabulary
        wrong = next((i for i in ids if i not in vocabulary), None)
        if wrong is not None:
            raise errors.Invalid(
                f"Token id {wrong} is not a word this demo worker has tokenized.",
                param="tokens",
            )
        return [vocabulary[i] for i in ids]

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's word."""
        return self._known(ids)

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The ids' words joined by single spaces."""
        words = self._known(ids)
        if sum(map(len, words)) + len(words) - 1 > MAX_DETOKENIZED_CHARS:
            raise errors.Invalid(
                f"The tokens decode to more than {MAX_DETOKENIZED_CHARS} characters.",
                param="tokens",
            )
        return " ".join(words)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Echo (or calls, or JSON), with the checks of a real server."""
        prompt_tokens, last = self._prompt(request)
        self.calls += 1
        try:
            budget = check_context(request, prompt_tokens, self.max_context)
            calls = self._calls(request, last)
            steps: Iterator[Reasoning | Text | ToolCallDelta] = itertools.chain(
                self._thought(request, last), self._steps(request, last, calls)
            )
            prompt_ids = None
            if request.return_token_ids:  # a map of its own: the others' steps pay nothing
                words = self._words(request)
                prompt_ids = tuple(_word_ids(words[len(words) - prompt_tokens :]))
                steps = map(_with_id, steps)
        except BaseException:
            self.refused += 1
            raise
        self.served += 1
        self.running += 1
        done = False
        uncached, cached = self._admit(request)
        try:
            yield Started(prompt_tokens, cached, prompt_ids)
            if uncached and self.prefill_delay:
                await asyncio.sleep(uncached * self.prefill_delay)
            tokens = 0
            for step in steps:
                if isinstance(step, ToolCallDelta) and not step.tokens:
                    yield step  # a call's id and name take no token
                    continue
                if tokens == budget:
                    done = True
                    yield Finished(FinishReason.LENGTH, tokens)
                    return
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                tokens += 1
                yield step
            done = True
            yield Finished(FinishReason.TOOL_CALLS if calls else FinishReason.STOP, tokens)
        finally:
            self.running -= 1
            if done:
                self.finished += 1
            else:
                self.aborted += 1

    def kv_events(self) -> KvPublisher | None:
        """The cache model's events (None with `kv_blocks=0`)."""
        return None if self.kv_cache is None else self.kv_cache.publisher

    def _admit(self, request: GenerateRequest) -> tuple[int, int]:
        """Runs the prompt through the cache model: the blocks it did not hold, and the
        prompt's tokens it did (`cached_words`)."""
        cache = self.kv_cache
        if cache is None:
            return 0, 0
        data = prompt_bytes(request)
        load = EngineLoad(running=self.running, kv_usage=cache.usage)
        held = cache.admit(data, load)
        cached = cached_words(data[: held * cache.block_size], request.messages is not None)
        return len(data) // cache.block_size - held, cached

    @staticmethod
    def _thought(request: GenerateRequest, last: str) -> list[Reasoning]:
        """What it thinks before the answer, by the effort (see the module's rules)."""
        reasoning = request.reasoning
        if reasoning is None or reasoning.off:
            return []
        count = THOUGHT_WORDS.get(reasoning.effort, 0)
        words = last.split()[-count:] if count else []
        return [Reasoning(w if i == 0 else " " + w, 1) for i, w in enumerate(words)]

    @staticmethod
    def _calls(request: GenerateRequest, last: str) -> list[Tool]:
        """The tools this answer calls, by the rules of `tool_choice`."""
        tools = request.tools
        choice = request.tool_choice or ("auto" if tools else "none")
        if choice == "none" or not tools:
            return []
        if choice == "required":
            return [tools[0]]
        if choice == "auto":
            words = set(_WORD.findall(last))
            called = [tool for tool in tools if tool.name in words]
            return called[:1] if request.parallel_tool_calls is False else called
        named = [tool for tool in tools if tool.name == choice]
        if not named:
            raise errors.Invalid(f"No tool is named `{choice}`.", param="tool_choice")
        return named[:1]

    def _steps(
        self, request: GenerateRequest, last: str, calls: list[Tool]
    ) -> Iterator[Text | ToolCallDelta]:
        """The answer's events, one token each (a call's first piece none)."""
        if calls:
            deltas: list[ToolCallDelta] = []
            for i, tool in enumerate(calls):
                arguments = _smallest(tool.parameters, "tools")
                deltas.append(ToolCallDelta(0, i, "call_" + secrets.token_hex(12), tool.name, ""))
                deltas.extend(ToolCallDelta(0, i, "", "", p, 1) for p in _pieces(arguments))
            return iter(deltas)
        words: Iterator[str]
        answer = request.response_format
        if answer is not None and answer.type == "json_schema":
            words = iter(_pieces(_smallest(answer.schema, "response_format")))
        elif answer is not None and answer.type == "choice":
            words = iter([next((c for c in answer.choice if c in last), answer.choice[0])])
        elif answer is not None:
            words = iter(["{}"])
        else:
            echo = last.split()
            s = request.sampling
            if s.ignore_eos and s.max_tokens is None:
                raise errors.Invalid("`ignore_eos` needs `max_tokens`.", param="ignore_eos")
            if echo and s.ignore_eos:
                words = itertools.cycle(echo)
            elif echo and s.min_tokens and s.min_tokens > len(echo):
                words = itertools.islice(itertools.cycle(echo), s.min_tokens)
            else:
                words = iter(echo)
            words = (w if i == 0 else " " + w for i, w in enumerate(words))
        return self._texts(words, request.logprobs)

    @staticmethod
    def _texts(pieces: Iterator[str], logprobs: int | None) -> Iterator[Text]:
        if logprobs is None:
            for piece in pieces:
                yield Text(piece, 1)
            return
        alternatives = tuple((f"<alt{i}>", -1.0 - i) for i in range(1, logprobs))
        for piece in pieces:
            top = ((piece, -1.0), *alternatives) if logprobs else ()
            yield Text(piece, 1, 0, (TokenLogprob(piece, -1.0, top),))

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """SHA-256 vectors (see the module's rules)."""
        d = request.dimensions
        if d is not None and not 1 <= d <= DEMO_DIMENSIONS:
            raise errors.Invalid(
                f"`dimensions` must be from 1 to {DEMO_DIMENSIONS}.", param="dimensions"
            )
        counts = [len(i.split()) if isinstance(i, str) else len(i) for i in request.inputs]
        if any(count > self.max_context for count in counts):
            raise errors.TooLong(
                f"This model's maximum context length is {self.max_context} tokens; "
                f"an input has {max(counts)}.",
                param="input",
            )
        self.embedded += 1
        return Embeddings(tuple(demo_vector(i, d) for i in request.inputs), sum(counts))
