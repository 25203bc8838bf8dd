// Derived gradients against central finite differences in double: softmax,
// scaled and repeated inputs, and the polynomial and random-feature maps
// (with the gradient of their projection W).
#include <doctest/doctest.h>

#include <cmath>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <string>

#include "support.hpp"

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
using N_t = std::remove_cvref_t<decltype(N)>;

struct softplus {  // a user-defined map
  static constexpr std::string_view name = "softplus";
  template <class T> static T value(T x) { return std::log1p(std::exp(x)); }
  template <class T> static T derivative(T x) { return 1 / (1 + std::exp(-x)); }
};

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

}  // namespace

TEST_CASE("gradients equal central differences: softmax, scaled, normalize as written") {
  check_fd_orders(normalize(exp(Q * transpose(K) * 0.5)) * V, 10);
  check_fd_orders(normalize(causal(exp(Q * transpose(K) / 3.0))) * V, 11);
  check_fd_orders(0.25 * causal(phi<elu_plus_one>(Q) * transpose(2.0 * phi<elu_plus_one>(K))) * V, 12);
  // Q and K twice each: contributions to one input add up.
  check_fd_orders(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * (K * (transpose(K) * V)), 13);
}

namespace {
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
}  // namespace

TEST_CASE("gradients equal central differences: poly2, favor, random Fourier features") {
  check_fd_orders(causal_plain<poly2>, 20);
  check_fd_orders(full_attn<poly2>, 21);  // normalised: (q·k)² >= 0
  check_fd_parametric(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 22);
  check_fd_parametric(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * V, 23);
  check_fd_parametric(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V, 24);
}
