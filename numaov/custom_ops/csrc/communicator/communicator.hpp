// numaov shared-memory communicator: the contract shared by the Python
// binding (binding/python_binding.cpp) and the OpenVINO extension ops.
//
// A group is (name, rank, world_size). Every collective is blocking, works on
// contiguous host memory, and either completes on every rank or throws
// CollectiveError on every rank (mismatch, timeout, peer failure).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/types.hpp"

namespace numaov {

class Communicator {
public:
    virtual ~Communicator() = default;

    virtual const std::string& name() const = 0;
    virtual int rank() const = 0;
    virtual int world_size() const = 0;

    // In place: data (count elements) becomes the element-wise sum over ranks.
    virtual void all_reduce(void* data, uint64_t count, DType dtype) = 0;
    // output holds world_size * count elements; rank r's input lands at r * count.
    virtual void all_gather_into_tensor(void* output, const void* input, uint64_t count,
                                        DType dtype) = 0;
    // input holds world_size * count elements; output (count elements) is the
    // sum over ranks of input[rank * count : (rank + 1) * count].
    virtual void reduce_scatter_tensor(void* output, const void* input, uint64_t count,
                                       DType dtype) = 0;
    // input and output hold world_size * count elements each, in world_size
    // blocks of count: block j of input goes to rank j, and block i of output
    // comes from rank i (its input's block `rank`). Equal blocks only: every
    // rank sends and receives count elements per peer. In place (output ==
    // input) is fine.
    virtual void all_to_all(void* output, const void* input, uint64_t count, DType dtype) = 0;
    // data holds count elements, overwritten on every rank by root's.
    virtual void broadcast(void* data, uint64_t count, DType dtype, int root) = 0;
    virtual void barrier() = 0;
    // For an error found before this rank's collective call (a bad input):
    // marks the group failed so the other ranks, already waiting, raise at
    // once instead of at the timeout. Later calls on this communicator throw.
    // Every transport must say what this means for it, so there is no default.
    virtual void fail(const std::string& reason) = 0;
    // Local: releases the transport; later calls throw "destroyed".
    virtual void close() = 0;
};

// The process-wide group registry: the one place that maps a group name to
// its communicator, for C++ callers (the OpenVINO ops' evaluate(), where the
// group name is the only state that crosses the op boundary) and for the
// Python binding alike.
//
// An entry holds the communicator C++ callers use and, opaque here, the
// object a language binding registered for its own callers (the Python
// communicator object). A transport C++ cannot drive (torch.distributed's
// gloo, registered from Python) has a frontend and no communicator: its name
// is taken for everyone, and C++ lookups of it are refused, naming it.
struct Registration {
    std::shared_ptr<Communicator> comm;
    // Owned by the binding that registered it (its deleter is the binding's);
    // the registry never drops one while holding its lock.
    std::shared_ptr<void> frontend;
    // What registered the name ("ShmCommunicator", "GlooCommunicator"), for messages.
    std::string transport;
};

// create_communicator joins the group (it blocks until all world_size ranks
// have joined, bounded by the timeout) and registers the communicator under
// `name`. An empty job_id means $NUMAOV_JOB_ID, else the session id;
// timeout_s <= 0 means $NUMAOV_COLL_TIMEOUT_S, else 60 s.
std::shared_ptr<Communicator> create_communicator(const std::string& name, int rank,
                                                  int world_size, const std::string& job_id,
                                                  double timeout_s);
// Registers `entry` under `name`. Registering the entry already there (same
// communicator or same frontend) is a no-op; any other is refused: one
// communicator per group name.
void register_communicator(const std::string& name, Registration entry);
// The entry under `name`; throws CollectiveError saying "not found" or "destroyed".
Registration find_registration(const std::string& name);
// The communicator under `name`. Throws CollectiveError saying "not found",
// "destroyed", or that the name belongs to a transport C++ cannot run.
std::shared_ptr<Communicator> find_communicator(const std::string& name);
// Removes the entry, marks the name destroyed, closes its communicator and
// returns the entry (empty when the name was destroyed already, which is
// fine: destroying is idempotent). Throws when the name was never registered.
Registration destroy_communicator(const std::string& name);
// For a communicator closing itself: if the entry under `name` holds `comm`
// or `frontend`, removes it and marks the name destroyed.
void forget_communicator(const std::string& name, const Communicator* comm,
                         const void* frontend);

}  // namespace numaov
