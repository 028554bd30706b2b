// Creating, attaching, reclaiming and unlinking a group's shared-memory
// segment. The layout and the lifetime are drawn in shm_segment.hpp.
#include "communicator/shm_segment.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/types.hpp"

namespace numaov::shm {
namespace {

constexpr uint64_t kPage = 4096;
// How long a segment may exist without its creator's pid before we call it
// stale: the creator writes the pid microseconds after creating it.
constexpr double kNoPidGraceSeconds = 1.0;
// Construction is not latency-critical: poll the name / the attach count at
// this period.
constexpr long kPollNanoseconds = 200 * 1000;

uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

uint64_t slots_offset() { return round_up(sizeof(ControlBlock), 64); }

uint64_t data_offset(int world_size) {
    return round_up(slots_offset() + uint64_t(world_size) * sizeof(RankSlot), kPage);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void pause_poll() {
    timespec ts{0, kPollNanoseconds};
    nanosleep(&ts, nullptr);
}

std::string errno_text(int err) { return std::string(std::strerror(err)); }

std::string byte_text(uint64_t bytes) {
    std::ostringstream s;
    if (bytes >= (uint64_t(1) << 20))
        s << (bytes >> 20) << " MiB";
    else
        s << bytes << " bytes";
    return s.str();
}

// Keeps [A-Za-z0-9._-], replaces the rest, caps the length; reports whether
// anything changed so the caller can add a hash of the original.
std::string sanitise(const std::string& s, size_t max_len, bool& changed) {
    std::string out;
    for (char c : s) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
        out.push_back(ok ? c : '_');
        if (!ok) changed = true;
    }
    if (out.size() > max_len) {
        out.resize(max_len);
        changed = true;
    }
    return out;
}

uint64_t fnv1a(const std::string& s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) {
        h ^= c;
        h *= 0x100000001b3ull;
    }
    return h;
}

CollectiveError error(const std::string& text) {
    return CollectiveError("numaov collectives: " + text);
}

}  // namespace

std::string resolve_job_id(const std::string& job_id) {
    if (!job_id.empty()) return job_id;
    const char* env = std::getenv("NUMAOV_JOB_ID");
    if (env != nullptr && *env != '\0') return env;
    return "sid" + std::to_string(getsid(0));
}

std::string segment_name(const std::string& group, const std::string& resolved_job_id) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::string uid = std::to_string(getuid());
    bool changed = false;
    std::string name = "/numaov-u" + uid + "-" + sanitise(host, 32, changed) + "-" +
                       sanitise(resolved_job_id, 48, changed) + "-" +
                       sanitise(group, 96, changed);
    if (changed) {
        char hash[24];
        std::snprintf(hash, sizeof(hash), "-%016llx",
                      static_cast<unsigned long long>(fnv1a(
                          uid + '\0' + host + '\0' + resolved_job_id + '\0' + group)));
        name += hash;
    }
    return name;
}

uint64_t segment_bytes(int world_size, uint64_t half_bytes) {
    return data_offset(world_size) + uint64_t(world_size) * 2 * half_bytes;
}

uint64_t own_pid_namespace() {
    static const uint64_t ns = [] {
        struct stat st;
        return stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : uint64_t(0);
    }();
    return ns;
}

bool process_alive(uint64_t pid, uint64_t pidns) {
    if (pid == 0 || pidns != own_pid_namespace()) return true;
    if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return false;
    // A killed child stays a zombie until its parent reaps it: it is gone
    // all the same. /proc/<pid>/stat is "pid (comm) S ...", comm may hold ')'.
    std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
    const size_t close_paren = text.rfind(')');
    if (close_paren == std::string::npos || close_paren + 2 >= text.size()) return true;
    const char state = text[close_paren + 2];
    return state != 'Z' && state != 'X';
}

bool reclaim_if_stale(const std::string& group, const std::string& resolved_job_id) {
    const std::string name = segment_name(group, resolved_job_id);
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) return false;
    uint64_t ids[2] = {0, 0};
    const ssize_t got = pread(fd, ids, sizeof(ids), 0);
    ::close(fd);
    const bool has_pid = got == ssize_t(sizeof(ids)) && ids[0] != 0;
    if (has_pid && process_alive(ids[0], ids[1])) return false;
    return shm_unlink(name.c_str()) == 0;
}

Segment::Segment(const SegmentConfig& config) : rank_(config.rank) {
    name_ = segment_name(config.group, config.job_id);
    try {
        if (config.rank == 0)
            create(config);
        else
            attach(config);
        wait_all_attached(config);
    } catch (...) {
        if (creator_ && !unlinked_) shm_unlink(name_.c_str());
        if (base_ != nullptr) munmap(base_, total_bytes_);
        base_ = nullptr;
        throw;
    }
}

Segment::~Segment() {
    if (creator_ && !unlinked_) shm_unlink(name_.c_str());
    if (base_ != nullptr) munmap(base_, total_bytes_);
}

std::string Segment::describe(const SegmentConfig& config) const {
    return "group '" + config.group + "' (job id '" + config.job_id + "', /dev/shm" + name_ + ")";
}

void Segment::map_fd(int fd, uint64_t bytes) {
    // MAP_POPULATE: fault every page in now, not inside the first collective.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        throw error("cannot map " + byte_text(bytes) + " of /dev/shm" + name_ + ": " +
                    errno_text(errno));
    }
    base_ = static_cast<uint8_t*>(p);
    total_bytes_ = bytes;
}

void Segment::create(const SegmentConfig& config) {
    const int world = config.world_size;
    const uint64_t total = segment_bytes(world, config.half_bytes);
    const auto start = std::chrono::steady_clock::now();
    int fd = -1;
    for (;;) {
        fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd >= 0) break;
        if (errno != EEXIST) {
            throw error("cannot create the shared-memory segment of " + describe(config) + ": " +
                        errno_text(errno));
        }
        // The name is taken: by a live run (an error), or by a dead one (reclaim it).
        const int old = shm_open(name_.c_str(), O_RDONLY, 0);
        if (old < 0) {
            if (errno == ENOENT) continue;  // unlinked meanwhile: try again
            throw error("cannot inspect the existing segment of " + describe(config) + ": " +
                        errno_text(errno));
        }
        uint64_t ids[2] = {0, 0};
        const ssize_t got = pread(old, ids, sizeof(ids), 0);
        ::close(old);
        const bool has_pid = got == ssize_t(sizeof(ids)) && ids[0] != 0;
        if (has_pid && process_alive(ids[0], ids[1])) {
            const std::string who = ids[0] == uint64_t(getpid())
                                        ? "this process"
                                        : "live process " + std::to_string(ids[0]);
            throw error("the shared-memory segment of " + describe(config) + " is in use by " +
                        who + "; expected no other live run with the same group and job id: "
                        "pick another group name or job id (job_id argument or NUMAOV_JOB_ID)");
        }
        if (!has_pid && seconds_since(start) < kNoPidGraceSeconds) {
            pause_poll();  // its creator may be between shm_open and pwrite
            continue;
        }
        shm_unlink(name_.c_str());
        notes_.push_back("reclaimed the stale shared-memory segment /dev/shm" + name_ +
                         (has_pid ? " left by dead process " + std::to_string(ids[0])
                                  : std::string(" left without an owner")));
    }
    creator_ = true;
    // The pid goes in first, so a crash at any later point leaves a segment
    // the next run can recognise as stale.
    const uint64_t ids[2] = {uint64_t(getpid()), own_pid_namespace()};
    if (pwrite(fd, ids, sizeof(ids), 0) != ssize_t(sizeof(ids))) {
        const int err = errno;
        ::close(fd);
        throw error("cannot write to the new segment of " + describe(config) + ": " +
                    errno_text(err));
    }
    // Reserve every page now: a full /dev/shm fails here with a message
    // instead of killing a rank with SIGBUS in the middle of a collective.
    const int rc = posix_fallocate(fd, 0, off_t(total));
    if (rc != 0) {
        ::close(fd);
        throw error("cannot reserve " + byte_text(total) + " in /dev/shm for " +
                    describe(config) + ": " + errno_text(rc) +
                    "; expected that much free space in /dev/shm (see `df -h /dev/shm`): free "
                    "some, or lower NUMAOV_COLL_BUFFER_BYTES (now " +
                    std::to_string(config.half_bytes) + ")");
    }
    try {
        map_fd(fd, total);
    } catch (...) {
        ::close(fd);
        throw;
    }
    ::close(fd);

    control_ = reinterpret_cast<ControlBlock*>(base_);
    slots_ = reinterpret_cast<RankSlot*>(base_ + slots_offset());
    data_ = base_ + data_offset(world);
    half_bytes_ = config.half_bytes;
    oneshot_bytes_ = config.oneshot_bytes;
    // posix_fallocate handed us zeroed pages: only non-zero fields are set.
    control_->world_size = uint64_t(world);
    control_->half_bytes = half_bytes_;
    control_->oneshot_bytes = oneshot_bytes_;
    control_->total_bytes = total;
    slots_[0].pid = uint64_t(getpid());
    slots_[0].pidns = own_pid_namespace();
    slots_[0].state = kSlotAttached;
    control_->attached = 1;
    store_release(&control_->magic, kReadyMagic);
}

void Segment::attach(const SegmentConfig& config) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        if (seconds_since(start) > config.timeout_s) {
            throw error("rank " + std::to_string(config.rank) + " timed out after " +
                        std::to_string(config.timeout_s) + " s waiting for rank 0 to create " +
                        describe(config) +
                        "; expected rank 0 to start with the same group, job id and world size "
                        "(ranks started from different sessions must share NUMAOV_JOB_ID)");
        }
        const int fd = shm_open(name_.c_str(), O_RDWR, 0);
        if (fd < 0) {
            if (errno != ENOENT) {
                throw error("cannot open the shared-memory segment of " + describe(config) +
                            ": " + errno_text(errno));
            }
            pause_poll();
            continue;
        }
        struct stat st;
        uint64_t ids[2] = {0, 0};
        const bool sized = fstat(fd, &st) == 0 && uint64_t(st.st_size) >= data_offset(1);
        const bool has_pid = pread(fd, ids, sizeof(ids), 0) == ssize_t(sizeof(ids)) && ids[0] != 0;
        // Not initialised yet, or left by a dead run (rank 0 reclaims that one).
        if (!sized || !has_pid || !process_alive(ids[0], ids[1])) {
            ::close(fd);
            pause_poll();
            continue;
        }
        try {
            map_fd(fd, uint64_t(st.st_size));
        } catch (...) {
            ::close(fd);
            throw;
        }
        ::close(fd);
        control_ = reinterpret_cast<ControlBlock*>(base_);
        if (load_acquire(&control_->magic) != kReadyMagic) {
            munmap(base_, total_bytes_);
            base_ = nullptr;
            pause_poll();
            continue;
        }
        break;
    }
    const uint64_t world = control_->world_size;
    if (world != uint64_t(config.world_size) || control_->total_bytes != total_bytes_) {
        const std::string text =
            "rank " + std::to_string(config.rank) + " was given world size " +
            std::to_string(config.world_size) + " but rank 0 (pid " +
            std::to_string(control_->creator_pid) + ") created " + describe(config) +
            " for world size " + std::to_string(world) +
            "; expected the same world size on every rank";
        raise_error(config.rank, text);
        throw error(text);
    }
    slots_ = reinterpret_cast<RankSlot*>(base_ + slots_offset());
    data_ = base_ + data_offset(config.world_size);
    half_bytes_ = control_->half_bytes;
    oneshot_bytes_ = control_->oneshot_bytes;

    RankSlot& mine = slots_[config.rank];
    uint64_t expected = 0;
    if (!__atomic_compare_exchange_n(&mine.pid, &expected, uint64_t(getpid()), false,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        const std::string text = "rank " + std::to_string(config.rank) + " of " +
                                 describe(config) + " is already taken by process " +
                                 std::to_string(expected) +
                                 "; expected every rank number exactly once per group";
        raise_error(config.rank, text);
        throw error(text);
    }
    mine.pidns = own_pid_namespace();
    store_release(&mine.state, kSlotAttached);
    __atomic_fetch_add(&control_->attached, 1, __ATOMIC_ACQ_REL);
}

void Segment::wait_all_attached(const SegmentConfig& config) {
    const uint64_t world = uint64_t(config.world_size);
    const auto start = std::chrono::steady_clock::now();
    while (load_acquire(&control_->attached) < world) {
        if (error_raised()) {
            throw error("rank " + std::to_string(config.rank) +
                        " stopped joining because the group failed: " + error_text());
        }
        if (seconds_since(start) > config.timeout_s) {
            std::string missing;
            for (int r = 0; r < config.world_size; ++r) {
                if (load_acquire(&slots_[r].state) == kSlotEmpty)
                    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            }
            const std::string text = "rank " + std::to_string(config.rank) + " timed out after " +
                                     std::to_string(config.timeout_s) +
                                     " s waiting for ranks [" + missing + "] to attach to " +
                                     describe(config);
            raise_error(config.rank, text);
            throw error(text);
        }
        pause_poll();
    }
    if (creator_) {
        // Everyone has it mapped: the name is no longer needed, and without it
        // no crash from now on can leave anything in /dev/shm.
        shm_unlink(name_.c_str());
        unlinked_ = true;
    }
}

void Segment::raise_error(int rank, const std::string& text) {
    if (control_ == nullptr) return;
    uint64_t expected = 0;
    if (__atomic_compare_exchange_n(&control_->error_claim, &expected, uint64_t(rank) + 1, false,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        const size_t n = std::min(text.size(), kErrorTextBytes - 1);
        std::memcpy(control_->error_text, text.data(), n);
        control_->error_text[n] = '\0';
        store_release(&control_->error_flag, 1);
    }
}

bool Segment::error_raised() const {
    return control_ != nullptr && load_acquire(&control_->error_flag) != 0;
}

std::string Segment::error_text() const {
    if (!error_raised()) return std::string();
    const char* text = control_->error_text;
    return std::string(text, strnlen(text, kErrorTextBytes));
}

void Segment::close() {
    if (base_ == nullptr) return;
    store_release(&slots_[rank_].state, kSlotClosed);
    if (creator_ && !unlinked_) {
        shm_unlink(name_.c_str());
        unlinked_ = true;
    }
    munmap(base_, total_bytes_);
    base_ = nullptr;
    control_ = nullptr;
    slots_ = nullptr;
    data_ = nullptr;
}

}  // namespace numaov::shm
