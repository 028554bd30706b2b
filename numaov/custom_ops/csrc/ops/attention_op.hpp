// OpenVINO extension op FlashAttention: softmax(Q K^T * scale) V on AMX
// (kernels/flash_attention.hpp), for the non-causal, unmasked attention of video DiTs.
//
// Not written by the exporter: the IR stays plain ONNX/OpenVINO and portable.
// The runtime swaps OpenVINO's ScaledDotProductAttention for this op before
// compiling when the CPU has AMX (numaov/custom_ops/flash_attention.py).
//
// Inputs q, k, v and the output share one element type, f32 or bf16, and each
// has its own layout (attributes q_layout, k_layout, v_layout, out_layout):
// "bhsd" is [batch, heads, length, head_dim], "bshd" is [batch, length, heads,
// head_dim]. The swap uses "bshd" where the model transposes to and from it
// around the attention, so those transposes go away. Attribute `scale`: the
// factor applied to Q K^T.
#pragma once

#include <array>
#include <string>

#include <openvino/op/op.hpp>

namespace numaov {

class FlashAttention : public ov::op::Op {
public:
    OPENVINO_OP("FlashAttention", "numaov");

    FlashAttention() = default;
    FlashAttention(const ov::Output<ov::Node>& q, const ov::Output<ov::Node>& k, const ov::Output<ov::Node>& v,
                   float scale, std::array<std::string, 4> layouts);

    void validate_and_infer_types() override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool has_evaluate() const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;

private:
    float m_scale = 1.0f;
    // q, k, v and output layouts, "bhsd" or "bshd"
    std::array<std::string, 4> m_layouts{"bhsd", "bhsd", "bhsd", "bhsd"};
};

}  // namespace numaov
