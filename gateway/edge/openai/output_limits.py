"""The bound on what one request may make: its choices' tokens and their
logprobs, counted together (`gateway.protocol.sizes.output_units`).

Why: `n` 128, `max_tokens` 1,000 and `top_logprobs` 20 is 2.7 million logprob
entries, about 540 bytes each while a non-streamed answer is built (the
token's string, its float, the tuples, then the JSON): one such request took the
gateway from 112 MB to 1.5 GB. Each parameter is within OpenAI's own bounds; the
product is not. So the product is checked against `max_output_units`, once the
model's `max_tokens` cap is applied: over it is a 400 naming the parameter the
client gave the length in (`max_tokens`, chat's `max_completion_tokens`; the
Responses route renames it `max_output_tokens`), its message naming `n` and the
logprobs too where the request asked for them. A request that leaves `max_tokens`
out may make up to the model's context per choice: where that could pass the
bound, it gets the most that fits as its `max_tokens` (its answer then ends with
`finish_reason` "length" there, as with a model's cap); where the model's
context is unknown, the model's `max_tokens_limit` is the operator's bound.
Streamed or not: a stream's reader may stop reading, and the worker's work is
the same.

The cost: a few multiplications per request.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.edge.errors import APIError, invalid
from gateway.edge.openai.validation import ParsedRequest
from gateway.protocol.sizes import output_units


def bound_output(parsed: ParsedRequest, most: int, max_context: int | None) -> ParsedRequest:
    """`parsed` if what it may make fits in `most` units; without `max_tokens` (on a
    model of `max_context` tokens, None: unknown), with the largest that fits;
    else a 400 naming the parameters."""
    generate = parsed.generate
    n, top = generate.n, generate.logprobs
    asked = generate.sampling.max_tokens
    if asked is None:
        if max_context is None or output_units(n, max_context, top) <= most:
            return parsed
        fits = max(1, most // output_units(n, 1, top))
        sampling = replace(generate.sampling, max_tokens=fits)
        return replace(parsed, generate=replace(generate, sampling=sampling))
    if output_units(n, asked, top) <= most:
        return parsed
    raise too_much(parsed, most)


def too_much(parsed: ParsedRequest, most: int) -> APIError:
    """The 400 for a request past the bound, naming the length's parameter as the
    client named it, and the other factors only where its API has them and it asked
    for them: `n` above 1, logprobs (chat's `top_logprobs`, a completion's `logprobs`)."""
    generate = parsed.generate
    name, asked = parsed.max_tokens_param, generate.sampling.max_tokens
    if generate.n == 1 and generate.logprobs is None:
        return invalid(
            name,
            f"Invalid '{name}': {asked} is more than the {most} tokens one request may make here.",
        )
    factors = [f"'{name}' ({asked})"]
    fewer = ["tokens"]
    if generate.n > 1:
        factors.insert(0, f"'n' ({generate.n})")
        fewer.insert(0, "choices")
    if generate.logprobs is not None:
        logprobs = "logprobs" if generate.messages is None else "top_logprobs"
        factors.append(f"(2 + '{logprobs}' ({generate.logprobs}))")
        fewer.append("alternatives")
    made = "tokens" if generate.logprobs is None else "tokens and logprobs"
    return invalid(
        name,
        f"Invalid '{name}': {' x '.join(factors)} is more than the {most} {made} one "
        f"request may make here; ask for fewer {', '.join(fewer[:-1])} or {fewer[-1]}.",
    )
