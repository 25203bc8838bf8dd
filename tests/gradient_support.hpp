// Shared by the gradient tests: the attention expressions they differentiate
// and the finite-difference checks (central differences in double).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
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

// L = sum(dout ⊙ out), out evaluated as written.
template <class E>
double loss(E const& e, tensor<double> const& q, tensor<double> const& k, tensor<double> const& v,
            tensor<double> const& dout) {
  auto out = cpu::evaluate(e, Q = q, K = k, V = v);
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out.data()[i] * dout.data()[i];
  return s;
}

// Central differences of L for every element of every input, compared with
// the gradients of each plan. The error of a central difference is
// h^2 |L'''| / 6 (about 1e-12 here) plus the rounding of L over 2h
// (|L| eps / h, about 1e-9), so 1e-6 (1 + |g|) is comfortably above both and
// far below any wrong term.
template <class E, class... Plans>
void check_fd(E const& expr, std::uint64_t seed, Plans const&... plans) {
  test::rng r{seed};
  for (int trial = 0; trial < 3; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 7), d = r.in(1, 4), m;
    do m = r.in(1, 4);
    while (m == d);
    auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
    auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
    double step = 1e-6;
    auto central = [&](tensor<double>& x) {
      tensor<double> fd(x.shape());
      for (std::size_t i = 0; i < x.size(); ++i) {
        double keep = x.data()[i];
        x.data()[i] = keep + step;
        double up = loss(expr, q, k, v, dout);
        x.data()[i] = keep - step;
        double down = loss(expr, q, k, v, dout);
        x.data()[i] = keep;
        fd.data()[i] = (up - down) / (2 * step);
      }
      return fd;
    };
    auto fq = central(q), fk = central(k), fv = central(v);
    std::size_t order = 0;
    auto compare = [&](tensor<double> const& fd, tensor<double> const& g, char const* name) {
      for (std::size_t i = 0; i < fd.size(); ++i) {
        CAPTURE(name); CAPTURE(order); CAPTURE(i); CAPTURE(n); CAPTURE(d); CAPTURE(m);
        CHECK(std::abs(fd.data()[i] - g.data()[i]) <= 1e-6 * (1 + std::abs(fd.data()[i])));
      }
    };
    auto one = [&](auto const& plan) {
      auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
      compare(fq, g[Q], "Q");
      compare(fk, g[K], "K");
      compare(fv, g[V], "V");
      ++order;
    };
    (one(plans), ...);
  }
}

// The expression differentiated as written (order 0; the same adjoint rules
// as its quadratic plan, minus the normalize rewrite) and its linear plan (1),
// or its quadratic plan where no linear one exists (exp).
template <class E>
void check_fd_orders(E const& expr, std::uint64_t seed) {
  if constexpr (!contains_op<decltype(compile(expr)), op::exp>())
    check_fd(expr, seed, expr, compile<order::linear>(expr));
  else
    check_fd(expr, seed, expr, compile<order::quadratic>(expr));
}
// Every order, and the automatic plan (its backward selects between the
// quadratic and linear ones; n = 1 .. 7 reaches both sides of small thresholds).
template <class E>
void check_fd_every_order(E const& expr, std::uint64_t seed) {
  check_fd(expr, seed, expr, compile<order::quadratic>(expr), compile<order::linear>(expr), compile(expr));
}


constexpr auto F = dim<"F">;
constexpr auto W = input<"W">(D, F);

// L = sum(dout ⊙ out) with a projection W bound too.
template <class E>
double loss_w(E const& e, tensor<double> const& q, tensor<double> const& k, tensor<double> const& v,
              tensor<double> const& w, tensor<double> const& dout) {
  auto out = cpu::evaluate(e, Q = q, K = k, V = v, W = w);
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out.data()[i] * dout.data()[i];
  return s;
}

// Central differences for Q, K, V and W of a parametric map's attention
// (same error budget as check_fd).
template <class E>
void check_fd_parametric(E const& expr, std::uint64_t seed) {
  test::rng r{seed};
  for (int trial = 0; trial < 2; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 6), d = r.in(1, 4), m = r.in(1, 3), f = r.in(2, 6);
    auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
    auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
    auto w = tensor<double>::random({b, h, d, f}, r.next());  // one projection per (b, h): ∂W per (b, h) too
    for (auto const& g : {cpu::gradient(compile<order::linear>(expr), dout, Q = q, K = k, V = v, W = w),
                          cpu::gradient(expr, dout, Q = q, K = k, V = v, W = w)}) {  // linear, as written
      auto check = [&](tensor<double>& x, tensor<double> const& gx, char const* name) {
        for (std::size_t i = 0; i < x.size(); ++i) {
          double keep = x.data()[i];
          x.data()[i] = keep + 1e-6;
          double up = loss_w(expr, q, k, v, w, dout);
          x.data()[i] = keep - 1e-6;
          double down = loss_w(expr, q, k, v, w, dout);
          x.data()[i] = keep;
          double fd = (up - down) / 2e-6;
          CAPTURE(name); CAPTURE(i);
          CHECK(std::abs(fd - gx.data()[i]) <= 1e-6 * (1 + std::abs(fd)));
        }
      };
      check(q, g[Q], "Q");
      check(k, g[K], "K");
      check(v, g[V], "V");
      check(w, g[W], "W");
    }
  }
}

}  // namespace gradient_test
