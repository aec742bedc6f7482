// Stand-in for <cuda_bf16.h>: __nv_bfloat16 and its conversions are in emu_device.h.
#pragma once
#include "emu_device.h"
