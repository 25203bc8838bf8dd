// Built against the installed package with lina_cuda_embed_kernels: the
// kernel its generator listed is linked in, found without NVRTC.
#include <fmt/core.h>

#include <lina/cuda/emit.hpp>
#include <lina/cuda/nvrtc.hpp>

#include "plan.hpp"

int main() {
  lina::cuda::program const p = consumer::kernel();
  lina::cuda::compiled_kernel const k = lina::cuda::compile_cached_in("", lina::cuda::emit(p), p.kernel_name, "sm_90");
  fmt::print("consumer_cuda: {} embedded kernel(s); {} for sm_90: {}\n", lina::cuda::embedded_kernel_count(), p.kernel_name,
             k.embedded ? "embedded" : "NOT embedded");
  return k.embedded && lina::cuda::cache_statistics().compiled == 0 ? 0 : 1;
}
