#include "store/expert_store.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

namespace numaov::store {

namespace {

template <class T>
T read_le(const uint8_t* p) {
    T value;
    std::memcpy(&value, p, sizeof(T));  // x86-64 is little-endian, as the format
    return value;
}

// a * b (* c), false on overflow.
bool product(uint64_t a, uint64_t b, uint64_t c, uint64_t& out) {
    uint64_t ab;
    return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &out);
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
    throw ExpertStoreError("expert store '" + path + "': " + what);
}

// Bytes of one row of K weights in `format`.
uint64_t row_bytes(moe::WeightFormat format, uint64_t K) {
    switch (format) {
        case moe::WeightFormat::f32: return 4 * K;
        case moe::WeightFormat::bf16: return 2 * K;
        case moe::WeightFormat::int4: return K / 2;
        default: return K;  // int8, fp8
    }
}

// Checks one table entry against the file and fills its addresses.
Layer parse_entry(const std::string& path, const uint8_t* base, uint64_t size, size_t index,
                  uint64_t table_end) {
    const uint8_t* e = base + kHeaderBytes + index * kEntryBytes;
    Layer l{};
    l.layer = read_le<int64_t>(e);
    std::ostringstream where;
    where << "layer " << l.layer << " (table entry " << index << ")";
    const std::string at = where.str();
    const uint32_t code = read_le<uint32_t>(e + 8);
    if (code > uint32_t(moe::WeightFormat::fp8)) {
        fail(path, at + " has weight format code " + std::to_string(code) +
                       "; expected 0 (f32), 1 (bf16), 2 (int8), 3 (int4) or 4 (fp8)");
    }
    l.format = moe::WeightFormat(code);
    l.experts = read_le<uint64_t>(e + 16);
    l.hidden = read_le<uint64_t>(e + 24);
    l.inter = read_le<uint64_t>(e + 32);
    l.gate_up_groups = read_le<uint64_t>(e + 40);
    l.down_groups = read_le<uint64_t>(e + 48);
    l.gate_up_offset = read_le<uint64_t>(e + 56);
    l.down_offset = read_le<uint64_t>(e + 64);
    l.gate_up_scale_offset = read_le<uint64_t>(e + 72);
    l.down_scale_offset = read_le<uint64_t>(e + 80);
    l.bytes = read_le<uint64_t>(e + 88);
    l.digest = hex16(e + 96);
    constexpr uint64_t kLimit = uint64_t(1) << 40;  // keeps every product below in 64 bits
    if (l.experts >= kLimit || l.hidden >= kLimit || l.inter >= kLimit || l.gate_up_groups >= kLimit ||
        l.down_groups >= kLimit) {
        fail(path, at + " has sizes of 2^40 or more; expected a store written by numaov");
    }
    if (!l.experts || !l.hidden || !l.inter) {
        fail(path, at + " has experts " + std::to_string(l.experts) + ", hidden " + std::to_string(l.hidden) +
                       ", inter " + std::to_string(l.inter) + "; expected all three positive");
    }
    const bool scaled = moe::has_scales(l.format);
    const char* name = moe::format_name(l.format);
    if (!scaled) {
        if (l.gate_up_groups || l.down_groups || l.gate_up_scale_offset || l.down_scale_offset) {
            fail(path, at + " holds " + name + " weights with scale groups " + std::to_string(l.gate_up_groups) +
                           " / " + std::to_string(l.down_groups) +
                           "; expected no scales (groups and scale offsets 0) for f32 / bf16");
        }
    } else {
        try {
            moe::check_groups(l.format, "gate_up", l.hidden, l.gate_up_groups);
            moe::check_groups(l.format, "down", l.inter, l.down_groups);
        } catch (const std::invalid_argument& e) {
            fail(path, at + " (" + name + "): " + e.what());
        }
    }
    // The regions in file order, each [offset, offset + bytes).
    struct Region {
        const char* name;
        uint64_t offset, bytes;
    };
    std::vector<Region> regions(2);
    bool sizes_ok = product(l.experts, 2 * l.inter, row_bytes(l.format, l.hidden), regions[0].bytes) &&
                    product(l.experts, l.hidden, row_bytes(l.format, l.inter), regions[1].bytes);
    regions[0].name = "gate_up", regions[0].offset = l.gate_up_offset;
    regions[1].name = "down", regions[1].offset = l.down_offset;
    if (scaled) {
        regions.push_back({"gate_up scales", l.gate_up_scale_offset, 0});
        regions.push_back({"down scales", l.down_scale_offset, 0});
        sizes_ok = sizes_ok && product(l.experts * 2, l.inter, l.gate_up_groups * 4, regions[2].bytes) &&
                   product(l.experts, l.hidden, l.down_groups * 4, regions[3].bytes);
    }
    if (!sizes_ok) {
        fail(path, at + ": sizes overflow 64 bits; expected a store written by numaov");
    }
    uint64_t span_end;
    if (__builtin_add_overflow(l.gate_up_offset, l.bytes, &span_end) || span_end > size) {
        fail(path, at + " spans bytes " + std::to_string(l.gate_up_offset) + " + " + std::to_string(l.bytes) +
                       " of a " + std::to_string(size) + "-byte file; expected its regions inside the file");
    }
    uint64_t previous_end = l.gate_up_offset;
    if (l.gate_up_offset < table_end) {
        fail(path, at + ": gate_up at byte " + std::to_string(l.gate_up_offset) +
                       " overlaps the header and layer table (" + std::to_string(table_end) +
                       " bytes); expected regions after the table");
    }
    for (const Region& r : regions) {
        uint64_t end;
        if (r.offset % kRegionAlignment) {
            fail(path, at + ": " + r.name + " at byte " + std::to_string(r.offset) + "; expected a multiple of " +
                           std::to_string(kRegionAlignment));
        }
        if (r.offset < previous_end || __builtin_add_overflow(r.offset, r.bytes, &end) || end > span_end) {
            fail(path, at + ": " + r.name + " at bytes [" + std::to_string(r.offset) + ", +" +
                           std::to_string(r.bytes) + ") overlaps the region before it or leaves the layer's span [" +
                           std::to_string(l.gate_up_offset) + ", " + std::to_string(span_end) +
                           "); expected gate_up, down, then the scales, in order, inside the span");
        }
        previous_end = end;
    }
    l.gate_up = base + l.gate_up_offset;
    l.down = base + l.down_offset;
    l.gate_up_scale = scaled ? reinterpret_cast<const float*>(base + l.gate_up_scale_offset) : nullptr;
    l.down_scale = scaled ? reinterpret_cast<const float*>(base + l.down_scale_offset) : nullptr;
    return l;
}

struct Registry {
    std::mutex mutex;
    std::unordered_map<std::string, std::shared_ptr<const ExpertStore>> stores;
};

Registry& registry() {
    static Registry* r = new Registry();  // leaked: ops may run during static destruction
    return *r;
}

}  // namespace

std::string hex16(const uint8_t* bytes) {
    static const char digits[] = "0123456789abcdef";
    std::string out(32, '0');
    for (size_t i = 0; i < 16; ++i) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    return out;
}

std::shared_ptr<ExpertStore> ExpertStore::open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(path, std::string("cannot be opened (") + std::strerror(errno) + "); expected a readable file");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        fail(path, "is not a regular file; expected an expert store file");
    }
    const uint64_t size = uint64_t(st.st_size);
    if (size < kHeaderBytes) {
        ::close(fd);
        fail(path, "is " + std::to_string(size) + " bytes, shorter than the " + std::to_string(kHeaderBytes) +
                       "-byte header; expected a numaov expert store");
    }
    void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);  // the mapping keeps the file
    if (mapped == MAP_FAILED) {
        fail(path, std::string("cannot be mapped (") + std::strerror(map_errno) + "); expected a mappable file");
    }
    std::shared_ptr<ExpertStore> store(new ExpertStore());
    store->path_ = path;
    store->size_ = size;
    store->base_ = static_cast<const uint8_t*>(mapped);  // unmapped by the destructor from here on
    const uint8_t* b = store->base_;
    if (std::memcmp(b, kMagic, sizeof kMagic) != 0) {
        fail(path, "is not a numaov expert store; expected the magic bytes \"NUMAOVXS\" at its start");
    }
    store->version_ = read_le<uint32_t>(b + 8);
    if (store->version_ != kVersion) {
        fail(path, "was written with format version " + std::to_string(store->version_) + "; this numaov reads version " +
                       std::to_string(kVersion) + ": re-export the model");
    }
    const uint32_t count = read_le<uint32_t>(b + 12);
    const uint64_t declared = read_le<uint64_t>(b + 16);
    if (declared != size) {
        fail(path, "is truncated or extended: " + std::to_string(size) + " bytes, the header says " +
                       std::to_string(declared) + "; expected the file as the export wrote it");
    }
    store->id_ = hex16(b + 24);
    const uint64_t table_end = kHeaderBytes + uint64_t(count) * kEntryBytes;
    if (table_end > size) {
        fail(path, "has a table of " + std::to_string(count) + " layers ending at byte " + std::to_string(table_end) +
                       " of a " + std::to_string(size) + "-byte file; expected the table inside the file");
    }
    std::set<int64_t> seen;
    for (size_t i = 0; i < count; ++i) {
        Layer l = parse_entry(path, b, size, i, table_end);
        if (!seen.insert(l.layer).second) {
            fail(path, "holds layer " + std::to_string(l.layer) + " twice; expected each layer index once");
        }
        store->layers_.push_back(std::move(l));
    }
    return store;
}

ExpertStore::~ExpertStore() {
    if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const Layer* ExpertStore::find(int64_t layer) const {
    for (const Layer& l : layers_) {
        if (l.layer == layer) return &l;
    }
    return nullptr;
}

std::string ExpertStore::layer_list() const {
    std::string out;
    for (const Layer& l : layers_) out += (out.empty() ? "" : ", ") + std::to_string(l.layer);
    return out.empty() ? "none" : out;
}

std::map<int, size_t> ExpertStore::nodes(size_t sample_pages) const {
    std::map<int, size_t> counts;
    const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
    const uint64_t pages = (size_ + page - 1) / page;
    const size_t n = size_t(std::min<uint64_t>(sample_pages, pages));
    if (n == 0) return counts;
    std::vector<void*> addresses(n);
    std::vector<int> status(n, -1);
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < n; ++i) {
        const uint8_t* p = base_ + (uint64_t(i) * pages / n) * page;
        sink = sink + *static_cast<const volatile uint8_t*>(p);  // make the page resident
        addresses[i] = const_cast<uint8_t*>(p);
    }
    const long rc = ::syscall(SYS_move_pages, 0, static_cast<unsigned long>(n), addresses.data(), nullptr,
                              status.data(), 0);
    for (size_t i = 0; i < n; ++i) ++counts[rc == 0 && status[i] >= 0 ? status[i] : -1];
    return counts;
}

std::shared_ptr<const ExpertStore> open_expert_store(const std::string& path) {
    std::shared_ptr<const ExpertStore> store = ExpertStore::open(path);
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    return r.stores.emplace(store->id(), store).first->second;  // the store opened first when the id was open already (this mapping is dropped)
}

std::shared_ptr<const ExpertStore> find_expert_store(const std::string& id) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.stores.find(id);
    return it == r.stores.end() ? nullptr : it->second;
}

}  // namespace numaov::store
