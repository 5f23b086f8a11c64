"""Fused dequant-GEMV for decode: y[t, row] = sum_k W[row, k] x[t, k] for NTOK (1..8) tokens.

One simdgroup per output row; its 32 lanes stride over the row's slices, decode each once and use it
for every token, then reduce with simd_sum. The weights are read once per call, in place, which is
what bounds decode speed.

Template: QTYPE (ggml type), COLS (input width), NTOK. Inputs: w (uint8 [rows, row bytes]),
x (float [NTOK, COLS]), dims (uint32 [rows]). Output: y (float [NTOK, rows]).
Grid: (32 * rows, 1, 1), threadgroup (256, 1, 1).
"""

SOURCE = r"""
  constexpr uint SLICES = COLS / SLICE;
  constexpr uint PER_BLOCK = block_elems<QTYPE>() / SLICE;
  constexpr ulong ROW_BYTES = ulong(COLS / block_elems<QTYPE>()) * block_bytes<QTYPE>();
  const uint n_rows = dims[0];
  const uint row = thread_position_in_grid.x / 32;
  const uint lane = thread_index_in_simdgroup;
  device const uint8_t* w_row = w + ulong(row) * ROW_BYTES;
  float acc[NTOK];
  for (uint t = 0; t < NTOK; t++) {
    acc[t] = 0.0f;
  }
  for (uint s = lane; s < SLICES && row < n_rows; s += 32) {
    float v[SLICE];
    dequant_slice<QTYPE>(w_row + (s / PER_BLOCK) * block_bytes<QTYPE>(), s % PER_BLOCK, v);
    for (uint t = 0; t < NTOK; t++) {
      device const float* xs = x + t * COLS + s * SLICE;
      float sum = 0.0f;
      for (uint i = 0; i < SLICE; i++) {
        sum += v[i] * xs[i];
      }
      acc[t] += sum;
    }
  }
  for (uint t = 0; t < NTOK; t++) {
    const float total = metal::simd_sum(acc[t]);
    if (lane == 0 && row < n_rows) {
      y[ulong(t) * n_rows + row] = total;
    }
  }
"""
