"""Every validation rule: a 400 invalid_request_error naming the parameter."""

import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello world"}]


def chat(**fields):
    return {"model": "furnace-demo", "messages": MESSAGES, **fields}


def completion(**fields):
    return {"model": "furnace-demo", "prompt": "hello world", **fields}


INVALID = [
    # (route, body, param)
    (CHAT, chat(n=2), "n"),
    (CHAT, chat(n="1"), "n"),
    (COMPLETIONS, completion(n=3), "n"),
    (COMPLETIONS, completion(best_of=2), "best_of"),
    (CHAT, chat(logprobs=True), "logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (COMPLETIONS, completion(logprobs=1), "logprobs"),
    (COMPLETIONS, completion(logprobs=0), "logprobs"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, chat(response_format={"type": "json_object"}), "response_format"),
    (CHAT, chat(response_format="text"), "response_format"),
    (COMPLETIONS, completion(echo=True), "echo"),
    (COMPLETIONS, completion(suffix="tail"), "suffix"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(temperature=2.01), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(temperature=True), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(presence_penalty=-2.5), "presence_penalty"),
    (COMPLETIONS, completion(frequency_penalty=2.5), "frequency_penalty"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens=1.5), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0, max_tokens=5), "max_completion_tokens"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (CHAT, chat(stop=[1]), "stop"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, {"model": "furnace-demo"}, "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=["hi"]), "messages[0]"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ]
        ),
        "messages[0].content[1]",
    ),
    (COMPLETIONS, completion(prompt=["a", "b"]), "prompt"),
    (COMPLETIONS, completion(prompt=[1, 2, 3]), "prompt"),
    (COMPLETIONS, completion(prompt=None), "prompt"),
    (COMPLETIONS, {"model": "furnace-demo"}, "prompt"),
    (CHAT, chat(model=7), "model"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (
        CHAT,
        chat(stream=True, stream_options={"include_usage": "y"}),
        "stream_options.include_usage",
    ),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(top_k=2**32), "top_k"),
    (CHAT, chat(max_tokens=2**32), "max_tokens"),
    (COMPLETIONS, completion(max_completion_tokens=10**30), "max_completion_tokens"),
    (CHAT, chat(seed=2**63), "seed"),
    (CHAT, chat(n=10**30), "n"),
    (CHAT, chat(seed="x"), "seed"),
]


@pytest.mark.parametrize(("route", "body", "param"), INVALID)
def test_invalid_parameter_is_a_400_naming_it(client, route, body, param):
    fixed = "stream" in body or "stream_options" in body
    for stream in (False, True):
        sent = body if fixed else {**body, "stream": stream}
        response = client.post(route, json=sent)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert error["code"] is None
        assert error["message"]


ACCEPTED = [
    (CHAT, chat(n=1, best_of=None, logprobs=False, tools=[], response_format={"type": "text"})),
    (CHAT, chat(temperature=0, top_p=1, presence_penalty=-2, frequency_penalty=2)),
    (CHAT, chat(temperature=2, top_k=0, seed=1234)),
    (CHAT, chat(top_k=-1)),
    (CHAT, chat(top_k=40)),
    (CHAT, chat(stop="x", max_completion_tokens=3, max_tokens=0)),
    (CHAT, chat(stop=["a", "b", "c", "d"])),
    (CHAT, chat(unknown_field={"deep": [1, 2]}, user="team-a", parallel_tool_calls=False)),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}])),
    (CHAT, chat(messages=[{"role": "assistant", "content": None}, *MESSAGES])),
    (COMPLETIONS, completion(echo=False, suffix="", best_of=1, logprobs=None)),
    (COMPLETIONS, completion(prompt=["one string"])),
]


@pytest.mark.parametrize(("route", "body"), ACCEPTED)
def test_valid_parameters_are_served(client, route, body):
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text


def test_max_completion_tokens_wins_over_max_tokens(client):
    body = chat(messages=[{"role": "user", "content": "a b c d e"}])
    response = client.post(CHAT, json={**body, "max_tokens": 4, "max_completion_tokens": 2})
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "a b"
    assert choice["finish_reason"] == "length"
