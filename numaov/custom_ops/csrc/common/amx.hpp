// AMX tiles, shared by the kernels that use them (flash attention, the MoE
// experts' bf16 products): whether this process may use them, the one tile
// configuration every kernel here runs with, and 64-byte aligned buffers.
//
// AMX (Sapphire Rapids and later Xeons) needs two things at run time: the CPU's
// AMX-TILE and AMX-BF16 bits (cpuid leaf 7) and, on Linux, a per-process
// request for the 8 KiB tile-data state (arch_prctl ARCH_REQ_XCOMP_PERM), made
// here once; without the grant the first tile instruction faults.
// The code that issues tile instructions lives in functions with the target
// attribute below, so the library still loads on a CPU without AMX.
#pragma once

#include <cstddef>
#include <new>
#include <string>
#include <vector>

#define NUMAOV_TARGET_AMX \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// GCC's tile intrinsics are asm statements that do not tell the compiler which
// memory they read or write; this barrier keeps ordinary loads and stores of
// the tile buffers on the right side of them.
#define NUMAOV_MEMORY_BARRIER() asm volatile("" ::: "memory")

namespace numaov::amx {

// True when the CPU has AMX-BF16, AMX-TILE and AVX512-BF16 and the kernel
// granted this process the tile state.
bool usable();

// Why usable() is false ("" when it is true), for error messages and doctor.
std::string unavailable_reason();

// A thread's use of the tiles: all eight configured as 16 rows of 64 bytes on
// entry, released on exit (also when an exception leaves the work early).
// Only constructed where usable() is true.
struct TileSession {
    TileSession();
    ~TileSession();
    TileSession(const TileSession&) = delete;
    TileSession& operator=(const TileSession&) = delete;
};

// Every buffer a tile reads or writes starts on a cache line: a tile row that
// straddles two lines makes the load several times slower (benchmarks/RESULTS.md,
// the second flash-attention kernel), and malloc's large blocks are only 16-byte
// aligned.
template <class T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <class U> Aligned64(const Aligned64<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U> bool operator==(const Aligned64<U>&) const { return true; }
    template <class U> bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T>
using Buffer = std::vector<T, Aligned64<T>>;

}  // namespace numaov::amx
