"""strata_attend::decode (engine/attend.cpp): a decode step's attention read from the KV pool in
place, against the gather-then-matmul path (engine/layers.py `attend_plain`) on the same pool."""

from __future__ import annotations

import pytest
import torch

from engine import kv_dtype
from engine.layers import attend_plain, gather_index
from engine.quants.build import compiler, load

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: engine/attend.cpp cannot be built")

KV, G, D, N = 3, 3, 64, 640  # SmolLM2's heads: 9 query heads over 3 KV heads of 64


def _case(dtype: torch.dtype, rows: int, tokens: int, span: int, seed: int = 0):
    """A pool of `dtype` with random entries, each row's positions scattered over it, each row's
    tokens seeing a different prefix of its span (a causal run of guesses), and a padding row
    that sees nothing."""
    g = torch.Generator().manual_seed(seed)
    pool = [kv_dtype.store(torch.randn(KV, N, D, generator=g) * 2, dtype) for _ in range(2)]
    read_at = torch.stack([torch.randperm(N - 1, generator=g)[:span] for _ in range(rows)])
    q = torch.randn(rows, tokens, KV * G, D, generator=g)
    lengths = torch.randint(1, span - tokens + 1, (rows,), generator=g)
    seen = torch.arange(span).view(1, 1, -1) < (lengths.view(-1, 1, 1) + torch.arange(tokens).view(1, -1, 1) + 1)
    seen[-1] = False  # a padding row
    return q, pool, read_at, seen


def _gathered(q, pool, read_at, seen, scale=0.0):
    rows, tokens, _, _ = q.shape
    span = read_at.shape[1]
    at = gather_index(read_at, KV, N)
    keys, values = (kv_dtype.load(p.view(-1, p.shape[-1]).index_select(0, at).view(rows, KV, span, -1), D) for p in pool)
    return attend_plain(q.transpose(1, 2), keys, values, seen.view(rows, 1, 1, tokens, span), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows,tokens,span", [(1, 1, 7), (4, 1, 300), (8, 3, 129), (3, 4, 64)])
def test_decode_reads_the_pool_as_the_gathered_rows_give(dtype, rows, tokens, span):
    assert load("strata_attend") is None
    q, pool, read_at, seen = _case(dtype, rows + 1, tokens, span)
    got = torch.ops.strata_attend.decode(q, *pool, read_at, seen, D**-0.5)
    want = _gathered(q, pool, read_at, seen)
    assert got.shape == (rows + 1, tokens, KV * G * D) and got.dtype == torch.float32
    torch.testing.assert_close(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # a row that sees nothing: zeros, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_token_that_sees_nothing_beside_one_that_sees_gets_zeros(dtype):
    """A row's second token (a guess) sees its prefix while the first sees nothing: the first's
    output is zeros, the second's what the gathered rows give, the first's -inf scores never
    reaching the weighted sum."""
    q, pool, read_at, seen = _case(dtype, 3, 2, 40, seed=2)
    seen[0, 0] = False
    got = torch.ops.strata_attend.decode(q, *pool, read_at, seen, D**-0.5)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    torch.testing.assert_close(got[:2, 1], _gathered(q, pool, read_at, seen)[:2, 1], rtol=1e-5, atol=1e-5)
    assert not got.isnan().any()


def test_a_rows_result_depends_on_nothing_but_its_own_and_never_reads_a_masked_place():
    """The same bits alone, beside other rows, on one thread or two, with its masked positions'
    entries NaN (never read)."""
    q, pool, read_at, seen = _case(torch.float32, 5, 2, 100, seed=1)
    clean = torch.ops.strata_attend.decode(q, *pool, read_at, seen, 0.125)
    # the scale is the one given (Gemma's is not head_dim ** -0.5)
    torch.testing.assert_close(clean[:4], _gathered(q, pool, read_at, seen, 0.125)[:4], rtol=1e-5, atol=1e-5)
    hidden = ~seen[2].any(0)
    assert hidden.any()
    for p in pool:
        p[:, read_at[2][hidden]] = float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.strata_attend.decode(q[2:3], *pool, read_at[2:3], seen[2:3], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, clean[2:3])


def test_decode_refuses_what_it_cannot_read():
    q, pool, read_at, seen = _case(torch.float32, 2, 1, 16)
    with pytest.raises(RuntimeError, match="query heads"):
        torch.ops.strata_attend.decode(q[:, :, :8], *pool, read_at, seen, 0.125)
    with pytest.raises(RuntimeError, match="a Double pool"):
        torch.ops.strata_attend.decode(q, *(p.double() for p in pool), read_at, seen, 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.strata_attend.decode(q, *pool, read_at + N, seen, 0.125)


BASELINE_OUTPUTS = """
import sys, torch
from engine.quants.build import load
assert load("strata_attend") is None
cases = torch.load(sys.argv[1])
torch.save([torch.ops.strata_attend.decode(q, *pool, read_at, seen, D_SCALE) for q, pool, read_at, seen in cases], sys.argv[2])
""".replace("D_SCALE", str(D**-0.5))


def test_the_baseline_build_gives_the_avx2_builds_bits(tmp_path):
    """attend.cpp is built twice, for the baseline and for AVX2 with F16C (float16 and int8 entries
    widened eight at a time by their instructions), and runs the second where the CPU has it: the
    baseline, kept by a process told to (STRATA_QUANTS_ISA=portable), gives the same bits on every
    pool dtype, with guesses and padding rows, at a short span and a long one (two halves)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    assert load("strata_attend") is None
    cases = [_case(dtype, rows, tokens, span, seed=3)
             for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8)
             for rows, tokens, span in ((3, 1, 70), (2, 3, 300))]
    torch.save(cases, tmp_path / "cases.pt")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "STRATA_QUANTS_ISA": "portable", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", BASELINE_OUTPUTS, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   env=env, cwd=root, check=True, timeout=300)
    for (q, pool, read_at, seen), theirs in zip(cases, torch.load(tmp_path / "out.pt")):
        ours = torch.ops.strata_attend.decode(q, *pool, read_at, seen, D**-0.5)
        assert torch.equal(ours, theirs), pool[0].dtype
