// The expert store: one file per rank holding the routed experts of every MoE
// layer in the kernel's own layout (kernels/moe_kernels.hpp), written by the
// exporter (numaov/custom_ops/expert_store.py) and mapped read-only here, so
// the weights are the page cache's pages, shared by every process that maps
// the file. The IR's MoeExperts nodes name a store (by id) and a layer.
//
// Binary format, version 1 (little-endian; offsets absolute from the start):
//
//   header, 64 bytes at offset 0:
//     0  char[8] magic "NUMAOVXS"     8  u32 version (1)   12 u32 layer_count
//     16 u64 file_size (the whole file: truncation is detected)
//     24 u8[16] store_id (random at export; the graph's store_id attribute is
//        their lowercase hex)          40 u8[24] reserved (0)
//   layer table at offset 64: layer_count entries of 128 bytes, each:
//     0  i64 layer (the model's layer index, unique)
//     8  u32 format (0 f32, 1 bf16, 2 int8, 3 int4, 4 fp8)   12 u32 reserved
//     16 u64 experts E   24 u64 hidden H   32 u64 inter I (this rank's shard)
//     40 u64 gate_up_groups (G of the gate_up scales [E, 2I, G]; 0: no scales)
//     48 u64 down_groups    (G of the down scales [E, H, G]; 0: no scales)
//     56 u64 gate_up_offset        gate_up [E, 2I, H] (int4: H / 2 bytes a row)
//     64 u64 down_offset           down [E, H, I]     (int4: I / 2 bytes a row)
//     72 u64 gate_up_scale_offset  f32 [E, 2I, gate_up_groups] (0: none)
//     80 u64 down_scale_offset     f32 [E, H, down_groups]     (0: none)
//     88 u64 bytes   the layer's span, gate_up_offset to the end of its last region
//     96 u8[16] digest: xxh3-128 of the span (checked by Python; reported here)
//     112 u8[16] reserved
//   regions start at multiples of 4096 (at least 64 is checked); within a
//   layer gate_up, down, then the scales, without overlap; gaps are zero.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/moe_kernels.hpp"

namespace numaov::store {

constexpr char kMagic[8] = {'N', 'U', 'M', 'A', 'O', 'V', 'X', 'S'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr size_t kEntryBytes = 128;
// The least alignment a region's offset must have (the writer uses 4096).
constexpr uint64_t kRegionAlignment = 64;

// A store that cannot be opened, one line: "expert store '<path>': <what is
// wrong>; expected <what>". An invalid_argument, so pybind11 raises ValueError.
class ExpertStoreError : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

// One layer table entry, with its regions' addresses in the mapping.
struct Layer {
    int64_t layer;
    moe::WeightFormat format;
    uint64_t experts, hidden, inter;
    uint64_t gate_up_groups, down_groups;
    uint64_t gate_up_offset, down_offset, gate_up_scale_offset, down_scale_offset;
    uint64_t bytes;
    std::string digest;  // 32 lowercase hex chars
    const void* gate_up;
    const void* down;
    const float* gate_up_scale;  // nullptr for f32 / bf16
    const float* down_scale;
};

class ExpertStore {
public:
    // Parses and maps `path`; throws ExpertStoreError. Not registered: see open_expert_store.
    static std::shared_ptr<ExpertStore> open(const std::string& path);
    ~ExpertStore();
    ExpertStore(const ExpertStore&) = delete;
    ExpertStore& operator=(const ExpertStore&) = delete;

    const std::string& path() const { return path_; }
    const std::string& id() const { return id_; }
    uint64_t bytes() const { return size_; }
    uint32_t version() const { return version_; }
    const std::vector<Layer>& layers() const { return layers_; }
    // The entry of model layer `layer`, nullptr when the store lacks it.
    const Layer* find(int64_t layer) const;
    // The layer indices held, "0, 1, 2" (for messages).
    std::string layer_list() const;
    // Reads one byte of up to `sample_pages` pages spread evenly over the
    // mapping and counts them per NUMA node (move_pages(2) with nodes NULL);
    // key -1: pages whose status is an error (or all of them when the system
    // call fails, e.g. a kernel without NUMA).
    std::map<int, size_t> nodes(size_t sample_pages) const;

private:
    ExpertStore() = default;
    std::string path_, id_;
    uint32_t version_ = 0;
    uint64_t size_ = 0;
    const uint8_t* base_ = nullptr;  // the whole file, PROT_READ, MAP_SHARED
    std::vector<Layer> layers_;
};

// The process-wide registry of open stores, keyed by id (thread safe), shared
// by the Python binding and the MoeExperts op (both in libnumaov.so). Opens
// `path` or returns the open store with the same id; stores stay open for the
// process's life.
std::shared_ptr<const ExpertStore> open_expert_store(const std::string& path);
// The open store of `id` (32 lowercase hex chars), nullptr when none is.
std::shared_ptr<const ExpertStore> find_expert_store(const std::string& id);

// 32 lowercase hex chars of 16 bytes.
std::string hex16(const uint8_t* bytes);

}  // namespace numaov::store
