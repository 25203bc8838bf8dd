// The host emulation: runs a tile program on the CPU, block by block, with
// the semantics written in program.hpp — fp32 registers and fused
// multiply-adds in the device's order, inputs read and outputs rounded in
// their dtype (round to nearest even). It is how the generated kernels are
// checked on machines without a GPU (every CI run).
#pragma once

#include "lina/cuda/program.hpp"

namespace lina::cuda {

// Execute p over every block of the grid, reading and writing host memory
// through the same argument block a launch gets. A chained program reads
// args.state_in and writes args.state_out (which must not overlap: checked,
// std::invalid_argument), also when n = 0 (it then copies the state).
void emulate(program const& p, forward_args const& args);

// What emulate() runs a kernel with, once its arguments are checked: the
// interpreter of program.hpp's semantics unless a runner is installed. A
// runner gets the blocks a launch would have (it is not called where a launch
// would launch nothing) and throws what it cannot run. The tests install one
// that runs the generated CUDA source itself on the host (tests/simt), and
// every emulated path — cuda::emulate, split forwards, gradients, steps — goes
// through it. Returns the runner it replaces (nullptr: the interpreter).
using kernel_runner = void (*)(program const& p, forward_args const& args, std::int64_t blocks);
kernel_runner set_kernel_runner(kernel_runner runner) noexcept;

}  // namespace lina::cuda
