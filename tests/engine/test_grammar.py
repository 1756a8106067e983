"""A row's grammar state (engine/grammar.py) on SmolLM2's real tokenizer: free while the model
thinks, constrained from the token after </think>; compiled once per grammar text. A grammar
that fails at run time fails its own row of the real engine's step, never the others."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from engine.errors import RowsFailed
from engine.grammar import Grammars
from engine.protocol import SamplingParams
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


def _free_run(engine, slot: int, prompt: list[int], steps: int) -> list[int]:
    engine.begin(slot, SamplingParams(temperature=0.0))
    tokens = [engine.read(slot, prompt, sample=True)]
    for _ in range(steps):
        tokens += engine.decode([slot], [tokens[-1]])[0]
    return tokens


@pytest.fixture(scope="module")
def two_slots(new_smollm2_engine):
    return new_smollm2_engine(torch.bfloat16, num_slots=2, ctx=256)  # the default: bf16, int4 linears


def test_a_grammar_at_a_dead_end_fails_only_its_own_row(smollm2, grammars, two_slots):
    """logit_bias bans the one token the grammar allows at its second position: that request
    fails with a grammar_error naming why; the free row beside it decodes as it does alone."""
    engine, tok = two_slots, smollm2.tokenizer
    free_prompt = tok.encode_plain("The capital of France is")
    alone = _free_run(engine, 1, free_prompt, 2)
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "{" "zzzz"')
    probe = grammars.constraint(grammar)
    probe.accept(int(probe.allowed().nonzero()[0]))  # "{"
    banned = probe.allowed().nonzero().squeeze(1).tolist()  # what may follow it: "zz"
    engine.begin(0, SamplingParams(temperature=0.0, grammar=grammar, logit_bias=tuple((t, -100.0) for t in banned)))
    engine.begin(1, SamplingParams(temperature=0.0))
    first = engine.read(0, tok.encode_plain("Answer:"), sample=True)
    assert tok.decode([first]) == "{"
    beside = [engine.read(1, free_prompt, sample=True)]
    with pytest.raises(RowsFailed) as failed:
        engine.decode([0, 1], [first, beside[-1]])
    assert set(failed.value.failed) == {0} and failed.value.failed[0].code == "grammar_error"
    assert "logit_bias removed all 1 of them" in str(failed.value.failed[0])
    beside += failed.value.tokens[1]
    beside += engine.decode([1], [beside[-1]])[0]
    assert beside == alone


def test_a_grammar_that_does_not_compile_fails_its_row_when_its_thinking_ends(smollm2, two_slots):
    """A grammar is first needed after the thinking (grammar_after): its compile error surfaces in
    a decode step, and ends that request only."""
    engine, tok = two_slots, smollm2.tokenizer
    prompt = tok.encode_plain("Once upon a time")
    alone = _free_run(engine, 1, prompt, 2)
    # the thinking "ends" with the first token the model writes: the grammar is wanted at the next
    engine.begin(0, SamplingParams(temperature=0.0, grammar="not a grammar", grammar_after=tok.decode(alone[:1])))
    engine.begin(1, SamplingParams(temperature=0.0))
    first = engine.read(0, prompt, sample=True)
    beside = [engine.read(1, prompt, sample=True)]
    with pytest.raises(RowsFailed) as failed:
        engine.decode([0, 1], [first, beside[-1]])
    assert set(failed.value.failed) == {0}
    assert "does not compile" in str(failed.value.failed[0])
    beside += failed.value.tokens[1]
    beside += engine.decode([1], [beside[-1]])[0]
    assert beside == alone
