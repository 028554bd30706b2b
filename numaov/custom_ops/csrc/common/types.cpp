// The shared types' helpers (common/types.hpp).
#include "common/types.hpp"

namespace numaov {

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32: return "f32";
        case DType::bf16: return "bf16";
        case DType::f16: return "f16";
    }
    return "unknown";
}

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::f32: return 4;
        case DType::bf16: return 2;
        case DType::f16: return 2;
    }
    return 0;
}

}  // namespace numaov
