#include "moe_op.hpp"

#include <sstream>
#include <stdexcept>

#include "moe_kernels.hpp"

namespace numaov {

namespace {

const char* const kInputs[] = {"x", "expert ids", "routing weights", "gate_up", "down"};
const size_t kRanks[] = {2, 2, 2, 3, 3};

bool is_float(const ov::element::Type& t) { return t == ov::element::f32 || t == ov::element::bf16; }
bool is_index(const ov::element::Type& t) { return t == ov::element::i64 || t == ov::element::i32; }

std::string describe(const ov::Node& op) { return "MoeExperts '" + op.get_friendly_name() + "'"; }

}  // namespace

MoeExperts::MoeExperts(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

bool MoeExperts::visit_attributes(ov::AttributeVisitor&) { return true; }

void MoeExperts::validate_and_infer_types() {
    NODE_VALIDATION_CHECK(this, get_input_size() == 5,
                          "expected 5 inputs (x, expert ids, routing weights, gate_up, down), got ", get_input_size());
    for (size_t i = 0; i < 5; ++i) {
        const auto& rank = get_input_partial_shape(i).rank();
        NODE_VALIDATION_CHECK(this, rank.is_dynamic() || size_t(rank.get_length()) == kRanks[i], "input ",
                              kInputs[i], " has rank ", rank, "; expected ", kRanks[i]);
    }
    const auto &xt = get_input_element_type(0), &idt = get_input_element_type(1), &wt = get_input_element_type(2);
    const auto &gut = get_input_element_type(3), &dt = get_input_element_type(4);
    NODE_VALIDATION_CHECK(this, xt.is_dynamic() || is_float(xt), "x has element type ", xt, "; expected f32 or bf16");
    NODE_VALIDATION_CHECK(this, idt.is_dynamic() || is_index(idt), "expert ids have element type ", idt,
                          "; expected i64 or i32");
    NODE_VALIDATION_CHECK(this, wt.is_dynamic() || wt == ov::element::f32, "routing weights have element type ", wt,
                          "; expected f32");
    NODE_VALIDATION_CHECK(this, gut.is_dynamic() || is_float(gut), "gate_up has element type ", gut,
                          "; expected f32 or bf16");
    NODE_VALIDATION_CHECK(this, gut.is_dynamic() || dt.is_dynamic() || gut == dt, "down has element type ", dt,
                          " but gate_up has ", gut, "; expected one weight format for both");
    const auto &x = get_input_partial_shape(0), &ids = get_input_partial_shape(1), &w = get_input_partial_shape(2);
    const auto &gu = get_input_partial_shape(3), &d = get_input_partial_shape(4);
    if (ids.rank().is_static() && w.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, ids.compatible(w), "expert ids ", ids, " and routing weights ", w,
                              " differ; expected both [N, k]");
    }
    if (x.rank().is_static() && ids.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, x[0].compatible(ids[0]), "x ", x, " and expert ids ", ids,
                              " differ in rows; expected x [N, H] and ids [N, k]");
    }
    if (gu.rank().is_static() && d.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, gu[0].compatible(d[0]), "gate_up ", gu, " and down ", d,
                              " differ in experts; expected [E, 2I, H] and [E, H, I]");
        NODE_VALIDATION_CHECK(this, gu[1].compatible(d[2] * 2) && gu[2].compatible(d[1]), "gate_up ", gu,
                              " and down ", d, " do not fit; expected [E, 2I, H] and [E, H, I]");
    }
    if (x.rank().is_static() && d.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, x[1].compatible(d[1]), "x ", x, " and down ", d,
                              " differ in hidden size; expected x [N, H] and down [E, H, I]");
    }
    ov::PartialShape out = ov::PartialShape::dynamic(2);
    if (x.rank().is_static()) out = x;
    set_output_type(0, xt, out);
}

std::shared_ptr<ov::Node> MoeExperts::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    OPENVINO_ASSERT(new_args.size() == 5, "MoeExperts takes 5 inputs, got ", new_args.size());
    return std::make_shared<MoeExperts>(new_args);
}

bool MoeExperts::has_evaluate() const {
    return is_float(get_input_element_type(0)) && is_float(get_input_element_type(3));
}

bool MoeExperts::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    for (size_t i = 0; i < 5; ++i) {
        OPENVINO_ASSERT(inputs[i].get_shape().size() == kRanks[i] && inputs[i].is_continuous(), describe(*this),
                        ": input ", kInputs[i], " ", inputs[i].get_shape(), " is not a dense rank-", kRanks[i],
                        " tensor");
    }
    const auto &x = inputs[0].get_shape(), &ids = inputs[1].get_shape(), &w = inputs[2].get_shape();
    const auto &gu = inputs[3].get_shape(), &d = inputs[4].get_shape();
    if (ids != w || x[0] != ids[0] || gu[0] != d[0] || gu[1] != 2 * d[2] || gu[2] != d[1] || x[1] != d[1]) {
        std::ostringstream msg;
        msg << describe(*this) << ": x " << x << ", expert ids " << ids << ", routing weights " << w << ", gate_up "
            << gu << ", down " << d << "; expected x [N, H], ids and weights [N, k], gate_up [E, 2I, H], down [E, H, I]";
        OPENVINO_THROW(msg.str());
    }
    const auto xt = inputs[0].get_element_type(), wt = inputs[3].get_element_type();
    OPENVINO_ASSERT(is_float(xt) && is_float(wt) && inputs[4].get_element_type() == wt &&
                        is_index(inputs[1].get_element_type()) && inputs[2].get_element_type() == ov::element::f32,
                    describe(*this), ": element types x ", xt, ", ids ", inputs[1].get_element_type(), ", weights ",
                    inputs[2].get_element_type(), ", gate_up ", wt, ", down ", inputs[4].get_element_type(),
                    "; expected x f32|bf16, ids i64|i32, weights f32, gate_up and down both f32 or both bf16");
    outputs[0].set_shape(x);
    const moe::Tensors tensors{inputs[0].data(),
                               inputs[1].data(),
                               inputs[1].get_element_type() == ov::element::i64,
                               inputs[2].data<const float>(),
                               inputs[3].data(),
                               inputs[4].data(),
                               outputs[0].data(),
                               xt == ov::element::bf16,
                               wt == ov::element::bf16 ? moe::WeightFormat::bf16 : moe::WeightFormat::f32};
    try {
        moe::moe_experts(tensors, {x[0], ids[1], gu[0], x[1], d[2]});
    } catch (const std::exception& e) {
        OPENVINO_THROW(describe(*this), ": ", e.what());
    }
    return true;
}

}  // namespace numaov
