// Derived gradients (against finite differences: test_gradient_fd*.cpp):
// linear = quadratic gradients; a two-token case in closed form; the printed
// causal backward; constant extra memory.
#include <string>

#include "gradient_support.hpp"

using namespace gradient_test;
using N_t = std::remove_cvref_t<decltype(N)>;

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
    CONTEXT(n, d, m);
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
        "∂Q = φ′[elu+1](Q)⊙contract(t1, prefix([V|1]⊗φ[elu+1](K)))\n"
        "∂K = φ′[elu+1](K)⊙contract([V|1], suffix(t1⊗φ[elu+1](Q)))\n"
        "∂V = dropcol(contract(φ[elu+1](K), suffix(φ[elu+1](Q)⊗t1)))\n"
        "t1 = rowdiv′(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])), dout)\n");
  CHECK(to_string(gradient(compile<order::quadratic>(causal_attn<elu_plus_one>))) ==
        "∂Q = φ′[elu+1](Q)⊙(t1·φ[elu+1](K))\n"
        "∂K = φ′[elu+1](K)⊙(t1ᵀ·φ[elu+1](Q))\n"
        "∂V = dropcol(t3ᵀ·t2)\n"
        "t1 = causal(t2·[V|1]ᵀ)\n"
        "t2 = rowdiv′(t3·[V|1], dout)\n"
        "t3 = causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ)\n");
}

// Shared subtrees are named by identity (type and values), not by their text:
// two maps that happen to share a name print alike, but are two subtrees.
struct twin_a {
  static constexpr std::string_view name = "twin";
  template <class T> static T value(T x) { return x * x + 1; }
  template <class T> static T derivative(T x) { return 2 * x; }
};
struct twin_b {
  static constexpr std::string_view name = "twin";
  template <class T> static T value(T x) { return x * x + 2; }
  template <class T> static T derivative(T x) { return 2 * x; }
};
TEST_CASE("backward plans name shared subtrees by identity, not by text") {
  constexpr auto a = normalize(causal(phi<twin_a>(Q) * transpose(phi<twin_a>(K)))) * V;
  constexpr auto b = normalize(causal(phi<twin_b>(Q) * transpose(phi<twin_b>(K)))) * V;
  std::string text = to_string(gradient(compile<order::linear>(transpose(a) * b)));
  CAPTURE(text);
  // The two forward scans print alike, yet are two subtrees: two names, two
  // definitions of the same text (naming by text gave them one).
  std::string const scan = " = contract(φ[twin](Q), prefix(φ[twin](K)⊗[V|1]))\n";
  std::size_t defs = 0;
  for (std::size_t at = 0; (at = text.find(scan, at)) != std::string::npos; ++at) ++defs;
  CHECK(defs == 2);
}

// The derived backward of a linear plan: no N x N node, and per-row matrices
// only inside fused scans (no per-step state cache).
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(causal_attn<elu_plus_one>))), N_t>());
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(full_attn<relu>))), N_t>());
static_assert(backward_is_constant_state<decltype(gradient(compile<order::linear>(causal_plain<identity>))), N_t>());
static_assert(!backward_is_constant_state<decltype(gradient(compile<order::quadratic>(causal_attn<elu_plus_one>))), N_t>());

// gradients_for<T, Plan> (what the CUDA backend returns, from the plan's inputs
// alone) is the type the derived backward plan's gradients have: one entry per
// input, in inputs_of order — with a run-time select, an input read twice,
// and stacked layers.
template <class P>
constexpr bool same_gradient_type =
    std::is_same_v<gradients_for<tensor<float>, P>, gradients_of<tensor<float>, decltype(gradient(P{}))>>;
static_assert(same_gradient_type<decltype(compile(causal_attn<elu_plus_one>))>);
static_assert(same_gradient_type<decltype(compile<order::linear>(full_plain<relu>))>);
static_assert(same_gradient_type<decltype(compile(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(Q)))) * V))>);
static_assert(same_gradient_type<decltype(compile(
                  normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * causal_attn<elu_plus_one>))>);

TEST_CASE("dout must have the output's shape") {
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 2);
  auto bad_rows = tensor<float>::random({1, 2, 9, 3}, 3), bad_cols = tensor<float>::random({1, 2, 10, 4}, 4);
  auto plan = compile(causal_attn<elu_plus_one>);
  test::expect_shape_error([&] { cpu::gradient(plan, bad_rows, Q = q, K = q, V = v); }, "dout", "N", 9, 10);
  auto const e = test::shape_error_of([&] { cpu::gradient(plan, bad_cols, Q = q, K = q, V = v); });
  CHECK(e.symbol() == "dout");
  CHECK(e.dimension() == "M");
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


TEST_CASE("gradient_into writes the gradients into caller views, in any layout, and checks them first") {
  std::size_t b = 2, h = 3, n = 70, d = 4, m = 5;
  auto q = tensor<double>::random({b, h, n, d}, 1), k = tensor<double>::random({b, h, n, d}, 2);
  auto v = tensor<double>::random({b, h, n, m}, 3), dout = tensor<double>::random({b, h, n, m}, 4);
  auto plan = compile(causal_attn<elu_plus_one>);
  auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  // dQ into a [B,N,H,D] buffer, dK and dV into plain tensors filled with a sentinel
  strides4 bnhd{std::ptrdiff_t(n * h * d), std::ptrdiff_t(d), std::ptrdiff_t(h * d), 1};
  auto dq = tensor<double>::like(tensor_view<double const>(nullptr, {b, h, n, d}, bnhd), -7.0);
  tensor<double> dk({b, h, n, d}, -7.0), dv({b, h, n, m}, -7.0);
  auto into = cpu::gradient_views<double>(plan);
  into[Q] = dq.view();
  into[K] = dk.view();
  into[V] = dv.view();
  cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v);
  CHECK(max_abs_diff(dq, g[Q]) == 0);
  CHECK(max_abs_diff(dk, g[K]) == 0);
  CHECK(max_abs_diff(dv, g[V]) == 0);

  // a view of the wrong shape: shape_error naming the gradient, nothing written
  tensor<double> short_dk({b, h, n - 1, d}, -7.0), dq2({b, h, n, d}, -7.0);
  into[Q] = dq2.view();
  into[K] = short_dk.view();
  auto const e = test::shape_error_of([&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v); });
  CHECK(e.symbol() == "∂K");
  CHECK(e.dimension() == "rows");
  CHECK(e.extent() == n - 1);
  bool untouched = true;
  for (std::size_t i = 0; i < dq2.size(); ++i) untouched = untouched && dq2.data()[i] == -7.0;
  CHECK(untouched);
}

// A gradient may go into its own input's memory (into[Q] = q, as a training
// step that overwrites what it no longer needs) or into dout's: the backend
// computes through a copy. Two gradients in shared memory would overwrite
// each other: lina::alias_error naming both, before anything is written.
TEST_CASE("gradient_into: over an input or dout the numbers of fresh memory, and two gradients sharing memory throw") {
  std::size_t b = 2, h = 2, n = 90, d = 4;
  auto q = tensor<double>::random({b, h, n, d}, 1), k = tensor<double>::random({b, h, n, d}, 2);
  auto v = tensor<double>::random({b, h, n, d}, 3), dout = tensor<double>::random({b, h, n, d}, 4);
  auto plan = compile(causal_attn<elu_plus_one>);
  auto const g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  auto q2 = q, k2 = k, v2 = v, dout2 = dout;
  auto into = cpu::gradient_views<double>(plan);
  into[Q] = q2.view();     // ∂Q over Q
  into[K] = dout2.view();  // ∂K over dout
  into[V] = k2.view();     // ∂V over K
  cpu::gradient_into(plan, into, dout2, Q = q2, K = k2, V = v2);
  CHECK(max_abs_diff(q2, g[Q]) == 0);
  CHECK(max_abs_diff(dout2, g[K]) == 0);
  CHECK(max_abs_diff(k2, g[V]) == 0);

  tensor<double> dq({b, h, n, d}, -7.0), dkv({b, h, n, d}, -7.0);
  into[Q] = dq.view();
  into[K] = dkv.view();
  into[V] = dkv.view().rows(1, n - 1);  // wrong shape and shared: the shape is checked first
  test::expect_shape_error([&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v); }, "∂V", "rows", n - 1, n);
  into[V] = dkv.view();
  try {
    cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v);
    FAIL("no alias_error");
  } catch (lina::alias_error const& e) {
    CHECK(std::string(e.what()) ==
          "lina::alias_error: the views of ∂K and ∂V may share memory; give each gradient memory of its own");
  }
  bool untouched = true;
  for (std::size_t i = 0; i < dq.size(); ++i) untouched = untouched && dq.data()[i] == -7.0 && dkv.data()[i] == -7.0;
  CHECK(untouched);
}
