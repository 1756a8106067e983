"""A model that thinks, end to end on the real engine (issue 28): its thinking goes to
`reasoning_content` / `reasoning`, `content` holds only the answer, streamed and not; a grammar
applies from the token after `</think>`; `chat_template_kwargs` reach the template.

No thinking model's weights are at hand, and a random one writes no `</think>`: the model here
is tiny (two layers, 64 wide, SmolLM2's tokenizer), given a thinking template of the
DeepSeek-R1 / Qwen3-thinking shape (the generation prompt opens `<think>`), and trained in a few
seconds to answer the one question below with its thinking and then "Paris.". A real worker
(the default engine on that folder), a real API and Redis serve it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import Stack, default_engine_stack, sse

pytestmark = pytest.mark.smollm2

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT = "The user asks for a capital."
ANSWER = f"{THOUGHT}\n</think>\n\nParis."  # what the model writes after the prompt's <think>
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}


def _train(folder: Path) -> None:
    """Overfit the folder's random model on ASK -> ANSWER + <|im_end|> until greedy decoding
    writes it with a margin of 3 logits at every token (bf16 rounding cannot flip it)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = torch.tensor([list(prompt) + answer])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(folder, local_files_only=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        out = model(ids, labels=labels)
        top = out.logits[0, len(prompt) - 1:-1].detach().topk(2)
        if bool((top.indices[:, 0] == ids[0, len(prompt):]).all()) and float((top.values[:, 0] - top.values[:, 1]).min()) > 3:
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the tiny model did not learn its answer")
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("thinking") / "tiny-thinker"
    shutil.copytree(tiny_model, folder)
    _train(folder)
    return folder


@pytest.fixture(scope="module")
def stack(thinking_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with default_engine_stack(tmp_path_factory.mktemp("thinking-redis"), parallel=2, prefill_chunk=64,
                              model=thinking_model) as stack:
        yield stack


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        yield client


def _streamed(http: httpx.Client, body: dict) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for event in sse(response.iter_lines()):
            if event["data"] == "[DONE]":
                continue
            for choice in json.loads(event["data"])["choices"]:
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_the_thinking_is_apart_from_the_answer_whole_and_streamed(http):
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"].strip() == THOUGHT
    assert message["reasoning"] == message["reasoning_content"]
    assert (message["content"], choice["finish_reason"]) == ("Paris.", "stop")
    assert _streamed(http, body) == (message["reasoning_content"], "Paris.", "stop")


def test_a_grammar_applies_once_the_thinking_ends(http):
    """Free while thinking (the model's own thought), then held to the schema: not "Paris."."""
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["reasoning_content"].strip() == THOUGHT
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY)
    assert _streamed(http, body) == (choice["message"]["reasoning_content"], choice["message"]["content"], "stop")


def test_chat_template_kwargs_turn_the_thinking_off(http):
    """enable_thinking false: the template closes the thinking itself, so none is read back."""
    response = http.post("/v1/chat/completions", json={
        "messages": ASK, "temperature": 0, "max_tokens": 12, "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None and message.get("reasoning") is None
    usage = response.json()["usage"]
    thinking_prompt = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] > thinking_prompt["prompt_tokens"]  # the template wrote "<think>\n\n</think>\n\n"
