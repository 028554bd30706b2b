// Sum kernels for the collectives: scalar, AVX2 and AVX-512 versions of one
// loop, picked at run time. See reduce_kernels.hpp for the contract.
#include "kernels/reduce_kernels.hpp"

// GCC 12 warns about the deliberately undefined source operand inside its own
// AVX-512 intrinsics (GCC bug 105593); the warning is located in the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

// Each vector kernel is compiled for its own instruction set, so the library
// itself needs no -march flag and runs on any x86-64.
#define NUMAOV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NUMAOV_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace numaov::kernels {
namespace {

// ---------------------------------------------------------------------------
// Scalar conversions. They round exactly like the vector instructions below
// (round to nearest even, NaN kept quiet with the top payload bits), so a tail
// or a machine without AVX2 gives the same bits as the vector path.

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

inline float bf16_to_f32(uint16_t h) { return float_of(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) {
        // Inf or NaN; a NaN comes out quiet, as vcvtph2ps makes it.
        return float_of(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
    }
    if (exponent == 0) {
        if (mantissa == 0) return float_of(sign);
        // Subnormal half: shift the leading one up to the implicit bit.
        const int shift = __builtin_clz(mantissa) - 21;
        mantissa = (mantissa << shift) & 0x3ffu;
        exponent = uint32_t(1 - shift);
    }
    return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float f) {
    const uint32_t x = bits_of(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // quiet NaN
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // 65520 and up round to inf
    if (ax >= 0x38800000u) {
        // Normal half: rebias the exponent (-112 << 23, mod 2^32) and round
        // the 13 dropped mantissa bits to nearest even in one add.
        const uint32_t r = ax + 0xc8000fffu + ((ax >> 13) & 1u);
        return uint16_t(sign | (r >> 13));
    }
    if (ax <= 0x33000000u) return sign;  // at most 2^-25: ties to the even zero
    // Subnormal half: value / 2^-24, rounded to nearest even.
    const uint32_t exponent = ax >> 23;
    const uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t r = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
}

template <DType D>
struct ScalarOps;
template <>
struct ScalarOps<DType::f32> {
    using T = float;
    static float load(T v) { return v; }
    static T store(float v) { return v; }
};
template <>
struct ScalarOps<DType::bf16> {
    using T = uint16_t;
    static float load(T v) { return bf16_to_f32(v); }
    static T store(float v) { return f32_to_bf16(v); }
};
template <>
struct ScalarOps<DType::f16> {
    using T = uint16_t;
    static float load(T v) { return f16_to_f32(v); }
    static T store(float v) { return f32_to_f16(v); }
};

template <DType D>
void reduce_scalar(void* dst, const void* const* srcs, int n, uint64_t count) {
    using Ops = ScalarOps<D>;
    using T = typename Ops::T;
    T* out = static_cast<T*>(dst);
    for (uint64_t i = 0; i < count; ++i) {
        float acc = Ops::load(static_cast<const T*>(srcs[0])[i]);
        for (int p = 1; p < n; ++p) acc += Ops::load(static_cast<const T*>(srcs[p])[i]);
        out[i] = Ops::store(acc);
    }
}

// ---------------------------------------------------------------------------
// AVX2: 8 lanes. The tail goes through a zero-padded stack block so the
// vector code (and its rounding) handles it without touching memory past the
// end.

struct Avx2F32 {
    using T = float;
    NUMAOV_TARGET_AVX2 static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
    NUMAOV_TARGET_AVX2 static void store(T* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

struct Avx2F16 {
    using T = uint16_t;
    NUMAOV_TARGET_AVX2 static __m256 load(const T* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    NUMAOV_TARGET_AVX2 static void store(T* p, __m256 v) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
};

template <class V>
NUMAOV_TARGET_AVX2 void reduce_avx2(void* dst, const void* const* srcs, int n, uint64_t count) {
    using T = typename V::T;
    T* out = static_cast<T*>(dst);
    uint64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        const T* s = static_cast<const T*>(srcs[0]) + i;
        __m256 a0 = V::load(s), a1 = V::load(s + 8), a2 = V::load(s + 16), a3 = V::load(s + 24);
        for (int p = 1; p < n; ++p) {
            s = static_cast<const T*>(srcs[p]) + i;
            a0 = _mm256_add_ps(a0, V::load(s));
            a1 = _mm256_add_ps(a1, V::load(s + 8));
            a2 = _mm256_add_ps(a2, V::load(s + 16));
            a3 = _mm256_add_ps(a3, V::load(s + 24));
        }
        V::store(out + i, a0);
        V::store(out + i + 8, a1);
        V::store(out + i + 16, a2);
        V::store(out + i + 24, a3);
    }
    for (; i + 8 <= count; i += 8) {
        __m256 a = V::load(static_cast<const T*>(srcs[0]) + i);
        for (int p = 1; p < n; ++p)
            a = _mm256_add_ps(a, V::load(static_cast<const T*>(srcs[p]) + i));
        V::store(out + i, a);
    }
    if (i < count) {
        const size_t rest = size_t(count - i) * sizeof(T);
        alignas(32) T block[8] = {};
        std::memcpy(block, static_cast<const T*>(srcs[0]) + i, rest);
        __m256 a = V::load(block);
        for (int p = 1; p < n; ++p) {
            std::memcpy(block, static_cast<const T*>(srcs[p]) + i, rest);
            a = _mm256_add_ps(a, V::load(block));
        }
        V::store(block, a);
        std::memcpy(out + i, block, rest);
    }
}

// ---------------------------------------------------------------------------
// AVX-512: 16 lanes, masked loads and stores for the tail.

struct Avx512F32 {
    using T = float;
    NUMAOV_TARGET_AVX512 static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
    NUMAOV_TARGET_AVX512 static __m512 load(const T* p, __mmask16 k) {
        return _mm512_maskz_loadu_ps(k, p);
    }
    NUMAOV_TARGET_AVX512 static void store(T* p, __m512 v) { _mm512_storeu_ps(p, v); }
    NUMAOV_TARGET_AVX512 static void store(T* p, __m512 v, __mmask16 k) {
        _mm512_mask_storeu_ps(p, k, v);
    }
};

struct Avx512F16 {
    using T = uint16_t;
    static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    NUMAOV_TARGET_AVX512 static __m512 load(const T* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    NUMAOV_TARGET_AVX512 static __m512 load(const T* p, __mmask16 k) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
    }
    NUMAOV_TARGET_AVX512 static void store(T* p, __m512 v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRound));
    }
    NUMAOV_TARGET_AVX512 static void store(T* p, __m512 v, __mmask16 k) {
        _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, kRound));
    }
};

template <class V>
NUMAOV_TARGET_AVX512 void reduce_avx512(void* dst, const void* const* srcs, int n,
                                        uint64_t count) {
    using T = typename V::T;
    T* out = static_cast<T*>(dst);
    uint64_t i = 0;
    for (; i + 64 <= count; i += 64) {
        const T* s = static_cast<const T*>(srcs[0]) + i;
        __m512 a0 = V::load(s), a1 = V::load(s + 16), a2 = V::load(s + 32), a3 = V::load(s + 48);
        for (int p = 1; p < n; ++p) {
            s = static_cast<const T*>(srcs[p]) + i;
            a0 = _mm512_add_ps(a0, V::load(s));
            a1 = _mm512_add_ps(a1, V::load(s + 16));
            a2 = _mm512_add_ps(a2, V::load(s + 32));
            a3 = _mm512_add_ps(a3, V::load(s + 48));
        }
        V::store(out + i, a0);
        V::store(out + i + 16, a1);
        V::store(out + i + 32, a2);
        V::store(out + i + 48, a3);
    }
    for (; i < count; i += 16) {
        const uint64_t rest = count - i;
        const __mmask16 k = rest >= 16 ? __mmask16(0xffff) : __mmask16((1u << rest) - 1u);
        __m512 a = V::load(static_cast<const T*>(srcs[0]) + i, k);
        for (int p = 1; p < n; ++p)
            a = _mm512_add_ps(a, V::load(static_cast<const T*>(srcs[p]) + i, k));
        V::store(out + i, a, k);
    }
}

// ---------------------------------------------------------------------------
// bf16 without shuffles. A vector of 32-bit lanes holds two bf16 values per
// lane: the even element in the low half, the odd one in the high half. As
// f32, the even one is the lane shifted left by 16 and the odd one is the
// lane with its low half cleared; both are summed as f32 and rounded with the
// same integer round-to-nearest-even as f32_to_bf16, then OR-ed back into
// place. Element order never changes, so no permutes (which would all queue
// on one execution port) are needed.

NUMAOV_TARGET_AVX512 inline __m512 bf16_even_512(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

NUMAOV_TARGET_AVX512 inline __m512 bf16_odd_512(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// x + 0x7fff + bit 16 of x: the top 16 bits are then x rounded to nearest
// even (f32_to_bf16 without its NaN case).
NUMAOV_TARGET_AVX512 inline __m512i bf16_rne_512(__m512i x) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

// Rounded bf16 of both sums, packed back into 32-bit lanes.
NUMAOV_TARGET_AVX512 inline __m512i bf16_pack_512(__m512 even, __m512 odd) {
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    const __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
    __m512i re = _mm512_srli_epi32(bf16_rne_512(e), 16);
    __m512i ro = _mm512_and_si512(bf16_rne_512(o), high);
    // NaN: keep it, quiet (bit 6 of the bf16), payload truncated.
    const __mmask16 nan_e = _mm512_cmp_ps_mask(even, even, _CMP_UNORD_Q);
    const __mmask16 nan_o = _mm512_cmp_ps_mask(odd, odd, _CMP_UNORD_Q);
    re = _mm512_mask_or_epi32(re, nan_e, _mm512_srli_epi32(e, 16), _mm512_set1_epi32(0x40));
    ro = _mm512_mask_and_epi32(ro, nan_o, _mm512_or_si512(o, _mm512_set1_epi32(0x400000)), high);
    return _mm512_or_si512(re, ro);
}

NUMAOV_TARGET_AVX512 void reduce_bf16_avx512(void* dst, const void* const* srcs, int n,
                                             uint64_t count) {
    auto* out = static_cast<uint16_t*>(dst);
    auto src = [srcs](int p) { return static_cast<const uint16_t*>(srcs[p]); };
    uint64_t i = 0;
    for (; i + 64 <= count; i += 64) {
        const __m512i a = _mm512_loadu_si512(src(0) + i), b = _mm512_loadu_si512(src(0) + i + 32);
        __m512 ea = bf16_even_512(a), oa = bf16_odd_512(a);
        __m512 eb = bf16_even_512(b), ob = bf16_odd_512(b);
        for (int p = 1; p < n; ++p) {
            const __m512i c = _mm512_loadu_si512(src(p) + i);
            const __m512i d = _mm512_loadu_si512(src(p) + i + 32);
            ea = _mm512_add_ps(ea, bf16_even_512(c));
            oa = _mm512_add_ps(oa, bf16_odd_512(c));
            eb = _mm512_add_ps(eb, bf16_even_512(d));
            ob = _mm512_add_ps(ob, bf16_odd_512(d));
        }
        _mm512_storeu_si512(out + i, bf16_pack_512(ea, oa));
        _mm512_storeu_si512(out + i + 32, bf16_pack_512(eb, ob));
    }
    for (; i < count; i += 32) {
        const uint64_t rest = count - i;
        const __mmask32 k = rest >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << rest) - 1u);
        const __m512i a = _mm512_maskz_loadu_epi16(k, src(0) + i);
        __m512 e = bf16_even_512(a), o = bf16_odd_512(a);
        for (int p = 1; p < n; ++p) {
            const __m512i c = _mm512_maskz_loadu_epi16(k, src(p) + i);
            e = _mm512_add_ps(e, bf16_even_512(c));
            o = _mm512_add_ps(o, bf16_odd_512(c));
        }
        _mm512_mask_storeu_epi16(out + i, k, bf16_pack_512(e, o));
    }
}

NUMAOV_TARGET_AVX2 inline __m256 bf16_even_256(__m256i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

NUMAOV_TARGET_AVX2 inline __m256 bf16_odd_256(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}

NUMAOV_TARGET_AVX2 inline __m256i bf16_rne_256(__m256i x) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

NUMAOV_TARGET_AVX2 inline __m256i bf16_pack_256(__m256 even, __m256 odd) {
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    const __m256i e = _mm256_castps_si256(even), o = _mm256_castps_si256(odd);
    __m256i re = _mm256_srli_epi32(bf16_rne_256(e), 16);
    __m256i ro = _mm256_and_si256(bf16_rne_256(o), high);
    // NaN: keep it, quiet (bit 6 of the bf16), payload truncated.
    const __m256i nan_e = _mm256_castps_si256(_mm256_cmp_ps(even, even, _CMP_UNORD_Q));
    const __m256i nan_o = _mm256_castps_si256(_mm256_cmp_ps(odd, odd, _CMP_UNORD_Q));
    const __m256i quiet_e = _mm256_or_si256(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(0x40));
    const __m256i quiet_o = _mm256_and_si256(_mm256_or_si256(o, _mm256_set1_epi32(0x400000)), high);
    re = _mm256_blendv_epi8(re, quiet_e, nan_e);
    ro = _mm256_blendv_epi8(ro, quiet_o, nan_o);
    return _mm256_or_si256(re, ro);
}

NUMAOV_TARGET_AVX2 inline __m256i load_256(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

NUMAOV_TARGET_AVX2 void reduce_bf16_avx2(void* dst, const void* const* srcs, int n,
                                         uint64_t count) {
    auto* out = static_cast<uint16_t*>(dst);
    auto src = [srcs](int p) { return static_cast<const uint16_t*>(srcs[p]); };
    uint64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        __m256i v = load_256(src(0) + i);
        __m256 e = bf16_even_256(v), o = bf16_odd_256(v);
        for (int p = 1; p < n; ++p) {
            v = load_256(src(p) + i);
            e = _mm256_add_ps(e, bf16_even_256(v));
            o = _mm256_add_ps(o, bf16_odd_256(v));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_pack_256(e, o));
    }
    if (i < count) {
        // The tail through a zero-padded block, so nothing past count is touched.
        const size_t rest = size_t(count - i) * sizeof(uint16_t);
        alignas(32) uint16_t block[16] = {};
        std::memcpy(block, src(0) + i, rest);
        __m256i v = load_256(block);
        __m256 e = bf16_even_256(v), o = bf16_odd_256(v);
        for (int p = 1; p < n; ++p) {
            std::memcpy(block, src(p) + i, rest);
            v = load_256(block);
            e = _mm256_add_ps(e, bf16_even_256(v));
            o = _mm256_add_ps(o, bf16_odd_256(v));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(block), bf16_pack_256(e, o));
        std::memcpy(out + i, block, rest);
    }
}

// Non-temporal copy: regular stores up to the first 64-byte boundary of dst,
// streaming stores for whole cache lines, memcpy for the tail.
NUMAOV_TARGET_AVX512 void copy_stream_avx512(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
    const uint64_t head =
        std::min<uint64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
    std::memcpy(dst, src, head);
    uint64_t i = head;
    for (; i + 256 <= bytes; i += 256) {
        const __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
        const __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
    }
    for (; i + 64 <= bytes; i += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
    std::memcpy(dst + i, src + i, bytes - i);
    _mm_sfence();
}

NUMAOV_TARGET_AVX2 void copy_stream_avx2(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
    const uint64_t head =
        std::min<uint64_t>(bytes, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
    std::memcpy(dst, src, head);
    uint64_t i = head;
    for (; i + 128 <= bytes; i += 128) {
        for (int k = 0; k < 128; k += 32) {
            _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + k),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + k)));
        }
    }
    std::memcpy(dst + i, src + i, bytes - i);
    _mm_sfence();
}

bool cpu_has_avx512() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

}  // namespace

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::scalar: return "scalar";
        case Isa::avx2: return "avx2";
        case Isa::avx512: return "avx512";
    }
    return "unknown";
}

Isa isa_from_name(const char* name) {
    const std::string s(name);
    if (s == "scalar") return Isa::scalar;
    if (s == "avx2") return Isa::avx2;
    if (s == "avx512") return Isa::avx512;
    throw CollectiveError("unknown instruction set '" + s +
                          "'; expected 'scalar', 'avx2' or 'avx512'");
}

Isa best_isa() {
    static const Isa isa = [] {
        __builtin_cpu_init();
        if (cpu_has_avx512()) return Isa::avx512;
        if (cpu_has_avx2()) return Isa::avx2;
        return Isa::scalar;
    }();
    return isa;
}

void copy(void* dst, const void* src, uint64_t bytes, bool stream) {
    if (bytes == 0) return;  // an empty tensor may have no address at all
    if (!stream || bytes < 4096) {
        std::memcpy(dst, src, bytes);
        return;
    }
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    switch (best_isa()) {
        case Isa::avx512: return copy_stream_avx512(d, s, bytes);
        case Isa::avx2: return copy_stream_avx2(d, s, bytes);
        case Isa::scalar: std::memcpy(d, s, bytes); return;
    }
}

namespace {

// Blocks of the two-destination reduction: small enough that the copy to the
// second destination reads the first one from L1.
constexpr uint64_t kSecondCopyBlockBytes = 8 << 10;

void reduce_one(void* dst, const void* const* srcs, int n_srcs, uint64_t count, DType dtype,
                Isa isa) {
    switch (isa) {
        case Isa::avx512:
            switch (dtype) {
                case DType::f32: return reduce_avx512<Avx512F32>(dst, srcs, n_srcs, count);
                case DType::bf16: return reduce_bf16_avx512(dst, srcs, n_srcs, count);
                case DType::f16: return reduce_avx512<Avx512F16>(dst, srcs, n_srcs, count);
            }
            break;
        case Isa::avx2:
            switch (dtype) {
                case DType::f32: return reduce_avx2<Avx2F32>(dst, srcs, n_srcs, count);
                case DType::bf16: return reduce_bf16_avx2(dst, srcs, n_srcs, count);
                case DType::f16: return reduce_avx2<Avx2F16>(dst, srcs, n_srcs, count);
            }
            break;
        case Isa::scalar:
            switch (dtype) {
                case DType::f32: return reduce_scalar<DType::f32>(dst, srcs, n_srcs, count);
                case DType::bf16: return reduce_scalar<DType::bf16>(dst, srcs, n_srcs, count);
                case DType::f16: return reduce_scalar<DType::f16>(dst, srcs, n_srcs, count);
            }
            break;
    }
    throw CollectiveError("unsupported dtype code " + std::to_string(uint32_t(dtype)) +
                          "; expected f32 (0), bf16 (1) or f16 (2)");
}

}  // namespace

void reduce_sum(void* dst, const void* const* srcs, int n_srcs, uint64_t count, DType dtype,
                Isa isa, void* dst2) {
    if (count == 0 || n_srcs <= 0) return;
    if (isa > best_isa()) {
        throw CollectiveError(std::string("instruction set ") + isa_name(isa) +
                              " is not available on this CPU; best is " + isa_name(best_isa()));
    }
    if (dst2 == nullptr) return reduce_one(dst, srcs, n_srcs, count, dtype, isa);
    const uint64_t es = dtype_size(dtype);
    const uint64_t block = kSecondCopyBlockBytes / es;
    std::vector<const void*> block_srcs(srcs, srcs + n_srcs);
    for (uint64_t i = 0; i < count; i += block) {
        const uint64_t n = std::min(block, count - i);
        for (int p = 0; p < n_srcs; ++p) {
            block_srcs[p] = static_cast<const uint8_t*>(srcs[p]) + i * es;
        }
        uint8_t* out = static_cast<uint8_t*>(dst) + i * es;
        reduce_one(out, block_srcs.data(), n_srcs, n, dtype, isa);
        std::memcpy(static_cast<uint8_t*>(dst2) + i * es, out, n * es);
    }
}

}  // namespace numaov::kernels
