/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
 * paged pool (no gather), GQA/MQA, sliding window, logit softcap and attention sinks.
 *
 * Layouts (contiguous): q and out [S, Hq, D] float32; k and v one layer of the pool
 * [P, B, Hkv, D] (FlashInfer NHD), float32, bfloat16, float8 e4m3fn or e5m2 (widened to float32 on
 * load, all math in float32; fp8 scales are applied by the caller); kv_indptr [S+1], kv_indices
 * [pages], kv_len [S] (int32).
 * Every sum has a fixed order (over d for a score, over keys in explicit 16-wide lanes for the
 * softmax denominator, key by key for P V), so a sequence's
 * result depends only on its own keys: not on the batch, the thread count, the physical blocks
 * it got or memory alignment (batch invariance). Loaded by batchgen/attention/cpu_kernel.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Pool element kinds: float32, bfloat16 (the top half of a float32), float8 e4m3fn and e5m2
 * (each through a 256-entry table). `kind` is a constant wherever these are inlined, so each
 * pool dtype gets its own branch-free copy of the loops. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2, KV_E5M2 = 3 };

static float fp8_table[256], e5m2_table[256];

/* float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities; 0x7f and
 * 0xff are NaN) to float32, exactly. */
static void fill_fp8_table(void) {
    for (int b = 0; b < 256; ++b) {
        const int e = (b >> 3) & 15, m = b & 7;
        float x = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if (e == 15 && m == 7) x = NAN;
        fp8_table[b] = (b & 128) ? -x : x;
    }
}

/* float8 e5m2 (1 sign, 5 exponent bits with bias 15, 2 mantissa bits: IEEE half's top byte,
 * with infinities and NaNs) to float32, exactly. */
static void fill_e5m2_table(void) {
    for (int b = 0; b < 256; ++b) {
        const int e = (b >> 2) & 31, m = b & 3;
        float x = e == 0 ? ldexpf((float)m / 4.0f, -14) : ldexpf(1.0f + (float)m / 4.0f, e - 15);
        if (e == 31) x = m == 0 ? INFINITY : NAN;
        e5m2_table[b] = (b & 128) ? -x : x;
    }
}

/* 16 elements of K or V from element index i, as float32. */
ALWAYS_INLINE v16 load16(const void *base, int64_t i, const int kind) {
    if (kind == KV_BF16) {
        v16h h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (v16)(__builtin_convertvector(h, v16i) << 16);
    }
    if (kind == KV_FP8 || kind == KV_E5M2) {
        const float *table = kind == KV_FP8 ? fp8_table : e5m2_table;
        const uint8_t *b = (const uint8_t *)base + i;
        v16 x;
        for (int u = 0; u < VL; ++u) x[u] = table[b[u]];
        return x;
    }
    v16 x;
    memcpy(&x, (const float *)base + i, sizeof x);
    return x;
}

ALWAYS_INLINE float load1(const void *base, int64_t i, const int kind) {
    if (kind == KV_BF16) {
        const uint32_t w = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &w, sizeof f);
        return f;
    }
    if (kind == KV_FP8) return fp8_table[((const uint8_t *)base)[i]];
    if (kind == KV_E5M2) return e5m2_table[((const uint8_t *)base)[i]];
    return ((const float *)base)[i];
}

/* exp(x) for x <= 0, branch-free so loops over it vectorise: 2^n * p(r), r = x - n ln2
 * (|r| <= ln2/2), degree-6 Taylor polynomial (relative error < 3e-7). Inputs below -87 are
 * clamped (exp(-87) ~ 1.6e-38: a probability that small adds nothing to a float32 sum). */
static inline float exp_neg(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const int32_t ni = (int32_t)(xc * 1.44269504f - 0.5f); /* round to nearest, xc <= 0 */
    const float n = (float)ni;
    float r = xc - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    float p = 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* exp_neg on 16 lanes at once (the same steps as the scalar form, which takes the tail). */
static inline v16 exp_neg16(v16 x) {
    const v16i low = x < -87.0f; /* all ones where x < -87 */
    const v16 xc = (v16)((low & (v16i)((v16){0} - 87.0f)) | (~low & (v16i)x));
    const v16i ni = __builtin_convertvector(xc * 1.44269504f - 0.5f, v16i);
    const v16 n = __builtin_convertvector(ni, v16);
    v16 r = xc - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    v16 p = r * 1.38888889e-3f + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v16)((ni + 127) << 23);
}

/* Fold 16 lanes to one in a fixed order. */
static inline float fold16(v16 acc) {
    const v8 s8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                  __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* x[j] = exp(x[j] - m) in place; returns their sum (16 lanes, then the tail in order). */
static float exp_sum(float *x, int64_t n, float m) {
    v16 acc = {0};
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
        v16 xv;
        memcpy(&xv, x + j, sizeof xv);
        xv = exp_neg16(xv - m);
        memcpy(x + j, &xv, sizeof xv);
        acc += xv;
    }
    float tail = 0.0f;
    for (; j < n; ++j) {
        x[j] = exp_neg(x[j] - m);
        tail += x[j];
    }
    return fold16(acc) + tail;
}

/* Max over explicit lanes (exact in any order; lanes only let it vectorise). */
static float ordered_max(const float *x, int64_t n, float init) {
    float l[VL];
    for (int i = 0; i < VL; ++i) l[i] = init;
    int64_t j = 0;
    for (; j + VL <= n; j += VL)
        for (int i = 0; i < VL; ++i) l[i] = x[j + i] > l[i] ? x[j + i] : l[i];
    for (int i = 0; j + i < n; ++i) l[i] = x[j + i] > l[i] ? x[j + i] : l[i];
    float m = init;
    for (int i = 0; i < VL; ++i) m = l[i] > m ? l[i] : m;
    return m;
}

/* Four scores q_i . k_i (q rows q[0..3], K rows at element offsets b[0..3]) at once: each in
 * 16-wide lanes over d, the lanes folded 16 → 8 → 4 → 1 in a fixed tree, the tail of d (head
 * sizes not a multiple of 16) summed in order. Every score of the kernel comes from here, the
 * four lanes treated alike, so a score's bits do not depend on which heads share the call.
 * GCC >= 12 / Clang vector extensions: no intrinsics, any ISA. */
ALWAYS_INLINE void dot4(const float *const *q, const void *k, const int64_t *b, int64_t D,
                        float *res, const int kind) {
    v16 a[4] = {{0}, {0}, {0}, {0}};
    int64_t d = 0;
    for (; d + VL <= D; d += VL)
        for (int i = 0; i < 4; ++i) {
            v16 x;
            memcpy(&x, q[i] + d, sizeof x);
            a[i] += x * load16(k, b[i] + d, kind);
        }
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; d < D; ++d)
        for (int i = 0; i < 4; ++i) tail[i] += q[i][d] * load1(k, b[i] + d, kind);
    const v16 x = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                          21, 22, 23) +
                  __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                          27, 28, 29, 30, 31);
    const v16 y = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                          21, 22, 23) +
                  __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                          27, 28, 29, 30, 31);
    const v16 z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                          26, 27) +
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                          29, 30, 31);
    const v8 w = __builtin_shufflevector(z, z, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(z, z, 2, 3, 6, 7, 10, 11, 14, 15);
    const v4 r = __builtin_shufflevector(w, w, 0, 2, 4, 6) + __builtin_shufflevector(w, w, 1, 3, 5, 7);
    for (int i = 0; i < 4; ++i) res[i] = r[i] + tail[i];
}

/* P V of four query heads over one block of keys: a_u[0:D] += sum over keys jj (in order) of
 * p_u[jj] * V row (x_u + jj * row). The four heads' chunks accumulate in registers side by
 * side (independent FMA chains; heads of one kv head share the V load). Each head's sum has
 * the same order whichever heads share the call. */
ALWAYS_INLINE void pv4(float *const *a, const float *const *p, const int64_t *x, int64_t nk,
                       const void *v, int64_t row, int64_t D, const int kind) {
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
        v16 acc[4];
        for (int u = 0; u < 4; ++u) memcpy(&acc[u], a[u] + d, sizeof acc[u]);
        for (int64_t jj = 0; jj < nk; ++jj)
            for (int u = 0; u < 4; ++u) acc[u] += p[u][jj] * load16(v, x[u] + jj * row + d, kind);
        for (int u = 0; u < 4; ++u) memcpy(a[u] + d, &acc[u], sizeof acc[u]);
    }
    for (; d < D; ++d)
        for (int u = 0; u < 4; ++u) {
            float ad = a[u][d];
            for (int64_t jj = 0; jj < nk; ++jj) ad += p[u][jj] * load1(v, x[u] + jj * row + d, kind);
            a[u][d] = ad;
        }
}

/* Ask for the rows of the block holding position `pos` (if < L), columns [col, col + width),
 * ahead of use: one layer's block is often exactly one 4 KiB page, where hardware prefetchers
 * stop. */
ALWAYS_INLINE void prefetch_block(const void *base, const int32_t *pages, int64_t pos,
                                  int64_t L, int64_t B, int64_t row, int64_t col, int64_t width,
                                  const int kind) {
    if (pos >= L) return;
    const int64_t esize = kind == KV_BF16 ? 2 : kind == KV_FP8 || kind == KV_E5M2 ? 1 : 4;
    const int64_t off = pos % B, end = pos - off + B < L ? pos - off + B : L;
    const char *p = (const char *)base + (((int64_t)pages[pos / B] * B + off) * row + col) * esize;
    for (int64_t i = pos; i < end; ++i, p += row * esize)
        for (int64_t c = 0; c < width * esize; c += 64) __builtin_prefetch(p + c, 0, 3);
}

/* Attention of one sequence's query heads of kv heads [h0, h1): scores, softmax, P V. The
 * steps for a query head are the same whichever range it is computed in. */
ALWAYS_INLINE int attend(const float *q, const void *k, const void *v, float *out,
                         const int32_t *pages, int64_t L, int64_t h0, int64_t h1, int64_t G,
                         int64_t D, int64_t B, int64_t row, float scale, int64_t window,
                         float softcap, const float *sinks, const int kind) {
    const int64_t j0 = (window > 0 && L > window) ? L - window : 0, n = L - j0;
    const int64_t H = (h1 - h0) * G; /* query heads in this task */
    const int64_t col = h0 * D, width = (h1 - h0) * D;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(H * (n + 2 * D) + D + 1));
    if (!buf) return 1;
    float *qs = buf, *acc = buf + H * D, *spare = acc + H * D, *sc = spare + D;
    const float *qh = q + h0 * G * D;
    for (int64_t i = 0; i < H * D; ++i) qs[i] = qh[i] * scale;
    memset(acc, 0, sizeof(float) * (size_t)(H * D));
    prefetch_block(v, pages, j0, L, B, row, col, width, kind); /* the V pass starts here */
    for (int64_t pos = j0, j = 0; pos < L;) { /* scores [H, n], block by block */
        const int64_t off = pos % B, end = pos - off + B < L ? pos - off + B : L;
        int64_t kr = ((int64_t)pages[pos / B] * B + off) * row + col; /* element offset */
        prefetch_block(k, pages, end, L, B, row, col, width, kind);
        for (; pos < end; ++pos, ++j, kr += row)
            for (int64_t i = 0; i < H; i += 4) { /* heads past H repeat the last one */
                const float *q4[4];
                int64_t k4[4];
                for (int u = 0; u < 4; ++u) {
                    const int64_t hi = i + u < H ? i + u : H - 1;
                    q4[u] = qs + hi * D;
                    k4[u] = kr + (hi / G) * D;
                }
                float r[4];
                dot4(q4, k, k4, D, r, kind);
                for (int u = 0; u < 4 && i + u < H; ++u) sc[(i + u) * n + j] = r[u];
            }
    }
    for (int64_t i = 0; i < H; ++i) { /* softmax per query head, in place */
        float *x = sc + i * n;
        const float *sink = sinks ? sinks + h0 * G + i : NULL;
        if (softcap > 0.0f)
            for (int64_t j = 0; j < n; ++j) x[j] = tanhf(x[j] / softcap) * softcap;
        const float m = ordered_max(x, n, sink ? *sink : -3.0e38f);
        const float den = exp_sum(x, n, m) + (sink ? exp_neg(*sink - m) : 0.0f);
        const float inv = 1.0f / den;
        for (int64_t j = 0; j < n; ++j) x[j] *= inv;
    }
    for (int64_t pos = j0, j = 0; pos < L;) { /* out = P V, keys in order */
        const int64_t off = pos % B, end = pos - off + B < L ? pos - off + B : L;
        int64_t vr = ((int64_t)pages[pos / B] * B + off) * row + col; /* element offset */
        prefetch_block(v, pages, end, L, B, row, col, width, kind);
        for (int64_t i = 0; i < H; i += 4) { /* heads past H: a scratch row, dropped */
            float *a4[4];
            const float *p4[4];
            int64_t x4[4];
            for (int u = 0; u < 4; ++u) {
                const int64_t hi = i + u < H ? i + u : H - 1;
                a4[u] = i + u < H ? acc + hi * D : spare;
                p4[u] = sc + hi * n + j;
                x4[u] = vr + (hi / G) * D;
            }
            pv4(a4, p4, x4, end - pos, v, row, D, kind);
        }
        j += end - pos;
        pos = end;
    }
    memcpy(out + h0 * G * D, acc, sizeof(float) * (size_t)(H * D));
    free(buf);
    return 0;
}

/* One copy of attend() per pool dtype. */
#define ATTEND_KIND(name, kind)                                                               \
    static int name(const float *q, const void *k, const void *v, float *out,              \
                    const int32_t *pages, int64_t L, int64_t h0, int64_t h1, int64_t G,     \
                    int64_t D, int64_t B, int64_t row, float scale, int64_t window,         \
                    float softcap, const float *sinks) {                                    \
        return attend(q, k, v, out, pages, L, h0, h1, G, D, B, row, scale, window, softcap, \
                      sinks, kind);                                                         \
    }
ATTEND_KIND(attend_f32, KV_F32)
ATTEND_KIND(attend_bf16, KV_BF16)
ATTEND_KIND(attend_fp8, KV_FP8)
ATTEND_KIND(attend_e5m2, KV_E5M2)

/* One task per sequence (its K/V rows are read whole, in order), or per (sequence, kv head)
 * when there are too few sequences to keep the threads busy. */
int batchgen_paged_decode(const float *q, const void *k, const void *v, int kv_kind,
                          float *out, const int32_t *kv_indptr, const int32_t *kv_indices,
                          const int32_t *kv_len, int64_t num_seqs, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t window, float softcap, const float *sinks) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads) return 1;
    const int64_t G = num_q_heads / num_kv_heads, D = head_dim;
    const int64_t row = num_kv_heads * D; /* elements between consecutive slots */
    const int64_t split = num_seqs < 4 * omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t per = num_kv_heads / split;
    int failed = 0;
    if (kv_kind == KV_FP8 && fp8_table[0x38] != 1.0f) fill_fp8_table(); /* 0x38 = 1.0 */
    if (kv_kind == KV_E5M2 && e5m2_table[0x3c] != 1.0f) fill_e5m2_table(); /* 0x3c = 1.0 */
    typedef int (*attend_fn)(const float *, const void *, const void *, float *, const int32_t *,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             float, int64_t, float, const float *);
    const attend_fn fn = kv_kind == KV_E5M2 ? attend_e5m2
                         : kv_kind == KV_FP8 ? attend_fp8
                         : kv_kind == KV_BF16 ? attend_bf16 : attend_f32;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t t = 0; t < num_seqs * split; ++t) {
        const int64_t s = t / split, h0 = (t % split) * per;
        failed |= fn(
            q + s * num_q_heads * D, k, v, out + s * num_q_heads * D, kv_indices + kv_indptr[s],
            kv_len[s], h0, h0 + per, G, D, block_size, row, scale, window, softcap, sinks);
    }
    return failed;
}
