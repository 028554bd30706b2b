// The shared-memory communicator: the round protocol, the collectives built
// on it, and the process-wide registry. The segment itself (name, layout,
// creation, reclaim, unlink) is in shm_segment.hpp/.cpp.
//
// Round protocol
// --------------
// Every collective is a sequence of rounds; round numbers keep counting
// across collectives. Each rank owns two halves of the data area (half
// n % 2 serves round n) and, per half, a HalfHeader whose `round` field is
// the only flag anyone waits on:
//
//        produce(n)                 publish(n)                  wait_all(n)
//   write my half n%2  --->  header{seq, op, dtype, count,  --->  every peer's half n%2
//   (and may read peers'     root}; round = n (release)         shows round == n and the
//    halves of round n-1)                                        same header (acquire)
//                                          |
//                                          v
//                                   consume(n): read peers' halves n%2
//                                   (done before I publish n+1)
//
//   peer half n%2 header.round:  n-2 --(peer publishes n)--> n --(peer publishes n+2)--> n+2
//
// Why nothing is overwritten while someone reads it: I rewrite half n%2 at
// round n+2, which I produce only after wait_all(n+1); every peer publishes
// n+1 only after it has finished consuming round n. So one 64-bit flag per
// half suffices, a fast rank cannot lap a slow one, and after wait_all(n) my
// half (n+1)%2 is already free: the next round's data is produced as soon as
// the current one is consumed (that is the pipelining of chunked transfers).
//
// Safety: the header carries {seq, op, dtype, count, root}; a peer with a
// different header is a mismatch error on every rank, raised at the first
// round of the first differing collective (so it never hangs on it). Every
// wait spins with pause, then yields, then sleeps briefly, and is bounded by
// the timeout; while waiting it watches the group's error flag (any rank's
// failure stops everyone), the peer's slot (closed) and the peer's process
// (exited). After any error the communicator refuses further calls.
//
// Bit-identical results: every sum adds rank 0's value first, then rank 1's,
// ... in fp32 (kernels/reduce_kernels.hpp), whichever rank computes it, so all ranks
// and both all_reduce algorithms give the same bits.
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <xmmintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <set>

#include "communicator/shm_communicator.hpp"

namespace numaov {

using shm::HalfHeader;
using shm::load_acquire;
using shm::store_release;

namespace {

// Spin this long on a flag before yielding: a peer arriving within a few
// microseconds is the common case of a balanced collective.
constexpr double kSpinSeconds = 50e-6;
// After this long, waiting is not latency-critical any more: sleep between
// checks so a rank stuck behind a slow peer does not burn its core.
constexpr double kYieldSeconds = 0.05;
constexpr long kSleepNanoseconds = 100 * 1000;
// How often a long wait checks whether the peer's process still exists.
constexpr double kLivenessPeriodSeconds = 0.02;
constexpr uint64_t kCacheLine = 64;

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

std::string seconds_text(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f s", s);
    return buf;
}

CollectiveError error(const std::string& text) {
    return CollectiveError("numaov collectives: " + text);
}

double env_seconds(const char* name, double fallback) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') return fallback;
    char* end = nullptr;
    const double v = std::strtod(value, &end);
    if (end == value || *end != '\0' || !(v > 0)) {
        throw error(std::string(name) + "='" + value +
                    "' is not a number of seconds; expected a positive number such as 60");
    }
    return v;
}

uint64_t env_bytes(const char* name, uint64_t fallback, uint64_t min, uint64_t max,
                   uint64_t multiple) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') return fallback;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(value, &end, 10);
    if (end == value || *end != '\0' || v < min || v > max || v % multiple != 0) {
        throw error(std::string(name) + "='" + value + "' is not a valid byte count; expected " +
                    "a multiple of " + std::to_string(multiple) + " between " +
                    std::to_string(min) + " and " + std::to_string(max));
    }
    return uint64_t(v);
}

uint64_t buffer_bytes_from_env() {
    return env_bytes("NUMAOV_COLL_BUFFER_BYTES", kDefaultBufferBytes, uint64_t(64) << 10,
                     uint64_t(1) << 40, 4096);
}

// Start of slice `r` when n elements are split over `world` ranks in whole
// cache lines; slices at the end may be short or empty.
struct Slice {
    uint64_t offset;
    uint64_t length;
};

Slice slice_of(uint64_t n, int world, int r, uint64_t elem_size) {
    const uint64_t line = kCacheLine / elem_size;
    const uint64_t per = ceil_div(ceil_div(n, uint64_t(world)), line) * line;
    const uint64_t begin = std::min(uint64_t(r) * per, n);
    return {begin, std::min(begin + per, n) - begin};
}

// Rounds a collective of `count` elements takes in chunks of `chunk`: at
// least one, so even an empty collective synchronises and checks headers.
uint64_t chunk_count(uint64_t count, uint64_t chunk) {
    return std::max<uint64_t>(1, ceil_div(count, chunk));
}

// Elements in chunk j (the last one may be short, or empty when count is 0).
uint64_t chunk_length(uint64_t count, uint64_t chunk, uint64_t j) {
    return std::min(chunk, count - std::min(count, j * chunk));
}

bool overlaps(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes) {
    const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
    return x < y + b_bytes && y < x + a_bytes;
}

// Chunk j of every peer's block of ``in`` (``world`` blocks of ``count`` elements of ``es``
// bytes, in destination order) into the slot for that peer in ``half`` (slots of ``chunk``
// elements): what reduce_scatter_tensor and all_to_all publish each round.
void stage_blocks(uint8_t* half, const uint8_t* in, uint64_t count, uint64_t chunk,
                  uint64_t j, uint64_t es, int world, int rank) {
    const uint64_t n = chunk_length(count, chunk, j);
    for (int d = 0; d < world; ++d) {
        if (d == rank) continue;
        kernels::copy(half + uint64_t(d) * chunk * es, in + (uint64_t(d) * count + j * chunk) * es,
                      n * es, false);
    }
}

}  // namespace

const char* op_name(Op op) {
    switch (op) {
        case Op::barrier: return "barrier";
        case Op::all_reduce: return "all_reduce";
        case Op::all_gather_into_tensor: return "all_gather_into_tensor";
        case Op::reduce_scatter_tensor: return "reduce_scatter_tensor";
        case Op::broadcast: return "broadcast";
        case Op::all_to_all: return "all_to_all";
    }
    return "unknown";
}

uint64_t shm_segment_bytes(int world_size) {
    return shm::segment_bytes(world_size, buffer_bytes_from_env());
}

// ---------------------------------------------------------------------------
// Construction

ShmCommunicator::ShmCommunicator(const std::string& name, int rank, int world_size,
                                 const std::string& job_id, double timeout_s)
    : name_(name), rank_(rank), world_(world_size), isa_(kernels::best_isa()) {
    if (name.empty()) throw error("the group name is empty; expected a non-empty name");
    if (world_size < 1 || world_size > shm::kMaxWorldSize) {
        throw error("world size " + std::to_string(world_size) + " for group '" + name +
                    "'; expected 1 to " + std::to_string(shm::kMaxWorldSize));
    }
    if (rank < 0 || rank >= world_size) {
        throw error("rank " + std::to_string(rank) + " for group '" + name + "' of world size " +
                    std::to_string(world_size) + "; expected 0 to " +
                    std::to_string(world_size - 1));
    }
    timeout_s_ = timeout_s > 0 ? timeout_s
                               : env_seconds("NUMAOV_COLL_TIMEOUT_S", kDefaultTimeoutSeconds);
    job_id_ = shm::resolve_job_id(job_id);
    shm::SegmentConfig config;
    config.group = name;
    config.job_id = job_id_;
    config.rank = rank;
    config.world_size = world_size;
    config.timeout_s = timeout_s_;
    // Only rank 0's values count (the others read them from the segment), so
    // a knob set differently on some rank cannot split the algorithms.
    if (rank == 0) {
        config.half_bytes = buffer_bytes_from_env();
        config.oneshot_bytes = env_bytes("NUMAOV_COLL_ONESHOT_BYTES",
                                         std::min(kDefaultOneshotBytes, config.half_bytes), 0,
                                         config.half_bytes, 1);
    }
    stream_bytes_ = env_bytes("NUMAOV_COLL_STREAM_BYTES", kDefaultStreamBytes, 0,
                              ~uint64_t(0), 1);
    segment_ = std::make_unique<shm::Segment>(config);
    segment_name_ = segment_->name();
    buffer_bytes_ = segment_->half_bytes();
    oneshot_bytes_ = segment_->oneshot_bytes();
    notes_ = segment_->notes();
    sources_.resize(size_t(world_size));
}

ShmCommunicator::~ShmCommunicator() { close(); }

void ShmCommunicator::close() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    segment_->close();
}

bool ShmCommunicator::closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
}

uint64_t ShmCommunicator::seq() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seq_;
}

void ShmCommunicator::fail(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || failed_) return;
    failed_ = true;
    failure_ = "rank " + std::to_string(rank_) + " of group '" + name_ + "' failed: " + reason;
    segment_->raise_error(rank_, failure_);
}

// ---------------------------------------------------------------------------
// The round protocol

std::string ShmCommunicator::where(const Call& call) const {
    return std::string(op_name(call.op)) + " seq " + std::to_string(call.seq) + " of group '" +
           name_ + "'";
}

void ShmCommunicator::fail_now(const std::string& text) {
    failed_ = true;
    failure_ = text;
    segment_->raise_error(rank_, text);
    throw error(text);
}

void ShmCommunicator::stop_for_peer_failure(const Call& call) {
    failed_ = true;
    failure_ = "rank " + std::to_string(rank_) + " stopped at " + where(call) +
               " because the group failed: " + segment_->error_text();
    throw error(failure_);
}

void ShmCommunicator::publish(const Call& call) {
    ++round_;
    HalfHeader& header = segment_->slot(rank_).half[round_ & 1];
    header.seq = call.seq;
    header.op = uint32_t(call.op);
    header.dtype = uint32_t(call.dtype);
    header.count = call.count;
    header.root = call.root;
    store_release(&header.round, round_);
}

void ShmCommunicator::wait_all(const Call& call) {
    for (int peer = 0; peer < world_; ++peer) {
        if (peer == rank_) continue;
        const HalfHeader& header = segment_->slot(peer).half[round_ & 1];
        if (load_acquire(&header.round) < round_) wait_slow(peer, call, header);
        check_header(peer, call, header);
    }
}

void ShmCommunicator::wait_slow(int peer, const Call& call, const HalfHeader& header) {
    const auto start = std::chrono::steady_clock::now();
    double next_liveness_check = kLivenessPeriodSeconds;
    shm::RankSlot& slot = segment_->slot(peer);
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (load_acquire(&header.round) >= round_) return;
            _mm_pause();
        }
        if (segment_->error_raised()) stop_for_peer_failure(call);
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > timeout_s_) {
            // Say where the peer is, from the newer of its two headers.
            const HalfHeader& a = slot.half[0];
            const HalfHeader& b = slot.half[1];
            const HalfHeader& last = load_acquire(&a.round) > load_acquire(&b.round) ? a : b;
            const std::string at =
                last.round == 0 ? std::string("has not started any collective")
                                : std::string("is still at ") + op_name(Op(last.op)) + " seq " +
                                      std::to_string(last.seq);
            fail_now("rank " + std::to_string(rank_) + " timed out after " +
                     seconds_text(timeout_s_) + " at " + where(call) + " waiting for rank " +
                     std::to_string(peer) + ", which " + at +
                     "; expected every rank to reach this collective (NUMAOV_COLL_TIMEOUT_S)");
        }
        if (waited > next_liveness_check) {
            next_liveness_check = waited + kLivenessPeriodSeconds;
            if (load_acquire(&slot.state) == shm::kSlotClosed) {
                fail_now("rank " + std::to_string(rank_) + " at " + where(call) + ": rank " +
                         std::to_string(peer) + " closed its communicator while rank " +
                         std::to_string(rank_) + " waited for it");
            }
            if (!shm::process_alive(slot.pid, slot.pidns)) {
                fail_now("rank " + std::to_string(rank_) + " at " + where(call) + ": rank " +
                         std::to_string(peer) + " (pid " + std::to_string(slot.pid) +
                         ") exited while rank " + std::to_string(rank_) + " waited for it");
            }
        }
        if (waited > kYieldSeconds) {
            timespec ts{0, kSleepNanoseconds};
            nanosleep(&ts, nullptr);
        } else if (waited > kSpinSeconds) {
            sched_yield();
        }
    }
}

void ShmCommunicator::check_header(int peer, const Call& call, const HalfHeader& header) {
    if (header.round == round_ && header.seq == call.seq && header.op == uint32_t(call.op) &&
        header.dtype == uint32_t(call.dtype) && header.count == call.count &&
        header.root == call.root) {
        return;
    }
    auto describe = [](uint32_t op, uint32_t dtype, uint64_t count, int64_t root, uint64_t seq) {
        std::string s = std::string(op_name(Op(op))) + "(count=" + std::to_string(count) +
                        ", dtype=" + dtype_name(DType(dtype));
        if (Op(op) == Op::broadcast) s += ", root=" + std::to_string(root);
        return s + ") at seq " + std::to_string(seq);
    };
    fail_now("collective mismatch in group '" + name_ + "': rank " + std::to_string(rank_) +
             " called " +
             describe(uint32_t(call.op), uint32_t(call.dtype), call.count, call.root, call.seq) +
             " but rank " + std::to_string(peer) + " called " +
             describe(header.op, header.dtype, header.count, header.root, header.seq) +
             "; expected every rank to call the same collectives in the same order with the "
             "same sizes");
}

void ShmCommunicator::validate(const Call& call) const {
    const uint32_t code = uint32_t(call.dtype);
    if (code > uint32_t(DType::f16)) {
        throw error("unsupported dtype code " + std::to_string(code) + " at " + where(call) +
                    "; expected f32 (0), bf16 (1) or f16 (2)");
    }
    // Every byte count below (count * elem * world) must fit in 63 bits.
    const uint64_t limit = (uint64_t(1) << 62) / (dtype_size(call.dtype) * uint64_t(world_));
    if (call.count > limit) {
        throw error("count " + std::to_string(call.count) + " at " + where(call) +
                    " is too large; expected at most " + std::to_string(limit) + " elements");
    }
    if (call.root < 0 || call.root >= world_) {
        throw error("root " + std::to_string(call.root) + " at " + where(call) +
                    "; expected 0 to " + std::to_string(world_ - 1));
    }
}

template <class Body>
void ShmCommunicator::run(Op op, DType dtype, uint64_t count, int root, Body&& body) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
        throw error("the communicator of group '" + name_ +
                    "' was destroyed (closed); expected a live communicator");
    }
    if (failed_) {
        throw error("the communicator of group '" + name_ + "' failed earlier (" + failure_ +
                    "); expected a new communicator after a failure");
    }
    const Call call{op, dtype, count, int64_t(root), ++seq_};
    try {
        validate(call);
        if (segment_->error_raised()) stop_for_peer_failure(call);
        body(call);
    } catch (const CollectiveError& e) {
        if (!failed_) {
            failed_ = true;
            failure_ = e.what();
            segment_->raise_error(rank_, failure_);
        }
        throw;
    }
}

// ---------------------------------------------------------------------------
// Collectives

uint64_t ShmCommunicator::chunk_elements(Op op, DType dtype) const {
    const uint64_t es = dtype_size(dtype);
    const uint64_t world = uint64_t(world_);
    const uint64_t line = kCacheLine / es;
    switch (op) {
        case Op::all_reduce: {
            // The raw chunk plus my reduced slice (chunk / world) fill one
            // half; slices are whole cache lines.
            const uint64_t chunk = buffer_bytes_ / es * world / (world + 1);
            return chunk - chunk % (line * world);
        }
        case Op::reduce_scatter_tensor:
        case Op::all_to_all: {
            // One slot per destination rank.
            const uint64_t chunk = buffer_bytes_ / world / es;
            return chunk - chunk % line;
        }
        case Op::all_gather_into_tensor:
        case Op::broadcast:
            return buffer_bytes_ / es;
        case Op::barrier:
            return 0;
    }
    return 0;
}

void ShmCommunicator::barrier() {
    run(Op::barrier, DType::f32, 0, 0, [&](const Call& call) {
        publish(call);
        wait_all(call);
    });
}

void ShmCommunicator::all_reduce(void* data, uint64_t count, DType dtype) {
    run(Op::all_reduce, dtype, count, 0, [&](const Call& call) {
        auto* bytes = static_cast<uint8_t*>(data);
        const uint64_t size = count * dtype_size(dtype);
        if (world_ == 1) return;
        if (size > oneshot_limit(dtype)) return all_reduce_two_shot(bytes, call);
        // One shot: everyone copies in, then everyone sums everything. One
        // round instead of two; above oneshot_limit the two-shot algorithm's
        // halved summing and halved copy-in win.
        kernels::copy(next_half(), bytes, size, false);
        publish(call);
        wait_all(call);
        for (int p = 0; p < world_; ++p) sources_[size_t(p)] = peer_half(p);
        kernels::reduce_sum(bytes, sources_.data(), world_, count, dtype, isa_);
    });
}

// Reduce-scatter then all-gather, chunk by chunk. Chunk j is split into one
// cache-line-aligned slice per rank. Round j carries, in my half: the raw
// slices of chunk j that the other ranks reduce, and the finished slice of
// chunk j-1 that I reduced; so K chunks take K + 1 rounds.
//
//   my half, round j:  | raw slices of chunk j (mine left empty) | my reduced slice of j-1 |
//                      0                                 chunk * es
//
// Every byte crosses cores once each way (my raw slices out, the others'
// reduced slices in); that cross-core traffic, not the arithmetic, bounds
// the time (the ranks spend only a few percent of it waiting for each
// other). So the reduction writes its result to my half and, block by block
// while it is still in L1, to my output (no second pass over it), and
// results are written with ordinary stores whatever the size: the output is
// the input, whose lines this rank has just read, so a non-temporal store
// would only evict them to memory first.
void ShmCommunicator::all_reduce_two_shot(uint8_t* data, const Call& call) {
    const uint64_t es = dtype_size(call.dtype);
    const uint64_t chunk = chunk_elements(Op::all_reduce, call.dtype);
    const uint64_t reduced_offset = chunk * es;
    const uint64_t count = call.count;
    const uint64_t chunks = ceil_div(count, chunk);  // count > oneshot limit >= 0: at least 1

    auto produce_raw = [&](uint64_t j) {
        const uint64_t n = chunk_length(count, chunk, j);
        uint8_t* half = next_half();
        for (int r = 0; r < world_; ++r) {
            if (r == rank_) continue;
            const Slice s = slice_of(n, world_, r, es);
            kernels::copy(half + s.offset * es, data + (j * chunk + s.offset) * es,
                          s.length * es, false);
        }
    };

    produce_raw(0);
    for (uint64_t j = 0; j <= chunks; ++j) {
        publish(call);
        wait_all(call);
        if (j >= 1) {
            // Gather the other ranks' finished slices of chunk j-1.
            const uint64_t n = chunk_length(count, chunk, j - 1);
            for (int p = 0; p < world_; ++p) {
                if (p == rank_) continue;
                const Slice s = slice_of(n, world_, p, es);
                kernels::copy(data + ((j - 1) * chunk + s.offset) * es,
                              peer_half(p) + reduced_offset, s.length * es, false);
            }
        }
        if (j < chunks) {
            // Reduce my slice of chunk j into my next half, where the others
            // pick it up in the next round, and into my own output.
            const uint64_t n = chunk_length(count, chunk, j);
            const Slice mine = slice_of(n, world_, rank_, es);
            uint8_t* out = data + (j * chunk + mine.offset) * es;
            for (int p = 0; p < world_; ++p) {
                sources_[size_t(p)] = p == rank_ ? out : peer_half(p) + mine.offset * es;
            }
            kernels::reduce_sum(next_half() + reduced_offset, sources_.data(), world_,
                                mine.length, call.dtype, isa_, out);
            if (j + 1 < chunks) produce_raw(j + 1);
        }
    }
}

void ShmCommunicator::reduce_scatter_tensor(void* output, const void* input, uint64_t count,
                                            DType dtype) {
    run(Op::reduce_scatter_tensor, dtype, count, 0, [&](const Call& call) {
        const uint64_t es = dtype_size(dtype);
        auto* out = static_cast<uint8_t*>(output);
        const auto* in = static_cast<const uint8_t*>(input);
        const uint64_t mine_offset = uint64_t(rank_) * count * es;
        // In place (output is this rank's block of input) is fine; other overlaps are not.
        if (out != in + mine_offset &&
            overlaps(out, count * es, in, count * es * uint64_t(world_))) {
            throw error("reduce_scatter_tensor output overlaps its input at " + where(call) +
                        "; expected separate buffers or the output being this rank's block");
        }
        if (world_ == 1) {
            if (out != in) kernels::copy(out, in, count * es, false);
            return;
        }
        // My half holds one slot per destination rank.
        const uint64_t chunk = chunk_elements(Op::reduce_scatter_tensor, dtype);
        const uint64_t chunks = chunk_count(count, chunk);
        auto produce = [&](uint64_t j) {
            stage_blocks(next_half(), in, count, chunk, j, es, world_, rank_);
        };
        produce(0);
        for (uint64_t j = 0; j < chunks; ++j) {
            publish(call);
            wait_all(call);
            const uint64_t n = chunk_length(count, chunk, j);
            for (int p = 0; p < world_; ++p) {
                sources_[size_t(p)] = p == rank_ ? in + mine_offset + j * chunk * es
                                                 : peer_half(p) + uint64_t(rank_) * chunk * es;
            }
            kernels::reduce_sum(out + j * chunk * es, sources_.data(), world_, n, dtype, isa_);
            if (j + 1 < chunks) produce(j + 1);
        }
    });
}

void ShmCommunicator::all_gather_into_tensor(void* output, const void* input, uint64_t count,
                                             DType dtype) {
    run(Op::all_gather_into_tensor, dtype, count, 0, [&](const Call& call) {
        const uint64_t es = dtype_size(dtype);
        auto* out = static_cast<uint8_t*>(output);
        const auto* in = static_cast<const uint8_t*>(input);
        uint8_t* own = out + uint64_t(rank_) * count * es;
        // In place (input is this rank's block of output) is fine; other overlaps are not.
        if (own != in && overlaps(in, count * es, out, count * es * uint64_t(world_))) {
            throw error("all_gather_into_tensor input overlaps its output at " + where(call) +
                        "; expected separate buffers or the input being this rank's block");
        }
        const uint64_t chunk = chunk_elements(Op::all_gather_into_tensor, dtype);
        const uint64_t chunks = chunk_count(count, chunk);
        auto length = [&](uint64_t j) { return chunk_length(count, chunk, j); };
        const bool stream = streams(count * es * uint64_t(world_));
        auto produce = [&](uint64_t j) {
            const uint64_t n = length(j);
            uint8_t* half = next_half();
            kernels::copy(half, in + j * chunk * es, n * es, false);
            // My own block comes from the copy just made, still in this core's
            // cache, rather than from the input a second time.
            if (own != in) kernels::copy(own + j * chunk * es, half, n * es, stream);
        };
        if (world_ == 1) {
            if (own != in) kernels::copy(own, in, count * es, false);
            return;
        }
        produce(0);
        for (uint64_t j = 0; j < chunks; ++j) {
            publish(call);
            wait_all(call);
            const uint64_t n = length(j);
            for (int p = 0; p < world_; ++p) {
                if (p == rank_) continue;
                kernels::copy(out + (uint64_t(p) * count + j * chunk) * es, peer_half(p), n * es,
                              stream);
            }
            if (j + 1 < chunks) produce(j + 1);
        }
    });
}

// My half holds one slot per destination rank, as reduce_scatter_tensor's:
// round j carries chunk j of every block I send, and each rank copies its
// own slot out of every peer's half.
//
//   my half, round j:  | to rank 0 | to rank 1 | ... | to rank w-1 |   (my own slot unused)
//                      0         chunk * es
//
// A copy, not a sum: every rank receives its peers' bytes unchanged, so the
// result is bit-identical to any transport's. My own block goes straight from
// input to output. In place (output == input) is safe: chunk j of every
// block is copied into my half before round j is published, and round j
// overwrites only chunk j of the output's blocks, which is chunk j of the
// input's.
void ShmCommunicator::all_to_all(void* output, const void* input, uint64_t count,
                                 DType dtype) {
    run(Op::all_to_all, dtype, count, 0, [&](const Call& call) {
        const uint64_t es = dtype_size(dtype);
        const uint64_t block_bytes = count * es;
        const uint64_t total = block_bytes * uint64_t(world_);
        auto* out = static_cast<uint8_t*>(output);
        const auto* in = static_cast<const uint8_t*>(input);
        if (out != in && overlaps(out, total, in, total)) {
            throw error("all_to_all output overlaps its input at " + where(call) +
                        "; expected separate buffers or the very same buffer (in place)");
        }
        const uint64_t mine = uint64_t(rank_) * block_bytes;
        const bool stream = streams(total);
        if (out != in) kernels::copy(out + mine, in + mine, block_bytes, stream);
        if (world_ == 1) return;
        const uint64_t chunk = chunk_elements(Op::all_to_all, dtype);
        const uint64_t chunks = chunk_count(count, chunk);
        auto produce = [&](uint64_t j) {
            stage_blocks(next_half(), in, count, chunk, j, es, world_, rank_);
        };
        produce(0);
        for (uint64_t j = 0; j < chunks; ++j) {
            publish(call);
            wait_all(call);
            const uint64_t n = chunk_length(count, chunk, j);
            for (int p = 0; p < world_; ++p) {
                if (p == rank_) continue;
                kernels::copy(out + uint64_t(p) * block_bytes + j * chunk * es,
                              peer_half(p) + uint64_t(rank_) * chunk * es, n * es, stream);
            }
            if (j + 1 < chunks) produce(j + 1);
        }
    });
}

void ShmCommunicator::broadcast(void* data, uint64_t count, DType dtype, int root) {
    run(Op::broadcast, dtype, count, root, [&](const Call& call) {
        if (world_ == 1) return;
        const uint64_t es = dtype_size(dtype);
        auto* bytes = static_cast<uint8_t*>(data);
        const uint64_t chunk = chunk_elements(Op::broadcast, dtype);
        const bool stream = streams(count * es);
        const uint64_t chunks = chunk_count(count, chunk);
        auto length = [&](uint64_t j) { return chunk_length(count, chunk, j); };
        auto produce = [&](uint64_t j) {
            if (rank_ == root)
                kernels::copy(next_half(), bytes + j * chunk * es, length(j) * es, false);
        };
        produce(0);
        for (uint64_t j = 0; j < chunks; ++j) {
            publish(call);
            wait_all(call);
            if (rank_ != root)
                kernels::copy(bytes + j * chunk * es, peer_half(root), length(j) * es, stream);
            if (j + 1 < chunks) produce(j + 1);
        }
    });
}

// ---------------------------------------------------------------------------
// Registry
//
// Entries leave the map under the lock but are dropped after it is released:
// dropping a frontend runs the binding's deleter (which takes Python's GIL),
// and closing a communicator waits for its collective lock.

namespace {

std::mutex g_registry_mutex;
std::map<std::string, Registration> g_registry;
std::set<std::string> g_destroyed;

bool same_entry(const Registration& a, const Registration& b) {
    return (a.comm != nullptr && a.comm == b.comm) ||
           (a.frontend != nullptr && a.frontend == b.frontend);
}

CollectiveError name_taken(const std::string& name, const Registration& existing) {
    return error("collective group '" + name +
                 "' already has a communicator in this process (a " + existing.transport +
                 "); expected a new name, or destroy the old communicator first");
}

// Throws name_taken() if `name` is registered to something other than `entry`;
// returns whether `entry` itself is already there. Call under the lock.
bool check_name_free(const std::string& name, const Registration& entry) {
    const auto it = g_registry.find(name);
    if (it == g_registry.end()) return false;
    if (same_entry(it->second, entry)) return true;
    throw name_taken(name, it->second);
}

}  // namespace

std::shared_ptr<ShmCommunicator> create_shm_communicator(const std::string& name, int rank,
                                                         int world_size,
                                                         const std::string& job_id,
                                                         double timeout_s,
                                                         std::shared_ptr<void> frontend) {
    Registration entry{nullptr, std::move(frontend), "ShmCommunicator"};
    {
        // Refused before joining, so the peers never count a rank that then gives up.
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        check_name_free(name, {});
    }
    // Creation waits for the other ranks: not under the registry lock.
    auto comm = std::make_shared<ShmCommunicator>(name, rank, world_size, job_id, timeout_s);
    entry.comm = comm;
    try {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        check_name_free(name, {});
        g_registry[name] = std::move(entry);
        g_destroyed.erase(name);
    } catch (const CollectiveError&) {
        comm->close();  // taken while this rank was joining
        throw;
    }
    return comm;
}

std::shared_ptr<Communicator> create_communicator(const std::string& name, int rank,
                                                  int world_size, const std::string& job_id,
                                                  double timeout_s) {
    return create_shm_communicator(name, rank, world_size, job_id, timeout_s);
}

void register_communicator(const std::string& name, Registration entry) {
    if (entry.comm == nullptr && entry.frontend == nullptr) {
        throw error("cannot register collective group '" + name +
                    "' without a communicator; expected a communicator object");
    }
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    if (check_name_free(name, entry)) return;
    g_registry.emplace(name, entry);  // a copy: `entry` itself is dropped after the lock
    g_destroyed.erase(name);
}

namespace {

// The entry under `name`, or the "destroyed" / "not found" error. Call under the lock.
const Registration& lookup(const std::string& name) {
    const auto it = g_registry.find(name);
    if (it != g_registry.end()) return it->second;
    if (g_destroyed.count(name) != 0) {
        throw error("the communicator of collective group '" + name +
                    "' was destroyed; expected a live communicator for that group");
    }
    std::string known;
    for (const auto& e : g_registry) known += (known.empty() ? "'" : ", '") + e.first + "'";
    throw error("collective group '" + name + "' not found in this process (known: " +
                (known.empty() ? std::string("none") : known) +
                "); expected its communicator created before the model runs");
}

}  // namespace

Registration find_registration(const std::string& name) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    return lookup(name);
}

std::shared_ptr<Communicator> find_communicator(const std::string& name) {
    // Only the communicator is copied out: a C++ caller (an inference thread)
    // never ends up holding, and so dropping, a binding's frontend.
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    const Registration& entry = lookup(name);
    if (entry.comm == nullptr) {
        // Explicit rather than "not found": the name exists, for another transport.
        throw error("collective group '" + name + "' is a " + entry.transport +
                    ", registered from Python, which numaov's C++ collectives (the OpenVINO "
                    "ops) cannot run; expected a ShmCommunicator for that group");
    }
    return entry.comm;
}

Registration destroy_communicator(const std::string& name) {
    Registration entry;
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        const auto it = g_registry.find(name);
        if (it == g_registry.end()) {
            if (g_destroyed.count(name) != 0) return {};
            throw error("cannot destroy collective group '" + name +
                        "': not found in this process");
        }
        entry = std::move(it->second);
        g_registry.erase(it);
        g_destroyed.insert(name);
    }
    if (entry.comm != nullptr) entry.comm->close();
    return entry;
}

void forget_communicator(const std::string& name, const Communicator* comm,
                         const void* frontend) {
    Registration entry;
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    const auto it = g_registry.find(name);
    if (it == g_registry.end()) return;
    const Registration& held = it->second;
    if ((comm != nullptr && held.comm.get() == comm) ||
        (frontend != nullptr && held.frontend.get() == frontend)) {
        entry = std::move(it->second);  // declared before the lock: dropped after it
        g_registry.erase(it);
        g_destroyed.insert(name);
    }
}

void close_communicator(const std::shared_ptr<ShmCommunicator>& comm) {
    forget_communicator(comm->name(), comm.get(), nullptr);
    comm->close();
}

}  // namespace numaov
