// The shared-memory implementation of numaov::Communicator, declared for the
// Python binding (which needs the extras: seq, segment name, limits, notes).
// Other code should use communicator.hpp only.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator/communicator.hpp"
#include "communicator/shm_segment.hpp"
#include "kernels/reduce_kernels.hpp"

namespace numaov {

// What a rank announces in its round headers, so ranks can tell whether they
// are at the same collective.
enum class Op : uint32_t {
    barrier = 1,
    all_reduce = 2,
    all_gather_into_tensor = 3,
    reduce_scatter_tensor = 4,
    broadcast = 5,
    all_to_all = 6,
};
const char* op_name(Op op);

// Defaults of the environment knobs (README "Environment variables").
constexpr double kDefaultTimeoutSeconds = 60.0;
constexpr uint64_t kDefaultBufferBytes = uint64_t(2) << 20;   // per rank and half
constexpr uint64_t kDefaultOneshotBytes = uint64_t(88) << 10;  // all_reduce one-shot limit (f32)
// 16-bit all_reduces run one-shot only up to oneshot_bytes / this: one-shot
// has every rank sum the whole message, and widening and narrowing 16-bit
// values makes that sum cost more per byte than the f32 one, while the
// two-shot algorithm halves it (see oneshot_limit).
constexpr uint64_t kOneshot16Divisor = 16;
constexpr uint64_t kDefaultStreamBytes = uint64_t(8) << 20;    // non-temporal result stores

class ShmCommunicator final : public Communicator {
public:
    // Blocks until every rank has attached (bounded by the timeout). An empty
    // job_id means $NUMAOV_JOB_ID, else the session id; timeout_s <= 0 means
    // $NUMAOV_COLL_TIMEOUT_S, else 60 s.
    ShmCommunicator(const std::string& name, int rank, int world_size, const std::string& job_id,
                    double timeout_s);
    ~ShmCommunicator() override;

    const std::string& name() const override { return name_; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_; }

    void all_reduce(void* data, uint64_t count, DType dtype) override;
    void all_gather_into_tensor(void* output, const void* input, uint64_t count,
                                DType dtype) override;
    void reduce_scatter_tensor(void* output, const void* input, uint64_t count,
                               DType dtype) override;
    void all_to_all(void* output, const void* input, uint64_t count, DType dtype) override;
    void broadcast(void* data, uint64_t count, DType dtype, int root) override;
    void barrier() override;

    // Local: unmaps the segment; later calls raise "destroyed". Peers waiting
    // on this rank see it closed and stop.
    void close() override;
    bool closed() const;
    // Marks the group failed on every rank (for errors found before the call
    // reaches here, e.g. a bad argument in Python): peers stop instead of
    // waiting out the timeout, and this communicator refuses further calls.
    void fail(const std::string& reason) override;

    const std::string& job_id() const { return job_id_; }
    const std::string& segment_name() const { return segment_name_; }
    double timeout_s() const { return timeout_s_; }
    uint64_t seq() const;
    uint64_t buffer_bytes() const { return buffer_bytes_; }
    uint64_t oneshot_bytes() const { return oneshot_bytes_; }
    // Largest all_reduce of `dtype`, in bytes, that runs one-shot.
    uint64_t oneshot_limit(DType dtype) const {
        return dtype == DType::f32 ? oneshot_bytes_ : oneshot_bytes_ / kOneshot16Divisor;
    }
    const char* isa() const { return kernels::isa_name(isa_); }
    // Elements per chunk (one round) of `op` for `dtype`; for all_reduce, of
    // the reduce-scatter + all-gather algorithm used above oneshot_limit.
    uint64_t chunk_elements(Op op, DType dtype) const;
    const std::vector<std::string>& notes() const { return notes_; }

private:
    struct Call {
        Op op;
        DType dtype;
        uint64_t count;
        int64_t root;
        uint64_t seq;
    };

    template <class Body>
    void run(Op op, DType dtype, uint64_t count, int root, Body&& body);
    void validate(const Call& call) const;

    // The round protocol (drawn in communicator.cpp).
    uint8_t* next_half() { return segment_->half(rank_, round_ + 1); }
    uint8_t* peer_half(int peer) { return segment_->half(peer, round_); }
    void publish(const Call& call);
    void wait_all(const Call& call);
    void wait_slow(int peer, const Call& call, const shm::HalfHeader& header);
    void check_header(int peer, const Call& call, const shm::HalfHeader& header);
    [[noreturn]] void fail_now(const std::string& text);
    [[noreturn]] void stop_for_peer_failure(const Call& call);
    std::string where(const Call& call) const;

    void all_reduce_two_shot(uint8_t* data, const Call& call);
    // Whether results of a collective with this many output bytes are
    // written with non-temporal stores.
    bool streams(uint64_t output_bytes) const { return output_bytes >= stream_bytes_; }

    std::string name_;
    std::string job_id_;
    std::string segment_name_;
    int rank_;
    int world_;
    double timeout_s_;
    uint64_t buffer_bytes_ = 0;
    uint64_t oneshot_bytes_ = 0;
    uint64_t stream_bytes_ = 0;
    std::vector<std::string> notes_;
    kernels::Isa isa_;
    std::unique_ptr<shm::Segment> segment_;

    mutable std::mutex mutex_;  // one collective at a time per process
    uint64_t seq_ = 0;          // collectives issued, including failed ones
    uint64_t round_ = 0;        // last round published
    bool closed_ = false;
    bool failed_ = false;
    std::string failure_;
    std::vector<const void*> sources_;
};

// Bytes of /dev/shm a group of `world_size` ranks takes with the current
// NUMAOV_COLL_BUFFER_BYTES (for `numaov doctor`).
uint64_t shm_segment_bytes(int world_size);

// create_communicator() with the concrete type, for the binding, which
// registers its own object for the group as `frontend` in the same step.
std::shared_ptr<ShmCommunicator> create_shm_communicator(const std::string& name, int rank,
                                                         int world_size,
                                                         const std::string& job_id,
                                                         double timeout_s,
                                                         std::shared_ptr<void> frontend = {});
// Closes `comm` and, if the registry holds it under its name, marks the name
// destroyed.
void close_communicator(const std::shared_ptr<ShmCommunicator>& comm);

}  // namespace numaov
