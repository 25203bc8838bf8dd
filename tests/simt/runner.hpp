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
// shared memory…). In a prepare run, only records the kernel.
void run(lina::cuda::program const& p, lina::cuda::forward_args const& args, std::int64_t blocks);

// A prepare run (the environment has LINA_SIMT_PREPARE; ctest runs one before
// the simt tests, tests/CMakeLists.txt) runs the tests to learn which kernels
// they launch — their interpreted halves as usual, the launches as written
// doing nothing — then compiles those not yet cached as one unit: a tenth of
// the time of compiling them one by one as each test first launches them
// (runner.cpp, build). What it checks is that compile; the tests' own checks
// mean something in the tests' own runs.
bool preparing();
// Whether a prepare run of this test binary, with this prelude, finished
// (then every kernel its tests launch is in the cache).
bool prepared();
// Compile what the prepare run recorded; the process's exit status.
int compile_recorded();

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
