// Compare the two orderings of attention with the elu+1 feature map, causal
// and not: (φQ·φKᵀ)·V makes N x N similarities (quadratic: the CPU makes
// them a block of query rows at a time), while φQ·(φKᵀ·V) or its causal
// prefix scan keeps a D x (M+1) state (linear).
//
// Prints the expressions and the plans compile() derives, times both orders
// for N = 256 ... 16384, and locates the measured crossover next to the one
// the cost model predicts (the threshold of the plan's run-time select).
//
//   orderings [--max-n 16384] [--heads 4] [--quadratic-max-n 4096]
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 64>;
constexpr auto M = dim<"M", 64>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto similarity = phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K));
constexpr auto causal_attn = normalize(causal(similarity)) * V;
constexpr auto full_attn = normalize(similarity) * V;

struct options {
  std::size_t max_n = 16384, heads = 4, quadratic_max_n = 4096;
};

// Best time of repeated runs (at least 3, and at least ~0.2 s in total), in ms.
template <class F>
double time_ms(F&& f) {
  using clock = std::chrono::steady_clock;
  double best = 1e300, total = 0;
  for (int rep = 0; rep < 3 || (total < 200 && rep < 1000); ++rep) {
    auto t0 = clock::now();
    f();
    double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    best = std::min(best, ms);
    total += ms;
  }
  return best;
}

template <class Plan>
double run_ms(Plan const& plan, std::size_t heads, std::size_t n) {
  auto q = tensor<float>::random({1, heads, n, 64}, 1);
  auto k = tensor<float>::random({1, heads, n, 64}, 2);
  auto v = tensor<float>::random({1, heads, n, 64}, 3);
  return time_ms([&] {
    auto out = cpu::evaluate(plan, Q = q, K = k, V = v);
    if (out.size() && out.data()[0] != out.data()[0]) std::abort();  // keep the result alive
  });
}

template <class Expr>
void compare(char const* title, Expr const& expr, options const& opt) {
  auto automatic = compile(expr);
  auto quadratic = compile<order::quadratic>(expr);
  auto linear = compile<order::linear>(expr);
  auto [thresholds, count] = select_thresholds<decltype(automatic)>();
  std::size_t predicted = count ? thresholds[0] : 0;
  // the CPU backend's calibrated model (docs/benchmarks.md), next to the core's counting one
  auto [cpu_thresholds, cpu_count] = select_thresholds<decltype(compile<order::automatic, cpu::cost_model>(expr))>();
  std::size_t cpu_predicted = cpu_count ? cpu_thresholds[0] : 0;

  fmt::print("\n== {} ==\n", title);
  fmt::print("expression      {}\n", expr);
  fmt::print("compile()       {}\n", automatic);
  fmt::print("quadratic order {}\n", quadratic);
  fmt::print("linear order    {}\n\n", linear);
  fmt::print("B·H = 1·{}, D = M = 64, float; GFLOP/s from each plan's own flop estimate (lina::estimate)\n",
             opt.heads);
  fmt::print("{:>7} {:>13} {:>9} {:>12} {:>9} {:>9}\n", "N", "quadratic ms", "GFLOP/s", "linear ms", "GFLOP/s",
             "lin/quad");
  double h = static_cast<double>(opt.heads);
  for (std::size_t n = 256; n <= opt.max_n; n *= 2) {
    double lin = run_ms(linear, opt.heads, n);
    double lin_gf = h * estimate(linear, N = n).flops / lin / 1e6;
    if (n <= opt.quadratic_max_n) {
      double quad = run_ms(quadratic, opt.heads, n);
      double quad_gf = h * estimate(quadratic, N = n).flops / quad / 1e6;
      fmt::print("{:>7} {:>13.3f} {:>9.1f} {:>12.3f} {:>9.1f} {:>8.1f}x\n", n, quad, quad_gf, lin, lin_gf, quad / lin);
    } else {
      fmt::print("{:>7} {:>13} {:>9} {:>12.3f} {:>9.1f}   (quadratic skipped past --quadratic-max-n {})\n", n, "-",
                 "-", lin, lin_gf, opt.quadratic_max_n);
    }
  }

  // The crossover: the first length from which the linear order is faster.
  std::vector<std::size_t> grid;
  for (std::size_t n = 4; n <= 512; n = n < 32 ? n + 4 : n + n / 4) grid.push_back(n);
  std::size_t measured = 0;
  for (std::size_t n : grid) {
    bool linear_wins = run_ms(linear, opt.heads, n) < run_ms(quadratic, opt.heads, n);
    if (linear_wins && measured == 0) measured = n;
    if (!linear_wins) measured = 0;
  }
  if (measured)
    fmt::print("crossover: measured N = {} (linear faster from there on, grid {}..{}); predicted N = {} by the "
               "counting model (compile()), N = {} by cpu::cost_model\n",
               measured, grid.front(), grid.back(), predicted, cpu_predicted);
  else
    fmt::print("crossover: not found on the grid {}..{}; predicted N = {} by the counting model, N = {} by "
               "cpu::cost_model\n", grid.front(), grid.back(), predicted, cpu_predicted);
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--max-n")) opt.max_n = v;
    else if (!std::strcmp(argv[i], "--heads")) opt.heads = v;
    else if (!std::strcmp(argv[i], "--quadratic-max-n")) opt.quadratic_max_n = v;
    else {
      fmt::print(stderr, "usage: orderings [--max-n N] [--heads H] [--quadratic-max-n N]\n");
      return 2;
    }
  }
#ifdef _OPENMP
  fmt::print("threads: {}\n", omp_get_max_threads());
#endif
  compare("causal: normalize(causal(φ(Q)·φ(K)ᵀ))·V", causal_attn, opt);
  compare("non-causal: normalize(φ(Q)·φ(K)ᵀ)·V", full_attn, opt);
}
