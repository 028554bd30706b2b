// The bf16 products of one MoE expert on AMX tiles, for experts whose rows fill
// them (prefill); moe_kernels.cpp decides which experts come here.
//
// Operands: the expert's weights are the tiles' left operand, read in place: 16
// rows of a row-major [N, K] bf16 stack, 32 values each, are one 16 x 64-byte
// tile at the stack's row stride. So the weights need no copy in another layout
// (a repacked copy would double the resident bf16 experts, whose bytes are what
// decode is bound by). The expert's activation rows are the right operand, in
// the pairs layout the tile product reads ("VNNI": row p of a tile holds
// (a[m][2p], a[m][2p+1]) for 16 rows m), packed once per call and expert: they
// are the smaller side (an expert's rows are far fewer than its output columns).
// A result tile is therefore transposed, [16 weight rows][16 activation rows].
//
// Tails: K is zero-padded to a multiple of 32 in the packed activations, and a
// weight block short of 16 rows or running past K is copied into a zero-padded
// tile, so any K and N work and nothing is read past the stacks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace numaov::moe::amx_tiles {

constexpr size_t kTile = 16;   // rows of a tile; fp32 columns of a result tile
constexpr size_t kTileK = 32;  // bf16 values in a 64-byte tile row

// 32-bit words of one 16-row block of packed activations of K values.
size_t block_words(size_t K);

// rows[m] (m < M) hold K bf16 values each; `panel` gets them in the pairs
// layout [ceil(M / 16)][ceil(K / 32) * 16][16], zero past M and K.
void pack_panel(const uint16_t* const* rows, size_t M, size_t K, uint32_t* panel);

// A 16 x 16 fp32 result tile [weight row][activation row] as [activation row][weight row]
// (both 64-byte aligned), so an epilogue writes whole activation rows.
void transpose_tile(const float* tile, float* out);

// `count` (<= 16) weight rows of K bf16 values from `first`, one after the
// other; count 0 marks an unused block.
struct WeightBlock {
    const uint16_t* first;
    size_t count;
};

// The four 16 x 16 fp32 tiles c + (2a + b) * 256, each [weight row][activation row],
// = weight block w[a] times activation block b of `panel` (one or two blocks),
// summed over K. Tiles whose block is unused are not written. The calling thread
// holds an amx::TileSession.
void products(const WeightBlock (&w)[2], const uint32_t* panel, size_t blocks, size_t K, float* c);

}  // namespace numaov::moe::amx_tiles
