// The OpenVINO extension entry point: every numaov op is listed here, for IR
// (ov::OpExtension) and, for the ops the exporter writes, for the ONNX
// frontend (domain mapping).
//
// ONNX attributes map onto the ops' visit_attributes() by name: the exporter
// writes `group` (string) and `world_size` (int) and the ops visit exactly
// those names, so no attribute-name table is passed to the ONNX extensions.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>

#include "ops/attention_op.hpp"
#include "ops/collective_ops.hpp"
#include "ops/moe_op.hpp"

// The ONNX domain the exporter writes the collectives in
// (numaov/custom_ops/collective_ops.py uses the same string).
#define NUMAOV_COLLECTIVE_DOMAIN "numaov.collective"
// The ONNX domain of the MoE experts node (numaov/custom_ops/moe_ops.py).
#define NUMAOV_MOE_DOMAIN "numaov.moe"

// clang-format off
OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    // IR: read_model / deserialisation of .xml files saved with these ops
    // (type "AllReduce", version "numaov").
    std::make_shared<ov::OpExtension<numaov::AllReduce>>(),
    // IR: the all-gather of DP attention (rows of every rank before the MoE).
    std::make_shared<ov::OpExtension<numaov::AllGatherIntoTensor>>(),
    // IR: the reduce-scatter of DP attention (each rank keeps its own rows).
    std::make_shared<ov::OpExtension<numaov::ReduceScatterTensor>>(),
    // IR: flash attention on AMX, put in place of ScaledDotProductAttention by
    // the runtime before compiling (never written by the exporter).
    std::make_shared<ov::OpExtension<numaov::FlashAttention>>(),
    // ONNX: numaov.collective::AllReduce nodes written by the exporter become AllReduce.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::AllReduce>>(
        "AllReduce", NUMAOV_COLLECTIVE_DOMAIN),
    // ONNX: numaov.collective::AllGatherIntoTensor nodes become AllGatherIntoTensor.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::AllGatherIntoTensor>>(
        "AllGatherIntoTensor", NUMAOV_COLLECTIVE_DOMAIN),
    // ONNX: numaov.collective::ReduceScatterTensor nodes become ReduceScatterTensor.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::ReduceScatterTensor>>(
        "ReduceScatterTensor", NUMAOV_COLLECTIVE_DOMAIN),
    // IR: the routed experts of a MoE layer (grouped by expert, weights as inputs).
    std::make_shared<ov::OpExtension<numaov::MoeExperts>>(),
    // ONNX: numaov.moe::MoeExperts nodes written by the exporter become MoeExperts.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::MoeExperts>>(
        "MoeExperts", NUMAOV_MOE_DOMAIN),
}));
// clang-format on
