// The kernels tests/test_cuda_embed.cpp's binary embeds (lina_cuda_embed_kernels):
// its generator (kernels.cpp) and its tests read the same list.
#pragma once

#include <lina/cuda.hpp>
#include <lina/lina.hpp>
#include <vector>

namespace embed_test {
using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
// Causal linear attention (forward, split, backward, chained, decoding step)
// and softmax attention (quadratic: forward and its backward's launches).
inline constexpr auto causal_plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
inline constexpr auto softmax_plan = compile(normalize(causal(exp(Q * transpose(K) * 0.25))) * V);
inline cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};
inline constexpr std::size_t d = 16, m = 8;

// What the binary embeds: softmax's kernels and the causal plan's forward (a
// compile with a launch's optimisation is about a second: CI time). The test
// of kernels_of takes both plans' whole lists.
inline std::vector<cuda::program> kernels() {
  std::vector<cuda::program> all = cuda::kernels_of(softmax_plan, {}, D = d, M = m);
  all.push_back(cuda::program_of(causal_plan, bf16, D = d, M = m));
  return all;
}
}  // namespace embed_test
