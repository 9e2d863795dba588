"""vLLM as a worker's engine: its `AsyncLLM` in this process, behind our protocol.

vLLM batches continuously: every request joins one engine, which steps all its
running sequences together, so concurrent requests share each forward pass
instead of taking turns. With `output_kind=DELTA` each engine step hands a
request the text and tokens it gained in that step, which become one event
(the SDK coalesces further when the network is slower than the engine).

The prompt is tokenized here, with the model's own tokenizer (the chat
template for messages and tools, as vLLM's server renders it), in a thread of
its own so a long prompt does not stall the event loop; so the prompt's length
is known and a prompt that does not fit `max_model_len` is refused with
`TooLong` before the engine sees it. Unset sampling fields take the model's
`generation_config.json` defaults, as in vLLM's server. A multimodal model's
conversations go through vLLM's own renderer instead, which fetches the images.

The OpenAI surface is vLLM's own: `n` is its parallel sampling (one prompt
prefill for all choices; greedy choices, which vLLM will not sample n times,
are one answer copied to each), logprobs its sampler's, `response_format` and a
forced `tool_choice` its guided decoding (the schemas its server uses: the
function's parameters for a named tool, an array of calls for "required"),
read back by the gateway's parsers of those answers. `tool_choice` "auto"
reads the text with the parser of the model's format (`--tool-call-parser`):
the gateway's where it has one (one behaviour for every kind of worker), else
vLLM's own parser of that name, fed each step. Whatever vLLM refuses is
`Invalid` naming the parameter.

Stop strings are not passed to vLLM: the SDK's matcher applies them, as for
every engine (one semantics and one held-back rule for all workers); its cut
closes this generator, which aborts the request in the engine. The cost is at
most the engine step already under way for that request.

With KV events (`--kv-events-config` publishing over ZMQ), the engine's blocks are
read back from its publisher and served on our `SubscribeKvEvents`, with a load record
(requests running and waiting, KV-cache use) from vLLM's scheduler statistics each
step (`SchedulerLoads`), so a gateway routes on the engine's queue as it does for
vLLM's gRPC server.

A closed generator (the call was cancelled, its deadline passed, the client
left, or a stop string matched) aborts the request in the engine. The engine
starts in `start` (seconds to minutes), while the worker already answers health
checks with NOT_SERVING; `wait_dead` tells the worker when the engine died.

With LoRA (vLLM's `--enable-lora`, `--max-loras`, `--max-lora-rank`), the engine serves
adapters of its model, each under its own name: those it starts with (`adapters`, the
worker's `--lora-modules NAME=PATH`) and those `LoadAdapter` adds at runtime (vLLM's
`add_lora`, which loads it before answering, so a bad adapter is refused then, not on
a request). Each name keeps one `LoRARequest` (its int id, given once, is the name's
for the engine's life: vLLM's cache and prefix-cache hashes key on it) and a request
naming it runs with it; vLLM keeps at most `--max-cpu-loras` of them in memory and
loads an evicted one again from its path when asked. A client names folders on this
machine and their count: only a folder holding `adapter_config.json` is read, at most
`max_adapters` names are held, and a name keeps its first path.

A generating model also answers Tokenize (the ids `generate` renders, as
`count_tokens` counts them; token strings by `convert_ids_to_tokens`) and Detokenize
(`tokenizer.decode`, special tokens kept), as vLLM's /tokenize and /detokenize do.

Started as a pooling model (vLLM's `--runner pooling`), the engine embeds
instead of generating: `embed` serves vectors, `dimensions` where the model is
a Matryoshka one; Tokenize and Detokenize as for a generating model (vLLM's
server tokenizes for any model).

Requires vLLM in the worker's environment (its own, with its own pins): the
rest of the gateway never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
from vllm import SamplingParams as VllmSampling
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from gateway.protocol import features, tool_calls
from gateway.protocol.chat import message_dict, tool_dict
from gateway.protocol.errors import Failed, Invalid, TooLong, Unavailable
from gateway.protocol.kv_blocks import EngineLoad
from gateway.protocol.kv_zmq import ZmqKvSubscriber
from gateway.protocol.token_ids import IdsByCount
from gateway.protocol.tool_calls import (
    CallPiece,
    ChoiceToolCalls,
    Parsed,
    ToolCallParser,
    new_call_id,
)
from gateway.protocol.types import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Started,
    Text,
    TokenLogprob,
)
from gateway.worker.engine import (
    Engine,
    chat_end,
    chat_end_refused,
    check_adapter,
    check_context,
    template_kwargs,
    truncated,
)
from gateway.worker.kv_events import ForwardedCache, KvPublisher

log = logging.getLogger("furnace.worker")

#: vLLM's finish reasons we pass on; any other ("abort", "error") is a failure.
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
#: Seconds between looks at whether the engine died (one attribute read each).
DEAD_POLL = 1.0
#: Temperatures below this are greedy sampling (vLLM's own bound).
GREEDY = 1e-5
#: The tool-call parser of `tool_choice` "auto" unless `--tool-call-parser` names another.
DEFAULT_TOOL_PARSER = "hermes"
#: Guided decoding unless the worker's options say otherwise: xgrammar without
#: free whitespace, or a model pads its JSON with blanks up to max_tokens.
STRUCTURED_OUTPUTS = '{"backend": "xgrammar", "disable_any_whitespace": true}'
#: The most adapters an engine holds by name unless `--max-adapters` says otherwise.
MAX_ADAPTERS = 64
#: The longest vLLM's refusal of an adapter that is passed on, in characters.
MAX_REASON = 512
#: What a generating model serves (plus "image_url" when it is multimodal).
#: Of vLLM's reasoning parameters, those its chat template takes: this engine runs no
#: reasoning parser, so it neither splits the reasoning from the answer
#: (`include_reasoning`) nor bounds it (`thinking_token_budget`, which vLLM serves only
#: with a reasoning config); those stay refused by name.
GENERATING = (
    features.SAMPLING
    | {
        features.GENERATE,
        features.N,
        features.LOGPROBS,
        features.TOOLS,
        features.RESPONSE_FORMAT,
        features.USER,
        features.REASONING_EFFORT,
        features.CHAT_TEMPLATE_KWARGS,
        features.TOKENIZE,
    }
    | features.STRUCTURED
    | features.CHAT_END
    | {features.SKIP_SPECIAL_TOKENS, features.TRUNCATE_PROMPT_TOKENS, features.RETURN_TOKEN_IDS}
)


#: What a refusal says a model does not serve, by the feature asked of it.
_SERVES = {features.EMBEDDINGS: "embeddings", features.TOKENIZE: "tokenization"}


def engine_args(
    model_path: str | Path, options: Sequence[str] = (), *, max_context: int | None = None
) -> Any:
    """vLLM's `AsyncEngineArgs` for the model folder, from vLLM's own command-line
    options (`--enforce-eager`, `--max-num-seqs 64`, `--kv-cache-memory-bytes 1G`,
    `--runner pooling`, ...), parsed by vLLM's parser; `max_context` is
    `--max-model-len`; guided decoding is `STRUCTURED_OUTPUTS` unless the options
    set `--structured-outputs-config`."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a folder")
    parser = AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser(prog="furnace-gateway worker --engine vllm")
    )
    argv = ["--model", str(path), *options]
    if not any(o.startswith("--structured-outputs-config") for o in options):
        argv += ["--structured-outputs-config", STRUCTURED_OUTPUTS]
    if max_context is not None:
        argv += ["--max-model-len", str(max_context)]
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


class VllmEngine(Engine):
    """vLLM's `AsyncLLM` as an engine: built by `start`, freed by `shutdown`.

    `max_context` is the engine's `max_model_len` and `capacity` its
    `max_num_seqs`, both known once started; its `features` are known from the
    model's config at once (a generating or a pooling model, multimodal or
    not); `load()` is the requests the engine holds (running or waiting), by
    its own count. `tool_parser` names the format of the model's tool calls:
    the gateway's parser of it, else vLLM's. With LoRA enabled in `args`, it serves
    adapters: `adapters` (name to folder) from its start, others loaded at runtime,
    at most `max_adapters` in all.
    """

    native_n = True

    def __init__(
        self,
        args: Any,
        model: str | None = None,
        *,
        tool_parser: str = DEFAULT_TOOL_PARSER,
        adapters: Mapping[str, str] | None = None,
        max_adapters: int = MAX_ADAPTERS,
    ) -> None:
        self.args = args
        self.model = model or Path(args.model).resolve().name
        self.max_context = 0  # known once started
        self.capacity = 1
        self.tool_parser = tool_parser
        self.llm: Any = None
        self.tokenizer: Any = None
        self.decodable = 0  # the ids Detokenize takes, known once started
        self.defaults: dict[str, Any] = {}
        # What it serves, from the model's config (read in milliseconds, before
        # the engine is built): a generating or a pooling model, with images or not.
        config = args.create_model_config()
        self.pooling = config.runner_type == "pooling"
        self.multimodal = bool(config.is_multimodal_model)
        self.matryoshka = bool(config.is_matryoshka)
        found = set(GENERATING)
        if self.multimodal:
            found.add(features.IMAGES)
        if self.pooling:
            found = {features.EMBEDDINGS, features.USER, features.TOKENIZE}
            if self.matryoshka:
                found.add(features.DIMENSIONS)
        self.features = frozenset(found)
        self.parser_class: Any = None  # vLLM's, for a format the gateway has no parser of
        if tool_parser not in tool_calls.PARSERS:
            from vllm.tool_parsers import ToolParserManager

            try:
                self.parser_class = ToolParserManager.get_tool_parser(tool_parser)
            except KeyError:
                raise ValueError(
                    f"unknown tool-call parser {tool_parser!r}: not the gateway's "
                    f"({', '.join(sorted(tool_calls.PARSERS))}) nor one of vLLM's"
                ) from None
        self._building: asyncio.Future[Any] | None = None
        self._ids = itertools.count()
        # LoRA adapters: vLLM's request of each, by name; ids from 1 (vLLM's lowest)
        self.takes_adapters = bool(getattr(args, "enable_lora", False))
        self._start_adapters = dict(adapters or {})
        if self._start_adapters and not self.takes_adapters:
            raise ValueError("adapters at start (--lora-modules) need vLLM's --enable-lora")
        if len(self._start_adapters) > max_adapters:
            raise ValueError(f"more adapters at start than --max-adapters ({max_adapters})")
        self.max_adapters = max_adapters
        self._loras: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)
        # vLLM's KV events, when its options publish them over ZMQ: read back here and
        # republished on our protocol (`SubscribeKvEvents`) once the engine is up
        self._kv_endpoint = _events_endpoint(getattr(args, "kv_events_config", None))
        self._kv = None if self._kv_endpoint is None else ForwardedCache()
        self._kv_task: asyncio.Task[None] | None = None
        self._loads = SchedulerLoads()
        # Tokenization runs here, off the event loop (one thread: tokenizers are not
        # safe to share between threads).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="furnace-vllm-tokenize")

    async def start(self) -> None:
        """Builds the engine (vLLM loads the model and sizes its KV cache) in a thread,
        so the worker answers health checks meanwhile."""
        began = time.monotonic()
        loop = asyncio.get_running_loop()
        # with KV events, vLLM's scheduler statistics each step become the load record
        loggers = None if self._kv is None else [self._loads.logger]
        build = functools.partial(AsyncLLM.from_engine_args, self.args, stat_loggers=loggers)
        self._building = loop.run_in_executor(None, build)
        llm = await asyncio.shield(self._building)
        config = llm.model_config
        self.tokenizer = llm.get_tokenizer()
        # the ids vLLM's check of token ids takes: the tokenizer's or the model's,
        # whichever has more (one may hold tokens the other lacks)
        self.decodable = max(int(self.tokenizer.max_token_id) + 1, int(config.get_vocab_size()))
        self.max_context = int(config.max_model_len)
        self.capacity = int(llm.vllm_config.scheduler_config.max_num_seqs)
        self.defaults = {
            name: value
            for name, value in config.get_diff_sampling_param().items()
            if name != "max_tokens"
        }
        if self.pooling and "embed" not in await llm.get_supported_tasks():
            llm.shutdown()
            raise RuntimeError(f"the pooling model {self.model} does not embed (--convert embed)")
        self.llm = llm
        for name, path in self._start_adapters.items():
            try:
                check_adapter(name, path)
                await self.load_adapter(name, path)
            except (Invalid, Unavailable) as error:
                raise RuntimeError(f"the adapter {name} at {path}: {error.message}") from None
        if self._kv_endpoint is not None:
            subscriber = ZmqKvSubscriber(self._kv_endpoint)
            self._kv_task = asyncio.create_task(self._forward_kv(subscriber))
            self._loads.changed = self._publish_load
        log.info(
            "vLLM engine for %s up in %.1f s: max_model_len %d, max_num_seqs %d, serves %s",
            self.model,
            time.monotonic() - began,
            self.max_context,
            self.capacity,
            ", ".join(sorted(self.features)) or "nothing",
        )

    def adapters(self) -> Collection[str]:
        """The adapters it serves, by name."""
        return self._loras.keys()

    async def load_adapter(self, name: str, path: str) -> None:
        """Adds the adapter to the engine (vLLM's `add_lora`, which loads its weights
        now); a name it holds from the same folder is loaded. `Invalid` for what it
        cannot serve: no adapter there, one vLLM refuses, another folder under that
        name, no room; `Unavailable` while the engine is not up."""
        llm = self.llm
        if llm is None or llm.errored:
            raise Unavailable("The engine is not running.")
        held = self._loras.get(name)
        if held is not None:
            if not _same_path(held.lora_path, path):
                raise Invalid(f"The adapter `{name}` is served from another folder here.")
            return
        if name == self.model:
            raise Invalid(f"`{name}` is this worker's model, not a name for an adapter of it.")
        if len(self._loras) >= self.max_adapters:
            raise Invalid(
                f"This worker holds its most adapters ({self.max_adapters}: --max-adapters)."
            )
        config = os.path.join(path, "adapter_config.json")
        if not await asyncio.to_thread(os.path.isfile, config):  # a slow mount waits there
            raise Invalid(f"No LoRA adapter at `{path}` on this worker (no adapter_config.json).")
        request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=path)
        try:
            loaded = await llm.add_lora(request)
        except EngineDeadError:
            raise Unavailable("The engine died.") from None
        except Exception as error:  # vLLM's refusal, e.g. a rank above --max-lora-rank
            reason = str(error)[:MAX_REASON]
            message = f"vLLM could not load the adapter `{name}` from `{path}`: {reason}"
            raise Invalid(message) from None
        if loaded is False:
            raise Invalid(f"vLLM did not load the adapter `{name}` from `{path}`.")
        self._loras.setdefault(name, request)

    def kv_events(self) -> KvPublisher | None:
        """vLLM's KV events, when its `--kv-events-config` publishes them over ZMQ."""
        return None if self._kv is None else self._kv.publisher

    async def _forward_kv(self, subscriber: ZmqKvSubscriber) -> None:
        """Reads the engine's ZMQ publisher into `_kv` (which republishes it), each
        batch with the engine's load, until shutdown."""
        assert self._kv is not None
        try:
            async for batch in subscriber.batches():
                self._kv.apply(batch, self._loads.load)
        except Exception:  # the answers go on without events; say why once
            log.exception("vLLM's KV events from %s: no longer forwarded", subscriber.endpoint)

    def _publish_load(self, load: EngineLoad) -> None:
        assert self._kv is not None
        if self._kv.publisher.subscribers:
            self._kv.publisher.publish((), load)

    async def wait_dead(self) -> None:
        """Returns once the engine has died (vLLM's `errored`)."""
        while True:  # vLLM has no event to wait on: a thread of its sets a flag
            if self.llm is not None and self.llm.errored:
                return
            await asyncio.sleep(DEAD_POLL)

    async def shutdown(self) -> None:
        """Stops the engine's process; an engine still being built is stopped once built."""
        llm = self.llm
        if llm is None and self._building is not None:
            with contextlib.suppress(Exception):
                llm = await self._building
        self.llm = None
        if self._kv_task is not None:
            self._kv_task.cancel()
        if llm is not None:
            llm.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def load(self) -> int:
        """The requests in the engine (vLLM's count), 0 before it is up."""
        return 0 if self.llm is None else int(self.llm.get_num_unfinished_requests())

    def _running(self, feature: str) -> Any:
        """The engine, if it runs and serves `feature`."""
        llm = self.llm
        if llm is None or llm.errored:
            raise Unavailable("The engine is not running.")
        if feature not in self.features:
            what = _SERVES.get(feature, "generation")
            raise Invalid(f"The model `{self.model}` does not serve {what}.", param="model")
        return llm

    def encode(
        self, request: GenerateRequest, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids: the chat template for messages (and `tools`), as
        vLLM's server renders it (special tokens come from the template), the plain
        text otherwise."""
        tokenizer = self.tokenizer
        if request.messages is None:
            return list(tokenizer.encode(request.prompt or ""))
        if getattr(tokenizer, "chat_template", None) is None:
            raise Invalid("This model has no chat template; use /v1/completions.", param="messages")
        messages = [message_dict(m, parsed_arguments=True) for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                **chat_end(request),
                **template_kwargs(request),
            )
        except jinja2.TemplateError as error:  # e.g. "roles must alternate user/assistant"
            message = f"The chat template refused the messages: {error}"
            raise Invalid(message, param="messages") from None
        except ValueError as error:  # the last message cannot be left open
            raise chat_end_refused(request, error) from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    async def _render(
        self, request: GenerateRequest, tools: list[dict[str, Any]] | None
    ) -> tuple[Any, int | None]:
        """The engine's input and its length in tokens (None: not known here).
        A multimodal model's conversation goes through vLLM's renderer, as in
        vLLM's server: it fetches the images and places their tokens."""
        if self.multimodal and request.messages is not None:
            from vllm.renderers.params import ChatParams

            if request.truncate_prompt_tokens is not None:  # its images' tokens inside
                raise Invalid(
                    f"The model `{self.model}` cannot cut a conversation with images.",
                    param="truncate_prompt_tokens",
                )

            messages = [message_dict(m, parsed_arguments=True) for m in request.messages]
            options = {**template_kwargs(request), **chat_end(request), "tools": tools}
            try:
                _, (engine_input,) = await self.llm.renderer.render_chat_async(
                    [messages], ChatParams(chat_template_kwargs=options)
                )
            except (ValueError, jinja2.TemplateError) as error:
                raise _refused(error, "messages") from None
            ids = engine_input.get("prompt_token_ids")
            return engine_input, None if ids is None else len(ids)
        if request.messages is not None and any(m.images for m in request.messages):
            raise Invalid(f"The model `{self.model}` takes no images.", param="messages")
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._executor, self.encode, request, tools)
        ids = truncated(ids, request, self.max_context)
        return tokens_input(ids), len(ids)

    def sampling(
        self,
        request: GenerateRequest,
        max_tokens: int | None,
        guided: Any = None,
        skip_special_tokens: bool = True,
    ) -> Any:
        """vLLM's sampling parameters: ours where set, else the model's defaults."""
        options = dict(self.defaults)
        sampling = request.sampling
        options.update(sampling.given())
        options.pop("max_tokens", None)  # `max_tokens` (the room left) is the one vLLM gets
        if options.get("top_k") is not None and options["top_k"] <= 0:
            del options["top_k"]  # ours: 0 or unset is off
        if sampling.logit_bias:
            options["logit_bias"] = dict(sampling.logit_bias)
        if sampling.stop_token_ids:
            options["stop_token_ids"] = list(sampling.stop_token_ids)
        # Greedy choices are all the same answer: vLLM refuses n > 1 for them, so
        # one is generated and `generate` copies it to every choice (as OpenAI answers).
        greedy = options.get("temperature", 1.0) < GREEDY
        try:
            return VllmSampling(
                **options,
                n=1 if greedy else max(request.n, 1),
                logprobs=request.logprobs,
                max_tokens=max_tokens,
                structured_outputs=guided,
                skip_special_tokens=skip_special_tokens,
                output_kind=RequestOutputKind.DELTA,
            )
        except VLLMValidationError as error:  # vLLM's checks of the values
            raise Invalid(str(error), param=error.parameter) from None
        except ValueError as error:
            raise Invalid(str(error)) from None

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The prompt's tokens as `generate` renders them (off the event loop); a
        multimodal conversation through vLLM's renderer."""
        self._running(features.GENERATE)
        _, length = await self._render(request, _ToolPlan(request, self).rendered)
        if length is None:
            raise Invalid(f"The model `{self.model}` cannot count this prompt.", param="messages")
        return length

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's ids as `generate` renders them (those `count_tokens` counts); a
        multimodal conversation through vLLM's renderer, refused as `count_tokens`
        refuses where it gives no ids."""
        self._running(features.TOKENIZE)
        rendered, length = await self._render(request, _ToolPlan(request, self).rendered)
        ids = None if length is None else rendered.get("prompt_token_ids")
        if ids is None:
            message = f"The model `{self.model}` cannot tokenize this prompt."
            raise Invalid(message, param="messages")
        return list(ids)

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's piece of each id (`convert_ids_to_tokens`, as vLLM's
        /tokenize), off the event loop."""
        self._running(features.TOKENIZE)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._token_strs, list(ids))

    def _token_strs(self, ids: list[int]) -> list[str]:
        self._check_ids(ids)
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        return ["" if piece is None else str(piece) for piece in pieces]

    async def detokenize(self, ids: Sequence[int]) -> str:
        """`tokenizer.decode(ids)`, special tokens kept, as vLLM's /detokenize (off the
        event loop); an id outside the vocabulary is refused naming "tokens"."""
        self._running(features.TOKENIZE)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._detokenize, list(ids))

    def _detokenize(self, ids: list[int]) -> str:
        self._check_ids(ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _check_ids(self, ids: list[int]) -> None:
        wrong = next((i for i in ids if not 0 <= i < self.decodable), None)
        if wrong is not None:
            message = f"Token id {wrong} is out of the vocabulary (0 to {self.decodable - 1})."
            raise Invalid(message, param="tokens")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Render and check the context, then per engine step each choice's
        `Text` (or tool-call pieces) until vLLM finishes every choice."""
        llm = self._running(features.GENERATE)
        plan = _ToolPlan(request, self)
        prompt, length = await self._render(request, plan.rendered)
        param = "messages" if request.messages is not None else "prompt"
        if length == 0:
            raise Invalid("The prompt is empty.", param=param)
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise Invalid("max_tokens must be at least 1.", param="max_tokens")
        budget: int | None = max_tokens  # None: up to the context (vLLM counts and checks)
        if length is not None:
            budget = check_context(request, length, self.max_context)
        params = self.sampling(request, budget, plan.guided(), plan.skip_special_tokens)
        # Our own id, unique in this engine: vLLM aborts every request of an id.
        request_id = f"{request.request_id or 'furnace'}-{next(self._ids)}"
        if request.user:
            log.info("request %s for user %r", request_id, request.user)
        outputs = llm.generate(
            prompt, params, request_id, lora_request=self._loras.get(request.model)
        )
        kind = _IdsChoice if request.return_token_ids else _Choice
        choices = [kind(i, plan, request.logprobs) for i in range(max(request.n, 1))]
        copied = params.n < len(choices)  # greedy: vLLM's one answer is every choice's
        started = done = False
        try:
            async for output in outputs:
                done = output.finished  # nothing left to abort, even if closed from here
                if not started:
                    started = True
                    # the prompt's tokens its prefix cache held (an older vLLM: none said)
                    cached = getattr(output, "num_cached_tokens", None) or 0
                    prompt_ids = output.prompt_token_ids or ()
                    ids = tuple(prompt_ids) if request.return_token_ids else None
                    yield Started(len(prompt_ids) or (length or 0), cached, ids)
                for completion in output.outputs:
                    for choice in choices if copied else (choices[completion.index],):
                        for event in choice.step(completion):
                            yield event
                        if completion.finish_reason is not None:
                            for event in choice.finish(completion.finish_reason):
                                yield event
                if done:
                    return
            raise Failed("The engine ended the answer without finishing it.")
        except VLLMValidationError as error:
            raise _refused(error, error.parameter or plan.param, param) from None
        except ValueError as error:  # vLLM's checks of the request, before it runs
            if started:
                raise
            raise Invalid(str(error), param=plan.param) from None
        except EngineDeadError:
            raise Unavailable("The engine died.") from None
        finally:
            if not done:
                # Closed early (cancelled, deadline, client gone, stop string) or failed.
                await llm.abort(request_id)
                log.info("request %s aborted in the engine", request_id)
            await outputs.aclose()

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """One pooled vector per input, all inputs in the engine at once."""
        llm = self._running(features.EMBEDDINGS)
        if request.dimensions is not None and not self.matryoshka:
            raise Invalid(
                f"The model `{self.model}` cannot shorten its embeddings.", param="dimensions"
            )
        loop = asyncio.get_running_loop()
        inputs = await loop.run_in_executor(self._executor, self._embed_inputs, request)
        pooling = PoolingParams(task="embed", dimensions=request.dimensions)
        base = f"{request.request_id or 'furnace'}-{next(self._ids)}"
        if request.user:
            log.info("request %s for user %r", base, request.user)
        lora = self._loras.get(request.model)
        vectors = await asyncio.gather(
            *(
                self._embed_one(llm, ids, pooling, f"{base}-{i}", lora)
                for i, ids in enumerate(inputs)
            )
        )
        return Embeddings(tuple(vectors), sum(len(ids) for ids in inputs))

    def _embed_inputs(self, request: EmbedRequest) -> list[list[int]]:
        """Each input's token ids (texts tokenized here), each checked to fit."""
        inputs = []
        for i, item in enumerate(request.inputs):
            ids = list(self.tokenizer.encode(item)) if isinstance(item, str) else list(item)
            if not ids:
                raise Invalid(f"Input {i} is empty.", param="input")
            if len(ids) > self.max_context:
                raise TooLong(
                    f"This model's maximum context length is {self.max_context} tokens. "
                    f"However, input {i} has {len(ids)} tokens.",
                    param="input",
                )
            inputs.append(ids)
        return inputs

    async def _embed_one(
        self, llm: Any, ids: list[int], pooling: Any, request_id: str, lora: Any = None
    ) -> tuple[float, ...]:
        done = False
        try:
            async for output in llm.encode(
                tokens_input(ids), pooling, request_id, lora_request=lora
            ):
                if output.finished:
                    done = True
                    return tuple(output.outputs.data.tolist())
            raise Failed("The engine ended the embedding without finishing it.")
        except VLLMValidationError as error:
            raise Invalid(str(error), param=error.parameter or "input") from None
        except EngineDeadError:
            raise Unavailable("The engine died.") from None
        finally:
            if not done:
                await llm.abort(request_id)


class SchedulerLoads:
    """vLLM's scheduler statistics as our load record: a stat logger of its engine
    (`stat_loggers`, called on the event loop with each engine step's statistics) that
    keeps the last record and calls `changed` when the queue moved or the KV-cache use
    moved by `USAGE_STEP`, so subscribers hear of a busy engine between KV events, as
    vLLM's gRPC server tells its own each step. vLLM does not count the uncached
    prompt tokens of its waiting requests there: that field stays 0."""

    #: The smallest change of KV-cache use worth a record.
    USAGE_STEP = 0.01

    def __init__(self) -> None:
        self.load = self._sent = EngineLoad()
        self.changed: Callable[[EngineLoad], None] | None = None

    def logger(self, vllm_config: Any, engine_index: int = 0) -> SchedulerLoads:
        """vLLM's stat-logger factory: this object serves every engine of the process."""
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        load = EngineLoad(
            running=int(scheduler_stats.num_running_reqs),
            waiting=int(scheduler_stats.num_waiting_reqs)
            + int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)),
            kv_usage=min(max(float(scheduler_stats.kv_cache_usage), 0.0), 1.0),
        )
        self.load, sent = load, self._sent
        moved = abs(load.kv_usage - sent.kv_usage) >= self.USAGE_STEP
        if self.changed is not None and (load[:2] != sent[:2] or moved):
            self._sent = load
            self.changed(load)

    def log(self) -> None:
        """vLLM's periodic log: nothing to say."""

    def log_engine_initialized(self) -> None:
        """vLLM's start notice: nothing to say."""


def _events_endpoint(config: Any) -> str | None:
    """Where this process reads vLLM's KV events from, for its `KVEventsConfig`: its
    ZMQ publisher's bind address, on loopback; None when it publishes none (or only
    connects out, or to a port it picks itself, which this process cannot know)."""
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    endpoint = str(config.endpoint)
    if endpoint.startswith("ipc://"):
        return endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if endpoint.startswith("tcp://") and host in ("*", "0.0.0.0") and port not in ("", "0"):
        return f"tcp://127.0.0.1:{port}"
    log.warning(
        "vLLM's KV events at %s are not forwarded: give --kv-events-config an endpoint "
        "tcp://*:PORT (a fixed port it binds)",
        endpoint,
    )
    return None


def _same_path(one: str, other: str) -> bool:
    """Whether two absolute paths name one folder, spelled alike or not (`a/./b/`, `a/b`);
    by their text alone, reading no file system."""
    return os.path.normpath(one) == os.path.normpath(other)


def _refused(error: Exception, param: str | None, prompt: str = "messages") -> Invalid | TooLong:
    """vLLM's refusal of a request: `TooLong` naming the prompt's parameter
    when the prompt does not fit the context, else `Invalid` naming `param`."""
    if "longer than the maximum model length" in str(error):
        return TooLong(str(error), param=prompt)
    return Invalid(str(error), param=param)


class _ToolPlan:
    """What a request's tools and response format make of the answer: the tools
    the template renders, the guided decoding, and each choice's tool-call
    parser (`gateway.protocol.tool_calls`: the forced call's for "required" or a
    named function, else the model's format's; none for "none" or no tools)."""

    def __init__(self, request: GenerateRequest, engine: VllmEngine) -> None:
        self.request = request
        self.engine = engine
        choice = request.tool_choice
        self.forced = tool_calls.forced(choice)
        if self.forced and not request.tools:
            raise Invalid(f"tool_choice {choice!r} needs tools.", param="tool_choice")
        if self.forced and request.response_format is not None:
            raise Invalid(
                f"response_format cannot be followed with tool_choice {choice!r}: "
                "the calls are the answer.",
                param="response_format",
            )
        self.called = bool(request.tools) and choice != "none"
        self.rendered = [tool_dict(t) for t in request.tools] if self.called else None
        self.param: str | None = "tools" if self.forced else None
        if request.response_format is not None:
            self.param = "response_format"
        self.vllm_parser = (
            self.called and not self.forced and engine.tool_parser not in tool_calls.PARSERS
        )
        self.chat_request: Any = None
        # The markers of a call may be special tokens (vLLM's parsers keep them too).
        self.skip_special_tokens = request.skip_special_tokens and (not self.called or self.forced)
        if self.vllm_parser:
            self.chat_request = _VllmParser.chat_request(request, engine)
        self.parser(0)  # refuses what no parser can serve, before the engine runs

    def guided(self) -> Any:
        """vLLM's guided decoding for the answer, None when it is free."""
        request, fmt = self.request, self.request.response_format
        if self.forced:
            schema = tool_calls.required_schema(
                request.tools, request.tool_choice, request.parallel_tool_calls
            )
            return StructuredOutputsParams(json=schema)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type == "json_schema":
            try:
                return StructuredOutputsParams(json=json.loads(fmt.schema))
            except json.JSONDecodeError as error:
                message = f"The schema is not valid JSON: {error}"
                raise Invalid(message, param="response_format") from None
        if fmt.type == "regex":
            return StructuredOutputsParams(regex=fmt.regex)
        if fmt.type == "choice":
            return StructuredOutputsParams(choice=list(fmt.choice))
        if fmt.type == "grammar":
            return StructuredOutputsParams(grammar=fmt.grammar)
        raise Invalid(f"Unknown response_format type {fmt.type!r}.", param="response_format")

    def parser(self, index: int) -> ToolCallParser | None:
        """A new tool-call parser for choice `index`; None: the answer is plain text."""
        if self.vllm_parser:
            return _VllmParser(self.request, self.engine, self.chat_request)
        name = self.engine.tool_parser if self.engine.tool_parser in tool_calls.PARSERS else None
        return tool_calls.for_request(self.request, name)


class _VllmParser(ToolCallParser):
    """vLLM's own tool-call parser (for a `--tool-call-parser` format the gateway
    has no parser of) behind the gateway's parser interface: vLLM's parsers read
    the whole text so far at each step (and its token ids: `ids` gives them
    before each `feed`) and say what the step adds, content or pieces of calls.
    Call ids are ours; with `parallel_tool_calls` false, calls after the first
    are dropped; text a parser still holds at the end is shown if nothing was
    called."""

    def __init__(self, request: GenerateRequest, engine: VllmEngine, chat_request: Any) -> None:
        super().__init__(request.tools)
        self._parser = engine.parser_class(engine.tokenizer, chat_request.tools)
        self._request = chat_request
        self._parallel = request.parallel_tool_calls is not False
        self._text = ""
        self._ids: list[int] = []
        self._new_ids: Sequence[int] = ()
        self._shown = 0  # characters of content shown

    @staticmethod
    def chat_request(request: GenerateRequest, engine: VllmEngine) -> Any:
        """The request as vLLM's parsers read it (OpenAI's chat request)."""
        import pydantic
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            return ChatCompletionRequest(
                model=engine.model,
                messages=[message_dict(m) for m in request.messages or ()],
                tools=[tool_dict(t) for t in request.tools],
                tool_choice="auto",
            )
        except pydantic.ValidationError as error:
            raise Invalid(f"vLLM refused the tools: {error}", param="tools") from None

    def ids(self, token_ids: Sequence[int]) -> None:
        """The token ids of the text the next `feed` gets."""
        self._new_ids = token_ids

    def feed(self, text: str) -> Parsed:
        previous, previous_ids = self._text, self._ids
        self._text, self._ids = previous + text, [*previous_ids, *self._new_ids]
        delta = self._parser.extract_tool_calls_streaming(
            previous, self._text, text, previous_ids, self._ids, self._new_ids, self._request
        )
        if delta is None:
            return Parsed("")
        shown = "" if self.called else (delta.content or "")
        self._shown += len(shown)
        pieces: list[CallPiece] = []
        for call in delta.tool_calls or ():
            if call.index > 0 and not self._parallel:
                continue
            name = (call.function.name if call.function else None) or ""
            arguments = (call.function.arguments if call.function else None) or ""
            if call.id or name:
                self._calls += 1
                pieces.append(CallPiece(call.index, new_call_id(), name, ""))
            if arguments:
                pieces.append(CallPiece(call.index, "", "", arguments))
        return Parsed(shown, tuple(pieces))

    def finish(self) -> Parsed:
        return Parsed("" if self.called else self._text[self._shown :])


class _Choice:
    """One choice's events: plain `Text` per step (with its logprobs), or what
    its tool-call parser makes of the text; and its Finished with its own
    token count."""

    def __init__(self, index: int, plan: _ToolPlan, logprobs: int | None) -> None:
        self.index = index
        self.parser = plan.parser(index)
        self.calls = None if self.parser is None else ChoiceToolCalls(self.parser, index)
        self.top = logprobs  # alternatives per token; None: no logprobs
        self.tokens = 0

    def step(self, completion: Any) -> list[Event]:
        """The events of one engine step's output for this choice."""
        ids = completion.token_ids
        self.tokens += len(ids)
        logprobs = None
        if self.top is not None:
            logprobs = self._logprobs(ids, completion.logprobs or ())
        if self.calls is None:
            if not ids and not completion.text:
                return []
            return [Text(completion.text, len(ids), self.index, logprobs)]
        if isinstance(self.parser, _VllmParser):
            self.parser.ids(ids)
        return self.calls.feed(completion.text, len(ids), logprobs)

    def _logprobs(self, ids: Sequence[int], positions: Sequence[Any]) -> tuple[TokenLogprob, ...]:
        """Each token's logprob and its `top` most likely alternatives, decoded
        (vLLM gives the top ones by rank, plus the sampled one when not among them)."""
        out = []
        for token_id, candidates in zip(ids, positions, strict=False):
            chosen = candidates[token_id]
            ranked = sorted(candidates.values(), key=lambda c: c.rank)
            top = tuple((c.decoded_token or "", c.logprob) for c in ranked[: self.top])
            out.append(TokenLogprob(chosen.decoded_token or "", chosen.logprob, top))
        return tuple(out)

    def finish(self, vllm_reason: str) -> list[Event]:
        """What a parser still held, then the choice's Finished."""
        reason = FINISH.get(vllm_reason)
        if reason is None:
            raise Failed(f"The engine ended the answer ({vllm_reason}).")
        if self.calls is None:
            return [Finished(reason, self.tokens, index=self.index)]
        events = self.calls.finish()
        events.append(Finished(self.calls.finish_reason(reason), self.tokens, index=self.index))
        return events


class _IdsChoice(_Choice):
    """A choice whose events carry their tokens' ids (`return_token_ids`): each step's
    ids (vLLM's, the end of sequence's too), handed out by the events' counts
    (`IdsByCount`). A class of its own: the other requests' steps read no ids."""

    def __init__(self, index: int, plan: _ToolPlan, logprobs: int | None) -> None:
        super().__init__(index, plan, logprobs)
        self.sampled = IdsByCount()

    def step(self, completion: Any) -> list[Event]:
        self.sampled.add(completion.token_ids)
        return self.sampled.attach(super().step(completion))

    def finish(self, vllm_reason: str) -> list[Event]:
        return self.sampled.attach(super().finish(vllm_reason))
