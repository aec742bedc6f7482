// Torch binding of the W8A16 linear kernels (cuda/w8a16_gemm.cu, or hip/w8a16_gemm.hip on ROCm).
//
// Only <torch/extension.h> is included (no ATen/CUDA headers), so this file also compiles against a CPU
// build of torch; the kernels are reached through a plain C interface. The caller passes the raw handle
// of the stream to launch on (torch.cuda.current_stream().cuda_stream), which keeps every launch on the
// current stream and makes the ops safe to capture in a CUDA graph. The caller also allocates y, so the
// ops allocate nothing.
#include <torch/extension.h>

#include "op_messages.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

extern "C" int w8a16_gemv_max_rows();
extern "C" int w8a16_gemm_available();
extern "C" int w8a16_gemv_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                 const void* w, const void* scale, void* y);
extern "C" int w8a16_gemm_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                 const void* w, const void* scale, void* y);
extern "C" int w8a16_gemm_sm90_tiles();
extern "C" int w8a16_gemm_sm90_tile(int tile, int which);
extern "C" int w8a16_gemm_sm90_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                      const void* w, const void* scale, void* y, int tile, int splits, void* partials,
                                      int64_t partial_rows);
extern "C" int w4a16_gemm_sm90_launch(int device, int64_t stream, int64_t M, int64_t N, int64_t K, const void* x,
                                      const void* words, const void* scale, const void* zero, int64_t group, void* y,
                                      int tile, int splits, void* partials, int64_t partial_rows);
extern "C" const char* w8a16_error_string(int code);

namespace {

using op_messages::num;  // numbers never streamed into messages (op_messages.h)
using op_messages::shape;

void check(const torch::Tensor& t, const torch::Device& device, torch::ScalarType dtype, const char* op,
           const char* name) {
    TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device().str(), ", x on ", device.str());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
                " must be 16-byte aligned");
}

// The device of x and y (both fp16, contiguous, aligned; x on a CUDA device, y on the same one).
torch::Device activation_device(const char* op, const torch::Tensor& x, const torch::Tensor& y) {
    TORCH_CHECK(x.is_cuda(), op, ": x must be on a CUDA device, got ", x.device().str());
    check(x, x.device(), torch::kFloat16, op, "x");
    check(y, x.device(), torch::kFloat16, op, "y");
    return x.device();
}

void check_output(const char* op, const torch::Tensor& y, int64_t M, int64_t N) {
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N, op, ": y must have shape [", num(M), ", ", num(N),
                "], got ", shape(y));
}

// Split K of the Hopper GEMMs: (splits, rows) of `partials` (fp32 [splits >= 2, rows >= 1, N], on x's device), K
// cut in `splits` slices of whole `step`s (the 4-bit group; 64 for int8); (1, 0) without partials.
std::pair<int64_t, int64_t> split_of(const char* op, const std::optional<torch::Tensor>& partials,
                                     const torch::Device& device, int64_t N, int64_t K, int64_t step) {
    if (!partials.has_value()) return {1, 0};
    check(*partials, device, torch::kFloat32, op, "partials");
    TORCH_CHECK(partials->dim() == 3 && partials->size(0) >= 2 && partials->size(1) >= 1 && partials->size(2) == N,
                op, ": partials must have shape [splits >= 2, rows >= 1, ", num(N), "], got ", shape(*partials));
    const int64_t splits = partials->size(0);
    TORCH_CHECK(K % (splits * step) == 0 && (K / splits) % 64 == 0 && N % 4 == 0, op, ": K = ", num(K),
                " cannot be split in ", num(splits), " slices of whole groups of ", num(step),
                " and of 64 (or N = ", num(N), " is not a multiple of 4)");
    return {splits, partials->size(1)};
}

// y[M, N] = x[M, K] @ (w[N, K] * scale[N, None])^T: checks, then one launch through
// launch(device, stream, M, N, K, x, w, scale, y).
template <typename Launch>
void run(const char* op, Launch launch, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
         const torch::Tensor& y, int64_t stream) {
    const torch::Device device = activation_device(op, x, y);
    check(w, device, torch::kInt8, op, "w");
    check(scale, device, torch::kFloat16, op, "scale");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), op, ": x ", shape(x), " and w ", shape(w),
                " must be [M, K] and [N, K]");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, op, ": scale must have shape [", num(N), "], got ",
                shape(scale));
    check_output(op, y, M, N);
    if (M == 0) return;
    const int err = launch(static_cast<int>(device.index()), stream, M, N, K, x.data_ptr(), w.data_ptr(),
                           scale.data_ptr(), y.data_ptr());
    TORCH_CHECK(err == 0, op, ": ", w8a16_error_string(err), " (error ", num(err), ", M=", num(M), " N=", num(N),
                " K=", num(K), ")");
}

}  // namespace

void gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor y, int64_t stream) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) <= w8a16_gemv_max_rows(), "w8a16 gemv: at most ",
                num(w8a16_gemv_max_rows()), " rows, got x ", shape(x));
    run("w8a16 gemv", w8a16_gemv_launch, x, w, scale, y, stream);
}

void gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor y, int64_t stream) {
    run("w8a16 gemm", w8a16_gemm_launch, x, w, scale, y, stream);
}

// With partials (fp32 [splits, rows, N], splits >= 2; scratch): K is split as gemm_w4_sm90 does.
void gemm_sm90(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor y, int64_t stream, int64_t tile,
               std::optional<torch::Tensor> partials) {
    const char* op = "w8a16 gemm (sm90)";
    TORCH_CHECK(tile >= -1 && tile < w8a16_gemm_sm90_tiles(), op, ": tile ", num(tile), " of ",
                num(w8a16_gemm_sm90_tiles()));
    TORCH_CHECK(w.dim() == 2, op, ": w must be [N, K], got ", shape(w));
    // (splits, rows of x per chunk): not a structured binding, which a C++17 lambda cannot capture
    const std::pair<int64_t, int64_t> split = split_of(op, partials, activation_device(op, x, y), w.size(0),
                                                       w.size(1), 64);
    void* partial_data = partials.has_value() ? partials->data_ptr() : nullptr;
    run(op, [&](int device, int64_t s, int64_t M, int64_t N, int64_t K, const void* xp, const void* wp,
                const void* sp, void* yp) {
        return w8a16_gemm_sm90_launch(device, s, M, N, K, xp, wp, sp, yp, static_cast<int>(tile),
                                      static_cast<int>(split.first), partial_data, split.second);
    }, x, w, scale, y, stream);
}

// y[M, N] = x[M, K] @ W^T for 4-bit W: words [N, K / 8] int32 (k in bits 4 (k % 8) .. of word k / 8), scale and
// zero [K / group, N] fp16, W = q * scale + zero (GemLite A16W4_HQQ_INT with its [K / 8, N] words transposed).
// With partials (fp32 [splits, rows, N], splits >= 2; scratch): K is split in `splits` slices, `rows` rows of x at
// a time, each chunk's slice products written there (packed, [splits, chunk rows, N]) and summed into y.
void gemm_w4_sm90(torch::Tensor x, torch::Tensor words, torch::Tensor scale, torch::Tensor zero, int64_t group,
                  torch::Tensor y, int64_t stream, int64_t tile, std::optional<torch::Tensor> partials) {
    const char* op = "w4a16 gemm (sm90)";
    TORCH_CHECK(tile >= -1 && tile < w8a16_gemm_sm90_tiles(), op, ": tile ", num(tile), " of ",
                num(w8a16_gemm_sm90_tiles()));
    const torch::Device device = activation_device(op, x, y);
    check(words, device, torch::kInt32, op, "words");
    check(scale, device, torch::kFloat16, op, "scale");
    check(zero, device, torch::kFloat16, op, "zero");
    TORCH_CHECK(x.dim() == 2 && words.dim() == 2 && x.size(1) == 8 * words.size(1), op, ": x ", shape(x),
                " and words ", shape(words), " must be [M, K] and [N, K / 8]");
    const int64_t M = x.size(0), K = x.size(1), N = words.size(0);
    TORCH_CHECK(group > 0 && K % group == 0, op, ": group ", num(group), " must divide K = ", num(K));
    for (const torch::Tensor* t : {&scale, &zero})
        TORCH_CHECK(t->dim() == 2 && t->size(0) == K / group && t->size(1) == N, op, ": scale and zero must have shape [",
                    num(K / group), ", ", num(N), "], got ", shape(*t));
    check_output(op, y, M, N);
    const auto [splits, partial_rows] = split_of(op, partials, device, N, K, group);
    if (M == 0) return;
    const int err = w4a16_gemm_sm90_launch(static_cast<int>(device.index()), stream, M, N, K, x.data_ptr(),
                                           words.data_ptr(), scale.data_ptr(), zero.data_ptr(), group, y.data_ptr(),
                                           static_cast<int>(tile), static_cast<int>(splits),
                                           partials.has_value() ? partials->data_ptr() : nullptr, partial_rows);
    TORCH_CHECK(err == 0, op, ": ", w8a16_error_string(err), " (error ", num(err), ", M=", num(M), " N=", num(N),
                " K=", num(K), " group=", num(group), " splits=", num(splits), ")");
}

// (output channels, batch rows) of each Hopper GEMM tile; empty in builds without it.
std::vector<std::pair<int64_t, int64_t>> gemm_sm90_tiles() {
    std::vector<std::pair<int64_t, int64_t>> tiles;
    for (int i = 0; i < w8a16_gemm_sm90_tiles(); ++i) tiles.emplace_back(w8a16_gemm_sm90_tile(i, 0), w8a16_gemm_sm90_tile(i, 1));
    return tiles;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "W8A16 linear layer: fp16 activations times int8 weights with per-output-channel fp16 scales (and the "
              "Hopper GEMM for 4-bit GemLite weights)";
    m.def("gemv", &gemv, "gemv(x, w, scale, y, stream): y = x @ (w * scale[:, None]).T for at most gemv_max_rows() rows",
          py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("y"), py::arg("stream"));
    m.def("gemm", &gemm, "gemm(x, w, scale, y, stream): the same product with the CUTLASS tensor-core GEMM",
          py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("y"), py::arg("stream"));
    m.def("gemm_sm90", &gemm_sm90, "gemm_sm90(x, w, scale, y, stream, tile=-1, partials=None): the same product with "
          "the Hopper WGMMA GEMM in tile `tile` of gemm_sm90_tiles() (-1: chosen from the shape); partials (fp32 "
          "[splits, rows, N]) splits K",
          py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("y"), py::arg("stream"), py::arg("tile") = -1,
          py::arg("partials") = py::none());
    m.def("gemm_w4_sm90", &gemm_w4_sm90, "gemm_w4_sm90(x, words, scale, zero, group, y, stream, tile=-1, "
          "partials=None): y = x @ W.T for 4-bit weights (words [N, K/8] int32, scale and zero [K/group, N]) with the "
          "Hopper WGMMA GEMM; partials (fp32 [splits, rows, N]) splits K",
          py::arg("x"), py::arg("words"), py::arg("scale"), py::arg("zero"), py::arg("group"), py::arg("y"),
          py::arg("stream"), py::arg("tile") = -1, py::arg("partials") = py::none());
    m.def("gemv_max_rows", &w8a16_gemv_max_rows, "the most rows (M) the GEMV takes");
    m.def("gemm_available", []() { return w8a16_gemm_available() != 0; },
          "whether this build has the CUTLASS GEMM (else larger batches must dequantize)");
    m.def("gemm_sm90_tiles", &gemm_sm90_tiles, "the Hopper GEMM's tiles as (output channels, batch rows); empty "
          "unless this is an sm_90a build");
}
