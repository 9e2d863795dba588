"""The demo engine: deterministic, no model needed. It echoes the words of the
last message (or of the completion prompt), one token per word, so the whole
path can be run, tested and benchmarked without a GPU.

Tokens are words: the prompt counts the words of every message. A prompt that
does not fit `max_context` (with `max_tokens`, when given) is refused with
`TooLong`, as vLLM refuses it. `token_delay` seconds between tokens stand in
for a GPU's pace.

Its counters are for tests and the soak benchmark (a few integer adds a call):
every call it saw ends one way, so once `running` is 0,
`calls == finished + aborted + refused`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.protocol.types import Event, Finished, FinishReason, GenerateRequest, Started, Text
from gateway.worker.engine import Engine, check_context

DEMO_MODEL = "furnace-demo"


class DemoEngine(Engine):
    """Echoes the prompt's last text back, word by word."""

    def __init__(
        self,
        model: str = DEMO_MODEL,
        max_context: int = 4096,
        token_delay: float = 0.0,
        capacity: int = 256,
    ) -> None:
        self.model = model
        self.max_context = max_context
        self.token_delay = token_delay
        self.capacity = capacity
        self.calls = 0  # generate calls started
        self.refused = 0  # calls refused before Started (too long)
        self.finished = 0  # generations that reached Finished
        self.served = 0  # requests accepted
        self.running = 0  # generations in progress; tests watch it fall back to 0
        self.aborted = 0  # generations stopped before their end

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Echo, with the context and max_tokens checks of a real server."""
        if request.messages is not None:
            prompt_tokens = sum(len(m.content.split()) for m in request.messages)
            words = request.messages[-1].content.split() if request.messages else []
        else:
            words = (request.prompt or "").split()
            prompt_tokens = len(words)
        self.calls += 1
        try:
            budget = check_context(request, prompt_tokens, self.max_context)
        except BaseException:
            self.refused += 1
            raise
        self.served += 1
        self.running += 1
        done = False
        try:
            yield Started(prompt_tokens)
            for i, word in enumerate(words):
                if i == budget:
                    done = True
                    yield Finished(FinishReason.LENGTH, i)
                    return
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                yield Text(word if i == 0 else " " + word, 1)
            done = True
            yield Finished(FinishReason.STOP, len(words))
        finally:
            self.running -= 1
            if done:
                self.finished += 1
            else:
                self.aborted += 1
