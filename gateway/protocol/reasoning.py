"""A reasoning model's answer cut into its reasoning and its text, where the gateway reads
the engine's tokens itself (`upstream: vllm-grpc`), as vLLM's server does with
`--reasoning-parser`: the model thinks between `<think>` and `</think>`, and what it
says after is the answer.

Two ways a model opens its thought, named as vLLM names its parsers:

- `deepseek_r1`: the chat template opens it (DeepSeek-R1's ends its prompt with
  `<think>`), so the answer begins in thought, up to `</think>` (a `<think>` the model
  writes first anyway is dropped); an answer without `</think>` is all reasoning;
- `qwen3`: the model opens it itself, first thing (Qwen3's template, with thinking off,
  writes an empty thought into the prompt instead): an answer that does not begin with
  `<think>` is all text.

`template_options` is the other half: the chat template's variables the request's
reasoning parameters set, shared by every path that renders a template (the vllm-grpc
upstream, the worker SDK's engines).

The markers are looked for in the text, held back across pieces while they may be
starting: they are text in these models' vocabularies (added tokens, not special ones).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocol.types import ReasoningParams

#: The parsers served, by vLLM's names.
PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"

# Where a splitter is: before it knows whether the answer opens a thought (qwen3), or
# whether the model writes `<think>` first anyway (deepseek_r1); thinking; answering.
_OPENING, _THINKING, _ANSWERING = range(3)


class ReasoningSplitter:
    """Feeds one choice's text through; gives what is reasoning and what is text."""

    __slots__ = ("_held", "_opens", "_state")

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser: one of {', '.join(PARSERS)}, not {parser!r}")
        #: Whether the answer is a thought until `</think>` whatever it begins with.
        self._opens = parser == "deepseek_r1"
        self._state = _OPENING
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the text `text` releases (a marker's beginning held)."""
        text = self._held + text
        self._held = ""
        if self._state == _OPENING:
            stripped = text.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                self._held = text  # it may still be `<think>`
                return "", ""
            if stripped.startswith(START):
                text = stripped[len(START) :]
                self._state = _THINKING
            else:
                self._state = _THINKING if self._opens else _ANSWERING
        if self._state == _ANSWERING:
            return "", text
        at = text.find(END)
        if at >= 0:
            self._state = _ANSWERING
            return text[:at], text[at + len(END) :]
        keep = _partial(text)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""

    def last(self, text: str) -> tuple[str, str]:
        """`feed` of the answer's last piece: nothing is held back after it."""
        thought, answer = self.feed(text)
        more_thought, more_answer = self.flush()
        return thought + more_thought, answer + more_answer

    def flush(self) -> tuple[str, str]:
        """What was held back, once the answer ended."""
        held, self._held = self._held, ""
        if self._state == _THINKING or (self._state == _OPENING and self._opens):
            return held, ""
        return "", held


def _partial(text: str) -> int:
    """The length of the longest end of `text` that begins `</think>`."""
    for keep in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-keep:]):
            return keep
    return 0


def template_options(reasoning: ReasoningParams) -> dict[str, Any] | None:
    """The chat template's variables a request's reasoning parameters set, as vLLM's
    server sets them: `chat_template_kwargs`, and `reasoning_effort` (with
    `enable_thinking` off for "none", unless the kwargs say otherwise; thinking turned
    off is "none"). Stdlib JSON: the worker SDK, which goes into engines' own
    environments, reads it too."""
    options: dict[str, Any] = {}
    if reasoning.template_kwargs:
        options = json.loads(reasoning.template_kwargs)
    effort = reasoning.effort or ("none" if reasoning.off else "")
    if effort:
        options.setdefault("reasoning_effort", effort)
        options.setdefault("enable_thinking", effort != "none")
    return options or None
