// Torch binding of the fused forward kernels (cuda/rwkv7_fused.cu).
//
// Like cuda/wkv7_slots_op.cpp: only <torch/extension.h> is included (the launchers are reached
// through a plain C interface), every launch goes to the stream handle the caller passes
// (torch.cuda.current_stream().cuda_stream), so the ops can be captured in CUDA graphs. Shapes,
// dtypes, devices and contiguity are checked here; the launchers check the sizes they depend on.
#include <torch/extension.h>

#include "op_messages.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

extern "C" int fused_ln_shift_mix_launch(int device, int64_t stream, int64_t T, int64_t B, int64_t C,
                                         int64_t num_slots, const void* x, const void* ln_w, const void* ln_b,
                                         void* shift, const int32_t* prev, const int64_t* slots, const int64_t* lasts,
                                         const void* const* mix, void* const* out, int count);
extern "C" int fused_time_mix_launch(int device, int64_t stream, int state_dtype, int64_t B, int64_t H,
                                     int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                     const int64_t* starts, const int64_t* lasts, const void* const* tensors,
                                     const void* const* params, int first_layer, int64_t max_len, float* scratch,
                                     int64_t scratch_floats, int64_t pipeline_blocks);
extern "C" int64_t fused_time_mix_scratch_floats(int64_t B, int64_t H, int64_t num_tokens, const void* const* tensors,
                                                 int first_layer, int64_t max_len);
extern "C" int fused_gemv_launch(int device, int64_t stream, int64_t M, int count, const void* const* w,
                                 const void* const* scale, const void* const* zero, const void* const* x,
                                 void* const* y, const void* const* residual, const int64_t* n, const int64_t* k,
                                 const int64_t* group, const int* weight_type, const int* epilogue,
                                 const int* stage, void* sync);
extern "C" int fused_gemv_max_rows();
extern "C" int fused_gemv_max_tasks();
extern "C" int fused_sparse_gemv_max_rows(int int8);
extern "C" int fused_sparse_gemv_workspace(int64_t n, int64_t k, int int8, int64_t* partial_floats, int64_t* arrivals);
extern "C" int fused_sparse_gemv_launch(int device, int64_t stream, int64_t M, const void* x, const void* w,
                                        const void* scale, void* y, const void* residual, void* partial,
                                        void* arrivals, int64_t n, int64_t k);
extern "C" int fused_relu_square_launch(int device, int64_t stream, int64_t n, void* x);
extern "C" int fused_uint4_dequantize_launch(int device, int64_t stream, const void* words, const void* scale,
                                             const void* zero, int64_t N, int64_t K, int64_t group, int64_t n0,
                                             int64_t width, void* out);
extern "C" const char* fused_error_string(int code);

namespace {

constexpr int64_t kHeadSize = 64;

using op_messages::num;  // numbers never streamed into messages (op_messages.h)
using op_messages::shape;

void check(const torch::Tensor& t, const torch::Device& device, torch::ScalarType dtype, std::vector<int64_t> dims,
           const char* op, const std::string& name) {
    TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device().str(), ", expected ", device.str());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
    bool ok = t.dim() == static_cast<int64_t>(dims.size());
    for (size_t d = 0; ok && d < dims.size(); ++d) ok = dims[d] < 0 || t.size(d) == dims[d];
    std::string want = "[";
    for (size_t d = 0; d < dims.size(); ++d) want += (d ? ", " : "") + (dims[d] < 0 ? std::string("*") : num(dims[d]));
    TORCH_CHECK(ok, op, ": ", name, " must have shape ", want, "], got ", shape(t));
    TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

void raise_on(int err, const char* op) {
    TORCH_CHECK(err == 0, op, ": kernel launch failed: ", fused_error_string(err), " (error ", num(err), ")");
}

}  // namespace

// out[m][t] = LN(x[t]) + (shifted - LN(x[t])) * mix[m]; the row starts' slots of `shift` get the
// normalised input of their row's last token (see cuda/rwkv7_fused.cu).
void ln_shift_mix(torch::Tensor x, torch::Tensor ln_w, torch::Tensor ln_b, torch::Tensor shift, torch::Tensor prev,
                  torch::Tensor slots, torch::Tensor lasts, std::vector<torch::Tensor> mix,
                  std::vector<torch::Tensor> out, int64_t stream) {
    const char* op = "ln_shift_mix";
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, op, ": x must be a 2-D CUDA tensor, got ", shape(x));
    const auto device = x.device();
    const int64_t T = x.size(0), C = x.size(1), B = slots.numel();
    check(x, device, torch::kFloat16, {T, C}, op, "x");
    check(ln_w, device, torch::kFloat16, {C}, op, "ln_w");
    check(ln_b, device, torch::kFloat16, {C}, op, "ln_b");
    check(shift, device, torch::kFloat16, {-1, C}, op, "shift");
    check(prev, device, torch::kInt32, {T}, op, "prev");
    check(slots, device, torch::kInt64, {B}, op, "slots");
    check(lasts, device, torch::kInt64, {B}, op, "lasts");
    TORCH_CHECK(!mix.empty() && mix.size() == out.size() && mix.size() <= 6, op,
                ": 1 to 6 mixing vectors with as many outputs, got ", num(mix.size()), " and ", num(out.size()));
    std::vector<const void*> mix_ptr;
    std::vector<void*> out_ptr;
    for (size_t m = 0; m < mix.size(); ++m) {
        check(mix[m], device, torch::kFloat16, {C}, op, "mix[" + num(m) + "]");
        check(out[m], device, torch::kFloat16, {T, C}, op, "out[" + num(m) + "]");
        mix_ptr.push_back(mix[m].data_ptr());
        out_ptr.push_back(out[m].data_ptr());
    }
    raise_on(fused_ln_shift_mix_launch(static_cast<int>(device.index()), stream, T, B, C, shift.size(0), x.data_ptr(),
                                       ln_w.data_ptr(), ln_b.data_ptr(), shift.data_ptr(), prev.data_ptr<int32_t>(),
                                       slots.data_ptr<int64_t>(), lasts.data_ptr<int64_t>(), mix_ptr.data(),
                                       out_ptr.data(), static_cast<int>(mix.size())),
             op);
}

// The time-mix between the projections and the output projection, state[slots] updated in place.
// tensors = [r, k, v, dw, da, dv, g, v_first, out] ([T, C] fp16; dv may be empty in layer 0),
// params = [w0, r_k, lnx_w, lnx_b] fp32 [C] + [a0, v0, k_k, k_a] fp16 [C] (v0 may be empty in layer 0).
// max_len: the longest row's tokens; with several, the launcher takes a prefill kernel (same results; see
// cuda/rwkv7_fused.cu), for a small grid one that needs an fp32 scratch [T, C], allocated here.
// pipeline_blocks: 0 lets a large decode launch walk its rows on a fixed grid (time_mix_pipelined_kernel, same
// results), < 0 never, > 0 always, on that many blocks (rounded down to a multiple of the heads).
void time_mix(torch::Tensor state, torch::Tensor slots, torch::Tensor starts, torch::Tensor lasts,
              std::vector<torch::Tensor> tensors, std::vector<torch::Tensor> params, bool first_layer,
              int64_t max_len, int64_t stream, int64_t pipeline_blocks) {
    const char* op = "time_mix";
    TORCH_CHECK(state.is_cuda() && state.dim() == 4 && state.size(2) == kHeadSize && state.size(3) == kHeadSize, op,
                ": state must be a CUDA tensor [slots, heads, 64, 64], got ", shape(state));
    TORCH_CHECK(state.scalar_type() == torch::kFloat32 || state.scalar_type() == torch::kFloat16, op,
                ": the state pool must be float32 or float16, got ", state.scalar_type());
    const auto device = state.device();
    check(state, device, state.scalar_type(), {-1, -1, kHeadSize, kHeadSize}, op, "state");
    const int64_t H = state.size(1), C = H * kHeadSize, B = slots.numel();
    check(slots, device, torch::kInt64, {B}, op, "slots");
    check(starts, device, torch::kInt64, {B}, op, "starts");
    check(lasts, device, torch::kInt64, {B}, op, "lasts");
    TORCH_CHECK(tensors.size() == 9 && params.size() == 8, op, ": 9 tensors and 8 parameter vectors expected");
    const int64_t T = tensors[0].dim() == 2 ? tensors[0].size(0) : -1;
    const char* tensor_names[] = {"r", "k", "v", "dw", "da", "dv", "g", "v_first", "out"};
    const char* param_names[] = {"w0", "r_k", "lnx_w", "lnx_b", "a0", "v0", "k_k", "k_a"};
    std::vector<const void*> tensor_ptr, param_ptr;
    for (int i = 0; i < 9; ++i) {
        const bool unused = first_layer && i == 5;
        if (!unused) check(tensors[i], device, torch::kFloat16, {T, C}, op, tensor_names[i]);
        tensor_ptr.push_back(unused ? nullptr : tensors[i].data_ptr());
    }
    for (int i = 0; i < 8; ++i) {
        const bool unused = first_layer && i == 5;
        if (!unused) check(params[i], device, i < 4 ? torch::kFloat32 : torch::kFloat16, {C}, op, param_names[i]);
        param_ptr.push_back(unused ? nullptr : params[i].data_ptr());
    }
    const int state_dtype = state.scalar_type() == torch::kFloat32 ? 0 : 1;
    TORCH_CHECK(B == 0 || (max_len >= 1 && max_len <= T), op, ": max_len must be in [1, T = ", T, "], got ", max_len);
    const int64_t scratch_floats =
        fused_time_mix_scratch_floats(B, H, T, tensor_ptr.data(), first_layer ? 1 : 0, max_len);
    torch::Tensor scratch;
    if (scratch_floats > 0) scratch = torch::empty({scratch_floats}, state.options().dtype(torch::kFloat32));
    raise_on(fused_time_mix_launch(static_cast<int>(device.index()), stream, state_dtype, B, H, state.size(0), T,
                                   state.data_ptr(), slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                                   lasts.data_ptr<int64_t>(), tensor_ptr.data(), param_ptr.data(), first_layer ? 1 : 0,
                                   max_len, scratch_floats > 0 ? scratch.data_ptr<float>() : nullptr, scratch_floats,
                                   pipeline_blocks),
             op);
}

// Several small-M matrix products in one launch: y[i] = x[i] @ W[i].T (* scale[i]) (epilogue[i]:
// 1 relu^2, 2 tanh, 3 sigmoid) (+ residual[i]). The weights' dtype says their kind: fp16 [out, in]; int8
// [out, in] with an fp16 scale [out]; int32 [in/8, out]: GemLite's packed 4-bit words, with fp16 scale and zero
// [in/group[i], out] (W = q * scale + zero per group of group[i] input columns). Empty tensors mean "none"
// for scale, zero and residual; group[i] is read for 4-bit tasks only. stage (empty: none): 1 for a task whose output
// another task of the launch reads (a producer), 2 for such a task (a consumer; after every producer), else 0; sync:
// int32 [2] on the device, zero before the first staged launch (each leaves it so).
void gemv(std::vector<torch::Tensor> w, std::vector<torch::Tensor> scale, std::vector<torch::Tensor> zero,
          std::vector<torch::Tensor> x, std::vector<torch::Tensor> y, std::vector<torch::Tensor> residual,
          std::vector<int64_t> group, std::vector<int64_t> epilogue, int64_t stream, std::vector<int64_t> stage,
          std::optional<torch::Tensor> sync) {
    const char* op = "gemv";
    const size_t count = w.size();
    TORCH_CHECK(count >= 1 && count <= static_cast<size_t>(fused_gemv_max_tasks()), op, ": 1 to ",
                num(fused_gemv_max_tasks()), " tasks per launch, got ", num(count));
    TORCH_CHECK(scale.size() == count && zero.size() == count && x.size() == count && y.size() == count &&
                    residual.size() == count && group.size() == count && epilogue.size() == count,
                op, ": every argument list needs one entry per task");
    TORCH_CHECK(x[0].is_cuda() && x[0].dim() == 2, op, ": x must be 2-D CUDA tensors");
    const auto device = x[0].device();
    const int64_t M = x[0].size(0);
    TORCH_CHECK(M >= 1 && M <= fused_gemv_max_rows(), op, ": 1 to ", num(fused_gemv_max_rows()), " rows, got ", num(M));
    std::vector<const void*> w_ptr, s_ptr, z_ptr, x_ptr, r_ptr;
    std::vector<void*> y_ptr;
    std::vector<int64_t> n(count), k(count);
    std::vector<int> wt(count), epi(count), stages(count, 0);
    TORCH_CHECK(stage.empty() || stage.size() == count, op, ": stage needs one entry per task (or none)");
    if (!stage.empty()) {
        TORCH_CHECK(sync.has_value(), op, ": a launch with stages needs its sync counters");
        check(*sync, device, torch::kInt32, {2}, op, "sync");
    }
    for (size_t i = 0; i < count; ++i) {
        const std::string tag = "[" + num(i) + "]";
        if (!stage.empty()) stages[i] = static_cast<int>(stage[i]);
        TORCH_CHECK(w[i].dim() == 2, op, ": w", tag, " must be 2-D, got ", shape(w[i]));
        const auto dtype = w[i].scalar_type();
        TORCH_CHECK(dtype == torch::kFloat16 || dtype == torch::kInt8 || dtype == torch::kInt32, op, ": w", tag,
                    " must be float16 or int8 [out, in], or int32 [in/8, out] (4-bit words), got ", dtype);
        const bool int8 = dtype == torch::kInt8, uint4 = dtype == torch::kInt32;
        wt[i] = uint4 ? 2 : int8 ? 1 : 0;
        n[i] = uint4 ? w[i].size(1) : w[i].size(0);
        k[i] = uint4 ? 8 * w[i].size(0) : w[i].size(1);
        check(w[i], device, dtype, {w[i].size(0), w[i].size(1)}, op, "w" + tag);
        if (uint4) {
            const int64_t g = group[i];
            TORCH_CHECK(g > 0 && g % 8 == 0 && k[i] % g == 0 && n[i] % 4 == 0, op, ": 4-bit task ", num(i),
                        " needs group % 8 == 0 dividing in_features and out_features % 4 == 0, got group ", num(g),
                        ", w ", shape(w[i]));
            check(scale[i], device, torch::kFloat16, {k[i] / g, n[i]}, op, "scale" + tag);
            check(zero[i], device, torch::kFloat16, {k[i] / g, n[i]}, op, "zero" + tag);
        } else {
            TORCH_CHECK(k[i] % (int8 ? 16 : 8) == 0, op, ": w", tag, " needs in_features % ", int8 ? "16" : "8",
                        " == 0");
            TORCH_CHECK(int8 == (scale[i].numel() > 0), op, ": task ", num(i),
                        " needs a scale iff its weights are int8");
            TORCH_CHECK(zero[i].numel() == 0, op, ": task ", num(i), " has a zero, which only 4-bit weights take");
            if (int8) check(scale[i], device, torch::kFloat16, {n[i]}, op, "scale" + tag);
        }
        check(x[i], device, torch::kFloat16, {M, k[i]}, op, "x" + tag);
        check(y[i], device, torch::kFloat16, {M, n[i]}, op, "y" + tag);
        if (residual[i].numel()) check(residual[i], device, torch::kFloat16, {M, n[i]}, op, "residual" + tag);
        TORCH_CHECK(epilogue[i] >= 0 && epilogue[i] <= 3, op, ": bad epilogue code ", num(epilogue[i]));
        w_ptr.push_back(w[i].data_ptr());
        s_ptr.push_back(int8 || uint4 ? scale[i].data_ptr() : nullptr);
        z_ptr.push_back(uint4 ? zero[i].data_ptr() : nullptr);
        x_ptr.push_back(x[i].data_ptr());
        y_ptr.push_back(y[i].data_ptr());
        r_ptr.push_back(residual[i].numel() ? residual[i].data_ptr() : nullptr);
        epi[i] = static_cast<int>(epilogue[i]);
    }
    raise_on(fused_gemv_launch(static_cast<int>(device.index()), stream, M, static_cast<int>(count), w_ptr.data(),
                               s_ptr.data(), z_ptr.data(), x_ptr.data(), y_ptr.data(), r_ptr.data(), n.data(),
                               k.data(), group.data(), wt.data(), epi.data(), stages.data(),
                               stage.empty() ? nullptr : sync->data_ptr()),
             op);
}

// Sizes of the workspace of sparse_gemv for a K-major weight [k, n] (int8: of int8 weights): (fp32 values, uint32
// counters).
std::vector<int64_t> sparse_gemv_workspace(int64_t k, int64_t n, bool int8) {
    int64_t partial = 0, arrivals = 0;
    TORCH_CHECK(fused_sparse_gemv_workspace(n, k, int8, &partial, &arrivals) == 0, "sparse_gemv: cannot take a [",
                num(k), ", ", num(n), "] ", int8 ? "int8" : "fp16", " weight (out_features % 8 == 0 needed",
                int8 ? "; int8 weights: the CUDA source only)" : ")");
    return {partial, arrivals};
}

int64_t sparse_gemv_max_rows(bool int8) { return fused_sparse_gemv_max_rows(int8); }

// y = x @ w_t (* scale) (+ residual) skipping the rows of w_t whose input column of x is zero in every row: x [M, k]
// fp16 (M <= sparse_gemv_max_rows(int8)), w_t [k, n] (K-major: the transposed nn.Linear weight) fp16, or int8 with
// its fp16 per-output-channel scale [n] (empty for fp16 weights); y and residual [M, n] fp16 (residual empty for
// none; it may be y itself); partial fp32 and arrivals int32: the workspace of sparse_gemv_workspace(k, n, int8),
// arrivals zero before the first launch (each launch leaves it so).
void sparse_gemv(torch::Tensor x, torch::Tensor w_t, torch::Tensor scale, torch::Tensor y, torch::Tensor residual,
                 torch::Tensor partial, torch::Tensor arrivals, int64_t stream) {
    const char* op = "sparse_gemv";
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && w_t.dim() == 2, op, ": x and w_t must be 2-D CUDA tensors");
    const auto device = x.device();
    const int64_t M = x.size(0), k = w_t.size(0), n = w_t.size(1);
    const bool int8 = w_t.scalar_type() == torch::kInt8;
    const int64_t max_rows = fused_sparse_gemv_max_rows(int8);
    TORCH_CHECK(M >= 1 && M <= max_rows, op, ": 1 to ", num(max_rows), " rows", int8 ? " (int8 weights)" : "",
                ", got ", num(M));
    check(x, device, torch::kFloat16, {M, k}, op, "x");
    check(w_t, device, int8 ? torch::kInt8 : torch::kFloat16, {k, n}, op, "w_t");
    if (int8) {
        check(scale, device, torch::kFloat16, {n}, op, "scale");
    } else {
        TORCH_CHECK(scale.numel() == 0, op, ": a scale goes with int8 weights only");
    }
    check(y, device, torch::kFloat16, {M, n}, op, "y");
    if (residual.numel()) check(residual, device, torch::kFloat16, {M, n}, op, "residual");
    const std::vector<int64_t> need = sparse_gemv_workspace(k, n, int8);
    check(partial, device, torch::kFloat32, {-1}, op, "partial");
    check(arrivals, device, torch::kInt32, {-1}, op, "arrivals");
    TORCH_CHECK(partial.numel() >= need[0] && arrivals.numel() >= need[1], op, ": the workspace needs ",
                num(need[0]), " fp32 values and ", num(need[1]), " counters, got ", num(partial.numel()), " and ",
                num(arrivals.numel()));
    raise_on(fused_sparse_gemv_launch(static_cast<int>(device.index()), stream, M, x.data_ptr(), w_t.data_ptr(),
                                      int8 ? scale.data_ptr() : nullptr, y.data_ptr(),
                                      residual.numel() ? residual.data_ptr() : nullptr, partial.data_ptr(),
                                      arrivals.data_ptr(), n, k),
             op);
}

// x = relu(x)^2 in place, x a contiguous fp16 CUDA tensor (16-byte aligned).
void relu_square_(torch::Tensor x, int64_t stream) {
    const char* op = "relu_square_";
    TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
    check(x, x.device(), torch::kFloat16, std::vector<int64_t>(x.dim(), -1), op, "x");
    raise_on(fused_relu_square_launch(static_cast<int>(x.device().index()), stream, x.numel(), x.data_ptr()), op);
}

// out [K, width] = columns n0 .. n0 + width - 1 of W^T, fp16, for a 4-bit GemLite matrix W [N, K]: words
// [K/8, N] int32, scale and zero [K/group, N] fp16 (all contiguous CUDA tensors on one device).
void uint4_dequantize(torch::Tensor words, torch::Tensor scale, torch::Tensor zero, int64_t n0, torch::Tensor out,
                      int64_t stream) {
    const char* op = "uint4_dequantize";
    TORCH_CHECK(words.is_cuda(), op, ": words must be a CUDA tensor");
    const auto device = words.device();
    check(words, device, torch::kInt32, {-1, -1}, op, "words");
    const int64_t K = words.size(0) * 8, N = words.size(1);
    check(scale, device, torch::kFloat16, {-1, N}, op, "scale");
    check(zero, device, torch::kFloat16, {scale.size(0), N}, op, "zero");
    TORCH_CHECK(scale.size(0) > 0 && K % scale.size(0) == 0 && (K / scale.size(0)) % 8 == 0, op, ": ",
                num(scale.size(0)), " groups do not split K = ", num(K), " into whole words");
    check(out, device, torch::kFloat16, {K, -1}, op, "out");
    TORCH_CHECK(n0 >= 0 && n0 + out.size(1) <= N, op, ": columns ", num(n0), " .. ", num(n0 + out.size(1) - 1),
                " are not all below N = ", num(N));
    raise_on(fused_uint4_dequantize_launch(static_cast<int>(device.index()), stream, words.data_ptr(),
                                           scale.data_ptr(), zero.data_ptr(), N, K, K / scale.size(0), n0,
                                           out.size(1), out.data_ptr()),
             op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Fused RWKV-7 forward kernels: layer norm + token shift + mix, time mix, grouped GEMV, sparse-input GEMV, "
            "relu^2, 4-bit dequantization";
    m.def("ln_shift_mix", &ln_shift_mix, "ln_shift_mix(x, ln_w, ln_b, shift, prev, slots, lasts, mix, out, stream)");
    m.def("time_mix", &time_mix,
          "time_mix(state, slots, starts, lasts, tensors, params, first_layer, max_len, stream, pipeline_blocks=0)",
          py::arg("state"), py::arg("slots"), py::arg("starts"), py::arg("lasts"), py::arg("tensors"),
          py::arg("params"), py::arg("first_layer"), py::arg("max_len"), py::arg("stream"),
          py::arg("pipeline_blocks") = 0);
    m.def("gemv", &gemv, "gemv(w, scale, zero, x, y, residual, group, epilogue, stream, stage=[], sync=None)",
          py::arg("w"), py::arg("scale"), py::arg("zero"), py::arg("x"), py::arg("y"), py::arg("residual"),
          py::arg("group"), py::arg("epilogue"), py::arg("stream"), py::arg("stage") = std::vector<int64_t>{},
          py::arg("sync") = py::none());
    m.def("gemv_max_rows", &fused_gemv_max_rows);
    m.def("gemv_max_tasks", &fused_gemv_max_tasks);
    m.def("sparse_gemv", &sparse_gemv, "sparse_gemv(x, w_t, scale, y, residual, partial, arrivals, stream)");
    m.def("sparse_gemv_workspace", &sparse_gemv_workspace,
          "sparse_gemv_workspace(k, n, int8=False) -> [fp32 values, counters]", py::arg("k"), py::arg("n"),
          py::arg("int8") = false);
    m.def("sparse_gemv_max_rows", &sparse_gemv_max_rows, "sparse_gemv_max_rows(int8=False)",
          py::arg("int8") = false);
    m.def("relu_square_", &relu_square_, "relu_square_(x, stream): x = relu(x)^2 in place");
    m.def("uint4_dequantize", &uint4_dequantize,
          "uint4_dequantize(words, scale, zero, n0, out, stream): columns of a 4-bit GemLite matrix's W^T in fp16");
}
