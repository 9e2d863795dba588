"""The OpenAI surface on the transformers worker, end to end: tiny models with
random weights (tests/support/tiny_model.py) served by real `WorkerServer`s,
driven through the real gateway with the openai SDK.

Four models share one tokenizer. `tiny-tools` has a chat template that shows
the model its tools and writes calls as Hermes' `<tool_call>` (its worker
parses that format); `tiny-llama3` is the same model with a worker that reads
calls in Llama 3's JSON format, which a response_format can make a random
model write; `tiny-random` has the plain template, which reads no
tools; `tiny-ordered` has its output layer zeroed, so every logit is equal and
greedy decoding repeats token 0 ("a"). A random model's text is junk: guided
decoding is what makes its JSON and tool arguments valid, so the schemas (the
surface conformance suite's) are bounded (enums, booleans) and finish in a few
tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest

from gateway.worker.transformers_engine import TransformersEngine
from tests.support.fronts import engines_front, nothing_left_after_each
from tests.support.requests import user
from tests.support.servers import Gateway, ServerLoop, Workers
from tests.support.surface import CLOCK, TOOLS, WEATHER, assert_valid, calls_of, text_of
from tests.support.tiny_model import TOOLS_TEMPLATE, build_tiny_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOOLS_MODEL = "tiny-tools"
LLAMA3 = "tiny-llama3"
RANDOM = "tiny-random"
ORDERED = "tiny-ordered"
#: Enough for a bounded call or object from a random model under guided decoding.
MAX_TOKENS = 96


@dataclass
class Tiny:
    """The four tiny models behind one gateway."""

    gateway: Gateway
    engines: tuple[TransformersEngine, ...]
    tokenizer: PreTrainedTokenizerFast
    sdk: openai.OpenAI
    random: TransformersEngine


def _with_tools_template(path: Path) -> Path:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    for template_file in path.glob("chat_template.*"):
        template_file.write_text(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tiny(
    server_loop: ServerLoop, workers: Workers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tiny]:
    root = tmp_path_factory.mktemp("models")
    tools_path = _with_tools_template(build_tiny_model(root / TOOLS_MODEL))
    engines = (
        TransformersEngine(tools_path, device="cpu", tool_call_parser="hermes"),
        TransformersEngine(tools_path, LLAMA3, device="cpu", tool_call_parser="llama3_json"),
        TransformersEngine(build_tiny_model(root / RANDOM), device="cpu"),
        TransformersEngine(build_tiny_model(root / ORDERED, ordered=True), device="cpu"),
    )
    with engines_front(server_loop, workers, engines) as front:
        yield Tiny(front.gateway, engines, engines[0].tokenizer, front.sdk, engines[2])


_nothing_left = nothing_left_after_each("tiny")


def test_models_say_what_they_serve(tiny: Tiny):
    served = {engine.model: engine.features for engine in tiny.engines}
    assert "tools" in served[TOOLS_MODEL]
    assert "tools" not in served[RANDOM]  # its template does not read them
    for features in served.values():
        assert {"logprobs", "response_format", "min_tokens", "logit_bias", "embeddings"} <= features
        assert not {"image_url", "dimensions"} & features
    assert tiny.sdk.models.retrieve(TOOLS_MODEL).id == TOOLS_MODEL


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_json_schema_answer_validates(tiny: Tiny, stream: bool, seed: int):
    body = {
        "model": RANDOM,
        "messages": user("describe the weather as JSON"),
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
    }
    text, finish = text_of(tiny.sdk, body, stream)
    assert finish == "stop"
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # compact
    jsonschema.validate(json.loads(text), WEATHER)


def test_n_choices_of_a_schema_compile_one_grammar_in_its_own_thread(tiny: Tiny):
    """A schema compiles once for the n choices of a request (each gets a copy), in the
    grammar thread, not the model's (a 430 KB schema with n 32 had held it 9.2 s)."""
    engine = tiny.random
    schema = {**WEATHER, "title": "weather-for-n"}  # a schema no other test compiled
    before = set(engine._grammars)
    reply = tiny.sdk.chat.completions.create(
        model=RANDOM,
        messages=user("describe the weather as JSON"),
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=MAX_TOKENS,
    )
    assert len(reply.choices) == 4
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert len(set(engine._grammars) - before) == 1
    assert any(t.name.startswith("furnace-grammar") for t in threading.enumerate())


def test_n_counts_against_the_workers_capacity(tiny: Tiny):
    engine = tiny.random
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.sdk.completions.create(model=RANDOM, prompt="a", n=engine.capacity + 1, max_tokens=1)
    assert refused.value.body["param"] == "n"


def test_json_mode_answers_an_object_or_runs_out(tiny: Tiny):
    for seed in range(3):
        choice = tiny.sdk.chat.completions.create(
            model=RANDOM,
            messages=user("any JSON object"),
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        ).choices[0]
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":  # else max_tokens cut it inside the object
            assert isinstance(json.loads(text), dict)


def test_a_schema_that_cannot_be_enforced_is_a_bad_request(tiny: Tiny):
    # a schema by the metaschema (the edge refuses what is not one), but not one that
    # llguidance compiles: the worker's own refusal
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.sdk.chat.completions.create(
            model=RANDOM,
            messages=user("x"),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "string", "format": "nonsense"}},
            },
        )
    assert refused.value.body["param"] == "response_format"
    assert "Unknown format" in refused.value.body["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("constraint", "matches"),
    [
        ({"regex": "[0-9]{2}-[a-c]{3}"}, re.compile("[0-9]{2}-[a-c]{3}").fullmatch),
        ({"choice": ["sunny", "rainy", 'a "quoted"\nline']}, None),
    ],
    ids=["regex", "choice"],
)
def test_structured_outputs_regex_and_choice_hold_a_random_model(
    tiny: Tiny, stream: bool, constraint: dict, matches: Any
):
    """vLLM's `structured_outputs` `regex` and `choice`, enforced by llguidance: a random
    model's answer matches the regex, or is exactly one of the choices."""
    body = {
        "model": RANDOM,
        "messages": user("the code"),
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": MAX_TOKENS,
        "extra_body": {"structured_outputs": constraint},
    }
    text, finish = text_of(tiny.sdk, body, stream)
    assert finish == "stop"
    assert matches(text) if matches else text in constraint["choice"]


def test_structured_outputs_a_bad_regex_or_a_grammar_is_refused_by_name(tiny: Tiny):
    """A regex llguidance cannot compile is the worker's 400; vLLM's EBNF grammar is
    not listed, so the gateway refuses it."""
    for constraint, named in (
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"grammar": 'root ::= "a"'}, "structured_outputs.grammar"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            tiny.sdk.chat.completions.create(
                model=RANDOM,
                messages=user("x"),
                max_tokens=4,
                extra_body={"structured_outputs": constraint},
            )
        assert refused.value.body["param"] == named


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_calls_follow_their_schemas(tiny: Tiny, stream: bool, seed: int):
    body = {
        "model": TOOLS_MODEL,
        "messages": user("what is the weather in Paris"),
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
    }
    calls, finish = calls_of(tiny.sdk, body, stream)
    assert_valid(calls)
    # Sampled, the array may go on with calls until max_tokens cuts one (never released).
    assert finish in ("tool_calls", "length")
    single, finish = calls_of(tiny.sdk, {**body, "parallel_tool_calls": False}, stream)
    assert_valid(single)
    assert len(single) == 1
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_is_the_one_called(tiny: Tiny, stream: bool):
    body = {
        "model": TOOLS_MODEL,
        "messages": user("what time is it"),
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    calls, finish = calls_of(tiny.sdk, body, stream)
    assert_valid(calls)
    assert [call.name for call in calls] == ["get_time"]
    assert finish in ("stop", "tool_calls")


def _prompt_tokens(tiny: Tiny, **body: Any) -> int:
    reply = tiny.sdk.chat.completions.create(model=TOOLS_MODEL, max_tokens=1, **body)
    return reply.usage.prompt_tokens


def test_the_template_shows_tools_unless_tool_choice_is_none(tiny: Tiny):
    messages = user("hello")
    plain = _prompt_tokens(tiny, messages=messages)
    expected = tiny.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _prompt_tokens(tiny, messages=messages, tools=TOOLS) == len(expected) > plain
    assert _prompt_tokens(tiny, messages=messages, tools=TOOLS, tool_choice="none") == plain


def test_auto_on_a_random_model_answers_text(tiny: Tiny):
    reply = tiny.sdk.chat.completions.create(
        model=TOOLS_MODEL, messages=user("hello"), tools=TOOLS, temperature=0, max_tokens=8
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_finds_calls_in_the_models_own_format(tiny: Tiny, stream: bool):
    # The grammar makes the random model write a Llama 3 JSON call; the parser finds it.
    call = {
        "type": "object",
        "properties": {"name": {"enum": ["get_time"]}, "parameters": CLOCK},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    body = {
        "model": LLAMA3,
        "messages": user("what time is it"),
        "tools": TOOLS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": call}},
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    calls, finish = calls_of(tiny.sdk, body, stream)
    assert_valid(calls)
    assert [c.name for c in calls] == ["get_time"]
    assert finish == "tool_calls"


def test_a_tool_answer_continues_the_conversation(tiny: Tiny):
    first = tiny.sdk.chat.completions.create(
        model=TOOLS_MODEL,
        messages=user("weather please"),
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages = [
        *user("weather please"),
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny and 21 degrees"},
    ]
    reply = tiny.sdk.chat.completions.create(
        model=TOOLS_MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=4
    )
    # The template got the call's arguments parsed, as Hermes' and Qwen's templates want.
    rendered = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        messages[2],
    ]
    expected = tiny.tokenizer.apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert reply.usage.prompt_tokens == len(expected)


def test_tools_on_a_template_that_reads_none_are_a_bad_request(tiny: Tiny):
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.sdk.chat.completions.create(model=RANDOM, messages=user("x"), tools=TOOLS)
    assert refused.value.body["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_models_own(tiny: Tiny, stream: bool):
    import torch  # only this test calls the model directly

    body = {
        "model": RANDOM,
        "messages": user("hello from the fleet"),
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 0,
        "max_tokens": 6,
    }
    if stream:
        chunks = list(
            tiny.sdk.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            )
        )
        entries = [
            entry
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for entry in c.choices[0].logprobs.content or []
        ]
        tokens = chunks[-1].usage.completion_tokens
    else:
        reply = tiny.sdk.chat.completions.create(**body)
        entries = reply.choices[0].logprobs.content
        tokens = reply.usage.completion_tokens
    assert len(entries) == tokens == 6
    for entry in entries:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == tops[0]  # greedy takes the likeliest
        assert entry.token == entry.top_logprobs[0].token
    # The first token's log-probabilities, straight from the model.
    engine = tiny.random
    prompt = tiny.tokenizer.apply_chat_template(
        body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        logits = engine.hf_model(torch.tensor([prompt])).logits[0, -1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(3)
    assert [t.logprob for t in entries[0].top_logprobs] == pytest.approx(
        top.values.tolist(), abs=1e-4
    )
    assert [t.token for t in entries[0].top_logprobs] == [
        tiny.tokenizer.decode([i]) for i in top.indices.tolist()
    ]


def test_completion_logprobs_count_every_token(tiny: Tiny):
    reply = tiny.sdk.completions.create(
        model=RANDOM, prompt="the quick", logprobs=2, temperature=0, max_tokens=5
    )
    logprobs = reply.choices[0].logprobs
    assert reply.usage.completion_tokens == 5
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def _tokens_of(tiny: Tiny, model: str, **body: Any) -> tuple[int, str, str]:
    reply = tiny.sdk.completions.create(model=model, prompt="hi", temperature=0, **body)
    choice = reply.choices[0]
    return reply.usage.completion_tokens, choice.finish_reason, choice.text


def test_logit_bias_forces_and_min_tokens_holds_back_the_end(tiny: Tiny):
    eos = str(tiny.tokenizer.eos_token_id)
    assert _tokens_of(tiny, RANDOM, max_tokens=20, logit_bias={eos: 100}) == (1, "stop", "")
    tokens, finish, _ = _tokens_of(
        tiny, RANDOM, max_tokens=20, logit_bias={eos: 100}, extra_body={"min_tokens": 5}
    )
    assert (tokens, finish) == (6, "stop")  # five tokens, then the end at once (as vLLM)


def test_a_prompt_is_cut_to_its_last_tokens(tiny: Tiny):
    """vLLM's `truncate_prompt_tokens` through the worker: the engine keeps the last N ids
    (which: tests/test_truncate_prompt.py)."""
    full = tiny.sdk.completions.create(model=RANDOM, prompt="hello there friend", max_tokens=1)
    cut = tiny.sdk.completions.create(
        model=RANDOM,
        prompt="hello there friend",
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 2},
    )
    assert full.usage.prompt_tokens > 2 and cut.usage.prompt_tokens == 2


def test_special_tokens_are_shown_when_asked(tiny: Tiny):
    """vLLM's `skip_special_tokens`: a special token the answer holds (forced here by a
    bias) is left out of its text by default, and shown with `false`."""
    user_tag = str(tiny.tokenizer.convert_tokens_to_ids("<|user|>"))
    forced = {"max_tokens": 2, "logit_bias": {user_tag: 100}}
    assert _tokens_of(tiny, RANDOM, **forced) == (2, "length", "")
    shown = _tokens_of(tiny, RANDOM, **forced, extra_body={"skip_special_tokens": False})
    assert shown == (2, "length", "<|user|><|user|>")


def test_logit_bias_bans_a_token(tiny: Tiny):
    def first_token(**body: Any) -> Any:
        reply = tiny.sdk.chat.completions.create(
            model=RANDOM,
            messages=user("hello"),
            temperature=0,
            max_tokens=1,
            logprobs=True,
            top_logprobs=2,
            **body,
        )
        return reply.choices[0].logprobs.content[0]

    free = first_token()
    likeliest = tiny.tokenizer.convert_tokens_to_ids(
        tiny.tokenizer.tokenize(free.top_logprobs[0].token)
    )
    assert len(likeliest) == 1
    banned = first_token(logit_bias={str(likeliest[0]): -100})
    # Logprobs are the model's own, before the bias: the second likeliest was taken.
    assert banned.logprob == free.top_logprobs[1].logprob


def test_stop_token_ids_end_the_answer_without_their_text(tiny: Tiny):
    a = tiny.tokenizer.convert_tokens_to_ids("a")
    stopped = _tokens_of(tiny, ORDERED, max_tokens=10, extra_body={"stop_token_ids": [a]})
    assert stopped == (1, "stop", "")
    assert _tokens_of(tiny, ORDERED, max_tokens=3) == (3, "length", "aaa")


def test_ignore_eos_runs_to_max_tokens(tiny: Tiny):
    eos = str(tiny.tokenizer.eos_token_id)
    tokens, finish, _ = _tokens_of(
        tiny, RANDOM, max_tokens=7, logit_bias={eos: 100}, extra_body={"ignore_eos": True}
    )
    assert (tokens, finish) == (7, "length")


def test_repetition_penalty_matches_transformers(tiny: Tiny):
    import torch

    engine = tiny.random
    prompt = tiny.tokenizer("the quick").input_ids
    reference = engine.hf_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=12, repetition_penalty=1.8
    )[0, len(prompt) :].tolist()
    assert tiny.tokenizer.eos_token_id not in reference
    reply = tiny.sdk.completions.create(
        model=RANDOM,
        prompt="the quick",
        temperature=0,
        max_tokens=12,
        extra_body={"repetition_penalty": 1.8},
    )
    assert reply.choices[0].text == tiny.tokenizer.decode(reference, skip_special_tokens=True)


def test_min_p_of_one_keeps_only_the_likeliest(tiny: Tiny):
    greedy = _tokens_of(tiny, RANDOM, max_tokens=12)
    sampled = tiny.sdk.completions.create(
        model=RANDOM,
        prompt="hi",
        temperature=1.5,
        seed=3,
        max_tokens=12,
        extra_body={"min_p": 1.0},
    )
    assert sampled.choices[0].text == greedy[2]


def test_out_of_vocabulary_ids_are_refused_by_name(tiny: Tiny):
    for field in ("logit_bias", "stop_token_ids"):
        value: Any = {"999999": 1} if field == "logit_bias" else [999999]
        with pytest.raises(openai.BadRequestError) as refused:
            tiny.sdk.completions.create(
                model=RANDOM, prompt="hi", max_tokens=2, extra_body={field: value}
            )
        assert refused.value.body["param"] == field


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_are_sampled_apart(tiny: Tiny, stream: bool):
    body = {
        "model": RANDOM,
        "messages": user("a b c"),
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 6,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        chunks = list(
            tiny.sdk.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            )
        )
        texts: dict[int, str] = defaultdict(str)
        finishes: dict[int, list[str]] = defaultdict(list)
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index].append(choice.finish_reason)
        assert finishes == {0: ["length"], 1: ["length"]}
        usage = chunks[-1].usage
    else:
        reply = tiny.sdk.chat.completions.create(**body)
        assert [choice.index for choice in reply.choices] == [0, 1]
        texts = {choice.index: choice.message.content for choice in reply.choices}
        usage = reply.usage
    assert usage.completion_tokens == 12
    assert texts[0] != texts[1]  # each choice has a seed of its own


def test_user_is_accepted(tiny: Tiny):
    reply = tiny.sdk.chat.completions.create(
        model=RANDOM,
        messages=user("hi"),
        user="team-a/alice",
        max_tokens=2,
        extra_body={"ignore_eos": True},  # a sampled end of text would stop it at 1
    )
    assert reply.usage.completion_tokens == 2


def test_images_are_refused_naming_the_part(tiny: Tiny):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.sdk.chat.completions.create(model=RANDOM, messages=messages)
    assert refused.value.body["param"].startswith("messages[0].content")


def _pooled(tiny: Tiny, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        hidden = tiny.random.hf_model.base_model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).tolist()


def test_embeddings_are_mean_pooled_unit_vectors(tiny: Tiny):
    texts = ["hello from the fleet", "the quick brown fox"]
    ids = [tiny.tokenizer(text).input_ids for text in texts]
    reply = tiny.sdk.embeddings.create(model=RANDOM, input=texts, encoding_format="float")
    vectors = [item.embedding for item in reply.data]
    assert [item.index for item in reply.data] == [0, 1]
    assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
    for vector, tokens in zip(vectors, ids, strict=True):
        assert len(vector) == tiny.random.hf_model.config.hidden_size
        assert sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-5)
        assert vector == pytest.approx(_pooled(tiny, tokens), abs=1e-5)
    by_ids = tiny.sdk.embeddings.create(model=RANDOM, input=ids, encoding_format="float")
    assert [item.embedding for item in by_ids.data] == vectors
    # The SDK's default asks for base64 and decodes it: the same float32 values.
    packed = tiny.sdk.embeddings.create(model=RANDOM, input=texts[0]).data[0].embedding
    assert packed == pytest.approx(vectors[0], abs=1e-6)


def test_embeddings_refuse_what_they_cannot_serve_by_name(tiny: Tiny):
    for body, param in (
        ({"input": "hello", "dimensions": 8}, "dimensions"),
        ({"input": [[1, 999999]]}, "input"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            tiny.sdk.embeddings.create(model=RANDOM, **body)
        assert refused.value.body["param"] == param
