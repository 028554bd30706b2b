// OpenVINO extension op MoeExperts: the routed experts of a MoE layer, each
// expert that got rows run once over just those rows (kernels/moe_kernels.hpp).
//
// Written by the exporter as node numaov.moe::MoeExperts (numaov/custom_ops/
// moe_ops.py), with the expert weights as inputs: in an IR they are
// Constants, stored in the format the export chose, and the kernel reads
// them in place.
//
//   inputs:  x [N, H] f32|bf16, expert ids [N, k] i64|i32, routing weights
//            [N, k] f32, gate_up [E, 2I, H] and down [E, H, I] in one
//            format: f32, bf16, i8 (int8), or u8 holding packed int4 with
//            the last dim halved (layout in kernels/moe_kernels.hpp); for i8 / u8
//            two more inputs, the f32 scales [E, 2I, G] and [E, H, Gd]
//   output:  [N, H], x's type: sum over slots j of weights[n, j] times
//            expert ids[n, j]'s down(silu(gate x) * up x)
//
// N is anything from 0 rows up. The CPU plugin runs the op through its
// reference path: evaluate() is called once per inference on the stream's
// thread, and the kernel spreads the work over the stream's threads.
#pragma once

#include <openvino/op/op.hpp>

namespace numaov {

class MoeExperts : public ov::op::Op {
public:
    OPENVINO_OP("MoeExperts", "numaov");

    MoeExperts() = default;
    MoeExperts(const ov::OutputVector& args);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool has_evaluate() const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

}  // namespace numaov
