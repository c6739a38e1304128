// The torch extension as one translation unit: lowbit.cpp (the products' thread split) and step.cpp (the
// C++ layer loop). Their cost to compile is torch's headers (about 25 s per file on one core); one unit
// parses them once and leaves the other core to gcc's kernel variants (specdecode/lowbit_kernels.py).
#include "lowbit.cpp"
#include "step.cpp"
