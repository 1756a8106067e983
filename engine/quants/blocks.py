"""Quantized matrices as the file's own blocks, multiplied by the C++ kernels in this folder.

A `QuantBlocks` is a matrix's raw GGUF rows (uint8 [out, row_bytes]: every row whole blocks,
rows already in HF order) and its type. `QuantLinear` multiplies by it: generated tokens (a decode
step, calling the module) through `strata_quants::mm`, which turns one row of blocks at a time into
int8 codes and per-block scales (the exact weights) and sums codes times activations per 32
weights (the activations quantized to int8 per 32, as llama.cpp does; float32 for the head), one
scale applied per sum; prompt tokens (its `prompt_form`, whatever their number) on AVX-512 VNNI
without AMX through `strata_quants::prompt_mm_int8` (the decode step's int8 arithmetic, W's codes
unpacked 16 rows x 256 weights at a time: prompt_int8.cpp; `int8_prompt_here`; Q4_1 with
AVX-512 BF16 in bf16, their codes exact: prompt_bf16.cpp, `bf16_prompt_here`), elsewhere where
oneDNN has bf16 kernels a slab of rows at a time, unpacked and rounded to bf16 and multiplied by
oneDNN (`F.linear` in bf16), on AVX2 alone through `strata_quants::prompt_mm` (float32, W
unpacked 16 rows x 256 weights at a time: prompt.cpp), so no dense copy is ever held. Chosen by role, not by a call's length, like the int4
matrices' bf16 copy (engine/weights.py `TwoFormLinear`): a cached repeat reads its last tokens as
the cold read did. Q4_K parts go through `mm` too (its fused Q4_K dot is 2-3x torch's int4
kernel on the same matrix); a `QuantLinear(int4=True)` repacks them once into torch's int4 groups
instead (exact; the loader's form before Dec 6: bf16 activations, finer, slower). `QuantRows` looks rows up (the
embedding, the head's exact top logits). Either holds exactly the file's bytes for the matrix
(the mapped file's pages). The decode form also runs inside compiled graphs and the packages
compiled ahead of time: the ops have fake kernels (fake.py) and a QuantLinear's blocks are tensor
attributes, the graphs' inputs."""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from torch import Tensor, nn

from engine.quants.build import load
from engine.weights import Int4Blocks, Int4Linear, fuse_int4

# What the kernels take (dequant.cpp). Q4_0/Q4_1 go to torch's int4 path where it has its bf16 prompt copy.
TYPES = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S}
INT4_TYPES = {Q.Q4_0, Q.Q4_1}  # torch's int4 kernel takes these first where oneDNN prepacks bf16 (model.py)
SLAB_BYTES = 8 << 20  # float32 bytes of one unpacked slab of rows in a bf16 prompt product


@cache
def slab_dtype() -> torch.dtype:
    """The dtype prompt slabs are multiplied in: bf16 where oneDNN has bf16 kernels (AVX-512,
    AMX); float32 on AVX2 alone, where a bf16 product is emulated and 3.4-6.6x slower than
    float32's (`.venv/bin/python -m bench.slab_dtype`, AMD EPYC Zen 3). Slabs are unpacked
    straight to this dtype (kernel.cpp `strata_unpack_rows_bf16`: no float32 slab in between)."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


@cache
def int8_prompt_here() -> bool:
    """Whether prompt tokens are multiplied in integers rather than through slabs:
    `strata_quants::prompt_mm_int8` (prompt_int8.cpp: x quantized per 32 as the decode step's
    `mm` quantizes it, the codes multiplied four bytes at a time, no slab written and read again)
    wherever kernel.cpp's AVX2 or VNNI build runs and the CPU has no AMX. With AVX-512 VNNI (AMD
    Zen 4/5, Intel Ice Lake) by `vpdpbusd`: on one Zen 4 core 1.4-1.6x the bf16 slabs' rate on a
    2048^2 matrix at 512 rows (`.venv/bin/python -m bench.prompt_product --int8`); on AVX2 alone
    (AMD Zen 2/3, Intel before Ice Lake) by `maddubs`, the same bits, against `prompt_mm`'s float32
    (docs/bench-log.md, Dec 7 eighth session). With AMX, oneDNN's bf16 tiles stay (several times
    any vector instruction's rate)."""
    return available() and bool(ops().int8_prompt())


def int8_prompt_of(qtype: Q) -> bool:
    """Whether a type's prompt tokens go through `prompt_mm_int8` where `int8_prompt_here`: every
    type's with AVX-512 VNNI; on AVX2 alone all but those of the types that take 16-bit
    activations (`takes_x16`: Q4_1), whose two `maddubs` a quad run at half `prompt_mm`'s float32
    rate there (docs/bench-log.md, Dec 7 eighth session)."""
    return int8_prompt_here() and (not takes_x16(qtype) or ops().mm_build() == "vnni")


@cache
def bf16_prompt_here() -> bool:
    """Whether the prompt tokens of the types that take 16-bit activations (`takes_x16`: Q4_1) go
    through `prompt_mm_int8`'s bf16 tile (prompt_bf16.cpp:
    x rounded to bf16, the codes as exact bf16 integers, `vdpbf16ps`) rather than its 16-bit
    integer one: where `int8_prompt_here` and the CPU has AVX-512 BF16 (AMD Zen 4 and 5). There
    their prompts need no bf16 copy of the matrix (model.py): on one Zen 4 core, 2048^2, Q4_0
    167-189 GFLOP/s at 16-512 rows against the copy's oneDNN 206-223 and the 16-bit integers'
    ~145 (docs/bench-log.md, Dec 7 fifth session). STRATA_QUANTS_ISA=vnni keeps the 16-bit integers."""
    return int8_prompt_here() and bool(ops().bf16_prompt())


def takes_x16(qtype: Q) -> bool:
    """Whether a type's repacked decode dots (and its integer prompt product) quantize activations
    to 16 bits per 32 rather than int8 (layouts.h `takes_x16`): Q4_1, the default file's type,
    whose precision test int8 ones fail; Q4_0 since Dec 7 (seventh session) as every other type."""
    return bool(ops().takes_x16(int(qtype)))


# layouts.h: blocks repacked eight weight rows at a time (repack.cpp), the type + 1000: not GGUF types
EIGHT_ROWS = {q: int(q) + 1000 for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)}


class QuantBlocks(NamedTuple):
    raw: Tensor  # uint8 [rows, row_bytes], or [E, rows, row_bytes]: an MoE layer's stacked experts
    qtype: Q
    cols: int
    repacked: bool = False  # a K-quant held eight rows at a time (`repacked`): raw's rows are groups of eight


class BlocksPart(NamedTuple):
    """A QuantLinear's part kept as blocks: the names of its tensor attributes, and its type."""
    raw: str  # uint8 [rows, row_bytes]
    table: str  # float32, the type's codebook (`table`), empty but for IQ types
    qtype: Q
    repacked: bool = False


def code(blocks: QuantBlocks | BlocksPart) -> int:
    """The type number the ops take: the GGUF type's, or its repacked form's (Q4_K_R8: 1012)."""
    return EIGHT_ROWS[blocks.qtype] if blocks.repacked else int(blocks.qtype)


def kind(blocks: QuantBlocks | BlocksPart) -> str:
    return f"{blocks.qtype.name}_R8" if blocks.repacked else blocks.qtype.name


@cache
def repack_here() -> bool:
    """Whether quantized matrices are repacked for the decode step: where kernel.cpp's AVX2 or
    VNNI build runs (the repacked forms' own dots are theirs; the portable build would read them
    restored)."""
    return available() and ops().mm_build() != "portable"


def repacked(blocks: QuantBlocks) -> QuantBlocks:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K as their repacked forms (`EIGHT_ROWS`;
    repack.cpp: exact repackings, eight weight rows at a time; Q4_K 148 and Q5_K 180 bytes a row's
    256 weights against the file's 144 and 176, the rest the file's bytes) where `repack_here` and
    the rows are whole groups of eight; anything else as it is. The decode step's dots then work
    on eight weight rows per register (kernel.cpp `dot_q45_k_r8`, `dot_q6_k_r8`, `dot_q32_r8`;
    Q4_1 with 16-bit activations); the prompt's integer product makes its panels straight from
    the repacked rows (prompt_int8.cpp), the others restore each panel's rows to the file's bytes
    as they unpack them. The file's pages are then no longer read: a copy in the worker's
    memory instead of the page cache's (not shared by two workers on one file)."""
    if (blocks.qtype not in EIGHT_ROWS or blocks.repacked or blocks.raw.dim() != 2 or blocks.raw.shape[0] % 8
            or not repack_here()):
        return blocks
    raw = ops().repack(blocks.raw.contiguous(), int(blocks.qtype), blocks.cols)
    return QuantBlocks(raw, blocks.qtype, blocks.cols, True)


def available() -> bool:
    """The kernels are built and loaded (a C++ compiler was there)."""
    return load() is None


def ops():  # noqa: ANN201 (torch's op namespace)
    """torch.ops.strata_quants, loaded."""
    if load() is not None:
        raise RuntimeError(f"strata_quants kernels unavailable: {load()}")
    return torch.ops.strata_quants


@cache
def table(qtype: Q) -> Tensor:
    """The codebook a type's kernel looks values up in, taken from gguf-py's own quants module."""
    from gguf import quants

    if qtype == Q.IQ4_XS:
        return torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32)
    if qtype == Q.IQ3_S:
        quants.IQ3_S.init_grid()
        return torch.from_numpy(np.ascontiguousarray(quants.IQ3_S.grid, dtype=np.float32).reshape(-1))
    return torch.empty(0)


def dequantize(blocks: QuantBlocks, dtype: torch.dtype = torch.float32) -> Tensor:
    """float32 [rows, cols] (or [E, rows, cols]), bit for bit gguf.quants.dequantize of the same
    bytes; bf16: those values as `.to(torch.bfloat16)` rounds them, made in one pass (no float32
    copy written and read again)."""
    assert dtype in (torch.float32, torch.bfloat16), dtype
    raw = blocks.raw
    flat = ops().dequantize(raw.reshape(-1, raw.shape[-1]), code(blocks), blocks.cols, table(blocks.qtype),
                            False, dtype == torch.bfloat16)
    return flat.view(*raw.shape[:-1], blocks.cols)


def shape_ok(qtype: Q, cols: int) -> bool:
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype in TYPES and cols % block == 0


def unpack_q4_k(blocks: QuantBlocks) -> Int4Blocks:
    """Q4_K rows as torch's int4 groups (32 weights): sub-block s of a 256-weight block is the low
    (s even) or high (s odd) nibbles of bytes 32*(s//2).. of its 128; scale d*sc_s, offset
    -(dmin*m_s), both exact in float32 (an f16 times a 6-bit integer), so q * scale + offset is
    bit for bit gguf's (d*sc) * q - dmin*m (`dequantize_int4`; tested)."""
    raw, rows, cols = blocks.raw, blocks.raw.shape[0], blocks.cols
    blk = raw.view(rows, cols // 256, 144)
    d = blk[..., 0:2].contiguous().view(torch.float16).float()  # [rows, n, 1]
    dmin = blk[..., 2:4].contiguous().view(torch.float16).float()
    s = blk[..., 4:16].to(torch.int32)
    sc = torch.cat([s[..., 0:4] & 0x3F, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 2) & 0x30)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 0x3F, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 2) & 0x30)], dim=-1)
    qs = blk[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, cols)  # sub-blocks 2j, 2j+1 of byte group j
    scale = (d * sc.float()).reshape(rows, -1)
    offset = -(dmin * mn.float()).reshape(rows, -1)
    return Int4Blocks(q.contiguous(), scale, offset)


class QuantLinear(nn.Module):
    """`F.linear` by matrices kept as GGUF blocks, stacked along the output dim (q/k/v and
    gate/up may be of different types in a K-quant mix: Q4_K_M stores v as Q6_K). float32 out.

    Q4_K parts run on `strata_quants::mm` like the others (its fused Q4_K dot: 0.23 / 0.50 ms
    against torch's int4 kernel's 0.72 / 1.10 on a 2048^2 matrix at 1 / 4 rows, bench/quant_speed.py
    --kernels; the loader's form since Dec 6). With `int4` they are repacked once, exactly,
    into torch's int4 groups and run on its int4 kernel instead (`Int4Linear`, as Q4_0/Q4_1 files
    do: bf16 activations, each group's scale and offset rounded to bf16: ~3e-3 relative error
    against int8's ~9e-3 on real layer inputs); the raw Q4_K bytes are then not kept (int4 holds
    0.625 bytes a weight against the file's 0.5625)."""

    def __init__(self, parts: list[QuantBlocks], bias: Tensor | None = None, *, slabs: bool = True,
                 int4: bool = False, int8_x: bool = True, int8_prompt: bool = True, repack: bool = True) -> None:
        """slabs: prompt tokens (`prompt_form`) go through unpacked slabs (bf16, or float32 where
        bf16 is slow: `slab_dtype`; False: through `mm` too).
        int8_prompt: with slabs, where `int8_prompt_here`, prompt tokens are multiplied in int8
        instead (`prompt_mm_int8`: the decode form's activations, llama.cpp's arithmetic; faster,
        less close to float32: docs/engine.md); False keeps the bf16 slabs.
        int4: Q4_K parts on torch's int4 kernel (tests and benches compare the two forms).
        int8_x: `mm` quantizes the activations to int8 per 32 (llama.cpp's arithmetic, ~5e-3
        relative error on the output; ~9e-3 on real layer inputs); False keeps them float32 (the
        head: its logits are then the exact rows' product).
        repack: with int8_x, parts of the types `repacked` takes held eight rows at a time (the decode
        step's dot on eight weight rows at once); False keeps the file's blocks."""
        super().__init__()
        self.slabs, self.int8_x = slabs, int8_x
        self.int8_prompt = slabs and int8_prompt and int8_prompt_here()
        self.cols = parts[0].cols
        assert all(p.cols == self.cols for p in parts)
        self.out_features = sum(p.raw.shape[0] for p in parts)
        self.bias = None if bias is None else bias.float()
        # consecutive Q4_K parts fused into one int4 matrix (an index into self.int4); the rest as
        # blocks for the op, each held as tensor attributes `raw<i>` and `table<i>` (its codebook,
        # empty but for IQ types), so a compiled step takes them as inputs (engine/aot.py
        # `_tensors`) rather than as constants baked into its code
        self.parts: list[int | BlocksPart] = []
        self.int4 = nn.ModuleList()
        run: list[QuantBlocks] = []
        for p in [*parts, None]:
            if p is not None and int4 and p.qtype == Q.Q4_K:
                run.append(p)
                continue
            if run:
                self.parts.append(len(self.int4))
                self.int4.append(Int4Linear(fuse_int4([unpack_q4_k(r) for r in run])))  # type: ignore[arg-type]
                run = []
            if p is not None:
                if repack and int8_x:
                    p = repacked(p)
                i = len(self.parts)
                setattr(self, f"raw{i}", p.raw)
                setattr(self, f"table{i}", table(p.qtype))
                self.parts.append(BlocksPart(f"raw{i}", f"table{i}", p.qtype, p.repacked))

    def forward(self, x: Tensor) -> Tensor:
        """Generated tokens (the decode form). x: [..., in] -> [..., out] float32."""
        return self._product(x, prompt=False)

    def prompt_form(self, x: Tensor) -> Tensor:
        """Prompt tokens, any number of them (engine/weights.py `in_pieces`, one call per aligned
        block): unpacked slabs (`slab_dtype`). x: [..., in] -> [..., out] float32."""
        return self._product(x, prompt=self.slabs)

    def blocks(self, part: BlocksPart) -> QuantBlocks:
        """A part's blocks, read from its attribute (where a package's trace puts its input)."""
        return QuantBlocks(getattr(self, part.raw), part.qtype, self.cols, part.repacked)

    def prompt_pieces(self, x: Tensor, pieces: tuple[int, ...]) -> Tensor:
        """Prompt tokens in pieces of rows (engine/weights.py `in_pieces`; sizes summing to x's
        [..., T, in] T): each piece's product the call `prompt_form` makes of it alone, the same
        bits. Where a row's product never depends on its call (`prompt_mm`, or `mm` without
        slabs) that is one call for all of them; else (bf16 slabs) each slab is unpacked once
        for all the pieces (a 512-token chunk is 8 of them), each piece its own product."""
        if not self.slabs or slab_dtype() == torch.float32 or all(self._int8(p) for p in self.parts):
            return self.prompt_form(x)
        chunks = x.split(list(pieces), dim=-2)
        ys = self._products([c.reshape(-1, self.cols) for c in chunks], prompt=self.slabs)
        return torch.cat([y.view(*c.shape[:-1], self.out_features) for y, c in zip(ys, chunks)], dim=-2)

    def _int8(self, part: int | BlocksPart | QuantBlocks) -> bool:
        """Whether a part's prompt tokens go through `prompt_mm_int8` (`int8_prompt_of` its type)."""
        return self.int8_prompt and not isinstance(part, int) and int8_prompt_of(part.qtype)

    def _product(self, x: Tensor, prompt: bool) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self._products([flat], prompt)[0].view(*x.shape[:-1], self.out_features)

    def _products(self, flats: list[Tensor], prompt: bool) -> list[Tensor]:
        """Each of `flats` [n, in] times the matrix, + bias: [n, out] float32 each."""
        per_part = [self._part_products(p, flats, prompt) for p in self.parts]
        ys = [outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1) for outs in zip(*per_part)]
        return ys if self.bias is None else [y + self.bias for y in ys]

    def _part_products(self, part: int | BlocksPart, flats: list[Tensor], prompt: bool) -> list[Tensor]:
        if isinstance(part, int):
            return [self.int4[part](flat).float() for flat in flats]
        if prompt:
            return self._slabs(flats, self.blocks(part))
        # The ops straight from torch.ops (not `ops()`, whose cached load a graph cannot trace):
        # this module exists only once the library loaded.
        blocks, codebook = getattr(self, part.raw), getattr(self, part.table)
        return [torch.ops.strata_quants.mm(flat, blocks, code(part), codebook, self.int8_x) for flat in flats]

    def extra_repr(self) -> str:
        """The parts' kinds in order (the package key's: blocks of the same shape can be of two
        types, Q5_0's and Q5_K's 176 bytes per 256 weights)."""
        kinds = ["int4" if isinstance(p, int) else kind(p) for p in self.parts]
        return f"cols={self.cols}, parts={kinds}, int8_x={self.int8_x}, slabs={self.slabs}"

    def _slabs(self, flats: list[Tensor], part: QuantBlocks) -> list[Tensor]:
        """Prompt tokens, each of `flats` its own product. `int8_prompt`: `prompt_mm_int8` (every
        output one fixed chain of operations, whatever the call's rows); float32 (AVX2 alone): `prompt_mm`
        (ops.cpp: its every output one fixed chain of sums, whatever the call's rows); bf16: a
        slab of rows unpacked, rounded to bf16 and multiplied by oneDNN, once for all of
        `flats`, each its own `F.linear` (oneDNN's blocking depends on a call's rows)."""
        if self._int8(part):
            return [torch.ops.strata_quants.prompt_mm_int8(flat, part.raw, code(part), table(part.qtype))
                    for flat in flats]
        dtype = slab_dtype()
        if dtype == torch.float32:
            return [torch.ops.strata_quants.prompt_mm(flat, part.raw, code(part), table(part.qtype))
                    for flat in flats]
        xs = [flat.to(dtype) for flat in flats]
        step = max(1, SLAB_BYTES // (4 * self.cols))
        if part.repacked:  # whole groups of eight rows
            step = max(8, step // 8 * 8)
        rows = part.raw.shape[0]
        outs = [torch.empty(flat.shape[0], rows, dtype=torch.float32) for flat in flats]
        for lo in range(0, rows, step):
            slab = dequantize(part._replace(raw=part.raw[lo:lo + step]), dtype)
            for x, out in zip(xs, outs):
                out[:, lo:lo + step] = F.linear(x, slab)
        return outs

    def dequantized(self, rows: slice = slice(None)) -> Tensor:
        """float32 rows of the matrix (the exact file weights; a one-part matrix, the head)."""
        (part,) = self.parts
        assert isinstance(part, BlocksPart) and not part.repacked  # a head's float32 activations: never repacked
        blocks = self.blocks(part)
        return dequantize(blocks._replace(raw=blocks.raw[rows]))


class QuantExperts(nn.Module):
    """An MoE layer's stacked expert matrices [E, out, in] kept as the file's blocks; called with
    (row, expert) pairs, it multiplies each row by its expert's matrix (`strata_quants::mm_experts`:
    each chosen expert's blocks read once for all its rows, the others never), activations
    quantized to int8 per 32 as `QuantLinear`'s decode form. The same product for prompt and
    generated tokens: a pair's result is its row's alone, whatever else the call holds."""

    def __init__(self, blocks: QuantBlocks) -> None:
        super().__init__()
        assert blocks.raw.dim() == 3
        self.qtype, self.cols = blocks.qtype, blocks.cols
        self.raw, self.table = blocks.raw, table(blocks.qtype)  # tensor attributes: a compiled step's inputs

    def forward(self, x: Tensor, experts: Tensor) -> Tensor:
        """x: [P, in], experts: [P] long -> [P, out] float32."""
        return torch.ops.strata_quants.mm_experts(x, self.raw, experts, int(self.qtype), self.table, True)

    def extra_repr(self) -> str:
        experts, rows, _ = self.raw.shape
        return f"experts={experts}, out={rows}, in={self.cols}, qtype={self.qtype.name}"


class QuantRows(nn.Module):
    """Rows of a quantized matrix kept as its blocks, unpacked on lookup (the embedding; the
    head's exact rows): the file's bytes, the file's exact values."""

    def __init__(self, blocks: QuantBlocks) -> None:
        super().__init__()
        self.qtype, self.dim = blocks.qtype, blocks.cols
        self.register_buffer("blocks", blocks.raw, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [...] long -> [..., dim] float32
        rows = QuantBlocks(self.blocks[ids.reshape(-1)], self.qtype, self.dim)
        return dequantize(rows).reshape(*ids.shape, self.dim)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct tensors a model keeps for its weights (every tensor attribute,
    buffer and parameter of its modules, QuantLinear's blocks and codebooks among them, a
    HeadBound's table; KV caches and RoPE tables left out), each storage counted once."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, Tensor) and t.numel():
            if t.layout == torch.strided and not t.is_mkldnn:
                s = t.untyped_storage()
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
            else:  # oneDNN's reordered weights: no storage to share
                seen[id(t)] = t.numel() * t.element_size()
        elif isinstance(t, QuantBlocks):
            add(t.raw)
        elif isinstance(t, (list, tuple)):
            for item in t:
                add(item)

    for part in module.modules():
        for name, value in vars(part).items():
            if name in ("k_cache", "v_cache", "cos", "sin"):
                continue
            if name in ("_parameters", "_buffers"):
                for t in value.values():
                    add(t)
            elif hasattr(value, "table") and isinstance(getattr(value, "table"), Tensor):  # HeadBound
                add(value.table)
            else:
                add(value)
    return sum(seen.values())
