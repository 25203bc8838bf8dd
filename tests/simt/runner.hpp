// Generated kernels run on the host as written (tests/simt/host_cuda.hpp):
// the source cuda::emit writes, tiles.cuh included, compiled by the host C++
// compiler into a shared object and launched over the grid with a block's
// threads as fibers. What the interpreter (cuda::emulate) cannot see — the
// CUDA half of the tile vocabulary: fragment layouts, vector loads and
// stores, index arithmetic, barriers placed by the emitter — is checked here
// on every commit, against the interpreter — with AddressSanitizer where the
// process has it loaded (ctest preloads it: tests/CMakeLists.txt).
#pragma once

#include <cstdint>

#include "lina/cuda/emulate.hpp"

namespace test::simt {

// Compile p's kernel for the host (once per source: cached on disk in the
// build tree, and loaded once per process) and run it over `blocks` blocks.
// Throws std::runtime_error with the compiler's log, or with what the run
// found (a warp divided at a warp-wide instruction, an ldmatrix outside the
// shared memory…).
void run(lina::cuda::program const& p, lina::cuda::forward_args const& args, std::int64_t blocks);

// While one lives, every emulated kernel (cuda::emulate and all that calls
// it) runs through run() instead of the interpreter.
class scope {
 public:
  scope() : previous_(lina::cuda::set_kernel_runner(&run)) {}
  ~scope() { lina::cuda::set_kernel_runner(previous_); }
  scope(scope const&) = delete;
  scope& operator=(scope const&) = delete;

 private:
  lina::cuda::kernel_runner previous_;
};

}  // namespace test::simt
