#include "common/amx.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace numaov::amx {

namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ARCH_REQ_XCOMP_PERM
constexpr int kXfeatureXtiledata = 18;

struct State {
    bool usable = false;
    std::string reason;
};

const State& state() {
    static const State s = [] {
        State out;
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
            out.reason = "the CPU does not report extended features (cpuid leaf 7)";
            return out;
        }
        const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
        const bool avx512_bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 5) & 1);
        if (!amx_tile || !amx_bf16 || !avx512_bf16) {
            out.reason = "the CPU has no AMX-BF16 tiles (Sapphire Rapids or later Xeon needed)";
            return out;
        }
        // Linux hands out the 8 KiB tile state only to processes that ask.
        if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
            out.reason = "the CPU has AMX but the kernel refused this process the tile state (Linux 5.16+ needed)";
            return out;
        }
        out.usable = true;
        return out;
    }();
    return s;
}

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// All eight tiles are 16 rows of 64 bytes (16 fp32, or 32 bf16 as 16 pairs);
// each kernel says which tiles it uses for what.
constexpr TileConfig make_tile_config() {
    TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    return config;
}

// A constant in memory, not a local: GCC 12 drops stores to a local config
// before ldtilecfg (it does not see the instruction read them).
alignas(64) constexpr TileConfig kTileConfig = make_tile_config();

NUMAOV_TARGET_AMX void load_tile_config() { _tile_loadconfig(&kTileConfig); }

NUMAOV_TARGET_AMX void release_tiles() { _tile_release(); }

}  // namespace

bool usable() { return state().usable; }

std::string unavailable_reason() { return state().reason; }

TileSession::TileSession() { load_tile_config(); }

TileSession::~TileSession() { release_tiles(); }

}  // namespace numaov::amx
