// Torch binding of the persistent decode-step kernel (cuda/rwkv7_step.cu; infer/ops/persistent.py). CUDA only: on
// ROCm the server keeps the fused launches (the kernel has no HIP port).
//
// Only <torch/extension.h> is included (no ATen/CUDA headers), so this file also compiles against a CPU build of
// torch; the launchers are reached through a plain C interface. The caller passes the raw handle of the stream to
// launch on (torch.cuda.current_stream().cuda_stream), so the step can be captured in a CUDA graph.
#include <torch/extension.h>

#include "op_messages.h"

#include <cstdint>

extern "C" int rwkv7_step_entries(int which);
extern "C" int64_t rwkv7_step_phase_bytes();
extern "C" int64_t rwkv7_step_max_phases(const int64_t* dims);
extern "C" int64_t rwkv7_step_workspace(const int64_t* dims, int which);
extern "C" int64_t rwkv7_step_build(const int64_t* dims, const int64_t* model, int model_entries,
                                    const int64_t* layers, int layer_entries, void* out);
extern "C" int rwkv7_step_launch(int device, int64_t stream, const void* phases, int nphases, const int64_t* dims,
                                 const int64_t* token, const int64_t* slot, const void* emb, void* x, float* logits,
                                 unsigned* sync, unsigned* deps, int prefetch, int blocks_per_sm,
                                 unsigned long long* timeline, int timeline_stride);
extern "C" const char* rwkv7_step_error_string(int code);

namespace {

using op_messages::num;
using op_messages::shape;

void check_cpu_int64(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous(), "rwkv7_step: ", name,
                " must be a contiguous int64 CPU tensor");
}

void check_scalar(const torch::Tensor& t, const torch::Device& device, const char* name) {
    TORCH_CHECK(t.device() == device && t.scalar_type() == torch::kInt64 && t.numel() >= 1, "rwkv7_step: ", name,
                " must be an int64 tensor on ", device.str(), ", got ", t.scalar_type(), " ", shape(t), " on ",
                t.device().str());
}

void check_dims(const torch::Tensor& dims) {
    check_cpu_int64(dims, "dims");
    TORCH_CHECK(dims.numel() == rwkv7_step_entries(2), "rwkv7_step: dims must have ", num(rwkv7_step_entries(2)),
                " entries, got ", shape(dims));
}

}  // namespace

int64_t entries(int64_t which) { return rwkv7_step_entries(static_cast<int>(which)); }

int64_t workspace(torch::Tensor dims, int64_t which) {
    check_dims(dims);
    return rwkv7_step_workspace(dims.data_ptr<int64_t>(), static_cast<int>(which));
}

// The program of one step (host bytes, one Phase after another) for the model/layer entries (data pointers and row
// strides, infer/ops/persistent.py's order); its phase count is size / phase_bytes.
torch::Tensor build(torch::Tensor dims, torch::Tensor model, torch::Tensor layers) {
    check_dims(dims);
    check_cpu_int64(model, "model");
    check_cpu_int64(layers, "layers");
    TORCH_CHECK(layers.dim() == 2 && layers.size(0) == dims.data_ptr<int64_t>()[0], "rwkv7_step: layers must be ",
                "[n_layer, entries], got ", shape(layers));
    const int64_t bytes = rwkv7_step_phase_bytes();
    const int64_t max = rwkv7_step_max_phases(dims.data_ptr<int64_t>());
    torch::Tensor out = torch::zeros({max * bytes}, torch::dtype(torch::kUInt8));
    const int64_t n = rwkv7_step_build(dims.data_ptr<int64_t>(), model.data_ptr<int64_t>(),
                                       static_cast<int>(model.numel()), layers.data_ptr<int64_t>(),
                                       static_cast<int>(layers.size(1)), out.data_ptr());
    TORCH_CHECK(n > 0, "rwkv7_step: ", rwkv7_step_error_string(static_cast<int>(n)));
    return out.narrow(0, 0, n * bytes).clone();
}

// One decode step: token/slot int64 device scalars; emb [V, C] and x [C] fp16, logits [V] fp32 (the tensors the
// model entries point to); sync: 2 zeroed int32 on the device, deps: workspace(dims, 1) of them, zeroed (the kernel
// leaves both zero). timeline: empty, or int64 [nphases, 2, blocks] on the device (blocks at least the grid's), where
// each block writes when it starts and ends each phase (ns; entries of blocks past the grid are left as they are).
void launch(torch::Tensor program, torch::Tensor dims, torch::Tensor token, torch::Tensor slot, torch::Tensor emb,
            torch::Tensor x, torch::Tensor logits, torch::Tensor sync, torch::Tensor deps, int64_t prefetch,
            int64_t blocks_per_sm, torch::Tensor timeline, int64_t stream) {
    TORCH_CHECK(program.is_cuda(), "rwkv7_step: the program must be on a CUDA device");
    const torch::Device device = program.device();
    check_dims(dims);
    check_scalar(token, device, "token");
    check_scalar(slot, device, "slot");
    TORCH_CHECK(sync.device() == device && sync.scalar_type() == torch::kInt32 && sync.numel() == 2,
                "rwkv7_step: sync must be 2 int32 on ", device.str());
    TORCH_CHECK(deps.device() == device && deps.scalar_type() == torch::kInt32 &&
                    deps.numel() >= rwkv7_step_workspace(dims.data_ptr<int64_t>(), 1),
                "rwkv7_step: deps must be int32 on ", device.str(), ", as many as workspace(dims, 1)");
    const int64_t nphases = program.numel() / rwkv7_step_phase_bytes();
    const bool timed = timeline.numel() > 0;
    TORCH_CHECK(!timed || (timeline.device() == device && timeline.scalar_type() == torch::kInt64 &&
                           timeline.is_contiguous() && timeline.dim() == 3 && timeline.size(0) == nphases &&
                           timeline.size(1) == 2),
                "rwkv7_step: timeline must be empty or a contiguous int64 [", num(nphases), ", 2, blocks] tensor on ",
                device.str(), ", got ", timeline.scalar_type(), " ", shape(timeline));
    const int err = rwkv7_step_launch(static_cast<int>(device.index()), stream, program.data_ptr(),
                                      static_cast<int>(nphases), dims.data_ptr<int64_t>(), token.data_ptr<int64_t>(),
                                      slot.data_ptr<int64_t>(), emb.data_ptr(), x.data_ptr(), logits.data_ptr<float>(),
                                      reinterpret_cast<unsigned*>(sync.data_ptr<int32_t>()),
                                      reinterpret_cast<unsigned*>(deps.data_ptr<int32_t>()), static_cast<int>(prefetch),
                                      static_cast<int>(blocks_per_sm),
                                      timed ? reinterpret_cast<unsigned long long*>(timeline.data_ptr<int64_t>())
                                            : nullptr,
                                      timed ? static_cast<int>(timeline.size(2)) : 0);
    TORCH_CHECK(err == 0, "rwkv7_step: launch failed: ", rwkv7_step_error_string(err), " (error ", num(err), ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "RWKV-7 batch-1 decode step as one persistent kernel";
    m.def("entries", &entries, "entries(which): the model (0) or per-layer (1) entry count of this build");
    m.def("workspace", &workspace, "workspace(dims, which): fp32 partial sums (0) and int32 counters (1) a step needs");
    m.def("build", &build, "build(dims, model, layers): the step's program (host bytes)");
    m.def("launch", &launch,
          "launch(program, dims, token, slot, emb, x, logits, sync, deps, prefetch, blocks_per_sm, timeline, stream)");
}
