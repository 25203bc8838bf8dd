// A three-layer stack trained as a user writes it, with and without a tape
// (and one layer's block of a chained step through a tape):
// its backward's schedule has ~320 occurrences of nodes, past the 256 terms
// of a fold expression Clang nests by default (ctest clang.stacked_training,
// parsed and instantiated: it once stopped with "exceeded expression nesting
// limit of 256").
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

int main() {
  using namespace lina;
  constexpr auto N = dim<"N">;
  constexpr auto D = dim<"D">;
  constexpr auto Q = input<"Q">(N, D);
  constexpr auto K = input<"K">(N, D);
  constexpr auto V = input<"V">(N, D);
  constexpr auto K2 = input<"K2">(N, D);
  constexpr auto V2 = input<"V2">(N, D);
  constexpr auto K3 = input<"K3">(N, D);
  constexpr auto V3 = input<"V3">(N, D);
  constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto layer2 = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
  constexpr auto layer3 = normalize(causal(phi<elu_plus_one>(layer2) * transpose(phi<elu_plus_one>(K3)))) * V3;
  constexpr auto plan = compile<order::linear>(layer3);
  auto x = tensor<float>::random({1, 2, 64, 8}, 1);
  cpu::tape<float> tp;
  auto out = cpu::evaluate(plan, tp, Q = x, K = x, V = x, K2 = x, V2 = x, K3 = x, V3 = x);
  auto g = cpu::gradient(plan, tp, out, Q = x, K = x, V = x, K2 = x, V2 = x, K3 = x, V3 = x);
  auto h = cpu::gradient(plan, out, Q = x, K = x, V = x, K2 = x, V2 = x, K3 = x, V3 = x);
  // A block of a chained training step through its tape (cpu/tape.hpp's chained forms).
  constexpr auto one = compile<order::linear>(layer1);
  cpu::state<float> st, none;
  cpu::tape<float> block;
  auto y = cpu::evaluate(one, st, block, Q = x, K = x, V = x);
  auto [gb, d0] = cpu::gradient(one, block, y, none, none, Q = x, K = x, V = x);
  return g[Q].size() == h[Q].size() && gb[Q].size() == x.size() && d0.scans() == 1 ? 0 : 1;
}
