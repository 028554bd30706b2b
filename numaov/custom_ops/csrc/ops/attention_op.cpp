#include "ops/attention_op.hpp"

#include <sstream>
#include <utility>

#include "kernels/flash_attention.hpp"

namespace numaov {

namespace {

const char* const kNames[] = {"q", "k", "v", "out"};

bool is_bshd(const std::string& layout) { return layout == "bshd"; }

// A [B, H, S, D] shape in the given layout, or back: swapping dims 1 and 2 is
// its own inverse.
template <class ShapeT>
ShapeT as_layout(ShapeT shape, const std::string& layout) {
    if (is_bshd(layout) && shape.rank().is_static()) std::swap(shape[1], shape[2]);
    return shape;
}

ov::Shape as_layout(ov::Shape shape, const std::string& layout) {
    if (is_bshd(layout)) std::swap(shape[1], shape[2]);
    return shape;
}

}  // namespace

FlashAttention::FlashAttention(const ov::Output<ov::Node>& q, const ov::Output<ov::Node>& k,
                               const ov::Output<ov::Node>& v, float scale, std::array<std::string, 4> layouts)
    : Op({q, k, v}),
      m_scale(scale),
      m_layouts(std::move(layouts)) {
    constructor_validate_and_infer_types();
}

bool FlashAttention::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("scale", m_scale);
    visitor.on_attribute("q_layout", m_layouts[0]);
    visitor.on_attribute("k_layout", m_layouts[1]);
    visitor.on_attribute("v_layout", m_layouts[2]);
    visitor.on_attribute("out_layout", m_layouts[3]);
    return true;
}

void FlashAttention::validate_and_infer_types() {
    NODE_VALIDATION_CHECK(this, get_input_size() == 3, "expected 3 inputs (q, k, v), got ", get_input_size());
    NODE_VALIDATION_CHECK(this, m_scale > 0.0f, "attribute 'scale' is ", m_scale, "; expected a positive number");
    for (size_t i = 0; i < 4; ++i) {
        NODE_VALIDATION_CHECK(this, m_layouts[i] == "bhsd" || is_bshd(m_layouts[i]), "attribute '", kNames[i],
                              "_layout' is '", m_layouts[i], "'; expected 'bhsd' or 'bshd'");
    }
    ov::PartialShape shapes[3];
    auto element_type = get_input_element_type(0);
    for (size_t i = 0; i < 3; ++i) {
        const auto& type = get_input_element_type(i);
        NODE_VALIDATION_CHECK(this,
                              type.is_dynamic() || type == ov::element::f32 || type == ov::element::bf16,
                              "input ", kNames[i], " has element type ", type, "; expected f32 or bf16");
        NODE_VALIDATION_CHECK(this, ov::element::Type::merge(element_type, element_type, type), "input ",
                              kNames[i], " has element type ", type, " but q has ", get_input_element_type(0),
                              "; expected one element type for q, k and v");
        const auto& rank = get_input_partial_shape(i).rank();
        NODE_VALIDATION_CHECK(this, rank.is_dynamic() || rank.get_length() == 4, "input ", kNames[i], " has rank ",
                              rank, "; expected 4");
        shapes[i] = as_layout(get_input_partial_shape(i), m_layouts[i]);  // as [B, H, S, D]
    }
    const auto &q = shapes[0], &k = shapes[1], &v = shapes[2];
    if (q.rank().is_static() && k.rank().is_static() && v.rank().is_static()) {
        for (size_t d : {size_t(0), size_t(1), size_t(3)}) {
            NODE_VALIDATION_CHECK(this, q[d].compatible(k[d]) && k[d].compatible(v[d]),
                                  "q, k and v (as [B, H, S, D]) disagree in dim ", d, ": ", q, ", ", k, ", ", v);
        }
        NODE_VALIDATION_CHECK(this, k[2].compatible(v[2]), "k and v disagree in length: ", k, ", ", v);
    }
    set_output_type(0, element_type, as_layout(q, m_layouts[3]));
}

std::shared_ptr<ov::Node> FlashAttention::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    OPENVINO_ASSERT(new_args.size() == 3, "FlashAttention takes 3 inputs, got ", new_args.size());
    return std::make_shared<FlashAttention>(new_args[0], new_args[1], new_args[2], m_scale, m_layouts);
}

bool FlashAttention::has_evaluate() const {
    const auto& type = get_input_element_type(0);
    return type == ov::element::f32 || type == ov::element::bf16;
}

bool FlashAttention::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    ov::Shape shapes[3];
    for (size_t i = 0; i < 3; ++i) {
        OPENVINO_ASSERT(inputs[i].get_shape().size() == 4 && inputs[i].is_continuous(), "FlashAttention '",
                        get_friendly_name(), "': input ", kNames[i], " ", inputs[i].get_shape(),
                        " is not a dense rank-4 tensor");
        shapes[i] = as_layout(inputs[i].get_shape(), m_layouts[i]);
    }
    const auto &q = shapes[0], &k = shapes[1], &v = shapes[2];
    if (k != v || q[0] != k[0] || q[1] != k[1] || q[3] != k[3]) {
        std::ostringstream msg;
        msg << "FlashAttention '" << get_friendly_name() << "': q " << q << ", k " << k << ", v " << v
            << " (as [B, H, S, D]); expected q [B, H, Sq, D] and k, v [B, H, Sk, D]";
        OPENVINO_THROW(msg.str());
    }
    outputs[0].set_shape(as_layout(q, m_layouts[3]));
    const attention::Shape shape{q[0], q[1], q[2], k[2], q[3]};
    auto strides = [&](size_t i, size_t length) {
        return attention::strides_of(attention::layout_named(m_layouts[i]), shape.heads, length, shape.head_dim);
    };
    const auto type = inputs[0].get_element_type();
    for (const auto& t : {inputs[1], inputs[2], outputs[0]}) {
        OPENVINO_ASSERT(t.get_element_type() == type, "FlashAttention '", get_friendly_name(),
                        "': q, k, v and the output must share one element type");
    }
    OPENVINO_ASSERT(type == ov::element::f32 || type == ov::element::bf16, "FlashAttention '",
                    get_friendly_name(), "': element type ", type, "; expected f32 or bf16");
    const attention::Tensors tensors{inputs[0].data(),
                                     inputs[1].data(),
                                     inputs[2].data(),
                                     outputs[0].data(),
                                     strides(0, shape.q_len),
                                     strides(1, shape.kv_len),
                                     strides(2, shape.kv_len),
                                     strides(3, shape.q_len),
                                     type == ov::element::bf16};
    attention::flash_attention(tensors, shape, m_scale);
    return true;
}

}  // namespace numaov
