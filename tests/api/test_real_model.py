"""With the real SmolLM2 tokenizer and the OpenAI client: the prompt ids the API enqueues are
the model's chat template, and the client library reads the stream the API writes."""

import json
import threading
import time

import openai
import pytest

from engine.files import resolve_model_path
from engine.tokenizer import Tokenizer
from queues.membership import Membership
from queues.worker_state import WorkerState
from queues.records import Done, Token
from tests.helpers.api import Worker

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(resolve_model_path(None))


def test_real_tokenizer_and_openai_client(start_api, redis_client, tokenizer):
    base = start_api(tokenizer=tokenizer, served_model_name=None, ctx=2048)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    # a live worker's heartbeat: /v1/models lists only models someone serves
    Membership(redis_client, "SmolLM2-135M-Instruct", "w1").heartbeat(WorkerState(), int(time.time() * 1000), ttl_s=10)
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    worker = Worker(redis_client, "SmolLM2-135M-Instruct")

    messages = [{"role": "user", "content": "What is 2+2?"}]

    enqueued = []

    def play_worker():
        (request_id,) = worker.wait_for(1)
        enqueued.append(worker.record(request_id))
        worker.publish(request_id, Token("Four", [1]), Token(".", [2]), Done("stop", 30, 2))

    thread = threading.Thread(target=play_worker, daemon=True)
    thread.start()
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, stream=True,
        stream_options={"include_usage": True}, extra_body={"priority": 4},
    )
    chunks = list(stream)
    thread.join(10)
    assert json.loads(enqueued[0]["prompt"]) == tokenizer.encode_chat(messages)
    assert enqueued[0]["priority"] == "4"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Four."
    assert chunks[-1].usage.total_tokens == 32
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert raised.value.body["code"] == "model_not_found"
