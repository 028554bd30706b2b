// Python binding of the numaov native library.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
    m.doc() = "numaov native library: shared-memory collectives and OpenVINO extension ops";
    // Checked at import against the running openvino: the extension must be
    // loaded by the same release it was compiled against.
    m.attr("openvino_build_version") = NUMAOV_OPENVINO_VERSION;
}
