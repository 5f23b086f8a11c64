"""Shared header: GGUF quant blocks decoded 16 weights ("a slice") at a time, read in place.

A slice is 16 consecutive weights of a row: half a Q8_0 block, one of the 16 sub-blocks of a Q2_K
block (which are 16 wide), half a Q4_K sub-block, or two grid entries of an IQ2_XXS group. Every
kernel splits its work into slices, so one decoder per type serves them all.

The decoders do exactly the float32 operations of `dwarfstar/gguf/dequant.py`, in the same order;
every product there is exact, so a fused multiply-add cannot change a bit and the weights match the
reference dequantizer bit for bit.
"""

from __future__ import annotations

import functools

from dwarfstar.gguf.dequant import _iq2xxs_tables

_DECODERS = r"""
// ggml type ids the kernels are specialised on
static constant constexpr const int Q8_0 = 8;
static constant constexpr const int Q2_K = 10;
static constant constexpr const int Q4_K = 12;
static constant constexpr const int IQ2_XXS = 16;
static constant constexpr const uint SLICE = 16;

template <int QTYPE>
constexpr uint block_elems() {
  return QTYPE == Q8_0 ? 32 : 256;
}

template <int QTYPE>
constexpr uint block_bytes() {
  return QTYPE == Q8_0 ? 34 : QTYPE == Q2_K ? 84 : QTYPE == Q4_K ? 144 : 66;
}

// Blocks start at any byte (34, 84 and 66 are not multiples of 4), so wider fields are assembled
// from bytes.
inline float f16_at(device const uint8_t* p) {
  return float(as_type<half>(ushort(p[0] | (p[1] << 8))));
}

inline uint u32_at(device const uint8_t* p) {
  return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

// ggml's get_scale_min_k4: eight 6-bit scales and mins packed in 12 bytes
inline void q4_k_scale_min(device const uint8_t* q, uint j, thread uint& sc, thread uint& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// IQ2_XXS stores 7 sign bits per 8 weights; the 8th makes the number of negatives even
inline uint iq2_signs(uint index) {
  return index | ((metal::popcount(index) & 1) << 7);
}

// The 16 weights of slice `slice` of the block at `block`.
template <int QTYPE>
inline void dequant_slice(device const uint8_t* block, uint slice, thread float* out) {
  if (QTYPE == Q8_0) {
    // f16 d, int8 q[32]: x = d * q
    const float d = f16_at(block);
    device const int8_t* q = (device const int8_t*)(block + 2) + SLICE * slice;
    for (uint i = 0; i < SLICE; i++) {
      out[i] = float(q[i]) * d;
    }
  } else if (QTYPE == Q2_K) {
    // u8 scales[16], u8 qs[64], f16 d, f16 dmin; sub-block j = 8h + 2s + (l >= 16) holds elements
    // 16j..16j+15, at bit shift 2s of qs[32h + l]
    const uint8_t sc = block[slice];
    const float dl = f16_at(block + 80) * float(sc & 0xF);
    const float ml = f16_at(block + 82) * float(sc >> 4);
    const uint h = slice / 8, shift = 2 * ((slice % 8) / 2);
    device const uint8_t* qs = block + 16 + 32 * h + 16 * (slice & 1);
    for (uint i = 0; i < SLICE; i++) {
      out[i] = dl * float((qs[i] >> shift) & 3) - ml;
    }
  } else if (QTYPE == Q4_K) {
    // f16 d, f16 dmin, u8 scales[12], u8 qs[128]; sub-blocks 2p and 2p+1 (32 wide) share
    // qs[32p..32p+31], low nibble then high nibble
    const uint sub = slice / 2;
    uint sc, m;
    q4_k_scale_min(block + 4, sub, sc, m);
    const float dl = f16_at(block) * float(sc);
    const float ml = f16_at(block + 2) * float(m);
    const uint shift = 4 * (sub % 2);
    device const uint8_t* qs = block + 16 + 32 * (sub / 2) + 16 * (slice & 1);
    for (uint i = 0; i < SLICE; i++) {
      out[i] = dl * float((qs[i] >> shift) & 0xF) - ml;
    }
  } else {
    // IQ2_XXS: f16 d, then 8 groups of 8 bytes for 32 weights: 4 grid indices, then a u32 with four
    // 7-bit sign indices (bits 0..27) and a 4-bit scale (bits 28..31); x = db * grid * sign
    device const uint8_t* group = block + 2 + 8 * (slice / 2);
    const uint aux = u32_at(group + 4);
    const float db = f16_at(block) * (0.5f + float(aux >> 28)) * 0.25f;
    for (uint e = 0; e < 2; e++) {
      const uint k = 2 * (slice & 1) + e;
      const uint signs = iq2_signs((aux >> (7 * k)) & 127);
      for (uint j = 0; j < 8; j++) {
        const float v = db * float(IQ2XXS_GRID[group[k]][j]);
        out[8 * e + j] = (signs >> j) & 1 ? -v : v;
      }
    }
  }
}
"""


@functools.cache
def header() -> str:
    """The decoders with the IQ2_XXS grid, generated from the same table the torch dequantizer uses."""
    grid, _ = _iq2xxs_tables()
    rows = ",\n".join("  {" + ", ".join(str(int(v)) for v in row) + "}" for row in grid.tolist())
    return f"constant uint8_t IQ2XXS_GRID[256][8] = {{\n{rows}\n}};\n" + _DECODERS
