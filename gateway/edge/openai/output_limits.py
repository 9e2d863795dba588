"""The bound on what one request may make: its choices' tokens and their
logprobs, counted together (`gateway.protocol.sizes.output_units`).

Why: `n` 128, `max_tokens` 1,000 and `top_logprobs` 20 is 2.7 million logprob
entries, about 540 bytes each while a non-streamed answer is built (the
token's string, its float, the tuples, then the JSON): one such request took the
gateway from 112 MB to 1.5 GB. Each parameter is within OpenAI's own bounds; the
product is not. So the product is checked against `max_output_units`, once the
model's `max_tokens` cap is applied: over it is a 400 naming `max_tokens` (its
message names `n` and `top_logprobs` too). A request that leaves `max_tokens`
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

from gateway.edge.errors import invalid
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
    raise invalid(
        "max_tokens",
        f"Invalid 'max_tokens': 'n' ({n}) x 'max_tokens' ({asked})"
        + ("" if top is None else f" x (2 + 'top_logprobs' ({top}))")
        + f" is more than the {most} tokens and logprobs one request may make here; "
        "ask for fewer choices, tokens or alternatives.",
    )
