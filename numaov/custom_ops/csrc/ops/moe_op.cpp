#include "ops/moe_op.hpp"

#include <cctype>
#include <sstream>
#include <stdexcept>

#include "kernels/moe_kernels.hpp"
#include "store/expert_store.hpp"

namespace numaov {

namespace {

const char* const kInputs[] = {"x", "expert ids", "routing weights", "gate_up", "down", "gate_up scales",
                               "down scales"};
const size_t kRanks[] = {2, 2, 2, 3, 3, 3, 3};

bool is_float(const ov::element::Type& t) { return t == ov::element::f32 || t == ov::element::bf16; }
bool is_index(const ov::element::Type& t) { return t == ov::element::i64 || t == ov::element::i32; }
bool is_quantized(const ov::element::Type& t) {
    return t == ov::element::i8 || t == ov::element::u8 || t == ov::element::f8e4m3;
}
bool is_weight(const ov::element::Type& t) { return is_float(t) || is_quantized(t); }

moe::WeightFormat format_of(const ov::element::Type& t) {
    if (t == ov::element::bf16) return moe::WeightFormat::bf16;
    if (t == ov::element::i8) return moe::WeightFormat::int8;
    if (t == ov::element::u8) return moe::WeightFormat::int4;
    if (t == ov::element::f8e4m3) return moe::WeightFormat::fp8;
    return moe::WeightFormat::f32;
}

std::string describe(const ov::Node& op) { return "MoeExperts '" + op.get_friendly_name() + "'"; }

bool is_store_id(const std::string& id) {
    if (id.size() != 32) return false;
    for (char c : id) {
        if (!std::isdigit(static_cast<unsigned char>(c)) && !(c >= 'a' && c <= 'f')) return false;
    }
    return true;
}

// The expert weights the kernel reads, wherever they live (IR constants or a store).
struct Experts {
    moe::WeightFormat format;
    size_t experts, inter;
    const void* gate_up;
    const void* down;
    const float* gate_up_scale = nullptr;
    const float* down_scale = nullptr;
    size_t gate_up_groups = 1, down_groups = 1;
};

// The one code path of both faces: x, ids and weights (inputs 0 .. 2, checked)
// against `experts`, into outputs[0].
void run_experts(const ov::Node& op, ov::TensorVector& outputs, const ov::TensorVector& inputs,
                 const Experts& experts) {
    const auto& x = inputs[0].get_shape();
    const auto& ids = inputs[1].get_shape();
    outputs[0].set_shape(x);
    moe::Tensors tensors{inputs[0].data(),
                         inputs[1].data(),
                         inputs[1].get_element_type() == ov::element::i64,
                         inputs[2].data<const float>(),
                         experts.gate_up,
                         experts.down,
                         outputs[0].data(),
                         inputs[0].get_element_type() == ov::element::bf16,
                         experts.format,
                         experts.gate_up_scale,
                         experts.down_scale,
                         experts.gate_up_groups,
                         experts.down_groups};
    try {
        moe::moe_experts(tensors, {x[0], ids[1], experts.experts, x[1], experts.inter});
    } catch (const std::exception& e) {
        OPENVINO_THROW(describe(op), ": ", e.what());
    }
}

// The store face's layer: from the registry, or a one-line error.
const store::Layer& store_layer(const ov::Node& op, const std::string& name, const std::string& id, int64_t layer) {
    const auto opened = store::find_expert_store(id);
    if (!opened) {
        OPENVINO_THROW(describe(op), ": expert store '", name, "' (id ", id,
                       ") is not open; expected numaov to open it before running the model (load the export with "
                       "numaov)");
    }
    const store::Layer* entry = opened->find(layer);
    if (!entry) {
        OPENVINO_THROW(describe(op), ": expert store '", name, "' (id ", id, ", ", opened->path(),
                       ") has no layer ", layer, "; expected one of the layers it holds: ", opened->layer_list());
    }
    return *entry;
}

}  // namespace

MoeExperts::MoeExperts(const ov::OutputVector& args, std::string store, std::string store_id, int64_t layer)
    : Op(args), m_store(std::move(store)), m_store_id(std::move(store_id)), m_layer(layer) {
    constructor_validate_and_infer_types();
}

bool MoeExperts::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("store", m_store);
    visitor.on_attribute("store_id", m_store_id);
    visitor.on_attribute("layer", m_layer);
    return true;
}

void MoeExperts::validate_and_infer_types() {
    const size_t inputs = get_input_size();
    NODE_VALIDATION_CHECK(this, inputs == 3 || inputs == 5 || inputs == 7,
                          "expected 3 inputs (x, expert ids, routing weights; the experts in a store), 5 (and "
                          "gate_up, down) or 7 (and the gate_up and down scales of int8 / int4 / fp8 weights), got ",
                          inputs);
    const bool stored = inputs == 3;
    NODE_VALIDATION_CHECK(this, !stored || is_store_id(m_store_id), "store_id '", m_store_id, "' (store '", m_store,
                          "'); expected 32 lowercase hex characters naming the expert store of the 3-input op");
    NODE_VALIDATION_CHECK(this, stored || m_store_id.empty(), "store_id '", m_store_id, "' with ", inputs,
                          " inputs; expected no store when the weights are inputs");
    for (size_t i = 0; i < inputs; ++i) {
        const auto& rank = get_input_partial_shape(i).rank();
        NODE_VALIDATION_CHECK(this, rank.is_dynamic() || size_t(rank.get_length()) == kRanks[i], "input ",
                              kInputs[i], " has rank ", rank, "; expected ", kRanks[i]);
    }
    const auto &xt = get_input_element_type(0), &idt = get_input_element_type(1), &wt = get_input_element_type(2);
    NODE_VALIDATION_CHECK(this, xt.is_dynamic() || is_float(xt), "x has element type ", xt, "; expected f32 or bf16");
    NODE_VALIDATION_CHECK(this, idt.is_dynamic() || is_index(idt), "expert ids have element type ", idt,
                          "; expected i64 or i32");
    NODE_VALIDATION_CHECK(this, wt.is_dynamic() || wt == ov::element::f32, "routing weights have element type ", wt,
                          "; expected f32");
    const auto &x = get_input_partial_shape(0), &ids = get_input_partial_shape(1), &w = get_input_partial_shape(2);
    if (ids.rank().is_static() && w.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, ids.compatible(w), "expert ids ", ids, " and routing weights ", w,
                              " differ; expected both [N, k]");
    }
    if (x.rank().is_static() && ids.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, x[0].compatible(ids[0]), "x ", x, " and expert ids ", ids,
                              " differ in rows; expected x [N, H] and ids [N, k]");
    }
    ov::PartialShape out = ov::PartialShape::dynamic(2);
    if (x.rank().is_static()) out = x;
    if (stored) {
        // Checked against the store when it is open; else evaluate() says it is not.
        if (const auto opened = store::find_expert_store(m_store_id)) {
            const store::Layer* entry = opened->find(m_layer);
            NODE_VALIDATION_CHECK(this, entry, "expert store '", m_store, "' (id ", m_store_id, ") has no layer ",
                                  m_layer, "; expected one of the layers it holds: ", opened->layer_list());
            NODE_VALIDATION_CHECK(this, x.rank().is_dynamic() || x[1].compatible(int64_t(entry->hidden)), "x ", x,
                                  " and layer ", m_layer, " of expert store '", m_store, "' (hidden ",
                                  entry->hidden, ") differ in hidden size; expected x [N, ", entry->hidden, "]");
        }
        set_output_type(0, xt, out);
        return;
    }
    const auto &gut = get_input_element_type(3), &dt = get_input_element_type(4);
    NODE_VALIDATION_CHECK(this, gut.is_dynamic() || is_weight(gut), "gate_up has element type ", gut,
                          "; expected f32, bf16, i8 (int8), u8 (packed int4) or f8e4m3 (fp8)");
    if (gut.is_static()) {
        NODE_VALIDATION_CHECK(this, is_quantized(gut) == (inputs == 7), "gate_up has element type ", gut, " and the op ",
                              inputs, " inputs; expected scales (7 inputs) exactly for i8 / u8 / f8e4m3 weights");
    }
    for (size_t i = 5; i < inputs; ++i) {
        const auto& st = get_input_element_type(i);
        NODE_VALIDATION_CHECK(this, st.is_dynamic() || st == ov::element::f32, kInputs[i], " have element type ", st,
                              "; expected f32");
    }
    NODE_VALIDATION_CHECK(this, gut.is_dynamic() || dt.is_dynamic() || gut == dt, "down has element type ", dt,
                          " but gate_up has ", gut, "; expected one weight format for both");
    const auto &gu = get_input_partial_shape(3), &d = get_input_partial_shape(4);
    // packed int4 holds two values per byte along the last dim
    const int64_t packing = gut == ov::element::u8 ? 2 : 1;
    if (gu.rank().is_static() && d.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, gu[0].compatible(d[0]), "gate_up ", gu, " and down ", d,
                              " differ in experts; expected [E, 2I, H] and [E, H, I]");
        NODE_VALIDATION_CHECK(this, gu[1].compatible(d[2] * 2 * packing) && (gu[2] * packing).compatible(d[1]),
                              "gate_up ", gu, " and down ", d, " do not fit; expected [E, 2I, H] and [E, H, I]",
                              packing == 2 ? " with the last dims halved (packed int4)" : "");
    }
    if (x.rank().is_static() && d.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, x[1].compatible(d[1]), "x ", x, " and down ", d,
                              " differ in hidden size; expected x [N, H] and down [E, H, I]");
    }
    if (inputs == 7) {
        const auto &gs = get_input_partial_shape(5), &ds = get_input_partial_shape(6);
        if (gs.rank().is_static() && gu.rank().is_static()) {
            NODE_VALIDATION_CHECK(this, gs[0].compatible(gu[0]) && gs[1].compatible(gu[1]), "gate_up scales ", gs,
                                  " do not fit gate_up ", gu, "; expected [E, 2I, groups]");
        }
        if (ds.rank().is_static() && d.rank().is_static()) {
            NODE_VALIDATION_CHECK(this, ds[0].compatible(d[0]) && ds[1].compatible(d[1]), "down scales ", ds,
                                  " do not fit down ", d, "; expected [E, H, groups]");
        }
    }
    set_output_type(0, xt, out);
}

std::shared_ptr<ov::Node> MoeExperts::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    OPENVINO_ASSERT(new_args.size() == 3 || new_args.size() == 5 || new_args.size() == 7,
                    "MoeExperts takes 3, 5 or 7 inputs, got ", new_args.size());
    return std::make_shared<MoeExperts>(new_args, m_store, m_store_id, m_layer);
}

bool MoeExperts::has_evaluate() const {
    return is_float(get_input_element_type(0)) && (get_input_size() == 3 || is_weight(get_input_element_type(3)));
}

bool MoeExperts::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const size_t count = inputs.size();
    OPENVINO_ASSERT(count == 3 || count == 5 || count == 7, describe(*this), ": ", count,
                    " inputs; expected 3, 5 or 7");
    for (size_t i = 0; i < count; ++i) {
        OPENVINO_ASSERT(inputs[i].get_shape().size() == kRanks[i] && inputs[i].is_continuous(), describe(*this),
                        ": input ", kInputs[i], " ", inputs[i].get_shape(), " is not a dense rank-", kRanks[i],
                        " tensor");
    }
    const auto xt = inputs[0].get_element_type();
    const bool io_ok = is_float(xt) && is_index(inputs[1].get_element_type()) &&
                       inputs[2].get_element_type() == ov::element::f32;
    const auto &x = inputs[0].get_shape(), &ids = inputs[1].get_shape(), &w = inputs[2].get_shape();
    const bool rows_ok = ids == w && x[0] == ids[0];

    if (count == 3) {
        OPENVINO_ASSERT(io_ok, describe(*this), ": element types x ", xt, ", ids ", inputs[1].get_element_type(),
                        ", weights ", inputs[2].get_element_type(), "; expected x f32|bf16, ids i64|i32, weights f32");
        const auto* entry = static_cast<const store::Layer*>(m_entry.load(std::memory_order_acquire));
        if (!entry) {
            entry = &store_layer(*this, m_store, m_store_id, m_layer);
            m_entry.store(entry, std::memory_order_release);
        }
        if (!rows_ok || x[1] != entry->hidden) {
            OPENVINO_THROW(describe(*this), ": x ", x, ", expert ids ", ids, ", routing weights ", w,
                           "; expected x [N, ", entry->hidden, "] (layer ", m_layer, " of expert store '", m_store,
                           "') and ids and weights [N, k]");
        }
        Experts experts{entry->format, entry->experts, entry->inter, entry->gate_up, entry->down};
        if (moe::has_scales(entry->format)) {
            experts.gate_up_scale = entry->gate_up_scale;
            experts.down_scale = entry->down_scale;
            experts.gate_up_groups = entry->gate_up_groups;
            experts.down_groups = entry->down_groups;
        }
        run_experts(*this, outputs, inputs, experts);
        return true;
    }

    const auto wt = inputs[3].get_element_type();
    const bool types_ok = io_ok && is_weight(wt) && inputs[4].get_element_type() == wt &&
                          is_quantized(wt) == (count == 7) &&
                          (count == 5 || (inputs[5].get_element_type() == ov::element::f32 &&
                                          inputs[6].get_element_type() == ov::element::f32));
    OPENVINO_ASSERT(types_ok, describe(*this), ": element types x ", xt, ", ids ", inputs[1].get_element_type(),
                    ", weights ", inputs[2].get_element_type(), ", gate_up ", wt, ", down ",
                    inputs[4].get_element_type(),
                    "; expected x f32|bf16, ids i64|i32, weights f32, gate_up and down in one format "
                    "(f32, bf16, or i8 / u8 / f8e4m3 with f32 scales)");
    const auto &gu = inputs[3].get_shape(), &d = inputs[4].get_shape();
    const size_t packing = wt == ov::element::u8 ? 2 : 1;
    bool shapes_ok = rows_ok && gu[0] == d[0] && gu[1] == 2 * d[2] * packing && gu[2] * packing == d[1] &&
                     x[1] == d[1];
    if (count == 7) {
        const auto &gs = inputs[5].get_shape(), &ds = inputs[6].get_shape();
        shapes_ok = shapes_ok && gs[0] == gu[0] && gs[1] == gu[1] && ds[0] == d[0] && ds[1] == d[1];
    }
    if (!shapes_ok) {
        std::ostringstream msg;
        msg << describe(*this) << ": x " << x << ", expert ids " << ids << ", routing weights " << w << ", gate_up "
            << gu << ", down " << d;
        if (count == 7) msg << ", scales " << inputs[5].get_shape() << " and " << inputs[6].get_shape();
        msg << "; expected x [N, H], ids and weights [N, k], gate_up [E, 2I, H], down [E, H, I]"
            << (packing == 2 ? " (last dims halved: packed int4)" : "")
            << (count == 7 ? ", scales [E, 2I, groups] and [E, H, groups]" : "");
        OPENVINO_THROW(msg.str());
    }
    Experts experts{format_of(wt), gu[0], gu[1] / 2, inputs[3].data(), inputs[4].data()};
    if (count == 7) {
        experts.gate_up_scale = inputs[5].data<const float>();
        experts.down_scale = inputs[6].data<const float>();
        experts.gate_up_groups = inputs[5].get_shape()[2];
        experts.down_groups = inputs[6].get_shape()[2];
    }
    run_experts(*this, outputs, inputs, experts);
    return true;
}

// -- DenseLinear ------------------------------------------------------------------------------

DenseLinear::DenseLinear(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

void DenseLinear::validate_and_infer_types() {
    const size_t inputs = get_input_size();
    NODE_VALIDATION_CHECK(this, inputs == 2 || inputs == 3,
                          "expected 2 inputs (x, weight) or 3 (and the f32 scales of i8 / u8 / f8e4m3 weights), got ",
                          inputs);
    const auto &xt = get_input_element_type(0), &wt = get_input_element_type(1);
    NODE_VALIDATION_CHECK(this, xt.is_dynamic() || is_float(xt), "x has element type ", xt, "; expected f32 or bf16");
    NODE_VALIDATION_CHECK(this, wt.is_dynamic() || is_weight(wt), "weight has element type ", wt,
                          "; expected f32, bf16, i8 (int8), u8 (packed int4) or f8e4m3 (fp8)");
    if (wt.is_static()) {
        NODE_VALIDATION_CHECK(this, is_quantized(wt) == (inputs == 3), "weight has element type ", wt, " and the op ",
                              inputs, " inputs; expected scales (3 inputs) exactly for i8 / u8 / f8e4m3 weights");
    }
    if (inputs == 3) {
        const auto& st = get_input_element_type(2);
        NODE_VALIDATION_CHECK(this, st.is_dynamic() || st == ov::element::f32, "scales have element type ", st,
                              "; expected f32");
    }
    const auto &x = get_input_partial_shape(0), &w = get_input_partial_shape(1);
    NODE_VALIDATION_CHECK(this, x.rank().is_dynamic() || x.rank().get_length() >= 1, "x is a scalar; expected [..., K]");
    NODE_VALIDATION_CHECK(this, w.rank().is_dynamic() || w.rank().get_length() == 2, "weight has rank ", w.rank(),
                          "; expected [M, K]");
    const int64_t packing = wt == ov::element::u8 ? 2 : 1;
    if (x.rank().is_static() && w.rank().is_static()) {
        NODE_VALIDATION_CHECK(this, x[x.size() - 1].compatible(w[1] * packing), "x ", x, " and weight ", w,
                              " differ in input size; expected x [..., K] and weight [M, K]",
                              packing == 2 ? " (K halved: packed int4)" : "");
    }
    if (inputs == 3) {
        const auto& sc = get_input_partial_shape(2);
        if (sc.rank().is_static() && w.rank().is_static()) {
            NODE_VALIDATION_CHECK(this, sc.size() == 2 && sc[0].compatible(w[0]), "scales ", sc,
                                  " do not fit weight ", w, "; expected [M, groups]");
        }
    }
    ov::PartialShape out = ov::PartialShape::dynamic();
    if (x.rank().is_static()) {
        out = x;
        out[out.size() - 1] = w.rank().is_static() ? w[0] : ov::Dimension::dynamic();
    }
    set_output_type(0, xt, out);
}

std::shared_ptr<ov::Node> DenseLinear::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    OPENVINO_ASSERT(new_args.size() == 2 || new_args.size() == 3, "DenseLinear takes 2 or 3 inputs, got ",
                    new_args.size());
    return std::make_shared<DenseLinear>(new_args);
}

bool DenseLinear::has_evaluate() const {
    return is_float(get_input_element_type(0)) && is_weight(get_input_element_type(1));
}

bool DenseLinear::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const size_t count = inputs.size();
    const std::string name = "DenseLinear '" + get_friendly_name() + "'";
    OPENVINO_ASSERT(count == 2 || count == 3, name, ": ", count, " inputs; expected 2 or 3");
    const auto xt = inputs[0].get_element_type(), wt = inputs[1].get_element_type();
    OPENVINO_ASSERT(is_float(xt) && is_weight(wt) && is_quantized(wt) == (count == 3) &&
                        (count == 2 || inputs[2].get_element_type() == ov::element::f32),
                    name, ": element types x ", xt, ", weight ", wt,
                    "; expected x f32|bf16 and a weight f32, bf16, or i8 / u8 / f8e4m3 with f32 scales");
    const auto &x = inputs[0].get_shape(), &w = inputs[1].get_shape();
    const size_t packing = wt == ov::element::u8 ? 2 : 1;
    bool shapes_ok = !x.empty() && w.size() == 2 && x.back() == w[1] * packing;
    if (count == 3) {
        const auto& sc = inputs[2].get_shape();
        shapes_ok = shapes_ok && sc.size() == 2 && sc[0] == w[0];
    }
    for (const auto& input : inputs) shapes_ok = shapes_ok && input.is_continuous();
    if (!shapes_ok) {
        std::ostringstream msg;
        msg << name << ": x " << x << ", weight " << w;
        if (count == 3) msg << ", scales " << inputs[2].get_shape();
        msg << "; expected dense x [..., K], weight [M, K]" << (packing == 2 ? " (K halved: packed int4)" : "")
            << (count == 3 ? " and scales [M, groups]" : "");
        OPENVINO_THROW(msg.str());
    }
    ov::Shape out_shape = x;
    out_shape.back() = w[0];
    outputs[0].set_shape(out_shape);
    const size_t rows = ov::shape_size(x) / x.back();
    moe::LinearTensors tensors{inputs[0].data(), outputs[0].data(), xt == ov::element::bf16, format_of(wt),
                               inputs[1].data()};
    if (count == 3) {
        tensors.scale = inputs[2].data<const float>();
        tensors.groups = inputs[2].get_shape()[1];
    }
    try {
        moe::linear(tensors, rows, x.back(), w[0]);
    } catch (const std::exception& e) {
        OPENVINO_THROW(name, ": ", e.what());
    }
    return true;
}

}  // namespace numaov
