// Derived gradients: finite differences in double for every input, map and
// mask; linear = quadratic gradients; a two-token case in closed form; the
// printed causal backward; constant extra memory.
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

// The expression differentiated as written (order 0), its quadratic plan (1),
// its linear plan (2, where there is one) and its automatic plan (last).
template <class E>
void check_fd_all_orders(E const& expr, std::uint64_t seed) {
  if constexpr (!contains_op<decltype(compile(expr)), op::exp>())
    check_fd(expr, seed, expr, compile<order::quadratic>(expr), compile<order::linear>(expr), compile(expr));
  else
    check_fd(expr, seed, expr, compile<order::quadratic>(expr), compile(expr));
}

}  // namespace

TEST_CASE("gradients equal central differences: normalised, positive maps") {
  check_fd_all_orders(causal_attn<elu_plus_one>, 1);
  check_fd_all_orders(full_attn<elu_plus_one>, 2);
  check_fd_all_orders(causal_attn<softplus>, 3);
  check_fd_all_orders(full_attn<softplus>, 4);
}

TEST_CASE("gradients equal central differences: unnormalised, any map") {
  check_fd_all_orders(causal_plain<relu>, 5);
  check_fd_all_orders(full_plain<relu>, 6);
  check_fd_all_orders(causal_plain<identity>, 7);
  check_fd_all_orders(full_plain<identity>, 8);
  check_fd_all_orders(causal_plain<elu_plus_one>, 9);
}

TEST_CASE("gradients equal central differences: softmax, scaled, normalize as written") {
  check_fd_all_orders(normalize(exp(Q * transpose(K) * 0.5)) * V, 10);
  check_fd_all_orders(normalize(causal(exp(Q * transpose(K) / 3.0))) * V, 11);
  check_fd_all_orders(0.25 * causal(phi<elu_plus_one>(Q) * transpose(2.0 * phi<elu_plus_one>(K))) * V, 12);
  // Q and K twice each: contributions to one input add up.
  check_fd_all_orders(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * (K * (transpose(K) * V)), 13);
}

TEST_CASE_TEMPLATE("linear and quadratic gradients agree", T, float, double) {
  test::rng r{14};
  constexpr auto e = causal_attn<elu_plus_one>;
  for (int trial = 0; trial < 8; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = test::length(r) / 3 + 1, d = r.in(1, 20), m;
    do m = r.in(1, 20);
    while (m == d);
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next()), dout = tensor<T>::random({b, h, n, m}, r.next());
    auto gl = cpu::gradient(compile<order::linear>(e), dout, Q = q, K = k, V = v);
    auto gq = cpu::gradient(compile<order::quadratic>(e), dout, Q = q, K = k, V = v);
    // Each gradient entry sums n rows of d (m+1)-term products of O(1) size.
    double bound = test::rounding_bound<T>(double(n * d * (m + 1)), 1.0);
    CAPTURE(n); CAPTURE(d); CAPTURE(m);
    CHECK(max_abs_diff(gl[Q], gq[Q]) <= bound * (1 + test::max_abs(gq[Q])));
    CHECK(max_abs_diff(gl[K], gq[K]) <= bound * (1 + test::max_abs(gq[K])));
    CHECK(max_abs_diff(gl[V], gq[V]) <= bound * (1 + test::max_abs(gq[V])));
  }
}

TEST_CASE("two tokens: the gradients in closed form") {
  // D = 2, M = 1, elu+1 on positive inputs (so φ(x) = x + 1), eps = 0:
  // out_0 = v_0;  out_1 = (s_0 v_0 + s_1 v_1) / (s_0 + s_1), s_j = a_1 · b_j,
  // a_i = φ(q_i), b_j = φ(k_j); L = g_0 out_0 + g_1 out_1.
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))), 0.0) * V;
  tensor<double> q({1, 1, 2, 2}), k({1, 1, 2, 2}), v({1, 1, 2, 1}), g({1, 1, 2, 1});
  double qv[] = {0.3, 0.7, 0.2, 0.5}, kv[] = {0.4, 0.1, 0.9, 0.6}, vv[] = {0.8, -0.5}, gv[] = {1.5, -0.7};
  std::copy(qv, qv + 4, q.data()); std::copy(kv, kv + 4, k.data());
  std::copy(vv, vv + 2, v.data()); std::copy(gv, gv + 2, g.data());
  double a1[] = {qv[2] + 1, qv[3] + 1}, b0[] = {kv[0] + 1, kv[1] + 1}, b1[] = {kv[2] + 1, kv[3] + 1};
  double s0 = a1[0] * b0[0] + a1[1] * b0[1], s1 = a1[0] * b1[0] + a1[1] * b1[1], z = s0 + s1;
  double out1 = (s0 * vv[0] + s1 * vv[1]) / z;
  for (auto const& grads : {cpu::gradient(compile<order::linear>(e), g, Q = q, K = k, V = v),
                            cpu::gradient(compile<order::quadratic>(e), g, Q = q, K = k, V = v)}) {
    // ∂L/∂v_0 = g_0 + g_1 s_0 / z,  ∂L/∂v_1 = g_1 s_1 / z
    CHECK(grads[V](0, 0, 0, 0) == doctest::Approx(gv[0] + gv[1] * s0 / z).epsilon(1e-12));
    CHECK(grads[V](0, 0, 1, 0) == doctest::Approx(gv[1] * s1 / z).epsilon(1e-12));
    // ∂L/∂q_0 = 0 (out_0 = v_0);  ∂L/∂a_1 = g_1 (b_0 (v_0 - out_1) + b_1 (v_1 - out_1)) / z
    for (int c = 0; c < 2; ++c) {
      CHECK(grads[Q](0, 0, 0, c) == doctest::Approx(0.0).epsilon(1e-12));
      double da1 = gv[1] * (b0[c] * (vv[0] - out1) + b1[c] * (vv[1] - out1)) / z;
      CHECK(grads[Q](0, 0, 1, c) == doctest::Approx(da1).epsilon(1e-12));
      // ∂L/∂b_j = g_1 a_1 (v_j - out_1) / z
      CHECK(grads[K](0, 0, 0, c) == doctest::Approx(gv[1] * a1[c] * (vv[0] - out1) / z).epsilon(1e-12));
      CHECK(grads[K](0, 0, 1, c) == doctest::Approx(gv[1] * a1[c] * (vv[1] - out1) / z).epsilon(1e-12));
    }
  }
}

TEST_CASE("the causal backward prints as prefix and suffix scans") {
  constexpr auto plan = compile<order::linear>(causal_attn<elu_plus_one>);
  CHECK(to_string(gradient(plan)) ==
        "∂Q = φ′(Q)⊙contract(t1, prefix([V|1]⊗φ(K)))\n"
        "∂K = φ′(K)⊙contract([V|1], suffix(t1⊗φ(Q)))\n"
        "∂V = dropcol(contract(φ(K), suffix(φ(Q)⊗t1)))\n"
        "t1 = rowdiv′(contract(φ(Q), prefix(φ(K)⊗[V|1])), dout)\n");
  CHECK(to_string(gradient(compile<order::quadratic>(causal_attn<elu_plus_one>))) ==
        "∂Q = φ′(Q)⊙(t1·φ(K))\n"
        "∂K = φ′(K)⊙(t1ᵀ·φ(Q))\n"
        "∂V = dropcol(causal(φ(Q)·φ(K)ᵀ)ᵀ·t2)\n"
        "t1 = causal(t2·[V|1]ᵀ)\n"
        "t2 = rowdiv′(causal(φ(Q)·φ(K)ᵀ)·[V|1], dout)\n");
}

// The derived backward of a linear plan: no N x N node, and per-row matrices
// only inside fused scans (no per-step state cache).
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(causal_attn<elu_plus_one>))), N_t>());
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(full_attn<relu>))), N_t>());
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(causal_plain<identity>))), N_t>());
static_assert(!backward_is_constant_state<decltype(gradient(compile<order::quadratic>(causal_attn<elu_plus_one>))), N_t>());

TEST_CASE("dout must have the output's shape") {
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 2);
  auto bad_rows = tensor<float>::random({1, 2, 9, 3}, 3), bad_cols = tensor<float>::random({1, 2, 10, 4}, 4);
  auto plan = compile(causal_attn<elu_plus_one>);
  try {
    cpu::gradient(plan, bad_rows, Q = q, K = q, V = v);
    FAIL("no shape_error");
  } catch (shape_error const& e) {
    CHECK(e.symbol() == "dout");
    CHECK(e.dimension() == "N");
    CHECK(e.extent() == 9);
    CHECK(e.expected_extent() == 10);
  }
  try {
    cpu::gradient(plan, bad_cols, Q = q, K = q, V = v);
    FAIL("no shape_error");
  } catch (shape_error const& e) {
    CHECK(e.symbol() == "dout");
    CHECK(e.dimension() == "M");
  }
}

TEST_CASE("gradients come back in the layout of their inputs") {
  std::size_t b = 2, h = 3, n = 11, d = 4, m = 5;
  auto q = tensor<double>::random({b, h, n, d}, 1), k = tensor<double>::random({b, h, n, d}, 2);
  auto v = tensor<double>::random({b, h, n, m}, 3), dout = tensor<double>::random({b, h, n, m}, 4);
  auto bnhd = [&](tensor<double> const& t) {  // the same numbers, stored [B,N,H,*]
    auto s = t.shape();
    auto r = tensor<double>::like(tensor_view<double const>(nullptr, s, {std::ptrdiff_t(s[2] * s[1] * s[3]),
                                                                          std::ptrdiff_t(s[3]),
                                                                          std::ptrdiff_t(s[1] * s[3]), 1}));
    for (std::size_t i = 0; i < s[0]; ++i)
      for (std::size_t j = 0; j < s[1]; ++j)
        for (std::size_t x = 0; x < s[2]; ++x)
          for (std::size_t y = 0; y < s[3]; ++y) r(i, j, x, y) = t(i, j, x, y);
    return r;
  };
  auto qb = bnhd(q), kb = bnhd(k), vb = bnhd(v), db = bnhd(dout);
  CHECK(qb.strides() == strides4{std::ptrdiff_t(n * h * d), std::ptrdiff_t(d), std::ptrdiff_t(h * d), 1});
  auto plan = compile(causal_attn<elu_plus_one>);
  auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  auto gb = cpu::gradient(plan, db, Q = qb.view(), K = kb.view(), V = vb.view());
  CHECK(gb[Q].strides() == qb.strides());
  CHECK(gb[V].strides() == vb.strides());
  CHECK(g[Q].strides() == q.strides());
  CHECK(max_abs_diff(gb[Q], g[Q]) == 0);
  CHECK(max_abs_diff(gb[K], g[K]) == 0);
  CHECK(max_abs_diff(gb[V], g[V]) == 0);
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
                          cpu::gradient(compile<order::quadratic>(expr), dout, Q = q, K = k, V = v, W = w)}) {
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
  check_fd_all_orders(causal_plain<poly2>, 20);
  check_fd_all_orders(full_attn<poly2>, 21);  // normalised: (q·k)² >= 0
  check_fd_parametric(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 22);
  check_fd_parametric(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * V, 23);
  check_fd_parametric(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V, 24);
}
