/* The sampler's masked elementwise stages on the CPU, one pass per stage, rows in parallel
 * (OpenMP). PyTorch's masked_fill / where run these at a few ns per element on the CPU; here
 * they are plain loops. Every value is the same IEEE float32 operation PyTorch performs
 * (a multiply, a divide or a copy), so the results are the same bits.
 *
 * Arrays are row-major [rows, vocab], contiguous; `out` may be `in`. */
#include <math.h>
#include <stdint.h>

/* The penalties in HF's order, one pass: where seen (when given), x < 0 ? x * penalty :
 * x / penalty (the repetition penalty); then x - offsets (when given: frequency * count +
 * presence * (count > 0)). `seen` is a torch bool tensor (one byte, 0 or 1), read as uint8_t:
 * GCC vectorises the select over bytes, not over C's bool (25x slower here). */
void batchgen_penalize(const float *in, const uint8_t *seen, const float *penalty,
                       const float *offsets, float *out, int64_t rows, int64_t vocab) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = in + r * vocab;
        float *y = out + r * vocab;
        if (seen) {
            const uint8_t *m = seen + r * vocab;
            const float p = penalty[r];
            for (int64_t j = 0; j < vocab; j++) {
                const float v = x[j];
                const float w = v < 0.0f ? v * p : v / p;
                y[j] = m[j] ? w : v;
            }
            x = y;
        }
        if (offsets) {
            const float *o = offsets + r * vocab;
            for (int64_t j = 0; j < vocab; j++) y[j] = x[j] - o[j];
        }
    }
}

/* out = in, with -inf wherever ref < limit[row] (or ref <= limit[row] when `inclusive`):
 * top-k (ref = in, limit = the k-th value), top-p (ref = in, limit = the last removed value,
 * inclusive), min-p (ref = the probabilities, limit = min_p * the top probability). */
void batchgen_mask_below(const float *in, const float *ref, const float *limit, float *out,
                         int64_t rows, int64_t vocab, int inclusive) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = in + r * vocab;
        const float *f = ref + r * vocab;
        float *y = out + r * vocab;
        const float l = limit[r];
        if (inclusive) {
            for (int64_t j = 0; j < vocab; j++) y[j] = f[j] <= l ? -INFINITY : x[j];
        } else {
            for (int64_t j = 0; j < vocab; j++) y[j] = f[j] < l ? -INFINITY : x[j];
        }
    }
}

/* Inverse-CDF sampling: for each row the first token whose cumulative probability exceeds
 * u * total (total = the row's sum; u rounded up to 1 stays inside), summing in token order.
 * Zero-probability tokens add nothing, so their intervals are empty and never chosen. */
void batchgen_inverse_cdf(const float *probs, const double *u, int64_t *out, int64_t rows,
                          int64_t vocab) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * vocab;
        float total = 0.0f;
        for (int64_t j = 0; j < vocab; j++) total += p[j];
        float target = (float)(u[r] * (double)total);
        const float below = nextafterf(total, 0.0f);
        if (target > below) target = below;
        float cum = 0.0f;
        int64_t pick = vocab - 1;
        for (int64_t j = 0; j < vocab; j++) {
            cum += p[j];
            if (cum > target) {
                pick = j;
                break;
            }
        }
        out[r] = pick;
    }
}

/* The penalty tables after a step: slot slots[i] generated tokens[i] (one per slot): count it,
 * mark it seen, and set its offset to frequency * count + presence (the float32 operations
 * of the PyTorch path, in its order). */
void batchgen_penalty_add(int32_t *counts, uint8_t *seen, float *offsets, const int64_t *slots,
                          const int64_t *tokens, const float *frequency, const float *presence,
                          int64_t n, int64_t vocab) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t at = slots[i] * vocab + tokens[i];
        counts[at] += 1;
        seen[at] = 1;
        offsets[at] = frequency[i] * (float)counts[at] + presence[i];
    }
}

/* HF top-p's removal from its sorted pass: `probs` is the softmax of each row's ascending
 * values `sorted`, whose cumulative sum (PyTorch's cumsum on the CPU: a double running sum,
 * rounded to float at each element, reproduced here) is summed only as far as the cut; the
 * tokens removed are the prefix whose cum <= cut (never the last), i.e. every token <= v, the
 * last removed value, unless the next value equals v too. out = scores with those -inf;
 * partial[r] = 1 where the cut splits a run of tokens tied at a finite v (the caller redoes
 * those rows with the index sort, whose tie order decides). */
void batchgen_top_p_cut(const float *probs, const float *sorted, const float *cut,
                        const float *scores, float *out, uint8_t *partial, int64_t rows,
                        int64_t vocab) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * vocab;
        const float *sv = sorted + r * vocab;
        const float *x = scores + r * vocab;
        float *y = out + r * vocab;
        const float c = cut[r];
        double cum = 0.0;
        int64_t j = 0;
        while (j < vocab - 1) {  /* the cumsum never decreases: stop at the first above */
            cum += (double)p[j];
            if (!((float)cum <= c)) break;
            j++;
        }
        if (j == 0) {
            for (int64_t k = 0; k < vocab; k++) y[k] = x[k];
            partial[r] = 0;
            continue;
        }
        const float v = sv[j - 1];
        partial[r] = (sv[j] == v) && isfinite(v);
        for (int64_t k = 0; k < vocab; k++) y[k] = x[k] <= v ? -INFINITY : x[k];
    }
}

/* The draws' uniforms (sampler.uniforms, the same integer arithmetic): splitmix64 of
 * key + (counter + 1) * golden, its top 53 bits as a double in [0, 1). */
static inline uint64_t splitmix_finish(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void batchgen_uniforms(const uint64_t *keys, const int64_t *counters, double *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t z = keys[i] + ((uint64_t)counters[i] + 1ull) * 0x9E3779B97F4A7C15ull;
        out[i] = (double)(splitmix_finish(z) >> 11) * 0x1.0p-53;
    }
}
