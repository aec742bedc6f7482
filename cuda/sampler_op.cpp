// Torch binding of the sampler kernel (cuda/sampler.cu, or hip/sampler.hip on ROCm).
//
// Only <torch/extension.h> is included (no ATen/CUDA headers), so this file also compiles against a
// CPU build of torch; the launcher is reached through a plain C interface. The caller passes the
// raw handle of the stream to launch on (torch.cuda.current_stream().cuda_stream), which keeps every
// launch on the current stream and makes the op safe to capture in a CUDA graph. The checks below
// look at shapes, dtypes and devices only: nothing is read back from the device.
#include <torch/extension.h>

#include "op_messages.h"

#include <climits>
#include <cstdint>
#include <string>
#include <tuple>

extern "C" int sampler_launch(int device, int64_t stream, int64_t B, int64_t V, int64_t p_stride, const float* p,
                              const int64_t* top_k, int64_t k_stride, const float* top_p, int64_t tp_stride,
                              const float* u, int64_t u_stride, const int64_t* greedy, int64_t g_stride, float* tau,
                              int64_t* drawn);
extern "C" int sampler_prepare_launch(int device, int64_t stream, int64_t B, int64_t V, int64_t vv, int half,
                                      const void* logits, int64_t l_stride, const float* penalty, int64_t pen_stride,
                                      const int64_t* slots, const int64_t* bias_ids, const float* bias_vals,
                                      int64_t n_bias, int64_t bias_stride, const float* temp, int64_t t_stride,
                                      const int64_t* k1, const int64_t* k2, int64_t k_stride, const int64_t* steps,
                                      float* s, int64_t s_stride, int64_t* tok, bool* dead, int64_t* fallback,
                                      float* u);
extern "C" const char* sampler_error_string(int code);

namespace {

using op_messages::num;  // numbers never streamed into messages (op_messages.h)
using op_messages::shape;

void check_row_vector(const torch::Tensor& t, const torch::Device& device, int64_t B, torch::ScalarType dtype,
                      const char* name) {
    TORCH_CHECK(t.device() == device, "sampler: ", name, " is on ", t.device().str(), ", p on ", device.str());
    TORCH_CHECK(t.scalar_type() == dtype, "sampler: ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "sampler: ", name, " must have shape [", num(B), "], got ",
                shape(t));
}

}  // namespace

// Keep threshold and draw of B sampled rows (see cuda/sampler.cu for the exact definition):
//   p      [B, V] float32, unit column stride (softmax of each row)
//   top_k  [B] int64 (0 = off), top_p [B] float32 (>= 1 = off), u [B] float32 uniforms in [0, 1),
//   greedy [B] int64 (non-zero: row skipped, tau 0 and drawn 0 written); any element stride
//   tau    [B] float32, drawn [B] int64: written, contiguous
void sampler_tau_draw(torch::Tensor p, torch::Tensor top_k, torch::Tensor top_p, torch::Tensor u, torch::Tensor greedy,
                      torch::Tensor tau, torch::Tensor drawn, int64_t stream) {
    TORCH_CHECK(p.is_cuda(), "sampler: p must be on a CUDA device, got ", p.device().str());
    const torch::Device device = p.device();
    TORCH_CHECK(p.scalar_type() == torch::kFloat32, "sampler: p must be float32, got ", p.scalar_type());
    TORCH_CHECK(p.dim() == 2, "sampler: p must be 2-D [rows, vocab], got shape ", shape(p));
    const int64_t B = p.size(0), V = p.size(1);
    TORCH_CHECK(V > 0 && V <= INT_MAX, "sampler: the vocabulary size must be in [1, 2^31), got ", num(V));
    TORCH_CHECK(B <= INT_MAX, "sampler: at most 2^31 - 1 rows, got ", num(B));
    TORCH_CHECK(p.stride(1) == 1 || V == 1, "sampler: p must have unit column stride");
    check_row_vector(top_k, device, B, torch::kInt64, "top_k");
    check_row_vector(top_p, device, B, torch::kFloat32, "top_p");
    check_row_vector(u, device, B, torch::kFloat32, "u");
    check_row_vector(greedy, device, B, torch::kInt64, "greedy");
    check_row_vector(tau, device, B, torch::kFloat32, "tau");
    check_row_vector(drawn, device, B, torch::kInt64, "drawn");
    TORCH_CHECK(tau.is_contiguous() && drawn.is_contiguous(), "sampler: tau and drawn must be contiguous");

    if (B == 0) return;
    const int err = sampler_launch(static_cast<int>(device.index()), stream, B, V, p.stride(0), p.data_ptr<float>(),
                                   top_k.data_ptr<int64_t>(), top_k.stride(0), top_p.data_ptr<float>(),
                                   top_p.stride(0), u.data_ptr<float>(), u.stride(0), greedy.data_ptr<int64_t>(),
                                   greedy.stride(0), tau.data_ptr<float>(), drawn.data_ptr<int64_t>());
    TORCH_CHECK(err == 0, "sampler: kernel launch failed: ", sampler_error_string(err), " (error ", num(err), ")");
}

void sampler_prepare(torch::Tensor logits, c10::optional<torch::Tensor> penalty, torch::Tensor slots,
                     c10::optional<torch::Tensor> bias_ids, c10::optional<torch::Tensor> bias_vals, int64_t vv,
                     torch::Tensor temp, torch::Tensor k1, torch::Tensor k2, torch::Tensor steps, torch::Tensor s,
                     torch::Tensor tok, torch::Tensor dead, torch::Tensor fallback, torch::Tensor u, int64_t stream) {
    TORCH_CHECK(logits.is_cuda(), "sampler_prepare: logits must be on a CUDA device, got ", logits.device().str());
    const torch::Device device = logits.device();
    const bool half = logits.scalar_type() == torch::kFloat16;
    TORCH_CHECK(half || logits.scalar_type() == torch::kFloat32, "sampler_prepare: logits must be float16 or float32, "
                "got ", logits.scalar_type());
    TORCH_CHECK(logits.dim() == 2, "sampler_prepare: logits must be 2-D [rows, vocab], got shape ", shape(logits));
    const int64_t B = logits.size(0), V = logits.size(1);
    TORCH_CHECK(V > 0 && V <= INT_MAX && B <= INT_MAX, "sampler_prepare: bad logits shape ", shape(logits));
    TORCH_CHECK(logits.stride(1) == 1 || V == 1, "sampler_prepare: logits must have unit column stride");
    TORCH_CHECK(vv >= 0, "sampler_prepare: vv must be >= 0, got ", num(vv));
    using RowVector = std::tuple<const torch::Tensor*, torch::ScalarType, const char*>;
    for (const auto& [t, dtype, name] :
         {RowVector{&slots, torch::kInt64, "slots"}, RowVector{&temp, torch::kFloat32, "temp"},
          RowVector{&k1, torch::kInt64, "k1"}, RowVector{&k2, torch::kInt64, "k2"},
          RowVector{&tok, torch::kInt64, "tok"}, RowVector{&fallback, torch::kInt64, "fallback"},
          RowVector{&dead, torch::kBool, "dead"}, RowVector{&u, torch::kFloat32, "u"}}) {
        check_row_vector(*t, device, B, dtype, name);
    }
    TORCH_CHECK(k1.stride(0) == k2.stride(0), "sampler_prepare: k1 and k2 must have the same stride");
    TORCH_CHECK(steps.device() == device && steps.scalar_type() == torch::kInt64 && steps.dim() == 1 &&
                steps.is_contiguous(), "sampler_prepare: steps must be a contiguous int64 vector on the logits' device");
    TORCH_CHECK(slots.is_contiguous() && tok.is_contiguous() && fallback.is_contiguous() && dead.is_contiguous() &&
                u.is_contiguous(), "sampler_prepare: slots, tok, dead, fallback and u must be contiguous");
    TORCH_CHECK(s.device() == device && s.scalar_type() == torch::kFloat32 && s.dim() == 2 && s.size(0) == B &&
                s.size(1) == V && (s.stride(1) == 1 || V == 1), "sampler_prepare: s must be float32 [", num(B), ", ",
                num(V), "] with unit column stride on the logits' device, got ", shape(s));
    const float* pen = nullptr;
    int64_t pen_stride = 0;
    if (penalty.has_value()) {
        const torch::Tensor& p = *penalty;
        TORCH_CHECK(p.device() == device && p.scalar_type() == torch::kFloat32 && p.dim() == 2 && p.size(1) == V &&
                    (p.stride(1) == 1 || V == 1), "sampler_prepare: penalty must be float32 [slots, ", num(V),
                    "] with unit column stride on the logits' device, got ", shape(p));
        pen = p.data_ptr<float>();
        pen_stride = p.stride(0);
    }
    TORCH_CHECK(bias_ids.has_value() == bias_vals.has_value(), "sampler_prepare: bias_ids and bias_vals go together");
    const int64_t* ids = nullptr;
    const float* vals = nullptr;
    int64_t n_bias = 0, bias_stride = 0;
    if (bias_ids.has_value()) {
        const torch::Tensor &bi = *bias_ids, &bv = *bias_vals;
        TORCH_CHECK(bi.device() == device && bv.device() == device && bi.scalar_type() == torch::kInt64 &&
                    bv.scalar_type() == torch::kFloat32 && bi.dim() == 2 && bi.sizes() == bv.sizes() &&
                    bi.strides() == bv.strides() && (bi.stride(1) == 1 || bi.size(1) <= 1),
                    "sampler_prepare: bias_ids int64 and bias_vals float32 must be [slots, entries] alike, got ",
                    shape(bi), " and ", shape(bv));
        ids = bi.data_ptr<int64_t>();
        vals = bv.data_ptr<float>();
        n_bias = bi.size(1);
        bias_stride = bi.stride(0);
    }
    if (B == 0) return;
    const int err = sampler_prepare_launch(static_cast<int>(device.index()), stream, B, V, vv, half ? 1 : 0,
                                           logits.data_ptr(), logits.stride(0), pen, pen_stride,
                                           slots.data_ptr<int64_t>(), ids, vals, n_bias, bias_stride,
                                           temp.data_ptr<float>(), temp.stride(0), k1.data_ptr<int64_t>(),
                                           k2.data_ptr<int64_t>(), k1.stride(0), steps.data_ptr<int64_t>(),
                                           s.data_ptr<float>(), s.stride(0), tok.data_ptr<int64_t>(),
                                           dead.data_ptr<bool>(), fallback.data_ptr<int64_t>(), u.data_ptr<float>());
    TORCH_CHECK(err == 0, "sampler_prepare: kernel launch failed: ", sampler_error_string(err), " (error ", num(err),
                ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Token sampler: top-k/top-p keep threshold and inverse-CDF draw per row, without sorting";
    m.def("sampler_tau_draw", &sampler_tau_draw,
          "sampler_tau_draw(p, top_k, top_p, u, greedy, tau, drawn, stream): per-row keep threshold tau (keep "
          "p >= tau) and drawn token",
          py::arg("p"), py::arg("top_k"), py::arg("top_p"), py::arg("u"), py::arg("greedy"), py::arg("tau"),
          py::arg("drawn"), py::arg("stream"));
    m.def("sampler_prepare", &sampler_prepare,
          "sampler_prepare(logits, penalty, slots, bias_ids, bias_vals, vv, temp, k1, k2, steps, s, tok, dead, "
          "fallback, u, stream): the adjusted logits over the temperature (s), their argmax, dead rows and their "
          "fallback token, and each row's uniform for this step",
          py::arg("logits"), py::arg("penalty"), py::arg("slots"), py::arg("bias_ids"), py::arg("bias_vals"),
          py::arg("vv"), py::arg("temp"), py::arg("k1"), py::arg("k2"), py::arg("steps"), py::arg("s"),
          py::arg("tok"), py::arg("dead"), py::arg("fallback"), py::arg("u"), py::arg("stream"));
}
