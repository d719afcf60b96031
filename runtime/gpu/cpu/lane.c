/* The CPU lane: a team of spinning threads that computes expert-cache misses for the GPU inside its decode step.
 *
 * The GPU posts one MoE call's CPU share into a mailbox in page-locked host memory (through its mapping), then runs
 * its own share, then spins until the lane has answered (`lane.py` holds the GPU side). No host thread launches or
 * waits for anything per call, so a step that uses the lane is still one CUDA graph replay.
 *
 * Mailbox (int32 words; the GPU writes everything before MB_REQ, then MB_REQ; the lane writes y, MB_ERR, then MB_DONE):
 *   MB_REQ      sequence number of the posted call (changes once per call)
 *   MB_DONE     the sequence number the lane answered last; MB_ERR nonzero: the post was refused (y is zeros)
 *   MB_N, MB_T, MB_LAYER   pairs posted (1..MB_PAIRS), tokens (1..tmax), layer
 *   MB_EXPERT / MB_TOKEN / MB_WEIGHT   per pair: expert id, token row, router weight (f32)
 *   MB_X        f32 [tmax, H] activations (bf16 values);  then y  f32 [tmax, H], the lane's answer
 *
 * Thread 0 leads: it watches MB_REQ, groups the pairs by expert, publishes the job (`gen`) and works on it with the
 * others; work items of each phase are taken from an atomic counter, phases end at a spin barrier. Each counter the
 * threads write (gen, the barrier's, the phases') has a cache line of its own: sharing one, every item taken would
 * take the line from the threads spinning on another. Idle threads spin
 * with a pause for SPIN_NS, then nap (50 us, 500 us after a second), so an idle server does not burn its cores. While
 * the host runs CPU work of its own (`ft_lane_rest`: host-planned calls, whose CPU share runs on another team) idle
 * threads nap REST_NS at once: spinning or waking every 50 us they would preempt that team's threads.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernel.h"

enum { MB_REQ = 0, MB_DONE = 16, MB_ERR = 17, MB_N = 32, MB_T = 33, MB_LAYER = 34, MB_EXPERT = 64, MB_TOKEN = 128,
       MB_WEIGHT = 192, MB_X = 256, MB_PAIRS = 64 };
#define SPIN_NS 20000000LL /* spin this long without work before napping */
#define REST_NS 500000L    /* an idle thread's nap while the lane rests */

typedef struct ft_lane ft_lane;
typedef struct {
    ft_lane *lane;
    int id;
} lane_arg;

typedef struct {
    _Alignas(64) _Atomic int64_t v;
} line_counter; /* an atomic alone in its cache line */

struct ft_lane {
    line_counter gen, bgen, arrive, next[2];
    _Alignas(64) _Atomic int stop, rest; /* read on every idle turn, written rarely */
    ft_layout L;
    int32_t *mb;
    int64_t tmax;
    int32_t n_layers;
    const uint8_t **bank; /* [n_layers] host address of expert 0's record (NULL: no bank) */
    int64_t *stride;      /* [n_layers] bytes between records */
    int32_t *n_experts;   /* [n_layers] */
    int nthreads;
    pthread_t *th;
    lane_arg *args;
    moe_job job;
    int64_t items[2];
    const uint8_t *recs[MB_PAIRS];
    int32_t grp_start[MB_PAIRS + 1], pair_tok[MB_PAIRS];
    float pair_w[MB_PAIRS];
    float *act;
    in_t *xin, *actin; /* bf16 copies of x and act where the kernel reads bf16 (else x and act themselves) */
    _Alignas(64) _Atomic int64_t stats[11]; /* see ft_lane_stats */
    _Atomic int64_t cap_fixed_ns, cap_per_ns; /* a job slower than fixed + per * experts stays out of the fit (0: none) */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One turn of an idle wait that began at *t0 (0: now): pause while young, nap when old or when the lane rests. */
static void idle_turn(ft_lane *l, int64_t *t0, unsigned *n) {
    if (atomic_load_explicit(&l->rest, memory_order_relaxed)) {
        struct timespec ts = {0, REST_NS};
        nanosleep(&ts, NULL);
        return;
    }
    if ((++*n & 255) != 0) {
        relax();
        return;
    }
    int64_t t = now_ns();
    if (*t0 == 0) *t0 = t;
    int64_t idle = t - *t0;
    if (idle > SPIN_NS) {
        struct timespec ts = {0, idle > 1000000000LL ? 500000 : 50000};
        nanosleep(&ts, NULL);
    } else {
        relax();
    }
}

static void barrier(ft_lane *l) {
    int64_t g = atomic_load_explicit(&l->bgen.v, memory_order_acquire);
    if (atomic_fetch_add_explicit(&l->arrive.v, 1, memory_order_acq_rel) == l->nthreads - 1) {
        atomic_store_explicit(&l->arrive.v, 0, memory_order_relaxed);
        atomic_store_explicit(&l->bgen.v, g + 1, memory_order_release);
    } else {
        while (atomic_load_explicit(&l->bgen.v, memory_order_acquire) == g) relax();
    }
}

static void run_phases(ft_lane *l) {
    static void (*const fn[2])(const moe_job *, int64_t) = {gu_item, down_item};
    for (int p = 0; p < 2; p++) {
        int64_t i;
        while ((i = atomic_fetch_add_explicit(&l->next[p].v, 1, memory_order_relaxed)) < l->items[p])
            fn[p](&l->job, i);
        barrier(l);
    }
}

/* Read the posted call into the job (pairs grouped by expert in order of first appearance); nonzero = refused. */
static int prepare(ft_lane *l) {
    const int32_t *mb = l->mb;
    const int32_t n = mb[MB_N], T = mb[MB_T], layer = mb[MB_LAYER];
    if (n < 1 || n > MB_PAIRS || T < 1 || T > l->tmax) return 1;
    if (layer < 0 || layer >= l->n_layers || !l->bank[layer]) return 2;
    const int32_t *ex = mb + MB_EXPERT, *tok = mb + MB_TOKEN;
    const float *w = (const float *)(mb + MB_WEIGHT);
    int32_t uniq[MB_PAIRS], group[MB_PAIRS], count[MB_PAIRS + 1] = {0};
    int ng = 0;
    for (int p = 0; p < n; p++) {
        if (ex[p] < 0 || ex[p] >= l->n_experts[layer] || tok[p] < 0 || tok[p] >= T) return 3;
        int g = 0;
        while (g < ng && uniq[g] != ex[p]) g++;
        if (g == ng) uniq[ng++] = ex[p];
        group[p] = g;
        count[g + 1]++;
    }
    for (int g = 0; g < ng; g++) {
        count[g + 1] += count[g];
        l->grp_start[g] = count[g];
        l->recs[g] = l->bank[layer] + (int64_t)uniq[g] * l->stride[layer];
    }
    l->grp_start[ng] = n;
    for (int p = 0; p < n; p++) { /* stable: a group's pairs keep their posted order */
        int slot = count[group[p]]++;
        l->pair_tok[slot] = tok[p];
        l->pair_w[slot] = w[p];
    }
    float *x = (float *)(l->mb + MB_X);
#if defined(FT_BF16)
    to_bf16(x, l->xin, (int64_t)T * l->L.hidden);
    const in_t *xin = l->xin;
    in_t *actin = l->actin;
#else
    const in_t *xin = x;
    in_t *actin = l->act;
#endif
    l->job = (moe_job){&l->L, ng, T, l->recs, l->grp_start, l->pair_tok, l->pair_w, x, l->act,
                       x + l->tmax * l->L.hidden, xin, actin};
    job_items(&l->job, l->items);
    return 0;
}

static void lead(ft_lane *l) {
    int32_t last = __atomic_load_n(&l->mb[MB_DONE], __ATOMIC_ACQUIRE);
    for (;;) {
        int32_t req;
        int64_t t0 = 0, waited_from = now_ns();
        unsigned turns = 0;
        int rested = 0;
        while ((req = __atomic_load_n(&l->mb[MB_REQ], __ATOMIC_ACQUIRE)) == last) {
            if (atomic_load_explicit(&l->stop, memory_order_relaxed)) return;
            rested |= atomic_load_explicit(&l->rest, memory_order_relaxed);
            idle_turn(l, &t0, &turns);
        }
        int64_t t = now_ns();
        /* so did the workers: this job's time includes their waking up */
        int napped = rested || t - waited_from > SPIN_NS;
        int rc = prepare(l);
        if (rc == 0) {
            for (int p = 0; p < 2; p++) atomic_store_explicit(&l->next[p].v, 0, memory_order_relaxed);
            atomic_fetch_add_explicit(&l->gen.v, 1, memory_order_release);
            run_phases(l);
            int64_t ns = now_ns() - t, g = l->job.n_groups;
            atomic_fetch_add(&l->stats[0], 1);
            atomic_fetch_add(&l->stats[1], l->grp_start[g]);
            atomic_fetch_add(&l->stats[2], g);
            atomic_fetch_add(&l->stats[3], ns);
            int64_t per = atomic_load_explicit(&l->cap_per_ns, memory_order_relaxed);
            if (per > 0 && ns > atomic_load_explicit(&l->cap_fixed_ns, memory_order_relaxed) + per * g) {
                atomic_fetch_add(&l->stats[10], 1); /* preempted, or slowed by something else: not the lane's cost */
            } else if (!napped) {
                atomic_fetch_add(&l->stats[5], 1);
                atomic_fetch_add(&l->stats[6], g);
                atomic_fetch_add(&l->stats[7], ns);
                atomic_fetch_add(&l->stats[8], g * g);
                atomic_fetch_add(&l->stats[9], g * ns);
            }
        } else {
            memset(l->mb + MB_X + l->tmax * l->L.hidden, 0, sizeof(float) * l->tmax * l->L.hidden);
            atomic_fetch_add(&l->stats[4], 1);
        }
        __atomic_store_n(&l->mb[MB_ERR], rc, __ATOMIC_RELAXED);
        __atomic_store_n(&l->mb[MB_DONE], req, __ATOMIC_RELEASE);
        last = req;
    }
}

static void work(ft_lane *l) {
    int64_t seen = 0;
    for (;;) {
        int64_t t0 = 0;
        unsigned turns = 0;
        while (atomic_load_explicit(&l->gen.v, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&l->stop, memory_order_relaxed)) return;
            idle_turn(l, &t0, &turns);
        }
        seen = atomic_load_explicit(&l->gen.v, memory_order_acquire);
        run_phases(l);
    }
}

static void *lane_main(void *p) {
    lane_arg *a = (lane_arg *)p;
    if (a->id == 0) lead(a->lane);
    else work(a->lane);
    return NULL;
}

void ft_lane_free(ft_lane *l);

/* A running lane over `mailbox` (page-locked, 64-byte aligned, at least MB_X + 2 * tmax * H words); NULL on failure.
 * bank / stride / n_experts: per layer (copied). */
ft_lane *ft_lane_new(const ft_layout *L, int32_t *mailbox, int64_t tmax, int32_t n_layers, const uint8_t *const *bank,
                     const int64_t *stride, const int32_t *n_experts, int32_t nthreads) {
    if (!layout_ok(L) || tmax < 1 || tmax > MB_PAIRS || n_layers < 1 || nthreads < 1) return NULL;
    init_tables();
    ft_lane *l = (ft_lane *)aligned_alloc(64, (sizeof(ft_lane) + 63) / 64 * 64); /* its cache-line alignments */
    if (!l) return NULL;
    memset(l, 0, sizeof(ft_lane));
    l->L = *L, l->mb = mailbox, l->tmax = tmax, l->n_layers = n_layers, l->nthreads = nthreads;
    l->bank = (const uint8_t **)calloc(n_layers, sizeof(*l->bank));
    l->stride = (int64_t *)calloc(n_layers, sizeof(int64_t));
    l->n_experts = (int32_t *)calloc(n_layers, sizeof(int32_t));
    l->act = (float *)malloc(sizeof(float) * MB_PAIRS * L->inter);
    l->xin = (in_t *)malloc(sizeof(in_t) * tmax * L->hidden);
    l->actin = (in_t *)malloc(sizeof(in_t) * MB_PAIRS * L->inter);
    l->th = (pthread_t *)calloc(nthreads, sizeof(pthread_t));
    l->args = (lane_arg *)calloc(nthreads, sizeof(lane_arg));
    if (!l->bank || !l->stride || !l->n_experts || !l->act || !l->xin || !l->actin || !l->th || !l->args) {
        l->nthreads = 0;
        ft_lane_free(l);
        return NULL;
    }
    memcpy(l->bank, bank, n_layers * sizeof(*bank));
    memcpy(l->stride, stride, n_layers * sizeof(int64_t));
    memcpy(l->n_experts, n_experts, n_layers * sizeof(int32_t));
    for (int i = 0; i < nthreads; i++) {
        l->args[i] = (lane_arg){l, i};
        if (pthread_create(&l->th[i], NULL, lane_main, &l->args[i]) != 0) {
            l->nthreads = i; /* join the started ones; none is inside a job (no post can have been answered) */
            ft_lane_free(l);
            return NULL;
        }
    }
    return l;
}

void ft_lane_free(ft_lane *l) {
    if (!l) return;
    atomic_store(&l->stop, 1);
    for (int i = 0; i < l->nthreads; i++) pthread_join(l->th[i], NULL);
    free(l->bank), free(l->stride), free(l->n_experts), free(l->act), free(l->xin), free(l->actin);
    free(l->th), free(l->args);
    free(l);
}

/* out[11] = jobs, pairs, experts, busy nanoseconds (post seen -> answer written), refused posts; then over the jobs that
 * found the team spinning (the others' time includes waking threads up) and stayed within the cap their number and the
 * sums of experts, ns, experts^2 and experts * ns (a least-squares line of job time against experts); then the jobs over
 * the cap; all cumulative. */
void ft_lane_stats(ft_lane *l, int64_t *out) {
    for (int i = 0; i < 11; i++) out[i] = atomic_load(&l->stats[i]);
}

/* on: idle threads nap REST_NS per turn instead of spinning (posted jobs are still answered, up to REST_NS late);
 * off: back to spinning at once. */
void ft_lane_rest(ft_lane *l, int32_t on) {
    atomic_store_explicit(&l->rest, on != 0, memory_order_relaxed);
}

/* Jobs slower than fixed_ns + per_ns * experts are counted as outliers, not fitted; per_ns 0 lifts the cap. */
void ft_lane_set_fit_cap(ft_lane *l, int64_t fixed_ns, int64_t per_ns) {
    atomic_store(&l->cap_fixed_ns, fixed_ns);
    atomic_store(&l->cap_per_ns, per_ns);
}
