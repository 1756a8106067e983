"""GGUF files written here with gguf.GGUFWriter, read back through engine.gguf_loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.gguf_loader import GGUFModel, unpermute_rope_rows
from engine.model import Transformer
from engine.weights import can_prepack
from tests.engine.conftest import q4_forms
from tests.engine.conftest import prefill_logits
from tests.helpers.gguf_llama import N_HEADS, N_KV, gguf_tensors, write_gguf

@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float().eval()


def test_f32_file_gives_hf_weights_and_logits(hf_model, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, gguf_tensors(hf_model), lambda name, w: Q.F32)
    loaded = GGUFModel(path)
    weights = loaded.weights()
    sd = hf_model.state_dict()
    # Exact: the loader must undo the Q/K permutation and the reversed dims with no loss.
    torch.testing.assert_close(weights["layers.1.q"], sd["model.layers.1.self_attn.q_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(weights["layers.0.k"], sd["model.layers.0.self_attn.k_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(weights["layers.0.down"], sd["model.layers.0.mlp.down_proj.weight"], atol=0, rtol=0)
    assert not loaded.config.tie_embeddings and loaded.config.n_kv_heads == N_KV

    model = Transformer.build(loaded.config, loaded, dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(1, 64)
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    ours = prefill_logits(model, 0, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)


QTYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


def test_quantized_file_matches_gguf_dequantize(hf_model, tmp_path):
    path = tmp_path / "tiny-mixed.gguf"
    tensors = gguf_tensors(hf_model)
    matrices = [n for n, w in tensors.items() if w.ndim == 2]
    assign = {n: QTYPES[i % len(QTYPES)] for i, n in enumerate(matrices)}
    write_gguf(path, tensors, lambda name, w: assign.get(name, Q.F32))

    reader = GGUFReader(path)
    seen = {Q(t.tensor_type).name for t in reader.tensors}
    assert {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"} <= seen
    loaded = GGUFModel(path)
    weights = loaded.weights()
    for t in reader.tensors:
        expected = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        layer, kind = t.name.split(".")[1], t.name.split(".")[-2]
        if kind == "attn_q":
            expected = unpermute_rope_rows(expected, N_HEADS)
        elif kind == "attn_k":
            expected = unpermute_rope_rows(expected, N_KV)
        ours = {
            "token_embd": "embed", "output_norm": "norm", "output": "output",
        }.get(t.name.split(".")[0]) or f"layers.{layer}." + {
            "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
            "ffn_up": "up", "ffn_down": "down", "attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
        }[kind]
        np.testing.assert_array_equal(weights[ours].numpy(), expected.astype(np.float32), err_msg=t.name)
        # and the quantization itself is close to the original weights
        np.testing.assert_allclose(weights[ours].numpy(), hf_model.state_dict()[_hf_name(ours)].numpy(), atol=0.05)

    # The embedding rows and the head's exact rows come from the file's blocks (QuantRows):
    # the same values as the dequantized matrix, for every type here.
    for name in ("embed", "output"):
        ids = torch.tensor([0, 5, 255, 5])
        torch.testing.assert_close(loaded.rows(name)(ids), weights[name][ids], atol=0, rtol=0)
    for dtype in (torch.float32, torch.bfloat16):  # bf16: int4 where Q4_0/Q4_1, packed bf16 elsewhere
        model = Transformer.build(loaded.config, loaded, dtype=dtype, device=torch.device("cpu"), int4=True)
        model.allocate_cache(1, 64)
        logits = prefill_logits(model, 0, list(range(20)))
        assert logits.shape == (256,) and torch.isfinite(logits).all()
        if dtype == torch.float32:
            reference = logits
        else:
            # AVX2 alone: oneDNN cannot pack; the Q4 blocks' form: tests/engine/conftest.py q4_forms
            other, q4 = "bf16-packed" if can_prepack() else "bfloat16-dense", next(iter(q4_forms(1, prompt_copy=False)))
            assert model.forms.get(q4, 0) > 0 and model.forms.get(other, 0) > 0, model.forms
            assert float((logits - reference).abs().max()) < 0.05 * float(reference.abs().max())


def _hf_name(ours: str) -> str:
    top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight"}
    if ours in top:
        return top[ours]
    _, i, kind = ours.split(".")
    sub = {
        "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }[kind]
    return f"model.layers.{i}.{sub}.weight"


def test_the_file_view_gives_what_gguf_reader_reads(hf_model, tmp_path, monkeypatch):
    # engine.gguf_file reads the header with transformers' struct reader: gguf's reference
    # GGUFReader must see the same metadata, shapes (torch order) and tensor bytes, on a file with
    # every value kind the writer emits and a block type transformers cannot dequantize (Q5_0).
    import engine.gguf_file
    from engine.gguf_file import GGUFFile

    path = tmp_path / "tiny-mixed.gguf"
    def metadata(writer):
        writer.add_token_list(["<s>", "hello", "wörld", ""] * 3)
        writer.add_token_scores([0.5, -1.0, 2.0, 0.0] * 3)
        writer.add_token_types([1, 2, 3, 1] * 3)
        writer.add_add_bos_token(True)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{{ messages }}")
        writer.add_array("test.floats", [0.25, -1.5])
        writer.add_float32("test.float", 0.125)
        writer.add_int64("test.big", -(2**40))

    def qtype(name, w):
        return Q.F32 if w.ndim < 2 else Q.Q5_0 if name.endswith("ffn_up.weight") else Q.Q4_1

    write_gguf(path, gguf_tensors(hf_model), qtype, metadata)
    reader = GGUFReader(path)
    # read straight, then through the index it writes to the cache folder, then from that index alone
    # (the header must not be read again then, unless a large field such as the vocabulary is asked for)
    straight, indexing = GGUFFile(path), GGUFFile(path, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("gguf-index-*.json"))) == 1
    opened = []
    for name in ("_index", "_large_field"):
        real = getattr(engine.gguf_file, name)
        monkeypatch.setattr(engine.gguf_file, name, lambda *args, real=real, name=name: opened.append(name) or real(*args))
    indexed = GGUFFile(path, tmp_path / "cache")
    assert opened == []
    assert {t.tensor_type for t in reader.tensors} >= {Q.Q5_0, Q.Q4_1, Q.F32}
    for ours in (straight, indexing, indexed):
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = ours.fields[key]
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
        assert [t.name for t in reader.tensors] == list(ours.tensors)
        for t in reader.tensors:
            mine = ours.tensors[t.name]
            assert mine.shape == tuple(reversed([int(d) for d in t.shape])) and mine.qtype == Q(t.tensor_type)
            np.testing.assert_array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(-1))
    assert opened == []
    # a large field (the vocabulary of a real file) is left out of the index and read when asked for
    monkeypatch.setattr(engine.gguf_file, "LARGE", 5)
    GGUFFile(path, tmp_path / "cache-large")
    lean = GGUFFile(path, tmp_path / "cache-large")
    assert opened == ["_index"] and "tokenizer.ggml.tokens" in lean.fields
    assert lean.fields["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    assert opened == ["_index", "_large_field"]
