"""An answer's detokenizer starts after the prompt, as vLLM's does: vLLM's
`FastIncrementalDetokenizer` (vllm/v1/engine/detokenizer.py) makes its DecodeStream with
`ids=` the whole prompt and steps it an output id at a time (`skip_special_tokens` as asked,
True by default), so the first token decodes after the prompt's text: a SentencePiece-style
decoder (Metaspace, or Llama-2's Replace/ByteFallback/Fuse/Strip) drops only a sequence's
first token's leading space, and " Sure" stays " Sure". The gateway's detokenizer starts
after the prompt's last ids (`ModelTokenizer.context`), which give the same text at a
fraction of the cost; here against vLLM's own steps (`vllm_pieces`), with tokenizers made on
the spot. No vLLM needed (tests/test_detokenize_context_vllm.py runs vLLM itself).

Left alone: a prompt whose text ends in U+FFFD (a character cut, or the character itself)
makes vLLM's first text hold the prompt's text, and the gateway's (started after the whole
prompt) too; but a message of several ids that then ends inside a character is stepped again
from the last text's ids alone (`StreamDetokenizer._one_by_one`), where vLLM's window still
holds the prompt's: its text may differ by a U+FFFD there."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from tokenizers.decoders import DecodeStream

from benchmarks.fake_vllm_grpc import FakeVllm
from gateway.protocol.types import (
    Event,
    GenerateRequest,
    Message,
    SamplingParams,
    Text,
    Tool,
    ToolCallDelta,
)
from gateway.tokenization.tokenizer import CONTEXT_IDS, ModelTokenizer
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from tests.support.servers import ServerLoop
from tests.support.tiny_model import (
    CHAT_TEMPLATE,
    SENTENCES,
    SPECIALS,
    WORDS,
    build_tokenizer,
)
from tests.support.waiting import HANG_GUARD

MODEL = "metaspace"

#: vLLM's error for a DecodeStream whose text went back on itself (`INVALID_PREFIX_ERR_MSG`).
INVALID_PREFIX = "Invalid prefix encountered"


def llama2_tokenizer() -> Tokenizer:
    """Llama-2's shape: BPE over `▁`-joined words with byte fallback (`<0xNN>` pieces, last,
    for characters it lacks), decoded by Replace, ByteFallback, Fuse, Strip (one leading
    space of the whole text)."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.train_from_iterator([*SENTENCES, *WORDS], trainer)
    bpe = json.loads(trained.to_str())["model"]
    vocab = bpe["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in bpe["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def _save(tokenizer: Tokenizer, path: Path) -> ModelTokenizer:
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return ModelTokenizer(path)


MAKERS: dict[str, Callable[[], Tokenizer]] = {
    "metaspace": lambda: build_tokenizer(metaspace=True).backend_tokenizer,
    "llama2": llama2_tokenizer,
    "byte-level": lambda: build_tokenizer().backend_tokenizer,
}


@pytest.fixture(scope="module", params=list(MAKERS), ids=list(MAKERS))
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ModelTokenizer:
    return _save(MAKERS[request.param](), tmp_path_factory.mktemp(request.param))


def special_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None
    return found


def vllm_pieces(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """Each output id's text as vLLM's `FastIncrementalDetokenizer.decode_next` gives it:
    its DecodeStream made with the whole prompt, stepped an id at a time; on tokenizers'
    invalid-prefix error it starts a DecodeStream again, empty (`_protected_step`)."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    pieces = []
    for token in output:
        try:
            text = stream.step(tokenizer, token)
        except Exception as error:
            if not str(error).startswith(INVALID_PREFIX):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            text = stream.step(tokenizer, token)
        pieces.append(text or "")
    return pieces


def gateway_pieces(tokenizer: ModelTokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """Each output id's text from the gateway's detokenizer, as the vllm-grpc upstream
    makes it (`VllmGrpcCall._start`) and feeds it (one id a message)."""
    detok = tokenizer.detokenizer(tokenizer.context(prompt))
    return [detok.feed_one(token) for token in output]


def chat(tokenizer: ModelTokenizer, text: str) -> list[int]:
    """A one-turn chat's prompt, as the tiny chat template renders it."""
    return tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>", add_special_tokens=False)


def test_an_answers_first_word_keeps_its_space_as_after_the_prompt(tmp_path: Path) -> None:
    """The difference this is for: alone, a Metaspace decoder reads the answer's first
    `▁Sure,` as "Sure,"; after the prompt, as vLLM decodes it, " Sure,"."""
    tokenizer = _save(MAKERS["metaspace"](), tmp_path)
    rust = tokenizer._tokenizer
    prompt = chat(tokenizer, "hello there")
    output = tokenizer.encode(" Sure, here is the answer.", add_special_tokens=False)
    assert rust.id_to_token(output[0]) == "▁Sure,"
    expected = [" Sure,", " here", " is", " the", " answer."]
    assert vllm_pieces(rust, prompt, output) == expected
    assert gateway_pieces(tokenizer, prompt, output) == expected
    # what the gateway gave before it started after the prompt
    assert [tokenizer.detokenizer().feed_one(output[0])] == ["Sure,"]
    # and what it amounts to: the text the answer adds to the prompt's
    whole = tokenizer.decode(prompt + output)
    assert "".join(expected) == whole[len(tokenizer.decode(prompt)) :]


def test_the_context_is_the_prompts_last_ids(tokenizer: ModelTokenizer) -> None:
    prompt = chat(tokenizer, SENTENCES[0])
    assert tokenizer.context(prompt) == prompt[-CONTEXT_IDS:]
    assert tokenizer.context(prompt[:3]) == prompt[:3]
    assert tokenizer.context([]) == []


def test_a_prompt_that_ends_in_special_tokens_alone_is_decoded_whole(
    tokenizer: ModelTokenizer,
) -> None:
    """Its last ids decode to nothing: the answer's first token would be the sequence's
    first; so the detokenizer starts after the whole prompt, as vLLM's."""
    rust = tokenizer._tokenizer
    end = special_id(rust, "<|end|>")
    prompt = tokenizer.encode(SENTENCES[1], add_special_tokens=False) + [end] * CONTEXT_IDS
    assert tokenizer.context(prompt) == prompt
    output = tokenizer.encode(" " + SENTENCES[0], add_special_tokens=False)
    assert gateway_pieces(tokenizer, prompt, output) == vllm_pieces(rust, prompt, output)


def test_a_prompt_ending_in_a_long_run_of_byte_tokens_is_decoded_whole(tmp_path: Path) -> None:
    """Byte fallback decodes a run of `<0xNN>` tokens together, all of them U+FFFD when the
    run does not hold whole characters: last ids cut inside one would read so."""
    tokenizer = _save(llama2_tokenizer(), tmp_path)
    rust = tokenizer._tokenizer
    prompt = tokenizer.encode("the fox: 中中中中", add_special_tokens=True)
    assert (rust.id_to_token(prompt[-1]) or "").startswith("<0x")
    assert tokenizer.context(prompt) == prompt
    output = tokenizer.encode("the lazy dog", add_special_tokens=False)
    assert gateway_pieces(tokenizer, prompt, output) == vllm_pieces(rust, prompt, output)
    assert gateway_pieces(tokenizer, prompt, output)[0].startswith(" the")


def test_a_prompt_that_ends_inside_a_character_starts_the_answer_with_its_text(
    tmp_path: Path,
) -> None:
    """vLLM's own way, kept: the prompt's text ends in U+FFFD, so its DecodeStream keeps no
    prefix and the first text it gives holds the prompt's text (tokenizers'
    `step_decode_stream`); the gateway, started after the whole prompt, gives the same."""
    tokenizer = _save(llama2_tokenizer(), tmp_path)
    rust = tokenizer._tokenizer
    prompt = tokenizer.encode("hello Ж", add_special_tokens=True)[:-1]  # half of Ж
    output = tokenizer.encode("the fox", add_special_tokens=False)
    pieces = vllm_pieces(rust, prompt, output)
    assert pieces[0].startswith("hello")
    assert gateway_pieces(tokenizer, prompt, output) == pieces


@pytest.mark.parametrize("seed", range(6))
def test_random_prompts_and_answers_read_as_vllm_reads_them(
    tokenizer: ModelTokenizer, seed: int
) -> None:
    """Any prompt (chats and raw ids: special tokens, byte tokens, characters cut) and any
    answer: each token's text is the one vLLM's steps give, one id a message or several
    (`feed`, which steps again id by id where a message ends inside a character).
    Where tokenizers' invalid-prefix error strikes, both start their stream again."""
    rust = tokenizer._tokenizer
    size = rust.get_vocab_size()
    texts = [*SENTENCES, *WORDS, "ЖЖ 日本語 🔥", ""]
    rng = random.Random(seed)
    checked = 0
    for _ in range(150):
        if rng.random() < 0.5:
            prompt = chat(tokenizer, rng.choice(texts))
        else:
            prompt = [rng.randrange(size) for _ in range(rng.randrange(0, 20))]
            if rng.random() < 0.3:
                prompt += [special_id(rust, rng.choice(SPECIALS))] * rng.randrange(1, 12)
        if rng.random() < 0.5:
            output = tokenizer.encode(" " + rng.choice(texts), add_special_tokens=False)
        else:
            output = [rng.randrange(size) for _ in range(rng.randrange(1, 12))]
        expected = vllm_pieces(rust, prompt, output)
        checked += 1
        assert gateway_pieces(tokenizer, prompt, output) == expected, (prompt, output)
        if tokenizer.decode(prompt).endswith("\ufffd"):
            continue  # (left alone: see the module's docstring)
        detok = tokenizer.detokenizer(tokenizer.context(prompt))
        cut = rng.randrange(len(output) + 1)
        batched = detok.feed(output[:cut]) + detok.feed(output[cut:])
        assert batched == "".join(expected), (prompt, output, cut)
    assert checked > 100


class InvalidPrefix(Exception):
    """Where vLLM starts its DecodeStream again."""


def test_a_stream_that_goes_back_on_its_text_starts_again_as_vllm_s(tmp_path: Path) -> None:
    """Byte-fallback pieces that are no character can make tokenizers' DecodeStream
    refuse its own text (its invalid-prefix error): vLLM starts the stream again, empty,
    and goes on; so does the gateway, id by id and in messages of several ids, where the
    error escaped before and failed the answer."""
    rust = llama2_tokenizer()
    tokenizer = _save(rust, tmp_path)
    rng = random.Random(17)
    struck = 0
    for _ in range(200):
        prompt = chat(tokenizer, rng.choice(SENTENCES))
        output = [rng.randrange(rust.get_vocab_size()) for _ in range(24)]
        try:
            vllm_pieces_strict(rust, prompt, output)
            continue
        except InvalidPrefix:
            struck += 1
        expected = vllm_pieces(rust, prompt, output)
        assert gateway_pieces(tokenizer, prompt, output) == expected, (prompt, output)
        detok = tokenizer.detokenizer(tokenizer.context(prompt))
        cut = rng.randrange(len(output) + 1)
        assert detok.feed(output[:cut]) + detok.feed(output[cut:]) == "".join(expected)
    assert struck > 20


def vllm_pieces_strict(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """`vllm_pieces`, raising `InvalidPrefix` where vLLM would start its stream again."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    pieces = []
    for token in output:
        try:
            pieces.append(stream.step(tokenizer, token) or "")
        except Exception as error:
            if str(error).startswith(INVALID_PREFIX):
                raise InvalidPrefix from None
            raise
    return pieces


class Choices(FakeVllm):
    """The stand-in engine answering each of a request's n choices the same ids, a token a
    message, the choices' messages interleaved; it keeps the prompts' ids it was sent."""

    def __init__(self, ids: list[int], model_dir: Path) -> None:
        super().__init__(ids, [], 0.0, 1, (str(model_dir), MODEL))
        self.prompts: list[list[int]] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = list(request.tokenized.input_ids)
        self.prompts.append(prompt)
        choices = range(request.sampling_params.n or 1)
        for count, token in enumerate(self.ids, 1):
            for index in choices:
                chunk = pb.GenerateStreamChunk(
                    token_ids=[token],
                    index=index,
                    prompt_tokens=len(prompt),
                    completion_tokens=count,
                )
                yield pb.GenerateResponse(chunk=chunk)
        for index in choices:
            done = pb.GenerateComplete(
                output_ids=self.ids[-1:],
                index=index,
                finish_reason="length",
                prompt_tokens=len(prompt),
                completion_tokens=len(self.ids),
            )
            yield pb.GenerateResponse(complete=done)


async def _events(
    model_dir: Path, output: list[int], request: GenerateRequest, parser: str | None = None
) -> tuple[list[Event], list[list[int]]]:
    """The events through the vllm-grpc upstream (with the tool-call format `parser`) from
    `Choices`, and the prompts the engine was sent."""
    engine = Choices(output, model_dir)
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = VllmGrpcUpstream(
        f"127.0.0.1:{port}", model=MODEL, tokenizer=str(model_dir), tool_call_parser=parser
    )
    try:
        events = [event async for event in upstream.call(request, timeout=HANG_GUARD)]
    finally:
        await upstream.close()
        await server.stop(None)
    return events, engine.prompts


async def _texts(
    model_dir: Path, output: list[int], request: GenerateRequest
) -> tuple[dict[int, str], list[list[int]]]:
    """Each choice's text through the vllm-grpc upstream from `Choices`, and the prompts
    the engine was sent."""
    events, prompts = await _events(model_dir, output, request)
    texts: dict[int, str] = {}
    for event in events:
        if isinstance(event, Text):
            texts[event.index] = texts.get(event.index, "") + event.text
    return texts, prompts


@pytest.mark.parametrize(
    "request_",
    [
        GenerateRequest(model=MODEL, messages=(Message("user", "hello there"),), n=2),
        GenerateRequest(model=MODEL, prompt="hello from the fleet", stop=("never said",)),
    ],
    ids=["chat-n2", "completion-stop"],
)
def test_through_the_upstream_every_choice_starts_after_the_prompt(
    server_loop: ServerLoop, tmp_path: Path, request_: GenerateRequest
) -> None:
    """Each of a request's choices (plain, or with stop strings), as vLLM's server gives
    them: its first word's space kept."""
    tokenizer = _save(MAKERS["metaspace"](), tmp_path)
    output = tokenizer.encode(" Sure, here is the answer.", add_special_tokens=False)
    request = dataclasses.replace(request_, sampling=SamplingParams(max_tokens=len(output)))
    texts, prompts = server_loop.call(_texts(tmp_path, output, request))
    (prompt,) = prompts
    expected = "".join(vllm_pieces(tokenizer._tokenizer, prompt, output))
    assert expected == " Sure, here is the answer."
    assert texts == {index: expected for index in range(request.n)}


def test_a_hermes_call_in_special_tokens_is_parsed_as_vllm_s_parser_reads_it(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """A model whose `<tool_call>` markers are special tokens: vLLM's hermes parser turns
    `skip_special_tokens` off for a request with tools, so the markers reach it and the
    call is a call; so does the gateway (before: the markers decoded to nothing and the
    call came out as text). Without tools, special tokens stay out of the text."""
    rust = build_tokenizer().backend_tokenizer
    rust.add_special_tokens(["<tool_call>", "</tool_call>"])
    tokenizer = _save(rust, tmp_path)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    body = tokenizer.encode(call, add_special_tokens=False)
    output = [special_id(rust, "<tool_call>"), *body, special_id(rust, "</tool_call>")]
    weather = Tool("get_weather", parameters='{"type": "object"}')
    request = GenerateRequest(
        model=MODEL,
        messages=(Message("user", "the weather in Paris?"),),
        tools=(weather,),
        sampling=SamplingParams(max_tokens=len(output)),
    )
    events, _ = server_loop.call(_events(tmp_path, output, request, "hermes"))
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}
    assert not [e for e in events if isinstance(e, Text) and e.text.strip()]
    plain = dataclasses.replace(request, tools=())
    texts, _ = server_loop.call(_texts(tmp_path, output, plain))
    assert texts == {0: call}
