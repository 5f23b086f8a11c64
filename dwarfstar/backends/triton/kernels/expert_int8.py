"""Integer dot products of int8 activation rows with rows of 2-bit GGUF blocks: the routed experts'
decode loops under Precision.fast (`moe_experts.decode_ffn`), for Q2_K and IQ2_XXS.

The activations are quantized once per row (`quantize_rows`, or `store_q8` where a kernel has the
row in registers), in blocks of 32 columns, like ggml's q8_1: int8 values r = round(x * 127 / amax),
a float32 scale amax / 127 per block and, per 16 columns, the scale times the sum of r (the K-quants'
mins multiply those). The weights are never floats: their integer quants are cut out four at a time
from 32-bit words (one shift and one mask give four int8 lanes) and multiplied with four activation
bytes by one dp4a (`dp4a`); the integer sums take the weight sub-block scale as an integer, then the
activation block scale and the super-block scale d as floats, once per sub-block.

IQ2_XXS's lattice values are 8, 25 and 43, exact in int8. `tables` holds per lattice row the codes of
its 8 values (0, 1, 2) as the nibbles of one word, and per 7-bit sign index its 8 signs (parity
included) as bit 2 of the same nibbles, so the OR of the two words picks each value, signed, out of
the 8 bytes 8, 25, 43, 0, -8, -25, -43, 0: one byte permute (prmt) gives 4 signed int8 weights
(`_signed_values`). The lookups are 4-byte gathers from tables of 1 KB and 512 bytes (8 and 4 cache
lines; `plan.predict.gather_lines`), where 8-byte rows and 8-byte sign masks took 2 KB and 1 KB.

The products are exact integers; the only rounding against the float reference is that of the
activations to int8 (and of the mid activations, quantized by the gate/up kernel that computes
them). tests/triton/test_moe.py bounds the error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels import expert_blocks
from dwarfstar.backends.triton.kernels.quant_blocks import compiles_ptx
from dwarfstar.gguf.dequant import _iq2xxs_tables

Q8_BLOCK = 32  # activation columns per int8 scale
Q8_TYPES = (10, 16)  # Q2_K, IQ2_XXS: the block types with int8 loops here
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + ROUND holds round-to-nearest-even(v) in its low mantissa bits
ROUND_BITS = tl.constexpr(0x4B400000)
# word offsets in `tables` (each table on a 128-byte line) of IQ2_XXS's lattice rows as 8 nibble codes
# and of its 7-bit sign indexes' signs as bit 2 of 8 nibbles: their OR picks the row's signed values
# out of LATTICE_LO:LATTICE_HI with one byte permute per 4 values (`_signed_values`)
CODES_AT = tl.constexpr(1792)
SIGN_NIBBLES_AT = tl.constexpr(1792 + 256)
LATTICE = (8, 25, 43)  # IQ2_XXS's lattice values: code c is LATTICE[c]
LATTICE_LO = tl.constexpr(0x002B1908)  # bytes 0-3 of the permute's source: 8, 25, 43, 0
LATTICE_HI = tl.constexpr(0x00D5E7F8)  # bytes 4-7: -8, -25, -43, 0 (code + 4 picks the negative)
# LATTICE_LO again, 8 times from this word: each group's thread loads its own copy, which ptxas keeps
# in a register; a constant or one uniform load it copied into a register before every permute
# (46 more instructions a pass on sm_90)
LATTICE_AT = tl.constexpr(1665)


@functools.cache
def _tables(device: torch.device) -> torch.Tensor:
    grid, ksigns = _iq2xxs_tables()
    nibble = 16 ** torch.arange(8, dtype=torch.int64)
    codes = torch.zeros_like(grid, dtype=torch.int64)
    for c, value in enumerate(LATTICE):
        codes[grid == value] = c
    if not torch.isin(grid, torch.tensor(LATTICE, dtype=grid.dtype)).all():
        raise AssertionError("the IQ2_XXS lattice holds values other than 8, 25 and 43")
    negative = (ksigns.to(torch.int64)[:, None] >> torch.arange(8)) & 1
    flat = torch.cat([(codes * nibble).sum(-1), (4 * negative * nibble).sum(-1)])
    ours = torch.where(flat >= 2**31, flat - 2**32, flat).to(torch.int32).to(device)
    theirs = expert_blocks.tables(device)
    pad = torch.zeros(CODES_AT - theirs.numel(), dtype=torch.int32, device=device)
    at = LATTICE_AT.value - theirs.numel()
    pad[at : at + 8] = LATTICE_LO.value
    return torch.cat([theirs, pad, ours])


def tables(device: torch.device | str) -> torch.Tensor:
    """`expert_blocks.tables` (the other loops of a launch read it), then from CODES_AT per IQ2_XXS
    lattice row its 8 values' codes (0, 1, 2 for 8, 25, 43) as the nibbles of one int32, value i in
    nibble i, and from SIGN_NIBBLES_AT per 7-bit sign index its 8 signs (parity included) as bit 2 of
    the same nibbles (4 where the value is negative): 1 KB and 512 bytes, 8 and 4 cache lines."""
    return _tables(torch.device(device))


@dataclass(frozen=True)
class Q8Rows:
    """Rows quantized to int8 in blocks of 32: q int8 [R, C]; scale float32 [R, C / 16], each block's
    scale once per 16 columns; and sums float32 [R, C / 16] (per 16 columns: the block scale times the
    sum of q). Scales and sums per 16 columns have the layout of the
    sub-blocks they go with (Q2_K's; IQ2_XXS loads a block's scale pair as it loads activation words),
    so a loop's loads of them need no layout conversion."""

    q: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor

    @classmethod
    def empty(cls, rows: int, cols: int, device: torch.device) -> Q8Rows:
        if cols % Q8_BLOCK:
            raise ValueError(f"int8 activation rows take a multiple of {Q8_BLOCK} columns, got {cols}")
        return cls(
            torch.empty(rows, cols, device=device, dtype=torch.int8),
            torch.empty(rows, cols // 16, device=device),
            torch.empty(rows, cols // 16, device=device),
        )


@triton.jit
def dp4a(a, b, c, PTX: tl.constexpr):
    """c + the dot product of the four signed bytes of a and of b (int32 words): one dp4a on NVIDIA."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, $3;",
            constraints="=r,r,r,r",
            args=[a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    a = a.to(tl.int32, bitcast=True)
    b = b.to(tl.int32, bitcast=True)
    c += ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
    return c + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24)


@triton.jit
def _dp4a_last(a, b, c, PTX: tl.constexpr):
    """c + dp4a over the last dim (2) of a and b, as one chain."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return dp4a(a1, b1, dp4a(a0, b0, c, PTX), PTX)


@triton.jit
def _dp4a_last2(a, b, c, PTX: tl.constexpr):
    """c + dp4a over the last two dims (2, 2) of a and b, as one chain."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return _dp4a_last(a1, b1, _dp4a_last(a0, b0, c, PTX), PTX)


@triton.jit
def mul_rn(a, b, PTX: tl.constexpr):
    """a * b rounded on its own, as the reference rounds it: ptxas contracts a product and the sum it
    feeds into one fused multiply-add (one rounding), which moves round(x * 127 / amax) off the
    reference's where the product sits within an ulp of a half; a mul.rn is never contracted."""
    if PTX:
        return tl.inline_asm_elementwise(asm="mul.rn.f32 $0, $1, $2;", constraints="=r,r,r", args=[a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return a * b


@triton.jit
def store_q8(y, q_ptr, s_ptr, sum_ptr, row_at, n0, N, BN: tl.constexpr, PTX: tl.constexpr):
    """Quantize y float32 [BN] (columns n0..n0+BN of a row, n0 and N multiples of 32) into a `Q8Rows`
    whose row starts at element row_at (int64); columns at or past N are not written."""
    blocks = tl.reshape(y, [BN // 32, 32])
    amax = tl.max(tl.abs(blocks), axis=1)
    inv = tl.div_rn(127.0, tl.maximum(amax, 1e-30))  # an all-zero block: r = 0, scale 0
    r = (mul_rn(blocks, inv[:, None], PTX) + ROUND).to(tl.int32, bitcast=True) - ROUND_BITS  # |r| <= 127
    scale = tl.div_rn(amax, 127.0)
    n = n0 + tl.arange(0, BN)
    tl.store(q_ptr + row_at + n, tl.reshape(r, [BN]).to(tl.int8), mask=n < N)
    h = n0 // 16 + tl.arange(0, BN // 16)
    pair = tl.reshape(tl.join(scale, scale), [BN // 16])  # each block's scale for both its 16-column halves
    tl.store(s_ptr + row_at // 16 + h, pair, mask=h < N // 16)
    sums = tl.sum(tl.reshape(r, [BN // 32, 2, 16]), axis=2).to(tl.float32) * scale[:, None]
    tl.store(sum_ptr + row_at // 16 + h, tl.reshape(sums, [BN // 16]), mask=h < N // 16)


@triton.jit
def _quantize_kernel(x_ptr, stride_x, q_ptr, s_ptr, sum_ptr, K, BK: tl.constexpr, PTX: tl.constexpr):
    t = tl.program_id(0)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    y = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    store_q8(y, q_ptr, s_ptr, sum_ptr, t.to(tl.int64) * K, tl.program_id(1) * BK, K, BK, PTX)


def quantize_rows(x: torch.Tensor) -> Q8Rows:
    """float rows [R, C] (row stride free, C a multiple of 32) as `Q8Rows`: one launch."""
    rows, cols = x.shape
    out = Q8Rows.empty(rows, cols, x.device)
    bk = min(1024, triton.next_power_of_2(cols))
    _quantize_kernel[(rows, triton.cdiv(cols, bk))](
        x, x.stride(0), out.q, out.scale, out.sums, cols, BK=bk, PTX=compiles_ptx()
    )
    return out


def reference_rows(x: torch.Tensor) -> Q8Rows:
    """`quantize_rows` in torch (round half to even, as the kernel)."""
    blocks = x.float().reshape(x.shape[0], -1, Q8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    r = torch.round(blocks * inv)
    scale = amax / 127.0
    sums = r.reshape(x.shape[0], -1, 2, 16).sum(-1) * scale
    q = r.reshape(x.shape).to(torch.int8)
    return Q8Rows(q, scale.repeat_interleave(2, dim=-1).reshape(x.shape[0], -1), sums.reshape(x.shape[0], -1))


@triton.jit
def _q8_q2_k(w_ptr, row_off, sb, K, xw_ptr, xs_ptr, xm_ptr, PTX: tl.constexpr, BN: tl.constexpr):
    # a thread takes a 16-byte run c of the payload (h = c // 2, bytes l = 16 (c % 2) + 4 w + b): with
    # shift 2 s, word w holds the quants of columns 128 h + 32 s + l, sub-block 8 h + 2 s + c % 2, four
    # bytes of one activation word. side (20 B): scales[16] (low nibble scale, high min), f16 d, dmin.
    # The activations are loaded in the words' shape [BN, c, w] (16 bytes a thread), at the same
    # addresses for every row, so that no value changes threads
    c = tl.arange(0, 4)
    h = (c >> 1)[None, :]
    lh = (c & 1)[None, :]
    w = tl.arange(0, 4)[None, None, :]  # 16-byte loads, split in registers as [2, 2]
    words = tl.load((w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))[:, None, None]
                    + (4 * c)[None, :, None] + w)  # fmt: skip
    words = tl.reshape(words, [BN, 4, 2, 2])
    rows = tl.zeros([BN], tl.int32)[:, None]
    run = (rows + sb * 64 + 32 * h + 4 * lh)[:, :, None] + w  # activation words of the run for s = 0
    side = row_off[:, None] + K // 4 + sb * 20
    acc_q = tl.zeros([BN, 4], tl.float32)
    acc_m = tl.zeros([BN, 4], tl.float32)
    for s in tl.static_range(4):
        q = (words >> (2 * s)) & 0x03030303
        xw = tl.reshape(tl.load(xw_ptr + run + 8 * s), [BN, 4, 2, 2])
        t = _dp4a_last2(q, xw, tl.zeros([BN, 4], tl.int32), PTX)  # [BN, c]
        sc = tl.load(w_ptr + side + 8 * h + 2 * s + lh).to(tl.int32)
        xs = tl.load(xs_ptr + (rows + sb * 16 + 8 * h + 2 * s + lh))
        xm = tl.load(xm_ptr + (rows + sb * 16 + 8 * h + 2 * s + lh))
        acc_q += (t * (sc & 15)).to(tl.float32) * xs
        acc_m += (sc >> 4).to(tl.float32) * xm
    d = tl.load((w_ptr + side + 16).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 18).to(tl.pointer_type(tl.float16))).to(tl.float32)
    return acc_q * d - acc_m * dmin


@triton.jit
def _byte(word, t: tl.constexpr, PTX: tl.constexpr):
    """Byte t of uint32 words as int32 in 0..255: one prmt on NVIDIA (a shift and a mask elsewhere)."""
    if PTX:  # selector: byte t, then three bytes of the zero operand
        selector = tl.full(word.shape, 0x4440 + t, tl.int32)
        return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, 0, $2;", constraints="=r,r,r", args=[word, selector],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    return ((word >> (8 * t)) & 255).to(tl.int32)


@triton.jit
def _pair_words(words, BN: tl.constexpr):
    """[BN, 8, 4] words (lattice rows t and t + 1 of each group, two words each) -> row t's [BN, 8, 2],
    row t + 1's: in-thread (the 16 bytes of a load stay in its thread)."""
    return tl.split(tl.permute(tl.reshape(words, [BN, 8, 2, 2]), (0, 1, 3, 2)))


@triton.jit
def _signed_values(select, lo, PTX: tl.constexpr):
    """The 4 int8 values the low 4 nibbles of `select` pick (nibble n: byte n of LATTICE_LO:LATTICE_HI),
    as one word: one prmt on NVIDIA, with `lo` (LATTICE_LO, loaded: `LATTICE_AT`) in a register."""
    if PTX:
        return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                         args=[lo + tl.zeros(select.shape, tl.int32),
                                               tl.full(select.shape, LATTICE_HI, tl.int32), select],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    word = tl.zeros(select.shape, tl.int32)
    for i in tl.static_range(4):
        n = (select >> (4 * i)) & 7
        byte = tl.where(n < 4, LATTICE_LO >> (8 * (n & 3)), LATTICE_HI >> (8 * (n & 3))) & 255
        word |= byte << (8 * i)
    return word


@triton.jit
def _lattice_dot(codes_ptr, signs_ptr, lo, points, aux, t: tl.constexpr, xw, isum, PTX: tl.constexpr):
    """isum + the dot products of the groups' lattice rows t, signed by their 7-bit sign index t,
    with the activation words xw [BN, g, half]: the row's codes OR its signs pick the signed values."""
    select = tl.load(codes_ptr + _byte(points, t, PTX)) | tl.load(signs_ptr + ((aux >> (7 * t)) & 127))
    values = tl.join(_signed_values(select, lo, PTX), _signed_values(select >> 16, lo, PTX))  # [BN, g, half]
    return _dp4a_last(values, xw, isum, PTX)


@triton.jit
def _q8_iq2_xxs(w_ptr, tab_ptr, row_off, sb, K, xw_ptr, xs_ptr, PTX: tl.constexpr, BN: tl.constexpr):
    # payload (64 B per super-block): 8 groups of 32 columns, each two words: 4 bytes picking lattice
    # rows (8 columns each) and four 7-bit sign indexes (bits 0-27) with a scale s (bits 28-31);
    # side: f16 d; x = d (2 s + 1) / 8 * grid * sign. Group g is activation block 8 sb + g
    g = tl.arange(0, 8)
    half = tl.arange(0, 2)
    # a thread takes whole groups, as the lookups below want them (16-byte runs would be regrouped)
    words = tl.load((w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))[:, None, None]
                    + (2 * g)[None, :, None] + half[None, None, :])  # fmt: skip
    points, aux = tl.split(words)  # [BN, g]
    codes, signs = tab_ptr + CODES_AT, tab_ptr + SIGN_NIBBLES_AT
    lo = tl.load(tab_ptr + LATTICE_AT + g)[None, :]  # LATTICE_LO
    # the activations in the products' shape (every row the same addresses: no layout conversion)
    rows = tl.zeros([BN], tl.int32)[:, None, None]
    isum = tl.zeros([BN, 8], tl.int32)
    quad = tl.arange(0, 4)
    for tp in tl.static_range(2):  # lattice rows 2 tp and 2 tp + 1 of each group: their activation words
        at = rows + (sb * 64 + 8 * g + 4 * tp)[None, :, None] + quad[None, None, :]  # in one 16-byte load
        x0, x1 = _pair_words(tl.load(xw_ptr + at), BN)  # [BN, g, half]
        isum = _lattice_dot(codes, signs, lo, points, aux, 2 * tp, x0, isum, PTX)
        isum = _lattice_dot(codes, signs, lo, points, aux, 2 * tp + 1, x1, isum, PTX)
    xs, _ = tl.split(tl.load(xs_ptr + rows + (sb * 16 + 2 * g)[None, :, None] + half[None, None, :]))  # a scale pair
    d = tl.load((w_ptr + row_off + K // 4 + 2 * sb).to(tl.pointer_type(tl.float16))).to(tl.float32)
    part = (isum * (2 * (aux >> 28) + 1).to(tl.int32)).to(tl.float32) * xs
    return part * (0.125 * d)[:, None]


@triton.jit
def _q8_step(w_ptr, tab_ptr, row_off, sb, K, xw_ptr, xs_ptr, xm_ptr,
             WTYPE: tl.constexpr, PTX: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    if WTYPE == 10:
        return _q8_q2_k(w_ptr, row_off, sb, K, xw_ptr, xs_ptr, xm_ptr, PTX, BN)  # [BN, 4]
    else:
        return _q8_iq2_xxs(w_ptr, tab_ptr, row_off, sb, K, xw_ptr, xs_ptr, PTX, BN)  # [BN, 8]


@triton.jit
def q8_rows_dot(xw_ptr, xs_ptr, xm_ptr, x0, w1_ptr, w2_ptr, tab_ptr, row_off, K, WTYPE: tl.constexpr,
                BN: tl.constexpr, TWO: tl.constexpr, PTX: tl.constexpr, SBP: tl.constexpr):  # fmt: skip
    """Products [BN] of the rows at byte offsets row_off [BN] (int64) of w1 (and w2 when TWO) with one
    int8 activation row (`Q8Rows` buffers: q as int32 words, scales, sums; column 0 at element x0,
    a multiple of 256), over K columns; WTYPE in Q8_TYPES. SBP super-blocks a pass (K / 256 a multiple
    of it): their loads in flight together. The partial sums of each thread are added over
    super-blocks first, in order, and across threads once, after the loop: an order fixed by the shapes."""
    xw_ptr += x0 // 4  # the row's words, block scales and sums
    xs_ptr += x0 // 16
    xm_ptr += x0 // 16
    a1 = _q8_step(w1_ptr, tab_ptr, row_off, 0, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
    a2 = a1
    if TWO:
        a2 = _q8_step(w2_ptr, tab_ptr, row_off, 0, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
    for j in tl.static_range(1, SBP):
        a1 += _q8_step(w1_ptr, tab_ptr, row_off, j, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
        if TWO:
            a2 += _q8_step(w2_ptr, tab_ptr, row_off, j, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
    for sb0 in range(SBP, K // 256, SBP):
        for j in tl.static_range(SBP):
            a1 += _q8_step(w1_ptr, tab_ptr, row_off, sb0 + j, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
            if TWO:
                a2 += _q8_step(w2_ptr, tab_ptr, row_off, sb0 + j, K, xw_ptr, xs_ptr, xm_ptr, WTYPE, PTX, BN)
    return tl.sum(a1, axis=1), tl.sum(a2, axis=1)
