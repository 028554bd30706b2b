#include "kernels/moe_kernels.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <openvino/core/parallel.hpp>

#include "common/amx.hpp"
#include "kernels/moe_amx.hpp"

// Only the functions marked with this attribute use AVX-512 code (and those
// marked NUMAOV_TARGET_AVX2, AVX2); the rest of the file stays baseline x86-64,
// so loading the library on an older CPU is safe (kernel_isa() picks what the
// CPU has; without either, the kernel refuses with unavailable_reason()).
#define NUMAOV_TARGET_AVX512_BF16 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace numaov::moe {

namespace {

// A micro-tile is up to kTileRows (row, slot) pairs by kTileCols weight rows:
// 16 zmm accumulators, 4 weight and 4 activation registers.
constexpr size_t kTileRows = 4;
constexpr size_t kTileCols = 4;
// Rows of one expert taken through a block of columns before moving on, so the
// block's weights stay in L2 while the rows stream (long prefill).
constexpr size_t kRowChunk = 64;
// bf16 experts with at least this many (row, slot) pairs run on AMX tiles
// (moe_amx.hpp) where usable. At a few rows an expert's product is bound by
// reading its weights, and at one row the tiles' 16 row streams per weight
// block read them no faster than the dot products' one stream per row; from
// two rows the tiles win (benchmarks/moe.py --part amx-rows: 1 row 0.80x,
// 2 rows 1.20x, 16 rows 2.04x; benchmarks/RESULTS.md).
constexpr size_t kAmxMinRows = 2;
// fp8 experts with bf16 activations (a bf16 model) run on the bf16 tiles (AMX where usable,
// else AVX512-BF16 dot products) once a call averages this many rows per expert it reads:
// each block of weight rows is dequantized to bf16 once (TileRows) and then serves all of
// its expert's rows, where the exact path widens every weight to f32 for every 4 rows and
// is bound by its f32 FMAs. On AVX512-BF16 dot products the two are even at 8 rows (hidden
// 2,048 x 1,408, 2 cores: 151 against 147 GMAC/s), the tiles ahead from there (12 rows 1.28x,
// 16 rows 1.46x; benchmarks/RESULTS.md); AMX tiles only move the crossover lower. Decode
// stays exact.
constexpr size_t kFp8TileMinRows = 8;
// bf16 experts (and a dense linear's one) with at least this many rows run, where AMX is not
// used, on AVX512-BF16 outer products against their packed activations (outer_products):
// the dot-product tiles' 4 x 4 sums end in 16 horizontal adds and reread the activations
// for every 4 weight rows, which left a 512-row bf16 linear at 123 GMAC/s against OpenVINO's
// 178 on 2 cores (benchmarks/RESULTS.md); below it the padded 16-row blocks waste products.
// int8 experts on quantized activations (AVX512-VNNI) switch at the same count: a 512-row int8
// linear ran 158 GMAC/s on the dot-product tiles, 301 as outer products.
constexpr size_t kOuterMinRows = 16;

struct Features {
    bool avx512 = false;
    bool avx512_bf16 = false;
    bool avx512_vnni = false;
    bool avx2 = false;  // with FMA and F16C
};

const Features& features() {
    // libgcc's checks: the CPUID bits and that the OS saves the registers (XCR0), so a
    // system that leaves AVX-512's state off gets the AVX2 kernel rather than a fault.
    static const Features f = [] {
        Features s;
        s.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        s.avx512_bf16 = s.avx512 && __builtin_cpu_supports("avx512bf16");
        s.avx512_vnni = s.avx512 && __builtin_cpu_supports("avx512vnni");
        s.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        return s;
    }();
    return f;
}

uint16_t to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1);  // round to nearest even
    return uint16_t(bits >> 16);
}

float from_bf16(uint16_t value) {
    const uint32_t bits = uint32_t(value) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

// GCC keeps a micro-tile's accumulator array in zmm registers only when every
// loop over it is fully unrolled early (before scalar replacement of the
// array). Rolled `for` loops were unrolled late, after that pass, and left the
// array in memory: every k step stored all M x kTileCols accumulators to the
// stack (16 64-byte stores per 16 FMAs at M = 4), so prefill ran at store speed
// (issue 33). Every loop over accumulators, weight vectors or rows carries this.
#define NUMAOV_UNROLL _Pragma("GCC unroll 16")
// The tile helpers are inlined into their dot_tile so the accumulators never
// cross a call (a call would pass them through memory).
#define NUMAOV_INLINE inline __attribute__((always_inline))

// The M x kTileCols accumulators of a micro-tile: zeroed, and summed into c.
template <int M>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void zero_tile(__m512 (&acc)[M][kTileCols]) {
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) acc[m][n] = _mm512_setzero_ps();
    }
}

template <int M>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void store_tile(const __m512 (&acc)[M][kTileCols], float* c) {
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) c[m * kTileCols + n] = _mm512_reduce_add_ps(acc[m][n]);
    }
}

// acc[m][n] += a[m][k + 16v .. k + 16v + 16) * wv[v][n] for the V vectors of
// weights one step widened (int4: 2 of 16 values, the other formats 1), the
// activations loaded under `mask` (all ones but in a row's last, short step).
template <int M, int V>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void fma_tile(__m512 (&acc)[M][kTileCols], const float* const (&a)[M], size_t k,
                                                      __mmask16 mask, const __m512 (&wv)[V][kTileCols]) {
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        NUMAOV_UNROLL for (int v = 0; v < V; ++v) {
            const __m512 av = _mm512_maskz_loadu_ps(mask, a[m] + k + 16 * v);
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) acc[m][n] = _mm512_fmadd_ps(av, wv[v][n], acc[m][n]);
        }
    }
}

// A tile of few rows (decode: one row, batched decode: an expert gets one to
// three) reads each weight once, so its loop should be bound by the weight
// reads. The tile's kTileCols rows are adjacent in the stack (one contiguous
// block of kTileCols rows), and so is the next tile's block: the one the thread
// reads next (the next columns of its item). Row streams of a few kilobytes
// each (int8 / fp8 rows of 2,048 values: 2 KB, int4: 1 KB) are too short for
// the hardware prefetcher to ramp up, so the tile requests the next block in
// software as one stream: each iteration that takes 64 bytes from each of its
// rows requests the next kTileCols lines of the next block, which is thus in
// cache, whole, when the tile ends (a distance of one block: 8 KB for int8 rows
// of 2,048, 16-36 KB for bf16 rows of 2,048-4,608). The requests go to L2, not
// L1: a tile of several rows holds its activation rows (4 x 4-9 KB) and its own
// block in L1, and the next block requested into L1 beside them evicted both
// (a chain of bf16 DenseLinears of 4 / 8 rows 1.3x / 1.5x faster into L2, one
// row the same or faster; benchmarks/RESULTS.md). Past the item's end it is the next columns' block,
// which this thread or another reads soon; past the stack's end it is harmless
// (a prefetch never faults). Every tile of bf16, int8, int4 or fp8 weights
// read in place does it (not rows dequantized into a buffer): the first tile of an expert's
// rows reads the weights from memory whatever its rows (int8 / fp8 experts of
// 2-4 rows read 5-7 GB/s without, 29-36 with), and for a later tile of the same
// rows the requests cost a few instructions beside its FMAs. (Issue 33: decode's
// samples sat on the first load of each line before; the next expert's rows at
// a hit's last tile measured no better; benchmarks/RESULTS.md.)
// `next` is null for rows a thread has copied into a buffer (TileRows): those come from
// cache, and what follows them is not the stack's next block.
NUMAOV_INLINE void prefetch_next_block(const uint8_t* next, size_t row_byte) {
    if (!next) return;
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
        _mm_prefetch(reinterpret_cast<const char*>(next + kTileCols * row_byte + 64 * n), _MM_HINT_T1);
    }
}

// The M activation rows and kTileCols weight rows as local arrays, so the
// loops read them from registers rather than through the callers' pointers.
template <int M, class A, class W>
NUMAOV_INLINE void local_rows(const A* const* a, const W* const* w, const A* (&la)[M], const W* (&lw)[kTileCols]) {
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) la[m] = a[m];
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) lw[n] = w[n];
}

// Dot products c[m * kTileCols + n] = a[m] . w[n] over K values, m < M, n < kTileCols.
template <int M>
NUMAOV_TARGET_AVX512_BF16 void dot_tile(const float* const* a_in, const float* const* w_in, size_t K, float* c) {
    const float* a[M];
    const float* w[kTileCols];
    local_rows<M>(a_in, w_in, a, w);
    __m512 acc[M][kTileCols];
    zero_tile<M>(acc);
    for (size_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        __m512 wv[1][kTileCols];
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) wv[0][n] = _mm512_maskz_loadu_ps(mask, w[n] + k);
        fma_tile<M, 1>(acc, a, k, mask, wv);
    }
    store_tile<M>(acc, c);
}

// The same over bf16 pairs (vdpbf16ps: 32 products per instruction, f32 sums).
template <int M>
NUMAOV_TARGET_AVX512_BF16 void dot_tile(const uint16_t* const* a_in, const uint16_t* const* w_in, size_t K,
                                        const uint8_t* next, float* c) {
    const uint16_t* a[M];
    const uint16_t* w[kTileCols];
    local_rows<M>(a_in, w_in, a, w);
    __m512 acc[M][kTileCols];
    zero_tile<M>(acc);
    for (size_t k = 0; k < K; k += 32) {
        prefetch_next_block(next, 2 * k);
        const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
        __m512i wv[kTileCols];
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) wv[n] = _mm512_maskz_loadu_epi16(mask, w[n] + k);
        NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
            const __m512i av = _mm512_maskz_loadu_epi16(mask, a[m] + k);
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
                acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)av, (__m512bh)wv[n]);
            }
        }
    }
    store_tile<M>(acc, c);
}

// 16 int8 bytes as 16 f32 values.
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE __m512 widen_int8(__m128i bytes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// 16 E4M3FN bytes (float8_e4m3fn) as their 16 exact f32 values times 2^-8
// (kFp8Unit undoes it, folded into the scales). The bits of an E4M3 value
// S.EEEE.MMM, moved 7 places up into a 16-bit lane, are those of the IEEE half
// S.0EEEE.MMM0000000, whose value is the E4M3 value times 2^-8: exponent bias
// 15 against 7, for normal and subnormal codes alike. F16C's conversion widens
// halves exactly, subnormal halves included (DAZ does not apply to its half
// inputs, and no denormal f32 arithmetic is involved), so three lane operations
// and one conversion widen 16 weights. The NaN codes (S.1111.111) are never written by the quantizer and
// read as 480.
constexpr float kFp8Unit = 256.0f;

NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE __m512 widen_fp8(__m128i bytes) {
    const __m256i b = _mm256_cvtepi8_epi16(bytes);  // sign-extended: the sign in bits 7 .. 15
    // bits 7 .. 13 the magnitude, bit 15 the sign, bit 14 (a copy of the sign) cleared
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xBF80)));
    return _mm512_cvtph_ps(half);
}

// The kTileCols group scales of scale group g, one vector each.
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void group_scales(const float* const* scale, size_t g, float unit,
                                                          __m512 (&s)[kTileCols]) {
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) s[n] = _mm512_set1_ps(scale[n][g] * unit);
}

// Scaled weights: each widened weight vector times its group's scale before the
// FMAs (tiles of several rows: one multiply serves them all; int4 looks its
// weights up already scaled instead). A one-row tile sums the unscaled products
// of a group in `part` and adds part times the scale into its accumulators at
// the group's end: one FMA per 16 weights and no multiply, which decode, bound
// by these instructions between reads, needs (issue 33). Both are f32 sums of
// the same products, in another order. (Part sums for two-row tiles too were
// measured no faster: at two rows the byte formats wait on their reads.)
template <int M>
struct GroupSums {
    static constexpr bool kPartSums = M == 1;
    __m512 acc[M][kTileCols];
    __m512 part[M][kTileCols];  // kPartSums: this group's unscaled sums
    __m512 s[kTileCols];        // this group's scales

    NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void start(const float* const* scale, size_t g, float unit) {
        group_scales(scale, g, unit, s);
        if constexpr (kPartSums) zero_tile<M>(part);
    }
    // The vectors of weights one step widened, into the FMAs.
    template <int V>
    NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void add(const float* const (&a)[M], size_t k, __mmask16 mask,
                                                     __m512 (&wv)[V][kTileCols]) {
        if constexpr (kPartSums) {
            fma_tile<M, V>(part, a, k, mask, wv);
        } else {
            NUMAOV_UNROLL for (int v = 0; v < V; ++v) {
                NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) wv[v][n] = _mm512_mul_ps(wv[v][n], s[n]);
            }
            fma_tile<M, V>(acc, a, k, mask, wv);
        }
    }
    // Weights widened already times their group's scale (int4's scaled tables), into the FMAs.
    template <int V>
    NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void add_scaled(const float* const (&a)[M], size_t k,
                                                            __m512 (&wv)[V][kTileCols]) {
        fma_tile<M, V>(acc, a, k, __mmask16(0xFFFF), wv);
    }
    NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void finish() {
        if constexpr (kPartSums) {
            NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
                NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
                    acc[m][n] = _mm512_fmadd_ps(part[m][n], s[n], acc[m][n]);
                }
            }
        }
    }
};

// One step of dot_tile_bytes: 16 weights of each row widened by `widen`, then
// one FMA per activation row; `mask` is all ones but in the last step of a row
// of one group with K % 16 != 0.
template <int M, __m512 (*widen)(__m128i)>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void byte_step(GroupSums<M>& sums, const float* const (&a)[M],
                                                       const uint8_t* const (&w)[kTileCols], size_t k, __mmask16 mask) {
    __m512 wv[1][kTileCols];
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) wv[0][n] = widen(_mm_maskz_loadu_epi8(mask, w[n] + k));
    sums.template add<1>(a, k, mask, wv);
}

// Rows of one byte per weight (int8, fp8): 16 weights at a time through
// byte_step, `unit` the value of a widened 1 (kFp8Unit for fp8). `group` is K
// (one scale per row) or a multiple of 16. The scale groups are the outer loop,
// so no division finds a value's group.
template <int M, __m512 (*widen)(__m128i)>
NUMAOV_TARGET_AVX512_BF16 void dot_tile_bytes(const float* const* a_in, const uint8_t* const* w_in,
                                              const float* const* scale, float unit, size_t K, size_t group,
                                              const uint8_t* next, float* c) {
    const float* a[M];
    const uint8_t* w[kTileCols];
    local_rows<M>(a_in, w_in, a, w);
    GroupSums<M> sums;
    zero_tile<M>(sums.acc);
    for (size_t g = 0, k0 = 0; k0 < K; ++g, k0 += group) {
        sums.start(scale, g, unit);
        const size_t k1 = k0 + group;  // <= K
        size_t k = k0;
        // A whole 64-byte line of each weight row per iteration, four steps
        // unrolled (more loads in flight). The steps run in the same order, so the
        // sums do not change.
        for (; k + 64 <= k1; k += 64) {
            prefetch_next_block(next, k);
            NUMAOV_UNROLL for (size_t v = 0; v < 64; v += 16) {
                byte_step<M, widen>(sums, a, w, k + v, __mmask16(0xFFFF));
            }
        }
        for (; k < k1; k += 16) {
            byte_step<M, widen>(sums, a, w, k, k1 - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1));
        }
        sums.finish();
    }
    store_tile<M>(sums.acc, c);
}

// One step of dot_tile_int4: 32 weights of each row (16 bytes: low nibbles
// values k .. k+15, high nibbles k+16 .. k+31, each q + 8) widened by looking
// each nibble up in its row's table (q as f32 at q + 8: the lookup takes an
// index's low 4 bits, so the low nibbles need no mask), then two FMAs per
// activation row. A one-row tile's tables hold q (its group sums are scaled at
// the group's end); those of larger tiles q times the group's scale: the same
// f32 products as a multiply after widening, four multiplies a group instead of
// eight a step (1.1-1.3x at 2 to 256 rows per expert).
template <int M>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void int4_step(GroupSums<M>& sums, const float* const (&a)[M],
                                                       const uint8_t* const (&w)[kTileCols],
                                                       const __m512 (&table)[kTileCols], size_t k) {
    __m512 wv[2][kTileCols];
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
        const __m512i b =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[n] + k / 2)));
        wv[0][n] = _mm512_permutexvar_ps(b, table[n]);
        wv[1][n] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table[n]);
    }
    if constexpr (GroupSums<M>::kPartSums) {
        sums.template add<2>(a, k, __mmask16(0xFFFF), wv);
    } else {
        sums.template add_scaled<2>(a, k, wv);
    }
}

// int4 rows: 32 weights at a time through int4_step, scaled like int8. K and
// `group` are multiples of 32; the scale groups are the outer loop, as in
// dot_tile_bytes.
template <int M>
NUMAOV_TARGET_AVX512_BF16 void dot_tile_int4(const float* const* a_in, const uint8_t* const* w_in,
                                             const float* const* scale, size_t K, size_t group,
                                             const uint8_t* next, float* c) {
    const float* a[M];
    const uint8_t* w[kTileCols];
    local_rows<M>(a_in, w_in, a, w);
    const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    GroupSums<M> sums;
    zero_tile<M>(sums.acc);
    __m512 table[kTileCols];
    for (size_t g = 0, k0 = 0; k0 < K; ++g, k0 += group) {
        sums.start(scale, g, 1.0f);
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
            table[n] = GroupSums<M>::kPartSums ? values : _mm512_mul_ps(values, sums.s[n]);
        }
        const size_t k1 = k0 + group;  // <= K
        size_t k = k0;
        // A 64-byte line (128 values) of each weight row per iteration, as in
        // dot_tile_bytes.
        for (; k + 128 <= k1; k += 128) {
            prefetch_next_block(next, k / 2);
            NUMAOV_UNROLL for (size_t v = 0; v < 128; v += 32) int4_step<M>(sums, a, w, table, k + v);
        }
        for (; k < k1; k += 32) int4_step<M>(sums, a, w, table, k);
        sums.finish();
    }
    store_tile<M>(sums.acc, c);
}

// One weight stack (gate_up or down) in its format: `rows` rows of K values per expert.
struct Stack {
    const void* data;
    const float* scale;  // int8 / int4 / fp8: [E, rows, groups]
    size_t rows, K, groups;
    WeightFormat format;
    bool streamed = true;  // read from memory (the stack itself), so tiles request ahead

    size_t row_bytes() const {
        switch (format) {
            case WeightFormat::f32: return K * 4;
            case WeightFormat::bf16: return K * 2;
            case WeightFormat::int8: return K;
            case WeightFormat::fp8: return K;
            default: return K / 2;
        }
    }
    const uint8_t* row(size_t expert, size_t r) const {
        return static_cast<const uint8_t*>(data) + (expert * rows + r) * row_bytes();
    }
    const float* row_scale(size_t expert, size_t r) const { return scale + (expert * rows + r) * groups; }
    // Rows [r0, r0 + count) of `expert` as a stack of one expert (its scales with them).
    Stack slice(size_t expert, size_t r0, size_t count) const {
        return {row(expert, r0), scale ? row_scale(expert, r0) : nullptr, count, K, groups, format, streamed};
    }
};

template <int M, class T>
void dot_tile_of(const T* const* a, const Stack& s, const size_t* r, float* c) {
    const uint8_t* w[kTileCols];
    for (size_t n = 0; n < kTileCols; ++n) w[n] = s.row(0, r[n]);
    // the block of kTileCols rows after this tile's (see prefetch_next_block)
    const uint8_t* next = s.streamed ? w[0] + kTileCols * s.row_bytes() : nullptr;
    if constexpr (std::is_same_v<T, uint16_t>) {
        dot_tile<M>(a, reinterpret_cast<const uint16_t* const*>(w), s.K, next, c);
    } else {
        if (s.format == WeightFormat::f32) return dot_tile<M>(a, reinterpret_cast<const float* const*>(w), s.K, c);
        const float* scale[kTileCols];
        for (size_t n = 0; n < kTileCols; ++n) scale[n] = s.row_scale(0, r[n]);
        // The next block's scales too (a few lines, in another region of the
        // stack): their first read would otherwise stall the next tile's start.
        const char* next_scale = reinterpret_cast<const char*>(scale[0] + kTileCols * s.groups);
        for (size_t b = 0; b < kTileCols * s.groups * sizeof(float); b += 64) {
            _mm_prefetch(next_scale + b, _MM_HINT_T0);
        }
        if (s.format == WeightFormat::int8) {
            return dot_tile_bytes<M, widen_int8>(a, w, scale, 1.0f, s.K, s.K / s.groups, next, c);
        }
        if (s.format == WeightFormat::fp8) {
            return dot_tile_bytes<M, widen_fp8>(a, w, scale, kFp8Unit, s.K, s.K / s.groups, next, c);
        }
        dot_tile_int4<M>(a, w, scale, s.K, s.K / s.groups, next, c);
    }
}

// `rows` (1 .. kTileRows) activation rows against weight rows r[0 .. kTileCols)
// of `s`, one expert's rows (Stack::slice, TileRows); unused entries of c stay 0.
template <class T>
void dot_rows(const T* const* a, size_t rows, const Stack& s, const size_t* r, float* c) {
    std::fill(c, c + kTileRows * kTileCols, 0.0f);
    switch (rows) {
        case 1: return dot_tile_of<1>(a, s, r, c);
        case 2: return dot_tile_of<2>(a, s, r, c);
        case 3: return dot_tile_of<3>(a, s, r, c);
        default: return dot_tile_of<4>(a, s, r, c);
    }
}

// -- AVX2 tiles -------------------------------------------------------------------------------
//
// For CPUs without AVX-512 (or forced, NUMAOV_MOE_ISA=avx2): the same tiles' contract as
// dot_rows, on 8-lane f32 FMAs. Every format is widened to an exact f32 value as it is read
// (bf16 by a shift, int8 by conversion, fp8 through an IEEE half as widen_fp8, int4 as its
// stored nibble q + 8, the 8 taken off a group's sums at its end: one op fewer per weight),
// and bf16 activations likewise, so bf16 experts give the products of the AVX512-BF16 path
// and int8 / fp8 those of the AVX-512 one, summed in another order. 16 ymm registers hold at
// most two activation rows' accumulators, so a tile of more rows is taken two rows at a time
// (the weights come from L1 the second time).
#define NUMAOV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

// Values of row `w` from k on, widened: 8 at a time and one at a time (a row's or group's tail).
template <WeightFormat F>
NUMAOV_TARGET_AVX2 NUMAOV_INLINE __m256 widen8(const uint8_t* w, size_t k) {
    if constexpr (F == WeightFormat::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
    if constexpr (F == WeightFormat::bf16) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    if constexpr (F == WeightFormat::int8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k))));
    }
    if constexpr (F == WeightFormat::fp8) {  // times 2^-8, as widen_fp8
        const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(int16_t(0xBF80))));
    }
    // int4: widen32 (whole 32-value blocks only)
}

template <WeightFormat F>
NUMAOV_TARGET_AVX2 float widen1(const uint8_t* w, size_t k) {
    if constexpr (F == WeightFormat::f32) return reinterpret_cast<const float*>(w)[k];
    if constexpr (F == WeightFormat::bf16) return from_bf16(reinterpret_cast<const uint16_t*>(w)[k]);
    if constexpr (F == WeightFormat::int8) return float(int8_t(w[k]));
    if constexpr (F == WeightFormat::fp8) {
        const int16_t b = int8_t(w[k]);
        return _cvtsh_ss(uint16_t((b << 7) & 0xBF80));
    }
    if constexpr (F == WeightFormat::int4) {
        const size_t o = k % 32;
        const uint8_t byte = w[(k - o) / 2 + (o % 16)];
        return float(int(o < 16 ? byte & 0xF : byte >> 4) - 8);
    }
}

NUMAOV_TARGET_AVX2 NUMAOV_INLINE __m256 load8(const float* a, size_t k) { return _mm256_loadu_ps(a + k); }
NUMAOV_TARGET_AVX2 NUMAOV_INLINE __m256 load8(const uint16_t* a, size_t k) {
    return widen8<WeightFormat::bf16>(reinterpret_cast<const uint8_t*>(a), k);
}
inline float load1(const float* a, size_t k) { return a[k]; }
inline float load1(const uint16_t* a, size_t k) { return from_bf16(a[k]); }

NUMAOV_TARGET_AVX2 NUMAOV_INLINE float sum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// Bits a weight of format F takes in a row.
template <WeightFormat F>
constexpr size_t kWeightBits = F == WeightFormat::f32 ? 32 : F == WeightFormat::bf16 ? 16
                               : F == WeightFormat::int4 ? 4 : 8;

// The 32 values of row `w` from k on, widened into four vectors of 8 (values k + 8v on).
// int4 (k a multiple of 32; a 16-byte block holds values k .. k + 15 in its low nibbles and
// k + 16 .. k + 31 in its high ones) as the stored nibble q + 8: each 8 bytes zero-extended
// once serve both of their nibbles, and the offset comes off a group's sums at its end
// (in dot_tile_avx2), not off every weight. fp8 16 values at a time: its half's bits made once
// for 16 lanes, then F16C's two conversions. The other formats 8 at a time (widen8).
template <WeightFormat F>
NUMAOV_TARGET_AVX2 NUMAOV_INLINE void widen32(const uint8_t* w, size_t k, __m256 (&wv)[4]) {
    if constexpr (F == WeightFormat::int4) {
        const uint8_t* block = w + k / 2;
        const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block)));
        const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)));
        const __m256i low = _mm256_set1_epi32(0xF);
        wv[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, low));
        wv[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, low));
        wv[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
        wv[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
    } else if constexpr (F == WeightFormat::fp8) {  // times 2^-8, as widen_fp8
        NUMAOV_UNROLL for (size_t h = 0; h < 2; ++h) {
            const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * h)));
            const __m256i half = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xBF80)));
            wv[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
            wv[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
        }
    } else {
        NUMAOV_UNROLL for (size_t v = 0; v < 4; ++v) wv[v] = widen8<F>(w, k + 8 * v);
    }
}

// acc[m][n] += a[m][k ..) * w[n][k ..) * s[n] for 32 values (`s`: the group's scales, or
// none: each widened vector multiplied once for all rows, as GroupSums does for tiles of
// several rows).
template <WeightFormat F, int M, bool kScale, class T>
NUMAOV_TARGET_AVX2 NUMAOV_INLINE void fma32(__m256 (&acc)[M][kTileCols], const T* const* a,
                                            const uint8_t* const* w, size_t k, const __m256 (&s)[kTileCols]) {
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
        __m256 wv[4];
        widen32<F>(w[n], k, wv);
        NUMAOV_UNROLL for (size_t v = 0; v < 4; ++v) {
            if constexpr (kScale) wv[v] = _mm256_mul_ps(wv[v], s[n]);
            NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
                acc[m][n] = _mm256_fmadd_ps(load8(a[m], k + 8 * v), wv[v], acc[m][n]);
            }
        }
    }
}

// acc[m][n] += a[m][k + 8 ..) * w[n][k + 8 ..) * s[n] for 8 values (a group's tail; not int4).
template <WeightFormat F, int M, bool kScale, class T>
NUMAOV_TARGET_AVX2 NUMAOV_INLINE void fma8(__m256 (&acc)[M][kTileCols], const T* const* a,
                                           const uint8_t* const* w, size_t k, const __m256 (&s)[kTileCols]) {
    __m256 av[M];
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) av[m] = load8(a[m], k);
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
        __m256 wv = widen8<F>(w[n], k);
        if constexpr (kScale) wv = _mm256_mul_ps(wv, s[n]);
        NUMAOV_UNROLL for (int m = 0; m < M; ++m) acc[m][n] = _mm256_fmadd_ps(av[m], wv, acc[m][n]);
    }
}

// c[m * kTileCols + n] = a[m] . w[n] for M (1 or 2) activation rows, each scale group's
// products times its scale (int8 / int4 / fp8; `unit` as for the AVX-512 tiles): 32 values a
// step, then 8, then one at a time. Like GroupSums: a one-row tile sums a group's unscaled
// products and adds them times the scale at the group's end; two rows scale each widened
// vector once. int4's products are of the stored q + 8, so a group's sums lose 8 times the
// sum of its activations (per lane, kept beside them) at its end. Every tile requests the
// next block of rows as dot_tile does, once per 64 bytes of its rows.
template <WeightFormat F, int M, class T>
NUMAOV_TARGET_AVX2 void dot_tile_avx2(const T* const* a, const uint8_t* const* w, const float* const* scale,
                                      float unit, size_t K, size_t group, float* c) {
    constexpr bool kScaled = F == WeightFormat::int8 || F == WeightFormat::int4 || F == WeightFormat::fp8;
    constexpr bool kScaleWeights = kScaled && M > 1;
    constexpr bool kInt4 = F == WeightFormat::int4;
    constexpr size_t kStepBytes = 32 * kWeightBits<F> / 8;
    const uint8_t* next = w[0] + kTileCols * (K * kWeightBits<F> / 8);
    __m256 acc[M][kTileCols], s[kTileCols];
    float tail[M][kTileCols] = {};
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) acc[m][n] = _mm256_setzero_ps();
    }
    for (size_t g = 0, k0 = 0; k0 < K; ++g, k0 += group) {
        const size_t k1 = k0 + group;
        float sg[kTileCols];
        for (size_t n = 0; n < kTileCols; ++n) {
            sg[n] = kScaled ? scale[n][g] * unit : 1.0f;
            s[n] = _mm256_set1_ps(sg[n]);
        }
        __m256 part[M][kTileCols];  // one-row tiles: this group's unscaled sums
        __m256 (&sums)[M][kTileCols] = kScaled && M == 1 ? part : acc;
        __m256 a_sum[M];            // int4: this group's activations, per lane
        if constexpr (kScaled && M == 1) {
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) part[0][n] = _mm256_setzero_ps();
        }
        NUMAOV_UNROLL for (int m = 0; m < M; ++m) a_sum[m] = _mm256_setzero_ps();
        size_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            const size_t byte = k * kWeightBits<F> / 8;
            for (size_t b = (byte + 63) & ~size_t(63); b < byte + kStepBytes; b += 64) {
                prefetch_next_block(next, b);
            }
            if constexpr (kInt4) {
                NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
                    a_sum[m] = _mm256_add_ps(_mm256_add_ps(load8(a[m], k), load8(a[m], k + 8)),
                                             _mm256_add_ps(_mm256_add_ps(load8(a[m], k + 16), load8(a[m], k + 24)), a_sum[m]));
                }
            }
            fma32<F, M, kScaleWeights>(sums, a, w, k, s);
        }
        if constexpr (!kInt4) {  // int4 groups are whole 32-value blocks
            for (; k + 8 <= k1; k += 8) fma8<F, M, kScaleWeights>(sums, a, w, k, s);
        }
        if constexpr (kInt4) {  // the offset: sums -= 8 * a_sum (one-row tiles before their scale)
            NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
                NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
                    const __m256 eight = kScaleWeights ? _mm256_mul_ps(_mm256_set1_ps(8.0f), s[n]) : _mm256_set1_ps(8.0f);
                    sums[m][n] = _mm256_fnmadd_ps(a_sum[m], eight, sums[m][n]);
                }
            }
        }
        if constexpr (kScaled && M == 1) {
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) acc[0][n] = _mm256_fmadd_ps(part[0][n], s[n], acc[0][n]);
        }
        for (int m = 0; m < M; ++m) {
            for (size_t n = 0; n < kTileCols; ++n) {
                for (size_t t = k; t < k1; ++t) tail[m][n] += load1(a[m], t) * widen1<F>(w[n], t) * sg[n];
            }
        }
    }
    for (int m = 0; m < M; ++m) {
        for (size_t n = 0; n < kTileCols; ++n) c[m * kTileCols + n] += sum8(acc[m][n]) + tail[m][n];
    }
}

template <WeightFormat F, class T>
NUMAOV_TARGET_AVX2 void dot_rows_avx2_of(const T* const* a, size_t rows, const Stack& s, const size_t* r,
                                         float* c) {
    const uint8_t* w[kTileCols];
    const float* scale[kTileCols] = {};
    for (size_t n = 0; n < kTileCols; ++n) {
        w[n] = s.row(0, r[n]);
        if (s.scale) scale[n] = s.row_scale(0, r[n]);
    }
    const float unit = F == WeightFormat::fp8 ? kFp8Unit : 1.0f;
    const size_t group = s.K / s.groups;
    for (size_t m = 0; m < rows; m += 2) {
        if (rows - m == 1) {
            dot_tile_avx2<F, 1>(a + m, w, scale, unit, s.K, group, c + m * kTileCols);
        } else {
            dot_tile_avx2<F, 2>(a + m, w, scale, unit, s.K, group, c + m * kTileCols);
        }
    }
}

template <class T>
void dot_rows_avx2(const T* const* a, size_t rows, const Stack& s, const size_t* r, float* c) {
    std::fill(c, c + kTileRows * kTileCols, 0.0f);
    switch (s.format) {
        case WeightFormat::f32: return dot_rows_avx2_of<WeightFormat::f32>(a, rows, s, r, c);
        case WeightFormat::bf16: return dot_rows_avx2_of<WeightFormat::bf16>(a, rows, s, r, c);
        case WeightFormat::int8: return dot_rows_avx2_of<WeightFormat::int8>(a, rows, s, r, c);
        case WeightFormat::int4: return dot_rows_avx2_of<WeightFormat::int4>(a, rows, s, r, c);
        case WeightFormat::fp8: return dot_rows_avx2_of<WeightFormat::fp8>(a, rows, s, r, c);
    }
}

// silu(g) * u on 16 values, one at a time (the AVX2 path's; silu_mul is AVX-512), with
// silu_mul's clamp of -g to [-87, 88], so both paths give a large negative gate the same tiny
// product rather than 0 on one of them.
void silu_mul_scalar(const float* g, const float* u, float* h) {
    for (size_t i = 0; i < kTileRows * kTileCols; ++i) {
        h[i] = g[i] / (1.0f + std::exp(std::clamp(-g[i], -87.0f, 88.0f))) * u[i];
    }
}

// silu(g) * u on 16 lanes. e^-g with a Cody-Waite reduction and a degree-7
// Taylor series (relative error near 1e-7, an f32 ulp), so f32 weights keep
// f32 accuracy.
NUMAOV_TARGET_AVX512_BF16 void silu_mul(const float* g, const float* u, float* h) {
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(g)),
                                                 _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(p, n);  // e^-g
    const __m512 gv = _mm512_loadu_ps(g);
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(h, _mm512_mul_ps(silu, _mm512_loadu_ps(u)));
}

void store(float* dst, float v) { *dst = v; }
void store(uint16_t* dst, float v) { *dst = to_bf16(v); }

// The (row, slot) pairs counting-sorted by expert.
struct Routing {
    std::vector<size_t> row;    // token row of each sorted pair
    std::vector<float> weight;  // its routing weight
    struct Hit {
        size_t expert, start, count;
    };
    std::vector<Hit> hits;  // experts that got pairs, in expert order
};

Routing route(const Tensors& t, const Shape& s) {
    const size_t pairs = s.rows * s.top_k;
    std::vector<size_t> expert_of(pairs), count(s.experts, 0);
    for (size_t p = 0; p < pairs; ++p) {
        const int64_t e = t.ids_int64 ? static_cast<const int64_t*>(t.ids)[p] : static_cast<const int32_t*>(t.ids)[p];
        if (e < 0 || e >= int64_t(s.experts)) {
            std::ostringstream msg;
            msg << "expert id " << e << " at row " << p / s.top_k << ", slot " << p % s.top_k
                << "; expected 0 .. " << s.experts - 1 << " (the model's " << s.experts << " experts)";
            throw std::invalid_argument(msg.str());
        }
        expert_of[p] = size_t(e);
        ++count[size_t(e)];
    }
    Routing r;
    r.row.resize(pairs);
    r.weight.resize(pairs);
    std::vector<size_t> next(s.experts);
    for (size_t e = 0, start = 0; e < s.experts; start += count[e], ++e) {
        next[e] = start;
        if (count[e]) r.hits.push_back({e, start, count[e]});
    }
    for (size_t p = 0; p < pairs; ++p) {
        const size_t at = next[expert_of[p]]++;
        r.row[at] = p / s.top_k;
        r.weight[at] = t.weights[p];
    }
    return r;
}

// Columns per work item: small enough that every thread gets about four items,
// a multiple of `step` (the micro-tile, or the AMX weight blocks), at most 64
// (one item's weights stay in L2).
size_t block_columns(size_t columns, size_t groups, int threads, size_t step) {
    const size_t want = (columns * groups + size_t(threads) * 4 - 1) / (size_t(threads) * 4);
    const size_t rounded = (want + step - 1) / step * step;
    return std::clamp(rounded, step, size_t(64));
}

// The kernel's scratch buffers: 64-byte aligned (tile loads and stores) and
// left uninitialised, since every value is written before it is read (zeroing
// them was 5.6% of a 1,024-row call's profile; benchmarks/RESULTS.md).
template <class T>
struct UninitialisedAligned64 : amx::Aligned64<T> {
    template <class U>
    struct rebind {
        using other = UninitialisedAligned64<U>;
    };
    UninitialisedAligned64() = default;
    template <class U> UninitialisedAligned64(const UninitialisedAligned64<U>&) {}
    template <class U> void construct(U*) noexcept {}
};
template <class T>
using Scratch = std::vector<T, UninitialisedAligned64<T>>;

// fn(n) for each of `rows` rows of `width` values: on this thread for a few rows (decode: a
// fork and join of the threads would cost more than the rows), else across the threads.
template <class Fn>
void for_rows(size_t rows, size_t width, const Fn& fn) {
    constexpr size_t kSerialValues = 1 << 15;
    if (rows * width <= kSerialValues) {
        for (size_t n = 0; n < rows; ++n) fn(n);
    } else {
        ov::parallel_for(rows, fn);
    }
}

// -- int8 weights against int8 activations (AVX512-VNNI) -------------------------------------
//
// int8 weights in a bf16 model (NUMAOV_MOE_VNNI, int8_activations) multiply activations
// quantized per row in groups of kActGroup values, as OpenVINO's CPU plugin quantizes the
// activations of its int8-compressed FullyConnected (DYNAMIC_QUANTIZATION_GROUP_SIZE, 32 by
// default): q = rint(x * 127 / max|x|) in [-127, 127], the group's scale max|x| / 127. One
// vpdpbusd then takes 64 products in int32, exact, where the f32 path widens each weight
// (two conversions) and spends one FMA per 16 products and row: that path is bound by those
// instructions from two rows per expert (its int8 prefill ran at 39-55% of the f32 FMA peak,
// its projections of 2+ rows at 0.31-0.54x OpenVINO's; benchmarks/RESULTS.md). vpdpbusd
// takes one unsigned operand: the weights, moved to w + 128 by one xor per 64 (shared by the
// tile's rows), so a group's int32 sum carries 128 * sum(q) extra, which each row's quantizer
// stored negated beside the group's scale and the sum starts from. Each group's exact int32
// sum is converted once and added times the activations' scale (and the weights' group
// scale) into f32 sums.
constexpr size_t kActGroup = 64;
// Groups whose largest magnitude is at most this (127 / FLT_MAX) quantize to zeros.
constexpr float kSmallestQuantized = 127.0f / 3.4028234663852886e38f;

// (avx512bf16 too so the AVX-512 helpers inline; these functions run no bf16 instruction, so
// a CPU with VNNI and without BF16 runs them.)
#define NUMAOV_TARGET_AVX512_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

// A quantized row of K values: ceil(K / 64) groups of 64 int8 values (zeros past K), then the
// groups' f32 scales, then their int32 starting sums (-128 * the group's sum of q), padded to
// 64 bytes so every row starts on a line.
size_t quantized_groups(size_t K) { return (K + kActGroup - 1) / kActGroup; }
size_t quantized_row_bytes(size_t K) {
    const size_t groups = quantized_groups(K);
    return (groups * kActGroup + 8 * groups + 63) / 64 * 64;
}

// One row of K values (f32, or bf16 when In is uint16_t) quantized into q (quantized_row_bytes).
template <class In>
NUMAOV_TARGET_AVX512_VNNI void quantize_row(const In* x, size_t K, uint8_t* q) {
    const size_t groups = quantized_groups(K);
    float* scale = reinterpret_cast<float*>(q + groups * kActGroup);
    int32_t* start = reinterpret_cast<int32_t*>(scale + groups);
    for (size_t g = 0; g < groups; ++g) {
        const size_t k0 = g * kActGroup;
        __m512 v[kActGroup / 16];
        __m512 amax = _mm512_setzero_ps();
        NUMAOV_UNROLL for (size_t i = 0; i < kActGroup / 16; ++i) {
            const size_t k = k0 + 16 * i;
            const __mmask16 mask = k >= K ? 0 : K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
            if constexpr (std::is_same_v<In, uint16_t>) {
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + k)), 16));
            } else {
                v[i] = _mm512_maskz_loadu_ps(mask, x + k);
            }
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        }
        const float largest = _mm512_reduce_max_ps(amax);
        // a group too small for 127 / largest to be finite quantizes to zeros
        const __m512 inverse = _mm512_set1_ps(largest > kSmallestQuantized ? 127.0f / largest : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        NUMAOV_UNROLL for (size_t i = 0; i < kActGroup / 16; ++i) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));  // to nearest even
            sum = _mm512_add_epi32(sum, qi);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * i), _mm512_cvtsepi32_epi8(qi));
        }
        scale[g] = largest / 127.0f;
        start[g] = -128 * _mm512_reduce_add_epi32(sum);
    }
}

// `rows` rows of `width` values of x (f32, or bf16 when x_bf16) quantized into `out`.
void quantize_rows(const void* x, bool x_bf16, size_t rows, size_t width, Scratch<uint8_t>& out) {
    const size_t stride = quantized_row_bytes(width);
    out.resize(rows * stride);
    for_rows(rows, width, [&](size_t n) {
        if (x_bf16) {
            quantize_row(static_cast<const uint16_t*>(x) + n * width, width, out.data() + n * stride);
        } else {
            quantize_row(static_cast<const float*>(x) + n * width, width, out.data() + n * stride);
        }
    });
}

// 64 int4 weights (32 bytes at p; `mask` over those bytes) as their stored nibbles q + 8 in
// value order (a block of 32 values is 16 bytes, low nibbles first): values 0 .. 15, the
// unsigned operand of vpdpbusd as they are, so an int4 group's sum carries 8 * sum(q) extra
// (the quantizer's starting sum divided by 16).
NUMAOV_TARGET_AVX512_VNNI NUMAOV_INLINE __m512i int4_nibbles(const uint8_t* p, __mmask32 mask) {
    const __m256i bytes = _mm256_maskz_loadu_epi8(mask, p);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(bytes, low4);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);  // l0 l1 h0 h1
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));                 // l0 h0 l1 h1
}

// Dot products of M quantized rows a[m] with kTileCols int8 (or int4, kInt4) weight rows over
// K values, the weights' scales in groups of `group` values (K, or a multiple of kActGroup),
// into c as dot_tile_bytes does. One iteration takes 64 values of each weight row (masked
// past K).
template <int M, bool kInt4>
NUMAOV_TARGET_AVX512_VNNI void dot_tile_vnni(const uint8_t* const* a_in, const uint8_t* const* w_in,
                                             const float* const* scale, size_t K, size_t group,
                                             const uint8_t* next, float* c) {
    const uint8_t* a[M];
    const uint8_t* w[kTileCols];
    local_rows<M>(a_in, w_in, a, w);
    const size_t groups = quantized_groups(K);
    const float* a_scale[M];
    const int32_t* a_start[M];
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        a_scale[m] = reinterpret_cast<const float*>(a[m] + groups * kActGroup);
        a_start[m] = reinterpret_cast<const int32_t*>(a_scale[m] + groups);
    }
    const bool grouped = group < K;
    const __m512i offset = _mm512_set1_epi8(char(0x80));
    __m512 acc[M][kTileCols];
    zero_tile<M>(acc);
    __m512 ws[kTileCols];
    size_t wg = 0, left = group;  // the weights' scale group and its values still to come
    NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) ws[n] = _mm512_set1_ps(scale[n][0]);
    for (size_t g = 0, k = 0; k < K; ++g, k += kActGroup) {
        __m512i wv[kTileCols];
        if constexpr (kInt4) {  // 32 bytes a row: a line every other step
            if (k % 128 == 0) prefetch_next_block(next, k / 2);
            const __mmask32 mask = K - k >= 64 ? ~__mmask32(0) : (__mmask32(1) << ((K - k) / 2)) - 1;
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) wv[n] = int4_nibbles(w[n] + k / 2, mask);
        } else {
            prefetch_next_block(next, k);
            const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
                wv[n] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w[n] + k), offset);
            }
        }
        NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
            const __m512i av = _mm512_load_si512(a[m] + k);
            const __m512i start =
                _mm512_maskz_set1_epi32(__mmask16(1), kInt4 ? a_start[m][g] / 16 : a_start[m][g]);
            const __m512 sa = _mm512_set1_ps(a_scale[m][g]);
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
                const __m512 sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wv[n], av));
                acc[m][n] = _mm512_fmadd_ps(sum, grouped ? _mm512_mul_ps(sa, ws[n]) : sa, acc[m][n]);
            }
        }
        if (grouped && (left -= kActGroup) == 0 && k + kActGroup < K) {
            ++wg;
            left = group;
            NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) ws[n] = _mm512_set1_ps(scale[n][wg]);
        }
    }
    NUMAOV_UNROLL for (int m = 0; m < M; ++m) {
        NUMAOV_UNROLL for (size_t n = 0; n < kTileCols; ++n) {
            const float sum = _mm512_reduce_add_ps(acc[m][n]);
            c[m * kTileCols + n] = grouped ? sum : sum * scale[n][0];
        }
    }
}

// dot_rows for quantized activation rows against an int8 or int4 stack.
void dot_rows_vnni(const uint8_t* const* a, size_t rows, const Stack& s, const size_t* r, float* c) {
    std::fill(c, c + kTileRows * kTileCols, 0.0f);
    const uint8_t* w[kTileCols];
    const float* scale[kTileCols];
    for (size_t n = 0; n < kTileCols; ++n) {
        w[n] = s.row(0, r[n]);
        scale[n] = s.row_scale(0, r[n]);
    }
    const uint8_t* next = s.streamed ? w[0] + kTileCols * s.row_bytes() : nullptr;
    const size_t group = s.K / s.groups;
    if (s.format == WeightFormat::int4) {
        switch (rows) {
            case 1: return dot_tile_vnni<1, true>(a, w, scale, s.K, group, next, c);
            case 2: return dot_tile_vnni<2, true>(a, w, scale, s.K, group, next, c);
            case 3: return dot_tile_vnni<3, true>(a, w, scale, s.K, group, next, c);
            default: return dot_tile_vnni<4, true>(a, w, scale, s.K, group, next, c);
        }
    }
    switch (rows) {
        case 1: return dot_tile_vnni<1, false>(a, w, scale, s.K, group, next, c);
        case 2: return dot_tile_vnni<2, false>(a, w, scale, s.K, group, next, c);
        case 3: return dot_tile_vnni<3, false>(a, w, scale, s.K, group, next, c);
        default: return dot_tile_vnni<4, false>(a, w, scale, s.K, group, next, c);
    }
}

// Experts of many rows (kOuterMinRows and more) take their quantized rows in 16-row blocks,
// as the bf16 outer products do: a block is the rows' quads, [ceil(K / 64) * 16][16] words
// (word (p, m): values 4p .. 4p + 3 of row m), then per activation group the 16 rows' scales
// and the 16 rows' starting sums (zero for rows past the block's count).
size_t quad_block_words(size_t K) {
    const size_t groups = quantized_groups(K);
    return groups * kActGroup / 4 * 16 + 2 * groups * 16;
}

// `count` (<= 16) quantized rows (quantize_row) of K values as one block.
void pack_quads(const uint8_t* const* rows, size_t count, size_t K, uint32_t* block) {
    const size_t groups = quantized_groups(K), quads = groups * kActGroup / 4;
    std::fill(block, block + quad_block_words(K), 0u);
    for (size_t m = 0; m < count; ++m) {
        const uint8_t* row = rows[m];
        for (size_t p = 0; p < quads; ++p) std::memcpy(&block[p * 16 + m], row + 4 * p, 4);
        const uint32_t* tail = reinterpret_cast<const uint32_t*>(row + groups * kActGroup);
        for (size_t g = 0; g < 2 * groups; ++g) block[quads * 16 + g * 16 + m] = tail[g];
    }
}

// `count` (<= 16) int8 weight rows of K values from `first` (one after the other) with their
// scales (`groups` per row); count 0 marks an unused block.
struct Int8Block {
    const uint8_t* first;
    const float* scale;
    size_t count, groups;
    bool nibbles = false;  // int4 rows unpacked to their nibbles q + 8 (unpack_int4_rows)
};

// Four weight bytes read as one word wherever they lie (GCC: any alignment, any aliasing).
typedef int32_t UnalignedInt32 __attribute__((aligned(1), may_alias));

// Four int8 weight rows w[r] against one or two blocks of quads (`act`, blocks `words`
// apart): c[b] + 16 r gets weight row r's sums over the block's 16 rows. Each step broadcasts
// four weights of a row (moved to w + 128, as dot_tile_vnni does) against the block's quads:
// one vpdpbusd per 64 products, each activation row's sum in its own lane; each activation
// group's int32 sums start from the rows' starting sums and are scaled into f32 at its end.
// The last quad of a row whose K is not a multiple of 4 is copied into a zero-padded word, and
// quads past K are zeros (the activations there are zeros too), so nothing is read past a
// row's end. `nibbles`: int4 rows unpacked to q + 8 (unpack_int4_rows), unsigned already: no
// xor, and the sums start from a 16th of the starting sums (8, not 128, times sum(q)).
template <int B>
NUMAOV_TARGET_AVX512_VNNI void outer_rows_int8(const uint8_t* const (&w)[4], const float* const (&scale)[4],
                                               size_t weight_group, bool nibbles, const uint32_t* act,
                                               size_t words, size_t K, float* const (&c)[B]) {
    const size_t groups = quantized_groups(K), quads = groups * kActGroup / 4;
    const bool grouped = weight_group < K;
    const float* a_scale = reinterpret_cast<const float*>(act + quads * 16);
    const int32_t* a_start = reinterpret_cast<const int32_t*>(act + quads * 16 + groups * 16);
    __m512 acc[4][B];
    NUMAOV_UNROLL for (int r = 0; r < 4; ++r) {
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    }
    const size_t whole = K / 4;  // quads read in place
    const __m512i offset = _mm512_set1_epi8(char(nibbles ? 0 : 0x80));
    const int shift = nibbles ? 4 : 0;  // the starts are multiples of 128
    for (size_t g = 0; g < groups; ++g) {
        __m512i sums[4][B];
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) {
            const __m512i start = _mm512_srai_epi32(_mm512_load_si512(a_start + b * words + g * 16), shift);
            NUMAOV_UNROLL for (int r = 0; r < 4; ++r) sums[r][b] = start;
        }
        const size_t p1 = std::min(quads, (g + 1) * kActGroup / 4);
        for (size_t p = g * kActGroup / 4; p < p1; ++p) {
            __m512i a[B];
            NUMAOV_UNROLL for (int b = 0; b < B; ++b) a[b] = _mm512_load_si512(act + b * words + p * 16);
            NUMAOV_UNROLL for (int r = 0; r < 4; ++r) {
                __m512i wq;
                if (p < whole) {  // a broadcast load: no trip through a general register
                    wq = _mm512_set1_epi32(*reinterpret_cast<const UnalignedInt32*>(w[r] + 4 * p));
                } else {
                    uint32_t quad = 0;
                    if (4 * p < K) std::memcpy(&quad, w[r] + 4 * p, K - 4 * p);
                    wq = _mm512_set1_epi32(int(quad));
                }
                wq = _mm512_xor_si512(wq, offset);
                NUMAOV_UNROLL for (int b = 0; b < B; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], wq, a[b]);
            }
        }
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) {
            const __m512 sa = _mm512_load_ps(a_scale + b * words + g * 16);
            NUMAOV_UNROLL for (int r = 0; r < 4; ++r) {
                const __m512 s = grouped ? _mm512_mul_ps(sa, _mm512_set1_ps(scale[r][g * kActGroup / weight_group])) : sa;
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][b]), s, acc[r][b]);
            }
        }
    }
    NUMAOV_UNROLL for (int r = 0; r < 4; ++r) {
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) {
            const __m512 out = grouped ? acc[r][b] : _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale[r][0]));
            _mm512_store_ps(c[b] + 16 * r, out);
        }
    }
}

// outer_products (the bf16 one) for int8 weight blocks against blocks of quads: the same
// result tiles (rows of a weight block past its count hold a repeat of its last, unused).
void outer_products_int8(const Int8Block (&w)[2], const uint32_t* panel, size_t blocks, size_t K, float* c) {
    constexpr size_t kResult = amx_tiles::kTile * amx_tiles::kTile;
    const size_t words = quad_block_words(K);
    for (size_t a = 0; a < 2; ++a) {
        for (size_t r0 = 0; r0 < w[a].count; r0 += 4) {
            const uint8_t* rows[4];
            const float* scales[4];
            for (size_t r = 0; r < 4; ++r) {  // a group's rows past the count repeat its last
                const size_t row = std::min(r0 + r, w[a].count - 1);
                rows[r] = w[a].first + row * K;
                scales[r] = w[a].scale + row * w[a].groups;
            }
            float* const tiles[2] = {c + 2 * a * kResult + 16 * r0, c + (2 * a + 1) * kResult + 16 * r0};
            if (blocks == 2) {
                outer_rows_int8<2>(rows, scales, K / w[a].groups, w[a].nibbles, panel, words, K, tiles);
            } else {
                float* const one[1] = {tiles[0]};
                outer_rows_int8<1>(rows, scales, K / w[a].groups, w[a].nibbles, panel, words, K, one);
            }
        }
    }
}

// `count` int4 rows of `s` (from row r0 of `expert`) as their nibbles q + 8, one byte a value,
// into `out` (rows of s.K bytes), for the outer products.
NUMAOV_TARGET_AVX512_VNNI void unpack_int4_rows(const Stack& s, size_t expert, size_t r0, size_t count,
                                                uint8_t* out) {
    const size_t K = s.K;
    for (size_t r = 0; r < count; ++r) {
        const uint8_t* row = s.row(expert, r0 + r);
        for (size_t k = 0; k < K; k += 64) {
            const __mmask32 mask = K - k >= 64 ? ~__mmask32(0) : (__mmask32(1) << ((K - k) / 2)) - 1;
            const __mmask64 values = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
            _mm512_mask_storeu_epi8(out + r * K + k, values, int4_nibbles(row + k / 2, mask));
        }
    }
}

// `count` fp8 rows of `s` (from row r0 of `expert`) as bf16 rows of s.K values into `out`:
// each weight times its group's scale in f32, rounded to bf16 (nearest even), as PyTorch
// dequantizes FP8 weights for a bf16 model (`w.float() * scale`, then `.bfloat16()`; the
// f32 product is the same: widen_fp8's 2^-8 is undone exactly by kFp8Unit in the scale).
// The rows are read from memory once, so each line of a row requests the same line of the
// block after them (the rows the next call takes), as the tiles do (into L1 here: the
// buffer it fills is all this thread holds beside them): without it the
// loads waited on memory and the bf16 tiles of 8 rows per expert ran at 44 GMAC/s, under
// half the exact path's 98 (benchmarks/RESULTS.md).
NUMAOV_TARGET_AVX512_BF16 void dequantize_fp8_rows(const Stack& s, size_t expert, size_t r0, size_t count,
                                                   uint16_t* out) {
    const size_t K = s.K, group = K / s.groups;
    for (size_t r = 0; r < count; ++r) {
        const uint8_t* w = s.row(expert, r0 + r);
        const uint8_t* next = w + count * s.row_bytes();  // harmless past the stack: never faults
        const float* scale = s.row_scale(expert, r0 + r);
        uint16_t* dst = out + r * K;
        for (size_t g = 0, k0 = 0; k0 < K; ++g, k0 += group) {
            const __m512 sv = _mm512_set1_ps(scale[g] * kFp8Unit);
            for (size_t k = k0; k < k0 + group; k += 16) {
                if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T0);
                const __mmask16 mask = k0 + group - k >= 16 ? __mmask16(0xFFFF)
                                                            : __mmask16((1u << (k0 + group - k)) - 1);
                const __m512 v = _mm512_mul_ps(widen_fp8(_mm_maskz_loadu_epi8(mask, w + k)), sv);
                _mm256_mask_storeu_epi16(dst + k, mask, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

// The weight rows one thread's tiles read, as a stack of one expert's rows: the stack's own
// rows in place, except that fp8 rows read by the bf16 tiles (run<uint16_t>) are dequantized
// into this thread's buffer first. `slot` (0 or 1) keeps two blocks read together apart (gate
// and up, or two blocks of down).
template <class T>
class TileRows {
public:
    Stack rows(const Stack& s, size_t expert, size_t r0, size_t count, int slot) {
        if constexpr (std::is_same_v<T, uint16_t>) {
            if (s.format == WeightFormat::fp8) {
                auto& buffer = buffers_[slot];
                if (buffer.size() < count * s.K) buffer.resize(count * s.K);
                dequantize_fp8_rows(s, expert, r0, count, buffer.data());
                return {buffer.data(), nullptr, count, s.K, 1, WeightFormat::bf16, false};
            }
        }
        return s.slice(expert, r0, count);
    }
    // The first of those rows as bf16 (for the AMX tiles' weight blocks).
    const uint16_t* bf16(const Stack& s, size_t expert, size_t r0, size_t count, int slot) {
        return static_cast<const uint16_t*>(rows(s, expert, r0, count, slot).data);
    }
    // Those rows as a weight block of the panel products (count 0: an unused block): bf16 rows
    // (AMX tiles, outer products), or int8 rows in place with their scales (quantized rows).
    auto block(const Stack& s, size_t expert, size_t r0, size_t count, int slot) {
        if constexpr (std::is_same_v<T, uint8_t>) {
            if (!count) return Int8Block{nullptr, nullptr, 0, s.groups};
            if (s.format == WeightFormat::int4) {
                auto& buffer = nibbles_[slot];
                if (buffer.size() < count * s.K) buffer.resize(count * s.K);
                unpack_int4_rows(s, expert, r0, count, buffer.data());
                return Int8Block{buffer.data(), s.row_scale(expert, r0), count, s.groups, true};
            }
            return Int8Block{s.row(expert, r0), s.row_scale(expert, r0), count, s.groups};
        } else {
            return amx_tiles::WeightBlock{count ? bf16(s, expert, r0, count, slot) : nullptr, count};
        }
    }

private:
    Scratch<uint16_t> buffers_[2];
    Scratch<uint8_t> nibbles_[2];
};

// NUMAOV_MOE_AMX and NUMAOV_MOE_VNNI: "auto" (unset), "off" or "always".
enum class KernelSetting { automatic, off, always };

KernelSetting auto_off_always(const char* variable) {
    const char* value = std::getenv(variable);
    const std::string v = value ? value : "";
    if (v.empty() || v == "auto") return KernelSetting::automatic;
    if (v == "off") return KernelSetting::off;
    if (v == "always") return KernelSetting::always;
    throw std::invalid_argument(std::string(variable) + "='" + v + "'; expected auto, off or always");
}

KernelSetting amx_setting() { return auto_off_always("NUMAOV_MOE_AMX"); }

// The fewest rows a bf16 expert needs to run on AMX tiles in this call; SIZE_MAX: none does.
size_t amx_min_rows() {
    switch (amx_setting()) {
        case KernelSetting::off: return SIZE_MAX;
        case KernelSetting::always:
            if (!amx::usable()) {
                throw std::runtime_error("NUMAOV_MOE_AMX=always, but AMX tiles are not usable here: " +
                                         amx::unavailable_reason());
            }
            return 1;
        default: return amx::usable() ? kAmxMinRows : SIZE_MAX;
    }
}

// How experts of many rows run in this call: against their activations packed in 16-row
// blocks (moe_amx.hpp's pairs layout), on AMX tiles where usable (and NUMAOV_MOE_AMX allows),
// else on AVX512-BF16 outer products; from min_rows rows (SIZE_MAX: none: f32 activations,
// or AVX2).
struct PanelTiles {
    size_t min_rows;
    bool amx;
};

template <class T>
PanelTiles panel_tiles(bool avx2) {
    if (std::is_same_v<T, uint8_t>) return {kOuterMinRows, false};  // AVX512-VNNI (int8_activations)
    if (!std::is_same_v<T, uint16_t> || avx2) return {SIZE_MAX, false};
    const size_t amx_rows = amx_min_rows();
    if (amx_rows != SIZE_MAX) return {amx_rows, true};
    return {kOuterMinRows, false};
}

// Eight weight rows w[r] (K bf16 values each) against one or two 16-row blocks of packed
// activations (`act`, blocks `words` apart): c[b] + 16 r gets weight row r's sums over the 16
// activation rows of block b. Each step broadcasts a weight pair (w[2p], w[2p+1]) against the
// block's pairs (a[m][2p], a[m][2p+1]): one vdpbf16ps per 16 products, each activation row's
// sum in its own lane, so no horizontal sums, and a weight pair is read once per 16 or 32
// rows. A K of odd length ends on a pair whose second weight is 0 (the panel's is too).
template <int B>
NUMAOV_TARGET_AVX512_BF16 NUMAOV_INLINE void outer_step(__m512 (&acc)[8][B], const uint32_t* act, size_t words,
                                                        size_t p, const uint32_t (&pair)[8]) {
    __m512i a[B];
    NUMAOV_UNROLL for (int b = 0; b < B; ++b) a[b] = _mm512_load_si512(act + b * words + p * 16);
    NUMAOV_UNROLL for (int r = 0; r < 8; ++r) {
        const __m512i wb = _mm512_set1_epi32(int(pair[r]));
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) {
            acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)a[b], (__m512bh)wb);
        }
    }
}

template <int B>
NUMAOV_TARGET_AVX512_BF16 void outer_product_rows(const uint16_t* const (&w)[8], const uint32_t* act,
                                                  size_t words, size_t K, float* const (&c)[B]) {
    __m512 acc[8][B];
    NUMAOV_UNROLL for (int r = 0; r < 8; ++r) {
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    }
    const size_t pairs = K / 2;
    for (size_t p = 0; p < pairs; ++p) {
        uint32_t pair[8];
        NUMAOV_UNROLL for (int r = 0; r < 8; ++r) std::memcpy(&pair[r], w[r] + 2 * p, 4);
        outer_step<B>(acc, act, words, p, pair);
    }
    if (K % 2) {
        uint32_t pair[8];
        NUMAOV_UNROLL for (int r = 0; r < 8; ++r) pair[r] = w[r][K - 1];
        outer_step<B>(acc, act, words, pairs, pair);
    }
    NUMAOV_UNROLL for (int r = 0; r < 8; ++r) {
        NUMAOV_UNROLL for (int b = 0; b < B; ++b) _mm512_store_ps(c[b] + 16 * r, acc[r][b]);
    }
}

// amx_tiles::products on AVX512-BF16 (the same operands and result tiles; rows of a weight
// block past its count are not written), for CPUs without AMX.
NUMAOV_TARGET_AVX512_BF16 void outer_products(const amx_tiles::WeightBlock (&w)[2], const uint32_t* panel,
                                              size_t blocks, size_t K, float* c) {
    constexpr size_t kResult = amx_tiles::kTile * amx_tiles::kTile;
    const size_t words = amx_tiles::block_words(K);
    for (size_t a = 0; a < 2; ++a) {
        for (size_t r0 = 0; r0 < w[a].count; r0 += 8) {
            const uint16_t* rows[8];
            // a group's rows past the count repeat its last row (their sums are not used)
            for (size_t r = 0; r < 8; ++r) rows[r] = w[a].first + std::min(r0 + r, w[a].count - 1) * K;
            float* const tiles[2] = {c + 2 * a * kResult + 16 * r0, c + (2 * a + 1) * kResult + 16 * r0};
            if (blocks == 2) {
                outer_product_rows<2>(rows, panel, words, K, tiles);
            } else {
                float* const one[1] = {tiles[0]};
                outer_product_rows<1>(rows, panel, words, K, one);
            }
        }
    }
}

// The product of one or two weight blocks and one or two blocks of packed activations, on
// AMX tiles (the calling thread holds an amx::TileSession) or AVX512-BF16 (PanelTiles).
void panel_products(bool amx, const amx_tiles::WeightBlock (&w)[2], const uint32_t* panel, size_t blocks, size_t K,
                    float* c) {
    if (amx) return amx_tiles::products(w, panel, blocks, K, c);
    outer_products(w, panel, blocks, K, c);
}

void panel_products(bool, const Int8Block (&w)[2], const uint32_t* panel, size_t blocks, size_t K, float* c) {
    outer_products_int8(w, panel, blocks, K, c);
}

// The experts on packed activations (AMX tiles or outer products, PanelTiles): which hits, and
// where their packed activations start in one buffer, in 16-row blocks of T's layout (bf16,
// uint16_t: moe_amx.hpp's pairs; quantized rows, uint8_t: quads, pack_quads).
template <class T>
struct PanelPlan {
    std::vector<size_t> panel_at;  // per hit; SIZE_MAX: the hit runs on the micro-tiles
    size_t words = 0;
    size_t block_words;  // of one 16-row block
    bool any = false;

    PanelPlan(const Routing& routing, size_t min_rows, size_t K)
        : block_words(std::is_same_v<T, uint8_t> ? quad_block_words(K) : amx_tiles::block_words(K)) {
        for (const auto& hit : routing.hits) {
            if (hit.count >= min_rows) {
                panel_at.push_back(words);
                words += (hit.count + amx_tiles::kTile - 1) / amx_tiles::kTile * block_words;
                any = true;
            } else {
                panel_at.push_back(SIZE_MAX);
            }
        }
    }
    bool uses(size_t hit) const { return panel_at[hit] != SIZE_MAX; }

    // Each such hit's rows (rows_of(hit, m) for its m-th pair) packed into `panels`.
    template <class RowsOf>
    void pack(const Routing& routing, size_t K, Scratch<uint32_t>& panels, RowsOf rows_of) const {
        if (!any) return;
        panels.resize(words);
        // one work item per 16-row block, so one hit of many rows (a dense linear's
        // prefill) is packed by every thread
        std::vector<std::pair<size_t, size_t>> blocks;  // (hit, its block)
        for (size_t h = 0; h < routing.hits.size(); ++h) {
            if (!uses(h)) continue;
            for (size_t b = 0; b * amx_tiles::kTile < routing.hits[h].count; ++b) blocks.emplace_back(h, b);
        }
        ov::parallel_for(blocks.size(), [&](size_t i) {
            const auto [h, b] = blocks[i];
            const auto& hit = routing.hits[h];
            const size_t first = b * amx_tiles::kTile, count = std::min(amx_tiles::kTile, hit.count - first);
            const T* rows[amx_tiles::kTile];
            for (size_t m = 0; m < count; ++m) rows[m] = rows_of(hit, first + m);
            uint32_t* block = panels.data() + panel_at[h] + b * block_words;
            if constexpr (std::is_same_v<T, uint8_t>) {
                pack_quads(rows, count, K, block);
            } else {
                amx_tiles::pack_panel(rows, count, K, block);
            }
        });
    }
};

// A 16-row block of an AMX hit's pairs: the first pair (index into the sorted
// pairs) and how many of its 16 rows are real.
struct PairBlock {
    size_t first, count;
};

PairBlock pair_block(const Routing::Hit& hit, size_t block) {
    const size_t first = block * amx_tiles::kTile;
    return {hit.start + first, std::min(amx_tiles::kTile, hit.count - first)};
}

// silu(gate) * up of one AMX block into the block's rows of `act`, bf16 or f32
// (rows of I values, `act` already at the block's first column), `cols` columns.
template <class Act>
NUMAOV_TARGET_AVX512_BF16 void store_gate_up_block(const float* gate, const float* up, size_t cols, PairBlock pb,
                                                   Act* act, size_t I) {
    constexpr size_t kTile = amx_tiles::kTile;
    alignas(64) float g[kTile * kTile], u[kTile * kTile], h[kTile];
    amx_tiles::transpose_tile(gate, g);
    amx_tiles::transpose_tile(up, u);
    const __mmask16 mask = __mmask16((1u << cols) - 1);
    for (size_t m = 0; m < pb.count; ++m) {
        silu_mul(g + m * kTile, u + m * kTile, h);
        if constexpr (std::is_same_v<Act, float>) {
            _mm512_mask_storeu_ps(act + (pb.first + m) * I, mask, _mm512_load_ps(h));
        } else {
            _mm256_mask_storeu_epi16(act + (pb.first + m) * I, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(h)));
        }
    }
}

// out[row] += weight * (the block's down products) for each pair of one AMX
// block; `out` is at the block's first column, rows of H values.
NUMAOV_TARGET_AVX512_BF16 void add_down_block(const float* tile, size_t cols, PairBlock pb, const Routing& routing,
                                              float* out, size_t H) {
    constexpr size_t kTile = amx_tiles::kTile;
    alignas(64) float y[kTile * kTile];
    amx_tiles::transpose_tile(tile, y);
    const __mmask16 mask = __mmask16((1u << cols) - 1);
    for (size_t m = 0; m < pb.count; ++m) {
        float* dst = out + routing.row[pb.first + m] * H;
        const __m512 sum = _mm512_fmadd_ps(_mm512_set1_ps(routing.weight[pb.first + m]), _mm512_load_ps(y + m * kTile),
                                           _mm512_maskz_loadu_ps(mask, dst));
        _mm512_mask_storeu_ps(dst, mask, sum);
    }
}

// `rows` rows of `width` values of x (f32, or bf16 when x_bf16) in the tiles' type T: x
// itself when it already is, else converted into `converted` (T = uint8_t: quantized rows).
template <class T>
const T* activations_as(const void* x, bool x_bf16, size_t rows, size_t width, Scratch<T>& converted) {
    constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
    if constexpr (std::is_same_v<T, uint8_t>) {
        quantize_rows(x, x_bf16, rows, width, converted);
        return converted.data();
    }
    if (x_bf16 == kBf16) return static_cast<const T*>(x);
    converted.resize(rows * width);
    for_rows(rows, width, [&](size_t n) {
        for (size_t h = 0; h < width; ++h) {
            if constexpr (kBf16) {
                converted[n * width + h] = to_bf16(static_cast<const float*>(x)[n * width + h]);
            } else {
                converted[n * width + h] = T(from_bf16(static_cast<const uint16_t*>(x)[n * width + h]));
            }
        }
    });
    return converted.data();
}

// Row n of rows of K values in the tiles' type T (uint8_t: quantized rows).
template <class T>
const T* row_at(const T* rows, size_t n, size_t K) {
    if constexpr (std::is_same_v<T, uint8_t>) {
        return rows + n * quantized_row_bytes(K);
    } else {
        return rows + n * K;
    }
}

// One micro-tile of `rows` rows against weight rows r of a one-expert stack, on AVX2 or AVX-512
// (quantized rows: on AVX512-VNNI).
template <class T>
void dot_micro_tile(bool avx2, const T* const* a, size_t rows, const Stack& w, const size_t* r, float* c) {
    if constexpr (std::is_same_v<T, uint8_t>) {
        dot_rows_vnni(a, rows, w, r, c);
    } else if (avx2) {
        dot_rows_avx2(a, rows, w, r, c);
    } else {
        dot_rows(a, rows, w, r, c);
    }
}

// The second pass (the down projection), shared with the dense linear:
// out[routing.row[p]] = sum over the sorted pairs p of routing.weight[p] * (w[e] . act[p]),
// e the pair's expert; act holds a row of w.K values per pair, out `rows` f32 rows of w.rows
// values, every one of them written. Work items are blocks of output columns, so no two
// threads write one value.
template <class T>
void down_pass(const Stack& w, const T* act, const Routing& routing, size_t rows, float* out, bool avx2) {
    const size_t H = w.rows, I = w.K;
    const int threads = parallel_get_max_threads();
    constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
    constexpr size_t kTile = amx_tiles::kTile, kResult = kTile * kTile;
    const PanelTiles kind = panel_tiles<T>(avx2);
    const PanelPlan<T> down_plan(routing, kind.min_rows, I);
    Scratch<uint32_t> act_panels;
    if constexpr (kBf16 || std::is_same_v<T, uint8_t>) {
        down_plan.pack(routing, I, act_panels,
                       [&](const Routing::Hit& hit, size_t m) { return row_at(act, hit.start + m, I); });
    }
    const size_t bh = block_columns(H, 1, threads, down_plan.any ? 2 * kTile : kTileCols);
    const size_t h_blocks = (H + bh - 1) / bh;
    ov::parallel_nt(0, [&](const int ithr, const int nthr) {
        size_t begin = 0, end = 0;
        ov::splitter(h_blocks, nthr, ithr, begin, end);
        const T* a[kTileRows];
        size_t wd[kTileCols];
        alignas(64) float y[kTileRows * kTileCols];
        std::optional<amx::TileSession> tiles;
        TileRows<T> weight_rows;
        alignas(64) float c[4 * kResult];
        for (size_t item = begin; item < end; ++item) {
            const size_t c0 = item * bh, c1 = std::min(H, c0 + bh);
            for (size_t n = 0; n < rows; ++n) std::fill(out + n * H + c0, out + n * H + c1, 0.0f);
            for (size_t hit_index = 0; hit_index < routing.hits.size(); ++hit_index) {
                const auto& hit = routing.hits[hit_index];
                if (down_plan.any && down_plan.uses(hit_index)) {
                    // Blocks of 32 output columns (two weight blocks of 16 rows) against
                    // two 16-row blocks of pairs.
                    if (kind.amx && !tiles) tiles.emplace();
                    const uint32_t* panel = act_panels.data() + down_plan.panel_at[hit_index];
                    const size_t blocks = (hit.count + kTile - 1) / kTile;
                    for (size_t n0 = c0; n0 < c1; n0 += 2 * kTile) {
                        const size_t cols[2] = {std::min(kTile, c1 - n0),
                                                n0 + kTile < c1 ? std::min(kTile, c1 - n0 - kTile) : 0};
                        const decltype(weight_rows.block(w, 0, 0, 0, 0)) wb2[2] = {
                            weight_rows.block(w, hit.expert, n0, cols[0], 0),
                            weight_rows.block(w, hit.expert, n0 + kTile, cols[1], 1)};
                        for (size_t b0 = 0; b0 < blocks; b0 += 2) {
                            const size_t nb = std::min<size_t>(2, blocks - b0);
                            panel_products(kind.amx, wb2, panel + b0 * down_plan.block_words, nb, I, c);
                            for (size_t wb = 0; wb < 2; ++wb) {
                                for (size_t b = 0; b < nb; ++b) {
                                    add_down_block(c + (2 * wb + b) * kResult, cols[wb], pair_block(hit, b0 + b),
                                                   routing, out + n0 + wb * kTile, H);
                                }
                            }
                        }
                    }
                    continue;
                }
                for (size_t j = c0; j < c1; j += kTileCols) {
                    const size_t cols = std::min(kTileCols, c1 - j);
                    for (size_t n = 0; n < kTileCols; ++n) wd[n] = std::min(n, cols - 1);
                    const Stack block = weight_rows.rows(w, hit.expert, j, cols, 0);
                    for (size_t m0 = hit.start; m0 < hit.start + hit.count; m0 += kTileRows) {
                        const size_t count = std::min(kTileRows, hit.start + hit.count - m0);
                        for (size_t m = 0; m < count; ++m) a[m] = row_at(act, m0 + m, I);
                        dot_micro_tile(avx2, a, count, block, wd, y);
                        for (size_t m = 0; m < count; ++m) {
                            float* dst = out + routing.row[m0 + m] * H + j;
                            const float weight = routing.weight[m0 + m];
                            for (size_t n = 0; n < cols; ++n) dst[n] += weight * y[m * kTileCols + n];
                        }
                    }
                }
            }
        }
    });
}

// f32 sums [rows, width] rounded once into a bf16 `out`.
void round_to_bf16(const float* sums, size_t rows, size_t width, void* out) {
    uint16_t* dst = static_cast<uint16_t*>(out);
    for_rows(rows, width, [&](size_t n) {
        for (size_t h = 0; h < width; ++h) dst[n * width + h] = to_bf16(sums[n * width + h]);
    });
}

// Whether a call runs on the bf16 tiles (run<uint16_t>): bf16 weights always; fp8 weights in a
// bf16 model (x_bf16) once its `pairs` average kFp8TileMinRows per expert it reads (`hits`),
// where AVX512-BF16 is there (not AVX2); the rest on f32 (run<float>).
bool on_bf16_tiles(WeightFormat format, bool x_bf16, bool avx2, size_t pairs, size_t hits) {
    if (format == WeightFormat::bf16) return true;
    return format == WeightFormat::fp8 && x_bf16 && !avx2 && features().avx512_bf16 &&
           pairs >= kFp8TileMinRows * hits;
}

// What NUMAOV_MOE_VNNI (auto, off, always) allows on this CPU, the tiles on AVX2 or not: whether
// int8 / int4 weights can run against quantized activations (`runs`; in f32 models too under
// always), else why not; under always a reason is an error (`refused`).
struct VnniChoice {
    bool runs, f32_models, refused;
    std::string why_not;
};

VnniChoice vnni_choice(bool avx2) {
    const KernelSetting setting = auto_off_always("NUMAOV_MOE_VNNI");
    if (setting == KernelSetting::off) return {false, false, false, "NUMAOV_MOE_VNNI=off"};
    const bool always = setting == KernelSetting::always;
    const char* missing = avx2 ? "the kernel runs on AVX2 here"
                               : features().avx512_vnni ? nullptr : "the CPU has no AVX512-VNNI";
    if (missing) return {false, false, always, always ? std::string("NUMAOV_MOE_VNNI=always, but ") + missing : missing};
    return {true, always, false, ""};
}

// Whether int8 or int4 weights whose stacks have `groups[i]` scale groups over rows of `K[i]` values
// run against quantized activations (dot_tile_vnni) under NUMAOV_MOE_VNNI (vnni_choice): auto:
// in a bf16 model (x_bf16), where the CPU has AVX512-VNNI and the AVX-512 kernel runs; always:
// in an f32 model too (an error without AVX512-VNNI); off: never. Weight groups that are not
// whole activation groups (a multiple of kActGroup values) stay on the f32 path.
template <size_t S>
bool int8_activations(WeightFormat format, bool x_bf16, bool avx2, const size_t (&K)[S], const size_t (&groups)[S]) {
    if (format != WeightFormat::int8 && format != WeightFormat::int4) return false;
    const VnniChoice choice = vnni_choice(avx2);
    if (choice.refused) throw std::runtime_error(choice.why_not);
    if (!choice.runs || (!choice.f32_models && !x_bf16)) return false;
    for (size_t i = 0; i < S; ++i) {
        if (groups[i] > 1 && (K[i] / groups[i]) % kActGroup != 0) return false;
    }
    return true;
}

// `avx2`: the tiles run on AVX2 (dot_rows_avx2), and bf16 experts never on AMX.
template <class T>
void run(const Tensors& t, const Shape& s, const Routing& routing, bool avx2) {
    const size_t H = s.hidden, I = s.inter;
    const size_t pairs = s.rows * s.top_k;
    const int threads = parallel_get_max_threads();

    // 0. Activations in the weights' type (x itself when it already is).
    constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
    Scratch<T> converted;
    const T* x = activations_as<T>(t.x, t.x_bf16, s.rows, H, converted);
    const Stack gate_up{t.gate_up, t.gate_up_scale, 2 * I, H, t.gate_up_groups, t.format};
    const Stack down{t.down, t.down_scale, H, I, t.down_groups, t.format};

    // 1. gate/up: silu(gate . x) * (up . x) per sorted pair, into `act` [pairs, I] (f32 for
    // quantized activations, quantized once whole for the down pass).
    constexpr bool kQuantized = std::is_same_v<T, uint8_t>;
    Scratch<std::conditional_t<kQuantized, float, T>> act(pairs * I);
    constexpr size_t kTile = amx_tiles::kTile, kResult = kTile * kTile;
    const auto dot = [avx2](const T* const* a, size_t rows, const Stack& w, const size_t* r, float* c) {
        dot_micro_tile(avx2, a, rows, w, r, c);
    };
    const PanelTiles kind = panel_tiles<T>(avx2);
    const PanelPlan<T> up_plan(routing, kind.min_rows, H);
    Scratch<uint32_t> x_panels;
    if constexpr (kBf16 || kQuantized) {
        up_plan.pack(routing, H, x_panels,
                     [&](const Routing::Hit& hit, size_t m) { return row_at(x, routing.row[hit.start + m], H); });
    }
    const size_t bi = block_columns(I, routing.hits.size(), threads, up_plan.any ? kTile : kTileCols);
    const size_t i_blocks = (I + bi - 1) / bi;
    ov::parallel_nt(0, [&](const int ithr, const int nthr) {
        size_t begin = 0, end = 0;
        ov::splitter(routing.hits.size() * i_blocks, nthr, ithr, begin, end);
        const T* a[kTileRows];
        size_t wr[kTileCols];
        alignas(64) float g[kTileRows * kTileCols], u[kTileRows * kTileCols], h[kTileRows * kTileCols];
        std::optional<amx::TileSession> tiles;  // configured on this thread's first AMX hit
        TileRows<T> weight_rows;
        alignas(64) float c[4 * kResult];
        for (size_t item = begin; item < end; ++item) {
            const size_t hit_index = item / i_blocks;
            const auto& hit = routing.hits[hit_index];
            const size_t c0 = (item % i_blocks) * bi, c1 = std::min(I, c0 + bi);
            if constexpr (kBf16 || kQuantized) {
                if (up_plan.uses(hit_index)) {
                    // Blocks of 16 intermediate columns: the gate rows and the up rows
                    // as the two weight blocks, against two 16-row blocks of pairs.
                    if (kind.amx && !tiles) tiles.emplace();
                    const uint32_t* panel = x_panels.data() + up_plan.panel_at[hit_index];
                    const size_t blocks = (hit.count + kTile - 1) / kTile;
                    for (size_t n0 = c0; n0 < c1; n0 += kTile) {
                        const size_t cols = std::min(kTile, c1 - n0);
                        const decltype(weight_rows.block(gate_up, 0, 0, 0, 0)) w[2] = {
                            weight_rows.block(gate_up, hit.expert, n0, cols, 0),
                            weight_rows.block(gate_up, hit.expert, I + n0, cols, 1)};
                        for (size_t b0 = 0; b0 < blocks; b0 += 2) {
                            const size_t nb = std::min<size_t>(2, blocks - b0);
                            panel_products(kind.amx, w, panel + b0 * up_plan.block_words, nb, H, c);
                            // gate's tiles at c + b * 256, up's at c + (2 + b) * 256
                            for (size_t b = 0; b < nb; ++b) {
                                store_gate_up_block(c + b * kResult, c + (2 + b) * kResult, cols,
                                                    pair_block(hit, b0 + b), act.data() + n0, I);
                            }
                        }
                    }
                    continue;
                }
            }
            for (size_t r0 = hit.start; r0 < hit.start + hit.count; r0 += kRowChunk) {
                const size_t r1 = std::min(hit.start + hit.count, r0 + kRowChunk);
                for (size_t j = c0; j < c1; j += kTileCols) {
                    const size_t cols = std::min(kTileCols, c1 - j);
                    // past the end: a repeat, dropped
                    for (size_t n = 0; n < kTileCols; ++n) wr[n] = std::min(n, cols - 1);
                    const Stack gate = weight_rows.rows(gate_up, hit.expert, j, cols, 0);
                    const Stack up = weight_rows.rows(gate_up, hit.expert, I + j, cols, 1);
                    for (size_t m0 = r0; m0 < r1; m0 += kTileRows) {
                        const size_t rows = std::min(kTileRows, r1 - m0);
                        for (size_t m = 0; m < rows; ++m) a[m] = row_at(x, routing.row[m0 + m], H);
                        dot(a, rows, gate, wr, g);
                        dot(a, rows, up, wr, u);
                        if (avx2) {
                            silu_mul_scalar(g, u, h);
                        } else {
                            silu_mul(g, u, h);
                        }
                        for (size_t m = 0; m < rows; ++m)
                            for (size_t n = 0; n < cols; ++n) store(&act[(m0 + m) * I + j + n], h[m * kTileCols + n]);
                    }
                }
            }
        }
    });

    // 2. down: out[row] += weight * (act . down[e]) over each row's pairs, by output columns.
    Scratch<float> sums;
    float* out = static_cast<float*>(t.out);
    if (t.x_bf16) {
        sums.resize(s.rows * H);
        out = sums.data();
    }
    if constexpr (kQuantized) {
        Scratch<uint8_t> quantized;
        quantize_rows(act.data(), false, pairs, I, quantized);
        down_pass<T>(down, quantized.data(), routing, s.rows, out, avx2);
    } else {
        down_pass<T>(down, act.data(), routing, s.rows, out, avx2);
    }
    if (t.x_bf16) round_to_bf16(sums.data(), s.rows, H, t.out);
}

}  // namespace

// The kernel steps through a row 16 (int8, fp8) or 32 (int4) weights at a time,
// each step inside one scale group.
void check_groups(WeightFormat format, const char* name, size_t K, size_t groups) {
    const size_t step = format == WeightFormat::int4 ? 32 : 16;
    const bool fits = groups >= 1 && K % groups == 0 &&
                      (format == WeightFormat::int4 ? K % 32 == 0 && (K / groups) % 32 == 0
                                                    : groups == 1 || (K / groups) % 16 == 0);
    if (!fits) {
        std::ostringstream msg;
        msg << name << ": " << groups << " scale groups over rows of " << K << " values; expected groups dividing "
            << K << " into multiples of " << step << (format == WeightFormat::int4 ? "" : " (or one group)");
        throw std::invalid_argument(msg.str());
    }
}

bool has_scales(WeightFormat format) {
    return format == WeightFormat::int8 || format == WeightFormat::int4 || format == WeightFormat::fp8;
}

const char* format_name(WeightFormat format) {
    switch (format) {
        case WeightFormat::f32: return "f32";
        case WeightFormat::bf16: return "bf16";
        case WeightFormat::int8: return "int8";
        case WeightFormat::int4: return "int4";
        case WeightFormat::fp8: return "fp8";
    }
    return "?";
}

std::string unavailable_reason(WeightFormat) {
    const Features& f = features();
    if (!f.avx512 && !f.avx2) return "the CPU has neither AVX-512 (F, DQ, BW, VL) nor AVX2 with FMA and F16C";
    return "";
}

std::string kernel_isa(WeightFormat format) {
    const Features& f = features();
    const bool avx512 = f.avx512 && (format != WeightFormat::bf16 || f.avx512_bf16);
    const char* value = std::getenv("NUMAOV_MOE_ISA");
    const std::string v = value ? value : "";
    if (v == "avx512") {
        if (!avx512) {
            throw std::runtime_error(std::string("NUMAOV_MOE_ISA=avx512, but the CPU has no ") +
                                     (f.avx512 ? "AVX512-BF16 (bf16 weights need it)" : "AVX-512 (F, DQ, BW, VL)"));
        }
        return "avx512";
    }
    if (v == "avx2") {
        if (!f.avx2) throw std::runtime_error("NUMAOV_MOE_ISA=avx2, but the CPU has no AVX2 with FMA and F16C");
        return "avx2";
    }
    if (!v.empty() && v != "auto") {
        throw std::invalid_argument("NUMAOV_MOE_ISA='" + v + "'; expected auto, avx512 or avx2");
    }
    if (avx512) return "avx512";
    if (f.avx2) return "avx2";
    throw std::runtime_error(unavailable_reason(format));
}

Bf16Kernel bf16_kernel() {
    const std::string missing = unavailable_reason(WeightFormat::bf16);
    if (!missing.empty()) return {"", missing, 0, 0};
    std::string isa;
    try {
        isa = kernel_isa(WeightFormat::bf16);
    } catch (const std::runtime_error& e) {
        return {"", e.what(), 0, 0};
    }
    if (isa == "avx2") {
        return {"avx2", features().avx512_bf16 ? "NUMAOV_MOE_ISA=avx2" : "the CPU has no AVX512-BF16", 0, 0};
    }
    switch (amx_setting()) {
        case KernelSetting::off: return {"avx512_bf16", "NUMAOV_MOE_AMX=off", 0, kFp8TileMinRows, kOuterMinRows};
        case KernelSetting::always:
            if (!amx::usable()) return {"", "NUMAOV_MOE_AMX=always, but " + amx::unavailable_reason(), 0, 0};
            return {"amx", "NUMAOV_MOE_AMX=always: every expert that gets rows", 1, kFp8TileMinRows};
        default:
            if (!amx::usable()) return {"avx512_bf16", amx::unavailable_reason(), 0, kFp8TileMinRows, kOuterMinRows};
            return {"amx", "AMX is usable; experts with fewer rows run on AVX512-BF16", kAmxMinRows,
                    kFp8TileMinRows};
    }
}

Int8Kernel int8_kernel() {
    std::string isa;
    try {
        isa = kernel_isa(WeightFormat::int8);
    } catch (const std::runtime_error& e) {
        return {"", e.what()};
    }
    const VnniChoice choice = vnni_choice(isa == "avx2");
    if (choice.refused) return {"", choice.why_not, 0};
    if (!choice.runs) return {"f32", choice.why_not, 0};
    if (choice.f32_models) return {"vnni", "NUMAOV_MOE_VNNI=always: f32 models too", kActGroup};
    return {"vnni", "in a bf16 model; f32 models widen the weights to f32", kActGroup};
}

void moe_experts(const Tensors& tensors, const Shape& shape) {
    const std::string missing = unavailable_reason(tensors.format);
    if (!missing.empty()) throw std::runtime_error("numaov MoE experts kernel: " + missing);
    if (shape.rows == 0) return;
    if (shape.top_k == 0 || shape.experts == 0 || shape.hidden == 0 || shape.inter == 0) {
        throw std::invalid_argument("top_k, experts, hidden and intermediate sizes must be >= 1");
    }
    if (has_scales(tensors.format)) {
        check_groups(tensors.format, "gate_up", shape.hidden, tensors.gate_up_groups);
        check_groups(tensors.format, "down", shape.inter, tensors.down_groups);
        if (!tensors.gate_up_scale || !tensors.down_scale) {
            throw std::invalid_argument("int8 / int4 / fp8 weights need their scales");
        }
    }
    const Routing routing = route(tensors, shape);
    const bool avx2 = kernel_isa(tensors.format) == "avx2";
    if (on_bf16_tiles(tensors.format, tensors.x_bf16, avx2, shape.rows * shape.top_k, routing.hits.size())) {
        run<uint16_t>(tensors, shape, routing, avx2);
    } else if (int8_activations(tensors.format, tensors.x_bf16, avx2, {shape.hidden, shape.inter},
                                {tensors.gate_up_groups, tensors.down_groups})) {
        run<uint8_t>(tensors, shape, routing, avx2);
    } else {
        run<float>(tensors, shape, routing, avx2);
    }
}

namespace {

template <class T>
void run_linear(const LinearTensors& t, size_t rows, size_t in, size_t outs, const Routing& routing, bool avx2) {
    Scratch<T> converted;
    const T* x = activations_as<T>(t.x, t.x_bf16, rows, in, converted);
    const Stack weight{t.weight, t.scale, outs, in, t.groups, t.format};
    Scratch<float> sums;
    float* out = static_cast<float*>(t.out);
    if (t.x_bf16) {
        sums.resize(rows * outs);
        out = sums.data();
    }
    down_pass<T>(weight, x, routing, rows, out, avx2);
    if (t.x_bf16) round_to_bf16(sums.data(), rows, outs, t.out);
}

}  // namespace

void linear(const LinearTensors& tensors, size_t rows, size_t in, size_t outs) {
    const std::string missing = unavailable_reason(tensors.format);
    if (!missing.empty()) throw std::runtime_error("numaov linear kernel: " + missing);
    if (rows == 0) return;
    if (in == 0 || outs == 0) throw std::invalid_argument("the input and output sizes must be >= 1");
    if (has_scales(tensors.format)) {
        check_groups(tensors.format, "weight", in, tensors.groups);
        if (!tensors.scale) throw std::invalid_argument("int8 / int4 / fp8 weights need their scales");
    }
    // every row is one pair of the one expert, of routing weight 1 (exact: 1 * y is y)
    Routing routing;
    routing.row.resize(rows);
    for (size_t n = 0; n < rows; ++n) routing.row[n] = n;
    routing.weight.assign(rows, 1.0f);
    routing.hits.push_back({0, 0, rows});
    const bool avx2 = kernel_isa(tensors.format) == "avx2";
    if (on_bf16_tiles(tensors.format, tensors.x_bf16, avx2, rows, 1)) {
        run_linear<uint16_t>(tensors, rows, in, outs, routing, avx2);
    } else if (int8_activations(tensors.format, tensors.x_bf16, avx2, {in}, {tensors.groups})) {
        run_linear<uint8_t>(tensors, rows, in, outs, routing, avx2);
    } else {
        run_linear<float>(tensors, rows, in, outs, routing, avx2);
    }
}

}  // namespace numaov::moe
