"""A row's grammar state (engine/grammar.py) on SmolLM2's real tokenizer: free while the model
thinks, constrained from the token after </think>; compiled once per grammar text."""

from __future__ import annotations

import json

import pytest

from engine.grammar import Grammars
from shapes.constraints import schema_grammar

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def grammars(smollm2):
    tok = smollm2.tokenizer
    made = Grammars(tok.json, smollm2.config.vocab_size, sorted(tok.eos_token_ids), tok.decode)
    yield made
    made.close()


def test_free_while_thinking_then_the_grammar(smollm2, grammars):
    tok = smollm2.tokenizer
    constraint = grammars.constraint(schema_grammar({"type": "object"}), after="</think>")
    for token in tok.encode_plain("Let me think. </think>"):
        assert constraint.allowed() is None
        constraint.accept(token)
    allowed = constraint.allowed()
    assert allowed is not None and allowed.shape == (smollm2.config.vocab_size,)
    ids = allowed.nonzero().squeeze(1).tolist()
    assert ids and all(tok.decode([i]).lstrip().startswith("{") for i in ids)  # an object, nothing else
    for token in tok.encode_plain('{"a": 1}'):
        assert constraint.allowed()[token]
        constraint.accept(token)
    assert set(constraint.allowed().nonzero().squeeze(1).tolist()) <= set(tok.eos_token_ids)  # only the end
    assert constraint.is_done


def test_each_grammar_compiles_once_and_rows_keep_their_own_state(smollm2, grammars):
    tok = smollm2.tokenizer
    grammar = schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    first, second = grammars.constraint(grammar), grammars.constraint(grammar)
    assert first._future is second._future  # one compilation, cached by the grammar's text
    for token in tok.encode_plain('{"n": 4'):
        first.accept(token)
    assert not second.allowed()[tok.encode_plain("}")[0]]  # the second row is still at the start
    json.loads(tok.decode(tok.encode_plain('{"n": 4}')))
