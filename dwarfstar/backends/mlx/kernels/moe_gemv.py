"""Gathered expert GEMV for decode: y[p, row] = sum_k W[ids[p]][row, k] x[p / per_x, k].

p runs over the (token, slot) pairs of the routing; the input row of a pair is its token's (gate and
up projections, per_x = experts per token) or its own (down projection, per_x = 1). One simdgroup
per (row, pair), so each chosen expert's rows are read in place, once per pair, and nothing else.

Template: QTYPE, COLS. Inputs: w (uint8 [experts * rows, row bytes]), x (float [*, COLS]),
ids (uint32 [pairs]), dims (uint32 [rows per expert, per_x]). Output: y (float [pairs, rows]).
Grid: (32 * rows, pairs, 1), threadgroup (256, 1, 1).
"""

SOURCE = r"""
  constexpr uint SLICES = COLS / SLICE;
  constexpr uint PER_BLOCK = block_elems<QTYPE>() / SLICE;
  constexpr ulong ROW_BYTES = ulong(COLS / block_elems<QTYPE>()) * block_bytes<QTYPE>();
  const uint n_rows = dims[0], per_x = dims[1];
  const uint row = thread_position_in_grid.x / 32;
  const uint pair = thread_position_in_grid.y;
  const uint lane = thread_index_in_simdgroup;
  device const uint8_t* w_row = w + (ulong(ids[pair]) * n_rows + row) * ROW_BYTES;
  device const float* xs = x + ulong(pair / per_x) * COLS;
  float acc = 0.0f;
  for (uint s = lane; s < SLICES && row < n_rows; s += 32) {
    float v[SLICE];
    dequant_slice<QTYPE>(w_row + (s / PER_BLOCK) * block_bytes<QTYPE>(), s % PER_BLOCK, v);
    for (uint i = 0; i < SLICE; i++) {
      acc += v[i] * xs[s * SLICE + i];
    }
  }
  const float total = metal::simd_sum(acc);
  if (lane == 0 && row < n_rows) {
    y[ulong(pair) * n_rows + row] = total;
  }
"""
