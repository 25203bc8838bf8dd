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

}  // namespace lina::cuda
