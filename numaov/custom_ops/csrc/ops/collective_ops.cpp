#include "ops/collective_ops.hpp"

#include <cstring>
#include <memory>
#include <sstream>
#include <utility>

#include <openvino/op/constant.hpp>

namespace numaov {

namespace {

bool is_supported_type(const ov::element::Type& type) {
    return type == ov::element::f32 || type == ov::element::bf16 || type == ov::element::f16;
}

DType to_dtype(const ov::element::Type& type) {
    if (type == ov::element::f32) return DType::f32;
    if (type == ov::element::bf16) return DType::bf16;
    if (type == ov::element::f16) return DType::f16;
    throw CollectiveError("numaov collective op: element type " + type.get_type_name() +
                          " is not supported; expected f32, bf16 or f16");
}

// "AllReduce 'node_name'": how errors raised at run time name the op.
std::string describe(const ov::Node& op) {
    return std::string(op.get_type_name()) + " '" + op.get_friendly_name() + "'";
}

}  // namespace

// ---------------------------------------------------------------- CollectiveOp

CollectiveOp::CollectiveOp(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size)
    : Op({arg}),
      m_group(std::move(group)),
      m_world_size(world_size) {}

bool CollectiveOp::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("group", m_group);
    visitor.on_attribute("world_size", m_world_size);
    return true;
}

bool CollectiveOp::has_evaluate() const {
    return is_supported_type(get_input_element_type(0));
}

bool CollectiveOp::can_constant_fold(const ov::OutputVector&) const {
    return false;
}

ov::PartialShape CollectiveOp::validate_common(bool splits_dim0) {
    NODE_VALIDATION_CHECK(this, get_input_size() == 1, "expected exactly one input, got ", get_input_size());
    NODE_VALIDATION_CHECK(this, !m_group.empty(), "attribute 'group' is empty; expected a communicator group name");
    NODE_VALIDATION_CHECK(this, m_world_size >= 1, "attribute 'world_size' is ", m_world_size,
                          "; expected a positive number of ranks");
    const auto& type = get_input_element_type(0);
    NODE_VALIDATION_CHECK(this, type.is_dynamic() || is_supported_type(type), "element type ", type,
                          " is not supported; expected f32, bf16 or f16");
    const auto& shape = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, !splits_dim0 || shape.rank().is_dynamic() || shape.rank().get_length() >= 1,
                          "the input is a scalar; expected at least one dimension (dim 0 is split across ranks)");
    return shape;
}

// At run time the CPU plugin infers a dynamic extension op's shapes by
// calling validate_and_infer_types() on a clone whose inputs are Constants
// holding the run-time tensors. A check failing there would throw before
// evaluate() can mark the group failed, leaving the peers to time out; so
// behind a Constant (run-time shapes, or a literal in the model) the check is
// evaluate()'s (block_elements), and everywhere else (reading, reshaping,
// compiling) it is made here.
void CollectiveOp::validate_blocks(const ov::Dimension& dim0) {
    const bool checked_by_evaluate = ov::is_type<ov::op::v0::Constant>(get_input_node_ptr(0));
    NODE_VALIDATION_CHECK(this, checked_by_evaluate || dim0.is_dynamic() || dim0.get_length() % m_world_size == 0,
                          "input dim 0 is ", dim0, "; expected a multiple of world_size ", m_world_size);
}

void CollectiveOp::Call::refuse(const std::string& text) const {
    comm->fail(text);
    throw CollectiveError(text);
}

CollectiveOp::Call CollectiveOp::begin_call(const ov::Tensor& input) const {
    // The group first: every later error is then reported to the peers too.
    // A missing group has nobody to tell (collective_ops.hpp), so it is only
    // named, at once, with the op that looked for it.
    std::shared_ptr<Communicator> comm;
    try {
        comm = find_communicator(m_group);
    } catch (const CollectiveError& e) {
        throw CollectiveError(describe(*this) + ": " + e.what());
    }
    Call call{std::move(comm), DType::f32};
    // A model exported for 4 ranks running in a group of 2 would move the
    // wrong number of rows.
    if (call.comm->world_size() != m_world_size) {
        std::ostringstream msg;
        msg << describe(*this) << ": the model was exported for world_size " << m_world_size
            << " but communicator group '" << m_group << "' has " << call.comm->world_size()
            << " ranks; expected the same world size (export the model for this group)";
        call.refuse(msg.str());
    }
    // The communicator works on dense memory; the CPU plugin's reference path
    // hands dense tensors, but a strided view would be read wrong silently.
    if (!input.is_continuous()) {
        call.refuse(describe(*this) + ": the input tensor is not contiguous; expected a dense tensor");
    }
    try {
        call.dtype = to_dtype(input.get_element_type());
    } catch (const CollectiveError& e) {
        call.refuse(describe(*this) + ": " + e.what());
    }
    return call;
}

size_t CollectiveOp::block_elements(const Call& call, const ov::Tensor& input) const {
    const ov::Shape& shape = input.get_shape();
    const auto ranks = static_cast<size_t>(m_world_size);
    if (shape.at(0) % ranks != 0) {
        std::ostringstream msg;
        msg << describe(*this) << ": input dim 0 is " << shape[0] << "; expected a multiple of world_size "
            << m_world_size;
        call.refuse(msg.str());
    }
    return input.get_size() / ranks;
}

// ---------------------------------------------------------------- AllReduce

AllReduce::AllReduce(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size)
    : CollectiveOp(arg, std::move(group), world_size) {
    constructor_validate_and_infer_types();
}

void AllReduce::validate_and_infer_types() {
    set_output_type(0, get_input_element_type(0), validate_common(false));
}

std::shared_ptr<ov::Node> AllReduce::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return clone_as<AllReduce>(new_args);
}

bool AllReduce::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    const auto call = begin_call(in);
    out.set_shape(in.get_shape());
    // The communicator reduces in place; the plugin may already have placed
    // the output on the input's memory.
    if (out.data() != in.data()) std::memcpy(out.data(), in.data(), in.get_byte_size());
    call.comm->all_reduce(out.data(), in.get_size(), call.dtype);
    return true;
}

// ---------------------------------------------------------------- AllGatherIntoTensor

AllGatherIntoTensor::AllGatherIntoTensor(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size)
    : CollectiveOp(arg, std::move(group), world_size) {
    constructor_validate_and_infer_types();
}

void AllGatherIntoTensor::validate_and_infer_types() {
    auto shape = validate_common(true);
    // [n, ...] -> [world_size * n, ...]; a dynamic n stays dynamic (an
    // interval is scaled).
    if (shape.rank().is_static()) shape[0] = shape[0] * ov::Dimension(m_world_size);
    set_output_type(0, get_input_element_type(0), shape);
}

std::shared_ptr<ov::Node> AllGatherIntoTensor::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return clone_as<AllGatherIntoTensor>(new_args);
}

bool AllGatherIntoTensor::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    const auto call = begin_call(in);
    ov::Shape shape = in.get_shape();
    shape.at(0) *= static_cast<size_t>(m_world_size);
    out.set_shape(shape);
    call.comm->all_gather_into_tensor(out.data(), in.data(), in.get_size(), call.dtype);
    return true;
}

// ---------------------------------------------------------------- ReduceScatterTensor

ReduceScatterTensor::ReduceScatterTensor(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size)
    : CollectiveOp(arg, std::move(group), world_size) {
    constructor_validate_and_infer_types();
}

void ReduceScatterTensor::validate_and_infer_types() {
    auto shape = validate_common(true);
    // [world_size * n, ...] -> [n, ...]; a dynamic dim 0 stays dynamic and
    // its divisibility is checked by evaluate().
    if (shape.rank().is_static()) {
        auto& dim0 = shape[0];
        validate_blocks(dim0);
        // A static dim 0 is divided exactly (rounded down when evaluate() is to refuse it).
        dim0 = dim0.is_static() ? ov::Dimension(dim0.get_length() / m_world_size) : dim0 / m_world_size;
    }
    set_output_type(0, get_input_element_type(0), shape);
}

std::shared_ptr<ov::Node> ReduceScatterTensor::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return clone_as<ReduceScatterTensor>(new_args);
}

bool ReduceScatterTensor::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    const auto call = begin_call(in);
    const size_t count = block_elements(call, in);
    ov::Shape shape = in.get_shape();
    shape[0] /= static_cast<size_t>(m_world_size);
    out.set_shape(shape);
    call.comm->reduce_scatter_tensor(out.data(), in.data(), count, call.dtype);
    return true;
}

// ---------------------------------------------------------------- AllToAll

AllToAll::AllToAll(const ov::Output<ov::Node>& arg, std::string group, int64_t world_size)
    : CollectiveOp(arg, std::move(group), world_size) {
    constructor_validate_and_infer_types();
}

void AllToAll::validate_and_infer_types() {
    // [world_size * n, ...] -> [world_size * n, ...]: the shape is kept; a
    // dynamic dim 0 stays dynamic and its divisibility is checked by evaluate().
    const auto shape = validate_common(true);
    if (shape.rank().is_static()) validate_blocks(shape[0]);
    set_output_type(0, get_input_element_type(0), shape);
}

std::shared_ptr<ov::Node> AllToAll::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return clone_as<AllToAll>(new_args);
}

bool AllToAll::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    const auto call = begin_call(in);
    const size_t count = block_elements(call, in);
    out.set_shape(in.get_shape());
    // The communicator also runs in place, should the plugin have placed the
    // output on the input's memory.
    call.comm->all_to_all(out.data(), in.data(), count, call.dtype);
    return true;
}

}  // namespace numaov
