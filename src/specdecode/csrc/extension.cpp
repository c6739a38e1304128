// The torch extension as one translation unit: lowbit.cpp (the products' thread split) and step.cpp (the
// C++ layer loop). Their cost to compile is torch's headers (both in one unit: 26 s on one core with ATen and
// torch's pybind header, 31 s with torch/extension.h, measured on the Intel Xeon); one unit
// parses them once and leaves the other core to gcc's kernel variants (specdecode/lowbit_kernels.py).
#include "lowbit.cpp"
#include "step.cpp"
