/* What the CPU's C kernels share (cpu_decode_attention.c, cpu_decode_step.c): sixteen-float vectors, the
 * attention kernel's entry points, and an exponential of sixteen lanes at a time. */

#ifndef KVSERVE_CPU_LANES_H
#define KVSERVE_CPU_LANES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* Sixteen floats, written out as a vector so that the compiler emits vector instructions whatever its tuning
 * prefers (it left the plain loops scalar for some CPUs); unaligned loads through memcpy. */
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));

static inline lanes load(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef int32_t int_lanes __attribute__((vector_size(LANES * sizeof(int32_t))));

/* e^x for x <= 0, LANES at a time (libm's expf is one at a time: a sixth of the kernel's time at 16 sequences).
 * x = k ln2 + r with |r| <= ln2 / 2 (k rounded to nearest by the 1.5 * 2^23 trick; ln2 in two parts, as Cody
 * and Waite split it, so that r is exact), e^r by its Taylor polynomial to r^7 / 7! (the next term is under
 * 2e-9 of the result), times 2^k written into the exponent's bits; where 2^k would be subnormal (x below
 * about -87.3) the result is 0, where expf gives a subnormal. */
static inline lanes exp_lanes(lanes x) {
    const float round = 12582912.0f; /* 1.5 * 2^23 */
    lanes k = (x * 1.44269504088896341f + round) - round;
    lanes r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    lanes p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int_lanes scale = (__builtin_convertvector(k, int_lanes) + 127) << 23, bits;
    lanes twos;
    memcpy(&twos, &scale, sizeof twos);
    p *= twos;
    memcpy(&bits, &p, sizeof bits);
    bits &= (int_lanes)(k >= -126.0f); /* (a comparison gives -1 in the lanes where it holds, else 0) */
    memcpy(&p, &bits, sizeof p);
    return p;
}

int kvserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                             float *out, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                             int64_t head_dim, int64_t block_size, float scale, int num_threads);
int kvserve_decode_one_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
                           int32_t len, float *out, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, float scale, int num_threads);

#endif
