"""Dot products of activation rows with rows of GGUF blocks, decoded in registers: the decode loops
of the experts (`moe_experts`' decode form).

Each function covers one step of a K loop (BK columns: one 256-element super-block, or 256 columns
of Q8_0) for BN weight rows at byte offsets `row_off`, in the aligned layout of `weights.repack`.

`exact_step` keeps fp32 products: it returns [TB, BN, C] partial sums for TB activation rows (C
spans the threads; the caller adds the steps up and reduces C once, after the loop). Weights are
never built as floats by table lookups per element or int-to-float conversions: the quants are cut
out of 32-bit words with shifts and masks, turned into floats by or-ing them into the mantissa of
2^23 (`0x4B000000 | q` is 2^23 + q, one subtraction from q) and joined (`tl.join`) so that each
thread holds whole 16-byte runs and sums its products in registers. The K-quants' scales apply per
sub-block to the sums of q * x, the mins to the sums of x; IQ2_XXS looks up its lattice rows as
fp16 pairs (8 values per 16-byte read), flips their signs on the half's sign bit and widens them,
exactly.

`fast_step` (Precision.fast) feeds the tensor cores fp16 operands: the activations rounded to fp16,
the weights as exact small integers w' (Q2_K: sc * q <= 45, Q4_K: sc * q <= 945, IQ2_XXS: sign *
lattice value <= 43) written straight into fp16 bit patterns two at a time with integer operations
(`q * sc + 0x3C003C00` is the fp16 pair (1 + w0 / 2^s, 1 + w1 / 2^s), no conversion instruction).
The constant 1 is cancelled inside the same accumulator by a second product with -1, the super-
block scale d and the min terms (a product with the sub-block mins, exact in fp16) apply per
super-block, IQ2_XXS's group scale per 32-column product. The K order inside a step is permuted so
that each thread of the mma operand layout holds whole sub-blocks or lattice points: the
activations are gathered in the same order, so the product is unchanged. Its error is the fp16
rounding of the activations (relative 2^-12 per product; tests/triton/test_moe.py bounds it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.quant_blocks import load_weight_tile
from dwarfstar.gguf.dequant import _iq2xxs_tables

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: or-ing an integer q < 2^23 into them gives 2^23 + q
FP16_ONE_PAIR = tl.constexpr(0x3C003C00)  # two fp16 1.0 in one word

# the block types with decoders here; others go through quant_blocks.load_weight_tile
EXACT_TYPES = (8, 10, 12, 16, 39)  # Q8_0, Q2_K, Q4_K, IQ2_XXS, MXFP4
FAST_TYPES = (10, 12, 16)  # Q2_K, Q4_K, IQ2_XXS


@functools.cache
def _tables(device: torch.device) -> torch.Tensor:
    grid, ksigns = _iq2xxs_tables()
    # fp16 lattice values, 8 per row (4 words of two halves), then per 7-bit sign index the xor masks
    # of its 8 signs (parity bit included) on the fp16 sign bits, 4 words of two halves
    halves = grid.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    grid16 = halves[:, 0::2] | (halves[:, 1::2] << 16)
    bits = (ksigns.to(torch.int64)[:, None] >> torch.arange(8)) & 1
    masks = (bits[:, 0::2] << 15) | (bits[:, 1::2] << 31)
    # the same signs in one word: value 2 e's at bit 15 - e, 2 e + 1's at bit 31 - e, so that word e's
    # mask is the word shifted left by e, its sign bits kept
    spread = (masks >> torch.arange(4)).sum(-1)
    one = torch.tensor([1.0]).view(torch.int32).to(torch.int64)
    flat = torch.cat([grid16.reshape(-1).to(torch.int64), masks.reshape(-1), spread, one])
    return torch.where(flat >= 2**31, flat - 2**32, flat).to(torch.int32).to(device)


def tables(device: torch.device | str) -> torch.Tensor:
    """IQ2_XXS lookup tables as one int32 tensor (stays in cache): the lattice as fp16 pairs (256 x 4
    words), per 7-bit sign index the masks of its 8 signs (parity included) on fp16 pairs (4 words),
    then the same 8 signs spread over one word (`SPREAD_AT`: 512 bytes, 4 cache lines); then the
    bits of 1.0."""
    return _tables(torch.device(device))


GRID16_AT = tl.constexpr(0)  # word offsets of the fp16 lattice and the sign masks in `tables`
SIGNS16_AT = tl.constexpr(1024)
SPREAD_AT = tl.constexpr(1536)
ONE_AT = tl.constexpr(1664)
SIGN_BITS = tl.constexpr(-0x7FFF8000)  # 0x80008000: the sign bits of two fp16 halves


@triton.jit
def _bytes_f32(v):
    """The 4 bytes of each word as 2^23 + byte (float32 bits), joined [..., 2, 2]: byte i + 2 j."""
    b0 = (v & 0xFF) | MAGIC
    b1 = ((v >> 8) & 0xFF) | MAGIC
    b2 = ((v >> 16) & 0xFF) | MAGIC
    b3 = (v >> 24) | MAGIC
    return tl.join(tl.join(b0, b1), tl.join(b2, b3))


@triton.jit
def _field_f32(w, one, AT: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit field at bit AT of each word as the float 1 + q / 2^BITS: shifted to the top of the
    mantissa and or-ed into `one`, the bits of 1.0 (read from memory: a register, where a constant
    would leave the compiler a second constant to rebuild in every instruction)."""
    if AT + BITS <= 23:
        top = w << (23 - BITS - AT)
    else:
        top = w >> (AT + BITS - 23)
    return (top & (((1 << BITS) - 1) << (23 - BITS))) | one


@triton.jit
def _fma_last(a, b, acc):
    """acc + sum of a * b over the last dim (2), as a multiply-add chain."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a1 * b1 + (a0 * b0 + acc)


@triton.jit
def _chain(a, b, acc, N: tl.constexpr):
    """acc + sum of a * b over the last N dims (each 2, held by one thread), as one multiply-add chain."""
    if N == 1:
        return _fma_last(a, b, acc)
    else:
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return _chain(a1, b1, _chain(a0, b0, acc, N - 1), N - 1)


@triton.jit
def _dot_last2(a, b):
    """Sum of a * b over the last two dims (2, 2)."""
    return _chain(a, b, 0.0, 2)


@triton.jit
def _x_rows(x_ptr, x_off, x_ok, k, k_ok):
    """Activations float32 [TB, *k.shape]: rows at element offsets x_off [TB] (int64), masked by
    x_ok [TB], columns k where k_ok."""
    for _ in tl.static_range(len(k.shape)):
        x_off = tl.expand_dims(x_off, len(x_off.shape))
        x_ok = tl.expand_dims(x_ok, len(x_ok.shape))
    return tl.load(x_ptr + x_off + k[None], mask=x_ok & k_ok[None], other=0.0).to(tl.float32)


@triton.jit
def _exact_q8_0(w_ptr, row_off, k0, K, x_ptr, x_off, x_ok, BN: tl.constexpr):
    # payload: int8 q[K]; side: f16 d per 32 columns. Each thread takes a 16-byte run (half a block);
    # q + 128 (the sign bit flipped) goes into the float: 2^23 + 128 + q
    c = tl.arange(0, 16)
    w = tl.arange(0, 4)
    i = tl.arange(0, 2)
    word = (4 * c)[:, None] + w[None, :]  # [16, 4] words of the 256 columns
    run_ok = (k0 + 16 * c) < K
    words = tl.load((w_ptr + row_off + k0).to(tl.pointer_type(tl.uint32))[:, None, None] + word[None],
                    mask=run_ok[None, :, None], other=0)  # fmt: skip
    q = _bytes_f32(words ^ tl.full([], 0x80808080, tl.uint32)).to(tl.float32, bitcast=True) - 8388736.0
    k = (4 * word)[:, :, None, None] + i[None, None, :, None] + (2 * i)[None, None, None, :]
    x = _x_rows(x_ptr, x_off, x_ok, k0 + k, k0 + k < K)  # [TB, 16, 4, 2, 2]; past K: q and x are 0
    part = tl.sum(_dot_last2(tl.reshape(q, [1, BN, 16, 4, 2, 2]), x[:, None]), axis=3)  # [TB, BN, 16]
    blk = (k0 // 32 + c // 2)[None, :]
    d = tl.load((w_ptr + row_off[:, None] + K + 2 * blk).to(tl.pointer_type(tl.float16)), mask=run_ok[None, :])
    return part * d.to(tl.float32)[None]


@triton.jit
def _q4_k_scale_min(w_ptr, side, BN: tl.constexpr):
    """Q4_K's eight 6-bit scales and mins (ggml's get_scale_min_k4) as uint8 [BN, 8] each."""
    j = tl.arange(0, 8)
    s_j = tl.load(w_ptr + side[:, None] + 4 + j[None, :])  # scales[j]
    s_j4 = tl.load(w_ptr + side[:, None] + 8 + j[None, :])  # scales[j + 4]
    s_jm4 = tl.load(w_ptr + side[:, None] + 4 + (j % 4)[None, :])  # scales[j - 4] where j >= 4
    low = (j < 4)[None, :]
    sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    return sc, mn


@triton.jit
def _nibbles(w, one, B: tl.constexpr):
    """Byte B's two nibbles of each word as floats 1 + q / 16, joined [..., n] (nibble n)."""
    return tl.join(_field_f32(w, one, 8 * B, 4), _field_f32(w, one, 8 * B + 4, 4))


@triton.jit
def _q4_k_sums(w_ptr, tab_ptr, row_off, sb, x_ptr, x_off, x_ok, k_base, BN: tl.constexpr):
    """For each of a Q4_K super-block's 8 16-byte runs (a thread each): the sums of q * x and of x over
    each of its two half sub-blocks (nibble n), [TB, BN, 8, 2] and [TB, 8, 2]. The quants are the
    floats 1 + q / 16, so the sum of q * x is 16 (sum of those times x - the sum of x). Element of run
    c, word w, byte b_i + 2 b_j and nibble n: column sb * 256 + k_base[c, n] + 4 w + b."""
    c = tl.arange(0, 8)
    w = tl.arange(0, 4)
    i = tl.arange(0, 2)
    payload = (w_ptr + row_off + sb * 128).to(tl.pointer_type(tl.uint32))
    words = tl.load(payload[:, None, None] + (4 * c)[None, :, None] + w[None, None, :])  # [BN, c, w]
    one = tl.load(tab_ptr + ONE_AT)
    q = tl.join(tl.join(_nibbles(words, one, 0), _nibbles(words, one, 1)),
                tl.join(_nibbles(words, one, 2), _nibbles(words, one, 3)))  # fmt: skip
    q = q.to(tl.float32, bitcast=True)  # [BN, c, w, n, b_i, b_j]
    b = i[:, None] + 2 * i[None, :]
    k = k_base[:, None, :, None, None] + (4 * w)[None, :, None, None, None] + b[None, None, None]
    x = _x_rows(x_ptr, x_off, x_ok, sb * 256 + k, k >= 0)  # [TB, c, w, n, b_i, b_j]
    sq = tl.sum(_dot_last2(tl.reshape(q, [1, BN, 8, 4, 2, 2, 2]), x[:, None]), axis=3)
    sx = tl.sum(tl.sum(tl.sum(x, axis=5), axis=4), axis=2)
    return 16 * (sq - sx[:, None]), sx


@triton.jit
def _q2_k_fields(w, one, B: tl.constexpr):
    """Byte B's four 2-bit fields of each word as floats 1 + q / 4, joined [..., s_hi, s_lo] (s = 2 s_hi +
    s_lo: the field at bit 8 B + 2 s)."""
    return tl.join(tl.join(_field_f32(w, one, 8 * B, 2), _field_f32(w, one, 8 * B + 4, 2)),
                   tl.join(_field_f32(w, one, 8 * B + 2, 2), _field_f32(w, one, 8 * B + 6, 2)))  # fmt: skip


@triton.jit
def _q2_k_byte(w0, w1, one, B: tl.constexpr):
    """Byte B's fields of the two words, [..., s_hi, s_lo, w]."""
    return tl.join(_q2_k_fields(w0, one, B), _q2_k_fields(w1, one, B))


@triton.jit
def _thread_words(words, BN: tl.constexpr):
    """A row's 16 words [BN, 16] as the two words of each thread's 8 bytes r: [r, BN] each."""
    return tl.split(tl.permute(tl.reshape(words, [BN, 8, 2]), (1, 0, 2)))


@triton.jit
def _exact_q2_k(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BN: tl.constexpr):
    # payload: qs[64] per super-block; byte 32 h + l holds elements 128 h + 32 s + l (s = 0..3) at
    # bit 2 s. side (20 B): scales[16] (low nibble scale, high min), f16 d, dmin. A thread takes 8
    # bytes, r = 4 h + 2 lh + f (l = 16 lh + 8 f + 4 w + b): 8 columns of 4 sub-blocks 8 h + 2 s + lh.
    # Every tensor is [r, BN, ...], the words' layout with the fields in the thread (s, then w, then
    # b last: its columns are consecutive), and the activations are loaded in that shape (the same
    # addresses for every row): no layout conversion in the loop
    words = tl.load((w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))[:, None] + tl.arange(0, 16)[None, :])
    w0, w1 = _thread_words(words, BN)
    one = tl.load(tab_ptr + ONE_AT)
    q = tl.join(tl.join(_q2_k_byte(w0, w1, one, 0), _q2_k_byte(w0, w1, one, 2)),
                tl.join(_q2_k_byte(w0, w1, one, 1), _q2_k_byte(w0, w1, one, 3)))  # fmt: skip
    q = q.to(tl.float32, bitcast=True)  # [r, BN, s_hi, s_lo, w, b_hi, b_lo]
    r = tl.arange(0, 8)
    i = tl.arange(0, 2)
    k = (
        (8 * r + 96 * (r // 4))[:, None, None, None, None, None]
        + tl.zeros([BN], tl.int32)[None, :, None, None, None, None]
        + (64 * i)[None, None, :, None, None, None]
        + (32 * i)[None, None, None, :, None, None]
        + (4 * i)[None, None, None, None, :, None]
        + tl.arange(0, 4)[None, None, None, None, None, :]
    )
    x = _x_rows(x_ptr, x_off, x_ok, sb * 256 + k, k >= 0)  # [TB, r, BN, s_hi, s_lo, w, b]
    sq = _chain(q[None], tl.reshape(x, [x.shape[0], 8, BN, 2, 2, 2, 2, 2]), 0.0, 3)  # [TB, r, BN, s_hi, s_lo]
    sx = tl.sum(tl.sum(x, axis=6), axis=5)
    # scale byte 8 h + 2 s + lh: byte lh + 2 s_lo of word 2 h + s_hi, loaded in the words' shape (word
    # j = 2 r + s_hi of a row's 16 takes side word 2 (j // 8) + j % 2), so in their layout
    side = row_off + K // 4 + sb * 20
    j = tl.arange(0, 16)
    sw = tl.load((w_ptr + side).to(tl.pointer_type(tl.uint32))[:, None] + (2 * (j // 8) + j % 2)[None, :])
    sw0, sw1 = _thread_words(sw, BN)
    lh8 = (8 * ((r // 2) % 2))[:, None]
    sw0, sw1 = sw0 >> lh8, sw1 >> lh8
    sc = tl.join(tl.join(sw0, sw1), tl.join(sw0 >> 16, sw1 >> 16))  # [r, BN, s_hi, s_lo]
    d = tl.load((w_ptr + side + 16).to(tl.pointer_type(tl.float16))).to(tl.float32)[None, :, None, None]
    dmin = tl.load((w_ptr + side + 18).to(tl.pointer_type(tl.float16))).to(tl.float32)[None, :, None, None]
    dl = (4.0 * d) * (sc & 15).to(tl.float32)
    ml = dmin * ((sc >> 4) & 15).to(tl.float32)
    part = (sq - sx) * dl[None] - sx * ml[None]  # [TB, r, BN, s_hi, s_lo]
    return tl.reshape(tl.permute(part, (0, 2, 1, 3, 4)), [part.shape[0], BN, 32])


@triton.jit
def _exact_q4_k(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BN: tl.constexpr):
    # payload: qs[128] per super-block; byte 32 p + l holds element 64 p + l (low nibble, sub-block
    # 2 p) and 64 p + 32 + l (high nibble, 2 p + 1). A thread takes a 16-byte run c (p = c // 2,
    # l = 16 (c % 2) + 0..15): half of two sub-blocks. side (16 B): f16 d, dmin, 12 scale bytes
    c = tl.arange(0, 8)
    k_base = (64 * (c // 2) + 16 * (c % 2))[:, None] + (32 * tl.arange(0, 2))[None, :]
    sq, sx = _q4_k_sums(w_ptr, tab_ptr, row_off, sb, x_ptr, x_off, x_ok, k_base, BN)
    side = row_off + K // 2 + sb * 16
    sc, mn = _q4_k_scale_min(w_ptr, side, BN)
    d = tl.load((w_ptr + side).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    # sub-block 2 p + n of run c = 2 p + (c % 2): the [BN, 4, 2] scales repeated for both runs of p
    dl = tl.reshape(tl.broadcast_to(tl.reshape(d[:, None] * sc.to(tl.float32), [BN, 4, 1, 2]), [BN, 4, 2, 2]),
                    [BN, 8, 2])  # fmt: skip
    ml = tl.reshape(tl.broadcast_to(tl.reshape(dmin[:, None] * mn.to(tl.float32), [BN, 4, 1, 2]), [BN, 4, 2, 2]),
                    [BN, 8, 2])  # fmt: skip
    return tl.reshape(sq * dl[None] - sx[:, None] * ml[None], [sx.shape[0], BN, 16])


@triton.jit
def _widen_halves(enc, PTX: tl.constexpr):
    """int32 words of two fp16 bit patterns -> float32 [..., 2] (low half first). On NVIDIA each half
    is converted where it lies in the word: through fp16 tensors the compiler packs the halves of two
    words together first (a byte permute per pair of values)."""
    if PTX:
        lo, hi = tl.inline_asm_elementwise(
            asm="{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}",
            constraints="=r,=r,r", args=[enc], dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
        return tl.join(lo, hi)
    else:
        return _halves(enc).to(tl.float32)


@triton.jit
def _exact_iq2_xxs(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BN: tl.constexpr, PTX: tl.constexpr):
    # payload (64 B per super-block): 8 groups of 32 elements, each two words: 4 bytes picking lattice
    # rows (8 elements each) and four 7-bit sign indexes (bits 0-27) with a scale s (bits 28-31);
    # the 8th sign makes the count of minus signs even. side: f16 d. x = d (0.5 + s) / 4 * grid * sign.
    # The lattice rows come from `tables` as fp16 pairs, 16 bytes a row, and the 8 signs of each
    # index as one word whose shifts put them on the halves' sign bits (`SPREAD_AT`): one shift and
    # one xor per word; each value then widens to fp32 exactly. A lookup is a gather whose lanes
    # touch about as many cache lines as they pick rows (`plan.predict.gather_lines`), and those, as
    # much as its instructions, bound this loop: rows from a 4 KB table touch 20 lines a warp-gather
    # and the 512-byte sign words 4, against 34 with the signs as fp16 pair masks (2 KB) and 91 with
    # float32 rows and masks (two 16-byte gathers each, from 8 KB and 4 KB). The group leads the
    # row in every tensor below: the lookups' layout (a lattice row in a thread, lanes over the
    # leading dims) then holds each group where the words put it, and the activations, loaded at
    # the same addresses for every row (16 bytes a load), where the products want them: no layout
    # conversion
    words = tl.load((w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))[:, None]
                    + tl.arange(0, 16)[None, :])  # fmt: skip
    points, aux = tl.split(tl.reshape(words, [BN, 8, 2]))  # [BN, g]
    points, aux = tl.trans(points), tl.trans(aux)  # [g, BN]
    pick = tl.join(tl.join(points & 255, (points >> 8) & 255), tl.join((points >> 16) & 255, points >> 24))
    signs = tl.join(tl.join(aux & 127, (aux >> 7) & 127), tl.join((aux >> 14) & 127, (aux >> 21) & 127))
    e = tl.arange(0, 4)  # a row's 4 words: values 2 e and 2 e + 1
    grid = tl.load(tab_ptr + GRID16_AT + (4 * pick)[:, :, :, :, None] + e[None, None, None, None, :])
    spread = tl.load(tab_ptr + SPREAD_AT + signs)  # [g, BN, c_i, c_j]
    v = _widen_halves(grid ^ ((spread[:, :, :, :, None] << e[None, None, None, None, :]) & SIGN_BITS), PTX)
    i = tl.arange(0, 2)
    k = (
        (32 * tl.arange(0, 8))[:, None, None, None, None, None]
        + tl.zeros([BN], tl.int32)[None, :, None, None, None, None]
        + (8 * i)[None, None, :, None, None, None]
        + (16 * i)[None, None, None, :, None, None]
        + (4 * i)[None, None, None, None, :, None]
        + tl.arange(0, 4)[None, None, None, None, None, :]
    )
    x = _x_rows(x_ptr, x_off, x_ok, sb * 256 + k, k >= 0)  # [TB, g, BN, c_i, c_j, e_hi, 4]
    x = tl.reshape(x, [x.shape[0], 8, BN, 2, 2, 2, 2, 2])  # [TB, g, BN, c_i, c_j, e_hi, e_lo, half]
    prod = _chain(tl.reshape(v, [8, BN, 2, 2, 2, 2, 2])[None], x, 0.0, 3)  # a lattice row's 8 products
    part = tl.sum(tl.sum(prod, axis=4), axis=3)  # [TB, g, BN]
    d = tl.load((w_ptr + row_off + K // 4 + 2 * sb).to(tl.pointer_type(tl.float16))).to(tl.float32)
    db = d[None, :] * (0.5 + (aux >> 28).to(tl.float32)) * 0.25  # [g, BN]
    return tl.permute(part * db[None], (0, 2, 1))  # [TB, BN, g]


@triton.jit
def _e2m1_bits(w, AT: tl.constexpr):
    """The E2M1 nibble at bit AT of each word as the float32 bits of its value times 2^-126: the sign to
    bit 31, the exponent and mantissa bits to bits 24-22, so E2M1's subnormal (0.5) is float32's."""
    if AT <= 22:
        mag = w << (22 - AT)
    else:
        mag = w >> (AT - 22)
    return (mag & 0x01C00000) | ((w << (28 - AT)) & 0x80000000)


@triton.jit
def _e2m1_byte(w, H: tl.constexpr):
    """Nibble H (0 low, 1 high) of bytes 0-3 of each word, joined [..., 2, 2] (byte i + 2 j)."""
    return tl.join(tl.join(_e2m1_bits(w, 4 * H), _e2m1_bits(w, 8 + 4 * H)),
                   tl.join(_e2m1_bits(w, 16 + 4 * H), _e2m1_bits(w, 24 + 4 * H)))  # fmt: skip


@triton.jit
def _exact_mxfp4(w_ptr, row_off, k0, K, x_ptr, x_off, x_ok, BN: tl.constexpr):
    # payload: 16 bytes per block of 32 columns, byte j holding element j (low nibble) and j + 16 (high);
    # side: an E8M0 exponent e per block, x = fp4 * 2^(e-127). A thread takes a 16-byte run, one block;
    # the nibbles become floats fp4 * 2^-126 by bit moves alone, scaled back by 2^126 (exact: float32
    # keeps subnormals here), and the block's sum by 2^(e-127) (float32 bits e << 23; 2^-127 for e = 0)
    c = tl.arange(0, 8)
    w = tl.arange(0, 4)
    i = tl.arange(0, 2)
    run_ok = (k0 + 32 * c) < K
    words = tl.load((w_ptr + row_off + k0 // 2).to(tl.pointer_type(tl.uint32))[:, None, None]
                    + (4 * c)[None, :, None] + w[None, None, :], mask=run_ok[None, :, None], other=0)  # fmt: skip
    q = tl.join(_e2m1_byte(words, 0), _e2m1_byte(words, 1))  # [BN, c, w, b_i, b_j, h]
    q = q.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126
    k = (
        (32 * c)[:, None, None, None, None]
        + (4 * w)[None, :, None, None, None]
        + i[None, None, :, None, None]
        + (2 * i)[None, None, None, :, None]
        + (16 * i)[None, None, None, None, :]
    )
    x = _x_rows(x_ptr, x_off, x_ok, k0 + k, k0 + k < K)  # [TB, c, w, b_i, b_j, h]; past K: q and x are 0
    part = tl.sum(_chain(tl.reshape(q, [1, BN, 8, 4, 2, 2, 2]), x[:, None], 0.0, 3), axis=3)  # [TB, BN, c]
    e = tl.load(w_ptr + row_off[:, None] + K // 2 + (k0 // 32 + c)[None, :], mask=run_ok[None, :], other=0)
    e = e.to(tl.int32)
    scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
    return part * scale[None]


@triton.jit
def exact_step(w_ptr, tab_ptr, row_off, k0, K, x_ptr, x_off, x_ok,
               WTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """fp32 partial sums [TB, BN, C] of rows `row_off` [BN] (int64 byte offsets) times activation rows
    x_ptr + x_off [TB] (int64 element offsets; x_ok [TB] masks rows) over columns k0..k0+BK. BK is
    256 for the types with decoders here; the others take `load_weight_tile`'s BK (C = 1). PTX: NVIDIA
    inline assembly allowed (`_widen_halves`)."""
    if WTYPE == 8:
        return _exact_q8_0(w_ptr, row_off, k0, K, x_ptr, x_off, x_ok, BN)
    elif WTYPE == 10:
        return _exact_q2_k(w_ptr, tab_ptr, row_off, k0 // 256, K, x_ptr, x_off, x_ok, BN)
    elif WTYPE == 12:
        return _exact_q4_k(w_ptr, tab_ptr, row_off, k0 // 256, K, x_ptr, x_off, x_ok, BN)
    elif WTYPE == 16:
        return _exact_iq2_xxs(w_ptr, tab_ptr, row_off, k0 // 256, K, x_ptr, x_off, x_ok, BN, PTX)
    elif WTYPE == 39:
        return _exact_mxfp4(w_ptr, row_off, k0, K, x_ptr, x_off, x_ok, BN)
    else:
        tile = load_weight_tile(w_ptr, tab_ptr, row_off, k0, K, WTYPE, BN, BK)  # [BN, BK]
        k = k0 + tl.arange(0, BK)
        x = _x_rows(x_ptr, x_off, x_ok, k, k < K)
        return tl.sum(tile[None] * x[:, None], axis=2)[:, :, None]


@triton.jit
def _x_operand(x_ptr, x_off, x_ok, e, BCAST: tl.constexpr):
    """fp16 [E, 16] mma operand: activations at columns e [E] of the rows at element offsets x_off
    [16] (masked by x_ok); BCAST: the row x_off[0] in every column (one token's entry)."""
    if BCAST:
        x = tl.load(x_ptr + tl.max(x_off, axis=0) + e).to(tl.float16)
        return tl.broadcast_to(x[:, None], [e.shape[0], 16])
    else:
        return tl.load(x_ptr + x_off[None, :] + e[:, None], mask=x_ok[None, :], other=0.0).to(tl.float16)


@triton.jit
def _halves(enc):
    """int32 words of two fp16 bit patterns -> fp16 [..., 2] (low half first)."""
    lo = (enc & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (enc >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _broadcast_q2_k(v, BN: tl.constexpr):
    """Per-sub-block values [BN, t, shi, slo] spread over their K positions, as `_fast_q2_k` orders them."""
    v = tl.broadcast_to(v[:, :, None, None, :, :, None], [BN, 4, 4, 2, 2, 2, 2])
    return tl.reshape(tl.permute(v, 0, 4, 5, 2, 1, 3, 6), [BN, 256])


@triton.jit
def _fast_q2_k(w_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST: tl.constexpr, BN: tl.constexpr):
    # lane t of an mma quad takes the 16-byte run t (h = t // 2, l = 16 (t % 2) + 4 w + b): its 64
    # K positions are the 4 sub-blocks of those bytes, one per s. Word (t, w) shifted right by
    # 8 hi + 4 shi and masked with 0x00030003 << 2 slo holds q * 4^slo of bytes hi and hi + 2 in its
    # halves (s = 2 shi + slo); times sc * 16 / 4^slo plus 0x3C003C00 it is the fp16 pair 1 + q sc / 64
    t = tl.arange(0, 4)
    two = tl.arange(0, 2)
    words = tl.load((w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))[:, None, None]
                    + (4 * t)[None, :, None] + t[None, None, :])  # [BN, t, w]  # fmt: skip
    shift = ((8 * two)[:, None] + (4 * two)[None, :]).to(tl.uint32)  # [hi, shi]
    v = words[:, :, :, None, None] >> shift[None, None, None, :, :]  # [BN, t, w, hi, shi]
    mask = (0x00030003 << (2 * two)).to(tl.uint32)  # [slo]
    q = v[:, :, :, :, :, None] & mask[None, None, None, None, None, :]  # [BN, t, w, hi, shi, slo]
    side = row_off + K // 4 + sb * 20
    sc = tl.load(w_ptr + side[:, None] + tl.arange(0, 16)[None, :]).to(tl.uint32)  # sub-block 8 h + 2 s + lh
    sc = tl.reshape(tl.permute(tl.reshape(sc, [BN, 2, 2, 2, 2]), 0, 1, 4, 2, 3), [BN, 4, 2, 2])  # [BN, t, shi, slo]
    mult = (sc & 15) << (4 - 2 * two)[None, None, None, :]
    enc = q * mult[:, :, None, None, :, :] + FP16_ONE_PAIR
    w16 = tl.reshape(tl.permute(_halves(enc), 0, 4, 5, 2, 1, 3, 6), [BN, 256])  # [BN, shi, slo, w, t, hi, lo]
    m16 = _broadcast_q2_k((sc >> 4).to(tl.float16), BN)
    # -1 everywhere, derived from the scales (sc >> 8 is 0) so that it shares the operands' layout
    minus = _broadcast_q2_k((sc >> 8).to(tl.float16) - 1.0, BN)
    p = tl.arange(0, 256)
    lane = (p // 4) % 4
    e = 128 * (lane // 2) + 16 * (lane % 2) + 32 * (p // 64) + 4 * ((p // 16) % 4) + (p // 2) % 2 + 2 * (p % 2)
    xb = _x_operand(x_ptr, x_off, x_ok, sb * 256 + e, BCAST)
    part = tl.dot(w16, xb)
    part = tl.dot(minus, xb, part)  # sum of q sc x / 64
    mins = tl.dot(m16, xb)
    d = tl.load((w_ptr + side + 16).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 18).to(tl.pointer_type(tl.float16))).to(tl.float32)
    return part * (64.0 * d)[:, None] - mins * dmin[:, None]


@triton.jit
def _broadcast_q4_k(v, BN: tl.constexpr):
    """Per-sub-block values [BN, 8 = 2 t + n] spread over their K positions, as `_fast_q4_k` orders them."""
    v = tl.broadcast_to(tl.reshape(v, [BN, 4, 2])[:, :, None, None, :, None], [BN, 4, 8, 2, 2, 2])
    return tl.reshape(tl.permute(v, 0, 2, 4, 1, 3, 5), [BN, 256])


@triton.jit
def _fast_q4_k(w_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST: tl.constexpr, BN: tl.constexpr):
    # lane t takes the 32 bytes of qs group p = t: sub-blocks 2 t (low nibbles) and 2 t + 1. Word
    # (t, w) shifted right by 8 hi + 4 n and masked with 0x000F000F holds nibble n of bytes hi and
    # hi + 2; times sc plus 0x3C003C00 it is the fp16 pair 1 + q sc / 1024 (q sc <= 945)
    t = tl.arange(0, 4)
    two = tl.arange(0, 2)
    words = tl.load((w_ptr + row_off + sb * 128).to(tl.pointer_type(tl.uint32))[:, None, None]
                    + (8 * t)[None, :, None] + tl.arange(0, 8)[None, None, :])  # [BN, t, w]  # fmt: skip
    shift = ((8 * two)[:, None] + (4 * two)[None, :]).to(tl.uint32)  # [hi, n]
    q = (words[:, :, :, None, None] >> shift[None, None, None, :, :]) & 0x000F000F  # [BN, t, w, hi, n]
    side = row_off + K // 2 + sb * 16
    sc, mn = _q4_k_scale_min(w_ptr, side, BN)
    sc = tl.reshape(sc.to(tl.uint32), [BN, 4, 2])  # [BN, t, n]
    enc = q * sc[:, :, None, None, :] + FP16_ONE_PAIR
    w16 = tl.reshape(tl.permute(_halves(enc), 0, 2, 4, 1, 3, 5), [BN, 256])  # [BN, w, n, t, hi, lo]
    m16 = _broadcast_q4_k(mn.to(tl.float16), BN)
    minus = _broadcast_q4_k((mn >> 8).to(tl.float16) - 1.0, BN)  # -1, shaped like the operands (mn >> 8 is 0)
    p = tl.arange(0, 256)
    step = p // 16
    e = 64 * ((p // 4) % 4) + 32 * (step % 2) + 4 * (step // 2) + (p // 2) % 2 + 2 * (p % 2)
    xb = _x_operand(x_ptr, x_off, x_ok, sb * 256 + e, BCAST)
    part = tl.dot(w16, xb)
    part = tl.dot(minus, xb, part)  # sum of q sc x / 1024
    mins = tl.dot(m16, xb)
    d = tl.load((w_ptr + side).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    return part * (1024.0 * d)[:, None] - mins * dmin[:, None]


@triton.jit
def _fast_iq2_xxs(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST: tl.constexpr, BN: tl.constexpr):
    # one 32-column product per group (its scale differs): lane t takes lattice point t of the group
    # (8 columns), looked up as 4 words of fp16 pairs and signed by xor with the sign table's masks.
    # Word v of point t goes to K positions 8 v + 2 t (+ its half): in NVIDIA's mma operand layout
    # lane t of a quad holds positions 2 t, 2 t + 1 of each 8, so the words it looked up are its
    # operand registers as loaded (on one warp: `moe_experts.decode_ffn`); the activations are
    # gathered in the same order, so the product is unchanged
    t = tl.arange(0, 4)
    v = tl.arange(0, 4)
    p = tl.arange(0, 32)
    col = 8 * ((p // 2) % 4) + 2 * (p // 8) + p % 2  # the column at K position p
    base = (w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))
    d = tl.load((w_ptr + row_off + K // 4 + 2 * sb).to(tl.pointer_type(tl.float16))).to(tl.float32)
    acc = tl.zeros([BN, 16], tl.float32)
    for g in tl.static_range(8):
        points = tl.load(base + 2 * g)
        aux = tl.load(base + 2 * g + 1)
        pick = ((points[:, None] >> (8 * t)[None, :].to(tl.uint32)) & 255).to(tl.int32)  # [BN, t]
        signs = ((aux[:, None] >> (7 * t)[None, :].to(tl.uint32)) & 127).to(tl.int32)
        grid = tl.load(tab_ptr + GRID16_AT + (4 * pick)[:, :, None] + v[None, None, :])  # [BN, t, v]
        flip = tl.load(tab_ptr + SIGNS16_AT + (4 * signs)[:, :, None] + v[None, None, :])
        w16 = tl.reshape(tl.permute(_halves(grid ^ flip), 0, 2, 1, 3), [BN, 32])
        xb = _x_operand(x_ptr, x_off, x_ok, sb * 256 + 32 * g + col, BCAST)
        db = d * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
        acc += tl.dot(w16, xb) * db[:, None]
    return acc


@triton.jit
def fast_step(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok,
              BCAST: tl.constexpr, WTYPE: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """[BN, 16] float32 products of super-block sb of rows `row_off` [BN] with 16 activation rows
    (`_x_operand`) through fp16 tensor-core operands; WTYPE in FAST_TYPES, BN a multiple of 16."""
    if WTYPE == 10:
        return _fast_q2_k(w_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST, BN)
    elif WTYPE == 12:
        return _fast_q4_k(w_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST, BN)
    else:
        return _fast_iq2_xxs(w_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST, BN)
