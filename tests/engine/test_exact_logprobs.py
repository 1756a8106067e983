"""A row that asks for logprobs gets the float32 head's logits over the whole vocabulary
(engine/exact_head.py), so its normaliser and its top entries are exact, not only the candidates
for the top that the low-precision head's bound picks (docs/engine.md "Log-probabilities")."""

from __future__ import annotations

import pytest
import torch

from engine.exact_head import exact_logits
from tests.helpers.logprobs import assert_exact_logprobs, model_with_head as _model_with_head

def _spread_head() -> tuple[torch.Tensor, torch.Tensor]:
    """h [4, 256] and a head [2048, 256] whose logits are spread (many tokens of some mass), where
    an int8 head's error moves the normaliser and the entries below its top."""
    torch.manual_seed(3)
    weight = torch.randn(2048, 256) * torch.rand(2048, 1)
    h = torch.randn(4, 256) * 0.6
    return h, weight


def test_scored_rows_report_every_logit_exact_and_every_row_samples_from_the_heads():
    h, weight = _spread_head()
    model = _model_with_head(weight)
    exact = (h.double() @ weight.double().T).float()
    plain = model.logits(h.clone())
    both = model.logits(h.clone(), scored=torch.tensor([True, False, True, False]))
    assert both.shape == (8, 2048)
    sampled, scored = both[:4], both[4:]
    # what is sampled does not depend on whether a row asks for logprobs
    assert torch.equal(sampled, plain)
    torch.testing.assert_close(scored[[0, 2]], exact[[0, 2]], rtol=0, atol=1e-4)
    assert torch.equal(scored[[1, 3]], plain[[1, 3]])
    # the head alone: its normaliser is off by more than float32's rounding (what this fixes)
    lse = torch.logsumexp
    assert float((lse(plain, -1) - lse(exact, -1)).abs().max()) > 1e-3
    assert float((lse(scored[[0, 2]], -1) - lse(exact[[0, 2]], -1)).abs().max()) < 1e-5
    # top 20 of each scored row: the float32 head's tokens and values
    for row in (0, 2):
        got, want = torch.topk(torch.log_softmax(scored[row], -1), 20), torch.topk(torch.log_softmax(exact[row], -1), 20)
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-5)


def test_a_scored_row_is_the_same_alone_or_beside_others():
    h, weight = _spread_head()
    model = _model_with_head(weight)
    together = model.logits(h.clone(), scored=torch.ones(4, dtype=torch.bool))[4:]
    for row in range(4):
        alone = model.logits(h[row:row + 1].clone(), scored=torch.ones(1, dtype=torch.bool))[1:]
        assert torch.equal(alone[0], together[row])


@pytest.mark.smollm2
def test_the_default_engines_logprobs_are_the_float32_heads_on_its_own_residual(smollm2, smollm2_default):
    """Eager, the default's int8 head with the file's Q8_0 rows (engine/quants' op); the
    packages compiled ahead of time: tests/engine/test_compiled.py."""
    assert_exact_logprobs(smollm2_default, smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "Write a short poem about the sea."}]))


def test_exact_logits_of_dense_rows_match_a_float64_product():
    h, weight = _spread_head()
    from engine.weights import DenseRows

    got = exact_logits(DenseRows(weight.bfloat16()), h, 2048)
    want = h.double() @ weight.bfloat16().double().T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
