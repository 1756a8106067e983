"""engine/quants: GGUF blocks kept as they are (Q8_0, Q5_0/Q5_1, K-quants, IQ4_XS, IQ3_S).

Unpacking equals gguf's own dequantize bit for bit (random valid blocks; gguf's quantize where
gguf-py has one); the decode product is the exact weights times the activations quantized to
int8 per 32 (llama.cpp's arithmetic) or, for the head, float32 ones, within float32 rounding; the
prompt product the bf16 product of their bf16 rounding, `prompt_mm`'s float32 one, or on x86
without AMX the decode step's int8 arithmetic (`prompt_mm_int8`, AVX2 and VNNI builds alike), the
last two each output one chain of sums (prompt tokens, any number); tiny models written by gguf's writer in the mixes
people download hold at most 1.15x the file's tensor bytes and give the dequantized-bf16 model's
greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.gguf_loader import GGUFModel
from engine.model import Transformer
from engine.quants import blocks as quants
from engine.quants.build import compiler
from engine.weights import DictSource, dequantize_int4, int4_available
from tests.engine.conftest import decode_logits, prefill_logits
from tests.helpers.quant_models import GGUF_QUANTIZES, random_blocks, write_mix

# Skipped only without a compiler: with one, a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/quants' kernels cannot be built")

NEW_TYPES = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S]


@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_unpacking_equals_gguf_dequantize_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    samples = [random_blocks(qtype, 9, 3 * block, rng)]
    raw = samples[0].copy()  # every byte random, scales included (NaN, inf, subnormal halves too)
    samples.append(rng.integers(0, 256, raw.shape, dtype=np.uint8))
    if qtype in GGUF_QUANTIZES:
        samples.append(gguf_quantize(rng.normal(0, 0.05, (9, 3 * block)).astype(np.float32), qtype))
    for raw in samples:
        with np.errstate(all="ignore"):  # NaN and inf scales in the all-random bytes
            expected = gguf_dequantize(raw, qtype)
        got = quants.dequantize(quants.QuantBlocks(torch.from_numpy(raw.copy()), qtype, 3 * block)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=qtype.name)
        # the baseline build too (dequant.cpp row by row; the AVX2 one unpacks from the codes)
        portable = quants.ops().dequantize(torch.from_numpy(raw.copy()), int(qtype), 3 * block, quants.table(qtype), True)
        np.testing.assert_array_equal(portable.numpy().view(np.uint32), expected.view(np.uint32), err_msg=qtype.name)
        # bf16 (a prompt's slabs): torch's own rounding of those floats, NaN and inf included, both builds
        rounded = torch.from_numpy(expected).to(torch.bfloat16).view(torch.int16)
        for build in (False, True):
            bf16 = quants.ops().dequantize(torch.from_numpy(raw.copy()), int(qtype), 3 * block, quants.table(qtype),
                                           build, True)
            assert bf16.dtype == torch.bfloat16
            assert torch.equal(bf16.view(torch.int16), rounded), (qtype.name, build)


def random_matrix(qtype: Q, seed: int, cols_256: int) -> tuple[torch.Tensor, torch.Tensor]:
    """37 rows of random blocks (the 32-weight types 544 wide, 17 blocks; the others
    `cols_256`) and gguf's own float64 values of them."""
    rng = np.random.default_rng(seed)
    cols = 544 if GGML_QUANT_SIZES[qtype][0] == 32 else cols_256
    raw = torch.from_numpy(random_blocks(qtype, 37, cols, rng))
    return raw, torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).double()


def assert_rows_alone(product, x: torch.Tensor, y: torch.Tensor, label: object) -> None:  # noqa: ANN001
    """Every row of `product(x)` (= y) the same bits alone, in slices of the call that cut its
    tiles anywhere, and beside rows it was never with."""
    for lo, hi in ((0, 1), (5, 6), (3, 10), (7, len(x)), (0, 13)):
        assert torch.equal(product(x[lo:hi]), y[lo:hi]), (label, lo, hi)
    assert torch.equal(product(torch.cat([x[11:12], torch.randn(8, x.shape[1]), x[2:3]]))[[0, 9]], y[[11, 2]]), label


@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_prompt_product_is_one_chain_per_output_whatever_the_call(qtype):
    """`prompt_mm` (the prompt's float32 product, AVX2 alone): within float32 rounding of the
    exact weights' product, and every row's result the same bits alone, in any call and beside any
    other rows: edge tiles (rows not a multiple of 6, outputs not of 16) and a width past one
    256-weight panel (the 32-weight types at 544, 17 blocks) included. Both builds."""
    raw, exact = random_matrix(qtype, int(qtype) + 7, 512)
    torch.manual_seed(int(qtype))
    x = torch.randn(20, exact.shape[1])
    reference = x.double() @ exact.T
    for portable in (False, True):
        def product(x: torch.Tensor) -> torch.Tensor:
            return quants.ops().prompt_mm(x, raw, int(qtype), quants.table(qtype), portable)

        y = product(x)
        assert y.shape == (20, 37) and y.dtype == torch.float32
        assert float((y.double() - reference).norm() / reference.norm()) <= 1e-6, (qtype.name, portable)
        assert_rows_alone(product, x, y, (qtype.name, portable))


INT8_PROMPT = quants.available() and quants.int8_prompt_here()


@pytest.mark.skipif(not INT8_PROMPT, reason="prompt_mm_int8 is the AVX2 and VNNI builds' where the CPU has no AMX")
@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_integer_prompt_product_is_the_decode_steps_arithmetic_in_one_chain(qtype):
    """`prompt_mm_int8` (the prompt's product on x86 without AMX): the exact weights times
    x quantized per 32 as `mm` quantizes it (Q4_0, Q4_1: to 16 bits, as their repacked decode
    products; with AVX-512 BF16, `bf16_prompt_here`, x rounded to bf16 instead, Q4_1's codes
    centred and the rest on float32 x: prompt_bf16.cpp), within float32 rounding (<= 1e-5 of float64 on those
    activations; `mm` with int8 activations within 1e-6), every row the same bits alone, beside
    any rows and at any position in a tile (edge tiles: rows not a multiple of 4, outputs not of
    16; a width of several 256-weight panels, the 32-weight types at 544). Every byte random
    (NaN / inf scales) gives NaN where `mm` does, not a crash."""
    raw, exact = random_matrix(qtype, int(qtype) + 11, 768)
    torch.manual_seed(int(qtype))
    x = torch.randn(23, exact.shape[1]) * torch.rand(23, 1)
    x[2, :64] = 0  # chunks of zeros (their int8 scale 0)

    def product(x: torch.Tensor, raw: torch.Tensor = raw) -> torch.Tensor:
        return quants.ops().prompt_mm_int8(x, raw, int(qtype), quants.table(qtype))

    y = product(x)
    assert y.shape == (23, 37) and y.dtype == torch.float32
    wide = quants.takes_x16(qtype)  # 16-bit activations (Q4_1), as its (repacked) decode products
    bf16 = wide and quants.bf16_prompt_here()
    if bf16:
        part = q4_float_part(raw, qtype)
        reference = x.to(torch.bfloat16).double() @ (exact - part).T + x.double() @ part.T
    else:
        reference = int8_per_32(x, 32767.0 if wide else 127.0) @ exact.T
    assert float((y.double() - reference).norm() / reference.norm()) <= (1e-6 if bf16 else 1e-5), qtype.name
    if wide and not bf16:  # the repacked decode form of the first 32 rows (bf16: another rounding of x)
        decode = quants.ops().mm(x, quants.ops().repack(raw[:32].contiguous(), int(qtype), exact.shape[1]),
                                 quants.EIGHT_ROWS[qtype], quants.table(qtype), True).double()
        assert float((y[:, :32].double() - decode).norm() / decode.norm()) <= 1e-6, qtype.name
    elif not wide:
        decode = quants.ops().mm(x, raw, int(qtype), quants.table(qtype), True).double()
        assert float((y.double() - decode).norm() / decode.norm()) <= 1e-6, qtype.name
    assert_rows_alone(product, x, y, qtype.name)
    broken = torch.from_numpy(np.random.default_rng(int(qtype)).integers(0, 256, raw.shape, dtype=np.uint8))
    with np.errstate(all="ignore"):
        nan = ~torch.isfinite(quants.ops().mm(x[:4], broken, int(qtype), quants.table(qtype), True))
    assert torch.equal(~torch.isfinite(product(x[:4], broken)), nan), qtype.name


# Each type's blocks with every code at its largest magnitude (prompt_int8.cpp's `top`; Q8_0 -128):
# (type, the bytes of a block set to 0xFF, or to 0x80 for Q8_0), by gguf's block layouts
CODE_BYTES = {Q.Q4_0: slice(2, 18), Q.Q4_1: slice(4, 20), Q.Q5_0: slice(2, 22), Q.Q5_1: slice(4, 24),
              Q.Q8_0: slice(2, 34), Q.Q4_K: slice(16, 144), Q.Q5_K: slice(16, 176), Q.Q6_K: slice(0, 192)}


@pytest.mark.skipif(not INT8_PROMPT, reason="prompt_mm_int8 is the AVX2 and VNNI builds' where the CPU has no AMX")
@pytest.mark.parametrize("qtype", sorted(CODE_BYTES), ids=lambda q: q.name)
def test_integer_prompt_sums_hold_the_largest_codes(qtype):
    """The AVX2 build sums `maddubs`' int16 pairs over several quads before widening them: with
    every code at its type's largest value (Q8_0's -128) and every activation at +127 (x all ones)
    or -127 (in turns), the sums are still exact (a quad too many saturates at 2^15 - 1), the
    file's blocks and the repacked ones alike."""
    block, size = GGML_QUANT_SIZES[qtype]
    cols = 512
    raw = random_blocks(qtype, 16, cols, np.random.default_rng(int(qtype))).reshape(16, -1, size)
    raw[:, :, CODE_BYTES[qtype]] = 0x80 if qtype == Q.Q8_0 else 0xFF
    raw = torch.from_numpy(raw.reshape(16, -1).copy())
    exact = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).double()
    x = torch.ones(5, cols)
    x[1] = -1
    x[3, ::2] = -1  # pairs of opposite signs
    reference = int8_per_32(x, 32767.0 if quants.takes_x16(qtype) else 127.0) @ exact.T
    held = [raw]
    if qtype in quants.EIGHT_ROWS:
        held.append(quants.ops().repack(raw, int(qtype), cols))
    for blocks, code in zip(held, (int(qtype), quants.EIGHT_ROWS.get(qtype))):
        y = quants.ops().prompt_mm_int8(x, blocks, code, quants.table(qtype)).double()
        assert float((y - reference).norm() / reference.norm()) <= 1e-6, (qtype.name, code)


def q4_float_part(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The part of each weight prompt_bf16.cpp multiplies by float32 x, float64 [N, K]: Q4_1's
    m + 8 d (its codes go centred, u - 8, on bf16 x)."""
    b = raw.numpy().reshape(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1])
    half = lambda at: b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    return torch.from_numpy(np.repeat(half(2) + 8 * half(0), 32, axis=-1))


@pytest.mark.skipif(not (quants.available() and quants.bf16_prompt_here()),
                    reason="elsewhere the 16-bit integer prompt product is this process's own (above)")
def test_q4_prompts_in_16_bit_integers_where_told(tmp_path):
    """Where prompt_bf16.cpp reads Q4_1 prompts, a process told to keep the VNNI build's
    16-bit integers (STRATA_QUANTS_ISA=vnni, as on a CPU without AVX-512 BF16) multiplies them as
    their decode products quantize x (Q4_0's in int8, as its own) (the file's blocks and the repacked ones alike, within float32
    rounding of float64 on those activations)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = []
    for qtype in (Q.Q4_0, Q.Q4_1):
        raw, exact = random_matrix(qtype, int(qtype) + 3, 768)
        x = torch.randn(13, exact.shape[1]) * torch.rand(13, 1)
        cases += [(int(qtype), raw, x), (quants.EIGHT_ROWS[qtype], quants.ops().repack(raw[:32].contiguous(), int(qtype),
                                                                                       exact.shape[1]), x)]
    torch.save(cases, tmp_path / "cases.pt")
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, torch; from engine.quants import blocks as quants; cases = torch.load(sys.argv[1]); "
            "torch.save([quants.bf16_prompt_here(), *[quants.ops().prompt_mm_int8(x, raw, q, "
            "quants.table(q % 1000)) for q, raw, x in cases]], sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "STRATA_QUANTS_ISA": "vnni", "PYTHONPATH": str(root)}, cwd=root, check=True,
                   timeout=300)
    bf16_there, *ys = torch.load(tmp_path / "out.pt")
    assert not bf16_there
    for (q, raw, x), y in zip(cases, ys):
        qtype = Q(q % 1000)
        exact = torch.from_numpy(gguf_dequantize(quants.ops().restore(raw, q, x.shape[1]).numpy() if q > 1000
                                                 else raw.numpy(), qtype)).double()
        reference = int8_per_32(x, 32767.0 if quants.takes_x16(qtype) else 127.0) @ exact.T
        assert float((y.double() - reference).norm() / reference.norm()) <= 1e-5, q


def test_q4_k_repacked_as_int4_groups_is_gguf_dequantize_bit_for_bit():
    rng = np.random.default_rng(3)
    for raw in (random_blocks(Q.Q4_K, 6, 512, rng), rng.integers(0, 256, (6, 2 * 144), dtype=np.uint8)):
        with np.errstate(all="ignore"):
            expected = gguf_dequantize(raw, Q.Q4_K)
        got = dequantize_int4(quants.unpack_q4_k(quants.QuantBlocks(torch.from_numpy(raw.copy()), Q.Q4_K, 512))).numpy()
        nan = np.isnan(expected)  # a NaN scale's payload and sign are not a value
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.skipif(not int4_available(), reason="torch's CPU int4 kernel is missing")
def test_q4_k_on_torchs_int4_kernel_is_within_bf16_of_float32():
    """int4 (`QuantLinear(int4=True)`; the loader's Q4_K runs on `mm`): bf16 activations and each group's
    scale and offset in bf16 (as Q4_0/Q4_1 files): relative error of the output <= 1e-2 (~3e-3
    measured), decode and prefill alike."""
    rng = np.random.default_rng(4)
    raw = random_blocks(Q.Q4_K, 48, 512, rng)
    exact = torch.from_numpy(gguf_dequantize(raw, Q.Q4_K)).double()
    blocks = quants.QuantBlocks(torch.from_numpy(raw), Q.Q4_K, 512)
    assert len(quants.QuantLinear([blocks]).int4) == 0  # the default: mm
    linear = quants.QuantLinear([blocks], int4=True)
    assert len(linear.int4) == 1 and quants.held_bytes(linear) <= 1.12 * raw.nbytes
    for tokens in (1, 20):
        x = torch.randn(2, tokens, 512)
        reference = x.double() @ exact.T
        assert float((linear(x).double() - reference).norm() / reference.norm()) <= 1e-2


def int8_per_32(x: torch.Tensor, top: float = 127.0) -> torch.Tensor:
    """x as `strata_quants::mm` takes it with int8_x: per 32, xq = round(x * (127 / max|x|)) to
    nearest even, in float32, times max|x| / 127; float64 out. top=32767: the 16-bit activations
    of the repacked Q4_1 dots."""
    chunks = x.reshape(x.shape[0], -1, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    # 127 / max|x| divided in float32 as the kernel does (torch's `127.0 / amax` is
    # 127 * (1 / amax), an ulp off at times: then an xq rounds the other way, ~1e-4 of the output)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    return (torch.round(chunks * inv).double() * (amax / top).double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", sorted(quants.TYPES), ids=lambda q: q.name)
def test_mm_is_the_exact_weights_times_the_activations(qtype):
    """`strata_quants::mm` on random blocks against gguf's dequantize and a float64 matmul, in
    every form (the AVX2 build this CPU picks and the portable one, int8 and float32 activations):
    - float32 activations (the head's): relative error of the output <= 1e-5 (~1e-7 measured);
    - int8 activations: against the activations quantized per 32 as the kernel does, <= 1e-5 (the
      integer sums exact, float32 roundings only); against x itself <= 1.5e-2 (~5e-3 measured on
      normal x: llama.cpp's error);
    - the two builds agree within float32 rounding (the same integers summed), and a row's result
      is the same alone and in a batch of 7 (bit for bit: the kernels take rows four at a time,
      then the rest)."""
    rng = np.random.default_rng(int(qtype) + 100)
    rows, cols = 48, 1024
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, rng))
    exact = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).double()
    torch.manual_seed(int(qtype))
    x = torch.randn(7, cols) * torch.rand(7, 1)
    x[1, :64] = 0  # a chunk of zeros (its int8 scale 0)
    reference, reference_int8 = x.double() @ exact.T, int8_per_32(x) @ exact.T

    def error(y: torch.Tensor, ref: torch.Tensor) -> float:
        return float((y.double() - ref).norm() / ref.norm())

    results = {}
    for int8_x in (False, True):
        for portable in (False, True):
            y = quants.ops().mm(x, raw, int(qtype), quants.table(qtype), int8_x, portable)
            assert y.shape == (7, rows) and y.dtype == torch.float32
            if int8_x:
                assert error(y, reference_int8) <= 1e-5, (qtype.name, portable)
                assert error(y, reference) <= 1.5e-2, (qtype.name, portable)
            else:
                assert error(y, reference) <= 1e-5, (qtype.name, portable)
            for i in range(7):
                alone = quants.ops().mm(x[i:i + 1], raw, int(qtype), quants.table(qtype), int8_x, portable)
                assert torch.equal(alone, y[i:i + 1]), (qtype.name, int8_x, portable, i)
            results[int8_x, portable] = y
        assert error(results[int8_x, True], results[int8_x, False].double()) <= 1e-6


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_XS, Q.IQ3_S],
                         ids=lambda q: q.name)
def test_fused_dots_are_the_codes_paths_sums(qtype):
    """Every type with int8 activations on AVX2 takes its dots straight from the packed bytes
    (kernel.cpp's fused dots), not through the row of codes the portable build unpacks to (the
    codebook types' codes looked up per chunk in registers): at every batch size of 1 to 10 (eight rows at
    a time, then the rest in one pass) and on a row of one super-block or several, the same
    integers summed (within float32 rounding of the portable codes path and of float64 on the
    quantized activations), each row alone the same bits. Random blocks: every bit of the codes,
    the high bits, the scales and minimums random."""
    rng = np.random.default_rng(int(qtype) + 200)
    torch.manual_seed(int(qtype) + 200)
    for cols in (256, 1536):
        raw = torch.from_numpy(random_blocks(qtype, 24, cols, rng))
        exact = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).double()
        for batch in range(1, 11):
            x = torch.randn(batch, cols) * torch.rand(batch, 1) * 4
            x[0, 32:64] = 0  # a chunk of zeros (its int8 scale 0)
            fused = quants.ops().mm(x, raw, int(qtype), quants.table(qtype), True, False)
            codes = quants.ops().mm(x, raw, int(qtype), quants.table(qtype), True, True)
            reference = int8_per_32(x) @ exact.T
            for y, bound in ((fused, 1e-6), (codes, 1e-6)):
                assert float((y.double() - reference).norm() / reference.norm()) <= bound, (qtype.name, cols, batch)
            assert float((fused - codes).double().norm() / reference.norm()) <= 1e-6, (qtype.name, cols, batch)
            for i in range(batch):
                alone = quants.ops().mm(x[i:i + 1], raw, int(qtype), quants.table(qtype), True, False)
                assert torch.equal(alone, fused[i:i + 1]), (qtype.name, cols, batch, i)


@pytest.mark.parametrize("qtype", sorted(quants.EIGHT_ROWS), ids=lambda q: q.name)
def test_repacked_eight_rows_at_a_time_keeps_every_bit_and_the_product(qtype):
    """Q4_0_R8 .. Q6_K_R8 (repack.cpp): the blocks moved so that the decode dots hold one weight
    row per lane. Restoring gives the file's bytes bit for bit and dequantizing gives gguf's
    values; `mm` with int8 activations runs the type's eight-row dot: the exact weights times the
    int8 activations (Q4_1: 16-bit ones; float64 on the quantized activations, <= 1e-6), each row alone the same
    bits, the same bits on one thread as on two (a group of eight cut by the threads' split is
    computed whole); every product that reads rows one at a time (float32 activations, the
    portable build, the prompt's) reads them restored, or straight where its panels' order is
    theirs (Q4_0's int8 prompt): the file's blocks' bits."""
    ops, R8, table = quants.ops(), quants.EIGHT_ROWS[qtype], quants.table(qtype)
    rng = np.random.default_rng(11 + int(qtype))
    torch.manual_seed(11)
    small = GGML_QUANT_SIZES[qtype][0] == 32  # a 32-weight type: also a width past whole 256-weight panels
    for rows, cols in ((8, 256), (40, 1536), *([(24, 544)] if small else [])):
        raw = torch.from_numpy(random_blocks(qtype, rows, cols, rng))
        r8 = ops.repack(raw, int(qtype), cols)
        row_bytes = {Q.Q4_K: 148, Q.Q5_K: 180}.get(qtype, raw.shape[1] * 256 // cols)  # the file's 144, 176; the rest as theirs
        assert r8.shape == (rows, cols * row_bytes // 256) and not torch.equal(r8[:, :raw.shape[1]], raw)
        assert torch.equal(ops.restore(r8, R8, cols), raw)
        dense = quants.dequantize(quants.QuantBlocks(r8, qtype, cols, True))
        assert torch.equal(dense.view(torch.int32), torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).view(torch.int32))
        exact = dense.double()
        for batch in (1, 2, 3, 4, 5, 9):
            x = torch.randn(batch, cols) * torch.rand(batch, 1) * 4
            x[0, 32:64] = 0  # a chunk of zeros (its int8 scale 0)
            y = ops.mm(x, r8, R8, table, True, False)
            reference = int8_per_32(x, 32767.0 if quants.takes_x16(qtype) else 127.0) @ exact.T
            assert float((y.double() - reference).norm() / reference.norm()) <= 1e-6, (rows, cols, batch)
            for i in range(batch):
                assert torch.equal(ops.mm(x[i:i + 1], r8, R8, table, True, False), y[i:i + 1]), (rows, batch, i)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert torch.equal(ops.mm(x, r8, R8, table, True, False), y)
            finally:
                torch.set_num_threads(threads)
            file = int(qtype)
            for int8_x, portable in ((False, False), (True, True)):
                assert torch.equal(ops.mm(x, r8, R8, table, int8_x, portable), ops.mm(x, raw, file, table, int8_x, portable))
            assert torch.equal(ops.prompt_mm(x, r8, R8, table), ops.prompt_mm(x, raw, file, table))
            if quants.int8_prompt_here():
                assert torch.equal(ops.prompt_mm_int8(x, r8, R8, table), ops.prompt_mm_int8(x, raw, file, table))
    with pytest.raises(RuntimeError, match="groups of 8"):
        ops.repack(torch.from_numpy(random_blocks(qtype, 12, 256, rng)), int(qtype), 256)


def test_quant_linear_repacks_for_the_decode_step_alone():
    """QuantLinear holds a K-quant part of whole groups of eight rows repacked (Q4_K_R8,
    Q6_K_R8 here) where kernel.cpp's AVX2 builds run (`repack_here`), with int8 activations only (not
    the head's float32 ones) and not with `repack=False`; its decode form is the file's blocks'
    product within float32 rounding, its prompt form the same bits (the panels restored as they
    are unpacked), and it holds 148 bytes a Q4_K row's 256 weights against the file's 144."""
    rng = np.random.default_rng(12)
    cols = 512
    parts = [quants.QuantBlocks(torch.from_numpy(random_blocks(q, rows, cols, rng)), q, cols)
             for q, rows in ((Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q4_K, 12))]
    bias = torch.randn(76)
    linear, plain = quants.QuantLinear(parts, bias), quants.QuantLinear(parts, bias, repack=False)
    head = quants.QuantLinear(parts, bias, slabs=False, int8_x=False)
    here = quants.repack_here()
    assert f"parts={['Q4_K_R8', 'Q6_K_R8', 'Q4_K'] if here else ['Q4_K', 'Q6_K', 'Q4_K']}" in linear.extra_repr()
    for module in (plain, head):
        assert "parts=['Q4_K', 'Q6_K', 'Q4_K']" in module.extra_repr()
    assert quants.held_bytes(linear) - quants.held_bytes(plain) == (48 * 2 * 4 if here else 0)
    x = torch.randn(3, 5, cols)
    y, expected = linear(x), plain(x)
    assert float((y - expected).norm() / expected.norm()) <= 1e-6
    assert torch.equal(linear.prompt_form(x), plain.prompt_form(x))
    assert torch.equal(quants.dequantize(linear.blocks(linear.parts[0])), quants.dequantize(parts[0]))


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_has_avx2() -> bool:
    """Whether ops.cpp picks kernel.cpp's AVX2 build here (x86 with AVX2, FMA and F16C)."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()


AVX2_PRODUCTS = """
import sys, torch
from engine.quants import blocks as quants
cases, prompts = torch.load(sys.argv[1])
torch.save([quants.ops().mm_build(), [quants.ops().mm(x, raw, qtype, quants.table(qtype), True, False)
                                      for qtype, raw, x in cases],
            [quants.ops().prompt_mm_int8(x, raw, qtype, quants.table(qtype % 1000)) for qtype, raw, x in prompts]],
           sys.argv[2])
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"} <= cpu_flags(),
                    reason="kernel.cpp's AVX-512 VNNI build runs only where the CPU has it")
def test_the_vnni_build_gives_the_avx2_builds_bits(tmp_path):
    """Where the CPU has AVX-512 VNNI, ops.cpp runs kernel.cpp's third build (the 32-weight types'
    four-byte sums in one instruction): every type's int8 product the same bits as the AVX2 build
    gives in a process told to keep it (STRATA_QUANTS_ISA=avx2), at 1 to 9 rows and an odd number
    of weight rows (each thread's share ends on a lone one); the repacked types' eight-row dots too;
    and the prompt's integer product (prompt_int8.cpp's `maddubs` sums against `vpdpbusd`), every
    type's on the file's blocks and the repacked ones (Q4_1's where its prompts are not bf16's)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    types = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S]
    cases = [(int(q), torch.from_numpy(random_blocks(q, 37, 512, rng)), torch.randn(rows, 512) * 3)
             for q in types for rows in (1, 4, 9)]
    for q, code in quants.EIGHT_ROWS.items():  # 40 rows: a group cut by the threads' split
        repacked = quants.ops().repack(torch.from_numpy(random_blocks(q, 40, 512, rng)), int(q), 512)
        cases += [(code, repacked, torch.randn(rows, 512) * 3) for rows in (1, 4, 9)]
    prompts = [(code, raw, torch.randn(13, 512) * 3) for code, raw, x in cases if x.shape[0] == 9
               and not (quants.takes_x16(Q(code % 1000)) and quants.bf16_prompt_here())]
    torch.save((cases, prompts), tmp_path / "cases.pt")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "STRATA_QUANTS_ISA": "avx2", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", AVX2_PRODUCTS, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env=env, cwd=root, check=True, timeout=300)
    their_build, avx2, avx2_prompts = torch.load(tmp_path / "avx2.pt")
    assert (quants.ops().mm_build(), their_build) == ("vnni", "avx2")
    for (qtype, raw, x), theirs in zip(cases, avx2):
        ours = quants.ops().mm(x, raw, qtype, quants.table(qtype), True, False)
        assert torch.equal(ours, theirs), (qtype, x.shape[0])
    assert len(prompts) >= 16
    for (qtype, raw, x), theirs in zip(prompts, avx2_prompts):
        assert torch.equal(quants.ops().prompt_mm_int8(x, raw, qtype, quants.table(qtype % 1000)), theirs), qtype


def codes_of(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kernel.cpp's codes of rows of Q8_0 / Q4_K / Q5_K / Q6_K blocks: q [N, K] (offsets
    subtracted), s [N, K/16] float32 (d * sc), m [N, K/32] float32 (-(dmin * mn))."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(raw.shape[0], -1, size)
    n, nb = b.shape[:2]
    half = lambda at: b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if qtype == Q.Q8_0:
        q = b[..., 2:].view(np.int8).astype(np.int32)
        s = np.repeat(half(0)[..., None], 2, -1)
        m = np.zeros((n, nb, 1), np.float32)
    elif qtype == Q.Q6_K:
        ql, qh = b[..., :128].astype(np.int32), b[..., 128:192].astype(np.int32)
        q = np.empty((n, nb, 256), np.int32)
        for h in range(2):
            for j in range(4):
                lo = (ql[..., 64 * h + 32 * (j % 2):][..., :32] >> (4 * (j // 2))) & 15
                q[..., 128 * h + 32 * j:][..., :32] = (lo | (((qh[..., 32 * h:32 * h + 32] >> (2 * j)) & 3) << 4)) - 32
        s = half(208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
        m = np.zeros((n, nb, 8), np.float32)
    else:  # Q4_K, Q5_K
        five = qtype == Q.Q5_K
        sc8 = b[..., 4:16].astype(np.int32)
        sc = np.concatenate([sc8[..., :4] & 63, (sc8[..., 8:] & 15) | ((sc8[..., :4] >> 6) << 4)], -1)
        mn = np.concatenate([sc8[..., 4:8] & 63, (sc8[..., 8:] >> 4) | ((sc8[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., 48 if five else 16:].astype(np.int32)
        q = np.empty((n, nb, 256), np.int32)
        for k in range(8):
            q[..., 32 * k:32 * k + 32] = (qs[..., 32 * (k // 2):32 * (k // 2) + 32] >> (4 * (k % 2))) & 15
            if five:
                q[..., 32 * k:32 * k + 32] |= ((b[..., 16:48].astype(np.int32) >> k) & 1) << 4
        s = np.repeat(half(0)[..., None] * sc.astype(np.float32), 2, -1)
        m = -(half(2)[..., None] * mn.astype(np.float32))
    return q.reshape(n, -1), s.reshape(n, -1), m.reshape(n, -1)


def avx2_dot_float(x: np.ndarray, q: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """kernel.cpp's `dot_float` (the AVX2 codes path, float32 activations) in numpy, operation by
    operation: per 32 weights, eight lanes of products of the first 16 in two fmas, of the last
    16 likewise, each fma'd by its scale into the lanes' sums; the lanes' horizontal sum in
    `hsum`'s order; then the minimums' share (min_bias: each chunk's m times its sum of x, summed
    chunk by chunk). An fma is the float64 sum of an exact product, rounded to float32 (a double
    rounding could differ from the fma's one in ~2^-29 of cases; the seeds here hit none)."""
    f32, f64 = np.float32, np.float64
    fma = lambda a, b, c: (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)  # noqa: E731
    B, K = x.shape
    xq = x.reshape(B, 1, K // 8, 8)
    qq = q.astype(f32).reshape(1, q.shape[0], K // 8, 8)
    acc = np.zeros((B, q.shape[0], 8), f32)
    for c in range(K // 32):
        g = lambda i: (qq[:, :, 4 * c + i], xq[:, :, 4 * c + i])  # noqa: E731
        lo = fma(*g(1), (g(0)[0] * g(0)[1]).astype(f32))
        hi = fma(*g(3), (g(2)[0] * g(2)[1]).astype(f32))
        acc = fma(lo, s[None, :, 2 * c, None], acc)
        acc = fma(hi, s[None, :, 2 * c + 1, None], acc)
    t = acc[..., :4] + acc[..., 4:]
    out = (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])
    xs = np.zeros((B, K // 32), f32)  # ops.cpp's sums of x, element after element
    for e in range(32):
        xs += x.reshape(B, -1, 32)[..., e]
    bias = np.zeros((B, q.shape[0]), f32)
    for c in range(K // 32):
        bias += (m[None, :, c] * xs[:, None, c]).astype(f32)
    return out + bias


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_fused_float_dots_are_the_codes_paths_bits(qtype):
    """The head's form (float32 activations, `int8_x=False`) on AVX2 for Q6_K, Q8_0, Q4_K and
    Q5_K: fused dots from the packed bytes (no codes buffer) doing `dot_float`'s operations in its
    order, so the same float32 bits as the codes path (emulated above, torch.equal; the head's
    logits stay the exact weights' float32 products, nothing else rounded), within float32
    rounding of float64 and of the portable build, at 1-10 rows (four at a time, then the rest)
    and one super-block a row or several, each row alone the same bits."""
    rng = np.random.default_rng(int(qtype) + 300)
    torch.manual_seed(int(qtype) + 300)
    for cols in (256, 1536):
        raw = random_blocks(qtype, 24, cols, rng)
        exact = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
        q, s, m = codes_of(raw, qtype)
        assert np.array_equal(q * np.repeat(s, 16, -1).astype(np.float64) + np.repeat(m, 32, -1), exact.numpy())
        for batch in range(1, 11):
            x = torch.randn(batch, cols) * torch.rand(batch, 1) * 4
            x[0, 32:64] = 0
            fused = quants.ops().mm(x, torch.from_numpy(raw), int(qtype), quants.table(qtype), False, False)
            portable = quants.ops().mm(x, torch.from_numpy(raw), int(qtype), quants.table(qtype), False, True)
            reference = x.double() @ exact.T
            for y in (fused, portable):
                assert float((y.double() - reference).norm() / reference.norm()) <= 1e-6, (qtype.name, cols, batch)
            if cpu_has_avx2():  # ops.cpp runs the AVX2 build
                assert torch.equal(fused, torch.from_numpy(avx2_dot_float(x.numpy(), q, s, m))), (qtype.name, cols, batch)
            for i in range(batch):
                alone = quants.ops().mm(x[i:i + 1], torch.from_numpy(raw), int(qtype), quants.table(qtype), False, False)
                assert torch.equal(alone, fused[i:i + 1]), (qtype.name, cols, batch, i)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_product_is_the_kernel_on_the_exact_weights(qtype):
    """QuantLinear: the decode form, any number of tokens a row, is `mm` with int8 activations
    (relative error of the output <= 1.5e-2, see above); the head's (int8_x=False) float32 products
    of the exact weights (<= 1e-5). The prompt form (`prompt_form`), one token or many: exactly
    oneDNN's product of the weights and activations rounded to bf16 where `slab_dtype` is bf16;
    `prompt_mm`'s where it is float32 (AVX2 alone), so a prompt's last tokens read alone after a
    cached prefix go through the kernel they went through in the cold read; `prompt_mm_int8`'s
    where `int8_prompt` (AVX-512 VNNI, no AMX)."""
    rng = np.random.default_rng(1)
    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, rng)
    exact = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
    raw_t = torch.from_numpy(raw)
    blocks = quants.QuantBlocks(raw_t, qtype, cols)
    bias = torch.arange(2 * rows, dtype=torch.float32)
    linear = quants.QuantLinear([blocks, blocks], bias=bias)
    on_slabs = quants.QuantLinear([blocks, blocks], bias=bias, int8_prompt=False)
    assert linear.int8_prompt == quants.int8_prompt_here() and not on_slabs.int8_prompt
    head = quants.QuantLinear([blocks, blocks], bias=bias, slabs=False, int8_x=False)
    torch.manual_seed(0)
    dtype = quants.slab_dtype()  # bf16 where oneDNN has bf16 kernels, float32 on AVX2 alone
    slab = quants.dequantize(blocks).to(dtype)  # each part's slab its own product
    for tokens in (1, 3, 20):
        x = torch.randn(2, tokens, cols)
        reference = x.double() @ torch.cat([exact, exact]).T + bias.double()
        for module, bound in ((linear, 1.5e-2), (head, 1e-5)):
            y = module(x)
            assert y.shape == (2, tokens, 2 * rows) and y.dtype == torch.float32
            error = float((y.double() - reference).norm() / reference.norm())
            assert error <= bound, (qtype.name, tokens, error)
        assert torch.equal(head.prompt_form(x), head(x))  # slabs=False: the kernel for prompt tokens too
        for module in (linear, on_slabs):
            if module.int8_prompt:
                part = quants.ops().prompt_mm_int8(x.reshape(-1, cols), raw_t, int(qtype), quants.table(qtype))
                part = part.view(2, tokens, rows)
            elif dtype == torch.float32:
                part = quants.ops().prompt_mm(x.reshape(-1, cols), raw_t, int(qtype), quants.table(qtype))
                part = part.view(2, tokens, rows)
            else:
                part = F.linear(x.to(dtype), slab).float()
            prompt = module.prompt_form(x)
            assert torch.equal(prompt, torch.cat([part, part], dim=-1) + bias), (qtype.name, tokens, module.int8_prompt)


@pytest.mark.parametrize("slabs, int8_prompt", [(True, True), (True, False), (False, False)])
def test_prompt_pieces_are_each_pieces_own_product(slabs, int8_prompt):
    """A prompt chunk's pieces (engine/weights.py `in_pieces`) through `prompt_pieces` (one call,
    or each bf16 slab unpacked once for all of them): every piece's rows are exactly what
    `prompt_form` gives that piece alone, so a prompt token's result does not depend on the rest
    of its chunk."""
    from engine.weights import in_pieces

    rng = np.random.default_rng(3)
    cols = 256
    parts = [quants.QuantBlocks(torch.from_numpy(random_blocks(q, rows, cols, rng)), q, cols)
             for q, rows in ((Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 40))]
    linear = quants.QuantLinear(parts, bias=torch.randn(104), slabs=slabs, int8_prompt=int8_prompt)
    x = torch.randn(1, 150, cols)
    pieces = (64, 64, 22)
    alone = torch.cat([linear.prompt_form(part) for part in x.split(list(pieces), dim=-2)], dim=-2)
    together = in_pieces(linear, x, pieces)
    assert together.shape == (1, 150, 104) and torch.equal(together, alone)


def test_a_row_of_a_batch_does_not_depend_on_its_neighbours():
    rng = np.random.default_rng(2)
    blocks = quants.QuantBlocks(torch.from_numpy(random_blocks(Q.Q4_K, 64, 256, rng)), Q.Q4_K, 256)
    linear = quants.QuantLinear([blocks])
    x = torch.randn(5, 1, 256)
    together = linear(x)
    for i in range(5):
        assert torch.equal(linear(x[i:i + 1]), together[i:i + 1])


MIXES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "IQ3_S"]


def greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    model.allocate_cache(1, 128)
    tokens = [int(prefill_logits(model, 0, prompt).argmax())]
    for i in range(steps - 1):
        tokens.append(int(decode_logits(model, [0], [tokens[-1]], [len(prompt) + i], span=128)[0].argmax()))
    return tokens


@pytest.mark.parametrize("name", MIXES)
def test_a_mix_loads_in_its_file_size_and_decodes_as_the_dequantized_model(tmp_path, name):
    """Weight memory (the bytes of every tensor the model holds, KV cache aside) <= 1.15x the
    file's tensor bytes; greedy tokens equal the dequantized model's in bf16 (oneDNN-prepacked
    bf16 linears, the path these types took before) for at least 14 of 16 steps, teacher-forced
    on the float32 model's own tokens, and the logits within 5% of their range."""
    path = tmp_path / f"tiny-{name}.gguf"
    file_bytes = write_mix(path, name)
    loaded = GGUFModel(path)
    cpu = torch.device("cpu")
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=cpu, int4=True)
    linears = sum(model.forms.values())
    assert model.forms.get("quant", 0) == linears, model.forms  # every linear kept as the file's blocks
    # prompt tokens in int8 where this CPU runs that faster (AVX-512 VNNI, no AMX), unless told not to
    on_blocks = [m for m in model.modules() if isinstance(m, quants.QuantLinear) and m.slabs]
    assert on_blocks and all(m.int8_prompt == quants.int8_prompt_here() for m in on_blocks)
    slabs = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=cpu, int4=True, prompt_int8=False)
    assert not any(m.int8_prompt for m in slabs.modules() if isinstance(m, quants.QuantLinear))
    held = quants.held_bytes(model)
    assert held <= 1.15 * file_bytes, (name, held / file_bytes)
    if quants.repack_here() and name in ("Q4_K_M", "Q5_K_M", "Q6_K"):  # their K-quant layers repacked at load
        assert any("_R8" in m.extra_repr() for m in on_blocks), name
    loaded.file.drop_pages()  # as load_engine does: the blocks kept as the file's pages fault back in
    weights = loaded.weights()
    dense = Transformer.build(loaded.config, DictSource(weights), dtype=torch.bfloat16, device=cpu)
    exact = Transformer.build(loaded.config, DictSource(weights), dtype=torch.float32, device=cpu)
    assert "quant" not in dense.forms
    prompt = [5, 17, 33, 101, 7, 250, 64, 3]
    reference = greedy(exact, prompt, 16)
    for m in (model, dense):
        m.allocate_cache(1, 128)
    ids = prompt + reference
    ours = prefill_logits(model, 0, ids)
    theirs = prefill_logits(dense, 0, ids)
    span = float(theirs.max() - theirs.min())
    assert float((ours - theirs).abs().max()) <= 0.05 * span, name
    agree = 0
    for step in range(16):  # teacher-forced: each position's next token after the float32 model's text
        prefix = prompt + reference[:step]
        agree += int(prefill_logits(model, 0, prefix).argmax()) == int(prefill_logits(dense, 0, prefix).argmax())
    assert agree >= 14, (name, agree)
    if name == "Q4_K_M":  # and decode steps through mm (one token a row), not only prefill
        assert greedy(model, prompt, 8)[:4] == greedy(dense, prompt, 8)[:4]


@pytest.mark.parametrize("q4_k_int4", [False, True], ids=["mm", "int4"])
def test_a_cached_prefix_then_the_rest_reads_as_the_cold_read(tmp_path, monkeypatch, q4_k_int4):
    """A K-quant model's prompt read cold in one call, and again as a cached first block then the
    rest (the last, partial block of 3 tokens): every prompt token goes through the prompt form,
    one call per aligned block, however it was read, so every linear's output for the last 3
    tokens is the same bits. The attention over them is not: 67 queries in one call against 3
    after a cached 64 round differently in float32 (~1e-7 of the logits; also on Q5_K_M, Q6_K and
    Q8_0 files). With Q4_K on torch's int4 kernel (the loader's form before Dec 6) the K/V and logits are the
    same bits (bf16-valued q, k, v from every int4 layer); on `mm`, the default, within 1e-5 of
    the logits' range (the decode form's int8 activations, read by mistake, would be ~1e-2)."""
    from engine.model import PROMPT_BLOCK

    if q4_k_int4:
        class OnInt4(quants.QuantLinear):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs, int4=True)

        monkeypatch.setattr("engine.model.QuantLinear", OnInt4)
    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_mix(path, "Q4_K_M")
    loaded = GGUFModel(path)
    model = Transformer.build(loaded.config, loaded, dtype=torch.bfloat16, device=torch.device("cpu"), int4=True)
    assert model.forms.get("quant", 0) == sum(model.forms.values()), model.forms
    model.allocate_cache(2, 128)
    prompt = [(7 * i + 3) % 250 for i in range(PROMPT_BLOCK + 3)]
    cold = prefill_logits(model, 0, prompt)
    prefill_logits(model, 1, prompt[:PROMPT_BLOCK])
    warm = prefill_logits(model, 1, prompt[PROMPT_BLOCK:], start=PROMPT_BLOCK)
    cold_kv, warm_kv = model.slot_kv(0, len(prompt)), model.slot_kv(1, len(prompt))
    if q4_k_int4:
        assert torch.equal(cold, warm) and torch.equal(cold_kv, warm_kv)
    else:
        span = float(cold.max() - cold.min())
        assert float((cold - warm).abs().max()) <= 1e-5 * span
        torch.testing.assert_close(warm_kv, cold_kv, rtol=1e-5, atol=1e-5)


def test_the_ops_fake_kernels_give_their_shapes_and_dtypes():
    """engine/quants/fake.py: what a compiled graph traces the ops with matches what they return
    (torch's opcheck: the schema, and the fake kernel against the real one), bf16 slabs included."""
    quants.ops()  # the library loaded, its fake kernels registered
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 4, 512, np.random.default_rng(7)))
    codebook = quants.table(Q.Q4_K)
    checks = ("test_schema", "test_faketensor")
    for bf16 in (False, True):
        result = torch.library.opcheck(torch.ops.strata_quants.dequantize.default,
                                       (raw, int(Q.Q4_K), 512, codebook, False, bf16), test_utils=checks)
        assert set(result.values()) == {"SUCCESS"}, (bf16, result)
    for int8_x in (False, True):
        result = torch.library.opcheck(torch.ops.strata_quants.mm.default,
                                       (torch.randn(3, 512), raw, int(Q.Q4_K), codebook, int8_x, False), test_utils=checks)
        assert set(result.values()) == {"SUCCESS"}, (int8_x, result)


def test_a_repacked_tensors_file_pages_leave_the_process_and_read_back(tmp_path):
    """`GGUFFile.drop_tensor_pages` (what the loader does once a matrix is repacked): none of the
    tensor's whole pages is mapped in this process afterwards (/proc/self/pagemap), and its bytes
    read back the same (faulted in again from the file)."""
    from engine.gguf_file import GGUFFile

    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_mix(path, "Q4_K_M")
    file = GGUFFile(path)
    name, tensor = max(file.tensors.items(), key=lambda item: item[1].data.nbytes)
    before = bytes(tensor.data)  # every page of it touched
    present, pages = _resident_pages(file, tensor)
    if pages and not present:
        pytest.skip("/proc/self/pagemap shows no page as present here (no presence information)")
    assert pages > 0 and present == pages
    file.drop_tensor_pages(name)
    assert _resident_pages(file, tensor) == (0, pages)
    assert bytes(tensor.data) == before


def _resident_pages(file, tensor) -> tuple[int, int]:
    """(pages of the tensor's whole pages mapped in this process, how many whole pages it spans),
    from /proc/self/pagemap's present bit."""
    import mmap
    import os
    import struct

    start = tensor.data.ctypes.data
    lo, hi = -(-start // mmap.PAGESIZE), (start + tensor.data.nbytes) // mmap.PAGESIZE
    present = 0
    if not os.access("/proc/self/pagemap", os.R_OK):
        pytest.skip("no /proc/self/pagemap")
    with open("/proc/self/pagemap", "rb") as f:
        for page in range(lo, hi):
            f.seek(8 * page)
            present += struct.unpack("<Q", f.read(8))[0] >> 63
    return present, hi - lo
