// What the CPU backend allocates: a linear plan never allocates anything
// N x N, and its temporaries grow linearly in N (Eigen-style no-temporary
// tests, counting the backend's buffers).
#include <doctest/doctest.h>

#include <lina/cpu.hpp>
#include <lina/lina.hpp>

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 16>;
constexpr auto M = dim<"M", 8>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

template <class Plan>
std::size_t largest_allocation(Plan const& plan, std::size_t n) {
  auto q = tensor<float>::random({1, 2, n, 16}, 1), k = tensor<float>::random({1, 2, n, 16}, 2);
  auto v = tensor<float>::random({1, 2, n, 8}, 3);
  cpu::memory().reset();
  auto out = cpu::evaluate(plan, Q = q, K = k, V = v);
  return cpu::memory().largest;
}
}  // namespace

TEST_CASE("a linear plan allocates no N x N and nothing beyond N x max(C, M+1)") {
  for (std::size_t n : {1000u, 4000u}) {
    std::size_t lin = largest_allocation(compile<order::linear>(attn), n);
    std::size_t automatic = largest_allocation(compile(attn), n);
    CHECK(lin <= n * 16 * sizeof(float));
    CHECK(automatic == lin);  // past the threshold the automatic plan is the linear one
    CHECK(cpu::memory().live == 0);  // every temporary was released
  }
}

TEST_CASE("the counters see the quadratic plan's N x N similarity") {
  std::size_t n = 1000;
  CHECK(largest_allocation(compile<order::quadratic>(attn), n) == n * n * sizeof(float));
}
