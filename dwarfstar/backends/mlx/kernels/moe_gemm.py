"""Gathered expert GEMM for prefill: the same product as moe_gemv, grouped by expert.

The pairs come sorted by expert (`order`, with `offsets[e]..offsets[e+1]` the pairs of expert e), so
a threadgroup owns one expert and a 32-row tile and walks that expert's pairs 32 at a time: each
weight tile is decoded once per 32 routed tokens instead of once per token (tiles.py).

Template: QTYPE, COLS. Inputs: w (uint8 [experts * rows, row bytes]), x (float [*, COLS]),
order (uint32 [pairs]), offsets (uint32 [experts + 1]), dims (uint32 [rows per expert, per_x]).
Output: y (float [pairs, rows]). Grid: (256 * ceil(rows / 32), experts, 1), threadgroup (256, 1, 1).
"""

SOURCE = r"""
  threadgroup float w_tile[TILE_ROWS * TILE_STRIDE];
  threadgroup float x_tile[TILE_TOKENS * TILE_STRIDE];
  const uint n_rows = dims[0], per_x = dims[1];
  const uint tid = thread_index_in_threadgroup;
  const uint row0 = threadgroup_position_in_grid.x * TILE_ROWS;
  const uint expert = threadgroup_position_in_grid.y;
  const uint begin = offsets[expert], end = offsets[expert + 1];
  const uint valid_rows = n_rows - row0 < TILE_ROWS ? n_rows - row0 : TILE_ROWS;
  device const uint8_t* rows = w + (ulong(expert) * n_rows + row0) * row_bytes<QTYPE, COLS>();
  for (uint p0 = begin; p0 < end; p0 += TILE_TOKENS) {
    float acc[TOKENS_PER_THREAD];
    for (uint j = 0; j < TOKENS_PER_THREAD; j++) {
      acc[j] = 0.0f;
    }
    for (uint k0 = 0; k0 < COLS; k0 += TILE_K) {
      load_w_tile<QTYPE, COLS>(rows, valid_rows, k0, tid, w_tile);
      for (uint i = tid; i < TILE_TOKENS * TILE_K; i += TILE_THREADS) {
        const uint t = i / TILE_K, k = i % TILE_K;
        x_tile[t * TILE_STRIDE + k] = p0 + t < end ? x[ulong(order[p0 + t] / per_x) * COLS + k0 + k] : 0.0f;
      }
      metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
      tile_product(w_tile, x_tile, tid, acc);
      metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    }
    const uint row = row0 + tid % TILE_ROWS, t0 = (tid / TILE_ROWS) * TOKENS_PER_THREAD;
    for (uint j = 0; j < TOKENS_PER_THREAD; j++) {
      if (row < n_rows && p0 + t0 + j < end) {
        y[ulong(order[p0 + t0 + j]) * n_rows + row] = acc[j];
      }
    }
  }
"""
