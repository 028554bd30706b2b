// Flash attention on AMX tiles: softmax(Q K^T * scale) V without materialising
// the [Sq, Sk] score matrix, for the long self-attention of video DiTs.
//
// Why our own kernel: OpenVINO 2026.4 runs a non-causal ScaledDotProductAttention
// outside stateful LLM graphs as its generic MHA snippet, which on AMX is slower
// than both PyTorch's CPU flash attention and this kernel (figures in
// benchmarks/RESULTS.md).
// This kernel keeps a 32-row block of queries in tiles, streams 128 keys at a
// time through an online (running max / running sum) softmax, and accumulates
// P V back into the same fp32 rows. The tile products of the neighbouring
// blocks (the previous one's P V, the next one's Q K^T) are issued between the
// rows of a block's softmax, so the tile unit and the vector units overlap.
//
// Numerics: Q, K, V and the probabilities are rounded to bf16 for the tile
// products (as OpenVINO's bf16 inference precision and PyTorch's bf16 SDPA do);
// scores, the softmax and the output accumulate in fp32.
//
// AMX (Sapphire Rapids and later) is required: the tile products are what make
// it fast, and without them OpenVINO's own attention is the better choice, so
// callers check amx::usable() (common/amx.hpp) first and keep OpenVINO's op otherwise.
#pragma once

#include <cstddef>
#include <string>

namespace numaov::attention {

struct Shape {
    size_t batch, heads, q_len, kv_len, head_dim;
};

// Where element (b, h, s, d) of a tensor lives, in elements: b * batch + h * head
// + s * row + d. Rows are dense along d. Attention reads [B, H, S, D] ("bhsd"),
// but a DiT holds its heads as [B, S, H, D] ("bshd") around the attention; reading
// that directly saves two transposes on the way in and one on the way out.
struct Strides {
    size_t batch, head, row;
};

enum class Layout { bhsd, bshd };

// "bhsd" or "bshd" as a Layout; any other name throws std::invalid_argument naming it.
Layout layout_named(const std::string& name);

Strides strides_of(Layout layout, size_t heads, size_t length, size_t head_dim);

// q, k, v and out share one element type: f32, or bf16 (what OpenVINO's bf16
// inference holds activations in, so no conversion runs around the op).
struct Tensors {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    Strides q_strides, k_strides, v_strides, out_strides;
    bool bf16 = false;
};

// q and out hold Sq rows per (batch, head), k and v Sk rows, each of D values.
// Any Sq, Sk >= 1 and D >= 1 (D is zero-padded to a multiple of 32 inside).
// Runs on the calling thread's OpenVINO/TBB arena. Throws std::runtime_error
// when AMX is not usable, a length is zero or the scale is not finite and > 0.
void flash_attention(const Tensors& tensors, const Shape& shape, float scale);

}  // namespace numaov::attention
