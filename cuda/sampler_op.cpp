// Torch binding of the sampler kernel (cuda/sampler.cu, or hip/sampler.hip on ROCm).
//
// Only <torch/extension.h> is included (no ATen/CUDA headers), so this file also compiles against a
// CPU build of torch; the launcher is reached through a plain C interface. The caller passes the
// raw handle of the stream to launch on (torch.cuda.current_stream().cuda_stream), which keeps every
// launch on the current stream and makes the op safe to capture in a CUDA graph. The checks below
// look at shapes, dtypes and devices only: nothing is read back from the device.
#include <torch/extension.h>

#include <climits>
#include <cstdint>
#include <string>

extern "C" int sampler_launch(int device, int64_t stream, int64_t B, int64_t V, int64_t p_stride, const float* p,
                              const int64_t* top_k, int64_t k_stride, const float* top_p, int64_t tp_stride,
                              const float* u, int64_t u_stride, const int64_t* greedy, int64_t g_stride, float* tau,
                              int64_t* drawn);
extern "C" const char* sampler_error_string(int code);

namespace {

// Numbers in error messages are formatted with std::to_string, not streamed (see wkv7_slots_op.cpp).
std::string num(int64_t x) { return std::to_string(x); }

std::string shape(const torch::Tensor& t) {
    std::string out = "[";
    for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + num(t.size(d));
    return out + "]";
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Token sampler: top-k/top-p keep threshold and inverse-CDF draw per row, without sorting";
    m.def("sampler_tau_draw", &sampler_tau_draw,
          "sampler_tau_draw(p, top_k, top_p, u, greedy, tau, drawn, stream): per-row keep threshold tau (keep "
          "p >= tau) and drawn token",
          py::arg("p"), py::arg("top_k"), py::arg("top_p"), py::arg("u"), py::arg("greedy"), py::arg("tau"),
          py::arg("drawn"), py::arg("stream"));
}
