"""Fused dequant-GEMM for prefill: y[t, row] = sum_k W[row, k] x[t, k] for any number of tokens.

Tiled 32 rows x 32 tokens per threadgroup (see tiles.py): the weight tile is decoded from the GGUF
blocks once per 32 tokens instead of once per token.

Template: QTYPE, COLS. Inputs: w (uint8 [rows, row bytes]), x (float [tokens, COLS]),
dims (uint32 [rows, tokens]). Output: y (float [tokens, rows]).
Grid: (256 * ceil(rows / 32), ceil(tokens / 32), 1), threadgroup (256, 1, 1).
"""

SOURCE = r"""
  threadgroup float w_tile[TILE_ROWS * TILE_STRIDE];
  threadgroup float x_tile[TILE_TOKENS * TILE_STRIDE];
  const uint n_rows = dims[0], n_tokens = dims[1];
  const uint tid = thread_index_in_threadgroup;
  const uint row0 = threadgroup_position_in_grid.x * TILE_ROWS;
  const uint token0 = threadgroup_position_in_grid.y * TILE_TOKENS;
  const uint valid_rows = n_rows - row0 < TILE_ROWS ? n_rows - row0 : TILE_ROWS;
  float acc[TOKENS_PER_THREAD];
  for (uint j = 0; j < TOKENS_PER_THREAD; j++) {
    acc[j] = 0.0f;
  }
  for (uint k0 = 0; k0 < COLS; k0 += TILE_K) {
    load_w_tile<QTYPE, COLS>(w + ulong(row0) * row_bytes<QTYPE, COLS>(), valid_rows, k0, tid, w_tile);
    for (uint i = tid; i < TILE_TOKENS * TILE_K; i += TILE_THREADS) {
      const uint t = i / TILE_K, k = i % TILE_K;
      x_tile[t * TILE_STRIDE + k] = token0 + t < n_tokens ? x[ulong(token0 + t) * COLS + k0 + k] : 0.0f;
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    tile_product(w_tile, x_tile, tid, acc);
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  }
  const uint row = row0 + tid % TILE_ROWS, token = token0 + (tid / TILE_ROWS) * TOKENS_PER_THREAD;
  for (uint j = 0; j < TOKENS_PER_THREAD; j++) {
    if (row < n_rows && token + j < n_tokens) {
      y[ulong(token + j) * n_rows + row] = acc[j];
    }
  }
"""
