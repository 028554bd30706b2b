#include "kernels/flash_attention.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

#include <openvino/core/parallel.hpp>

#include "common/amx.hpp"

namespace numaov::attention {

namespace {

constexpr size_t kBlockM = 32;   // query rows per work item: two 16-row tiles
constexpr size_t kBlockN = 128;  // keys per online-softmax step
constexpr size_t kGroupBlocks = 8;  // row blocks sharing one pass over the keys: 256 query rows
constexpr size_t kTileK = 32;    // bf16 elements in a 64-byte tile row
constexpr size_t kTileN = 16;    // fp32 columns of a result tile

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// f32 row of `n` values -> `padded` bf16 values (round to nearest even, zero tail).
NUMAOV_TARGET_AMX void to_bf16_row(const float* src, size_t n, uint16_t* dst, size_t padded) {
    for (size_t i = 0; i < padded; i += 16) {
        const size_t left = i < n ? n - i : 0;
        const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(mask, src + i);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(x));
    }
}

// `padded` bf16 values from row `offset` (in elements) of an f32 or bf16 tensor:
// the first n read, the rest zero.
NUMAOV_TARGET_AMX void read_row(const void* base, bool bf16, size_t offset, size_t n, uint16_t* dst,
                                size_t padded) {
    if (!bf16) return to_bf16_row(static_cast<const float*>(base) + offset, n, dst, padded);
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    for (size_t i = 0; i < padded; i += 16) {
        const size_t left = i < n ? n - i : 0;
        const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_maskz_loadu_epi16(mask, src + i));
    }
}

// 2^x for x up to about kMaxSlack (scores minus the running max); NaN stays NaN. Below
// -126 the result stays 2^-126 (the smallest normal float): a weight of 1e-38 next to
// the row max's 1, so a -inf score still weighs nothing measurable. The result is
// rounded to bf16 for the P V product, so a degree-4 polynomial is enough.
NUMAOV_TARGET_AMX inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
    // 2^f = e^(f ln 2): Taylor series to degree 4, relative error < 5e-5 on [-0.5, 0.5]
    // (bf16 rounding of the probabilities is 4e-3).
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// One (batch, head)'s keys and values in the bf16 pair layout the tile products read.
struct PackedHead {
    // The B operands, laid out so that every 16x16 tile of pairs is 1 KiB of
    // contiguous memory (a strided tile would touch 16 pages and thrash L1):
    // keys[n / 16][p][n % 16] = (K[n][2p], K[n][2p+1])   for Q K^T
    const uint32_t* keys;
    // values[d / 16][r][d % 16] = (V[2r][d], V[2r+1][d])  for P V
    const uint32_t* values;
};

struct Geometry {
    Shape shape;
    size_t dim_padded;  // D rounded up to 32
    size_t kv_padded;   // Sk rounded up to kBlockN
    float log2_scale;   // scale * log2(e): scores go through exp2
};

// `k` and `v` are the (batch, head)'s first rows, as element offsets into the tensors of `t`.
NUMAOV_TARGET_AMX void pack_head(const Tensors& t, size_t k, size_t v, const Geometry& g, uint32_t* keys,
                                 uint32_t* values, uint16_t* row_a, uint16_t* row_b) {
    const size_t k_row = t.k_strides.row, v_row = t.v_strides.row;
    const size_t D = g.shape.head_dim, Dp = g.dim_padded, Sk = g.shape.kv_len, SkP = g.kv_padded;
    // The row's bf16 values read as (even, odd) pairs; may_alias: row_a is uint16_t storage.
    typedef uint32_t __attribute__((may_alias)) pair_t;
    const pair_t* pairs = reinterpret_cast<const pair_t*>(row_a);
    for (size_t n = 0; n < SkP; ++n) {
        if (n < Sk) {
            read_row(t.k, t.bf16, k + n * k_row, D, row_a, Dp);
        } else {
            std::memset(row_a, 0, Dp * sizeof(uint16_t));
        }
        uint32_t* tile = keys + (n / kTileN) * (Dp / 2) * kTileN + n % kTileN;
        for (size_t p = 0; p < Dp / 2; ++p) tile[p * kTileN] = pairs[p];
    }
    for (size_t r = 0; r < SkP / 2; ++r) {
        const size_t n0 = 2 * r, n1 = 2 * r + 1;
        // Rows past the keys read nothing (zero padding), from the first row's address.
        read_row(t.v, t.bf16, v + (n0 < Sk ? n0 * v_row : 0), n0 < Sk ? D : 0, row_a, Dp);
        read_row(t.v, t.bf16, v + (n1 < Sk ? n1 * v_row : 0), n1 < Sk ? D : 0, row_b, Dp);
        for (size_t d = 0; d < Dp; d += kTileN) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_a + d)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_b + d)));
            _mm512_storeu_si512(values + (d / kTileN) * (SkP / 2) * kTileN + r * kTileN,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    NUMAOV_MEMORY_BARRIER();  // the tile loads that read keys/values come next
}

// One 32-row block of queries in flight: its bf16 queries, fp32 output rows,
// and each row's running max (log2 domain) and running sum.
struct RowBlock {
    uint16_t* query;  // [32][Dp]
    float* acc;       // [32][Dp]
    float max[kBlockM];
    // Per-row sums kept as 16 partial sums, reduced once at the end.
    alignas(64) float sum[kBlockM][16];
};

// What one thread keeps: the packed keys and values of the (batch, head) it is
// working on, up to kGroupBlocks row blocks that share each pass over those
// keys, and the scores / probabilities of the two items in flight.
struct Scratch {
    explicit Scratch(const Geometry& g)
        : keys(g.kv_padded * g.dim_padded / 2), values(g.kv_padded * g.dim_padded / 2),
          query(kGroupBlocks * kBlockM * g.dim_padded), acc(kGroupBlocks * kBlockM * g.dim_padded),
          scores(2 * kBlockM * kBlockN), probs(2 * kBlockM * kBlockN), row_a(g.dim_padded), row_b(g.dim_padded),
          blocks(kGroupBlocks) {
        for (size_t b = 0; b < kGroupBlocks; ++b) {
            blocks[b].query = query.data() + b * kBlockM * g.dim_padded;
            blocks[b].acc = acc.data() + b * kBlockM * g.dim_padded;
        }
    }
    amx::Buffer<uint32_t> keys, values;  // PackedHead's layout, one (batch, head)
    amx::Buffer<uint16_t> query;
    amx::Buffer<float> acc;
    amx::Buffer<float> scores;  // two items' [32][kBlockN], by item parity
    amx::Buffer<uint16_t> probs;  // likewise
    amx::Buffer<uint16_t> row_a, row_b;
    std::vector<RowBlock> blocks;
};

// The one step both products are made of: the 32x32 fp32 block in tmm0-3 +=
// a 32 x 32 bf16 block of A (rows of `row` elements, from `a`) times a 32 x 32
// bf16 block of B (two 1 KiB tiles of pairs, at `b` and `b + b_next`).
NUMAOV_TARGET_AMX inline void tile_product(const uint16_t* a, size_t row, const uint32_t* b, size_t b_next) {
    _tile_loadd(4, a, row * 2);
    _tile_loadd(5, a + 16 * row, row * 2);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + b_next, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

// tmm0-3, a 32x32 fp32 block, to `c` in rows of `row` floats.
NUMAOV_TARGET_AMX inline void store_result(float* c, size_t row) {
    _tile_stored(0, c, row * 4);
    _tile_stored(1, c + kTileN, row * 4);
    _tile_stored(2, c + 16 * row, row * 4);
    _tile_stored(3, c + 16 * row + kTileN, row * 4);
}

// scores[32][kBlockN] = Q_block (32 x Dp) . K[n0 : n0 + kBlockN]^T, as a sequence of
// tile steps (one 2x2 tile product each) so that they can be spread through the
// softmax of the block before: the tile unit works while the vector units do.
struct ScoreSteps {
    const uint16_t* query = nullptr;  // the row block's [32][Dp]
    const uint32_t* keys = nullptr;   // the packed keys from key n0 on
    float* scores = nullptr;          // [32][kBlockN]
    size_t dim_padded = 0, tile_stride = 0, count = 0;

    ScoreSteps() = default;  // no work
    ScoreSteps(const Geometry& g, const PackedHead& head, size_t n0, const RowBlock& rb, float* out)
        : query(rb.query), keys(head.keys + (n0 / kTileN) * (g.dim_padded / 2) * kTileN), scores(out),
          dim_padded(g.dim_padded), tile_stride((g.dim_padded / 2) * kTileN),
          count((kBlockN / (2 * kTileN)) * (g.dim_padded / kTileK)) {}

    // Step i: chunk of 32 keys i / ksteps, 32 head-dims i % ksteps.
    NUMAOV_TARGET_AMX void run(size_t i) const {
        const size_t ksteps = dim_padded / kTileK, nc = (i / ksteps) * 2 * kTileN, ks = (i % ksteps) * kTileK;
        if (ks == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        tile_product(query + ks, dim_padded, keys + (nc / kTileN) * tile_stride + (ks / 2) * kTileN, tile_stride);
        if (ks + kTileK == dim_padded) store_result(scores + nc, kBlockN);
    }
};

// acc[32][Dp] += probs (32 x kBlockN) . V[n0 : n0 + kBlockN], as tile steps like
// ScoreSteps: each 32-column chunk of acc is loaded, accumulated and stored back.
struct ValueSteps {
    const uint16_t* probs = nullptr;   // [32][kBlockN]
    const uint32_t* values = nullptr;  // the packed values from key n0 on
    float* acc = nullptr;              // the row block's [32][Dp]
    size_t dim_padded = 0, tile_stride = 0, count = 0;

    ValueSteps() = default;  // no work
    ValueSteps(const Geometry& g, const PackedHead& head, size_t n0, const uint16_t* p, RowBlock& rb)
        : probs(p), values(head.values + (n0 / 2) * kTileN), acc(rb.acc), dim_padded(g.dim_padded),
          tile_stride((g.kv_padded / 2) * kTileN), count((g.dim_padded / (2 * kTileN)) * (kBlockN / kTileK)) {}

    // Step i: 32 output columns (i / ksteps), 32 keys (i % ksteps).
    NUMAOV_TARGET_AMX void run(size_t i) const {
        constexpr size_t ksteps = kBlockN / kTileK;
        const size_t dc = (i / ksteps) * 2 * kTileN, kn = (i % ksteps) * kTileK, Dp = dim_padded;
        if (kn == 0) {
            _tile_loadd(0, acc + dc, Dp * 4);
            _tile_loadd(1, acc + dc + kTileN, Dp * 4);
            _tile_loadd(2, acc + 16 * Dp + dc, Dp * 4);
            _tile_loadd(3, acc + 16 * Dp + dc + kTileN, Dp * 4);
        }
        tile_product(probs + kn, kBlockN, values + (dc / kTileN) * tile_stride + (kn / 2) * kTileN, tile_stride);
        if (kn + kTileK == kBlockN) store_result(acc + dc, Dp);
    }
};

// The tile work spread through one item's softmax: the previous item's P V,
// then the next item's scores. Only whole 32x32 blocks share tmm0-3, so the
// two never interleave with each other, only with the softmax's vector code.
struct TileSteps {
    ValueSteps values;
    ScoreSteps scores;
    size_t count() const { return values.count + scores.count; }
    NUMAOV_TARGET_AMX void run(size_t i) const {
        if (i < values.count) {
            values.run(i);
        } else {
            scores.run(i - values.count);
        }
    }
    NUMAOV_TARGET_AMX void run_all() const {
        for (size_t i = 0; i < count(); ++i) run(i);
        NUMAOV_MEMORY_BARRIER();
    }
};

// A row's running max only moves when a block's max exceeds it by more than
// this (log2 units): probabilities then reach at most 2^8, harmless in fp32
// sums and bf16 products, and the output rows are rescaled far less often.
constexpr float kMaxSlack = 8.0f;

// Online softmax over this block's `valid` keys: updates each row's running
// max and sum, rescales its output row when the max moves, and writes the bf16
// probabilities. After each row it runs its share of `work`'s tile steps (all
// of them by the end), so the tile unit and the vector units work at once.
NUMAOV_TARGET_AMX void block_softmax(const Geometry& g, size_t valid, const float* scores, RowBlock& rb,
                                     uint16_t* probs, const TileSteps& work) {
    const size_t Dp = g.dim_padded;
    const __m512 c = _mm512_set1_ps(g.log2_scale);
    const __mmask16 tail = valid % 16 ? __mmask16((1u << (valid % 16)) - 1) : __mmask16(0xFFFF);
    const size_t vectors = (valid + 15) / 16;
    size_t steps_done = 0;
    for (size_t r = 0; r < kBlockM; ++r) {
        const float* row = scores + r * kBlockN;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (size_t j = 0; j < vectors; ++j) {
            const __mmask16 m = j + 1 == vectors ? tail : __mmask16(0xFFFF);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_loadu_ps(row + 16 * j));
        }
        // scale > 0, so max(s) * scale = max(s * scale)
        const float block_max = _mm512_reduce_max_ps(vmax) * g.log2_scale;
        const float old_max = rb.max[r];
        __m512 vsum = _mm512_load_ps(rb.sum[r]);
        // A row whose scores are all -inf so far keeps max -inf (its probabilities are 0).
        if (block_max > old_max + kMaxSlack || (old_max == -INFINITY && block_max != -INFINITY)) {
            const __m512 a = exp2_ps(_mm512_set1_ps(old_max - block_max));
            vsum = _mm512_mul_ps(vsum, a);
            float* acc = rb.acc + r * Dp;
            for (size_t d = 0; d < Dp; d += 16) _mm512_store_ps(acc + d, _mm512_mul_ps(a, _mm512_load_ps(acc + d)));
            rb.max[r] = block_max;
        }
        const __m512 shift = _mm512_set1_ps(rb.max[r] == -INFINITY ? 0.0f : rb.max[r]);
        uint16_t* prob_row = probs + r * kBlockN;
        for (size_t j = 0; j < kBlockN / 16; ++j) {
            __m512 p = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * j), c, shift));
            if (j + 1 >= vectors) {
                p = _mm512_maskz_mov_ps(j + 1 == vectors ? tail : __mmask16(0), p);
            }
            vsum = _mm512_add_ps(vsum, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob_row + 16 * j), (__m256i)_mm512_cvtneps_pbh(p));
        }
        _mm512_store_ps(rb.sum[r], vsum);
        for (const size_t due = (r + 1) * work.count() / kBlockM; steps_done < due; ++steps_done) work.run(steps_done);
    }
    NUMAOV_MEMORY_BARRIER();
}

// Output rows q0 .. q0 + 32 * kGroupBlocks - 1 (fewer at the end) of one
// (batch, head). Every block of keys is used by all the row blocks before the
// next is read, so a head's keys and values stream from memory once per group
// rather than once per 32 rows (a 5,120-token head's are 2.6 MiB, over L2).
// `q` and `out` are the (batch, head)'s first rows, as element offsets into the tensors of `t`.
NUMAOV_TARGET_AMX void attend_group(const Tensors& t, const Geometry& g, const PackedHead& head, size_t q,
                                    size_t out, size_t q0, Scratch& s) {
    const size_t q_row = t.q_strides.row, out_row = t.out_strides.row;
    const size_t D = g.shape.head_dim, Dp = g.dim_padded, Sk = g.shape.kv_len;
    const size_t rows = std::min(kGroupBlocks * kBlockM, g.shape.q_len - q0);
    const size_t blocks = (rows + kBlockM - 1) / kBlockM;
    for (size_t b = 0; b < blocks; ++b) {
        RowBlock& rb = s.blocks[b];
        for (size_t r = 0; r < kBlockM; ++r) {
            const size_t row = b * kBlockM + r;
            read_row(t.q, t.bf16, q + (row < rows ? (q0 + row) * q_row : 0), row < rows ? D : 0, rb.query + r * Dp,
                     Dp);
            rb.max[r] = -INFINITY;
            std::fill(rb.sum[r], rb.sum[r] + 16, 0.0f);
        }
        std::fill(rb.acc, rb.acc + kBlockM * Dp, 0.0f);
    }
    NUMAOV_MEMORY_BARRIER();
    // Work items (key block, row block) in order. Item i's softmax runs with
    // the tile work of its neighbours: item i - 1's P V and item i + 1's scores.
    // Scores and probabilities are double-buffered by item parity.
    const size_t items = ((Sk + kBlockN - 1) / kBlockN) * blocks;
    auto first_key = [&](size_t i) { return (i / blocks) * kBlockN; };
    auto row_block = [&](size_t i) -> RowBlock& { return s.blocks[i % blocks]; };
    auto score_buffer = [&](size_t i) { return s.scores.data() + (i % 2) * kBlockM * kBlockN; };
    auto prob_buffer = [&](size_t i) { return s.probs.data() + (i % 2) * kBlockM * kBlockN; };
    auto scores_of = [&](size_t i) { return ScoreSteps(g, head, first_key(i), row_block(i), score_buffer(i)); };
    auto values_of = [&](size_t i) { return ValueSteps(g, head, first_key(i), prob_buffer(i), row_block(i)); };
    TileSteps{ValueSteps(), scores_of(0)}.run_all();
    for (size_t i = 0; i < items; ++i) {
        TileSteps work{i > 0 ? values_of(i - 1) : ValueSteps(), i + 1 < items ? scores_of(i + 1) : ScoreSteps()};
        if (blocks == 1 && i > 0) {
            // One row block: item i - 1's P V writes the rows item i's softmax rescales.
            TileSteps{work.values, ScoreSteps()}.run_all();
            work.values = ValueSteps();
        }
        block_softmax(g, std::min(kBlockN, Sk - first_key(i)), score_buffer(i), row_block(i), prob_buffer(i), work);
    }
    TileSteps{values_of(items - 1), ScoreSteps()}.run_all();
    for (size_t row = 0; row < rows; ++row) {
        const RowBlock& rb = s.blocks[row / kBlockM];
        const float* acc = rb.acc + (row % kBlockM) * Dp;
        const size_t dst = out + (q0 + row) * out_row;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(rb.sum[row % kBlockM])));
        for (size_t d = 0; d < D; d += 16) {
            const __mmask16 m = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
            const __m512 y = _mm512_mul_ps(inv, _mm512_loadu_ps(acc + d));
            if (t.bf16) {
                _mm256_mask_storeu_epi16(static_cast<uint16_t*>(t.out) + dst + d, m, (__m256i)_mm512_cvtneps_pbh(y));
            } else {
                _mm512_mask_storeu_ps(static_cast<float*>(t.out) + dst + d, m, y);
            }
        }
    }
}

}  // namespace

Layout layout_named(const std::string& name) {
    if (name == "bhsd") return Layout::bhsd;
    if (name == "bshd") return Layout::bshd;
    throw std::invalid_argument("layout '" + name + "'; expected 'bhsd' or 'bshd'");
}

Strides strides_of(Layout layout, size_t heads, size_t length, size_t head_dim) {
    if (layout == Layout::bshd) return {length * heads * head_dim, head_dim, heads * head_dim};
    return {heads * length * head_dim, length * head_dim, head_dim};
}

void flash_attention(const Tensors& t, const Shape& shape, float scale) {
    if (!amx::usable()) throw std::runtime_error("numaov flash attention needs AMX: " + amx::unavailable_reason());
    if (shape.q_len == 0 || shape.kv_len == 0 || shape.head_dim == 0) {
        throw std::runtime_error("numaov flash attention: query length, key length and head size must be >= 1");
    }
    // The running max relies on scale > 0 (max(s) * scale = max(s * scale)).
    if (!(scale > 0.0f) || !std::isfinite(scale)) {
        throw std::runtime_error("numaov flash attention: scale " + std::to_string(scale) +
                                 "; expected a finite positive number");
    }
    Geometry g{shape, round_up(shape.head_dim, kTileK), round_up(shape.kv_len, kBlockN),
               float(scale * 1.4426950408889634)};
    const size_t heads = shape.batch * shape.heads;
    // Offset of (batch, head) number h = b * H + h' in a tensor with strides `s`.
    auto offset = [&](const Strides& s, size_t h) { return (h / shape.heads) * s.batch + (h % shape.heads) * s.head; };
    const size_t group_rows = kGroupBlocks * kBlockM;
    const size_t groups = (shape.q_len + group_rows - 1) / group_rows;
    // Work items are (head, group of query rows), head-major, split into one
    // contiguous range per thread: a thread packs a head's keys and values once
    // and uses them for all its groups of that head (a head on the boundary
    // between two threads is packed by both).
    ov::parallel_nt(0, [&](const int ithr, const int nthr) {
        size_t begin = 0, end = 0;
        ov::splitter(heads * groups, nthr, ithr, begin, end);
        if (begin >= end) return;
        Scratch scratch(g);
        const PackedHead head{scratch.keys.data(), scratch.values.data()};
        size_t packed_head = heads;  // none yet
        const amx::TileSession tiles;
        for (size_t item = begin; item < end; ++item) {
            const size_t h = item / groups, q0 = (item % groups) * group_rows;
            if (h != packed_head) {
                pack_head(t, offset(t.k_strides, h), offset(t.v_strides, h), g, scratch.keys.data(),
                          scratch.values.data(), scratch.row_a.data(), scratch.row_b.data());
                packed_head = h;
            }
            attend_group(t, g, head, offset(t.q_strides, h), offset(t.out_strides, h), q0, scratch);
        }
    });
}

}  // namespace numaov::attention
