#include "kernels/moe_amx.hpp"

#include <immintrin.h>

#include <algorithm>

#include "common/amx.hpp"

namespace numaov::moe::amx_tiles {

namespace {

constexpr size_t kPrefetch = 4 * kTileK;

size_t padded_k(size_t K) { return (K + kTileK - 1) / kTileK * kTileK; }

// Where the tile of w's rows at values k0 .. k0 + 32 is read from: the stack
// itself when the block is whole, else `tail` (16 x 32, zero-padded).
NUMAOV_TARGET_AMX const uint16_t* tile_source(const WeightBlock& w, size_t k0, size_t K, uint16_t* tail,
                                              size_t& stride_bytes) {
    if (w.count == kTile && k0 + kTileK <= K) {
        stride_bytes = K * 2;
        return w.first + k0;
    }
    const size_t left = K - k0;
    const __mmask32 mask = left >= kTileK ? ~__mmask32(0) : __mmask32((1u << left) - 1);
    for (size_t r = 0; r < kTile; ++r) {
        const __m512i v = r < w.count ? _mm512_maskz_loadu_epi16(mask, w.first + r * K + k0) : _mm512_setzero_si512();
        _mm512_store_si512(tail + r * kTileK, v);
    }
    NUMAOV_MEMORY_BARRIER();  // the tile load that reads `tail` comes next
    stride_bytes = kTileK * 2;
    return tail;
}

// r[i][j] <- r[j][i] for 16 x 16 32-bit words: pairs within 128-bit lanes,
// then 4 x 4 blocks within lanes, then the lanes themselves.
NUMAOV_TARGET_AMX void transpose_words(__m512i (&r)[kTile]) {
    __m512i t[kTile], u[kTile], v[kTile];
    for (size_t i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (size_t i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (size_t i = 0; i < 2; ++i) {
        for (size_t j = 0; j < 4; ++j) {
            v[8 * i + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
            v[8 * i + 4 + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
        }
    }
    for (size_t j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(v[j], v[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v[j], v[8 + j], 0xdd);
    }
}

}  // namespace

size_t block_words(size_t K) { return padded_k(K) / 2 * kTile; }


NUMAOV_TARGET_AMX void pack_panel(const uint16_t* const* rows, size_t M, size_t K, uint32_t* panel) {
    const size_t words = block_words(K);
    for (size_t b = 0; b * kTile < M; ++b) {
        const size_t count = std::min(kTile, M - b * kTile);
        uint32_t* dst = panel + b * words;
        for (size_t k0 = 0; k0 < K; k0 += kTileK) {
            // 16 rows x 16 pairs, each row's pairs read as 16 words, transposed
            // into 16 tile rows of one pair per activation row.
            const size_t left = K - k0;
            const __mmask32 mask = left >= kTileK ? ~__mmask32(0) : __mmask32((1u << left) - 1);
            __m512i r[kTile];
            for (size_t m = 0; m < kTile; ++m)
                r[m] = m < count ? _mm512_maskz_loadu_epi16(mask, rows[b * kTile + m] + k0) : _mm512_setzero_si512();
            transpose_words(r);
            for (size_t p = 0; p < kTile; ++p) _mm512_store_si512(dst + (k0 / 2 + p) * kTile, r[p]);
        }
    }
}

NUMAOV_TARGET_AMX void transpose_tile(const float* tile, float* out) {
    __m512i r[kTile];
    for (size_t n = 0; n < kTile; ++n) r[n] = _mm512_load_si512(tile + n * kTile);
    transpose_words(r);
    for (size_t m = 0; m < kTile; ++m) _mm512_store_si512(out + m * kTile, r[m]);
}

// Tiles: tmm0-3 the four results (tmm0 = w[0] x block 0, tmm1 = w[0] x block 1,
// tmm2 = w[1] x block 0, tmm3 = w[1] x block 1), tmm4-5 the weight blocks,
// tmm6-7 the activation blocks.
NUMAOV_TARGET_AMX void products(const WeightBlock (&w)[2], const uint32_t* panel, size_t blocks, size_t K, float* c) {
    const bool two_w = w[1].count > 0, two_b = blocks > 1;
    const uint32_t* panel_1 = panel + block_words(K);
    alignas(64) uint16_t tail[2][kTile * kTileK];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t k0 = 0; k0 < padded_k(K); k0 += kTileK) {
        size_t stride = 0;
        const size_t pair_row = k0 / 2 * kTile;
        // 16 (or 32) weight rows are as many streams, more than the hardware
        // prefetcher follows: fetch each row's line kPrefetch values ahead.
        if (k0 + kPrefetch < K) {
            for (size_t r = 0; r < w[0].count; ++r) _mm_prefetch(w[0].first + r * K + k0 + kPrefetch, _MM_HINT_T0);
            for (size_t r = 0; r < w[1].count; ++r) _mm_prefetch(w[1].first + r * K + k0 + kPrefetch, _MM_HINT_T0);
        }
        _tile_loadd(4, tile_source(w[0], k0, K, tail[0], stride), stride);
        _tile_loadd(6, panel + pair_row, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
            _tile_loadd(7, panel_1 + pair_row, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_w) {
            _tile_loadd(5, tile_source(w[1], k0, K, tail[1], stride), stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
    constexpr size_t kResult = kTile * kTile;
    _tile_stored(0, c, 64);
    if (two_b) _tile_stored(1, c + kResult, 64);
    if (two_w) _tile_stored(2, c + 2 * kResult, 64);
    if (two_w && two_b) _tile_stored(3, c + 3 * kResult, 64);
    NUMAOV_MEMORY_BARRIER();  // the caller reads c next
}

}  // namespace numaov::moe::amx_tiles
