"""The transformers worker end to end: a tiny Llama with random weights and a
byte-level BPE tokenizer made on the spot (nothing is fetched), served by a real
`WorkerServer`, driven through the real gateway with the openai SDK.

Two models share one tokenizer. `tiny-random` has random weights: its greedy
answer is checked against transformers' own `generate`. `tiny-ordered` has its
output layer zeroed, so every logit is equal: greedy decoding repeats token 0
("a"), and with a presence or frequency penalty it walks the vocabulary in id
order. The tokenizer puts the bytes of "aé中😀" first, so that walk spells
multi-byte characters one byte token at a time.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from gateway.config import ModelConfig
from gateway.worker.transformers_engine import TransformersEngine
from tests.support.fronts import engines_front, gateway_over, nothing_left_after_each
from tests.support.processes import free_port, running, wait_listening
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left
from tests.support.tiny_model import CONTEXT, FIRST, build_tiny_model
from tests.support.waiting import HANG_GUARD, wait_until

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

RANDOM = "tiny-random"
ORDERED = "tiny-ordered"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello from the fleet"},
]


@dataclass
class Tiny:
    """The two tiny models behind one gateway."""

    gateway: Gateway
    random: TransformersEngine
    ordered: TransformersEngine
    tokenizer: PreTrainedTokenizerFast
    sdk: openai.OpenAI
    ordered_path: Path

    @property
    def engines(self) -> tuple[TransformersEngine, ...]:
        """Both engines, for the check that none is left running."""
        return (self.random, self.ordered)


@pytest.fixture(scope="module")
def tiny(
    server_loop: ServerLoop, workers: Workers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tiny]:
    root = tmp_path_factory.mktemp("models")
    random_path = build_tiny_model(root / RANDOM)
    ordered_path = build_tiny_model(root / ORDERED, ordered=True)
    engines = (
        TransformersEngine(random_path, device="cpu"),
        TransformersEngine(ordered_path, device="cpu"),
    )
    with engines_front(server_loop, workers, engines) as front:
        yield Tiny(front.gateway, *engines, engines[0].tokenizer, front.sdk, ordered_path)


_nothing_left = nothing_left_after_each("tiny")


def _chat_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_models_report_the_model_context(tiny: Tiny):
    listed = {m.id: m for m in tiny.sdk.models.list().data}
    assert listed[RANDOM].model_extra["max_model_len"] == CONTEXT
    assert listed[ORDERED].model_extra["max_model_len"] == CONTEXT


def test_chat_applies_the_template_and_matches_transformers_greedy(tiny: Tiny):
    import torch  # only this test calls the model directly

    prompt = _chat_ids(tiny.tokenizer)
    reference = tiny.random.hf_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=12
    )[0, len(prompt) :].tolist()
    assert tiny.tokenizer.eos_token_id not in reference  # so the answer runs to max_tokens

    reply = tiny.sdk.chat.completions.create(
        model=RANDOM, messages=MESSAGES, temperature=0, max_tokens=12
    )
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == len(prompt) + 12
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == tiny.tokenizer.decode(
        reference, skip_special_tokens=True
    )


def test_stream_matches_the_full_answer(tiny: Tiny):
    full = tiny.sdk.completions.create(
        model=RANDOM, prompt="the quick", temperature=0, max_tokens=9
    )
    chunks = list(
        tiny.sdk.completions.create(
            model=RANDOM,
            prompt="the quick",
            temperature=0,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == full.usage
    assert full.usage.prompt_tokens == len(tiny.tokenizer("the quick").input_ids)
    assert full.usage.completion_tokens == 9


def test_multibyte_characters_are_never_split(tiny: Tiny):
    stream = tiny.sdk.chat.completions.create(
        model=ORDERED,
        messages=MESSAGES,
        temperature=0,
        frequency_penalty=2,
        max_tokens=len(FIRST.encode()),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == FIRST
    assert not any("\ufffd" in d for d in deltas)
    assert chunks[-1].usage.completion_tokens == len(FIRST.encode())


def test_end_of_sequence_finishes_with_stop(tiny: Tiny):
    # A presence penalty walks the ids in order; the first special one is the EOS token.
    eos = tiny.tokenizer.eos_token_id
    reply = tiny.sdk.completions.create(
        model=ORDERED, prompt="hi", temperature=0, presence_penalty=2, max_tokens=1000
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == eos + 1  # the EOS token counts, as in vLLM
    expected = tiny.tokenizer.decode(list(range(eos + 1)), skip_special_tokens=True)
    assert reply.choices[0].text == expected
    assert reply.choices[0].text.startswith(FIRST)


def test_seed_reproduces_a_sampled_answer(tiny: Tiny):
    def sample(**options: object) -> str:
        reply = tiny.sdk.completions.create(model=RANDOM, prompt="hello", max_tokens=16, **options)
        assert reply.usage.completion_tokens == 16
        return reply.choices[0].text

    first = sample(temperature=1.0, seed=7)
    assert sample(temperature=1.0, seed=7) == first
    assert sample(temperature=1.0, seed=8) != first
    greedy = sample(temperature=0)
    assert sample(temperature=1.5, extra_body={"top_k": 1}, seed=1) == greedy
    assert sample(temperature=1.5, top_p=1e-6, seed=2) == greedy


def test_prompt_beyond_the_context_is_refused(tiny: Tiny):
    with pytest.raises(openai.BadRequestError) as by_max_tokens:
        tiny.sdk.chat.completions.create(model=RANDOM, messages=MESSAGES, max_tokens=CONTEXT + 1)
    assert (by_max_tokens.value.code, by_max_tokens.value.param) == (None, "max_tokens")
    long_prompt = "é" * CONTEXT  # two byte tokens each
    with pytest.raises(openai.BadRequestError) as by_prompt:
        tiny.sdk.completions.create(model=RANDOM, prompt=long_prompt, stream=True)
    assert by_prompt.value.code == "context_length_exceeded"
    assert tiny.random.running == 0


def test_max_tokens_past_what_the_prompt_leaves_is_cut_at_the_context(tiny: Tiny):
    """As vLLM's server: not refused, the answer ends with the context ("length")."""
    prompt = "é" * (CONTEXT // 2 - 8)  # two byte tokens each: a few tokens left
    reply = tiny.sdk.completions.create(
        model=RANDOM, prompt=prompt, max_tokens=CONTEXT, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == CONTEXT
    assert 0 < reply.usage.completion_tokens < 32


#: A tool call and its answer, as the gateway takes them.
CALLED_AND_ANSWERED = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "content": "42", "tool_call_id": "call_1"},
]


def test_messages_the_chat_template_refuses_are_a_bad_request(tiny: Tiny):
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.sdk.chat.completions.create(
            model=RANDOM,
            messages=[*MESSAGES, *CALLED_AND_ANSWERED],
        )
    assert "This model knows no tools." in refused.value.message
    assert refused.value.param == "messages"


def test_reasoning_options_reach_the_chat_template_as_vllm_passes_them(tiny: Tiny):
    """`reasoning_effort` is the template's variable, with `enable_thinking` off for
    "none" (unless `chat_template_kwargs` say otherwise); the kwargs are merged in."""
    tokenizer = tiny.random.tokenizer
    plain = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% if reasoning_effort %}<|system|>effort {{ reasoning_effort }}<|end|>{% endif %}"
        "{% if enable_thinking is false %}<|system|>no thinking at all<|end|>{% endif %}"
        "{% if depth %}<|system|>{{ 'deeper ' * depth }}<|end|>{% endif %}" + plain
    )
    try:
        for extra, kwargs in [
            ({}, {}),
            ({"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
            ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
            (
                {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
                {"reasoning_effort": "none", "enable_thinking": True},
            ),
            # the engine's own arguments stay its own, as vLLM's server keeps them
            ({"chat_template_kwargs": {"depth": 3, "tokenize": False}}, {"depth": 3}),
        ]:
            reply = tiny.sdk.chat.completions.create(
                model=RANDOM, messages=MESSAGES, max_tokens=1, extra_body=extra
            )
            expected = tokenizer.apply_chat_template(
                MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
            assert reply.usage is not None and reply.usage.prompt_tokens == len(expected), extra
            if kwargs:  # the template saw them
                assert reply.usage.prompt_tokens != len(_chat_ids(tokenizer)), extra
    finally:
        tokenizer.chat_template = plain


def test_closing_a_stream_stops_the_generation(tiny: Tiny):
    engine = tiny.ordered
    steps, aborted = engine.steps, engine.aborted
    stream = tiny.sdk.completions.create(
        model=ORDERED, prompt="hi", temperature=0, max_tokens=4000, stream=True
    )
    received = ""
    for chunk in stream:
        received += chunk.choices[0].text
        if len(received) >= 3:
            break
    stream.close()
    assert received.startswith("aaa")
    wait_until(lambda: engine.running == 0, "the generation to end")
    assert engine.aborted == aborted + 1
    stopped_at = engine.steps
    # A one-token request on the same engine queues behind any step still submitted
    # to its pool: once answered, a generation left running would have stepped too.
    tiny.sdk.completions.create(model=ORDERED, prompt="hi", temperature=0, max_tokens=1)
    assert engine.steps == stopped_at + 1, "decode steps went on after the stream was closed"
    assert stopped_at - steps < 4000


def test_requests_run_at_once_without_blocking_the_loop(tiny: Tiny):
    engine = tiny.ordered
    long = tiny.sdk.completions.create(
        model=ORDERED, prompt="hi", temperature=0, max_tokens=600, stream=True
    )
    pieces = iter(long)
    first = next(pieces).choices[0].text
    # While the long answer is generating, short ones on the same engine and on the
    # other complete (the worker and gateway share the tests' event loop).
    short = tiny.sdk.completions.create(model=ORDERED, prompt="yo", temperature=0, max_tokens=5)
    other = tiny.sdk.completions.create(model=RANDOM, prompt="yo", temperature=0, max_tokens=5)
    assert engine.running == 1, "the long answer should still be generating"
    assert short.choices[0].text == "aaaaa"
    assert other.usage.completion_tokens == 5
    rest = "".join(c.choices[0].text for c in pieces)
    assert first + rest == "a" * 600


def test_cli_runs_the_transformers_worker(tiny: Tiny, server_loop: ServerLoop, workers: Workers):
    port = free_port()
    args = ["worker", "--engine", "transformers", "--model-path", str(tiny.ordered_path)]
    with running(*args, "--model", "cli-tiny", "--device", "cpu", "--port", str(port)) as process:
        wait_listening(port, process)
        model = ModelConfig("cli-tiny", workers=(f"127.0.0.1:{port}",))
        with gateway_over(server_loop, (model,), workers) as gw:
            try:
                reply = httpx.post(
                    gw.url + "/v1/completions",
                    json={"model": "cli-tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0},
                    timeout=HANG_GUARD,
                ).json()
                assert reply["choices"][0]["text"] == "aaaa"
                assert reply["usage"]["prompt_tokens"] == len(tiny.tokenizer("hi").input_ids)
            finally:
                assert_nothing_left(gw, None)


def test_cli_refuses_a_tool_call_format_it_cannot_parse(tiny: Tiny):
    args = ["worker", "--engine", "transformers", "--model-path", str(tiny.ordered_path)]
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--tool-call-parser", "mistral"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert result.returncode != 0
    assert "tool_call_parser: expected one of hermes, llama3_json" in result.stderr
    assert "Traceback" not in result.stderr
