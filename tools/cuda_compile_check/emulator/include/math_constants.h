// Emulator stand-in for CUDA's math_constants.h.
#pragma once
#include <limits>
#define CUDART_INF_F std::numeric_limits<float>::infinity()
#define CUDART_INF std::numeric_limits<double>::infinity()
