/* One sequence's decode step through every decoder layer of a Llama-family model on the CPU, float32, in one
 * call. Built with cpu_decode_attention.c into one library by kvkernels/cpu_decode.py;
 * engine/models/native_decode.py says why this exists and which models take it.
 *
 * A layer: RMSNorm of the residual stream, the q/k/v product (and its bias), an RMSNorm of each q and k head
 * where the model has one, rotate-half RoPE of the leading rotary_dim dims, the new token's K and V into its
 * slot, paged attention over the sequence (kvserve_decode_one_f32), o_proj, RMSNorm, the gate/up product with
 * SiLU(gate) * up, down_proj; the final RMSNorm after the last layer. Each product is a matrix-vector product
 * whose rows the parts (a thread each) split in contiguous ranges, each part's rows read from its own stream of
 * every layer's (kvserve_decode_step_pack_f32), each row summed in four vectors of lanes; everything else is a
 * few thousand floats, on the calling thread. The math is the PyTorch layers' in float32, summed in
 * another order (as any two kernels' sums are). */

#include "cpu_lanes.h"

#include <omp.h>

/* One decoder layer's tensors, contiguous float32; a NULL bias or head norm: the model has none. The step reads
 * qkv, o, gate_up and down from the parts' streams; kvserve_decode_step_pack_f32 reads them here. */
struct layer {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *gate_up_bias, *down,
        *down_bias;
    float *k_cache, *v_cache; /* (blocks, block_size, kv_heads, head_dim) */
};

struct step {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, block_size, num_slots;
    float eps, scale;
    int threads;
    const struct layer *layers;
    const float *final_norm;
    const float *cos_sin;       /* (rotary_dim,): the new token's cosines, then its sines */
    const int32_t *block_table; /* the sequence's blocks */
    int32_t seq_len;            /* the tokens the sequence holds, the new one included */
    int64_t slot;               /* the new token's slot in the caches */
    float *x;                   /* in: the token's embedding; out: the last layer's output, normed */
    float *work;                /* kvserve_decode_step_work_f32(...) floats of scratch */
    const float *const *parts;  /* the layers' matrices in num_parts streams (kvserve_decode_step_pack_f32) */
    int64_t num_parts;
};

static float sum_lanes(lanes v) {
    float s[LANES];
    memcpy(s, &v, sizeof s);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++)
            s[j] += s[j + width];
    return s[0];
}

/* a . x over n floats, in four vectors of partial sums: one row of a product, read front to back once */
static float row_dot(const float *restrict a, const float *restrict x, int64_t n) {
    lanes s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        s0 += load(a + i) * load(x + i);
        s1 += load(a + i + LANES) * load(x + i + LANES);
        s2 += load(a + i + 2 * LANES) * load(x + i + 2 * LANES);
        s3 += load(a + i + 3 * LANES) * load(x + i + 3 * LANES);
    }
    for (; i + LANES <= n; i += LANES)
        s0 += load(a + i) * load(x + i);
    float total = sum_lanes((s0 + s1) + (s2 + s3));
    for (; i < n; i++)
        total += a[i] * x[i];
    return total;
}

/* Part `part`'s rows [*first, *last) of a product of n rows: the parts split them evenly, in multiples of `align`
 * but the last part's end. */
static void part_rows(int64_t n, int64_t align, int64_t part, int64_t parts, int64_t *first, int64_t *last) {
    *first = n * part / parts / align * align;
    *last = part == parts - 1 ? n : n * (part + 1) / parts / align * align;
}

/* Where each part's stream is: the floats of it that the products so far read. */
struct streams {
    const float *const *parts;
    int64_t count, read[64];
};

/* Each part's rows of one product, `per_row` floats a row, in the order the step reads them: rows [first, last)
 * of each of `sources` matrices of k columns (gate/up: a row of gate, then the same row of up), appended to
 * dest[part] (where not NULL); adds the floats to read[part]. */
static void pack(const float *const *sources, int n_sources, int64_t n, int64_t k, int64_t align, float **dest,
                 int64_t *read, int64_t parts) {
    for (int64_t part = 0; part < parts; part++) {
        int64_t first, last;
        part_rows(n, align, part, parts, &first, &last);
        for (int64_t r = first; r < last; r++)
            for (int i = 0; i < n_sources; i++, read[part] += k)
                if (dest != NULL)
                    memcpy(dest[part] + read[part], sources[i] + r * k, sizeof(float) * k);
    }
}

/* y (n) = w (n, k) x (+ bias), w's rows read from the parts' streams (a thread a part, or several parts) */
static void product(struct streams *w, const float *bias, const float *x, float *y, int64_t n, int64_t k,
                    int threads) {
#pragma omp parallel num_threads(threads)
    for (int64_t part = omp_get_thread_num(); part < w->count; part += omp_get_num_threads()) {
        int64_t first, last;
        part_rows(n, 1, part, w->count, &first, &last);
        const float *rows = w->parts[part] + w->read[part];
        for (int64_t r = first; r < last; r++)
            y[r] = row_dot(rows + (r - first) * k, x, k) + (bias ? bias[r] : 0.0f);
    }
    pack(NULL, 1, n, k, 1, NULL, w->read, w->count);
}

/* act (inter) = SiLU(gate) * up, where gate and up are the two halves of the gate/up product (2 inter rows of k,
 * read as pairs of rows from the parts' streams) (+ bias); up is scratch. SiLU(g) = g / (1 + e^-g), with e^-|g|
 * from exp_lanes: g e^g / (1 + e^g) where g < 0. */
static void gated(struct streams *w, const float *bias, const float *x, float *act, float *up, int64_t inter,
                  int64_t k, int threads) {
#pragma omp parallel num_threads(threads)
    for (int64_t part = omp_get_thread_num(); part < w->count; part += omp_get_num_threads()) {
        int64_t first, last;
        part_rows(inter, LANES, part, w->count, &first, &last);
        const float *rows = w->parts[part] + w->read[part];
        for (int64_t r = first; r < last; r++) {
            act[r] = row_dot(rows + (r - first) * 2 * k, x, k) + (bias ? bias[r] : 0.0f);
            up[r] = row_dot(rows + ((r - first) * 2 + 1) * k, x, k) + (bias ? bias[inter + r] : 0.0f);
        }
        int64_t r = first;
        for (; r + LANES <= last; r += LANES) {
            const lanes g = load(act + r);
            int_lanes bits;
            lanes negative;
            memcpy(&bits, &g, sizeof bits);
            bits |= INT32_MIN; /* the sign bit: -|g| */
            memcpy(&negative, &bits, sizeof negative);
            const lanes e = exp_lanes(negative);
            const lanes positive = __builtin_convertvector(-(g >= 0.0f), lanes); /* 1 or 0 */
            const lanes silu = g * (positive + (1.0f - positive) * e) / (1.0f + e) * load(up + r);
            memcpy(act + r, &silu, sizeof silu);
        }
        for (; r < last; r++)
            act[r] = act[r] / (1.0f + expf(-act[r])) * up[r];
    }
    pack(NULL, 2, inter, k, LANES, NULL, w->read, w->count);
}

/* residual = x (+ residual); out = w * (residual / rms(residual)), as transformers' RMSNorm in float32 */
static void add_norm(const float *x, float *residual, int add, const float *w, float *out, int64_t n, float eps) {
    lanes squares = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const lanes r = add ? load(x + i) + load(residual + i) : load(x + i);
        memcpy(residual + i, &r, sizeof r);
        squares += r * r;
    }
    float total = sum_lanes(squares);
    for (; i < n; i++) {
        residual[i] = add ? x[i] + residual[i] : x[i];
        total += residual[i] * residual[i];
    }
    const float inverse = 1.0f / sqrtf(total / n + eps);
    for (i = 0; i < n; i++)
        out[i] = w[i] * (residual[i] * inverse);
}

/* each of `heads` heads of v: RMSNorm by w (if any), then rotate-half RoPE of its leading rotary_dim dims */
static void norm_rotate(float *v, int64_t heads, int64_t head_dim, const float *w, float eps, const float *cos_sin,
                        int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *head = v + h * head_dim;
        if (w != NULL)
            add_norm(head, head, 0, w, head, head_dim, eps);
        for (int64_t j = 0; j < half; j++) {
            const float x1 = head[j], x2 = head[j + half], cos = cos_sin[j], sin = cos_sin[half + j];
            head[j] = x1 * cos - x2 * sin;
            head[j + half] = x2 * cos + x1 * sin;
        }
    }
}

int64_t kvserve_decode_step_work_f32(const struct step *s) {
    return 2 * s->hidden + (s->num_heads + 2 * s->num_kv_heads) * s->head_dim + s->num_heads * s->head_dim +
           2 * s->intermediate;
}

/* The layers' matrices (the layer structs' qkv, o, gate_up, down) as the step reads them, in num_parts streams:
 * stream p holds part p's rows of each product in turn, so that the thread that reads it reads one run of memory
 * from the first layer to the last, as a single stream over all the weights does (a third faster in this host's
 * faster bandwidth mode than each thread's half of each matrix in turn, which jumps 120 times a step).
 * dest[p] (where not NULL) gets stream p; sizes[p] gets its floats. Returns 0, -3 for a count outside 1..64. */
int kvserve_decode_step_pack_f32(const struct step *s, float **dest, int64_t *sizes) {
    if (s->num_parts < 1 || s->num_parts > 64)
        return -3;
    const int64_t hidden = s->hidden, q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    memset(sizes, 0, sizeof(int64_t) * s->num_parts);
    for (int64_t l = 0; l < s->num_layers; l++) {
        const struct layer *w = s->layers + l;
        const float *gate_up[2] = {w->gate_up, w->gate_up + s->intermediate * hidden};
        pack(&w->qkv, 1, q_size + 2 * kv_size, hidden, 1, dest, sizes, s->num_parts);
        pack(&w->o, 1, hidden, q_size, 1, dest, sizes, s->num_parts);
        pack(gate_up, 2, s->intermediate, hidden, LANES, dest, sizes, s->num_parts);
        pack(&w->down, 1, hidden, s->intermediate, 1, dest, sizes, s->num_parts);
    }
    return 0;
}

/* Returns 0; -1 where the slot lies outside the caches (nothing is written then), -2 where attention could not
 * allocate its scores, -3 for a count of parts outside 1..64. */
int kvserve_decode_step_f32(const struct step *s) {
    if (s->num_parts < 1 || s->num_parts > 64)
        return -3;
    const int64_t hidden = s->hidden, q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    if (s->slot < 0 || s->slot >= s->num_slots)
        return -1;
    float *residual = s->work, *h = residual + hidden, *qkv = h + hidden, *attn = qkv + q_size + 2 * kv_size;
    float *act = attn + q_size, *up = act + s->intermediate;
    float *q = qkv, *k = qkv + q_size, *v = k + kv_size;
    struct streams w_all = {s->parts, s->num_parts, {0}};
    for (int64_t l = 0; l < s->num_layers; l++) {
        const struct layer *w = s->layers + l;
        add_norm(s->x, residual, l > 0, w->input_norm, h, hidden, s->eps);
        product(&w_all, w->qkv_bias, h, qkv, q_size + 2 * kv_size, hidden, s->threads);
        norm_rotate(q, s->num_heads, s->head_dim, w->q_norm, s->eps, s->cos_sin, s->rotary_dim);
        norm_rotate(k, s->num_kv_heads, s->head_dim, w->k_norm, s->eps, s->cos_sin, s->rotary_dim);
        memcpy(w->k_cache + s->slot * kv_size, k, sizeof(float) * kv_size);
        memcpy(w->v_cache + s->slot * kv_size, v, sizeof(float) * kv_size);
        if (kvserve_decode_one_f32(q, w->k_cache, w->v_cache, s->block_table, s->seq_len, attn, s->num_kv_heads,
                                   s->num_heads / s->num_kv_heads, s->head_dim, s->block_size, s->scale,
                                   s->threads) != 0)
            return -2;
        product(&w_all, NULL, attn, s->x, hidden, q_size, s->threads);
        add_norm(s->x, residual, 1, w->post_norm, h, hidden, s->eps);
        gated(&w_all, w->gate_up_bias, h, act, up, s->intermediate, hidden, s->threads);
        product(&w_all, w->down_bias, act, s->x, hidden, s->intermediate, s->threads);
    }
    add_norm(s->x, residual, 1, s->final_norm, s->x, hidden, s->eps);
    return 0;
}
