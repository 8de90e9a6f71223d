/* y = x @ W^T straight from bitsandbytes' packed 4-bit weights (nf4 or fp4), for decoding on any CPU.
 *
 * Compiled on first use by lit_qlora/decode4bit.py (gcc or clang, -O3 -march=native) and called through ctypes.
 * Batch-1 decoding reads every weight once per token, so its speed is the speed of reading the weights: this
 * kernel reads the packed bytes (0.5 byte per weight plus the block scales) and never writes a dense copy,
 * where bitsandbytes without AVX512-BF16 dequantizes the whole weight (2-4 bytes per weight, written and read
 * back) for every token.
 *
 * The layout is bitsandbytes': the [N, K] weight is flattened row-major and cut into blocks of `blocksize`
 * elements, each with one fp32 scale (absmax); element i of the flattened weight is the high nibble of byte i/2
 * when i is even, the low nibble when odd, and its value is code[nibble] * absmax[i / blocksize]. With double
 * quantization the scales are themselves 8-bit codes: absmax[b] = code2[absmax_q[b]] * absmax2[b / blocksize2]
 * + offset, computed here per block as bitsandbytes does (fp32 multiply, then add; -ffp-contract=off keeps them
 * two roundings). When K is not a multiple of blocksize a block straddles two rows: rows are walked as segments
 * that each lie in one block. K must be even, so that every row starts on a byte boundary.
 *
 * Three builds of the same loop: AVX512F (16-entry table lookup with one vpermps), AVX2 (two 8-entry lookups and
 * a blend) and portable C. Rows of W are shared out between OpenMP threads.
 *
 * With AVX512-BF16, bf16 activations and whole 64-weight blocks per row (bitsandbytes' default), a fourth loop
 * reads 128 weights (two blocks) per 64-byte load: every 16-bit word of it holds four nibbles, which three shifts
 * bring to its low bits, and `vpermw` looks each up in the 16 code values as bf16 (it reads 5 index bits: the
 * table is held twice). `vdpbf16ps` multiplies 32 of them by the activations per instruction, the activations
 * being permuted once per call into the order the nibbles come out in, and each block's fp32 sum is scaled by its
 * absmax. The weights are thus bf16(code) * absmax, within bf16 rounding of bitsandbytes' values (a dense bf16
 * model holds bf16(code * absmax)), summed in fp32; the fp32 loops keep bitsandbytes' fp32 weights exactly.
 *
 * Decoding (one activation row) on AVX512 takes four weight rows at a time, sharing the activations' loads and one
 * combined horizontal sum, and the AVX512 loops prefetch the weights a few KB ahead.
 *
 * `q4_linear_lora` adds a LoRA update in the same call: y = x @ W^T (+ bias) + (x @ A^T) @ B^T, A [r, K] in fp32 and B
 * given transposed ([r, N], the LoRA scaling folded in), everything summed in fp32 and rounded once. A decoding step
 * then costs one call per adapted layer where separate torch ops cost five and their Python around them. With a DoRA
 * factor g it is DoRA's form: y = g * (x @ W^T + (x @ A^T) @ B^T) (+ bias), g [N] the fp32 factor of each output row
 * (magnitude / row norm of W + B A, 1 for rows without LoRA), still rounded once. `q4_linear_segments` does the same
 * for runs of rows of different adapters (the batched engine's rows), each run with its own A, B and g. The
 * weights' products are kept in fp32 and each row's update added afterwards, 16 outputs at a time.
 *
 * `q4_linear_many` runs several layers, each on its own rows, in one call and one OpenMP region: a mixture of
 * experts' active experts of a projection (and the up projection's with the gate's) while decoding, where a call
 * per expert cost a ctypes call, an OpenMP region and their Python each. The groups of four rows of all the layers
 * are handed out to the threads as one list; each row is computed by the same code as in q4_linear (same bits).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(Q4_PORTABLE)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && !defined(Q4_PORTABLE)
#define Q4_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && !defined(Q4_PORTABLE)
#define Q4_ISA 2
#else
#define Q4_ISA 0
#endif

#if Q4_ISA == 512 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define Q4_BF16DOT 1
#else
#define Q4_BF16DOT 0
#endif

#define MAX_TILE 8 /* activation rows that share one decoding of a weight row */
/* Bytes ahead of the weights being read that the AVX512 loops ask into the cache: decoding streams every weight
 * from memory once, and the hardware prefetcher alone left them 10-28% slower (SmolLM2-135M, AMD EPYC, one thread,
 * kernel time per token: fp32 10.7 against 9.7 ms, bf16 8.7 against 6.8 ms; 2 to 16 KB ahead all did as well).
 * The AVX2 loop has none: it measured no faster with it (on the same CPU). */
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 4096
#endif

/* One quantized layer; mirrored field for field by a ctypes.Structure in decode4bit.py. */
typedef struct {
    const uint8_t *w;         /* packed codes, (N * K + 1) / 2 bytes */
    const float *absmax;      /* fp32 scale per block; NULL when the scales are double-quantized */
    const uint8_t *absmax_q;  /* double quantization: 8-bit code of each block's scale */
    const float *absmax2;     /* double quantization: fp32 scale per `blocksize2` codes */
    const float *code2;       /* double quantization: the 256 values of the 8-bit codes */
    const float *code;        /* the 16 values of the 4-bit codes */
    const float *bias;        /* fp32 [N], or NULL */
    int64_t n, k, blocksize, blocksize2;
    float offset;             /* double quantization: added to every decoded scale */
} q4_layer;

int q4_isa(void) { return Q4_ISA; }
int q4_bf16dot(void) { return Q4_BF16DOT; }

/* b2_shift: log2(blocksize2) when it is a power of two (bitsandbytes always uses 256), else -1. A 64-bit
 * division per block costs more than decoding the block, so there is none on the fast path. */
static inline float block_scale(const q4_layer *L, int64_t b, int b2_shift) {
    if (L->absmax) return L->absmax[b];
    float s = L->code2[L->absmax_q[b]] * L->absmax2[b2_shift >= 0 ? b >> b2_shift : b / L->blocksize2];
    return s + L->offset;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Accumulators of one weight row against up to MAX_TILE activation rows. */
typedef struct {
#if Q4_ISA == 512
    __m512 v[MAX_TILE][2]; /* the products of high nibbles in [0], of low nibbles in [1] (bf16 loop: [0] only) */
#elif Q4_ISA == 2
    __m256 v[MAX_TILE][2];
#endif
    float s[MAX_TILE];
} acc_t;

/* Add the products of `nbytes` packed bytes at `wp` (all in one block, of scale `s`) with the activations from
 * position j0 of each de-interleaved row: xs holds each activation row as [x0, x2, x4, ...] then [x1, x3, ...]
 * (K floats per row), so the high nibbles of consecutive bytes meet consecutive floats of the first half and the
 * low nibbles those of the second half: no shuffle per weight. */
static inline __attribute__((always_inline)) void segment(const float *code, const uint8_t *wp, int64_t nbytes,
                                                           float s, const float *xs, int64_t j0, int64_t k,
                                                           int mt, acc_t *acc) {
    const int64_t kh = k / 2;
    int64_t c = 0;
#if Q4_ISA == 512
    /* The block's 16 possible weight values, scaled once: code[i] * absmax, as bitsandbytes computes them. */
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(code), _mm512_set1_ps(s));
    for (; c + 32 <= nbytes; c += 32) { /* two 16-byte steps */
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wp + c)));
        __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wp + c + 16)));
        /* vpermps reads only the low 4 bits of each index: the low nibble needs no mask */
        __m512 hi0 = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t), lo0 = _mm512_permutexvar_ps(i0, t);
        __m512 hi1 = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), t), lo1 = _mm512_permutexvar_ps(i1, t);
        for (int m = 0; m < mt; m++) {
            const float *xe = xs + (int64_t)m * k + j0 + c, *xo = xe + kh;
            acc->v[m][0] = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xe), acc->v[m][0]);
            acc->v[m][1] = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(xo), acc->v[m][1]);
            acc->v[m][0] = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(xe + 16), acc->v[m][0]);
            acc->v[m][1] = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(xo + 16), acc->v[m][1]);
        }
    }
    for (; c + 16 <= nbytes; c += 16) {
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wp + c)));
        __m512 hi0 = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t), lo0 = _mm512_permutexvar_ps(i0, t);
        for (int m = 0; m < mt; m++) {
            const float *xe = xs + (int64_t)m * k + j0 + c, *xo = xe + kh;
            acc->v[m][0] = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xe), acc->v[m][0]);
            acc->v[m][1] = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(xo), acc->v[m][1]);
        }
    }
#elif Q4_ISA == 2
    const __m256 s8 = _mm256_set1_ps(s);
    const __m256 tlo = _mm256_mul_ps(_mm256_loadu_ps(code), s8), thi = _mm256_mul_ps(_mm256_loadu_ps(code + 8), s8);
    for (; c + 8 <= nbytes; c += 8) {
        __m256i i0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wp + c)));
        __m256i h = _mm256_srli_epi32(i0, 4);
        /* a 16-entry lookup from two 8-entry ones: bit 3 of the index, shifted into the sign bit, picks the half */
        __m256 whi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, h), _mm256_permutevar8x32_ps(thi, h),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(h, 28)));
        __m256 wlo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, i0), _mm256_permutevar8x32_ps(thi, i0),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
        for (int m = 0; m < mt; m++) {
            const float *xe = xs + (int64_t)m * k + j0 + c, *xo = xe + kh;
            acc->v[m][0] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(xe), acc->v[m][0]);
            acc->v[m][1] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(xo), acc->v[m][1]);
        }
    }
#endif
    if (c < nbytes) { /* the portable build, or the last bytes of a segment that are not a whole vector */
        float t16[16];
        for (int i = 0; i < 16; i++) t16[i] = code[i] * s;
        for (int m = 0; m < mt; m++) {
            const float *xe = xs + (int64_t)m * k + j0, *xo = xe + kh;
            float a = 0.0f;
            for (int64_t j = c; j < nbytes; j++) a += t16[wp[j] >> 4] * xe[j] + t16[wp[j] & 15] * xo[j];
            acc->s[m] += a;
        }
    }
}

#if Q4_BF16DOT
/* Where word w of a 128-weight chunk (bytes 2w and 2w+1) keeps its nibbles: bits 0-3 hold element 4w+1 (the low
 * nibble of byte 2w), bits 4-7 element 4w, bits 8-11 element 4w+3, bits 12-15 element 4w+2. */
static const int NIBBLE_ELEMENT[4] = {1, 0, 3, 2};

/* One activation row (k bf16 values) in the bf16 loop's order: per 128-element chunk four runs of 32, run r holding
 * elements 4w + NIBBLE_ELEMENT[r] (w = 0..31); a last lone block of 64 the same with runs of 16. */
static void permute_for_bf16dot(const uint16_t *x, uint16_t *xp, int64_t k) {
    int64_t c = 0;
    for (; c + 128 <= k; c += 128)
        for (int r = 0; r < 4; r++)
            for (int w = 0; w < 32; w++) xp[c + 32 * r + w] = x[c + 4 * w + NIBBLE_ELEMENT[r]];
    if (c < k)
        for (int r = 0; r < 4; r++)
            for (int w = 0; w < 16; w++) xp[c + 16 * r + w] = x[c + 4 * w + NIBBLE_ELEMENT[r]];
}

/* The 128 weights of 64 packed bytes at wp as four vectors of 32 bf16 code values (run r: nibble r of each word),
 * looked up in t (the 16 code values as bf16, twice over). */
typedef struct { __m512bh r[4]; } chunk_t;
static inline __attribute__((always_inline)) chunk_t bf16_chunk(const uint8_t *wp, __m512i t) {
    _mm_prefetch((const char *)(wp + Q4_PREFETCH), _MM_HINT_T0);
    const __m512i b = _mm512_loadu_si512(wp);
    chunk_t w;
    for (int r = 0; r < 4; r++) w.r[r] = (__m512bh)_mm512_permutexvar_epi16(r ? _mm512_srli_epi16(b, 4 * r) : b, t);
    return w;
}

/* Its products with the activations (four runs of 32 at xp) summed per lane pair, unscaled: lanes 0-7 hold the
 * first block's partial sums, 8-15 the second's. */
static inline __attribute__((always_inline)) __m512 bf16_chunk_dot(chunk_t w, const uint16_t *xp) {
    __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), w.r[0], (__m512bh)_mm512_loadu_si512(xp));
    __m512 q = _mm512_dpbf16_ps(_mm512_setzero_ps(), w.r[1], (__m512bh)_mm512_loadu_si512(xp + 32));
    p = _mm512_dpbf16_ps(p, w.r[2], (__m512bh)_mm512_loadu_si512(xp + 64));
    q = _mm512_dpbf16_ps(q, w.r[3], (__m512bh)_mm512_loadu_si512(xp + 96));
    return _mm512_add_ps(p, q);
}

/* A last lone block (32 bytes): the same with 256-bit vectors, its table the first 16 words of t, its sum in the
 * low 8 lanes. */
static inline __attribute__((always_inline)) __m512 bf16_block_dot(const uint8_t *wp, __m512i t,
                                                                  const uint16_t *xp) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)wp), t16 = _mm512_castsi512_si256(t);
    __m256 p = _mm256_setzero_ps(), q = _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) {
        const __m256bh w = (__m256bh)_mm256_permutexvar_epi16(r ? _mm256_srli_epi16(b, 4 * r) : b, t16);
        const __m256bh x = (__m256bh)_mm256_loadu_si256((const __m256i *)(xp + 16 * r));
        if (r & 1) q = _mm256_dpbf16_ps(q, w, x);
        else p = _mm256_dpbf16_ps(p, w, x);
    }
    return _mm512_zextps256_ps512(_mm256_add_ps(p, q));
}

/* The scales of blocks blk (lanes 0-7) and blk + 1 (lanes 8-15). */
static inline __attribute__((always_inline)) __m512 pair_scales(const q4_layer *L, int64_t blk, int b2_shift) {
    return _mm512_insertf32x8(_mm512_set1_ps(block_scale(L, blk, b2_shift)),
                              _mm256_set1_ps(block_scale(L, blk + 1, b2_shift)), 1);
}

static inline __m512i bf16_table(const q4_layer *L) {
    return _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(L->code)));
}
#endif

#if Q4_ISA == 512
/* One 64-weight block (32 bytes at wp, scale s) as fp32: the block's 16 values scaled once (code[i] * absmax, as
 * bitsandbytes computes them), looked up with one vpermps per 16 weights, which reads only the low 4 bits of each
 * index (the low nibble needs no mask). hi0/lo0: elements 0, 2, ..., 30 / 1, 3, ..., 31; hi1/lo1 the next 32. */
typedef struct { __m512 hi0, lo0, hi1, lo1; } block_t;
static inline __attribute__((always_inline)) block_t fp32_block(const uint8_t *wp, __m512 code, float s) {
    _mm_prefetch((const char *)(wp + Q4_PREFETCH), _MM_HINT_T0);
    const __m512 t = _mm512_mul_ps(code, _mm512_set1_ps(s));
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)wp));
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wp + 16)));
    return (block_t){_mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t), _mm512_permutexvar_ps(i0, t),
                     _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), t), _mm512_permutexvar_ps(i1, t)};
}
#endif

#if Q4_ISA == 512
/* The horizontal sums of four vectors at once, into out[0..4): pairwise interleaves leave [a0, a1, a2, a3] partial
 * sums in every 128-bit lane, then the lanes are added (10 operations, where four separate sums take about 30). */
static inline __attribute__((always_inline)) void reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *out) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

#endif

/* Dot products of weight row `o` with `mt` activation rows (de-interleaved in xs, or, for the bf16 loop, as bf16
 * bits in xs16) into out[0..mt). */
static inline __attribute__((always_inline)) void row_dot(const q4_layer *L, int64_t o, const float *xs,
                                                           const uint16_t *xs16, int mt, int b2_shift, float *out) {
    const int64_t k = L->k, bs = L->blocksize;
    acc_t acc;
    for (int m = 0; m < mt; m++) {
#if Q4_ISA == 512
        for (int a = 0; a < 2; a++) acc.v[m][a] = _mm512_setzero_ps();
#elif Q4_ISA == 2
        for (int a = 0; a < 2; a++) acc.v[m][a] = _mm256_setzero_ps();
#endif
        acc.s[m] = 0.0f;
    }
#if Q4_BF16DOT
    if (xs16) { /* bf16 activations, 64-weight blocks (q4_linear checked): see the comment at the top */
        const int64_t nblk = k / 64, b0 = o * nblk;
        const uint8_t *wp = L->w + o * (k / 2);
        const __m512i t = bf16_table(L);
        int64_t c = 0;
        for (; c + 128 <= k; c += 128, wp += 64) {
            const chunk_t w = bf16_chunk(wp, t);
            const __m512 sc = pair_scales(L, b0 + c / 64, b2_shift);
            for (int m = 0; m < mt; m++)
                acc.v[m][0] = _mm512_fmadd_ps(bf16_chunk_dot(w, xs16 + (int64_t)m * k + c), sc, acc.v[m][0]);
        }
        if (c < k) {
            const __m512 sc = _mm512_set1_ps(block_scale(L, b0 + nblk - 1, b2_shift));
            for (int m = 0; m < mt; m++)
                acc.v[m][0] = _mm512_fmadd_ps(bf16_block_dot(wp, t, xs16 + (int64_t)m * k + c), sc, acc.v[m][0]);
        }
    } else
#endif
#if Q4_ISA == 512
    if (bs == 64 && k % 64 == 0) { /* bitsandbytes' default block: one 32-byte step per block, nothing else */
        const int64_t nblk = k / 64, b0 = o * nblk;
        const uint8_t *wp = L->w + o * (k / 2);
        const __m512 code = _mm512_loadu_ps(L->code);
        for (int64_t i = 0; i < nblk; i++, wp += 32) {
            const block_t w = fp32_block(wp, code, block_scale(L, b0 + i, b2_shift));
            for (int m = 0; m < mt; m++) {
                const float *xe = xs + (int64_t)m * k + 32 * i, *xo = xe + k / 2;
                acc.v[m][0] = _mm512_fmadd_ps(w.hi0, _mm512_loadu_ps(xe), acc.v[m][0]);
                acc.v[m][1] = _mm512_fmadd_ps(w.lo0, _mm512_loadu_ps(xo), acc.v[m][1]);
                acc.v[m][0] = _mm512_fmadd_ps(w.hi1, _mm512_loadu_ps(xe + 16), acc.v[m][0]);
                acc.v[m][1] = _mm512_fmadd_ps(w.lo1, _mm512_loadu_ps(xo + 16), acc.v[m][1]);
            }
        }
    } else
#endif
    if (k % bs == 0) { /* the row is whole blocks, with no per-block bookkeeping */
        const int64_t nblk = k / bs, nb = bs / 2, b0 = o * nblk;
        const uint8_t *wrow = L->w + o * (k / 2);
        for (int64_t i = 0; i < nblk; i++)
            segment(L->code, wrow + i * nb, nb, block_scale(L, b0 + i, b2_shift), xs, i * nb, k, mt, &acc);
    } else { /* blocks straddle rows: walk the row as segments that each lie inside one block */
        const int64_t e0 = o * k, e1 = e0 + k;
        int64_t b = e0 / bs;
        for (int64_t e = e0; e < e1; b++) {
            const int64_t seg_end = (b + 1) * bs < e1 ? (b + 1) * bs : e1;
            segment(L->code, L->w + e / 2, (seg_end - e) / 2, block_scale(L, b, b2_shift), xs, (e - e0) / 2, k, mt,
                    &acc);
            e = seg_end;
        }
    }
#if Q4_ISA == 512
    /* every row's sum in the same order whatever the number of rows (and as the 4-row decoding loops sum theirs):
     * a row's result never depends on the rows computed beside it */
    for (int m0 = 0; m0 < mt; m0 += 4) {
        __m512 v[4];
        float r4[4];
        for (int j = 0; j < 4; j++)
            v[j] = m0 + j < mt ? _mm512_add_ps(acc.v[m0 + j][0], acc.v[m0 + j][1]) : _mm512_setzero_ps();
        reduce4(v[0], v[1], v[2], v[3], r4);
        for (int j = 0; j < 4 && m0 + j < mt; j++) out[m0 + j] = r4[j] + acc.s[m0 + j];
    }
#else
    for (int m = 0; m < mt; m++) {
#if Q4_ISA == 2
        __m256 v = _mm256_add_ps(acc.v[m][0], acc.v[m][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        acc.s[m] += _mm_cvtss_f32(h);
#endif
        out[m] = acc.s[m];
    }
#endif
}

#if Q4_ISA == 512
/* Four weight rows o..o+3 against one fp32 activation row (decoding; 64-weight blocks, rows of whole blocks): the
 * fp32 loop of row_dot with each block's activations loaded once for the four rows. */
static void rows4_fp32(const q4_layer *L, int64_t o, const float *xs, int b2_shift, float *out) {
    const int64_t k = L->k, nblk = k / 64, kh = k / 2;
    const __m512 code = _mm512_loadu_ps(L->code);
    __m512 a[4][2];
    for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nblk; i++) {
        const float *xe = xs + 32 * i, *xo = xe + kh;
        const __m512 xe0 = _mm512_loadu_ps(xe), xe1 = _mm512_loadu_ps(xe + 16);
        const __m512 xo0 = _mm512_loadu_ps(xo), xo1 = _mm512_loadu_ps(xo + 16);
        for (int j = 0; j < 4; j++) {
            const block_t w = fp32_block(L->w + (o + j) * kh + 32 * i, code,
                                         block_scale(L, (o + j) * nblk + i, b2_shift));
            a[j][0] = _mm512_fmadd_ps(w.hi0, xe0, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(w.lo0, xo0, a[j][1]);
            a[j][0] = _mm512_fmadd_ps(w.hi1, xe1, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(w.lo1, xo1, a[j][1]);
        }
    }
    reduce4(_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[1][0], a[1][1]), _mm512_add_ps(a[2][0], a[2][1]),
            _mm512_add_ps(a[3][0], a[3][1]), out);
}
#endif

#if Q4_BF16DOT
/* Four weight rows o..o+3 against one bf16 activation row (decoding), in the bf16 loop: each chunk's activations
 * are loaded once for the four rows, and the four sums are reduced together (a row's own horizontal sum costs about
 * as much as a 128-weight chunk, and these rows are a few chunks long). */
static void rows4_bf16dot(const q4_layer *L, int64_t o, const uint16_t *xp, int b2_shift, float *out) {
    const int64_t k = L->k, nblk = k / 64;
    const __m512i t = bf16_table(L);
    __m512 a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 128 <= k; c += 128)
        for (int j = 0; j < 4; j++) /* the activations' loads repeat per row: L1 hits, hoisted by the compiler */
            a[j] = _mm512_fmadd_ps(bf16_chunk_dot(bf16_chunk(L->w + (o + j) * (k / 2) + c / 2, t), xp + c),
                                   pair_scales(L, (o + j) * nblk + c / 64, b2_shift), a[j]);
    if (c < k) /* a last lone block per row */
        for (int j = 0; j < 4; j++)
            a[j] = _mm512_fmadd_ps(bf16_block_dot(L->w + (o + j) * (k / 2) + c / 2, t, xp + c),
                                   _mm512_set1_ps(block_scale(L, (o + j + 1) * nblk - 1, b2_shift)), a[j]);
    reduce4(a[0], a[1], a[2], a[3], out);
}
#endif

/* a[0..k) . b[0..k) in fp32 (vector partial sums, then the tail). */
static float dot_f32(const float *a, const float *b, int64_t k) {
    int64_t j = 0;
    float s = 0.0f;
#if Q4_ISA == 512
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= k; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
    s = _mm512_reduce_add_ps(acc);
#elif Q4_ISA == 2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= k; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; j < k; j++) s += a[j] * b[j];
    return s;
}

static inline void put(void *y, int dtype, int64_t i, float v) {
    if (dtype == 1) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}

/* A tile of `mt` rows with mt a compile-time constant, so that the accumulators stay in registers. */
#define DEFINE_TILE(MT) \
    static void tile_##MT(const q4_layer *L, int64_t o, const float *xs, const uint16_t *xs16, int b2_shift, \
                          float *out) { \
        row_dot(L, o, xs, xs16, MT, b2_shift, out); \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

/* The LoRA of each run of rows ("segment"): rows seg_end[s-1] .. seg_end[s]-1 add (x @ A_s^T) @ B_s^T, A_s [r_s, K]
 * in fp32 and B_s^T given as Bt_s, r_s rows of `ldb` floats whose first N are this layer's (the scaling folded in),
 * and with g_s (DoRA: the fp32 factor of each output row) the output is g_s * (x @ W^T + update) (+ bias). A NULL
 * A_s: rows without LoRA. One adapter for every row is one segment; rows of several adapters in one batch, one
 * segment per run of rows of the same adapter. */
typedef struct {
    int64_t n;
    const int64_t *end;
    const float *const *A, *const *Bt, *const *g;
    const int64_t *r;
    int64_t ldb;
} segments_t;

/* One product to compute: y[M, N] = x[M, K] @ W^T (+ bias) (+ each segment's LoRA, see segments_t), with what
 * `job_start` prepares for it: the activations de-interleaved (xs) or permuted for the bf16 loop (xs16), and for
 * each row its segment (seg, -1: none) and its x @ A^T (at ax + ax_at[m]). */
typedef struct {
    const q4_layer *L;
    void *y;
    int64_t M;
    segments_t S;
    int64_t *seg, *ax_at;
    float *xs, *ax, *wx; /* wx: with a LoRA, the weights' products [M, N], finished by `lora_row` */
    uint16_t *xs16;
    int b2_shift; /* see block_scale */
} job_t;

static void job_free(job_t *J) {
    free(J->xs);
    free(J->xs16);
    free(J->ax);
    free(J->wx);
    free(J->seg);
    J->xs = J->ax = J->wx = NULL;
    J->xs16 = NULL;
    J->seg = J->ax_at = NULL;
}

/* Output (m, o) from the weights' product `wx`: plus the bias (then y); with a LoRA, wx kept for `lora_row`. */
static inline void emit(const job_t *J, int dtype, int64_t m, int64_t o, float wx) {
    if (J->wx) {
        J->wx[m * J->L->n + o] = wx;
        return;
    }
    put(J->y, dtype, m * J->L->n + o, wx + ((J->L->bias ? J->L->bias[o] : 0.0f) + 0.0f));
}

/* Row m of y from its products `wx`: plus the bias and its LoRA update u = Bt^T ax[m] (each u[o] summed over the r
 * ranks in order, fused multiply-adds, 16 outputs at a time); with a DoRA factor g, g[o] * (wx + u) + bias. */
static void lora_row(const job_t *J, int dtype, int64_t m) {
    const int64_t n = J->L->n, s = J->seg[m], r = s >= 0 ? J->S.r[s] : 0, ldb = J->S.ldb;
    const float *wx = J->wx + m * n, *bias = J->L->bias, *ax = s >= 0 ? J->ax + J->ax_at[m] : NULL;
    const float *Bt = s >= 0 ? J->S.Bt[s] : NULL, *g = s >= 0 && J->S.g ? J->S.g[s] : NULL;
    float u[16];
    for (int64_t o0 = 0; o0 < n; o0 += 16) {
        const int64_t w = n - o0 < 16 ? n - o0 : 16;
        int64_t i = 0;
#if Q4_ISA == 512
        if (w == 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < r; j++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(ax[j]), _mm512_loadu_ps(Bt + j * ldb + o0), acc);
            _mm512_storeu_ps(u, acc);
            i = 16;
        }
#endif
        for (; i < w; i++) {
            float a = 0.0f;
            for (int64_t j = 0; j < r; j++) a = fmaf(ax[j], Bt[j * ldb + o0 + i], a);
            u[i] = a;
        }
        for (i = 0; i < w; i++) {
            const int64_t o = o0 + i;
            const float b = bias ? bias[o] : 0.0f;
            put(J->y, dtype, m * n + o, g ? g[o] * (wx[o] + u[i]) + b : wx[o] + (b + u[i]));
        }
    }
}

/* Each row's segment, and its x @ A^T [r] (in ax), computed before the weight rows are shared out, a row per
 * thread at a time. */
static int job_lora(job_t *J, const void *x, int dtype, int nthreads) {
    const int64_t k = J->L->k, M = J->M;
    const segments_t *S = &J->S;
    int64_t cells = 0, s = 0;
    J->seg = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * M + 1));
    if (!J->seg) return -1;
    J->ax_at = J->seg + M;
    for (int64_t m = 0; m < M; m++) {
        while (s < S->n && m >= S->end[s]) s++;
        J->seg[m] = s < S->n && S->A[s] && S->r[s] > 0 ? s : -1;
        J->ax_at[m] = cells;
        cells += J->seg[m] >= 0 ? S->r[s] : 0;
    }
    J->ax = (float *)malloc(sizeof(float) * (size_t)(cells + M * k));
    if (!J->ax) return -1;
    const int threads = nthreads > 0 && M > 1 ? nthreads : 1;
    (void)threads; /* (read only by the pragma) */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const int64_t sm = J->seg[m];
        float *xrow = J->ax + cells + m * k;
        if (sm < 0) continue;
        for (int64_t j = 0; j < k; j++)
            xrow[j] = dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[m * k + j]) : ((const float *)x)[m * k + j];
        for (int64_t j = 0; j < S->r[sm]; j++) J->ax[J->ax_at[m] + j] = dot_f32(S->A[sm] + j * k, xrow, k);
    }
    return 0;
}

/* Fill J for layer L on x (fp32, dtype 0, or bf16, dtype 1; row-major, contiguous). Returns 0, or -1 when K is odd
 * (rows would start mid-byte) or memory runs out (nothing left allocated then). */
static int job_start(job_t *J, const q4_layer *L, const void *x, void *y, int64_t M, int dtype,
                     const segments_t *S, int nthreads) {
    const int64_t k = L->k, kh = k / 2;
    *J = (job_t){L, y, M, {0, NULL, NULL, NULL, NULL, NULL, 0}, NULL, NULL, NULL, NULL, NULL, NULL, -1};
    if (k % 2) return -1;
    if (S && S->n > 0) {
        J->S = *S;
        J->wx = (float *)malloc(sizeof(float) * (size_t)(M * L->n > 0 ? M * L->n : 1));
        if (!J->wx || job_lora(J, x, dtype, nthreads)) { job_free(J); return -1; }
    }
    /* The bf16 loop takes bf16 activations de-interleaved as they are; every other case fp32 ones. */
    const size_t cells = (size_t)(M * k > 0 ? M * k : 1);
    if (Q4_BF16DOT && dtype == 1 && L->blocksize == 64 && k % 64 == 0) {
        J->xs16 = (uint16_t *)malloc(sizeof(uint16_t) * cells);
        if (!J->xs16) { job_free(J); return -1; }
#if Q4_BF16DOT
        for (int64_t m = 0; m < M; m++) permute_for_bf16dot((const uint16_t *)x + m * k, J->xs16 + m * k, k);
#endif
    } else {
        J->xs = (float *)malloc(sizeof(float) * cells);
        if (!J->xs) { job_free(J); return -1; }
        for (int64_t m = 0; m < M; m++) {
            float *xe = J->xs + m * k, *xo = xe + kh;
            if (dtype == 1) {
                const uint16_t *xb = (const uint16_t *)x + m * k;
                for (int64_t j = 0; j < kh; j++) { xe[j] = bf16_to_f32(xb[2 * j]); xo[j] = bf16_to_f32(xb[2 * j + 1]); }
            } else {
                const float *xf = (const float *)x + m * k;
                for (int64_t j = 0; j < kh; j++) { xe[j] = xf[2 * j]; xo[j] = xf[2 * j + 1]; }
            }
        }
    }
    if (L->blocksize2 > 0 && (L->blocksize2 & (L->blocksize2 - 1)) == 0)
        J->b2_shift = __builtin_ctzll((unsigned long long)L->blocksize2);
    return 0;
}

/* Rows 4g .. 4g+3 of J's output: what one thread does at a time. */
static void job_rows(const job_t *J, int dtype, int64_t g) {
    const q4_layer *L = J->L;
    const int64_t n = L->n, k = L->k, M = J->M, o0 = 4 * g, o1 = o0 + 4 < n ? o0 + 4 : n;
    const float *xs = J->xs;
    const uint16_t *xs16 = J->xs16;
#if Q4_ISA == 512
    if (M == 1 && o1 - o0 == 4 && (xs16 || (L->blocksize == 64 && k % 64 == 0))) {
        /* decoding: four rows share their activation loads and their horizontal sums */
        float out4[4];
#if Q4_BF16DOT
        if (xs16) rows4_bf16dot(L, o0, xs16, J->b2_shift, out4);
        else
#endif
            rows4_fp32(L, o0, xs, J->b2_shift, out4);
        for (int j = 0; j < 4; j++)
            emit(J, dtype, 0, o0 + j, out4[j]);
        return;
    }
#endif
    for (int64_t o = o0; o < o1; o++) {
        float out[MAX_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE) {
            const int64_t mt = M - m0 < MAX_TILE ? M - m0 : MAX_TILE;
            const float *xt = xs ? xs + m0 * k : NULL;
            const uint16_t *xt16 = xs16 ? xs16 + m0 * k : NULL;
            switch (mt) {
                case 1: tile_1(L, o, xt, xt16, J->b2_shift, out); break;
                case 2: tile_2(L, o, xt, xt16, J->b2_shift, out); break;
                case 3: tile_3(L, o, xt, xt16, J->b2_shift, out); break;
                case 4: tile_4(L, o, xt, xt16, J->b2_shift, out); break;
                case 5: tile_5(L, o, xt, xt16, J->b2_shift, out); break;
                case 6: tile_6(L, o, xt, xt16, J->b2_shift, out); break;
                case 7: tile_7(L, o, xt, xt16, J->b2_shift, out); break;
                default: tile_8(L, o, xt, xt16, J->b2_shift, out); break;
            }
            for (int64_t m = 0; m < mt; m++)
                emit(J, dtype, m0 + m, o, out[m]);
        }
    }
}

/* The groups of four rows of `count` jobs, numbered one after the other, shared out between `nthreads` OpenMP
 * threads. They are handed out in chunks as threads ask for them: on a machine shared with other work one core may
 * be busy, and a static split would leave the whole call waiting for it. */
static void run_jobs(const job_t *jobs, int64_t count, int dtype, int nthreads) {
    int64_t groups = 0, rows = 0;
    for (int64_t i = 0; i < count; i++) {
        groups += (jobs[i].L->n + 3) / 4;
        rows += jobs[i].L->n;
    }
    const int threads = nthreads > 0 ? nthreads : 1;
    int64_t chunk = rows / (16 * (int64_t)threads);
    chunk = chunk < 16 ? 16 : chunk; /* rows */
    const int64_t group_chunk = chunk / 4;
    (void)group_chunk; /* (read only by the pragma: unused when compiled without OpenMP) */
    int64_t job = 0, first = 0; /* each thread's own: the job of the last group it took, and that job's first group */
#pragma omp parallel for schedule(dynamic, group_chunk) num_threads(threads) firstprivate(job, first)
    for (int64_t g = 0; g < groups; g++) {
        if (g < first) job = first = 0; /* (a thread's chunks come in increasing order: this is never taken) */
        while (g - first >= (jobs[job].L->n + 3) / 4) first += (jobs[job++].L->n + 3) / 4;
        job_rows(&jobs[job], dtype, g - first);
    }
}

/* One layer (see job_t), its rows shared out between `nthreads` OpenMP threads; fp32 accumulation. Returns 0, or -1
 * when K is odd or memory runs out. */
static int linear(const q4_layer *L, const void *x, void *y, int64_t M, int dtype, int nthreads,
                  const segments_t *S) {
    job_t J;
    if (job_start(&J, L, x, y, M, dtype, S, nthreads)) return -1;
    run_jobs(&J, 1, dtype, nthreads);
    if (J.wx) {
        const int threads = nthreads > 0 && M > 1 ? nthreads : 1;
        (void)threads; /* (read only by the pragma) */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t m = 0; m < M; m++) lora_row(&J, dtype, m);
    }
    job_free(&J);
    return 0;
}

int q4_linear(const q4_layer *L, const void *x, void *y, int64_t M, int dtype, int nthreads) {
    return linear(L, x, y, M, dtype, nthreads, NULL);
}

/* `count` layers in one call, ys[i][Ms[i], N_i] = xs[i] @ W_i^T (+ bias_i), all in one OpenMP region: a mixture of
 * experts' active experts of one projection while decoding, one call where there would be one per expert. Each
 * output row is computed exactly as q4_linear computes it (the same code), so the results are the same bits. */
int q4_linear_many(const q4_layer *const *Ls, const void *const *xs, void *const *ys, const int64_t *Ms,
                   int64_t count, int dtype, int nthreads) {
    job_t *jobs = (job_t *)calloc((size_t)(count > 0 ? count : 1), sizeof(job_t));
    if (!jobs) return -1;
    int failed = 0;
    for (int64_t i = 0; i < count && !failed; i++)
        failed = job_start(&jobs[i], Ls[i], xs[i], ys[i], Ms[i], dtype, NULL, 1);
    if (!failed) run_jobs(jobs, count, dtype, nthreads);
    for (int64_t i = 0; i < count; i++) job_free(&jobs[i]);
    free(jobs);
    return failed ? -1 : 0;
}

/* One LoRA (g NULL) or DoRA adapter on every row (Bt: B transposed, see segments_t). */
int q4_linear_lora(const q4_layer *L, const void *x, void *y, int64_t M, int dtype, int nthreads, const float *A,
                   const float *Bt, int64_t r, const float *g, int64_t ldb) {
    const segments_t S = {1, &M, &A, &Bt, &g, &r, ldb};
    return linear(L, x, y, M, dtype, nthreads, &S);
}

/* Rows of several adapters (see segments_t): the batched engine's rows of different LoRA adapters in one call. */
int q4_linear_segments(const q4_layer *L, const void *x, void *y, int64_t M, int dtype, int nthreads, int64_t nseg,
                       const int64_t *seg_end, const float *const *A, const float *const *Bt, const int64_t *r,
                       const float *const *g, int64_t ldb) {
    const segments_t S = {nseg, seg_end, A, Bt, g, r, ldb};
    return linear(L, x, y, M, dtype, nthreads, &S);
}

/* ---- attention of a decoding step over the batched engine's paged keys and values ----
 *
 * One new query per row (B rows, H heads of hs) against that row's cached keys and values, which lie in the engine's
 * pool ([slots, G, hs] per layer, fp32 or bf16 like the queries) at the slots `slots[b * L + j]` of its positions
 * j; row b attends to positions starts[b] .. ends[b]-1 (its length, and its sliding window). Query head h reads kv
 * head h / (H / G). Scores q . k * scale, soft-capped (cap * tanh(s / cap)) when softcap > 0, softmax in fp32 (with
 * one more logit per head, sinks[h], that takes its share and gives nothing back, when sinks is given), then the
 * weighted sum of the values. Read straight from the pool: no gathered copy of the keys and values per layer and
 * step, as the batched step would otherwise make. Rows x kv heads are shared out between threads. */
static inline void kv_row(const void *pool, int dtype, int64_t at, int64_t hs, float *out) {
    if (dtype != 1) {
        memcpy(out, (const float *)pool + at, sizeof(float) * (size_t)hs);
        return;
    }
    const uint16_t *src = (const uint16_t *)pool + at;
    int64_t i = 0;
#if Q4_ISA == 512
    for (; i + 16 <= hs; i += 16) /* bf16 -> fp32: the 16 bits become the high half */
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
#endif
    for (; i < hs; i++) out[i] = bf16_to_f32(src[i]);
}

#if Q4_ISA == 512
/* e^x for 16 floats: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (in two parts), e^r by its degree-6 Taylor
 * polynomial (|r| <= ln 2 / 2: relative error under 2e-7, as close as expf's rounding); -inf -> 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), 0);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 e = _mm512_set1_ps(1.0f / 720);
    const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(e, n);
}
#endif

/* Softmax of the n scores at p in place (fp32), with a sink logit when given; returns nothing, p sums to 1 (with
 * the sink's share). */
static void softmax_row(float *p, int64_t n, const float *sink) {
    float mx = sink ? *sink : -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) mx = p[j] > mx ? p[j] : mx;
    int64_t j = 0;
#if Q4_ISA == 512
    __m512 s16 = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(p + j, e);
        s16 = _mm512_add_ps(s16, e);
    }
    sum = _mm512_reduce_add_ps(s16);
#endif
    for (; j < n; j++) sum += (p[j] = expf(p[j] - mx));
    if (sink) sum += expf(*sink - mx);
    const float inv = 1.0f / sum;
    for (j = 0; j < n; j++) p[j] *= inv;
}

#if Q4_ISA == 512
/* 16 values of a pool row from element `at` on, as fp32. */
static inline __m512 load16(const void *pool, int dtype, int64_t at) {
    if (dtype == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + at))), 16));
    return _mm512_loadu_ps((const float *)pool + at);
}

/* attend_group's loops in 16-wide vectors (hs a multiple of 16, at most 256): each key and value row read once from
 * the pool for all the query heads of its kv head. */
static void attend_group16(const float *qs, float *acc, float *sc, const void *kpool, const void *vpool,
                           const int64_t *row_slots, int64_t n, int64_t g, int64_t G, int64_t rep, int64_t hs,
                           float scale, float softcap, const float *sinks, int dtype) {
    const int64_t nv = hs / 16;
    for (int64_t j = 0; j < n; j++) {
        const int64_t at = (row_slots[j] * G + g) * hs;
        __m512 kr[16];
        for (int64_t c = 0; c < nv; c++) kr[c] = load16(kpool, dtype, at + 16 * c);
        for (int64_t i = 0; i < rep; i += 4) {
            __m512 d[4];
            float s4[4];
            for (int h = 0; h < 4; h++) {
                d[h] = _mm512_setzero_ps();
                if (i + h < rep)
                    for (int64_t c = 0; c < nv; c++)
                        d[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + (i + h) * hs + 16 * c), kr[c], d[h]);
            }
            reduce4(d[0], d[1], d[2], d[3], s4);
            for (int h = 0; h < 4 && i + h < rep; h++) {
                const float x = s4[h] * scale;
                sc[(i + h) * n + j] = softcap > 0 ? softcap * tanhf(x / softcap) : x;
            }
        }
    }
    for (int64_t i = 0; i < rep; i++) softmax_row(sc + i * n, n, sinks ? sinks + g * rep + i : NULL);
    for (int64_t i = 0; i < rep; i++) {
        __m512 a[16];
        for (int64_t c = 0; c < nv; c++) a[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m512 p = _mm512_set1_ps(sc[i * n + j]);
            const int64_t at = (row_slots[j] * G + g) * hs;
            for (int64_t c = 0; c < nv; c++) a[c] = _mm512_fmadd_ps(p, load16(vpool, dtype, at + 16 * c), a[c]);
        }
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(acc + i * hs + 16 * c, a[c]);
    }
}
#endif

/* Row b's query heads of kv head g against its keys starts..ends-1 (see q4_decode_attention), into y. */
static void attend_group(const void *q, void *y, const void *kpool, const void *vpool, const int64_t *slots,
                         int64_t start, int64_t end, int64_t b, int64_t g, int64_t L, int64_t H, int64_t G,
                         int64_t hs, float scale, float softcap, const float *sinks, int dtype, float *buf) {
    const int64_t rep = H / G, n = end - start, *row_slots = slots + b * L + start;
    float *qs = buf, *acc = qs + rep * hs, *row = acc + rep * hs, *sc = row + hs;
    for (int64_t i = 0; i < rep; i++) kv_row(q, dtype, (b * H + g * rep + i) * hs, hs, qs + i * hs);
#if Q4_ISA == 512
    if (hs % 16 == 0 && hs <= 256) {
        attend_group16(qs, acc, sc, kpool, vpool, row_slots, n, g, G, rep, hs, scale, softcap, sinks, dtype);
        for (int64_t i = 0; i < rep * hs; i++) put(y, dtype, (b * H + g * rep) * hs + i, acc[i]);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        kv_row(kpool, dtype, (row_slots[j] * G + g) * hs, hs, row);
        for (int64_t i = 0; i < rep; i++) {
            const float s = dot_f32(qs + i * hs, row, hs) * scale;
            sc[i * n + j] = softcap > 0 ? softcap * tanhf(s / softcap) : s;
        }
    }
    for (int64_t i = 0; i < rep; i++) {
        softmax_row(sc + i * n, n, sinks ? sinks + g * rep + i : NULL);
        memset(acc + i * hs, 0, sizeof(float) * (size_t)hs);
    }
    for (int64_t j = 0; j < n; j++) {
        kv_row(vpool, dtype, (row_slots[j] * G + g) * hs, hs, row);
        for (int64_t i = 0; i < rep; i++) {
            const float p = sc[i * n + j];
            float *a = acc + i * hs;
            for (int64_t d = 0; d < hs; d++) a[d] += p * row[d];
        }
    }
    for (int64_t i = 0; i < rep * hs; i++) put(y, dtype, (b * H + g * rep) * hs + i, acc[i]);
}

int q4_decode_attention(const void *q, void *y, const void *kpool, const void *vpool, const int64_t *slots,
                        const int64_t *starts, const int64_t *ends, int64_t B, int64_t L, int64_t H, int64_t G,
                        int64_t hs, float scale, float softcap, const float *sinks, int dtype, int nthreads) {
    const int64_t rep = H / G, cells = rep * (2 * hs + L) + hs; /* per task: queries, sums, a row, the scores */
    const int threads = nthreads > 0 ? nthreads : 1;
    float *bufs = (float *)malloc(sizeof(float) * (size_t)(cells * threads));
    if (!bufs) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < B * G; t++) {
#ifdef _OPENMP
        float *buf = bufs + cells * omp_get_thread_num();
#else
        float *buf = bufs;
#endif
        attend_group(q, y, kpool, vpool, slots, starts[t / G], ends[t / G], t / G, t % G, L, H, G, hs, scale,
                     softcap, sinks, dtype, buf);
    }
    free(bufs);
    return 0;
}
