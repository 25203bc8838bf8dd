// The CUDA backend without a GPU: the README's attention, lowered to a tile
// program, printed as the CUDA kernel it generates, compiled by NVRTC, and run
// through the host emulation in bf16 next to the CPU backend.
//
//   cuda_quickstart            the listing, the source, NVRTC and the comparison
//   cuda_quickstart --source   the generated CUDA source alone
#include <lina/cpu.hpp>
#include <lina/cuda.hpp>
#include <lina/cuda/nvrtc.hpp>
#include <lina/lina.hpp>

#include <fmt/core.h>

#include <cmath>
#include <string_view>

int main(int argc, char** argv) {
  using namespace lina;
  constexpr auto N = dim<"N">;
  constexpr auto D = dim<"D", 32>;
  constexpr auto M = dim<"M", 16>;
  constexpr auto Q = input<"Q">(N, D);
  constexpr auto K = input<"K">(N, D);
  constexpr auto V = input<"V">(N, M);
  constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto plan = compile<order::linear>(attn);
  cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};

  if (argc > 1 && std::string_view(argv[1]) == "--source") {
    fmt::print("{}", cuda::source(plan, bf16));
    return 0;
  }
  cuda::program const p = cuda::program_of(plan, bf16);
  fmt::print("{}\n{}\n", cuda::listing(p), cuda::emit(p));
  for (char const* arch : {"sm_80", "sm_90"}) {
    auto k = cuda::compile(cuda::emit(p), p.kernel_name, arch);
    fmt::print("NVRTC {} for {}: {} bytes of cubin, log: {}\n", cuda::nvrtc_version(), arch, k.image.size(),
               k.log.empty() ? "empty" : k.log);
  }

  auto q = tensor<float>::random({2, 3, 100, 32}, 1);  // [B,H,N,D]
  auto k = tensor<float>::random({2, 3, 100, 32}, 2);
  auto v = tensor<float>::random({2, 3, 100, 16}, 3);
  tensor<float> gpu = cuda::emulate(plan, bf16, Q = q, K = k, V = v);  // as the kernel computes it, on the CPU
  tensor<float> cpu = cpu::evaluate(plan, Q = q, K = k, V = v);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    num += (gpu.data()[i] - cpu.data()[i]) * (gpu.data()[i] - cpu.data()[i]);
    den += cpu.data()[i] * cpu.data()[i];
  }
  fmt::print("bf16 kernel (emulated) vs fp32 CPU backend: relative RMS error {:.2e}\n", std::sqrt(num / den));
}
