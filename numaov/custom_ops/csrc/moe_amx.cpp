#include "moe_amx.hpp"

#include <immintrin.h>

#include <cstring>

#include "amx.hpp"

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

}  // namespace

size_t block_words(size_t K) { return padded_k(K) / 2 * kTile; }

size_t panel_words(size_t M, size_t K) { return (M + kTile - 1) / kTile * block_words(K); }

void pack_panel(const uint16_t* const* rows, size_t M, size_t K, uint32_t* panel) {
    std::memset(panel, 0, panel_words(M, K) * sizeof(uint32_t));
    const size_t pairs = K / 2, words = block_words(K);
    for (size_t m = 0; m < M; ++m) {
        uint32_t* dst = panel + (m / kTile) * words + m % kTile;
        const uint16_t* src = rows[m];
        for (size_t p = 0; p < pairs; ++p) {
            uint32_t pair;
            std::memcpy(&pair, src + 2 * p, 4);  // (a[2p], a[2p + 1]), low half first
            dst[p * kTile] = pair;
        }
        if (K % 2) dst[pairs * kTile] = src[K - 1];
    }
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
