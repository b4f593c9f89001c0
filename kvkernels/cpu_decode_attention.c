/* Paged decode attention on the CPU, float32: one new query token per sequence over its KV in the pool.
 *
 * Built and loaded by kvkernels/cpu_decode.py (its docstring says why this exists). Shapes, all contiguous:
 *   q, out        (seqs, kv_heads * group, head_dim)
 *   k/v_cache     (blocks, block_size, kv_heads, head_dim)
 *   block_tables  (seqs, table_stride) int32; seq_lens (seqs,) int32
 * A task is a sequence's KV heads (or one of them): their query heads score every token the sequence holds,
 * read in place from its blocks (no gather), then a softmax, then the weighted sum of V. A sequence of length 0 (batch
 * padding) gets zeros. Sums run in LANES partial sums combined in a fixed order, so the result does not depend
 * on the vector width the compiler picks (AVX2 or AVX-512 give the same bits). */

#include "cpu_lanes.h"

#include <omp.h>

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    lanes partial = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        partial += load(a + d) * load(b + d);
    float sums[LANES];
    memcpy(sums, &partial, sizeof sums);
    for (int j = 0; d < n; d++, j++)
        sums[j] += a[d] * b[d];
    /* halving, not a running sum: a few vector adds instead of LANES dependent scalar ones */
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++)
            sums[j] += sums[j + width];
    return sums[0];
}

/* The head_dim / LANES products of each of LANES rows with one query, lane by lane in order: each row's lane
 * vector as dot() builds it, before its lanes are summed. */
static void partials(lanes out[LANES], const float *restrict q, const float *const rows[LANES], int64_t n) {
    for (int i = 0; i < LANES; i++) {
        lanes partial = {0};
        for (int64_t d = 0; d < n; d += LANES)
            partial += load(q + d) * load(rows[i] + d);
        out[i] = partial;
    }
}

/* The lane sums of LANES vectors at once: lane i of the result is the sum of v[i]'s lanes, added in dot()'s
 * halving order (so the same bits as dot() for a head_dim that is a multiple of LANES). Each level pairs the
 * vectors up and halves every one's live lanes: a transpose and a reduction in 15 shuffle-adds, where dot()
 * spends LANES - 1 dependent scalar adds on each row. */
static lanes lane_sums(lanes v[LANES]) {
    for (int i = 0; i < 8; i++) /* each row's 16 lanes -> 8: [row 2i (8) | row 2i+1 (8)] */
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int i = 0; i < 4; i++) /* 8 -> 4 lanes a row: rows 4i..4i+3 */
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* 4 -> 2 lanes a row: rows 8i..8i+7 */
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    /* 2 -> 1: row i in lane i */
    return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* acc += p * v over n floats */
static void add_scaled(float *restrict acc, float p, const float *restrict v, int64_t n) {
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) {
        lanes sum = load(acc + d) + p * load(v + d);
        memcpy(acc + d, &sum, sizeof sum);
    }
    for (; d < n; d++)
        acc[d] += p * v[d];
}

/* s[0..n) = e^(s - top), returning their sum (added in order, one at a time) */
static float exp_shifted(float *s, int64_t n, float top) {
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        lanes e = exp_lanes(load(s + t) - top);
        memcpy(s + t, &e, sizeof e);
    }
    if (t < n) {
        float tail[LANES] = {0};
        memcpy(tail, s + t, sizeof(float) * (n - t));
        lanes e = exp_lanes(load(tail) - top);
        memcpy(tail, &e, sizeof e);
        memcpy(s + t, tail, sizeof(float) * (n - t));
    }
    float total = 0.0f;
    for (t = 0; t < n; t++)
        total += s[t];
    return total;
}

/* Where a task's rows lie: token t's row in a cache, from the span's first float on. */
struct rows {
    const int32_t *table; /* the sequence's block table */
    int64_t len, block_size, block_stride, token_stride, offset, width, ahead;
    int shift; /* log2(block_size) where it is a power of two (a shift, not a division, per row), else -1 */
};

static int log2_of(int64_t block_size) {
    for (int shift = 0; shift < 31; shift++)
        if (((int64_t)1 << shift) == block_size)
            return shift;
    return -1;
}

static const float *row_at(const float *cache, const struct rows *r, int64_t t) {
    const int64_t block = r->shift >= 0 ? t >> r->shift : t / r->block_size;
    return cache + r->table[block] * r->block_stride + (t - block * r->block_size) * r->token_stride + r->offset;
}

/* Token t's row, after prefetching the row `ahead` tokens on: reading a sequence's rows walks its blocks in a
 * pattern the hardware prefetcher follows badly (scattered blocks, a head's slice of each row), and the loop
 * does too little work per row to hide a miss (0.85 against 0.60 ms on the bundled model's 16 x 270 tokens,
 * cold). */
static const float *next_row(const float *cache, const struct rows *r, int64_t t) {
    if (t + r->ahead < r->len) {
        const float *next = row_at(cache, r, t + r->ahead);
        for (int64_t d = 0; d < r->width; d += 16)
            __builtin_prefetch(next + d);
    }
    return row_at(cache, r, t);
}

/* One task's attention: its query heads (q: their rows, head h over the span's KV head h / group) over the
 * sequence's tokens [first, last), read through r; scores holds heads * (last - first) floats. For each head,
 * top = its largest score, total = the sum of e^(score - top), and o (zeroed by the caller) gets the sum of each
 * token's V times e^(score - top), divided by total first where `normalize` (a whole sequence's task) and not
 * where the caller combines several ranges (kvserve_decode_one_f32). */
static void attend(const float *q, const float *k_cache, const float *v_cache, const struct rows *r, int64_t first,
                   int64_t last, int64_t heads, int64_t group, int64_t head_dim, float scale, float *scores,
                   float *top, float *total, float *o, int normalize) {
    const int64_t n = last - first;
    int64_t t = 0;
    if (head_dim % LANES == 0) /* LANES tokens at a time, their sums transposed into one vector */
        for (; t + LANES <= n; t += LANES) {
            const float *k[LANES], *k_head[LANES];
            for (int i = 0; i < LANES; i++)
                k[i] = next_row(k_cache, r, first + t + i);
            for (int64_t h = 0; h < heads; h++) {
                for (int i = 0; i < LANES; i++)
                    k_head[i] = k[i] + (h / group) * head_dim;
                lanes sums[LANES];
                partials(sums, q + h * head_dim, k_head, head_dim);
                const lanes s = lane_sums(sums) * scale;
                memcpy(scores + h * n + t, &s, sizeof s);
            }
        }
    for (; t < n; t++) {
        const float *k = next_row(k_cache, r, first + t);
        for (int64_t h = 0; h < heads; h++)
            scores[h * n + t] = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * n;
        top[h] = s[0];
        for (t = 1; t < n; t++)
            top[h] = s[t] > top[h] ? s[t] : top[h];
        total[h] = exp_shifted(s, n, top[h]);
        for (t = 0; normalize && t < n; t++)
            s[t] /= total[h];
    }
    for (t = 0; t < n; t++) {
        const float *v = next_row(v_cache, r, first + t);
        for (int64_t h = 0; h < heads; h++)
            add_scaled(o + h * head_dim, scores[h * n + t], v + (h / group) * head_dim, head_dim);
    }
}

static int64_t rows_ahead(int64_t width) { /* rows to prefetch ahead: ~2 KiB on */
    return width * 4 >= 2048 ? 2 : (2048 + width * 4 - 1) / (width * 4);
}

/* Returns 0, or -1 where a score buffer could not be allocated (the caller raises). */
int kvserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                             float *out, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                             int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    const int64_t token_stride = num_kv_heads * head_dim; /* floats from one token to the next in a block */
    const int64_t block_stride = block_size * token_stride;
    /* A task is a sequence's KV heads [first, first + span): all of them (whole rows, read front to back)
     * when the sequences keep the threads busy, else one each. */
    const int64_t span = num_seqs >= 2 * num_threads ? num_kv_heads : 1, chunks = num_kv_heads / span;
    const int64_t width = span * head_dim, heads = span * group; /* floats of a row read; query heads */
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * chunks; task++) {
        const int64_t seq = task / chunks, first = (task % chunks) * span;
        const int64_t q_row = (seq * num_kv_heads + first) * group * head_dim; /* its first query head */
        const int64_t len = seq_lens[seq];
        float *o = out + q_row;
        memset(o, 0, sizeof(float) * heads * head_dim);
        if (len <= 0)
            continue;
        float *scores = malloc(sizeof(float) * heads * (len + 2)); /* (heads, len), then top and total */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const struct rows rows = {block_tables + seq * table_stride, len, block_size, block_stride, token_stride,
                                  first * head_dim, width, rows_ahead(width), log2_of(block_size)};
        float *top = scores + heads * len;
        attend(q + q_row, k_cache, v_cache, &rows, 0, len, heads, group, head_dim, scale, scores, top, top + heads, o,
               1);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* One sequence's decode attention (kvserve_paged_decode_f32's arguments for one sequence), the threads splitting
 * its tokens rather than its KV heads: one sequence has too few KV heads to keep them evenly busy (3 on two
 * threads, the bundled model's). Each CHUNK of tokens gives each head its top score, sum of exponentials and
 * weighted V; the chunks combine in order, rescaled to the largest top, as split-KV decoding does on a GPU. The
 * chunks do not depend on the thread count, so neither do the bits. Returns 0, or -1 where a buffer could not
 * be allocated. */
#define CHUNK 32
int kvserve_decode_one_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
                           int32_t len, float *out, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, float scale, int num_threads) {
    const int64_t width = num_kv_heads * head_dim, heads = num_kv_heads * group, part = heads * (head_dim + 2);
    const int64_t chunks = (len + CHUNK - 1) / CHUNK;
    memset(out, 0, sizeof(float) * heads * head_dim);
    if (len <= 0)
        return 0;
    float *parts = calloc((size_t)chunks * part, sizeof(float)); /* each chunk's (top, total, o) */
    int failed = parts == NULL;
    const struct rows rows = {block_table, len,   block_size,        block_size * width, width,
                              0,           width, rows_ahead(width), log2_of(block_size)};
#pragma omp parallel num_threads(num_threads) if (!failed)
    {
        float *scores = malloc(sizeof(float) * heads * CHUNK);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            float *top = parts + c * part, *total = top + heads;
            if (scores != NULL)
                attend(q, k_cache, v_cache, &rows, c * CHUNK, c * CHUNK + CHUNK < len ? c * CHUNK + CHUNK : len, heads,
                       group, head_dim, scale, scores, top, total, total + heads, 0);
        }
        free(scores);
    }
    for (int64_t h = 0; h < heads && !failed; h++) {
        float best = parts[h], sum = 0.0f, *o = out + h * head_dim;
        for (int64_t c = 1; c < chunks; c++)
            best = parts[c * part + h] > best ? parts[c * part + h] : best;
        for (int64_t c = 0; c < chunks; c++) {
            const float *top = parts + c * part, *total = top + heads, *acc = total + heads + h * head_dim;
            const float weight = expf(top[h] - best);
            sum += weight * total[h];
            add_scaled(o, weight, acc, head_dim);
        }
        for (int64_t d = 0; d < head_dim; d++)
            o[d] /= sum;
    }
    free(parts);
    return failed ? -1 : 0;
}

/* Stores each new token's K and V row (kv_heads * head_dim floats) into its slot of the caches; a slot of -1
 * (batch padding) is skipped. Returns 0, or -1 where a slot lies outside the caches' num_slots (nothing is
 * written then). The PyTorch reference spends about ten ATen calls a layer on this (a mask, a nonzero, two
 * index, two index_copy_): more than the rows it moves at a decode step's few tokens. */
int kvserve_store_kv_f32(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *slots,
                         int64_t num_tokens, int64_t row, int64_t num_slots) {
    for (int64_t i = 0; i < num_tokens; i++)
        if (slots[i] < -1 || slots[i] >= num_slots)
            return -1;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0)
            continue;
        memcpy(k_cache + slots[i] * row, k + i * row, sizeof(float) * row);
        memcpy(v_cache + slots[i] * row, v + i * row, sizeof(float) * row);
    }
    return 0;
}
