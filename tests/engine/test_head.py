"""The vocabulary head. A GGUF file's quantized head is its own blocks times the float32 residual
(exact); a bf16 head (an HF folder's) runs as int8 rows (half its bytes) whose error bound decides
which top logits `Transformer.logits` recomputes exactly, so the top token is the float32
model's."""

from __future__ import annotations

import pytest
import torch

from engine.model import CacheIndex
from engine.quants import blocks as quants
from engine.quants.blocks import QuantLinear
from engine.weights import HeadBound
from tests.helpers.logprobs import model_with_head as _model_with_head

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "What is 17 times 23?"]
STEPS = 12


class RowCounter(torch.nn.Module):
    """Wraps a row table and counts the rows asked for (the exact recomputations)."""

    def __init__(self, rows) -> None:
        super().__init__()
        self.rows, self.counts = rows, []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.counts.append(ids.numel())
        return self.rows(ids)


def test_int8_head_error_is_within_its_bound():
    torch.manual_seed(0)
    weight = torch.randn(4096, 256) * torch.rand(4096, 1)  # rows of different scales
    model = _model_with_head(weight)
    h = torch.randn(8, 256) * 4
    h[:, 3] = 60.0  # an outlier dimension, as RMSNorm outputs have
    x = h.bfloat16()
    c = model.head(x).float()
    exact = h.double() @ weight.double().T
    bound = (model.head_bound.coefficients(h, x) @ model.head_bound.table).double() + HeadBound.ROUNDING * c.abs().double()
    err = (c.double() - exact).abs()
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.02  # a bound, not a wild overestimate


def _near_tie(high_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """h [4, 256] and a head [256, 256] whose exact logits for h[0] are 20 + 0.05 k / 256 in random
    order (2e-4 apart), the first `high_rows` rows at 30 instead."""
    torch.manual_seed(1)
    dim, vocab = 256, 256
    h = torch.randn(4, dim)
    base = torch.randn(dim)
    weight = base + 0.05 * torch.randn(vocab, dim)
    unit = h[0] / h[0].norm()
    target = 20.0 + 0.05 * torch.randperm(vocab).float().unsqueeze(1) / vocab
    target[:high_rows] = 30.0
    return h, weight - (weight @ unit).unsqueeze(1) * unit + target * unit / h[0].norm()  # each row's part along h[0]


def test_near_tie_goes_to_the_true_maximum():
    # 256 rows whose exact logits for h[0] are 2e-4 apart, far above float32's rounding but far
    # below the int8 head's error (bf16 alone rounds them all to 20.0), so the head alone picks a
    # wrong top token; the recomputed window must hold the right one.
    h, weight = _near_tie()
    model = _model_with_head(weight)
    counter = RowCounter(model.head_rows)
    model.head_rows = counter
    exact = h.double() @ weight.double().T
    assert float(exact[0].max() - exact[0].min()) < 0.05
    cheap = model.head(h.bfloat16()).float()
    assert not torch.equal(cheap.argmax(-1), exact.argmax(-1))  # the head alone gets it wrong
    logits = model.logits(h)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.argmax(-1)
    torch.testing.assert_close(logits.gather(1, top[:, None]).double(), exact.gather(1, top[:, None]), rtol=1e-6, atol=1e-5)
    assert sum(counter.counts) > 1


@pytest.mark.smollm2
def test_default_head_is_the_files_rows_exactly(smollm2, smollm2_default):
    # The default's head is the file's Q8_0 blocks dotted with the float32 residual: teacher-forced
    # on its own greedy continuation, its logits are that product bit for bit (so a row that asks
    # for logprobs reports them, no second pass), each row's the same alone as in a batch, within
    # float32 rounding of the float64 product of the same rows, with the same top token.
    model, tok = smollm2_default.model, smollm2.tokenizer
    assert isinstance(model.head, QuantLinear) and model.head_bound is None
    exact_rows = smollm2.gguf.dense("embed").double()
    hidden = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            for step in range(STEPS):
                h = model(torch.tensor([ids]), CacheIndex.for_read(0, 0, len(ids)))
                hidden.append(h)
                ids.append(int(model.logits(h).argmax()))
        h = torch.cat(hidden)
        ours = model.logits(h)
        rows = model.head_rows
        assert torch.equal(ours, quants.ops().mm(h, rows.blocks, int(rows.qtype), quants.table(rows.qtype), False))
        assert torch.equal(model.reported_logits(h), ours)
        assert torch.equal(ours[5:6], model.logits(h[5:6].clone()))
    float64 = h.double() @ exact_rows.T
    assert float((ours.double() - float64).abs().max()) < 1e-3
    assert torch.equal(ours.argmax(-1), float64.argmax(-1))


def test_a_constrained_row_gets_the_true_maximum_among_its_allowed_tokens():
    # Rows near-tied at ~20 for h[0] (as in the test above), and eight rows far above at ~30 that
    # row 0's grammar forbids: the head's candidates are those eight, so without the mask the
    # near-tied allowed ones keep the head's rounded logits and the wrong one wins. Row 1 is
    # free: its logits are the same as without a constrained neighbour.
    h, weight = _near_tie(high_rows=8)
    vocab = weight.shape[0]
    model = _model_with_head(weight)
    exact = h.double() @ weight.double().T
    allowed = torch.ones(4, vocab, dtype=torch.bool)
    allowed[0, :8] = False
    free = model.logits(h[1:2].clone())
    logits = model.logits(h.clone(), allowed)
    truth = int(exact[0].masked_fill(~allowed[0], float("-inf")).argmax())
    assert int(logits[0].masked_fill(~allowed[0], float("-inf")).argmax()) == truth
    unmasked = model.logits(h.clone())[0].masked_fill(~allowed[0], float("-inf"))
    assert int(unmasked.argmax()) != truth  # what the head's candidates alone give
    assert torch.equal(logits[1:2], free)


def test_a_constrained_row_whose_head_top_is_allowed_keeps_its_candidates_among_the_allowed():
    # Near-tied rows (the head alone picks a wrong top); row 0's grammar forbids half of them but
    # not the head's top: its candidates are the head's own, less the forbidden ones (no second
    # bound), and still give the true maximum among the allowed. Rows 2-3 forbid nothing.
    h, weight = _near_tie()
    vocab = weight.shape[0]
    model = _model_with_head(weight)
    exact = h.double() @ weight.double().T
    head_top = model.head(h.bfloat16()).float().argmax(-1)
    allowed = torch.ones(4, vocab, dtype=torch.bool)
    forbidden = exact[0].argsort(descending=True)[: vocab // 2]  # the best half: the true top too
    forbidden = forbidden[forbidden != head_top[0]]
    allowed[0, forbidden] = False
    assert allowed[0, head_top[0]]
    counter = RowCounter(model.head_rows)
    model.head_rows = counter
    logits = model.logits(h.clone(), allowed)
    truth = int(exact[0].masked_fill(~allowed[0], float("-inf")).argmax())
    assert int(logits[0].masked_fill(~allowed[0], float("-inf")).argmax()) == truth
    counted = sum(counter.counts)
    counter.counts.clear()
    model.logits(h.clone())
    assert counted < sum(counter.counts)  # the forbidden candidates were not recomputed
