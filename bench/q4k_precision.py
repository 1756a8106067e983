"""Q4_K on `strata_quants::mm` (int8 x per 32, the default) against torch's int4 kernel (bf16 x, bf16
scales, `QuantLinear(int4=True)`): relative error of one product against float64 of the exact weights, on
SmolLM2-135M's own layer inputs (float32 engine, eager) and on normal x; random Q4_K blocks (gguf-py
cannot quantize Q4_K). docs/bench-log.md, 2026-12-06.

    PYTHONPATH=. .venv/bin/python -m bench.q4k_precision
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from engine.load import load_engine
from engine.weights import DenseLinear, Int4Linear
from engine.quants import blocks as quants
from tests.helpers.quant_models import random_blocks
from engine.protocol import SamplingParams


def main() -> None:

    torch.manual_seed(0)
    eng = load_engine(None, dtype="float32", compile=False, num_slots=1, prompt_lookup=False)
    caught = {"attn": [], "down": []}
    for i, block in enumerate(eng.model.layers):
        for name, mod in (("attn", block.mixer.wqkv), ("down", block.ffn.w_down)):
            assert isinstance(mod, DenseLinear), type(mod)
            orig = mod.forward
            def hook(x, orig=orig, name=name):
                caught[name].append(x.detach().reshape(-1, x.shape[-1]).float().clone())
                return orig(x)
            mod.forward = hook
    ids = eng.tokenizer.encode("Write a short poem about the sea, then explain in two sentences why the sky is blue.")
    eng.begin(0, SamplingParams(temperature=0.0))
    tok = eng.read(0, ids, sample=True)
    for _ in range(8):
        tok = eng.decode([0], [tok])[0][-1]
    rng = np.random.default_rng(0)
    def errors(x, cols):
        raw = torch.from_numpy(random_blocks(Q.Q4_K, 256, cols, rng))
        w = quants.dequantize(quants.QuantBlocks(raw, Q.Q4_K, cols)).double()
        exact = x.double() @ w.T
        mm = quants.ops().mm(x, raw, int(Q.Q4_K), quants.table(Q.Q4_K), True, False).double()
        i4 = Int4Linear(quants.unpack_q4_k(quants.QuantBlocks(raw, Q.Q4_K, cols)))(x.to(torch.bfloat16)).double()
        rel = lambda y: ((y - exact).norm(dim=1) / exact.norm(dim=1))
        return rel(mm), rel(i4)
    for name, xs in caught.items():
        x = torch.cat(xs)
        cols = x.shape[1] // 256 * 256
        x = x[:, :cols].contiguous()
        a, b = errors(x, cols)
        print(f"{name:5} inputs ({x.shape[0]} rows x {cols}): median rel error mm int8 {a.median():.2e} (p90 {a.quantile(.9):.2e}), int4 bf16 {b.median():.2e} (p90 {b.quantile(.9):.2e})")
    x = torch.randn(64, 2048)
    a, b = errors(x, 2048)
    print(f"normal x (64 x 2048): median rel error mm int8 {a.median():.2e} (p90 {a.quantile(.9):.2e}), int4 bf16 {b.median():.2e} (p90 {b.quantile(.9):.2e})")


if __name__ == "__main__":
    main()
