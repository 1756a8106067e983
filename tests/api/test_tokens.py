"""POST /tokenize and /detokenize: the ids a generation request with the same prompt enqueues."""

from __future__ import annotations

from tests.helpers.api import FakeTokenizer
from tests.helpers.api import assert_error

HI = [{"role": "user", "content": "hi"}]


def test_tokenize_text_and_messages_as_the_generation_endpoints_do(http, worker):
    text = http.post("/tokenize", json={"prompt": "abc"})
    assert text.status_code == 200, text.text
    assert text.json() == {"tokens": [97, 98, 99], "count": 3, "max_model_len": 64}
    chat = http.post("/tokenize", json={"messages": HI}).json()
    assert chat["tokens"] == FakeTokenizer().encode_chat(HI)
    # the same ids a chat request enqueues
    http.post("/v1/chat/completions", json={"messages": HI, "background": True})
    (request_id,) = worker.wait_for(1)
    assert worker.prompt(request_id) == chat["tokens"]


def test_detokenize_is_the_inverse(http):
    ids = http.post("/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    response = http.post("/detokenize", json={"tokens": ids})
    assert response.status_code == 200 and response.json() == {"prompt": "héllo"}


def test_bad_bodies_are_400s_naming_the_field(http):
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": HI}), 400)
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400, param="tokens.0")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")
    assert_error(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, code="model_not_found")


def test_tokenizer_info_and_tokenizing_without_special_tokens(http):
    info = http.get("/tokenizer_info")
    assert info.status_code == 200 and info.json()["model_max_length"] == 64
    plain = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False})
    assert plain.status_code == 200 and plain.json()["tokens"] == [97, 98]
