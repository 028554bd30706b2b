// OpenVINO extension ops for the numaov collectives: AllReduce,
// AllGatherIntoTensor, ReduceScatterTensor and AllToAll.
//
// Each op carries two attributes, `group` (the communicator's name) and
// `world_size`, and nothing else: the communicator itself lives in the
// process-wide registry (communicator/communicator.hpp) that the runtime fills before
// inference, so a compiled model holds no process state and the same IR runs
// on every rank. evaluate() looks the group up on every call, so a group that
// was destroyed and re-created between inferences is picked up, and a missing
// one fails with the registry's "not found" / "destroyed" message.
//
// Failing fast: the peers of a rank are already waiting inside the collective
// when that rank's evaluate() finds something wrong with its own call (a dim 0
// that world_size does not divide, a model exported for another world size, a
// strided input). Such an error marks the group failed before it is thrown,
// as the Python path does, so the peers raise at once, quoting it, instead of
// waiting out NUMAOV_COLL_TIMEOUT_S. An unknown (or destroyed) group is the
// one error that cannot: there is no group in this process to mark. It is
// thrown at once on this rank, naming the op and the groups that do exist;
// the peers, whose group is under the name they were given, stop when this
// rank's process exits or closes its communicators, else at their timeout.
//
// The CPU plugin runs these through its reference path: evaluate() is called
// once per inference on the stream's thread, with dense row-major tensors.
#pragma once

#include <cstdint>
#include <string>

#include <openvino/op/op.hpp>

#include "communicator/communicator.hpp"

namespace numaov {

// Shared by the four ops: the attributes, their IR/ONNX names, type checks
// and the refusal to be constant-folded.
class CollectiveOp : public ov::op::Op {
public:
    OPENVINO_OP("CollectiveOp", "numaov");

    CollectiveOp() = default;
    CollectiveOp(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size);

    // Attribute names match the ONNX attributes of domain numaov.collective,
    // so the ONNX frontend maps them without a name table.
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool has_evaluate() const override;
    // A collective must run on every rank at inference time; folding it at
    // compile time (constant input) would run it on one rank only and hang
    // the others, so it is never folded.
    bool can_constant_fold(const ov::OutputVector& inputs_values) const override;

    const std::string& group() const { return m_group; }
    int64_t world_size() const { return m_world_size; }

protected:
    // Checks the attributes and the input element type; returns the input's
    // partial shape for the op to transform. `splits_dim0`: the gather,
    // scatter and all-to-all ops split dim 0 across ranks, so the input needs one.
    ov::PartialShape validate_common(bool splits_dim0);
    // For the ops whose input dim 0 holds world_size equal blocks
    // (ReduceScatterTensor, AllToAll): refuses a static dim 0 that world_size
    // does not divide, except behind a Constant, where evaluate() checks it
    // (see collective_ops.cpp, validate_blocks).
    void validate_blocks(const ov::Dimension& dim0);

    template <class Concrete>
    std::shared_ptr<ov::Node> clone_as(const ov::OutputVector& new_args) const {
        OPENVINO_ASSERT(new_args.size() == 1, get_type_name(), " takes 1 input, got ", new_args.size());
        return std::make_shared<Concrete>(new_args.at(0), m_group, m_world_size);
    }

    // What evaluate() needs before moving data: the group's communicator,
    // checked against the world size the model was exported for, and the
    // input checked dense and of a supported type.
    struct Call {
        std::shared_ptr<Communicator> comm;
        DType dtype;
        // For a bad input found before the collective runs: marks the group
        // failed (the peers stop at once), then throws CollectiveError(text).
        [[noreturn]] void refuse(const std::string& text) const;
    };
    Call begin_call(const ov::Tensor& input) const;
    // evaluate()'s side of validate_blocks: the elements of one of the
    // world_size blocks of `input` along dim 0; refuses (failing the group)
    // a dim 0 that world_size does not divide.
    size_t block_elements(const Call& call, const ov::Tensor& input) const;

    std::string m_group;
    int64_t m_world_size = 1;
};

// Sum over ranks; the output has the input's shape.
class AllReduce : public CollectiveOp {
public:
    OPENVINO_OP("AllReduce", "numaov", CollectiveOp);

    AllReduce() = default;
    AllReduce(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

// Concatenation of every rank's input along dim 0, in rank order:
// output dim 0 = world_size * input dim 0.
class AllGatherIntoTensor : public CollectiveOp {
public:
    OPENVINO_OP("AllGatherIntoTensor", "numaov", CollectiveOp);

    AllGatherIntoTensor() = default;
    AllGatherIntoTensor(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

// Sum over ranks of the inputs, of which rank r keeps block r along dim 0:
// output dim 0 = input dim 0 / world_size (must divide exactly).
class ReduceScatterTensor : public CollectiveOp {
public:
    OPENVINO_OP("ReduceScatterTensor", "numaov", CollectiveOp);

    ReduceScatterTensor() = default;
    ReduceScatterTensor(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

// Block j of dim 0 goes to rank j; block i of the output comes from rank i
// (torch.distributed's all_to_all_single with equal splits): the output has
// the input's shape, whose dim 0 world_size must divide. Uneven splits are
// not supported (the communicator moves equal blocks only).
class AllToAll : public CollectiveOp {
public:
    OPENVINO_OP("AllToAll", "numaov", CollectiveOp);

    AllToAll() = default;
    AllToAll(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

}  // namespace numaov
