// Shared by the gradient tests: the attention expressions they differentiate
// and the finite-difference check (central differences in double).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <lina/check.hpp>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#include "support.hpp"

namespace gradient_test {

using namespace lina;
using test::softplus;

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
using N_t = std::remove_cvref_t<decltype(N)>;

template <class M_>
constexpr auto causal_attn = normalize(causal(phi<M_>(Q) * transpose(phi<M_>(K)))) * V;
template <class M_>
constexpr auto full_attn = normalize(phi<M_>(Q) * transpose(phi<M_>(K))) * V;
template <class M_>
constexpr auto causal_plain = causal(phi<M_>(Q) * transpose(phi<M_>(K))) * V;
template <class M_>
constexpr auto full_plain = phi<M_>(Q) * transpose(phi<M_>(K)) * V;

// Every order's gradients (as written, automatic, quadratic, linear where it
// exists) against central differences in double: lina::check, the check users
// run on their own variants (lina/check.hpp). n = 1 .. 7 reaches both sides of
// the automatic plan's small thresholds.
template <class E>
void check_fd(E const& expr, std::uint64_t seed) {
  auto r = check::gradients(expr, {.max_extent = 7, .seed = seed});
  INFO(r);
  CHECK(r.ok());
}

constexpr auto F = dim<"F">;
constexpr auto W = input<"W">(D, F);

}  // namespace gradient_test
