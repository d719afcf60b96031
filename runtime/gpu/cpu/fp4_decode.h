/* The format-specific part of the CPU expert kernel (`kernel.c`, its only includer): FP4 weight rows decoded and
 * dotted with token vectors, for both record schemes (record_layout.py):
 *   NVFP4  W[o, i] = E2M1[code] * e4m3(scale[o, i / 16])   (the per-row scale_2 is applied by the caller)
 *   MXFP4  W[o, i] = E2M1[code] * 2^(scale[o, i / 32] - 127)   (E8M0; 255 reads as 2^128 = inf, like the reference)
 * Codes pack element 2j in the low nibble of byte j in both. Each variant below (AVX512-BF16, AVX-512, portable) is
 * written once over 16-element code words; a scheme is a (scale table, log2 of code words per scale) pair that is a
 * compile-time constant in each instantiation, so the inner loops never branch on the format: `row_dots_for` picks
 * the instantiation once per work item from the layout's scheme.
 */
#ifndef FT_CPU_FP4_DECODE_H
#define FT_CPU_FP4_DECODE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static float E4M3[256], E8M0[256];
#if defined(FT_BF16)
static uint16_t E2M1_BF16[32]; /* E2M1 as bf16 bits (16 used: a vpermw table has 32 entries) */
#endif

static void fill_tables(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = (b & 0x80) ? -v : v;
        E8M0[b] = ldexpf(1.f, b - 127); /* exact: 2^-127 is a subnormal float, 2^128 overflows to inf */
    }
#if defined(FT_BF16)
    to_bf16(E2M1, E2M1_BF16, 16);
#endif
}

#define MAXT 4 /* token vectors per pass over a weight row */
#ifndef FT_PREFETCH
/* Prefetch the codes this many bytes ahead of the dot product (0: the hardware prefetchers only). Rows are contiguous,
 * so the next row's first lines arrive while this one ends; 512 gave 5-15 % more per expert from 11-15 threads on the
 * H200 host (tools/bench_cpu_lane.py), 1024 less. */
#define FT_PREFETCH 512
#endif

/* out[t] = sum_i W[row, i] * xs[t][i] (without scale_2) for NT token vectors, K inputs (K % 32 == 0); the scale of
 * code word b (16 elements) is stab[scales[b >> SH]]. NT, stab and SH are compile-time constants in every
 * instantiation, so the accumulators stay in registers and the scale lookup folds. */
#if defined(FT_BF16)
/* 32 weights per step: the 16 code bytes widen to 16 dwords whose low / high u16 hold the low / high nibble, i.e.
 * the codes of elements 2i / 2i + 1 in weight order; one vpermw maps them to the E2M1 values as bf16 (exact), one
 * vdpbf16ps multiplies them with 32 bf16 inputs and sums pairs (exact products, fp32 sums). Dword lanes 0-7 hold
 * the first code word, 8-15 the second: the pair sums are scaled per lane (one scale for both under MXFP4) and
 * accumulated. One shuffle-port uop per 16 weights instead of four in the fp32 path below. */
static inline __attribute__((always_inline)) void row_dots_nt(const uint8_t *codes, const uint8_t *scales,
                                                              int64_t K, const in_t *const *xs, float *out,
                                                              const int NT, const float *stab, const int SH) {
    const __m512i lut = _mm512_loadu_si512(E2M1_BF16), low4 = _mm512_set1_epi32(0x0F), high4 = _mm512_set1_epi32(0xF0);
    __m512 a0[MAXT], a1[MAXT]; /* even / odd steps: two independent FMA chains per token */
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 16; b += 2) {
#if FT_PREFETCH > 0
        if ((b & 7) == 0) _mm_prefetch((const char *)codes + 8 * b + FT_PREFETCH, _MM_HINT_T0);
#endif
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 8 * b)));
        __m512i idx = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_slli_epi32(_mm512_and_si512(v, high4), 12));
        __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, lut);
        __m512 sc = SH ? _mm512_set1_ps(stab[scales[b >> SH]]) /* MXFP4: one scale for both words */
                       : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(stab[scales[b]]),
                                              _mm512_set1_ps(stab[scales[b + 1]]));
        for (int t = 0; t < NT; t++) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(xs[t] + 16 * b));
            if (b & 2) a1[t] = _mm512_fmadd_ps(d, sc, a1[t]);
            else a0[t] = _mm512_fmadd_ps(d, sc, a0[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}
#elif defined(__AVX512F__)
/* One code word (8 bytes) -> 16 weights by a permute from the 16-float table, times its scale. */
static inline __attribute__((always_inline)) __m512 decode_word(const uint8_t *codes, float scale, __m512 lut) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadl_epi64((const __m128i *)codes);
    __m128i lo = _mm_and_si128(raw, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    __m512 w = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
    return _mm512_mul_ps(w, _mm512_set1_ps(scale));
}

static inline __attribute__((always_inline)) void row_dots_nt(const uint8_t *codes, const uint8_t *scales,
                                                              int64_t K, const float *const *xs, float *out,
                                                              const int NT, const float *stab, const int SH) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    __m512 a0[MAXT], a1[MAXT]; /* even / odd words: two independent FMA chains per token */
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 16; b += 2) {
        __m512 w0 = decode_word(codes + 8 * b, stab[scales[b >> SH]], lut);
        __m512 w1 = decode_word(codes + 8 * b + 8, stab[scales[(b + 1) >> SH]], lut);
        for (int t = 0; t < NT; t++) {
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[t] + 16 * b), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[t] + 16 * b + 16), a1[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}
#else
static inline __attribute__((always_inline)) void row_dots_nt(const uint8_t *codes, const uint8_t *scales,
                                                              int64_t K, const in_t *const *xs, float *out,
                                                              const int NT, const float *stab, const int SH) {
    float acc[MAXT] = {0};
    for (int64_t b = 0; b < K / 16; b++) {
        float s = stab[scales[b >> SH]];
        float w[16];
        for (int j = 0; j < 8; j++) {
            w[2 * j] = E2M1[codes[8 * b + j] & 15] * s;
            w[2 * j + 1] = E2M1[codes[8 * b + j] >> 4] * s;
        }
        for (int t = 0; t < NT; t++) {
            float a = 0.f;
            for (int j = 0; j < 16; j++) a += w[j] * xs[t][16 * b + j];
            acc[t] += a;
        }
    }
    for (int t = 0; t < NT; t++) out[t] = acc[t];
}
#endif

/* One weight row against nt (1..MAXT) token vectors; `row_dots_for` picks the scheme's. */
typedef void (*row_dots_fn)(const uint8_t *codes, const uint8_t *scales, int64_t K, const in_t *const *xs, int nt,
                            float *out);

#define FT_ROW_DOTS(name, stab, SH)                                                                                  \
    static void name(const uint8_t *codes, const uint8_t *scales, int64_t K, const in_t *const *xs, int nt,         \
                     float *out) {                                                                                   \
        switch (nt) {                                                                                                \
        case 1: row_dots_nt(codes, scales, K, xs, out, 1, stab, SH); break;                                         \
        case 2: row_dots_nt(codes, scales, K, xs, out, 2, stab, SH); break;                                         \
        case 3: row_dots_nt(codes, scales, K, xs, out, 3, stab, SH); break;                                         \
        default: row_dots_nt(codes, scales, K, xs, out, 4, stab, SH); break;                                        \
        }                                                                                                            \
    }
FT_ROW_DOTS(row_dots_nvfp4, E4M3, 0) /* e4m3 scale per code word */
FT_ROW_DOTS(row_dots_mxfp4, E8M0, 1) /* E8M0 scale per two code words */

static inline row_dots_fn row_dots_for(int32_t scheme) {
    return scheme == FT_MXFP4 ? row_dots_mxfp4 : row_dots_nvfp4;
}

/* Inputs per block scale (the scale bytes of a row of K inputs are K / scale_group). */
static inline int64_t scale_group(int32_t scheme) {
    return scheme == FT_MXFP4 ? 32 : 16;
}
#endif
