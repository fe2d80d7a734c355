/* Causal prefill attention with vectors, queries in the lanes: float32 with AVX-512 or
   AVX2+FMA, bfloat16 with AVX-512 BF16. Heads of 64 or 128.

   out[i, h] = softmax(scale * q[i, h] . k[g]^T over keys j <= ctx_len + i) . v[g],
   g = h / group.

   With a sliding window (`window` > 0) query i sees only keys j > ctx_len + i - window: a
   task's walk starts at its first query's first visible key, and the keys it does not see
   are masked per lane like the causal edge.

   Query i of the chunk sits at position ctx_len + i; keys 0..ctx_len-1 come from the cached
   context (gathered out of the pool), the rest are the chunk's own, so no caller copies them
   together. A task is one query head and two vectors of queries, transposed once so a vector
   holds one dimension of as many queries as it has lanes. Then every step is vertical: a
   key's scores for a vector of queries are a chain of FMAs with its dimensions broadcast,
   and the online softmax's running max and sum are per lane, so no row ever needs a
   horizontal reduction (the softmax was 65% of the row-major AMX kernel's time). p . v keeps
   the same layout: the output, transposed, takes each key's p times its values broadcast.
   bfloat16 uses the BF16 dot product on pairs:
   q's pairs of dimensions against a key's (adjacent in its row), p's pairs of keys against V
   packed once per call into pairs of keys. A K/V head's tasks run in a row, the longest
   first, so its K/V stay in cache.

   The vector width is a small layer below (`vf`, VL lanes): AVX-512 takes 32 queries a task
   in 16-lane vectors, AVX2 16 queries in 8-lane ones, with fewer keys and dimensions per
   register block (16 registers, not 32). Other builds export the same functions and answer
   -1 (`vec_prefill_supports` says 0). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

#define SPAN 64 /* keys per softmax step */
#define MAX_HEAD 128

enum { DT_F32 = 0, DT_BF16 = 2 };

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#if defined(__AVX512F__)
typedef __m512 vf;
#define VL 16
#define KB 8 /* keys per register block of the scores */
#define DB 8 /* output dimensions per register block of p . v */
#define v_load _mm512_load_ps
#define v_store _mm512_store_ps
#define v_set1 _mm512_set1_ps
#define v_zero _mm512_setzero_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_mul _mm512_mul_ps
#define v_div _mm512_div_ps
#define v_fma _mm512_fmadd_ps
#define v_exp2 exp2_avx512
/* max(acc, x) in the lanes whose bit is set; acc elsewhere */
static inline vf v_max_where(vf acc, uint32_t bits, vf x) {
    return _mm512_mask_max_ps(acc, (__mmask16)bits, acc, x);
}
/* x in the lanes whose bit is set, 0 elsewhere */
static inline vf v_keep(uint32_t bits, vf x) { return _mm512_maskz_mov_ps((__mmask16)bits, x); }
#else
typedef __m256 vf;
#define VL 8
#define KB 4
#define DB 4
#define v_load _mm256_load_ps
#define v_store _mm256_store_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_mul _mm256_mul_ps
#define v_div _mm256_div_ps
#define v_fma _mm256_fmadd_ps
#define v_exp2 exp2_avx2
static inline vf lanes_of(uint32_t bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i hit = _mm256_and_si256(_mm256_set1_epi32((int)bits), bit);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(hit, bit));
}
static inline vf v_max_where(vf acc, uint32_t bits, vf x) {
    return _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), lanes_of(bits));
}
static inline vf v_keep(uint32_t bits, vf x) { return _mm256_and_ps(x, lanes_of(bits)); }
#endif

#define QB (2 * VL) /* queries per task: two vectors */
#define LANES ((uint32_t)((1ull << VL) - 1))

/* Where one head's keys (or values) live: the first `ctx_len` rows in the cached context, the
   rest in the chunk's own; strides in elements. */
typedef struct {
    const char *ctx, *fresh;
    int64_t ctx_len, ctx_stride, fresh_stride, len;
    int elem;
} rows_of;

static const char zeros[MAX_HEAD * 4] __attribute__((aligned(64)));

static inline const char *row_at(const rows_of *r, int64_t key) {
    if (key >= r->len) return zeros;
    return key < r->ctx_len ? r->ctx + key * r->ctx_stride * r->elem
                            : r->fresh + (key - r->ctx_len) * r->fresh_stride * r->elem;
}

/* The lanes (of QB) that see key `key`: query lane i sits at position first + i and sees
   keys in (first + i - window, first + i] (window 0: no lower bound). */
static inline uint32_t visible(int64_t key, int64_t first, int64_t window) {
    const int64_t lo = key - first;
    uint32_t bits = lo <= 0 ? 0xffffffffu : lo >= QB ? 0u : 0xffffffffu << lo;
    if (window > 0) { /* lanes i < key - first + window */
        const int64_t hi = lo + window;
        bits &= hi <= 0 ? 0u : hi >= QB ? 0xffffffffu : (uint32_t)((1ull << hi) - 1);
    }
    return bits;
}

/* The bits of vector w (of the task's two) */
static inline uint32_t bits_of(uint32_t vis, int w) { return (vis >> (VL * w)) & LANES; }

typedef struct {
    float s[SPAN * QB] __attribute__((aligned(64)));       /* scores, then p (float32) */
    uint32_t p2[SPAN / 2 * QB] __attribute__((aligned(64))); /* p as bfloat16 pairs of keys */
    float o[MAX_HEAD * QB] __attribute__((aligned(64)));   /* the output, transposed */
    uint32_t qt[MAX_HEAD * QB] __attribute__((aligned(64))); /* q, transposed */
} scratch;

/* Scores of keys k0..k0+n-1 (n <= SPAN) in log2 units into sc->s[key][lane]. */
static inline __attribute__((always_inline)) void scores(scratch *sc, const rows_of *k,
                                                         int64_t k0, int n, float c,
                                                         const int head, const int bf) {
    const vf vc = v_set1(c);
    for (int j0 = 0; j0 < n; j0 += KB) {
        const char *kr[KB];
        for (int b = 0; b < KB; b++) kr[b] = row_at(k, k0 + j0 + b);
        vf a[KB][2];
        for (int b = 0; b < KB; b++) a[b][0] = a[b][1] = v_zero();
        if (bf) {
#if defined(__AVX512BF16__)
            for (int d = 0; d < head / 2; d++) {
                const __m512bh q0 = (__m512bh)_mm512_load_si512(sc->qt + d * QB);
                const __m512bh q1 = (__m512bh)_mm512_load_si512(sc->qt + d * QB + 16);
                for (int b = 0; b < KB; b++) {
                    int32_t pair;
                    memcpy(&pair, kr[b] + d * 4, 4);
                    const __m512bh kk = (__m512bh)_mm512_set1_epi32(pair);
                    a[b][0] = _mm512_dpbf16_ps(a[b][0], q0, kk);
                    a[b][1] = _mm512_dpbf16_ps(a[b][1], q1, kk);
                }
            }
#endif
        } else {
            const float *qt = (const float *)sc->qt;
            for (int d = 0; d < head; d++) {
                const vf q0 = v_load(qt + d * QB), q1 = v_load(qt + d * QB + VL);
                for (int b = 0; b < KB; b++) {
                    const vf kk = v_set1(((const float *)kr[b])[d]);
                    a[b][0] = v_fma(q0, kk, a[b][0]);
                    a[b][1] = v_fma(q1, kk, a[b][1]);
                }
            }
        }
        for (int b = 0; b < KB && j0 + b < SPAN; b++) {
            v_store(sc->s + (j0 + b) * QB, v_mul(a[b][0], vc));
            v_store(sc->s + (j0 + b) * QB + VL, v_mul(a[b][1], vc));
        }
    }
}

/* The span's scores into p = 2^(s - new max) (0 where a lane does not see the key), the
   running max m and sum l updated; returns the factors the output is rescaled by. */
static inline __attribute__((always_inline)) void softmax_span(scratch *sc, int64_t k0, int n,
                                                               int64_t first, int64_t window,
                                                               vf m[2], vf l[2], vf alpha[2],
                                                               const int bf) {
    /* every lane sees every key of the span */
    const int whole = k0 + n - 1 <= first && (window == 0 || k0 > first + QB - 1 - window);
    vf mx[2] = {m[0], m[1]};
    for (int j = 0; j < n; j++) {
        const uint32_t vis = whole ? 0xffffffffu : visible(k0 + j, first, window);
        for (int w = 0; w < 2; w++)
            mx[w] = v_max_where(mx[w], bits_of(vis, w), v_load(sc->s + j * QB + VL * w));
    }
    vf sum[2] = {v_zero(), v_zero()};
    for (int w = 0; w < 2; w++) alpha[w] = v_exp2(v_sub(m[w], mx[w]));
    for (int j = 0; j < n; j++) {
        const uint32_t vis = whole ? 0xffffffffu : visible(k0 + j, first, window);
        for (int w = 0; w < 2; w++) {
            float *s = sc->s + j * QB + VL * w;
            const vf p = v_keep(bits_of(vis, w), v_exp2(v_sub(v_load(s), mx[w])));
            sum[w] = v_add(sum[w], p);
            v_store(s, p);
        }
    }
    for (int w = 0; w < 2; w++) {
        l[w] = v_fma(l[w], alpha[w], sum[w]);
        m[w] = mx[w];
    }
#if defined(__AVX512BF16__)
    if (bf) { /* pairs of keys, interleaved per lane: (p[2j], p[2j + 1]) */
        const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                               25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,
                                               3, 18, 2, 17, 1, 16, 0);
        for (int j = 0; j < n; j += 2)
            for (int v = 0; v < 2; v++) {
                const __m512 even = _mm512_load_ps(sc->s + j * QB + 16 * v);
                const __m512 odd = j + 1 < n ? _mm512_load_ps(sc->s + (j + 1) * QB + 16 * v)
                                             : _mm512_setzero_ps();
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
                _mm512_store_si512(sc->p2 + j / 2 * QB + 16 * v,
                                   _mm512_permutexvar_epi16(order, both));
            }
    }
#else
    (void)bf;
#endif
}

/* o = o * alpha + p . v over the span's keys (o transposed: o[dim][lane]). */
static inline __attribute__((always_inline)) void accumulate(scratch *sc, const rows_of *v,
                                                             const uint32_t *vpairs, int64_t k0,
                                                             int n, const vf alpha[2],
                                                             const int head, const int bf) {
    const char *vr[SPAN];
    if (!bf)
        for (int j = 0; j < n; j++) vr[j] = row_at(v, k0 + j);
    for (int d0 = 0; d0 < head; d0 += DB) {
        vf a[DB][2];
        for (int e = 0; e < DB; e++)
            for (int w = 0; w < 2; w++)
                a[e][w] = v_mul(v_load(sc->o + (d0 + e) * QB + VL * w), alpha[w]);
        if (bf) {
#if defined(__AVX512BF16__)
            const uint32_t *vp = vpairs + k0 / 2 * head + d0;
            for (int j = 0; j < (n + 1) / 2; j++, vp += head) {
                const __m512bh p0 = (__m512bh)_mm512_load_si512(sc->p2 + j * QB);
                const __m512bh p1 = (__m512bh)_mm512_load_si512(sc->p2 + j * QB + 16);
                for (int e = 0; e < DB; e++) {
                    const __m512bh vv = (__m512bh)_mm512_set1_epi32((int32_t)vp[e]);
                    a[e][0] = _mm512_dpbf16_ps(a[e][0], p0, vv);
                    a[e][1] = _mm512_dpbf16_ps(a[e][1], p1, vv);
                }
            }
#else
            (void)vpairs;
#endif
        } else {
            for (int j = 0; j < n; j++) {
                const vf p0 = v_load(sc->s + j * QB), p1 = v_load(sc->s + j * QB + VL);
                const float *row = (const float *)vr[j] + d0;
                for (int e = 0; e < DB; e++) {
                    const vf vv = v_set1(row[e]);
                    a[e][0] = v_fma(p0, vv, a[e][0]);
                    a[e][1] = v_fma(p1, vv, a[e][1]);
                }
            }
        }
        for (int e = 0; e < DB; e++)
            for (int w = 0; w < 2; w++) v_store(sc->o + (d0 + e) * QB + VL * w, a[e][w]);
    }
}

/* One task: query head h's queries q0..q0+rows-1. */
static inline __attribute__((always_inline)) void task(
    scratch *sc, const char *q, int64_t q_tok, char *out, int64_t o_tok, int rows,
    int64_t first, int64_t window, const rows_of *k, const rows_of *v, const uint32_t *vpairs,
    float c, const int head, const int bf) {
    /* q transposed: float32 qt[dim][lane]; bfloat16 qt[dim pair][lane] */
    if (bf) {
        for (int i = 0; i < QB; i++)
            for (int d = 0; d < head / 2; d++) {
                uint32_t pair = 0;
                if (i < rows) memcpy(&pair, q + i * q_tok * 2 + d * 4, 4);
                sc->qt[d * QB + i] = pair;
            }
    } else {
        float *qt = (float *)sc->qt;
        for (int i = 0; i < QB; i++)
            for (int d = 0; d < head; d++)
                qt[d * QB + i] = i < rows ? ((const float *)(q + i * q_tok * 4))[d] : 0.0f;
    }
    memset(sc->o, 0, sizeof(float) * head * QB);
    vf m[2] = {v_set1(-INFINITY), v_set1(-INFINITY)};
    vf l[2] = {v_zero(), v_zero()};
    const int64_t last_key = first + rows - 1 < k->len - 1 ? first + rows - 1 : k->len - 1;
    /* the first query's first visible key, even (V's bfloat16 pairs start at even keys) */
    const int64_t k_first = window > 0 && first - window + 1 > 0 ? (first - window + 1) & ~1ll : 0;
    for (int64_t k0 = k_first; k0 <= last_key; k0 += SPAN) {
        const int n = (int)(last_key - k0 + 1 < SPAN ? last_key - k0 + 1 : SPAN);
        vf alpha[2];
        scores(sc, k, k0, n, c, head, bf);
        softmax_span(sc, k0, n, first, window, m, l, alpha, bf);
        accumulate(sc, v, vpairs, k0, n, alpha, head, bf);
    }
    float inv[QB] __attribute__((aligned(64)));
    v_store(inv, v_div(v_set1(1.0f), l[0]));
    v_store(inv + VL, v_div(v_set1(1.0f), l[1]));
    for (int i = 0; i < rows; i++) {
        if (bf) {
            bf16 *o = (bf16 *)(out + i * o_tok * 2);
            for (int d = 0; d < head; d++) o[d] = f32_to_bf16(sc->o[d * QB + i] * inv[i]);
        } else {
            float *o = (float *)(out + i * o_tok * 4);
            for (int d = 0; d < head; d++) o[d] = sc->o[d * QB + i] * inv[i];
        }
    }
}

/* V -> [key pairs][dim][2] as 32-bit words (keys past len are 0), for the BF16 dot product. */
static void pack_v_pairs(const rows_of *v, int64_t pairs, int head, uint32_t *out) {
    for (int64_t j = 0; j < pairs; j++) {
        const bf16 *even = (const bf16 *)row_at(v, 2 * j);
        const bf16 *odd = (const bf16 *)row_at(v, 2 * j + 1);
        for (int d = 0; d < head; d++)
            out[j * head + d] = (uint32_t)even[d] | (uint32_t)odd[d] << 16;
    }
}

static int supports(int dtype, int64_t head) {
    if (head != 64 && head != 128) return 0;
    if (dtype == DT_F32) return 1;
#if defined(__AVX512BF16__)
    if (dtype == DT_BF16) return 1;
#endif
    return 0;
}

int vec_prefill_supports(int dtype, int64_t head) { return supports(dtype, head); }

/* q [q_len, heads, head] (strides in elements); the cached context's K and V
   [kv_heads, ctx_len, head] (strides ctx_head, ctx_tok); the chunk's own K and V
   [q_len, kv_heads, head] (strides new_tok, new_head); out like q. Query i sits at position
   ctx_len + i; with `window` > 0 it sees keys ctx_len + i - window < j <= ctx_len + i. 0; -1 if
   this build cannot serve this dtype and head; -2 if memory runs out. */
int vec_prefill_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k_ctx,
                          const void *v_ctx, int64_t ctx_head, int64_t ctx_tok,
                          const void *k_new, const void *v_new, int64_t new_tok,
                          int64_t new_head, void *out, int64_t o_tok, int64_t o_head,
                          int64_t q_len, int64_t ctx_len, int64_t heads, int64_t kv_heads,
                          int64_t head, int dtype, float scale, int threads, int64_t window) {
    if (!supports(dtype, head) || q_len < 1 || ctx_len < 0 || heads % kv_heads != 0) return -1;
    const int bf = dtype == DT_BF16, elem = bf ? 2 : 4;
    const int64_t kv_len = ctx_len + q_len, group = heads / kv_heads;
    const int64_t pairs = (kv_len + SPAN - 1) / SPAN * SPAN / 2;
    uint32_t *vpairs = NULL;
    if (bf) {
        vpairs = aligned_alloc(64, (size_t)(kv_heads * pairs * head * 4));
        if (vpairs == NULL) return -2;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t g = 0; g < kv_heads; g++) {
            const rows_of rows = {(const char *)v_ctx + g * ctx_head * 2,
                                  (const char *)v_new + g * new_head * 2, ctx_len, ctx_tok,
                                  new_tok, kv_len, 2};
            pack_v_pairs(&rows, pairs, (int)head, vpairs + g * pairs * head);
        }
    }
    const float c = scale * 1.44269504088896341f; /* scores in log2 units */
    const int64_t q_blocks = (q_len + QB - 1) / QB;
#pragma omp parallel num_threads(threads)
    {
        scratch *sc = aligned_alloc(64, sizeof(scratch));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < heads * q_blocks; t++) {
            if (sc == NULL) continue;
            /* a K/V head's tasks in a row, the latest (longest) query blocks first */
            const int64_t g = t / (group * q_blocks), in_g = t % (group * q_blocks);
            const int64_t h = g * group + in_g % group, qb = q_blocks - 1 - in_g / group;
            const int64_t q0 = qb * QB;
            const int rows = (int)(q_len - q0 < QB ? q_len - q0 : QB);
            const rows_of k = {(const char *)k_ctx + g * ctx_head * elem,
                               (const char *)k_new + g * new_head * elem, ctx_len, ctx_tok,
                               new_tok, kv_len, elem};
            const rows_of v = {(const char *)v_ctx + g * ctx_head * elem,
                               (const char *)v_new + g * new_head * elem, ctx_len, ctx_tok,
                               new_tok, kv_len, elem};
            const char *qp = (const char *)q + (q0 * q_tok + h * q_head) * elem;
            char *op = (char *)out + (q0 * o_tok + h * o_head) * elem;
            const uint32_t *vp = bf ? vpairs + g * pairs * head : NULL;
            const int64_t first = ctx_len + q0;
            if (head == 64) {
                if (bf) task(sc, qp, q_tok, op, o_tok, rows, first, window, &k, &v, vp, c, 64,
                             1);
                else task(sc, qp, q_tok, op, o_tok, rows, first, window, &k, &v, vp, c, 64, 0);
            } else {
                if (bf) task(sc, qp, q_tok, op, o_tok, rows, first, window, &k, &v, vp, c, 128,
                             1);
                else task(sc, qp, q_tok, op, o_tok, rows, first, window, &k, &v, vp, c, 128,
                          0);
            }
        }
        free(sc);
    }
    free(vpairs);
    return 0;
}

#else /* no vectors */

int vec_prefill_supports(int dtype, int64_t head) {
    (void)dtype, (void)head;
    return 0;
}

int vec_prefill_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k_ctx,
                          const void *v_ctx, int64_t ctx_head, int64_t ctx_tok,
                          const void *k_new, const void *v_new, int64_t new_tok,
                          int64_t new_head, void *out, int64_t o_tok, int64_t o_head,
                          int64_t q_len, int64_t ctx_len, int64_t heads, int64_t kv_heads,
                          int64_t head, int dtype, float scale, int threads, int64_t window) {
    (void)q, (void)q_tok, (void)q_head, (void)k_ctx, (void)v_ctx, (void)ctx_head;
    (void)ctx_tok, (void)k_new, (void)v_new, (void)new_tok, (void)new_head, (void)out;
    (void)o_tok, (void)o_head, (void)q_len, (void)ctx_len, (void)heads, (void)kv_heads;
    (void)head, (void)dtype, (void)scale, (void)threads, (void)window;
    return -1;
}

#endif
