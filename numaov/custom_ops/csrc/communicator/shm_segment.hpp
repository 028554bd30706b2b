// The shared-memory segment behind one collective group: its name, its
// layout, and how ranks create, attach to, reclaim and unlink it.
//
// Name: /dev/shm/numaov-u<uid>-<host>-<job id>-<group>, with characters other
// than [A-Za-z0-9._-] replaced and a hash of the exact strings appended when
// anything was replaced or shortened, so different groups never share a name.
//
// Layout (one segment per group, every rank maps all of it):
//
//   offset 0     ControlBlock (one page)
//                  creator_pid, creator_pidns   written with pwrite() right after the
//                                               exclusive create, before anything else
//                  magic                        0 until the creator finished initialising
//                  world_size, half_bytes, oneshot_bytes, total_bytes
//                  attached                     ranks attached so far (atomic)
//                  error_claim, error_flag, error_text   first failure, for every rank
//   next         RankSlot[world_size]
//                  half[0], half[1]   HalfHeader, one cache line each:
//                                     {round, seq, op, dtype, count, root}
//                  pid, pidns, state  owner process; state empty/attached/closed
//   page-aligned data: rank 0 half 0 | rank 0 half 1 | rank 1 half 0 | ... (half_bytes each)
//
// Lifetime:
//   rank 0: shm_open(O_CREAT|O_EXCL, 0600) -> pwrite {pid, pidns} -> posix_fallocate
//           (a full /dev/shm fails here, not with SIGBUS later) -> mmap -> init
//           -> magic = ready (release) -> wait until attached == world_size -> unlink.
//           On EEXIST: a segment whose creator process is dead is unlinked and
//           created again; one whose creator is alive is an error.
//   rank r: poll shm_open(O_RDWR) until the segment exists with magic == ready and a
//           live creator (a segment left by a dead run is skipped; rank 0 reclaims it)
//           -> claim slot r (CAS pid 0 -> own pid) -> attached += 1 -> wait until
//           attached == world_size.
//   After the unlink the name is gone: a crash at any later point leaves nothing in
//   /dev/shm, and a crash before it leaves a segment whose owner is dead, which the
//   launcher reclaims once its ranks have exited (reclaim_if_stale), or else the
//   next run. Only the creator (rank 0) unlinks a live group.
//
// The flag protocol that moves data through the halves is drawn in
// communicator.cpp, next to the code that runs it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace numaov::shm {

constexpr int kMaxWorldSize = 64;
constexpr size_t kErrorTextBytes = 1024;
// "numaovC1": layout version 1. A segment with another value is not ours.
constexpr uint64_t kReadyMagic = 0x31436f76616d756eull;

enum SlotState : uint64_t { kSlotEmpty = 0, kSlotAttached = 1, kSlotClosed = 2 };

struct alignas(64) ControlBlock {
    uint64_t creator_pid;
    uint64_t creator_pidns;
    uint64_t magic;
    uint64_t world_size;
    uint64_t half_bytes;
    uint64_t oneshot_bytes;
    uint64_t total_bytes;
    uint64_t attached;
    alignas(64) uint64_t error_claim;  // 0, or the failing rank + 1 (first failure wins)
    uint64_t error_flag;               // 1 once error_text is complete
    char error_text[kErrorTextBytes];
};

// What a rank announces for one round. `round` is the flag peers wait on; the
// other fields say which collective the round belongs to, so ranks at
// different operations or sizes see a mismatch instead of hanging.
struct alignas(64) HalfHeader {
    uint64_t round;
    uint64_t seq;
    uint32_t op;
    uint32_t dtype;
    uint64_t count;
    int64_t root;
};

struct alignas(64) RankSlot {
    HalfHeader half[2];
    alignas(64) uint64_t pid;
    uint64_t pidns;
    uint64_t state;
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

struct SegmentConfig {
    std::string group;
    std::string job_id;  // already resolved (see resolve_job_id)
    int rank = 0;
    int world_size = 1;
    double timeout_s = 60.0;
    uint64_t half_bytes = 0;     // used by the creator only; others read the segment's
    uint64_t oneshot_bytes = 0;  // used by the creator only; others read the segment's
};

// The job id used in segment names: `job_id` if not empty, else $NUMAOV_JOB_ID,
// else "sid<session id>" — every process one launcher starts shares its session.
std::string resolve_job_id(const std::string& job_id);
std::string segment_name(const std::string& group, const std::string& resolved_job_id);
// Size of a group's segment: header pages plus two halves per rank.
uint64_t segment_bytes(int world_size, uint64_t half_bytes);

// PID namespace of this process (inode of /proc/self/ns/pid, 0 if unknown).
uint64_t own_pid_namespace();
// False only when the process is known to be gone (or a zombie). A process in
// another PID namespace cannot be checked and counts as alive.
bool process_alive(uint64_t pid, uint64_t pidns);
// Unlinks the group's segment if it is still there and its creator is gone;
// true when it did. For a launcher whose ranks have all exited: a segment
// is unlinked once every rank attached, so one still there means a rank died
// (or was stopped) before the group formed. One without its creator's pid is
// unlinked too: only a process of this launcher's could have created it.
bool reclaim_if_stale(const std::string& group, const std::string& resolved_job_id);

class Segment {
public:
    // Creates (rank 0) or attaches (other ranks), then waits until every rank
    // has attached; rank 0 then unlinks the name. Throws CollectiveError.
    explicit Segment(const SegmentConfig& config);
    ~Segment();
    Segment(const Segment&) = delete;
    Segment& operator=(const Segment&) = delete;

    ControlBlock& control() { return *control_; }
    RankSlot& slot(int rank) { return slots_[rank]; }
    uint8_t* half(int rank, uint64_t round) {
        return data_ + (uint64_t(rank) * 2 + (round & 1)) * half_bytes_;
    }
    uint64_t half_bytes() const { return half_bytes_; }
    uint64_t oneshot_bytes() const { return oneshot_bytes_; }
    const std::string& name() const { return name_; }
    // Things worth a log line (a stale segment reclaimed), for the Python side.
    const std::vector<std::string>& notes() const { return notes_; }

    // Records the first failure of the group, so every rank stops; later
    // failures keep the first message.
    void raise_error(int rank, const std::string& text);
    bool error_raised() const;
    std::string error_text() const;
    // Marks this rank's slot closed and unmaps the segment.
    void close();

private:
    void create(const SegmentConfig& config);
    void attach(const SegmentConfig& config);
    void map_fd(int fd, uint64_t bytes);
    void wait_all_attached(const SegmentConfig& config);
    std::string describe(const SegmentConfig& config) const;

    std::string name_;
    bool creator_ = false;
    bool unlinked_ = false;
    uint8_t* base_ = nullptr;
    uint64_t total_bytes_ = 0;
    ControlBlock* control_ = nullptr;
    RankSlot* slots_ = nullptr;
    uint8_t* data_ = nullptr;
    uint64_t half_bytes_ = 0;
    uint64_t oneshot_bytes_ = 0;
    int rank_ = 0;
    std::vector<std::string> notes_;
};

}  // namespace numaov::shm
