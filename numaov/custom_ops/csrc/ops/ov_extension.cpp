// The OpenVINO extension entry point: every numaov op is listed here, for IR
// (ov::OpExtension) and, for the ops the exporter writes, for the ONNX
// frontend (domain mapping).
//
// ONNX attributes map onto the ops' visit_attributes() by name: the exporter
// writes `group` (string) and `world_size` (int) and the ops visit exactly
// those names, so no attribute-name table is passed to the ONNX extensions.
// MoeExperts is converted by a function instead: its store attributes (store,
// store_id, layer) exist only on the 3-input store face, and a by-name
// mapping refuses a node that lacks an attribute the op visits.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/conversion.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>

#include "ops/attention_op.hpp"
#include "ops/collective_ops.hpp"
#include "ops/moe_op.hpp"

// The ONNX domain the exporter writes the collectives in
// (numaov/custom_ops/collective_ops.py uses the same string).
#define NUMAOV_COLLECTIVE_DOMAIN "numaov.collective"
// The ONNX domain of the MoE experts node (numaov/custom_ops/moe_ops.py).
#define NUMAOV_MOE_DOMAIN "numaov.moe"

namespace {

// numaov.moe::MoeExperts: its inputs as they are (3, 5 or 7) and, when present,
// the store attributes (defaults: the constant face's empty ones).
ov::OutputVector convert_moe_experts(const ov::frontend::NodeContext& context) {
    ov::OutputVector inputs;
    for (size_t i = 0; i < context.get_input_size(); ++i) inputs.push_back(context.get_input(int(i)));
    const auto op = std::make_shared<numaov::MoeExperts>(
        inputs, context.get_attribute<std::string>("store", ""), context.get_attribute<std::string>("store_id", ""),
        context.get_attribute<int64_t>("layer", -1));
    return op->outputs();
}

}  // namespace

// clang-format off
OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    // IR: read_model / deserialisation of .xml files saved with these ops
    // (type "AllReduce", version "numaov").
    std::make_shared<ov::OpExtension<numaov::AllReduce>>(),
    // IR: the all-gather of DP attention (rows of every rank before the MoE).
    std::make_shared<ov::OpExtension<numaov::AllGatherIntoTensor>>(),
    // IR: the reduce-scatter of DP attention (each rank keeps its own rows).
    std::make_shared<ov::OpExtension<numaov::ReduceScatterTensor>>(),
    // IR: the all-to-all of sequence parallelism (a token split becomes a head split and back).
    std::make_shared<ov::OpExtension<numaov::AllToAll>>(),
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
    // ONNX: numaov.collective::AllToAll nodes become AllToAll.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::AllToAll>>(
        "AllToAll", NUMAOV_COLLECTIVE_DOMAIN),
    // IR: the routed experts of a MoE layer (grouped by expert, weights as inputs).
    std::make_shared<ov::OpExtension<numaov::MoeExperts>>(),
    // ONNX: numaov.moe::MoeExperts nodes written by the exporter become MoeExperts
    // (with their store attributes, when they have them).
    std::make_shared<ov::frontend::onnx::ConversionExtension>(
        "MoeExperts", NUMAOV_MOE_DOMAIN, convert_moe_experts),
    // IR: a linear layer whose weight OpenVINO cannot read in its format (fp8), on the
    // experts' kernel.
    std::make_shared<ov::OpExtension<numaov::DenseLinear>>(),
    // ONNX: numaov.moe::DenseLinear nodes written by the exporter become DenseLinear.
    std::make_shared<ov::frontend::onnx::OpExtension<numaov::DenseLinear>>("DenseLinear", NUMAOV_MOE_DOMAIN),
}));
// clang-format on
