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
// inference do) and accumulate in f32: on AMX tiles (moe_amx.hpp) for experts
// with 2 or more rows where AMX is usable, else on AVX512-BF16: outer products
// against the same packed activations for experts of 16 or more rows, dot
// products below (NUMAOV_MOE_AMX: auto, off, always; read at every call).
// int8, int4 and fp8 weights are weight-only: each weight is widened to its
// exact f32 value as it is read (int8 by conversion, int4 by a 16-entry lookup,
// fp8 through the bits of an IEEE half and F16C's conversion), and the
// activations stay f32. A tile of several rows multiplies each widened weight
// by its group's scale (one multiply for all its rows); a one-row tile (decode)
// sums a group's unscaled products and scales the sum once. Decode is bound by
// reading the weights: it reads 1/4 (int8, fp8) or 1/8 (int4) of the f32 bytes,
// and each tile requests the next block of rows and its scales in software (rows
// of a few KB are too short for the hardware prefetcher), which batched decode's
// tiles of a few rows need as much as one row's. The sums over slots are f32;
// the output is rounded once to x's type.
// With bf16 x, int8 and int4 experts run on AVX512-VNNI instead where the CPU has it
// (NUMAOV_MOE_VNNI; int8_kernel): the activations (x, then each pair's silu(gate) * up) are
// quantized per row in groups of 64 values, q = rint(x * 127 / max|x|), as OpenVINO's CPU
// plugin quantizes those of its own int8 / int4 weights, and each group's products are summed
// exactly in int32, then scaled in f32 (dot_tile_vnni; experts of 16+ rows as outer products,
// outer_rows_int8). Weight scale groups must hold whole 64-value groups (int4's groups of 32
// stay on the f32 path).
// With bf16 x (a bf16 model), fp8 experts run on the bf16 tiles instead once the call
// averages 8 or more rows per expert it reads (Bf16Kernel's fp8_tile_min_rows): each
// block of weight rows is dequantized to
// bf16 once (w * scale rounded to nearest even, as PyTorch dequantizes FP8 weights for a bf16
// model) and serves all of its expert's rows, bit for bit what bf16 stacks holding those
// values give; below that (decode) they stay on the exact path above.
// On AVX2 (kernel_isa) every format is widened to f32 as read, bf16 weights and
// activations included, so the products are those above, summed in another order.
//
// Weight formats (the layout moe_ops.py's quantizer writes):
//   f32, bf16: gate_up [E, 2I, H], down [E, H, I] as they are.
//   int8:      the same shapes in int8, q = round(w / scale), and scales f32
//              [E, rows, G]: G groups of K / G along each row (G = 1: one
//              scale per output channel). K / G is a multiple of 16 when G > 1.
//   int4:      each row of K values packed in K / 2 bytes: block b of 32
//              values is 16 bytes whose low nibbles hold values 32b .. 32b+15
//              and high nibbles 32b+16 .. 32b+31, each stored as q + 8 with q
//              in [-8, 7]; scales f32 [E, rows, G], K / G a multiple of 32.
//   fp8:       the shapes of f32 in float8_e4m3fn bytes (1 sign, 4 exponent bits
//              of bias 7, 3 mantissa bits; subnormals at exponent 0; no
//              infinities; NaN only at S.1111.111; largest 448), w = value *
//              scale, with scales f32 [E, rows, G] as for int8 (K / G a
//              multiple of 16, or G = 1). Each byte's bits moved 7 places up are
//              the IEEE half of its value times 2^-8 (subnormals included; the
//              scale undoes the factor), which F16C widens exactly: DAZ does not
//              apply to half inputs and no denormal f32 arithmetic is involved,
//              so DAZ / FTZ do not change it. DeepSeek-V3's released FP8 experts keep
//              their 128 x 128 block scales as per-row groups of 128 columns
//              (moe_ops.fp8_row_scales).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace numaov::moe {

// The numbers are the expert store's format codes (store/expert_store.hpp).
enum class WeightFormat { f32 = 0, bf16 = 1, int8 = 2, int4 = 3, fp8 = 4 };

// Why the kernel cannot run `format` on this CPU, "" when it can: every format
// runs on AVX-512 F/DQ/BW/VL (bf16 weights: with AVX512-BF16) or on AVX2 with FMA
// and F16C.
std::string unavailable_reason(WeightFormat format);

// The instructions the kernel runs `format` on here under NUMAOV_MOE_ISA (read at
// every call): "avx512" or "avx2". auto (unset): AVX-512 where the CPU has it (and
// AVX512-BF16 for bf16 weights), else AVX2; avx512 / avx2 force one. Throws
// std::invalid_argument for another setting and std::runtime_error when the CPU
// lacks the instructions.
std::string kernel_isa(WeightFormat format);

// "f32", "bf16", "int8", "int4", "fp8".
const char* format_name(WeightFormat format);

// Whether `format` comes with f32 scales (int8, int4, fp8).
bool has_scales(WeightFormat format);

// Throws std::invalid_argument (naming `name`) unless `groups` scale groups
// over rows of K values fit the kernel: int8 / fp8: groups dividing K into
// multiples of 16, or one group; int4: K and K / groups multiples of 32.
void check_groups(WeightFormat format, const char* name, size_t K, size_t groups);

// Which kernel bf16 experts run on here under NUMAOV_MOE_AMX and NUMAOV_MOE_ISA:
// "amx" (experts of at least amx_min_rows rows; fewer on AVX512-BF16),
// "avx512_bf16" (outer products for experts of at least outer_min_rows rows, dot
// products below), "avx2" (widened to f32), or "" when bf16 weights cannot run;
// `reason` says why; fp8_tile_min_rows: the rows per expert from which a bf16
// model's fp8 experts run on these tiles (0: never). Throws
// std::invalid_argument for a setting other than those the two variables take.
struct Bf16Kernel {
    std::string kernel, reason;
    size_t amx_min_rows;
    size_t fp8_tile_min_rows;
    size_t outer_min_rows = 0;
};
Bf16Kernel bf16_kernel();

// Which kernel int8 and int4 experts run on here under NUMAOV_MOE_VNNI (auto, off, always) and
// NUMAOV_MOE_ISA: "vnni" (int8 products against activations quantized per row in groups of
// act_group values: in a bf16 model, or in every model under always), "f32" (weights
// widened to f32), or "" when they cannot run; `reason` says why. Throws
// std::invalid_argument for a setting other than those the variables take.
struct Int8Kernel {
    std::string kernel, reason;
    size_t act_group = 0;
};
Int8Kernel int8_kernel();

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
    bool x_bf16;              // also: the model computes in bf16 (see Numerics)
    WeightFormat format;
    // int8 / int4 / fp8 only: f32 scales [E, 2I, groups_gate_up] and [E, H, groups_down].
    const float* gate_up_scale = nullptr;
    const float* down_scale = nullptr;
    size_t gate_up_groups = 1, down_groups = 1;
};

// Throws std::invalid_argument naming the (row, slot) of an expert id outside
// [0, E) or a group count the format cannot take, and std::runtime_error when
// the CPU lacks the instructions.
// Runs on the calling thread's OpenVINO/TBB arena.
void moe_experts(const Tensors& tensors, const Shape& shape);

// A dense linear on the experts' kernel, for weights OpenVINO's own kernels cannot read in
// their format (fp8: the CPU plugin widens an f8e4m3 constant at compile time and reads it
// as bf16, twice the bytes):
//
//   out[n] = weight . x[n]
//
// x [N, K] and out [N, M] share one element type (f32 or bf16); weight is one expert's down
// stack [M, K] in `format` (with f32 scales [M, groups] for int8 / int4 / fp8), read with the
// experts' numerics, tiles and threads (see Numerics above): each of the N rows is a pair
// of routing weight 1 of that one expert. No bias: the caller adds it.
struct LinearTensors {
    const void* x;    // [N, K]
    void* out;        // [N, M]
    bool x_bf16;      // also: the model computes in bf16
    WeightFormat format;
    const void* weight;           // [M, K]
    const float* scale = nullptr;  // int8 / int4 / fp8: [M, groups]
    size_t groups = 1;
};

// Throws std::invalid_argument for a group count the format cannot take, and
// std::runtime_error when the CPU lacks the instructions.
void linear(const LinearTensors& tensors, size_t rows, size_t in, size_t outs);

}  // namespace numaov::moe
