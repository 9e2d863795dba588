"""vLLM as a worker's engine: its `AsyncLLM` in this process, behind our protocol.

vLLM batches continuously: every request joins one engine, which steps all its
running sequences together, so concurrent requests share each forward pass
instead of taking turns. With `output_kind=DELTA` each engine step hands a
request the text and tokens it gained in that step, which become one `Text`
(the SDK coalesces further when the network is slower than the engine).

The prompt is tokenized here, with the model's own tokenizer (the chat
template for messages, as vLLM's server renders it), in a thread of its own so
a long prompt does not stall the event loop; so the prompt's length is known
and a prompt that does not fit `max_model_len` is refused with `TooLong` before
the engine sees it. Unset sampling fields take the model's
`generation_config.json` defaults, as in vLLM's server.

Stop strings are not passed to vLLM: the SDK's matcher applies them, as for
every engine (one semantics and one held-back rule for all workers); its cut
closes this generator, which aborts the request in the engine. The cost is at
most the engine step already under way for that request.

A closed generator (the call was cancelled, its deadline passed, the client
left, or a stop string matched) aborts the request in the engine. The engine
starts in `start` (seconds to minutes), while the worker already answers health
checks with NOT_SERVING; `wait_dead` tells the worker when the engine died.

Requires vLLM in the worker's environment (its own, with its own pins): the
rest of the gateway never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
from vllm import SamplingParams as VllmSampling
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from gateway.protocol.errors import Failed, Invalid, Unavailable
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

log = logging.getLogger("furnace.worker")

#: vLLM's finish reasons we pass on; any other ("abort", "error") is a failure.
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
#: Seconds between looks at whether the engine died (one attribute read each).
DEAD_POLL = 1.0
_SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed")


def engine_args(
    model_path: str | Path, options: Sequence[str] = (), *, max_context: int | None = None
) -> Any:
    """vLLM's `AsyncEngineArgs` for the model folder, from vLLM's own command-line
    options (`--enforce-eager`, `--max-num-seqs 64`, `--kv-cache-memory-bytes 1G`,
    ...), parsed by vLLM's parser; `max_context` is `--max-model-len`."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a folder")
    parser = AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser(prog="furnace-gateway worker --engine vllm")
    )
    argv = ["--model", str(path), *options]
    if max_context is not None:
        argv += ["--max-model-len", str(max_context)]
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


class VllmEngine(Engine):
    """vLLM's `AsyncLLM` as an engine: built by `start`, freed by `shutdown`.

    `max_context` is the engine's `max_model_len` and `capacity` its
    `max_num_seqs`, both known once started; `load()` is the requests the engine
    holds (running or waiting), by its own count.
    """

    def __init__(self, args: Any, model: str | None = None) -> None:
        self.args = args
        self.model = model or Path(args.model).resolve().name
        self.max_context = 0  # known once started
        self.capacity = 1
        self.llm: Any = None
        self.tokenizer: Any = None
        self.defaults: dict[str, Any] = {}
        self._building: asyncio.Future[Any] | None = None
        self._ids = itertools.count()
        # Tokenization runs here, off the event loop (one thread: tokenizers are not
        # safe to share between threads).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="furnace-vllm-tokenize")

    async def start(self) -> None:
        """Builds the engine (vLLM loads the model and sizes its KV cache) in a thread,
        so the worker answers health checks meanwhile."""
        began = time.monotonic()
        loop = asyncio.get_running_loop()
        self._building = loop.run_in_executor(None, AsyncLLM.from_engine_args, self.args)
        llm = await asyncio.shield(self._building)
        self.tokenizer = llm.get_tokenizer()
        self.max_context = int(llm.model_config.max_model_len)
        self.capacity = int(llm.vllm_config.scheduler_config.max_num_seqs)
        self.defaults = {
            name: value
            for name, value in llm.model_config.get_diff_sampling_param().items()
            if name != "max_tokens"
        }
        self.llm = llm
        log.info(
            "vLLM engine for %s up in %.1f s: max_model_len %d, max_num_seqs %d",
            self.model,
            time.monotonic() - began,
            self.max_context,
            self.capacity,
        )

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
        if llm is not None:
            llm.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def load(self) -> int:
        """The requests in the engine (vLLM's count), 0 before it is up."""
        return 0 if self.llm is None else int(self.llm.get_num_unfinished_requests())

    def encode(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids: the chat template for messages, as vLLM's server
        renders it (special tokens come from the template), the plain text otherwise."""
        tokenizer = self.tokenizer
        if request.messages is None:
            return list(tokenizer.encode(request.prompt or ""))
        if getattr(tokenizer, "chat_template", None) is None:
            raise Invalid("This model has no chat template; use /v1/completions.", param="messages")
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateError as error:  # e.g. "roles must alternate user/assistant"
            message = f"The chat template refused the messages: {error}"
            raise Invalid(message, param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    def sampling(self, sampling: SamplingParams, max_tokens: int) -> Any:
        """vLLM's sampling parameters: ours where set, else the model's defaults."""
        options = dict(self.defaults)
        for name in _SAMPLING:
            value = getattr(sampling, name)
            if value is not None:
                options[name] = value
        if options.get("top_k") is not None and options["top_k"] <= 0:
            del options["top_k"]  # ours: 0 or unset is off
        try:
            return VllmSampling(
                **options, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
            )
        except ValueError as error:  # vLLM's checks of the values
            raise Invalid(str(error)) from None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Tokenize, check the context, then one `Text` per engine step until vLLM finishes."""
        llm = self.llm
        if llm is None or llm.errored:
            raise Unavailable("The engine is not running.")
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._executor, self.encode, request)
        param = "messages" if request.messages is not None else "prompt"
        if not prompt:
            raise Invalid("The prompt is empty.", param=param)
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise Invalid("max_tokens must be at least 1.", param="max_tokens")
        budget = check_context(request, len(prompt), self.max_context)
        params = self.sampling(request.sampling, budget)
        # Our own id, unique in this engine: vLLM aborts every request of an id.
        request_id = f"{request.request_id or 'furnace'}-{next(self._ids)}"
        outputs = llm.generate(tokens_input(prompt), params, request_id)
        started = done = False
        tokens = 0
        try:
            async for output in outputs:
                if not started:
                    started = True
                    yield Started(len(output.prompt_token_ids or prompt))
                completion = output.outputs[0]
                step = len(completion.token_ids)
                tokens += step
                if step or completion.text:
                    yield Text(completion.text, step)
                if output.finished:
                    reason = FINISH.get(completion.finish_reason)
                    if reason is None:
                        raise Failed(f"The engine ended the answer ({completion.finish_reason}).")
                    done = True
                    yield Finished(reason, tokens)
                    return
            raise Failed("The engine ended the answer without finishing it.")
        except VLLMValidationError as error:
            raise Invalid(str(error)) from None
        except EngineDeadError:
            raise Unavailable("The engine died.") from None
        finally:
            if not done:
                # Closed early (cancelled, deadline, client gone, stop string) or failed.
                await llm.abort(request_id)
                log.info("request %s aborted in the engine", request_id)
            await outputs.aclose()
