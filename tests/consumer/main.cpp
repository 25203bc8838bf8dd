// Built against the installed package: compile, evaluate, check both orders agree.
#include <fmt/core.h>

#include <lina/cpu.hpp>
#include <lina/lina.hpp>

int main() {
  using namespace lina;
  constexpr auto N = dim<"N">;
  constexpr auto D = dim<"D", 8>;
  constexpr auto Q = input<"Q">(N, D);
  constexpr auto K = input<"K">(N, D);
  constexpr auto V = input<"V">(N, D);
  constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  auto q = tensor<double>::random({1, 2, 50, 8}, 1);
  auto a = cpu::evaluate(compile<order::linear>(attn), Q = q, K = q, V = q);
  auto b = cpu::evaluate(compile<order::quadratic>(attn), Q = q, K = q, V = q);
  double d = max_abs_diff(a, b);
  fmt::print("consumer: {} -> max |linear - quadratic| = {}\n", compile(attn), d);
  return d < 1e-12 ? 0 : 1;
}
