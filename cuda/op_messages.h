// Numbers and shapes in the error messages of the torch bindings (cuda/*_op.cpp).
//
// Numbers are formatted with std::to_string, never streamed: on one CUDA image (torch 2.11) streaming an
// integer into a TORCH_CHECK message from an extension crashed with SIGSEGV inside
// std::ostream::_M_insert<long>, turning a bad argument into a dead server.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace op_messages {

inline std::string num(int64_t x) { return std::to_string(x); }

inline std::string shape(const torch::Tensor& t) {
    std::string out = "[";
    for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + num(t.size(d));
    return out + "]";
}

}  // namespace op_messages
