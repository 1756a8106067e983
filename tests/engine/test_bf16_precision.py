"""bf16 against float32 on SmolLM2, measured beside transformers' own bf16 on the same positions.

Teacher-forced: each prompt's float32 greedy continuation is fed to every model, so position p of
each model predicts the same next token; agreement = same top token as our float32 engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.protocol import SamplingParams
from engine.runner import default_dtype

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "What is 17 times 23?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]
STEPS = 16
GREEDY = SamplingParams(temperature=0.0)


def _greedy(engine, ids: list[int], steps: int) -> list[int]:
    engine.begin(0, GREEDY)
    out = [engine.read(0, ids, sample=True)]
    while len(out) < steps and out[-1] not in engine.eos_token_ids:
        out += engine.decode([0], [out[-1]])
    return out


def _teacher_forced(engine, ids: list[int], forced: list[int]) -> torch.Tensor:
    """Logits [len(forced), V]: after the prompt, then after each forced token but the last."""
    engine.begin(0, GREEDY)
    model, pos = engine.model, len(ids)
    with torch.inference_mode():
        rows = [model.prefill(0, torch.tensor(ids), 0)]
        for token in forced[:-1]:
            span = -(-(pos + 1) // 256) * 256
            rows.append(model.decode(torch.tensor([0]), torch.tensor([token]), torch.tensor([pos]), span, (0, 1))[0])
            pos += 1
    return torch.stack(rows)


def _hf_bf16(path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    return hf.to(torch.bfloat16)


def test_bf16_is_as_close_to_float32_as_transformers_bf16(smollm2, new_smollm2_engine):
    f32 = new_smollm2_engine(torch.float32, num_slots=1, ctx=512)
    bf16 = new_smollm2_engine(torch.bfloat16, num_slots=1, ctx=512)
    default = bf16 if default_dtype(torch.device("cpu")) == torch.bfloat16 else f32
    hf = _hf_bf16(smollm2.path)
    tok = smollm2.tokenizer
    stats = {"ours_bf16": [0, 0.0], "hf_bf16": [0, 0.0], "default": [0, 0.0]}
    total = 0
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        forced = _greedy(f32, ids, STEPS)
        ref = _teacher_forced(f32, ids, forced)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([ids + forced[:-1]])).logits[0, len(ids) - 1 :].float()
        ours = _teacher_forced(bf16, ids, forced)
        for name, logits in [("ours_bf16", ours), ("hf_bf16", hf_logits), ("default", ref if default is f32 else ours)]:
            stats[name][0] += int((logits.argmax(-1) == torch.tensor(forced)).sum())
            kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            stats[name][1] += float(kl.sum())
        total += len(forced)
    summary = {k: (f"{a}/{total}", round(kl / total, 5)) for k, (a, kl) in stats.items()}
    print(summary)
    # The served default agrees with float32 at least as often as transformers' bf16 does.
    assert stats["default"][0] >= stats["hf_bf16"][0], summary
    # Our bf16 is closer to float32 than transformers' bf16 (mean KL over the same positions;
    # measured 0.0005 vs 0.0012 -- top-token counts are decided by near-ties, see docs/engine.md).
    assert stats["ours_bf16"][1] <= stats["hf_bf16"][1], summary


def test_bf16_greedy_france_says_paris(smollm2_bf16):
    tok = smollm2_bf16.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = smollm2_bf16
    engine.begin(0, GREEDY)
    out = [engine.read(0, ids, sample=True)]
    while len(out) < 20 and out[-1] not in engine.eos_token_ids:
        out += engine.decode([0], [out[-1]])
    answer = tok.decode(out)
    assert "Paris" in answer, answer
