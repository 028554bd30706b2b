// The OpenVINO extension entry point: every numaov op is listed here, once
// for IR (ov::OpExtension) and once for the ONNX frontend (domain mapping).
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({}));
