// Python binding of the numaov native library.
//
// The library is not built against torch: collectives take raw addresses,
// element counts and dtype codes, which numaov/distributed/communicator.py
// computes from numpy arrays or torch tensors (bf16 tensors have no numpy
// dtype, so addresses come from data_ptr()). Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "common/amx.hpp"
#include "common/types.hpp"
#include "communicator/communicator.hpp"
#include "communicator/shm_communicator.hpp"
#include "communicator/shm_segment.hpp"
#include "kernels/flash_attention.hpp"
#include "kernels/moe_kernels.hpp"
#include "kernels/reduce_kernels.hpp"
#include "store/expert_store.hpp"

namespace py = pybind11;

namespace {

// The MoE kernel's weight format named `name` ("f32", "bf16", "int8", "int4", "fp8").
numaov::moe::WeightFormat moe_format(const std::string& name) {
    for (auto f : {numaov::moe::WeightFormat::f32, numaov::moe::WeightFormat::bf16, numaov::moe::WeightFormat::int8,
                   numaov::moe::WeightFormat::int4, numaov::moe::WeightFormat::fp8}) {
        if (name == numaov::moe::format_name(f)) return f;
    }
    throw std::invalid_argument("weight format '" + name + "'; expected f32, bf16, int8, int4 or fp8");
}

// The Python class CollectiveError(NumaovError) lives in
// numaov/distributed/communicator.py, which installs it here; until then
// errors surface as RuntimeError.
py::object& collective_error_type() {
    static py::object* type = new py::object();  // leaked: must outlive interpreter teardown
    return *type;
}

numaov::DType dtype_from_code(uint32_t code) {
    if (code > uint32_t(numaov::DType::f16)) {
        throw numaov::CollectiveError("unsupported dtype code " + std::to_string(code) +
                                      "; expected f32 (0), bf16 (1) or f16 (2)");
    }
    return numaov::DType(code);
}

template <class T>
T* address(uintptr_t a) {
    return reinterpret_cast<T*>(a);
}

// A Python object as a registry frontend (numaov::Registration): the pointer
// is the PyObject itself, so two holds of one object compare equal. It may be
// dropped on any thread, so the release takes the GIL; after the interpreter
// is gone (static destruction at exit) there is nothing left to release.
std::shared_ptr<void> hold(py::object object) {
    if (object.is_none()) return {};
    return std::shared_ptr<void>(object.release().ptr(), [](void* p) {
        if (!Py_IsInitialized()) return;
        py::gil_scoped_acquire gil;
        Py_DECREF(static_cast<PyObject*>(p));
    });
}

py::object held(const std::shared_ptr<void>& frontend) {
    if (!frontend) return py::none();
    return py::reinterpret_borrow<py::object>(static_cast<PyObject*>(frontend.get()));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "numaov native library: shared-memory collectives and OpenVINO extension ops";
    // Checked at import against the running openvino: the extension must be
    // loaded by the same release it was compiled against.
    m.attr("openvino_build_version") = NUMAOV_OPENVINO_VERSION;

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const numaov::CollectiveError& e) {
            const py::object& type = collective_error_type();
            PyErr_SetString(type ? type.ptr() : PyExc_RuntimeError, e.what());
        }
    });
    m.def(
        "set_collective_error_type", [](py::object type) { collective_error_type() = type; },
        "Raise this Python exception class for numaov::CollectiveError.");

    using numaov::ShmCommunicator;
    using Release = py::call_guard<py::gil_scoped_release>;
    py::class_<ShmCommunicator, std::shared_ptr<ShmCommunicator>>(m, "ShmCommunicator")
        .def_property_readonly("name", &ShmCommunicator::name)
        .def_property_readonly("rank", &ShmCommunicator::rank)
        .def_property_readonly("world_size", &ShmCommunicator::world_size)
        .def_property_readonly("job_id", &ShmCommunicator::job_id)
        .def_property_readonly("segment_name", &ShmCommunicator::segment_name)
        .def_property_readonly("timeout_s", &ShmCommunicator::timeout_s)
        .def_property_readonly("seq", &ShmCommunicator::seq)
        .def_property_readonly("buffer_bytes", &ShmCommunicator::buffer_bytes)
        .def_property_readonly("oneshot_bytes", &ShmCommunicator::oneshot_bytes)
        .def_property_readonly("isa", &ShmCommunicator::isa)
        .def_property_readonly("notes", &ShmCommunicator::notes)
        .def_property_readonly("closed", &ShmCommunicator::closed)
        .def(
            "chunk_elements",
            [](const ShmCommunicator& c, const std::string& op, uint32_t dtype) {
                for (auto o : {numaov::Op::all_reduce, numaov::Op::all_gather_into_tensor,
                               numaov::Op::reduce_scatter_tensor, numaov::Op::all_to_all,
                               numaov::Op::broadcast}) {
                    if (op == numaov::op_name(o))
                        return c.chunk_elements(o, dtype_from_code(dtype));
                }
                throw numaov::CollectiveError("unknown collective '" + op + "'");
            },
            py::arg("op"), py::arg("dtype"))
        .def(
            "all_reduce",
            [](ShmCommunicator& c, uintptr_t data, uint64_t count, uint32_t dtype) {
                c.all_reduce(address<void>(data), count, dtype_from_code(dtype));
            },
            Release())
        .def(
            "all_gather_into_tensor",
            [](ShmCommunicator& c, uintptr_t out, uintptr_t in, uint64_t count, uint32_t dtype) {
                c.all_gather_into_tensor(address<void>(out), address<const void>(in), count,
                                         dtype_from_code(dtype));
            },
            Release())
        .def(
            "reduce_scatter_tensor",
            [](ShmCommunicator& c, uintptr_t out, uintptr_t in, uint64_t count, uint32_t dtype) {
                c.reduce_scatter_tensor(address<void>(out), address<const void>(in), count,
                                        dtype_from_code(dtype));
            },
            Release())
        .def(
            "all_to_all",
            [](ShmCommunicator& c, uintptr_t out, uintptr_t in, uint64_t count, uint32_t dtype) {
                c.all_to_all(address<void>(out), address<const void>(in), count,
                             dtype_from_code(dtype));
            },
            Release())
        .def(
            "broadcast",
            [](ShmCommunicator& c, uintptr_t data, uint64_t count, uint32_t dtype, int root) {
                c.broadcast(address<void>(data), count, dtype_from_code(dtype), root);
            },
            Release())
        .def("barrier", &ShmCommunicator::barrier, Release())
        .def("fail", &ShmCommunicator::fail, Release())
        .def(
            "close",
            [](const std::shared_ptr<ShmCommunicator>& c) { numaov::close_communicator(c); },
            Release());

    // The group registry is the C++ one (communicator/communicator.hpp); Python keeps no
    // copy. Python communicator objects are its frontends.
    m.def(
        "create_communicator",
        [](const std::string& name, int rank, int world_size, const std::string& job_id,
           double timeout_s, py::object frontend) {
            auto entry = hold(std::move(frontend));
            py::gil_scoped_release release;
            return numaov::create_shm_communicator(name, rank, world_size, job_id, timeout_s,
                                                   std::move(entry));
        },
        py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("job_id"),
        py::arg("timeout_s"), py::arg("frontend") = py::none(),
        "Create the group's shared-memory communicator (blocks until every rank attached) "
        "and register it under `name`, with `frontend` as the object Python lookups return.");
    m.def(
        "register_communicator",
        [](const std::string& name, py::object frontend, const std::string& transport,
           std::shared_ptr<ShmCommunicator> native) {
            numaov::register_communicator(name, {native, hold(std::move(frontend)), transport});
        },
        py::arg("name"), py::arg("frontend"), py::arg("transport"), py::arg("native") = nullptr,
        "Register a Python communicator under `name`; `native` is the C++ communicator the "
        "OpenVINO ops use, None for a transport they cannot run (refused by name there).");
    m.def(
        "find_communicator",
        [](const std::string& name) {
            return std::dynamic_pointer_cast<ShmCommunicator>(numaov::find_communicator(name));
        },
        py::arg("name"), "The C++ communicator of `name`, as the OpenVINO ops see it.");
    m.def(
        "find_frontend",
        [](const std::string& name) {
            const numaov::Registration entry = numaov::find_registration(name);
            if (!entry.frontend) {
                throw numaov::CollectiveError(
                    "numaov collectives: collective group '" + name +
                    "' was created from C++ without a Python communicator; expected one "
                    "created from Python (ShmCommunicator)");
            }
            return held(entry.frontend);
        },
        py::arg("name"), "The Python communicator registered under `name`.");
    m.def(
        "destroy_communicator",
        [](const std::string& name) {
            numaov::Registration entry;
            {
                py::gil_scoped_release release;  // closing waits for a running collective
                entry = numaov::destroy_communicator(name);
            }
            return held(entry.frontend);
        },
        py::arg("name"),
        "Unregister and close the communicator of `name`; returns its Python communicator "
        "(None when the name was destroyed already).");
    m.def(
        "forget_communicator",
        [](const std::string& name, py::object frontend) {
            numaov::forget_communicator(name, nullptr, frontend.ptr());
        },
        py::arg("name"), py::arg("frontend"),
        "Mark `name` destroyed if `frontend` is what is registered under it.");
    m.def(
        "segment_name",
        [](const std::string& group, const std::string& job_id) {
            return numaov::shm::segment_name(group, numaov::shm::resolve_job_id(job_id));
        },
        py::arg("group"), py::arg("job_id") = "",
        "The /dev/shm name (with a leading '/') a group's segment gets.");
    m.def(
        "reclaim_stale_segment",
        [](const std::string& group, const std::string& job_id) {
            return numaov::shm::reclaim_if_stale(group, numaov::shm::resolve_job_id(job_id));
        },
        py::arg("group"), py::arg("job_id") = "",
        "Unlink a group's segment left by ranks that all exited before the group formed; "
        "True when one was there.");
    m.def("segment_bytes", &numaov::shm_segment_bytes, py::arg("world_size"),
          "Bytes of /dev/shm a group of world_size ranks takes (NUMAOV_COLL_BUFFER_BYTES).");
    m.def("resolve_job_id", &numaov::shm::resolve_job_id, py::arg("job_id") = "");
    m.def("collective_defaults", [] {
        py::dict d;
        d["timeout_s"] = numaov::kDefaultTimeoutSeconds;
        d["buffer_bytes"] = numaov::kDefaultBufferBytes;
        d["oneshot_bytes"] = numaov::kDefaultOneshotBytes;
        d["max_world_size"] = numaov::shm::kMaxWorldSize;
        return d;
    });

    m.def("best_isa", [] { return numaov::kernels::isa_name(numaov::kernels::best_isa()); });
    m.def(
        "reduce_sum",
        [](uintptr_t dst, const std::vector<uintptr_t>& srcs, uint64_t count, uint32_t dtype,
           const std::string& isa) {
            std::vector<const void*> pointers;
            for (uintptr_t s : srcs) pointers.push_back(address<const void>(s));
            numaov::kernels::reduce_sum(address<void>(dst), pointers.data(), int(pointers.size()),
                                        count, dtype_from_code(dtype),
                                        numaov::kernels::isa_from_name(isa.c_str()));
        },
        py::arg("dst"), py::arg("srcs"), py::arg("count"), py::arg("dtype"), py::arg("isa"),
        Release(),
        "The collectives' sum kernel on local buffers (for tests and benchmarks): "
        "dst = sum of srcs in order, in fp32, rounded to the dtype.");

    m.def(
        "moe_unavailable_reason",
        [](const std::string& format) { return numaov::moe::unavailable_reason(moe_format(format)); },
        py::arg("format"),
        "Why the MoeExperts op's kernel cannot run weights of this format here (\"\" when it can).");
    m.def(
        "moe_kernel_isa",
        [](const std::string& format) { return numaov::moe::kernel_isa(moe_format(format)); },
        py::arg("format"),
        "The instructions the MoeExperts op runs this format on here under NUMAOV_MOE_ISA: 'avx512' or "
        "'avx2' (ValueError for a bad setting, RuntimeError where the CPU lacks them).");
    m.def(
        "moe_bf16_kernel",
        [] {
            const auto k = numaov::moe::bf16_kernel();
            py::dict out;
            out["kernel"] = k.kernel.empty() ? py::object(py::none()) : py::object(py::str(k.kernel));
            out["amx_min_rows"] = k.amx_min_rows ? py::object(py::int_(k.amx_min_rows)) : py::object(py::none());
            out["fp8_tile_min_rows"] =
                k.fp8_tile_min_rows ? py::object(py::int_(k.fp8_tile_min_rows)) : py::object(py::none());
            out["outer_min_rows"] =
                k.outer_min_rows ? py::object(py::int_(k.outer_min_rows)) : py::object(py::none());
            out["reason"] = k.reason;
            return out;
        },
        "Which kernel the MoeExperts op runs bf16 experts on here under NUMAOV_MOE_AMX: kernel 'amx' (experts "
        "of at least amx_min_rows rows), 'avx512_bf16' (outer products from outer_min_rows rows) or None, the "
        "rows per expert from which a bf16 model's fp8 experts run on it (fp8_tile_min_rows), and the reason.");
    m.def(
        "moe_int8_kernel",
        [] {
            const auto k = numaov::moe::int8_kernel();
            py::dict out;
            out["kernel"] = k.kernel.empty() ? py::object(py::none()) : py::object(py::str(k.kernel));
            out["act_group"] = k.act_group ? py::object(py::int_(k.act_group)) : py::object(py::none());
            out["reason"] = k.reason;
            return out;
        },
        "Which kernel the MoeExperts and DenseLinear ops run int8 weights on here under NUMAOV_MOE_VNNI: 'vnni' "
        "(against activations quantized per row in groups of act_group values), 'f32' (widened) or None, and "
        "the reason.");
    m.def(
        "open_expert_store",
        [](const std::string& path) {
            std::shared_ptr<const numaov::store::ExpertStore> store;
            {
                py::gil_scoped_release release;  // parsing and mapping touch the file
                store = numaov::store::open_expert_store(path);
            }
            py::list layers;
            for (const auto& l : store->layers()) {
                py::dict d;
                d["layer"] = l.layer;
                d["format"] = numaov::moe::format_name(l.format);
                d["experts"] = l.experts;
                d["hidden"] = l.hidden;
                d["inter"] = l.inter;
                d["gate_up_groups"] = l.gate_up_groups;
                d["down_groups"] = l.down_groups;
                d["gate_up_offset"] = l.gate_up_offset;
                d["down_offset"] = l.down_offset;
                d["gate_up_scale_offset"] = l.gate_up_scale_offset;
                d["down_scale_offset"] = l.down_scale_offset;
                d["bytes"] = l.bytes;
                d["digest"] = l.digest;
                layers.append(d);
            }
            py::dict out;
            out["id"] = store->id();
            out["path"] = store->path();
            out["bytes"] = store->bytes();
            out["version"] = store->version();
            out["layers"] = layers;
            return out;
        },
        py::arg("path"),
        "Open (parse, check and map read-only) the expert store at `path`, or find the open one with the same "
        "id, for this process's life; the MoeExperts ops naming its id read it. Returns its header and layer "
        "table as a dict (id, path, bytes, version, layers). Raises ValueError with a one-line message.");
    m.def(
        "expert_store_nodes",
        [](const std::string& id, size_t sample_pages) {
            const auto store = numaov::store::find_expert_store(id);
            if (!store) {
                throw std::invalid_argument("expert store id '" + id +
                                            "' is not open; expected the id of a store opened with open_expert_store");
            }
            py::gil_scoped_release release;
            return store->nodes(sample_pages);
        },
        py::arg("store_id"), py::arg("sample_pages") = 256,
        "{NUMA node: pages} of up to sample_pages pages spread over the open store's mapping (each read once "
        "first); key -1 counts pages whose node cannot be told.");
    m.def("amx_unavailable_reason", &numaov::amx::unavailable_reason,
          "Why AMX tiles cannot be used here (\"\" when they can): flash attention needs them, the MoE "
          "experts kernel uses them for bf16 experts with many rows.");
    m.def(
        "flash_attention",
        [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, const std::vector<uint64_t>& shape,
           float scale, const std::vector<std::string>& layouts, bool bf16) {
            namespace at = numaov::attention;
            if (shape.size() != 5) throw std::invalid_argument("shape is (batch, heads, q_len, kv_len, head_dim)");
            if (layouts.size() != 4) throw std::invalid_argument("layouts are those of q, k, v and out");
            const at::Shape s{shape[0], shape[1], shape[2], shape[3], shape[4]};
            auto strides = [&](size_t i, size_t length) {
                return at::strides_of(at::layout_named(layouts[i]), s.heads, length, s.head_dim);
            };
            const at::Tensors tensors{address<const void>(q), address<const void>(k), address<const void>(v),
                                      address<void>(out),     strides(0, s.q_len),   strides(1, s.kv_len),
                                      strides(2, s.kv_len),   strides(3, s.q_len),   bf16};
            py::gil_scoped_release release;
            at::flash_attention(tensors, s, scale);
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("shape"), py::arg("scale"),
        py::arg("layouts"), py::arg("bf16") = false,
        "The FlashAttention op's kernel on dense f32 (or, with bf16=True, bf16) buffers; layouts of q, k, v, "
        "out: 'bhsd' or 'bshd'.");
}
