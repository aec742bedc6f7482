// Torch binding of bench/experiment_f16_gemm_sm90.cu (an experiment; only <torch/extension.h>, the kernels
// through a C interface, as cuda/w8a16_gemm_op.cpp does).
#include <torch/extension.h>

#include <cstdint>
#include <string>

extern "C" int f16_gemm_configs();
extern "C" const char* f16_gemm_config_name(int config);
extern "C" int f16_gemm_launch(int config, int64_t stream, int M, int N, int K, int L, const void* x, const void* w,
                               void* y, float beta, int splits, void* workspace, size_t workspace_bytes, int sms,
                               size_t* needed);

namespace {

// x [L, M, K], w [L, N, K], y [L, M, N], fp16, contiguous, on one CUDA device.
void shapes(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& y) {
    for (const auto* t : {&x, &w, &y}) {
        TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kFloat16 && t->is_contiguous() && t->dim() == 3,
                    "f16 gemm: x, w, y must be contiguous fp16 CUDA tensors [L, rows, cols]");
    }
    TORCH_CHECK(x.size(0) == w.size(0) && y.size(0) == x.size(0) && x.size(2) == w.size(2) &&
                    y.size(1) == x.size(1) && y.size(2) == w.size(1),
                "f16 gemm: shapes must be x [L, M, K], w [L, N, K], y [L, M, N]");
}

}  // namespace

int64_t workspace_size(int64_t config, torch::Tensor x, torch::Tensor w, torch::Tensor y, int64_t splits,
                       int64_t sms) {
    shapes(x, w, y);
    size_t needed = 0;
    const int err = f16_gemm_launch(static_cast<int>(config), 0, x.size(1), w.size(1), x.size(2), x.size(0),
                                    x.data_ptr(), w.data_ptr(), y.data_ptr(), 0.0f, static_cast<int>(splits),
                                    nullptr, 0, static_cast<int>(sms), &needed);
    TORCH_CHECK(err == 0, "f16 gemm: config ", std::to_string(config), " cannot run this problem (error ",
                std::to_string(err), ")");
    return static_cast<int64_t>(needed);
}

void gemm(int64_t config, torch::Tensor x, torch::Tensor w, torch::Tensor y, double beta, int64_t splits,
          torch::Tensor workspace, int64_t sms, int64_t stream) {
    shapes(x, w, y);
    const int err = f16_gemm_launch(static_cast<int>(config), stream, x.size(1), w.size(1), x.size(2), x.size(0),
                                    x.data_ptr(), w.data_ptr(), y.data_ptr(), static_cast<float>(beta),
                                    static_cast<int>(splits), workspace.numel() ? workspace.data_ptr() : nullptr,
                                    static_cast<size_t>(workspace.numel()), static_cast<int>(sms), nullptr);
    TORCH_CHECK(err == 0, "f16 gemm: config ", std::to_string(config), " failed (error ", std::to_string(err), ")");
}

std::string name(int64_t config) { return f16_gemm_config_name(static_cast<int>(config)); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("configs", &f16_gemm_configs);
    m.def("name", &name);
    m.def("workspace_size", &workspace_size);
    m.def("gemm", &gemm);
}
