#include <lina/lina.hpp>
#include <lina/cpu.hpp>
#include <fmt/core.h>

int main() {
  using namespace lina;
  constexpr auto N = dim<"N">;       // known at run time
  constexpr auto D = dim<"D", 32>;   // known at compile time
  constexpr auto M = dim<"M", 16>;
  constexpr auto Q = input<"Q">(N, D);
  constexpr auto K = input<"K">(N, D);
  constexpr auto V = input<"V">(N, M);
  constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto fast = compile(attn);
  constexpr auto slow = compile<order::quadratic>(attn);
  fmt::print("{}\n{}\n", attn, fast);
  auto q = tensor<float>::random({2, 3, 100, 32}, /*seed=*/1);  // [B,H,N,D]
  auto k = tensor<float>::random({2, 3, 100, 32}, 2);
  auto v = tensor<float>::random({2, 3, 100, 16}, 3);
  tensor<float> a = cpu::evaluate(fast, Q = q, K = k, V = v);  // [B,H,N,M]
  tensor<float> b = cpu::evaluate(slow, Q = q, K = k, V = v);
  fmt::print("max |a-b| = {}\n", max_abs_diff(a, b));
}
