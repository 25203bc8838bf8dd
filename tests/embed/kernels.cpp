// The generator of lina_cuda_embed_tests' embedded kernels (tests/CMakeLists.txt,
// lina_cuda_embed_kernels): what a user's generator looks like, plus the tests'
// NVRTC cache (the suite compiles the same kernels: one compile for both).
#include <cstdlib>
#include <lina/cuda/embed.hpp>

#include "plans.hpp"

int main(int argc, char** argv) {
  setenv("LINA_CUDA_CACHE", LINA_TEST_NVRTC_CACHE, 0);
  return lina::cuda::embed_main(argc, argv, embed_test::kernels());
}
