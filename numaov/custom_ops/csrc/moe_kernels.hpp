// The routed experts of a MoE layer as one grouped computation:
//
//   out[n] = sum_j weights[n, j] * down[e] . (silu(gate[e] . x[n]) * (up[e] . x[n])),
//   e = ids[n, j], gate[e] = gate_up[e, :I], up[e] = gate_up[e, I:]
//
// Why our own kernel: an exported graph of standard ops can only either copy a
// weight slice per (row, expert) pair (decode) or run every expert on every row
// (prefill); OpenVINO 2026.4's own MoE fusion does not trigger on DeepSeek's
// pattern (benchmarks/RESULTS.md). Here the (row, slot) pairs are counting-
// sorted by expert, and each expert that got rows reads its weights once, in
// place, for all of its rows: cost follows the routed rows, never the expert
// count (an expert with no rows costs nothing).
//
// Two passes, each split across the OpenVINO/TBB threads of the caller:
//   1. gate/up: work items are (hit expert, block of intermediate columns);
//      each writes silu(gate) * up for its expert's rows into a scratch row
//      per (row, slot) pair.
//   2. down: work items are blocks of output columns; each walks every hit
//      expert and adds weights[n, j] * (its rows . down[e]) into its own
//      columns, so no two threads write one value and no atomics are needed.
//
// Numerics: f32 weights run in f32 (AVX-512 FMA). bf16 weights take the
// activations rounded to bf16 (as PyTorch's bf16 linear and OpenVINO's bf16
// inference do) and accumulate in f32 with AVX512-BF16 dot products, or AMX
// tiles when the CPU has them and an expert has enough rows to fill a tile.
// The sums over slots are f32; the output is rounded once to x's type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace numaov::moe {

enum class WeightFormat { f32, bf16 };

// True when the CPU has AVX-512 F/BW/VL (f32 weights) and AVX512-BF16 (bf16
// weights); the kernel throws naming what is missing otherwise.
std::string unavailable_reason(WeightFormat format);

struct Shape {
    size_t rows;     // N
    size_t top_k;    // k
    size_t experts;  // E
    size_t hidden;   // H
    size_t inter;    // I (this rank's shard)
};

// Dense row-major tensors. x and out share one element type (f32 or bf16);
// gate_up [E, 2I, H] and down [E, H, I] are in `format`.
struct Tensors {
    const void* x;            // [N, H]
    const void* ids;          // [N, k], int64 or int32
    bool ids_int64;
    const float* weights;     // [N, k], routing weights
    const void* gate_up;      // [E, 2I, H]
    const void* down;         // [E, H, I]
    void* out;                // [N, H]
    bool x_bf16;
    WeightFormat format;
};

// Throws std::invalid_argument naming the (row, slot) of an expert id outside
// [0, E), and std::runtime_error when the CPU lacks the instructions.
// Runs on the calling thread's OpenVINO/TBB arena.
void moe_experts(const Tensors& tensors, const Shape& shape);

}  // namespace numaov::moe
