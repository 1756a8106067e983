"""A model folder's generation_config.json gives the sampling defaults a request does not set."""

from __future__ import annotations

import json

from engine.generation_config import sampling_defaults
from shapes.requests import ChatCompletionRequest
from shapes.rules import Rules
from tests.helpers.api import FakeTokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def _queued(rules: Rules, **body):
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
    return rules.queued("r1", request, [1, 2, 3], 0)


def test_generation_config_defaults_apply_only_where_the_request_sets_nothing(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.1, "eos_token_id": 2}))
    rules = Rules("m", FakeTokenizer(), 100, 10, defaults=sampling_defaults(tmp_path))
    default = _queued(rules)
    assert (default.temperature, default.top_p, default.top_k, default.min_p, default.repetition_penalty) == \
        (0.6, 0.9, 20, 0.05, 1.1)
    asked = _queued(rules, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert (asked.temperature, asked.top_p, asked.top_k, asked.min_p, asked.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_do_sample_false_means_greedy_and_no_file_means_the_built_in_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert _queued(Rules("m", FakeTokenizer(), 100, 10, defaults=sampling_defaults(tmp_path))).temperature == 0.0
    plain = _queued(Rules("m", FakeTokenizer(), 100, 10, defaults=sampling_defaults(tmp_path / "absent")))
    assert (plain.temperature, plain.top_p, plain.min_p, plain.repetition_penalty, plain.logit_bias) == \
        (1.0, 1.0, 0.0, 1.0, [])


def test_logit_bias_travels_as_sorted_id_bias_pairs():
    rules = Rules("m", FakeTokenizer(), 100, 10)
    assert _queued(rules, logit_bias={"7": -100, "3": 2.5}).logit_bias == [(3, 2.5), (7, -100.0)]
