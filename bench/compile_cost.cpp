// What a user's translation unit pays to compile lina: scripts/compile-cost.sh
// compiles this file once per setting below and prints the seconds
// (docs/dsl.md, "What it costs to compile"). Not a program to time: the
// benchmark tests only check that it compiles (at its defaults: everything).
//   STAGE  0: the headers and the expression; 1: + compile(e);
//          2: + cpu::evaluate; 3: + cpu::gradient
//   LINEAR 1: compile<order::linear>(e) (one order) instead of the automatic
//          order (with a dynamic N, both orders' code and a comparison)
//   PLANS  2, 3: one or two more plans evaluated (causal poly2, non-causal elu+1)
//   DOUBLE 1: all of it at fp64 as well as fp32
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#ifndef STAGE
#define STAGE 3
#endif
#ifndef LINEAR
#define LINEAR 0
#endif
#ifndef PLANS
#define PLANS 3
#endif
#ifndef DOUBLE
#define DOUBLE 1
#endif

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
constexpr auto e2 = causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V;
constexpr auto e3 = normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V;

template <class E>
constexpr auto compiled(E const& x) {
  if constexpr (LINEAR)
    return compile<order::linear>(x);
  else
    return compile(x);
}

template <class T>
double run() {
  auto q = tensor<T>::random({1, 2, 16, 8}, 1), k = tensor<T>::random({1, 2, 16, 8}, 2);
  auto v = tensor<T>::random({1, 2, 16, 8}, 3);
  double sum = 0;
  [[maybe_unused]] auto add = [&](auto const& t) {
    for (std::size_t i = 0; i < t.size(); ++i) sum += static_cast<double>(t.data()[i]);
  };
#if STAGE >= 1
  [[maybe_unused]] auto const plan = compiled(e);
#endif
#if STAGE >= 2
  auto const out = cpu::evaluate(plan, Q = q, K = k, V = v);
  add(out);
#endif
#if STAGE >= 3
  auto const g = cpu::gradient(plan, out, Q = q, K = k, V = v);
  add(g[Q]);
#endif
#if STAGE >= 2 && PLANS >= 2
  add(cpu::evaluate(compiled(e2), Q = q, K = k, V = v));
#endif
#if STAGE >= 2 && PLANS >= 3
  add(cpu::evaluate(compiled(e3), Q = q, K = k, V = v));
#endif
  return sum;
}

int main() {
  double s = run<float>();
#if DOUBLE
  s += run<double>();
#endif
  return s == s ? 0 : 1;  // (NaN: something is wrong)
}
