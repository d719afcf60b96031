/* NVFP4 expert MLPs on the CPU, reading FTW expert records in place (mmapped file pages or pinned buffers).
 *
 * Same math as the GPU kernel (W4A16): x is fp32 holding bf16 values; [g; u] = gate_up . x with fp32 accumulation and
 * the per-row fp32 scale_2 applied to each dot; act = bf16_rne(silu(g) * u); y = down . act * scale_2 * weight.
 * W[o, i] = E2M1[code] * e4m3(scale[o, i / 16]) * scale_2[o]; codes pack element 2j in the low nibble of byte j.
 *
 * One call handles one MoE layer step: `n_groups` experts, each with the pairs (token, router weight) routed to it.
 * Three phases inside one OpenMP team: gate_up rows (split over experts x row chunks), down rows, then the sum of
 * pair outputs into y (column chunks, fixed pair order, so results do not depend on the thread count).
 * With AVX-512 one 16-element block (8 code bytes + 1 scale byte) is decoded by a permute from a 16-float table.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_nvfp4.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static float E4M3[256];
#if defined(FT_BF16)
static uint16_t E2M1_BF16[32]; /* E2M1 as bf16 bits (16 used: a vpermw table has 32 entries) */
#endif
static int tables_ready = 0;

void init_tables(void) {
    if (tables_ready) return;
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
        if ((b & 0x7F) == 0x7F) v = NAN;
        E4M3[b] = (b & 0x80) ? -v : v;
    }
#if defined(FT_BF16)
    to_bf16(E2M1, E2M1_BF16, 16);
#endif
    tables_ready = 1;
}

static inline float bf16_rne(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

#define MAXT 4 /* token vectors per pass over a weight row */
#ifndef FT_PREFETCH
/* Prefetch the codes this many bytes ahead of the dot product (0: the hardware prefetchers only). Rows are contiguous,
 * so the next row's first lines arrive while this one ends; 512 gave 5-15 % more per expert from 11-15 threads on the
 * H200 host (tools/bench_cpu_lane.py), 1024 less. */
#define FT_PREFETCH 512
#endif

void to_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, 4);
        dst[i] = (uint16_t)(u >> 16);
    }
}

/* out[t] = sum_i W[row, i] * xs[t][i] (without scale_2) for NT token vectors, K inputs (K % 32 == 0).
 * NT is a compile-time constant in every instantiation, so the accumulators stay in registers. */
#if defined(FT_BF16)
/* 32 weights per step: the 16 code bytes widen to 16 dwords whose low / high u16 hold the low / high nibble, i.e.
 * the codes of elements 2i / 2i + 1 in weight order; one vpermw maps them to the E2M1 values as bf16 (exact), one
 * vdpbf16ps multiplies them with 32 bf16 inputs and sums pairs (exact products, fp32 sums). Dword lanes 0-7 hold
 * the first scale block, 8-15 the second: the pair sums are scaled per lane and accumulated. One shuffle-port uop
 * per 16 weights instead of four in the fp32 path below. */
static inline __attribute__((always_inline)) void row_dots_nt(const uint8_t *codes, const uint8_t *scales,
                                                              int64_t K, const in_t *const *xs, float *out,
                                                              const int NT) {
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
        __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(E4M3[scales[b]]), _mm512_set1_ps(E4M3[scales[b + 1]]));
        for (int t = 0; t < NT; t++) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(xs[t] + 16 * b));
            if (b & 2) a1[t] = _mm512_fmadd_ps(d, sc, a1[t]);
            else a0[t] = _mm512_fmadd_ps(d, sc, a0[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}
#elif defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 decode_block(const uint8_t *codes, uint8_t scale, __m512 lut) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadl_epi64((const __m128i *)codes);
    __m128i lo = _mm_and_si128(raw, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    __m512 w = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
    return _mm512_mul_ps(w, _mm512_set1_ps(E4M3[scale]));
}

static inline __attribute__((always_inline)) void row_dots_nt(const uint8_t *codes, const uint8_t *scales,
                                                              int64_t K, const float *const *xs, float *out,
                                                              const int NT) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    __m512 a0[MAXT], a1[MAXT]; /* even / odd blocks: two independent FMA chains per token */
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 16; b += 2) {
        __m512 w0 = decode_block(codes + 8 * b, scales[b], lut);
        __m512 w1 = decode_block(codes + 8 * b + 8, scales[b + 1], lut);
        for (int t = 0; t < NT; t++) {
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[t] + 16 * b), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[t] + 16 * b + 16), a1[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}
#else
static inline void row_dots_nt(const uint8_t *codes, const uint8_t *scales, int64_t K, const in_t *const *xs,
                               float *out, const int NT) {
    float acc[MAXT] = {0};
    for (int64_t b = 0; b < K / 16; b++) {
        float s = E4M3[scales[b]];
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

static void row_dots(const uint8_t *codes, const uint8_t *scales, int64_t K, const in_t *const *xs, int nt,
                     float *out) {
    switch (nt) {
    case 1: row_dots_nt(codes, scales, K, xs, out, 1); break;
    case 2: row_dots_nt(codes, scales, K, xs, out, 2); break;
    case 3: row_dots_nt(codes, scales, K, xs, out, 3); break;
    default: row_dots_nt(codes, scales, K, xs, out, 4); break;
    }
}

/* Work items small enough that a decode call of 1-2 experts spreads evenly over a dozen threads (an item of gate_up
 * rows reads 16 KiB of codes per row pair group, a down item 8 KiB): with 32 / 128 rows the lane's jobs ran in two
 * uneven rounds. */
#ifndef GU_ROWS
#define GU_ROWS 8 /* gate/up row pairs per work item */
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 32 /* down rows per work item */
#endif
#define SUM_COLS 256 /* y columns per work item */

void job_items(const moe_job *j, int64_t n[3]) {
    const int64_t H = j->L->hidden, I = j->L->inter;
    n[0] = (int64_t)j->n_groups * ((I + GU_ROWS - 1) / GU_ROWS);
    n[1] = (int64_t)j->n_groups * ((H + DOWN_ROWS - 1) / DOWN_ROWS);
    n[2] = (int64_t)j->T * ((H + SUM_COLS - 1) / SUM_COLS);
}

void gu_item(const moe_job *j, int64_t item) {
    const ft_layout *L = j->L;
    const int64_t H = L->hidden, I = L->inter, chunks = (I + GU_ROWS - 1) / GU_ROWS;
    const int64_t g = item / chunks, r0 = (item % chunks) * GU_ROWS;
    const int64_t r1 = r0 + GU_ROWS < I ? r0 + GU_ROWS : I;
    const uint8_t *rec = j->recs[g];
    const uint8_t *codes = rec + L->off_gu, *scales = rec + L->off_gus;
    const float *s2 = (const float *)(rec + L->off_gus2);
    for (int32_t p0 = j->grp_start[g]; p0 < j->grp_start[g + 1]; p0 += MAXT) {
        int nt = j->grp_start[g + 1] - p0 < MAXT ? j->grp_start[g + 1] - p0 : MAXT;
        const in_t *xs[MAXT];
        for (int t = 0; t < nt; t++) xs[t] = j->xin + (int64_t)j->pair_tok[p0 + t] * H;
        for (int64_t n = r0; n < r1; n++) {
            float gv[MAXT], uv[MAXT];
            row_dots(codes + n * (H / 2), scales + n * (H / 16), H, xs, nt, gv);
            row_dots(codes + (I + n) * (H / 2), scales + (I + n) * (H / 16), H, xs, nt, uv);
            for (int t = 0; t < nt; t++) {
                float gg = gv[t] * s2[n], uu = uv[t] * s2[I + n];
                float a = bf16_rne(gg / (1.f + expf(-gg)) * uu);
                j->act[(int64_t)(p0 + t) * I + n] = a;
#if defined(FT_BF16)
                to_bf16(&a, j->actin + (int64_t)(p0 + t) * I + n, 1);
#endif
            }
        }
    }
}

void down_item(const moe_job *j, int64_t item) {
    const ft_layout *L = j->L;
    const int64_t H = L->hidden, I = L->inter, chunks = (H + DOWN_ROWS - 1) / DOWN_ROWS;
    const int64_t g = item / chunks, r0 = (item % chunks) * DOWN_ROWS;
    const int64_t r1 = r0 + DOWN_ROWS < H ? r0 + DOWN_ROWS : H;
    const uint8_t *rec = j->recs[g];
    const uint8_t *codes = rec + L->off_d, *scales = rec + L->off_ds;
    const float *s2 = (const float *)(rec + L->off_ds2);
    for (int32_t p0 = j->grp_start[g]; p0 < j->grp_start[g + 1]; p0 += MAXT) {
        int nt = j->grp_start[g + 1] - p0 < MAXT ? j->grp_start[g + 1] - p0 : MAXT;
        const in_t *as[MAXT];
        for (int t = 0; t < nt; t++) as[t] = j->actin + (int64_t)(p0 + t) * I;
        for (int64_t n = r0; n < r1; n++) {
            float dv[MAXT];
            row_dots(codes + n * (I / 2), scales + n * (I / 16), I, as, nt, dv);
            for (int t = 0; t < nt; t++) j->part[(int64_t)(p0 + t) * H + n] = dv[t] * s2[n] * j->pair_w[p0 + t];
        }
    }
}

/* y[t, columns] = sum of the pair outputs of token t, in pair order (results do not depend on the thread count). */
void sum_item(const moe_job *j, int64_t item) {
    const int64_t H = j->L->hidden, chunks = (H + SUM_COLS - 1) / SUM_COLS;
    const int64_t t = item / chunks, c0 = (item % chunks) * SUM_COLS;
    const int64_t c1 = c0 + SUM_COLS < H ? c0 + SUM_COLS : H;
    float *yr = j->y + t * H;
    for (int64_t c = c0; c < c1; c++) yr[c] = 0.f;
    for (int32_t p = 0; p < j->grp_start[j->n_groups]; p++) {
        if (j->pair_tok[p] != t) continue;
        const float *pr = j->part + (int64_t)p * H;
        for (int64_t c = c0; c < c1; c++) yr[c] += pr[c];
    }
}

int ft_nvfp4_moe(const ft_layout *L, int32_t n_groups, const uint8_t *const *recs, const int32_t *grp_start,
                 const int32_t *pair_tok, const float *pair_w, int32_t T, const float *x, float *act, float *part,
                 float *y, int32_t nthreads) {
    init_tables();
    if (L->hidden % 32 || L->inter % 32 || n_groups < 0 || T < 0) return -1;
    moe_job j = {L, n_groups, T, recs, grp_start, pair_tok, pair_w, x, act, part, y, NULL, NULL};
#if defined(FT_BF16)
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * L->hidden + 64);
    uint16_t *ab = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)grp_start[n_groups] * L->inter + 64);
    if (!xb || !ab) {
        free(xb), free(ab);
        return -3;
    }
    to_bf16(x, xb, (int64_t)T * L->hidden);
    j.xin = xb, j.actin = ab;
#else
    j.xin = x, j.actin = act;
#endif
    int64_t n[3];
    job_items(&j, n);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n[0]; item++) gu_item(&j, item);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n[1]; item++) down_item(&j, item);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n[2]; item++) sum_item(&j, item);
    }
#if defined(FT_BF16)
    free((void *)j.xin), free(j.actin);
#endif
    return 0;
}

/* A persistent native worker per caller: `ft_worker_submit` hands it one `ft_nvfp4_moe` call and returns at once,
 * `ft_worker_wait` blocks until that call is done. The caller (Python, through ctypes, which releases the GIL around
 * each call) needs no Python thread of its own: a Python worker thread would have to win the GIL before it could
 * even start the kernel, which serialises the CPU experts behind the GPU-driving thread's Python work. One call in
 * flight per worker; the argument buffers must stay alive until the wait returns. The worker's OpenMP team
 * persists between calls (libgomp keeps one pool per master thread). */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pending, done, stop, rc;
    double seconds; /* of the last call, measured on the worker */
    const ft_layout *L;
    int32_t n_groups, T, nthreads;
    const uint8_t *const *recs;
    const int32_t *grp_start, *pair_tok;
    const float *pair_w, *x;
    float *act, *part, *y;
} ft_worker;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *worker_loop(void *arg) {
    ft_worker *w = (ft_worker *)arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->pending && !w->stop) pthread_cond_wait(&w->cv, &w->mu);
        if (w->stop) break;
        w->pending = 0;
        pthread_mutex_unlock(&w->mu);
        double t = now_s();
        int rc = ft_nvfp4_moe(w->L, w->n_groups, w->recs, w->grp_start, w->pair_tok, w->pair_w, w->T, w->x, w->act,
                              w->part, w->y, w->nthreads);
        double dt = now_s() - t;
        pthread_mutex_lock(&w->mu);
        w->rc = rc;
        w->seconds = dt;
        w->done = 1;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

ft_worker *ft_worker_new(void) {
    ft_worker *w = (ft_worker *)calloc(1, sizeof(ft_worker));
    if (!w) return NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->done = 1;
    if (pthread_create(&w->th, NULL, worker_loop, w) != 0) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    return w;
}

/* 0 = started; -2 = a call is still in flight (wait for it first). */
int ft_worker_submit(ft_worker *w, const ft_layout *L, int32_t n_groups, const uint8_t *const *recs,
                     const int32_t *grp_start, const int32_t *pair_tok, const float *pair_w, int32_t T,
                     const float *x, float *act, float *part, float *y, int32_t nthreads) {
    pthread_mutex_lock(&w->mu);
    if (!w->done) {
        pthread_mutex_unlock(&w->mu);
        return -2;
    }
    w->L = L, w->n_groups = n_groups, w->recs = recs, w->grp_start = grp_start, w->pair_tok = pair_tok;
    w->pair_w = pair_w, w->T = T, w->x = x, w->act = act, w->part = part, w->y = y, w->nthreads = nthreads;
    w->done = 0;
    w->pending = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* The return code of the call in flight (or of the last one); its seconds on the worker in *seconds. */
int ft_worker_wait(ft_worker *w, double *seconds) {
    pthread_mutex_lock(&w->mu);
    while (!w->done) pthread_cond_wait(&w->cv, &w->mu);
    int rc = w->rc;
    *seconds = w->seconds;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void ft_worker_free(ft_worker *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* dst <- src, n bytes, split over threads (pageable file pages -> pinned staging). */
void ft_memcpy(uint8_t *dst, const uint8_t *src, int64_t n, int32_t nthreads) {
    const int64_t chunk = 256 << 10;
    const int64_t nchunks = (n + chunk - 1) / chunk;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t off = c * chunk, len = off + chunk < n ? chunk : n - off;
        memcpy(dst + off, src + off, (size_t)len);
    }
}

int ft_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
