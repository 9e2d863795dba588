"""`protocol.reasoning.ReasoningSplitter`, the gateway's own reasoning parser (for
`upstream: vllm-grpc`): an answer cut into reasoning and text at `</think>`, the same
whichever pieces the detokenizer gives it in, markers cut anywhere; `deepseek_r1`'s
answer begins in thought, `qwen3`'s only when it opens one."""

import random

import pytest

from gateway.protocol.reasoning import ReasoningSplitter


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    """The answer in `pieces`, the last given as the last (`last`, as after a stop string)."""
    splitter = ReasoningSplitter(parser)
    thought, text = "", ""
    for i, piece in enumerate(pieces):
        more_thought, more_text = (
            splitter.last(piece) if i == len(pieces) - 1 else splitter.feed(piece)
        )
        thought, text = thought + more_thought, text + more_text
    if not pieces:
        thought, text = splitter.flush()
    return thought, text


@pytest.mark.parametrize(
    ("parser", "answer", "expected"),
    [
        ("deepseek_r1", "I think</think>Hello", ("I think", "Hello")),
        ("deepseek_r1", "<think>I think</think>Hello", ("I think", "Hello")),
        ("deepseek_r1", "\n<think>a</think>", ("a", "")),
        ("deepseek_r1", "still thinking", ("still thinking", "")),
        ("deepseek_r1", "a < b </thin", ("a < b </thin", "")),
        ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),
        ("deepseek_r1", "", ("", "")),
        ("qwen3", "<think>\nI think\n</think>\n\nHello", ("\nI think\n", "\n\nHello")),
        ("qwen3", "Hello, no thought", ("", "Hello, no thought")),
        ("qwen3", "<thin", ("", "<thin")),
        ("qwen3", "<think>cut", ("cut", "")),
        ("qwen3", "Hi</think>there", ("", "Hi</think>there")),
    ],
)
def test_an_answer_splits_the_same_however_it_is_cut(parser, answer, expected):
    assert split(parser, [answer]) == expected
    r = random.Random(answer)
    for _ in range(200):
        cuts = sorted(r.sample(range(len(answer) + 1), r.randint(0, len(answer))))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        assert split(parser, pieces) == expected, pieces


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("granite")
