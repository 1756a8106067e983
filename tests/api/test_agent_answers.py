"""Answers split into thinking, content and tool calls through the API and Redis: whole, streamed
(several tokens in one event, as prompt lookup yields them), and re-attached by Last-Event-ID.
A test plays the worker and publishes exactly the text a model would have written."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from queues.records import Done, Failed, Token
from tests.helpers.api import FakeTokenizer, assert_error
from tests.helpers.http import sse

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = ['Checking.\n<tool_call>\n{"name": "get_w', 'eather", "arguments": {"ci', 'ty": "Paris"}}\n</tool_call>']


class QwenLikeTokenizer(FakeTokenizer):
    """A template that thinks and renders tools (as Qwen3's does): Hermes calls, <think> tags."""

    chat_template = "{{ tools }} <tool_call> {% if enable_thinking %}<think>{% endif %}</think>"

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
        return super().encode_chat(messages)


@pytest.fixture
def http(start_api):
    with httpx.Client(base_url=start_api(tokenizer=QwenLikeTokenizer(), ctx=4096), timeout=10) as client:
        yield client


def whole(http: httpx.Client, worker, body: dict, *events) -> dict:
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(http.post, CHAT, json=body)
        (request_id,) = worker.wait_for(1)
        worker.publish(request_id, *events)
        response = future.result(10)
    assert response.status_code == 200, response.text
    return response.json()


def deltas(events: list[dict]) -> tuple[str, str, dict[int, dict], str | None]:
    """reasoning, content, tool calls (index -> id, name, arguments) and finish_reason of a stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for event in events:
        if event["data"] == "[DONE]":
            continue
        for choice in json.loads(event["data"])["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content", "")
            assert delta.get("reasoning_content") == delta.get("reasoning")  # the two names, the same text
            content += delta.get("content", "")
            for part in delta.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"arguments": ""})
                if "id" in part:
                    call.update(id=part["id"], name=part["function"]["name"])
                call["arguments"] += part["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_thinking_is_apart_from_the_answer_whole_and_streamed(http, worker):
    text = ["<think>\nThe user", " says hi.\n</th", "ink>\n\nHello", "!"]
    events = [Token(t, [i]) for i, t in enumerate(text)] + [Done("stop", 5, 4)]
    body = whole(http, worker, {"messages": HI}, *events)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].strip() == "The user says hi."
    assert message["reasoning"] == message["reasoning_content"]
    assert message["content"] == "Hello!"
    assert "tool_calls" not in message

    with http.stream("POST", CHAT, json={"messages": HI, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, *events)
        reasoning, content, calls, finish = deltas(list(sse(response.iter_lines())))
    assert (reasoning, content, calls, finish) == (message["reasoning_content"], "Hello!", {}, "stop")


def test_a_tool_call_whole_and_streamed_from_events_of_several_tokens(http, worker):
    events = [Token(t, [1, 2, 3]) for t in CALL_TEXT] + [Done("stop", 5, 9)]
    body = {"messages": HI, "tools": [WEATHER]}
    answer = whole(http, worker, body, *events)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        worker.publish(request_id, *events)
        streamed = list(sse(response.iter_lines()))
    reasoning, content, calls, finish = deltas(streamed)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Paris"}'
    # id, type and name first, then the arguments under the same index
    parts = [p for e in streamed[:-1] for c in json.loads(e["data"])["choices"] for p in c["delta"].get("tool_calls", [])]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""} and parts[0]["type"] == "function"
    assert "id" not in parts[1] and parts[1]["function"] == {"arguments": '{"city": "Paris"}'}


def test_a_reattach_after_part_of_a_call_still_gets_the_whole_call_once(http, worker):
    body = {"messages": HI, "tools": [WEATHER], "stream": True, "stream_options": {"detach": True}}
    with http.stream("POST", CHAT, json=body) as response:
        request_id = response.headers["x-request-id"]
        entry_ids = worker.publish(request_id, *[Token(t, [1]) for t in CALL_TEXT], Done("stop", 5, 3))
        first = list(sse(response.iter_lines()))
    # the client saw the content chunk (from the first event) and then lost the connection
    seen = [e for e in first if e.get("id") == entry_ids[0]]
    assert deltas(seen)[1] == "Checking."
    with http.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": entry_ids[0]}) as again:
        rest = list(sse(again.iter_lines()))
    reasoning, content, calls, finish = deltas(rest)
    assert content == ""  # what it had seen is not sent again
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"
    assert deltas(first)[2] == calls  # the same call, the same id, as the first stream had


def test_tool_choice_none_reads_no_calls(http, worker):
    events = [Token(t, [1]) for t in CALL_TEXT] + [Done("stop", 5, 3)]
    answer = whole(http, worker, {"messages": HI, "tools": [WEATHER], "tool_choice": "none"}, *events)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"] == "".join(CALL_TEXT)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 5}, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
])
def test_asks_that_cannot_be_met_are_400(http, worker, body, param):
    response = http.post(CHAT, json={"messages": HI, **body})
    assert response.status_code == 400, response.text
    if param:
        assert response.json()["error"]["param"].startswith(param)
    assert worker.waiting() == []


def test_a_forced_call_carries_its_grammar_to_the_worker(http, worker):
    response = http.post(CHAT, json={"messages": HI, "tools": [WEATHER], "tool_choice": "required",
                                     "background": True})
    assert response.status_code == 202, response.text
    (request_id,) = worker.wait_for(1)
    params = json.loads(worker.record(request_id)["params"])
    assert "get_weather" in params["grammar"] and "<tool_call>" in params["grammar"]
    assert worker.record(request_id)["tool_format"] == "hermes"


def test_a_grammar_the_worker_failed_is_a_400_naming_it(http, worker):
    """The worker ends a request whose grammar failed at run time with code grammar_error (only
    that request: tests/workers/test_loop.py, tests/engine/test_grammar.py): the request's fault."""
    body = {"messages": HI, "response_format": {"type": "json_object"}}
    message = "the answer's grammar (response_format or the forced tool call) failed: the grammar allows no token here"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(http.post, CHAT, json=body)
        (request_id,) = worker.wait_for(1)
        worker.publish(request_id, Failed(message, "grammar_error"))
        response = future.result(10)
    error = assert_error(response, 400, code="grammar_error")
    assert error["message"] == message and error["type"] == "invalid_request_error"
