// Kernels compiled ahead of time: the generator side of lina_cuda_embed_kernels
// (CMake, docs/cuda.md). A small program of the user's lists the kernels its
// application launches (cuda::kernels_of); at build time it compiles them with
// NVRTC and writes a C++ source that holds their images and registers them
// (lina/cuda/nvrtc.hpp, embedded_kernel), which the CMake function adds to the
// application: its launches then find their kernels without compiling.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "lina/cuda/program.hpp"

namespace lina::cuda {

// Compile each program's source for each architecture ("sm_90", …; through
// compile_cached, so a rebuild reuses the on-disk cache) and write them, with
// their sources, as a C++ source file at `path` (replaced only when its text
// changes, so that the application is not rebuilt for nothing). Programs with
// the same source are written once. Throws nvrtc_error when a compile fails,
// std::runtime_error when the file cannot be written. Returns the number of
// images written (distinct sources × architectures).
std::size_t write_embedded_kernels(std::string const& path, std::vector<program> const& programs,
                                   std::vector<std::string> const& archs);

// The generator's main: `<generator> --out FILE --arch sm_XY [--arch …]`.
// Prints what it wrote; returns 0, or prints the error and returns 1.
int embed_main(int argc, char** argv, std::vector<program> const& programs);

}  // namespace lina::cuda
