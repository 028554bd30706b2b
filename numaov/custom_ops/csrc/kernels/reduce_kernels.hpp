// Element-wise sum kernels used by the shared-memory collectives.
//
// dst[i] = round(src[0][i] + src[1][i] + ... + src[n-1][i]), added left to
// right in fp32 whatever the element type, then rounded back to the element
// type to nearest even (NaN stays NaN). The order is fixed, so every rank that
// reduces the same inputs gets the same bits, whichever algorithm ran.
//
// The instruction set is picked once at run time (AVX-512 > AVX2 > scalar);
// the library is compiled for baseline x86-64 and each vector kernel carries
// its own target attribute. All three produce identical bits for non-NaN
// results. Tails are exact: nothing is read or written past `count`.
#pragma once

#include <cstdint>

#include "common/types.hpp"

namespace numaov::kernels {

enum class Isa : uint32_t { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
// Throws CollectiveError for a name other than "scalar", "avx2", "avx512".
Isa isa_from_name(const char* name);
// The best instruction set this CPU and OS support.
Isa best_isa();

// `dst` may be one of `srcs` (same index ranges): every source element is
// loaded before the matching destination element is stored. A non-null
// `dst2` (which too may be one of `srcs`) receives a copy of the result,
// made block by block right after each block is summed, while it is still
// in L1: cheaper than a second pass over `dst`.
void reduce_sum(void* dst, const void* const* srcs, int n_srcs, uint64_t count, DType dtype,
                Isa isa, void* dst2 = nullptr);
inline void reduce_sum(void* dst, const void* const* srcs, int n_srcs, uint64_t count,
                       DType dtype) {
    reduce_sum(dst, srcs, n_srcs, count, dtype, best_isa());
}

// memcpy, or with `stream` a copy whose stores bypass the caches
// (non-temporal): for large results written once into memory that no cache
// level could hold anyway, it saves reading each destination line first.
// Ends with a store fence, so the data is ordered before any later flag.
void copy(void* dst, const void* src, uint64_t bytes, bool stream);

}  // namespace numaov::kernels
