"""Shared header of the tiled kernels: a 32-row x 32-token output tile per threadgroup of 256 threads.

The weight tile (32 rows x 32 inputs) is decoded once into threadgroup memory and reused by all 32
tokens of the tile; each thread accumulates 4 outputs (one row, 4 tokens). Plain float FMAs, no
simdgroup matrices yet: correctness first, the tile product is where tuning would start.
"""

SOURCE = r"""
static constant constexpr const uint TILE_ROWS = 32;
static constant constexpr const uint TILE_TOKENS = 32;
static constant constexpr const uint TILE_K = 32;
static constant constexpr const uint TILE_STRIDE = TILE_K + 1;  // padding: threads of a row hit distinct banks
static constant constexpr const uint TILE_THREADS = 256;
static constant constexpr const uint TOKENS_PER_THREAD = TILE_ROWS * TILE_TOKENS / TILE_THREADS;

template <int QTYPE, int COLS>
constexpr ulong row_bytes() {
  return ulong(COLS / block_elems<QTYPE>()) * block_bytes<QTYPE>();
}

// Decode inputs k0..k0+31 of the tile's rows (`rows` points at the first; rows from n_valid on are
// zeros) into tile[r * TILE_STRIDE + k].
template <int QTYPE, int COLS>
inline void load_w_tile(device const uint8_t* rows, uint n_valid, uint k0, uint tid, threadgroup float* tile) {
  constexpr uint PARTS = TILE_K / SLICE;
  constexpr uint PER_BLOCK = block_elems<QTYPE>() / SLICE;
  if (tid < TILE_ROWS * PARTS) {
    const uint r = tid / PARTS, part = tid % PARTS;
    const uint s = k0 / SLICE + part;
    float v[SLICE];
    if (r < n_valid) {
      device const uint8_t* block = rows + r * row_bytes<QTYPE, COLS>() + (s / PER_BLOCK) * block_bytes<QTYPE>();
      dequant_slice<QTYPE>(block, s % PER_BLOCK, v);
    } else {
      for (uint i = 0; i < SLICE; i++) {
        v[i] = 0.0f;
      }
    }
    for (uint i = 0; i < SLICE; i++) {
      tile[r * TILE_STRIDE + part * SLICE + i] = v[i];
    }
  }
}

// acc[j] += sum_k w_tile[row][k] * x_tile[token + j][k] for this thread's row and tokens
inline void tile_product(
    threadgroup const float* w_tile, threadgroup const float* x_tile, uint tid, thread float* acc) {
  const uint row = tid % TILE_ROWS, token = (tid / TILE_ROWS) * TOKENS_PER_THREAD;
  for (uint k = 0; k < TILE_K; k++) {
    const float w = w_tile[row * TILE_STRIDE + k];
    for (uint j = 0; j < TOKENS_PER_THREAD; j++) {
      acc[j] += w * x_tile[(token + j) * TILE_STRIDE + k];
    }
  }
}
"""
