// Types shared by every layer of the native library: the element types the
// collectives move and reduce (DType) and the error every collective, kernel
// and segment call throws (CollectiveError). They live here, below the
// kernels and the communicator, so neither has to include a header above it
// to get them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace numaov {

// Element types the collectives move and reduce. Reductions accumulate in
// fp32 and round back to nearest even. The values are the dtype codes the
// Python binding takes.
enum class DType : uint32_t { f32 = 0, bf16 = 1, f16 = 2 };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

// A collective (or a kernel or segment call made for one) failed: mismatch,
// timeout, peer failure, bad argument. The Python binding maps it onto
// numaov's Python CollectiveError.
class CollectiveError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

}  // namespace numaov
