/* DwarfStar's CPU kernels: products of float activations with GGUF weights read in place.

   Built at first use by dwarfstar/backends/cpu/native.py (cc -O3 -march=native -ffp-contract=off
   -fopenmp), loaded through ctypes. The weights stay in the file's own blocks (the memory map): the
   layout the GEMV of a decode step and the GEMM of a prefill chunk both read, so nothing is repacked
   or copied at load.

   Activations are quantized once per product input (`ds_quantize`), as ggml does: int8 with a float
   scale (amax / 127) per block of 32 for Q8_0 and MXFP4 weights, per block of 256 for the K-quants
   and IQ2_XXS (with the int sums of each 16, which the K-quants' minimums need). Every weight format
   is read in chunks of 32 as unsigned magnitudes, an optional sign source and int16 sub-block
   multipliers: one `maddubs` + `madd` per chunk and token, the integer sum exact. Per-32 formats
   then take one float FMA per chunk, per-256 ones add the chunks in int32 and take one per block. A
   (row, token) dot is computed by the same instructions in the same order whatever the number of
   tokens and threads, so the result of a row does not depend on what shares the call.

   Formats: F32, F16 (float activations), Q8_0, Q2_K, Q4_K, IQ2_XXS, MXFP4 (ggml type ids). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(DS_SCALAR)
#include <immintrin.h>
#define DS_AVX2 1
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q8_0 = 8, T_Q2_K = 10, T_Q4_K = 12, T_IQ2_XXS = 16, T_MXFP4 = 39 };
#define CHUNK 32
#define MAX_NT 8 /* tokens a weight chunk is decoded for at once */
#define PARALLEL_BYTES (256 << 10)
#define PREFETCH 8192 /* bytes ahead; 2, 4 and 8 KB measured alike for IQ2_XXS and Q8_0 streamed */

static uint64_t iq2xxs_grid[256]; /* ds_set_iq2xxs_grid: eight magnitudes a byte each, from gguf-py */
static uint8_t ksigns[128];       /* 7 sign bits and the parity bit that makes them even */
static const int8_t fp4_doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float h2f(uint16_t h) {
#ifdef DS_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return (h & 0x8000) ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24); }

static float e8m0_half(uint8_t e) { /* 2^(e - 128): half the block scale, the value table is doubled */
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void q4k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#ifdef DS_AVX2
static uint64_t sign_masks[128]; /* byte i: -1 where sign bit i of ksigns is set, else 1 */

static inline int hsum_epi32(__m256i v) { /* exact: integer */
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
#endif

void ds_set_iq2xxs_grid(const uint64_t *grid) {
    memcpy(iq2xxs_grid, grid, sizeof iq2xxs_grid);
    for (int i = 0; i < 128; i++) {
        int parity = __builtin_popcount(i) & 1;
        ksigns[i] = (uint8_t)(i | (parity << 7));
#ifdef DS_AVX2
        uint64_t m = 0;
        for (int b = 0; b < 8; b++) m |= (uint64_t)((ksigns[i] >> b) & 1 ? 0xFF : 0x01) << (8 * b);
        sign_masks[i] = m;
#endif
    }
}

int ds_simd(void) {
#ifdef DS_AVX2
    return 2;
#else
    return 0;
#endif
}

/* -- activations ---------------------------------------------------------------------------------- */
/* Per block of `n` (32, or 256 for the K-quants and IQ2_XXS, as ggml's Q8_0 and Q8_K): int8 values at
   scale amax / 127 (rounded to nearest, even on ties), and with `s` the int sums of each 16. */
void ds_quantize(const float *x, int64_t T, int64_t K, int n, int8_t *q, float *d, int16_t *s) {
    for (int64_t b = 0; b < T * K / n; b++) {
        const float *xb = x + b * n;
        float amax = 0.0f;
#ifdef DS_AVX2 /* the same values as the portable loop: max is exact, cvtps rounds to nearest even */
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + i)));
        __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
        amax = _mm_cvtss_f32(_mm_max_ss(h4, _mm_movehdup_ps(h4)));
#else
        for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(xb[i]));
#endif
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int h = 0; h < n / 16; h++) {
            int sum = 0;
#ifdef DS_AVX2
            const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h), _mm256_set1_ps(id)));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h + 8), _mm256_set1_ps(id)));
            a = _mm256_min_epi32(_mm256_max_epi32(a, lo), hi);
            c = _mm256_min_epi32(_mm256_max_epi32(c, lo), hi);
            __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8); /* 16 int16, in order */
            _mm_storeu_si128((__m128i *)(q + b * n + 16 * h),
                             _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
            sum = hsum_epi32(_mm256_add_epi32(a, c));
#else
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                int v = (int)lrintf(xb[i] * id);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                q[b * n + i] = (int8_t)v;
                sum += v;
            }
#endif
            if (s) s[b * (n / 16) + h] = (int16_t)sum;
        }
    }
}

static int block_elements(int fmt) { return (fmt == T_Q8_0 || fmt == T_MXFP4) ? 32 : 256; }
static int block_bytes(int fmt) {
    return fmt == T_Q8_0 ? 34 : fmt == T_MXFP4 ? 17 : fmt == T_Q2_K ? 84 : fmt == T_Q4_K ? 144 : 66;
}

/* -- one chunk of 32 weights, decoded --------------------------------------------------------------
   Q8_0 and MXFP4: signed values and a float scale (per-32 activations). Q2_K, Q4_K and IQ2_XXS: the
   values and an int multiplier per 16 (sub-block scale), the block's float scale applied once per
   block (per-256 activations), and for the K-quants the block minimums over the activation sums. */
static inline __attribute__((always_inline)) float chunk_ints(int fmt, const uint8_t *blk, int c, int8_t *w,
                                                              int *mul) {
    if (fmt == T_Q8_0) {
        memcpy(w, blk + 2, 32);
        return h2f(rd16(blk));
    }
    if (fmt == T_MXFP4) {
        for (int i = 0; i < 16; i++) {
            w[i] = fp4_doubled[blk[1 + i] & 0xF];
            w[i + 16] = fp4_doubled[blk[1 + i] >> 4];
        }
        return e8m0_half(blk[0]);
    }
    if (fmt == T_IQ2_XXS) { /* db = d * (2 s + 1) / 8 */
        const uint8_t *g = blk + 2 + 8 * c;
        uint32_t aux = rd32(g + 4);
        for (int k = 0; k < 4; k++) {
            uint64_t row = iq2xxs_grid[g[k]];
            uint8_t signs = ksigns[(aux >> (7 * k)) & 127];
            for (int i = 0; i < 8; i++) {
                int v = (int)((row >> (8 * i)) & 0xFF);
                w[8 * k + i] = (int8_t)((signs >> i) & 1 ? -v : v);
            }
        }
        mul[0] = mul[1] = 2 * (int)(aux >> 28) + 1;
    } else if (fmt == T_Q2_K) {
        const uint8_t *qs = blk + 16 + 32 * (c / 4);
        int shift = 2 * (c % 4);
        for (int i = 0; i < 32; i++) w[i] = (int8_t)((qs[i] >> shift) & 3);
        mul[0] = blk[2 * c] & 0xF;
        mul[1] = blk[2 * c + 1] & 0xF;
    } else { /* Q4_K */
        int sc, mn;
        q4k_scale_min(blk + 4, c, &sc, &mn);
        const uint8_t *qs = blk + 16 + 32 * (c / 2);
        for (int i = 0; i < 32; i++) w[i] = (int8_t)((c & 1) ? (qs[i] >> 4) : (qs[i] & 0xF));
        mul[0] = mul[1] = sc;
    }
    return 0.0f;
}

/* the block's float scale (times the activation block's), and what its minimums subtract per unit of
   the activation block's scale: dmin * sum of min_j * (sum of the activations of 16 j) */
static inline __attribute__((always_inline)) float block_scale(int fmt, const uint8_t *blk) {
    return fmt == T_IQ2_XXS ? h2f(rd16(blk)) * 0.125f : fmt == T_Q2_K ? h2f(rd16(blk + 80)) : h2f(rd16(blk));
}

static inline __attribute__((always_inline)) float block_min(int fmt, const uint8_t *blk, const int16_t *bs) {
    int sum = 0;
    if (fmt == T_Q2_K) {
#ifdef DS_AVX2 /* the 16 minimums against the 16 activation sums: one madd */
        __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)blk), 4),
                                                          _mm_set1_epi8(0xF)));
        sum = hsum_epi32(_mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)bs)));
#else
        for (int j = 0; j < 16; j++) sum += (blk[j] >> 4) * bs[j];
#endif
        return h2f(rd16(blk + 82)) * (float)sum;
    }
    if (fmt == T_Q4_K) {
        for (int c = 0; c < 8; c++) {
            int sc, mn;
            q4k_scale_min(blk + 4, c, &sc, &mn);
            sum += mn * (bs[2 * c] + bs[2 * c + 1]);
        }
        return h2f(rd16(blk + 2)) * (float)sum;
    }
    return 0.0f;
}

#ifdef DS_AVX2
/* shuffle controls: chunk c's two sub-block scales as int16, 2c in the low lane and 2c + 1 in the high */
static const uint8_t q2k_pick[8][32] = {
#define PICK(j) j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80
    {PICK(0), PICK(1)},   {PICK(2), PICK(3)},   {PICK(4), PICK(5)},   {PICK(6), PICK(7)},
    {PICK(8), PICK(9)},   {PICK(10), PICK(11)}, {PICK(12), PICK(13)}, {PICK(14), PICK(15)},
#undef PICK
};

typedef struct {
    __m256i u;   /* unsigned magnitudes */
    __m256i sg;  /* sign source for the activations (_mm256_sign_epi8), or ones */
    __m256i s16; /* int16 multipliers of the pair sums: sub-block scales, or ones */
} Chunk;

static inline __attribute__((always_inline)) float chunk_avx2(int fmt, const uint8_t *blk, int c, Chunk *k) {
    const __m256i ones8 = _mm256_set1_epi8(1);
    k->s16 = _mm256_set1_epi16(1);
    if (fmt == T_Q8_0) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        k->u = _mm256_sign_epi8(w, w); /* |w| */
        k->sg = w;
        return h2f(rd16(blk));
    }
    if (fmt == T_MXFP4) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fp4_doubled));
        __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0xF)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0xF));
        __m256i w = _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo));
        k->u = _mm256_sign_epi8(w, w);
        k->sg = w;
        return e8m0_half(blk[0]);
    }
    if (fmt == T_IQ2_XXS) {
        const uint8_t *g = blk + 2 + 8 * c;
        uint32_t aux = rd32(g + 4);
        k->u = _mm256_set_epi64x((long long)iq2xxs_grid[g[3]], (long long)iq2xxs_grid[g[2]],
                                 (long long)iq2xxs_grid[g[1]], (long long)iq2xxs_grid[g[0]]);
        k->sg = _mm256_set_epi64x((long long)sign_masks[(aux >> 21) & 127], (long long)sign_masks[(aux >> 14) & 127],
                                  (long long)sign_masks[(aux >> 7) & 127], (long long)sign_masks[aux & 127]);
        k->s16 = _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
    } else if (fmt == T_Q2_K) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (c / 4)));
        k->u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * (c % 4)), _mm256_set1_epi8(3));
        k->sg = ones8;
        /* the 16 scales in both lanes; lane 0 takes scale 2c as int16, lane 1 scale 2c + 1 */
        __m256i scales = _mm256_broadcastsi128_si256(_mm_and_si128(_mm_loadu_si128((const __m128i *)blk), _mm_set1_epi8(0xF)));
        k->s16 = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)q2k_pick[c]));
    } else { /* Q4_K */
        int sc, mn;
        q4k_scale_min(blk + 4, c, &sc, &mn);
        __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (c / 2)));
        if (c & 1) q = _mm256_srli_epi16(q, 4);
        k->u = _mm256_and_si256(q, _mm256_set1_epi8(0xF));
        k->sg = ones8;
        k->s16 = _mm256_set1_epi16((short)sc);
    }
    return 0.0f;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* -- a row against up to MAX_NT tokens ---------------------------------------------------------------
   x: int8 activations [nt][K] with one float scale per `bn` (32 or 256) and, for the K-quants, the int
   sums of each 16. */
static inline __attribute__((always_inline)) void qrow(int fmt, const uint8_t *row, int64_t K, const int8_t *xq,
                                                       const float *xd, const int16_t *xs, int nt, float *out,
                                                       int64_t ostride) {
    const int bn = block_elements(fmt), bb = block_bytes(fmt), per = bn / CHUNK, nb = (int)(K / bn);
    const int signed_w = fmt == T_Q8_0 || fmt == T_MXFP4 || fmt == T_IQ2_XXS, per_chunk = per == 1;
    float macc[MAX_NT] = {0};
    (void)signed_w;
#ifdef DS_AVX2
    __m256 acc[MAX_NT];
    __m256i iacc[MAX_NT];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
#else
    float acc[MAX_NT] = {0};
    int iacc[MAX_NT];
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (int64_t)b * bb;
        /* the weights PREFETCH bytes ahead, once a cache line: a decode loop of many instructions a
           byte holds too few loads in flight to hide the memory's latency by itself */
        if (b % (bb >= 64 ? 1 : 64 / bb) == 0) __builtin_prefetch(blk + PREFETCH, 0, 3);
        for (int t = 0; t < nt; t++) {
#ifdef DS_AVX2
            iacc[t] = _mm256_setzero_si256();
#else
            iacc[t] = 0;
#endif
        }
        for (int c = 0; c < per; c++) {
            const int64_t at = (int64_t)b * bn + c * CHUNK;
#ifdef DS_AVX2
            Chunk k;
            float scale = chunk_avx2(fmt, blk, c, &k);
            for (int t = 0; t < nt; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + t * K + at));
                if (signed_w) xv = _mm256_sign_epi8(xv, k.sg);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(k.u, xv), k.s16);
                if (per_chunk)
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale * xd[t * nb + b]), acc[t]);
                else
                    iacc[t] = _mm256_add_epi32(iacc[t], p);
            }
#else
            int8_t w[CHUNK];
            int mul[2] = {1, 1};
            float scale = chunk_ints(fmt, blk, c, w, mul);
            for (int t = 0; t < nt; t++) {
                const int8_t *x = xq + t * K + at;
                int lo = 0, hi = 0;
                for (int i = 0; i < 16; i++) lo += (int)w[i] * (int)x[i];
                for (int i = 16; i < 32; i++) hi += (int)w[i] * (int)x[i];
                if (per_chunk)
                    acc[t] += (float)(lo + hi) * (scale * xd[t * nb + b]);
                else
                    iacc[t] += lo * mul[0] + hi * mul[1];
            }
#endif
        }
        if (!per_chunk) {
            const float scale = block_scale(fmt, blk);
            for (int t = 0; t < nt; t++) {
                const float dx = xd[t * nb + b];
#ifdef DS_AVX2
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t]), _mm256_set1_ps(scale * dx), acc[t]);
#else
                acc[t] += (float)iacc[t] * (scale * dx);
#endif
                if (fmt != T_IQ2_XXS) macc[t] += dx * block_min(fmt, blk, xs + (int64_t)t * (K / 16) + 16 * b);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
#ifdef DS_AVX2
        out[t * ostride] = hsum8(acc[t]) - macc[t];
#else
        out[t * ostride] = acc[t] - macc[t];
#endif
    }
}

/* element j of a float row (F32 or F16) */
static inline float fval(int fmt, const uint8_t *row, int64_t j) {
    return fmt == T_F16 ? h2f(rd16(row + 2 * j)) : ((const float *)row)[j];
}

/* float weights (F32, F16) against float activations, 16 elements a step in two chains */
static inline __attribute__((always_inline)) void frow(int fmt, const uint8_t *row, int64_t K, const float *x, int nt,
                                                       float *out, int64_t ostride) {
#ifdef DS_AVX2
    __m256 a0[MAX_NT], a1[MAX_NT];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
        __m256 w0, w1;
        if (fmt == T_F16) {
            w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
            w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i + 16)));
        } else {
            w0 = _mm256_loadu_ps((const float *)row + i);
            w1 = _mm256_loadu_ps((const float *)row + i + 8);
        }
        for (int t = 0; t < nt; t++) {
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * K + i), a0[t]);
            a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * K + i + 8), a1[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float s = hsum8(_mm256_add_ps(a0[t], a1[t]));
        for (int64_t j = i; j < K; j++) s += fval(fmt, row, j) * x[t * K + j];
        out[t * ostride] = s;
    }
#else
    for (int t = 0; t < nt; t++) {
        float s = 0.0f;
        for (int64_t j = 0; j < K; j++) s += fval(fmt, row, j) * x[t * K + j];
        out[t * ostride] = s;
    }
#endif
}

/* a row against nt tokens, nt a constant in each copy, so a token's sums stay in registers */
#define QROW(F, NT)                                                                                 \
    qrow(F, w + r * row_bytes, K, xq + t0 * K, xd + t0 * (K / block_elements(F)),                   \
         xs ? xs + t0 * (K / 16) : xs, NT, out + t0 * ldo + r, ldo)

#define ROW_CASE(F)                                                                                    \
    case F:                                                                                            \
        for (int64_t r = r0; r < r1; r++) {                                                            \
            switch (nt) {                                                                              \
            case 1: QROW(F, 1); break;                                                                 \
            case 2: QROW(F, 2); break;                                                                 \
            case 3: QROW(F, 3); break;                                                                 \
            case 4: QROW(F, 4); break;                                                                 \
            case 5: QROW(F, 5); break;                                                                 \
            case 6: QROW(F, 6); break;                                                                 \
            case 7: QROW(F, 7); break;                                                                 \
            default: QROW(F, 8); break;                                                                \
            }                                                                                          \
        }                                                                                              \
        break;

static void rows_tokens(int fmt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t K,
                        const int8_t *xq, const float *xd, const int16_t *xs, const float *xf, int64_t t0, int nt,
                        float *out, int64_t ldo) {
    switch (fmt) {
        ROW_CASE(T_Q8_0)
        ROW_CASE(T_Q2_K)
        ROW_CASE(T_Q4_K)
        ROW_CASE(T_IQ2_XXS)
        ROW_CASE(T_MXFP4)
    case T_F16:
        for (int64_t r = r0; r < r1; r++) frow(T_F16, w + r * row_bytes, K, xf + t0 * K, nt, out + t0 * ldo + r, ldo);
        break;
    default:
        for (int64_t r = r0; r < r1; r++) frow(T_F32, w + r * row_bytes, K, xf + t0 * K, nt, out + t0 * ldo + r, ldo);
        break;
    }
}

/* out [T, rows] = x [T, K] . w [rows, K]^T, with `ldo` floats between output rows. x comes quantized
   (xq, xd, xs: ds_quantize) for block formats and as floats (xf) for F32 and F16. Rows are split over
   `threads` threads; tokens go in tiles whose activations stay in the cache while every row passes. */
void ds_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t K, const int8_t *xq,
               const float *xd, const int16_t *xs, const float *xf, int64_t T, float *out, int64_t ldo, int threads) {
    const int64_t tile = K <= 4096 ? 64 : (K <= 8192 ? 32 : 16);
    const int64_t row_block = 16;
    const int64_t nrb = (rows + row_block - 1) / row_block;
    /* a thread hand-off costs microseconds: small products stay on the calling thread */
    const int parallel = threads > 1 && nrb > 1 && rows * row_bytes * (T < 8 ? T : 8) >= PARALLEL_BYTES;
#pragma omp parallel num_threads(threads) if (parallel)
    for (int64_t tt = 0; tt < T; tt += tile) {
        int64_t tend = tt + tile < T ? tt + tile : T;
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < nrb; rb++) {
            int64_t r0 = rb * row_block, r1 = r0 + row_block < rows ? r0 + row_block : rows;
            for (int64_t t0 = tt; t0 < tend; t0 += MAX_NT) {
                int nt = (int)(tend - t0 < MAX_NT ? tend - t0 : MAX_NT);
                rows_tokens(fmt, w, row_bytes, r0, r1, K, xq, xd, xs, xf, t0, nt, out, ldo);
            }
        }
    }
}
