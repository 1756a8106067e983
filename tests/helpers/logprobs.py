"""Shared by the head's tests and the logprobs tests: a model that is only a head, and the check
that a request's logprobs are the float32 head's on the step's own residual."""

from __future__ import annotations

import torch

from engine.model import ModelConfig, Transformer
from engine.protocol import SamplingParams
from engine.weights import DenseRows, HeadBound, Int8Linear

STEPS = 8


def model_with_head(weight: torch.Tensor) -> Transformer:
    """A model with no layers: only `logits` (int8 head, its bound, exact rows) is used."""
    vocab, dim = weight.shape
    model = Transformer(ModelConfig(dim=dim, n_layers=0, n_heads=1, n_kv_heads=1, head_dim=dim, hidden_dim=dim,
                                    vocab_size=vocab))
    head = Int8Linear(weight)
    model.head, model.head_bound, model.head_rows = head, HeadBound(weight, head.dequantized), DenseRows(weight)
    return model


def assert_exact_logprobs(engine, ids: list[int], steps: int = STEPS) -> None:
    """A greedy answer to `ids` with top_logprobs 20 through `engine` (whichever step it decodes
    with) carries, at every position, log_softmax of the step's own residual times the head's
    exact rows (float64 here), every entry; the prompt's echo scores too."""
    model = engine.model
    vocab = model.cfg.vocab_size
    with torch.inference_mode():
        exact_rows = model.head_rows(torch.arange(vocab)).double()
    residuals = []  # each exact_top call's h: the rows the head was given
    scored = []  # each reported_logits call's h: a prompt's rows, which only report
    exact_top, reported_logits = model.exact_top, model.reported_logits

    def recording(h, *args, **kwargs):
        residuals.append(h.detach().clone())
        return exact_top(h, *args, **kwargs)

    def recording_prompt(h):
        scored.append(h.detach().clone())
        return reported_logits(h)

    model.exact_top, model.reported_logits = recording, recording_prompt
    try:
        engine.begin(0, SamplingParams(temperature=0.0, logprobs=20, prompt_logprobs=5))
        out = [engine.read(0, ids, sample=True)]
        rows = [residuals[-1]]  # the prompt's last row: the first answer token is drawn from it
        while len(out) < steps:
            new = engine.decode([0], [out[-1]])[0]
            rows.append(residuals[-1][:len(new)])  # guessed rows past the first wrong guess unused
            out += new
    finally:
        del model.exact_top, model.reported_logits
    scores, prompt_scores = engine.logprobs(0), engine.prompt_logprobs(0)
    engine.truncate(0, 0)
    prompt_rows, answer_rows = torch.cat(scored), torch.cat(rows)
    assert torch.equal(rows[0], prompt_rows[-1:])
    assert prompt_rows.shape[0] == len(ids) and len(scores) == answer_rows.shape[0] >= steps
    expected = torch.log_softmax(answer_rows.double() @ exact_rows.T, -1)
    worst = 0.0
    for i, score in enumerate(scores):
        assert score.token == out[i] == int(expected[i].argmax())
        want = torch.topk(expected[i], 20)
        assert [t for t, _ in score.top] == want.indices.tolist(), i
        worst = max(worst, abs(score.logprob - float(expected[i, score.token])),
                    max(abs(v - w) for (_, v), w in zip(score.top, want.values.tolist())))
    expected = torch.log_softmax(prompt_rows.double() @ exact_rows.T, -1)
    assert len(prompt_scores) == len(ids) - 1
    for i, score in enumerate(prompt_scores):
        assert score.token == ids[i + 1]
        worst = max(worst, abs(score.logprob - float(expected[i, ids[i + 1]])))
    assert worst < 1e-4, worst  # float32 against float64 rounding only
