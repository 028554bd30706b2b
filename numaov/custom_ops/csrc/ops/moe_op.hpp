// OpenVINO extension op MoeExperts: the routed experts of a MoE layer, each
// expert that got rows run once over just those rows (kernels/moe_kernels.hpp).
//
// Written by the exporter as node numaov.moe::MoeExperts (numaov/custom_ops/
// moe_ops.py). It has two faces that run the same kernel on the same bytes:
//
// constant face: the expert weights are inputs; in an IR they are Constants,
// stored in the format the export chose, and the kernel reads them in place.
//   inputs:  x [N, H] f32|bf16, expert ids [N, k] i64|i32, routing weights
//            [N, k] f32, gate_up [E, 2I, H] and down [E, H, I] in one
//            format: f32, bf16, i8 (int8), u8 holding packed int4 with the
//            last dim halved, or f8e4m3 (fp8) (layouts in kernels/
//            moe_kernels.hpp); for i8 / u8 / f8e4m3 two more inputs, the f32
//            scales [E, 2I, G] and [E, H, Gd]
//   attributes: store, store_id and layer empty ("", "", -1); an IR written
//            before the store existed has none, which reads the same.
//
// store face: the weights live in the rank's expert store (store/
// expert_store.hpp), a file numaov maps before running the model.
//   inputs:  x, expert ids, routing weights (as above)
//   attributes: store (the file's name, for messages), store_id (32 lowercase
//            hex chars: the store's id) and layer (the model layer index)
//
//   output:  [N, H], x's type: sum over slots j of weights[n, j] times
//            expert ids[n, j]'s down(silu(gate x) * up x)
//
// N is anything from 0 rows up. The CPU plugin runs the op through its
// reference path: evaluate() is called once per inference on the stream's
// thread, and the kernel spreads the work over the stream's threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <openvino/op/op.hpp>

namespace numaov {

class MoeExperts : public ov::op::Op {
public:
    OPENVINO_OP("MoeExperts", "numaov");

    MoeExperts() = default;
    // 5 or 7 inputs (constant face) with no store; 3 inputs with a store.
    MoeExperts(const ov::OutputVector& args, std::string store = "", std::string store_id = "",
               int64_t layer = -1);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool has_evaluate() const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;

    const std::string& store() const { return m_store; }
    const std::string& store_id() const { return m_store_id; }
    int64_t layer() const { return m_layer; }

private:
    std::string m_store, m_store_id;
    int64_t m_layer = -1;
    // The store face's layer entry (owned by the store registry, which keeps
    // stores open for the process's life), found on the first evaluate().
    mutable std::atomic<const void*> m_entry{nullptr};
};

// OpenVINO extension op DenseLinear: a linear layer whose weight is in a format the CPU
// plugin's own kernels cannot read as it is (fp8), run by the experts' kernel
// (kernels/moe_kernels.hpp, `linear`).
//
// Written by the exporter as node numaov.moe::DenseLinear (numaov/custom_ops/moe_ops.py).
//   inputs:  x [..., K] f32|bf16, weight [M, K] in a weight format as MoeExperts' stacks
//            (f32, bf16, i8, u8 holding packed int4 with K halved, f8e4m3), and for i8 / u8 /
//            f8e4m3 its f32 scales [M, groups]
//   output:  [..., M], x's type: weight . x over the last dim (no bias)
class DenseLinear : public ov::op::Op {
public:
    OPENVINO_OP("DenseLinear", "numaov");

    DenseLinear() = default;
    explicit DenseLinear(const ov::OutputVector& args);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

}  // namespace numaov
