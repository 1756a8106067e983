"""Random-weight GGUFs of the newer families at bench/models_speed.py's shapes (a real
checkpoint's layers, fewer of them), in Q8_0, carrying the default model's tokenizer and chat
template (vocabulary 49 152), so that Strata and llama-server serve the same file through HTTP:

    .venv/bin/python -m bench.family_gguf --family qwen3moe     # prints the path
    .venv/bin/python -m bench.family_gguf --family qwen3moe --mix Q4_K_M
    LLAMA_SERVER=... .venv/bin/python -m bench.side_by_side --model "$(...)" --temperature 1 ...

Built from transformers' own config and model classes (random init, norms and routers jittered
so they count) and written by tests/helpers/family_gguf.py under llama.cpp's tensor names and
keys; Q8_0 as `llama-quantize` would leave it (routers float32). Speed only: the text means
nothing, so sample (temperature 1), or prompt lookup guesses it. Written once under the
temporary folder and reused."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from engine.files import default_model_path
from tests.helpers.family_gguf import gemma3_gguf, moe_gguf, qwen3next_gguf, with_norms_and_routers_counting
from tests.helpers.quant_models import mix

VOCAB = 49152  # SmolLM2's, so its tokenizer fits
FAMILIES = ("qwen3moe", "gemma3", "qwen3next")


def hf_model(family: str):
    """models_speed's shapes: Qwen3-30B-A3B's layer (32 of its 128 experts, 4 of its 48 layers);
    Gemma-3-1B's (6 of its 26 layers, the 5:1 sliding pattern); Qwen3-Next-80B-A3B's (32 of its
    512 experts, 4 layers in its 3:1 DeltaNet:attention pattern)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=32,
                                num_experts_per_tok=8, norm_topk_prob=True, **common)
        model = tf.Qwen3MoeForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(hidden_size=1152, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=256, intermediate_size=6912, sliding_window=512, query_pre_attn_scalar=256,
                                  **(common | {"tie_word_embeddings": True}))
        model = tf.Gemma3ForCausalLM
    elif family == "qwen3next":
        cfg = tf.Qwen3NextConfig(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                                 head_dim=256, intermediate_size=5120, moe_intermediate_size=512,
                                 shared_expert_intermediate_size=512, num_experts=32, num_experts_per_tok=10,
                                 norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"], **common)
        model = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    return with_norms_and_routers_counting(model(cfg))


def family_gguf(family: str, mix_name: str = "Q8_0") -> Path:
    """mix_name: Q8_0 (every matrix), or for qwen3moe a llama.cpp mix (tests/helpers/quant_models.py
    `mix`: Q4_K_M's experts Q4_K, its down experts Q6_K in the `more_bits` layers), its K-quant
    blocks random (gguf-py does not quantize them)."""
    path = Path(tempfile.gettempdir()) / "strata-bench-cache" / f"random-{family}-{mix_name}-tokenizer.gguf"
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        started = time.perf_counter()
        tmp = path.with_suffix(".tmp")
        model = hf_model(family)
        if mix_name != "Q8_0":
            if family != "qwen3moe":
                raise SystemExit(f"--mix {mix_name}: only qwen3moe's writer takes a mix")
            moe_gguf(tmp, model, Q.F32, tokenizer_of=default_model_path(),
                     pick=mix(mix_name, model.config.num_hidden_layers))
        else:
            write = {"qwen3moe": moe_gguf, "gemma3": gemma3_gguf, "qwen3next": qwen3next_gguf}[family]
            write(tmp, model, Q.Q8_0, tokenizer_of=default_model_path())
        tmp.replace(path)
        print(f"wrote {path} in {time.perf_counter() - started:.0f}s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3moe", choices=FAMILIES)
    parser.add_argument("--mix", default="Q8_0", help="Q8_0, or for qwen3moe a llama.cpp mix: Q4_K_M, Q5_K_M, ...")
    args = parser.parse_args()
    print(family_gguf(args.family, args.mix))


if __name__ == "__main__":
    main()
