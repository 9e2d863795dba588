"""Bounds on what one request may ask, past what validation checks: how many
chat messages, a model's cap on `max_tokens` (also its default, so leaving
`max_tokens` out cannot get around it), a `max_tokens` no larger than the model's
context (where the gateway knows it: vLLM's rule, checked here so that the refusal names
the client's parameter), and what its choices and logprobs may add up to
(`output_limits`). Each is a 400 naming the parameter."""

from __future__ import annotations

from dataclasses import replace

from gateway.config import Config
from gateway.edge.errors import invalid
from gateway.edge.openai.output_limits import bound_output
from gateway.edge.openai.validation import ParsedRequest


class InputLimits:
    """The config's bounds, by model."""

    def __init__(self, config: Config) -> None:
        self.max_messages = config.max_messages
        self.max_tokens = {m.name: m.max_tokens_limit for m in config.models}
        self.max_output_units = config.max_output_units

    def check(
        self, parsed: ParsedRequest, model: str, max_context: int | None = None
    ) -> ParsedRequest:
        """`parsed`, with the model's `max_tokens` cap applied and its output bounded
        (`max_context`: the model's, when known), or a 400."""
        parsed = bound_output(self._capped(parsed, model), self.max_output_units, max_context)
        asked = parsed.generate.sampling.max_tokens
        if max_context is not None and asked is not None and asked > max_context:
            # vLLM's refusal (a prompt and a length within the context that together pass
            # it are served, the answer cut at the context), naming the client's parameter
            name = parsed.max_tokens_param
            raise invalid(
                name,
                f"Invalid '{name}': {asked} cannot be greater than the model's context, "
                f"max_model_len={max_context}. Please request fewer output tokens.",
            )
        return parsed

    def _capped(self, parsed: ParsedRequest, model: str) -> ParsedRequest:
        generate = parsed.generate
        if generate.messages is not None and len(generate.messages) > self.max_messages:
            raise invalid("messages", f"Invalid 'messages': at most {self.max_messages} messages.")
        cap = self.max_tokens.get(model)
        if cap is None:
            return parsed
        asked = generate.sampling.max_tokens
        if asked is not None and asked > cap:
            name = parsed.max_tokens_param
            raise invalid(name, f"Invalid '{name}': the model `{model}` allows at most {cap}.")
        if asked is None:
            sampling = replace(generate.sampling, max_tokens=cap)
            parsed = replace(parsed, generate=replace(generate, sampling=sampling))
        return parsed
