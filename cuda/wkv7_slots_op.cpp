// Torch binding of the WKV-7 slot-pool kernel (cuda/wkv7_slots.cu, or hip/wkv7_slots.hip on ROCm).
//
// Only <torch/extension.h> is included (no ATen/CUDA headers), so this file also compiles against a
// CPU build of torch; the launcher is reached through a plain C interface. The caller passes the
// raw handle of the stream to launch on (torch.cuda.current_stream().cuda_stream), which keeps every
// launch on the current stream and makes the op safe to capture in a CUDA graph.
#include <torch/extension.h>

#include "op_messages.h"

#include <cstdint>
#include <string>

extern "C" int wkv7_slots_launch(int device, int64_t stream, int act_dtype, int state_dtype, int64_t B, int64_t H,
                                 int64_t num_slots, int64_t num_tokens, void* state, const int64_t* slots,
                                 const int64_t* starts, const int64_t* lasts, const void* r, const float* w,
                                 const void* k, const void* v, const void* a, const void* b, float* y);
extern "C" const char* wkv7_slots_error_string(int code);

namespace {

constexpr int64_t kHeadSize = 64;

using op_messages::num;  // numbers never streamed into messages (op_messages.h)
using op_messages::shape;

// dtype codes of the launcher
int act_code(const torch::Tensor& t) {
    switch (t.scalar_type()) {
        case torch::kFloat32: return 0;
        case torch::kFloat16: return 1;
        case torch::kBFloat16: return 2;
        default:
            TORCH_CHECK(false, "wkv7_slots: activations must be float32, float16 or bfloat16, got ", t.scalar_type());
    }
    return -1;
}

int state_code(const torch::Tensor& t) {
    switch (t.scalar_type()) {
        case torch::kFloat32: return 0;
        case torch::kFloat16: return 1;
        default:
            TORCH_CHECK(false, "wkv7_slots: the state pool must be float32 or float16, got ", t.scalar_type());
    }
    return -1;
}

void check_on(const torch::Tensor& t, const torch::Device& device, const char* name) {
    TORCH_CHECK(t.device() == device, "wkv7_slots: ", name, " is on ", t.device().str(), ", the state pool on ",
                device.str());
    TORCH_CHECK(t.is_contiguous(), "wkv7_slots: ", name, " must be contiguous");
}

void check_index(const torch::Tensor& t, const torch::Device& device, int64_t B, const char* name) {
    check_on(t, device, name);
    TORCH_CHECK(t.scalar_type() == torch::kInt64, "wkv7_slots: ", name, " must be int64, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "wkv7_slots: ", name, " must have shape [", num(B), "], got ",
                shape(t));
}

void check_tc(const torch::Tensor& t, const torch::Device& device, int64_t T, int64_t C, const char* name) {
    check_on(t, device, name);
    TORCH_CHECK(t.dim() == 2 && t.size(0) == T && t.size(1) == C, "wkv7_slots: ", name, " must have shape [",
                num(T), ", ", num(C), "], got ", shape(t));
}

}  // namespace

// Run the WKV-7 recurrence of B packed rows, reading and writing each row's state in place:
//   state  [S, H, 64, 64] float32/float16, contiguous (one layer's pool; state[slot][h][value][key])
//   slots, starts, lasts  [B] int64: row b owns tokens starts[b]..lasts[b] and state slot slots[b]
//   r, k, v, a, b  [T, H*64] one activation dtype (float32/float16/bfloat16); w [T, H*64] float32
//   y  [T, H*64] float32, written
// Slot ids are not bounds-checked here (that would need a device sync); the kernel skips a row
// with an out-of-range slot and writes NaN into its y instead.
void wkv7_slots(torch::Tensor state, torch::Tensor slots, torch::Tensor starts, torch::Tensor lasts,
                torch::Tensor r, torch::Tensor w, torch::Tensor k, torch::Tensor v, torch::Tensor a, torch::Tensor b,
                torch::Tensor y, int64_t stream) {
    TORCH_CHECK(state.is_cuda(), "wkv7_slots: the state pool must be on a CUDA device, got ", state.device().str());
    const torch::Device device = state.device();
    check_on(state, device, "state");
    TORCH_CHECK(state.dim() == 4 && state.size(2) == kHeadSize && state.size(3) == kHeadSize,
                "wkv7_slots: state must have shape [slots, heads, 64, 64], got ", shape(state));
    TORCH_CHECK(reinterpret_cast<std::uintptr_t>(state.data_ptr()) % 16 == 0,
                "wkv7_slots: the state pool must be 16-byte aligned");
    const int state_dtype = state_code(state);
    const int64_t num_slots = state.size(0), H = state.size(1), C = H * kHeadSize;

    TORCH_CHECK(slots.dim() == 1, "wkv7_slots: slots must be 1-D, got shape ", shape(slots));
    const int64_t B = slots.size(0);
    check_index(slots, device, B, "slots");
    check_index(starts, device, B, "starts");
    check_index(lasts, device, B, "lasts");

    TORCH_CHECK(r.dim() == 2, "wkv7_slots: r must be 2-D [tokens, channels], got shape ", shape(r));
    const int64_t T = r.size(0);
    const int act_dtype = act_code(r);
    const std::pair<const torch::Tensor*, const char*> acts[] = {{&r, "r"}, {&k, "k"}, {&v, "v"}, {&a, "a"}, {&b, "b"}};
    for (const auto& [t, name] : acts) {
        check_tc(*t, device, T, C, name);
        TORCH_CHECK(t->scalar_type() == r.scalar_type(), "wkv7_slots: ", name, " is ", t->scalar_type(),
                    " but r is ", r.scalar_type(), " (r, k, v, a, b must share one dtype)");
    }
    check_tc(w, device, T, C, "w");
    TORCH_CHECK(w.scalar_type() == torch::kFloat32, "wkv7_slots: w must be float32, got ", w.scalar_type());
    check_tc(y, device, T, C, "y");
    TORCH_CHECK(y.scalar_type() == torch::kFloat32, "wkv7_slots: y must be float32, got ", y.scalar_type());

    if (B == 0 || T == 0) return;
    const int err = wkv7_slots_launch(
        static_cast<int>(device.index()), stream, act_dtype, state_dtype, B, H, num_slots, T, state.data_ptr(),
        slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), lasts.data_ptr<int64_t>(), r.data_ptr(),
        w.data_ptr<float>(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr<float>());
    TORCH_CHECK(err == 0, "wkv7_slots: kernel launch failed: ", wkv7_slots_error_string(err), " (error ", num(err),
                ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "RWKV-7 WKV recurrence over a slot pool of states, updated in place";
    m.def("wkv7_slots", &wkv7_slots,
          "wkv7_slots(state, slots, starts, lasts, r, w, k, v, a, b, y, stream): y = WKV-7 of the packed rows; "
          "state[slots] updated in place",
          py::arg("state"), py::arg("slots"), py::arg("starts"), py::arg("lasts"), py::arg("r"), py::arg("w"),
          py::arg("k"), py::arg("v"), py::arg("a"), py::arg("b"), py::arg("y"), py::arg("stream"));
}
