/* FP4 expert MLPs on the CPU (NVFP4 and MXFP4 records), reading FTW expert records in place (mmapped file pages or
 * pinned buffers).
 *
 * Same math as the GPU kernels (W4A16): x is fp32 holding bf16 values; [g; u] = gate_up . x with fp32 accumulation,
 * each dot then times its row's fp32 scale_2 (NVFP4) or plus its row's bias (MXFP4); act = bf16_rne(act(g, u)) with
 * the layout's activation (silu(g) * u, gpt_oss's clamped SwiGLU, deepseek_v4's clamped silu); y = (down . act * scale_2 or + bias) * weight.
 * Rows 0..I-1 of gate_up are the gate, I..2I-1 the up projection (the compiler de-interleaves gpt-oss's rows).
 * Weight decode per scheme: `fp4_decode.h`.
 *
 * One call handles one MoE layer step: `n_groups` experts, each with the pairs (token, router weight) routed to it.
 * Two phases inside one OpenMP team: gate_up rows (split over experts x row chunks), then down row chunks, each
 * summing its rows of every pair's output into y in the fixed pair order (results do not depend on the thread
 * count; no third phase adding up per-pair outputs, nor the barrier before it).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fp4_decode.h"
#include "kernel.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static int tables_ready = 0;

void init_tables(void) {
    if (tables_ready) return;
    fill_tables();
    tables_ready = 1;
}

int layout_ok(const ft_layout *L) {
    if (L->hidden % 32 || L->inter % 32 || L->hidden <= 0 || L->inter <= 0) return 0;
    if (L->scheme != FT_NVFP4 && L->scheme != FT_MXFP4) return 0;
    if (L->act != FT_SILU && L->act != FT_CLAMPED_SWIGLU && L->act != FT_CLAMPED_SILU) return 0;
    return L->scheme == FT_MXFP4 || (L->off_gus2 >= 0 && L->off_ds2 >= 0); /* NVFP4 rows always have a scale_2 */
}

static inline float bf16_rne(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

void to_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, 4);
        dst[i] = (uint16_t)(u >> 16);
    }
}

/* Row n's dot finished: times its scale_2 (off_s2 >= 0) and plus its bias (off_b >= 0); the flags are fixed per
 * layout, so the branches go the same way every row. */
static inline float row_out(const uint8_t *rec, int64_t off_s2, int64_t off_b, int64_t n, float dot) {
    if (off_s2 >= 0) dot *= ((const float *)(rec + off_s2))[n];
    if (off_b >= 0) dot += ((const float *)(rec + off_b))[n];
    return dot;
}

/* The layout's gated activation of one (g, u), in the reference's order of operations (moe_reference.activation). */
static inline float gate(const ft_layout *L, float g, float u) {
    if (L->act == FT_SILU) return g / (1.f + expf(-g)) * u;
    g = fminf(g, L->limit);
    u = fminf(fmaxf(u, -L->limit), L->limit);
    if (L->act == FT_CLAMPED_SILU) return g / (1.f + expf(-g)) * u;
    return (u + 1.f) * (g * (1.f / (1.f + expf(-g * L->alpha))));
}

/* Work items small enough that a decode call of 1-2 experts spreads evenly over a dozen threads (an item of gate_up
 * rows reads 16 KiB of codes per row pair group, a down item 8 KiB): with 32 / 128 rows the lane's jobs ran in two
 * uneven rounds. */
#ifndef GU_ROWS
#define GU_ROWS 8 /* gate/up row pairs per work item */
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 32 /* down rows of one expert per work item */
#endif

/* Rows of y per down item: an item covers them for every expert, about DOWN_ROWS rows of one expert's codes, and
 * whole 64-byte lines of y (a multiple of 16 rows): two threads adding into one line of y would pass it back and
 * forth on every row. */
static int64_t down_rows(const moe_job *j) {
    const int64_t r = DOWN_ROWS / (j->n_groups > 0 ? j->n_groups : 1);
    return r < 16 ? 16 : r / 16 * 16;
}

void job_items(const moe_job *j, int64_t n[2]) {
    const int64_t H = j->L->hidden, I = j->L->inter, r = down_rows(j);
    n[0] = (int64_t)j->n_groups * ((I + GU_ROWS - 1) / GU_ROWS);
    n[1] = (H + r - 1) / r;
}

void gu_item(const moe_job *j, int64_t item) {
    const ft_layout *L = j->L;
    const int64_t H = L->hidden, I = L->inter, chunks = (I + GU_ROWS - 1) / GU_ROWS;
    const int64_t sb = H / scale_group(L->scheme); /* scale bytes per gate/up row */
    const int64_t g = item / chunks, r0 = (item % chunks) * GU_ROWS;
    const int64_t r1 = r0 + GU_ROWS < I ? r0 + GU_ROWS : I;
    const row_dots_fn row_dots = row_dots_for(L->scheme);
    const uint8_t *rec = j->recs[g];
    const uint8_t *codes = rec + L->off_gu, *scales = rec + L->off_gus;
    for (int32_t p0 = j->grp_start[g]; p0 < j->grp_start[g + 1]; p0 += MAXT) {
        int nt = j->grp_start[g + 1] - p0 < MAXT ? j->grp_start[g + 1] - p0 : MAXT;
        const in_t *xs[MAXT];
        for (int t = 0; t < nt; t++) xs[t] = j->xin + (int64_t)j->pair_tok[p0 + t] * H;
        for (int64_t n = r0; n < r1; n++) {
            float gv[MAXT], uv[MAXT];
            row_dots(codes + n * (H / 2), scales + n * sb, H, xs, nt, gv);
            row_dots(codes + (I + n) * (H / 2), scales + (I + n) * sb, H, xs, nt, uv);
            for (int t = 0; t < nt; t++) {
                float gg = row_out(rec, L->off_gus2, L->off_gub, n, gv[t]);
                float uu = row_out(rec, L->off_gus2, L->off_gub, I + n, uv[t]);
                float a = bf16_rne(gate(L, gg, uu));
                j->act[(int64_t)(p0 + t) * I + n] = a;
#if defined(FT_BF16)
                to_bf16(&a, j->actin + (int64_t)(p0 + t) * I + n, 1);
#endif
            }
        }
    }
}

/* y[t, rows r0..r1) = the sum over pairs of token t, in pair order, of the pair's down rows times its router weight
 * (the same additions in the same order for any thread count or item size). */
void down_item(const moe_job *j, int64_t item) {
    const ft_layout *L = j->L;
    const int64_t H = L->hidden, I = L->inter, rows = down_rows(j);
    const int64_t sb = I / scale_group(L->scheme); /* scale bytes per down row */
    const int64_t r0 = item * rows, r1 = r0 + rows < H ? r0 + rows : H;
    const row_dots_fn row_dots = row_dots_for(L->scheme);
    for (int64_t t = 0; t < j->T; t++)
        for (int64_t n = r0; n < r1; n++) j->y[t * H + n] = 0.f;
    for (int32_t g = 0; g < j->n_groups; g++) {
        const uint8_t *rec = j->recs[g];
        const uint8_t *codes = rec + L->off_d, *scales = rec + L->off_ds;
        for (int32_t p0 = j->grp_start[g]; p0 < j->grp_start[g + 1]; p0 += MAXT) {
            int nt = j->grp_start[g + 1] - p0 < MAXT ? j->grp_start[g + 1] - p0 : MAXT;
            const in_t *as[MAXT];
            for (int t = 0; t < nt; t++) as[t] = j->actin + (int64_t)(p0 + t) * I;
            for (int64_t n = r0; n < r1; n++) {
                float dv[MAXT];
                row_dots(codes + n * (I / 2), scales + n * sb, I, as, nt, dv);
                for (int t = 0; t < nt; t++) {
                    const float v = row_out(rec, L->off_ds2, L->off_db, n, dv[t]) * j->pair_w[p0 + t];
                    j->y[(int64_t)j->pair_tok[p0 + t] * H + n] += v;
                }
            }
        }
    }
}

int ft_nvfp4_moe(const ft_layout *L, int32_t n_groups, const uint8_t *const *recs, const int32_t *grp_start,
                 const int32_t *pair_tok, const float *pair_w, int32_t T, const float *x, float *act, float *y,
                 int32_t nthreads) {
    init_tables();
    if (!layout_ok(L) || n_groups < 0 || T < 0) return -1;
    moe_job j = {L, n_groups, T, recs, grp_start, pair_tok, pair_w, x, act, y, NULL, NULL};
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
    int64_t n[2];
    job_items(&j, n);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n[0]; item++) gu_item(&j, item);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n[1]; item++) down_item(&j, item);
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
    float *act, *y;
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
                              w->y, w->nthreads);
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
                     const float *x, float *act, float *y, int32_t nthreads) {
    pthread_mutex_lock(&w->mu);
    if (!w->done) {
        pthread_mutex_unlock(&w->mu);
        return -2;
    }
    w->L = L, w->n_groups = n_groups, w->recs = recs, w->grp_start = grp_start, w->pair_tok = pair_tok;
    w->pair_w = pair_w, w->T = T, w->x = x, w->act = act, w->y = y, w->nthreads = nthreads;
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
