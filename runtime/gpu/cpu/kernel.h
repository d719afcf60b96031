/* Declarations shared by the CPU expert kernel (`kernel.c`, its format decode in `fp4_decode.h`) and the lane that
 * runs it for the GPU (`lane.c`). */
#ifndef FT_CPU_NVFP4_H
#define FT_CPU_NVFP4_H
#include <stdint.h>

/* The kernel's input vectors (x, the gated activations): bf16 bit patterns where the CPU has AVX512-BF16 dot products
 * (vdpbf16ps, 32 weights per instruction), else fp32 holding bf16 values. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FT_BF16 1
typedef uint16_t in_t;
#else
typedef float in_t;
#endif

enum { FT_NVFP4 = 0, FT_MXFP4 = 1 };          /* record schemes (record_layout.py SCHEMES) */
/* expert activations (record_layout.py ACTS) */
enum { FT_SILU = 0, FT_CLAMPED_SWIGLU = 1, FT_CLAMPED_SILU = 2 };

/* One expert record: byte offsets of its components (see record_layout.py) and the expert's function, fixed per model.
 * off_gus2 / off_ds2: the per-row second-level scales (NVFP4; -1 absent); off_gub / off_db: the per-row biases added
 * to gate/up and down (MXFP4; -1 absent). act FT_SILU: silu(g) * u; FT_CLAMPED_SWIGLU (gpt_oss): g' = min(g, limit),
 * u' = clamp(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha * g'); FT_CLAMPED_SILU (deepseek_v4): silu(g') * u'.
 */
typedef struct {
    int64_t hidden, inter;
    int64_t off_gu, off_gus, off_gus2, off_d, off_ds, off_ds2;
    int64_t off_gub, off_db;
    int32_t scheme, act;
    float alpha, limit;
} ft_layout;

/* One MoE layer step: the arguments of `ft_nvfp4_moe`, split into work items of two phases (gate_up row chunks
 * per expert, then chunks of y's rows, each over every expert) so that an OpenMP team (`ft_nvfp4_moe`) or the
 * lane's spinning team (`lane.c`) can run them; items of one phase are independent, phases are ordered.
 * Pairs are grouped by expert: group g (record recs[g]) owns pairs grp_start[g] .. grp_start[g + 1] - 1. */
typedef struct {
    const ft_layout *L;
    int32_t n_groups, T;
    const uint8_t *const *recs;
    const int32_t *grp_start, *pair_tok;
    const float *pair_w, *x;
    float *act, *y;
    const in_t *xin; /* x as the dots read it: x itself, or its bf16 bits (`to_bf16`) */
    in_t *actin;     /* act as the down dots read it: act itself, or bf16 bits written beside it */
} moe_job;

void init_tables(void);
int layout_ok(const ft_layout *L); /* 1 if the kernel takes this layout (sizes, scheme, activation) */
void to_bf16(const float *src, uint16_t *dst, int64_t n); /* the top half of each float (exact for bf16 values) */
void job_items(const moe_job *j, int64_t n[2]); /* items per phase */
void gu_item(const moe_job *j, int64_t item);
void down_item(const moe_job *j, int64_t item);
#endif
