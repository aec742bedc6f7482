// Stand-in for <hip/hip_fp16.h>: __half and its conversions are in ../emu_device.h.
#pragma once
#include "../emu_device.h"
