"""The coding agent's API end to end (issue 28), with the clients agents use: the `openai`
client, the OpenAI Agents SDK and LangChain's ChatOpenAI, against a real worker on the default
engine (the SmolLM2 GGUF, bf16 linears on its Q4_1 blocks, four slots, eager), a real API and Redis.

SmolLM2-135M is weak: what it writes is only guaranteed valid where a grammar enforces it, so
tool-call flows use tool_choice "required" or a named tool, and structured output a schema."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, Stack, default_engine_stack, wait_until

pytestmark = pytest.mark.smollm2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with default_engine_stack(tmp_path_factory.mktemp("agents-redis"), parallel=4, prefill_chunk=256) as stack:
        yield stack


@pytest.fixture
def openai_client(stack: Stack) -> Iterator[OpenAI]:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=120, max_retries=0)
    yield client
    client.close()


def _validates(arguments: str, tool: dict) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, tool["function"]["parameters"])
    return value


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls put together from delta.tool_calls chunks, as a client does."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                assert call["name"] is None, "id and name come first, once"
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_parses_and_validates_streamed_or_not(openai_client: OpenAI, choice):
    tools = [WEATHER, TIME]
    whole = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                                  parallel_tool_calls=False, temperature=0, max_tokens=60)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    expected = [t for t in tools if t["function"]["name"] == call.function.name]
    assert expected
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    _validates(call.function.arguments, expected[0])
    assert call.id and call.type == "function"

    stream = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                                   parallel_tool_calls=False, temperature=0, max_tokens=60,
                                                   stream=True)
    calls, finish, content = _streamed_calls(stream)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert content == (message.content or "")


def test_response_format_json_schema_validates(openai_client: OpenAI):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_response_format_json_object_is_an_object(openai_client: OpenAI):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Answer in JSON: {"colour": "..."}. Name a colour.'}],
        temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_a_schema_that_cannot_be_enforced_is_400(stack: Stack):
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("response_format")


def _ids(stack: Stack, request_id: str) -> list[int]:
    entries = stack.redis.xrange(stack.keys.out(request_id))
    return [int(i) for _, fields in entries if fields.get("type") == "token" for i in fields["ids"].split(",") if i]


def test_two_constrained_and_two_free_batched(stack: Stack):
    """4 slots at once: the constrained answers validate; the free ones are token for token
    what they are alone."""
    free = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Count to five."}]]

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=300,
                          json={"temperature": 0, "max_tokens": 40, **body})

    alone = [_ids(stack, post({"messages": m}).headers["x-request-id"]) for m in free]
    bodies = [{"messages": [{"role": "user", "content": f"Describe person number {i}."}], "max_tokens": 120,
               "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
              for i in range(2)] + [{"messages": m} for m in free]
    results: list[httpx.Response | None] = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(bodies[i]))) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for response in results[:2]:
        assert response is not None and response.status_code == 200, response
        jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), PERSON)
    batched = [_ids(stack, r.headers["x-request-id"]) for r in results[2:] if r is not None]
    assert batched == alone
    # they did share steps: the worker ran them together (each was running when another finished)
    records = [stack.redis.hgetall(stack.keys.req(r.headers["x-request-id"])) for r in results if r is not None]
    assert len({rec.get("worker") for rec in records}) == 1


def _dead_end_bias() -> tuple[dict[str, float], int]:
    """A logit_bias that leaves a json_object grammar no token at its second position on
    SmolLM2: the first token can only be "{", and every token the grammar allows after it (their
    count returned too) is banned."""
    from engine.files import default_model_path
    from engine.grammar import Grammars
    from engine.tokenizer import Tokenizer
    from shapes.constraints import schema_grammar

    tok = Tokenizer.from_model_path(default_model_path())
    grammars = Grammars(tok.json, tok.vocab_size, sorted(tok.eos_token_ids), tok.decode)
    try:
        constraint = grammars.constraint(schema_grammar({"type": "object"}))
        first = [t for t in constraint.allowed().nonzero().squeeze(1).tolist() if tok.decode([t]) != "{"]
        constraint.accept(tok.encode_plain("{")[0])
        then = constraint.allowed().nonzero().squeeze(1).tolist()
    finally:
        grammars.close()
    return {str(t): -100.0 for t in first + then}, len(then)


def test_a_grammar_at_a_dead_end_fails_its_request_alone(stack: Stack):
    """On the real worker: a request whose grammar meets a dead end in a decode step is a 400
    grammar_error; a free request sharing those steps goes on, token for token as alone."""
    free = {"messages": [{"role": "user", "content": "Count to twenty."}], "temperature": 0, "max_tokens": 48}
    url = f"{stack.base_url}/v1/chat/completions"
    alone = _ids(stack, httpx.post(url, json=free, timeout=300).headers["x-request-id"])
    bias, banned_next = _dead_end_bias()
    doomed = {"messages": ASK, "temperature": 0, "max_tokens": 16, "response_format": {"type": "json_object"},
              "logit_bias": bias}
    beside: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: beside.append(httpx.post(url, json=free, timeout=300)))
    thread.start()
    wait_until(lambda: stack.redis.zcard(stack.keys.running) == 1, "the free request running")
    failed = httpx.post(url, json=doomed, timeout=300)
    thread.join()
    assert failed.status_code == 400, failed.text
    error = failed.json()["error"]
    assert error["code"] == "grammar_error"
    assert f"logit_bias removed all {banned_next} of them" in error["message"]  # at its second token: a decode step
    assert beside[0].status_code == 200
    assert _ids(stack, beside[0].headers["x-request-id"]) == alone
    record = stack.redis.hgetall(stack.keys.req(failed.headers["x-request-id"]))
    assert record["status"] == "failed"


def test_a_tool_turn_in_history_gets_a_final_answer(openai_client: OpenAI):
    first = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                  temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = openai_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                                  temperature=0, max_tokens=30)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content


def test_the_agents_sdk_runs_a_one_tool_agent_to_completion(stack: Stack):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        called.append(city)
        return f"Sunny, 21 C in {city}"

    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=120, max_retries=0)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    # the first turn must call the tool; after the tool's result the SDK asks again with tool_choice
    # reset to auto (reset_tool_choice), and SmolLM2 answers in text
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                             run_config=RunConfig(tracing_disabled=True))
    assert called, "the tool was called"
    kinds = [item.type for item in result.new_items]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item")
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(stack: Stack, method):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=30)
        country: str = Field(max_length=30)

    llm = ChatOpenAI(model=MODEL, base_url=f"{stack.base_url}/v1", api_key="none", temperature=0, max_tokens=60,
                     max_retries=0, timeout=120)
    found = llm.with_structured_output(City, method=method).invoke("Name the capital of France and its country.")
    assert isinstance(found, City)
    City.model_validate(found.model_dump())
