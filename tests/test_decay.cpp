// A decayed causal mask, causal(S, decay{g}): token j weighs g^(i-j) in row i
// (RetNet's retention). Its linear order is a prefix scan that decays its
// state, its gradient a suffix scan that decays it the other way; both are
// checked against the mask as written, in every order, with finite
// differences, and as recurrent steps and chained blocks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <lina/check.hpp>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);

template <class Map>
constexpr auto retention(double g) {
  return normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)), decay{g})) * V;
}
constexpr auto unnormalised = causal(Q * transpose(K), decay{0.5}) * V;  // RetNet's form: no φ, no normaliser
constexpr auto softmax = normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.8})) * V;

std::string message_of(double g) {
  try {
    (void)decay{g};
  } catch (std::invalid_argument const& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// The decay is a value of the mask, carried into the scan and its adjoint.
static_assert(contains_op<decltype(compile<order::linear>(retention<elu_plus_one>(0.9))), op::prefix_scan_t<op::decay_by>>());
// the plain mask stays an empty op (its subtrees merge by type in a schedule)
static_assert(std::is_empty_v<op::causal> && std::is_empty_v<op::prefix_scan> && !std::is_empty_v<op::causal_t<op::decay_by>>);
static_assert(kid<1>(kid<0>(compile<order::linear>(retention<elu_plus_one>(0.9)))).op.decay == 0.9);

TEST_CASE("decay: plans print their decay, the plain mask prints as before") {
  CHECK(to_string(compile<order::linear>(retention<elu_plus_one>(0.9))).find("; decay=0.9)") != std::string::npos);
  CHECK(to_string(retention<elu_plus_one>(0.9)).find("causal(") != std::string::npos);
  CHECK(to_string(compile<order::linear>(retention<elu_plus_one>(1))).find("decay") == std::string::npos);
  auto back = to_string(gradient(compile<order::linear>(retention<elu_plus_one>(0.75))));
  INFO(back);
  CHECK(back.find("suffix(") != std::string::npos);
  CHECK(back.find("; decay=0.75)") != std::string::npos);
}

TEST_CASE("decay: every order agrees with the mask as written, and gradients with central differences") {
  for (auto const& e : {retention<elu_plus_one>(0.9), retention<elu_plus_one>(0.3), retention<elu_plus_one>(0)}) {
    auto o = check::orderings(e, {.trials = 4});
    INFO(o);
    CHECK(o.ok());
    CHECK(o.findings.size() == 3);  // automatic, quadratic, linear against as written
    auto g = check::gradients(e, {.trials = 2});
    INFO(g);
    CHECK(g.ok());
  }
  auto plain = check::gradients(unnormalised, {.trials = 3, .seed = 5});
  INFO(plain);
  CHECK(plain.ok());
  auto sm = check::gradients(softmax, {.trials = 2});
  INFO(sm);
  CHECK(sm.ok());
}

TEST_CASE("decay: recurrent steps and two chained blocks, forward and gradients, equal one pass") {
  // the chained gradients hand ∂state back through the block boundary: the
  // suffix scan's decay after its last row is what makes them join
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto r = check::recurrent(retention<elu_plus_one>(0.8), {.trials = 1, .seed = seed});
    INFO(r);
    CHECK(r.ok());
    CHECK(r.findings.size() == 5);
    auto u = check::recurrent(unnormalised, {.trials = 1, .seed = seed});
    INFO(u);
    CHECK(u.ok());
  }
}

TEST_CASE_TEMPLATE("decay: the scan forgets as the mask says, at longer sequences and signed inputs", T, float, double) {
  test::rng r{3};
  for (int trial = 0; trial < 4; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 3), n = r.in(1, 300), d = r.in(1, 24), m = r.in(1, 24);
    double g = trial == 0 ? 1 : 1 - std::ldexp(1.0, -static_cast<int>(r.in(1, 8)));  // RetNet's 1 - 2^-k
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next());
    auto e = causal(phi<identity>(Q) * transpose(phi<identity>(K)), decay{g}) * V;
    auto ref = cpu::evaluate(compile<order::quadratic>(e), Q = q, K = k, V = v);
    auto lin = cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v);
    CONTEXT(n, d, m, g);
    double bound = test::rounding_bound<T>(double(n * d * 4), 1.0) * (1 + test::max_abs(ref));
    CHECK(max_abs_diff(lin, ref) <= bound);
    // the plain mask's fast scan and a decay of 1 give the same plan
    if (g == 1)
      CHECK(max_abs_diff(lin, cpu::evaluate(compile<order::linear>(causal(Q * transpose(K)) * V), Q = q, K = k, V = v)) == 0);
  }
}

TEST_CASE("decay: a decay of 0 keeps only the diagonal, so normalised attention returns V") {
  auto q = tensor<double>::random({1, 2, 50, 8}, 1), k = tensor<double>::random({1, 2, 50, 8}, 2);
  auto v = tensor<double>::random({1, 2, 50, 5}, 3);
  for (auto plan : {compile<order::linear>(retention<elu_plus_one>(0))})
    CHECK(max_abs_diff(cpu::evaluate(plan, Q = q, K = k, V = v), v) < 1e-5);  // eps / φ(q)·φ(k)
}

TEST_CASE("decay: a decay outside [0, 1] or NaN is refused, naming the value") {
  CHECK_THROWS_AS((void)decay{1.5}, std::invalid_argument);
  CHECK_THROWS_AS((void)decay{-0.25}, std::invalid_argument);
  CHECK_THROWS_AS((void)decay{std::numeric_limits<double>::quiet_NaN()}, std::invalid_argument);
  CHECK(message_of(1.5).find("lina::decay: gamma must be in [0, 1]") != std::string::npos);
  CHECK(message_of(1.5).find("1.5") != std::string::npos);
  CHECK(message_of(0.5).empty());
}

TEST_CASE("decay: the backward reads the forward's scan three times and runs it once") {
  // the decayed scans carry a value, so they are not merged by type: the later
  // two name the first as their twin and share its rows when the decays agree
  auto const b = as_bundle(gradient(compile<order::linear>(retention<elu_plus_one>(0.9))));
  using S = schedule_of<std::remove_cvref_t<decltype(b)>>;
  auto const forward = to_string(compile<order::linear>(retention<elu_plus_one>(0.9))).substr(std::string("rowdiv(").size());
  std::size_t copies = 0, twins = 0;
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    auto one = [&]<std::size_t K>(std::integral_constant<std::size_t, K>) {
      if constexpr (S::template is_scan<K>) {
        if (forward.rfind(to_string(S::template node_at<K>(b)), 0) != 0) return;
        ++copies;
        if (S::twin[K] != sched::none) {
          ++twins;
          CHECK(S::template is_scan<S::twin[K] % S::size>);
        }
      }
    };
    (one(std::integral_constant<std::size_t, J>{}), ...);
  }(std::make_index_sequence<S::size>{});
  CHECK(copies == 3);
  CHECK(twins == 2);
}

TEST_CASE("decay: heads with decays of their own, one plan per head's view, written in place (docs/dsl.md)") {
  std::size_t const b = 2, h = 3, n = 70, d = 5, m = 4;
  double const g[h] = {0.5, 0.9, 0.99};  // RetNet's 1 - 2^-k, one k per head
  auto q = tensor<double>::random({b, h, n, d}, 1), k = tensor<double>::random({b, h, n, d}, 2);
  auto v = tensor<double>::random({b, h, n, m}, 3);
  tensor<double> out({b, h, n, m});
  auto head = [&](auto& t, std::size_t x) {
    using T = std::remove_reference_t<decltype(*t.data())>;
    return tensor_view<T>(t.data() + static_cast<std::ptrdiff_t>(x) * t.strides()[1], {b, 1, n, t.shape()[3]}, t.strides());
  };
  for (std::size_t x = 0; x < h; ++x) {
    auto const plan = compile(causal(Q * transpose(K), decay{g[x]}) * V);  // g at run time
    cpu::evaluate_into(plan, head(out, x), Q = head(q, x), K = head(k, x), V = head(v, x));
  }
  for (std::size_t x = 0; x < h; ++x) {
    CAPTURE(x);
    auto const ref = cpu::evaluate(compile<order::quadratic>(causal(Q * transpose(K), decay{g[x]}) * V), Q = head(q, x),
                                   K = head(k, x), V = head(v, x));
    CHECK(max_abs_diff(head(out, x), ref) <= 1e-12 * (1 + test::max_abs(ref)));
    if (x > 0) {  // and the decays differ: another head's g gives other numbers
      auto const other = cpu::evaluate(compile(causal(Q * transpose(K), decay{g[x - 1]}) * V), Q = head(q, x),
                                       K = head(k, x), V = head(v, x));
      CHECK(max_abs_diff(other, ref) > 1e-3);
    }
  }
}

namespace {
// Head x of t, a [B, 1, rows, cols] view of the same memory.
template <class T>
tensor_view<T const> head_of(tensor<T> const& t, std::size_t x) {
  auto const s = t.shape();
  return tensor_view<T const>(t.data() + static_cast<std::ptrdiff_t>(x) * t.strides()[1], {s[0], 1, s[2], s[3]},
                              t.strides());
}
template <class Map>
auto retention_per_head(std::vector<double> g) {
  return normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)), head_decays{std::move(g)})) * V;
}
}  // namespace

TEST_CASE("decay per head: each head's rows and gradients are those of its own decay, in every order") {
  // RetNet's heads forget at different rates: one plan with head_decays against
  // one plan per head's view with that head's decay{g}
  test::rng r{5};
  for (int trial = 0; trial < 4; ++trial) {
    std::size_t const b = r.in(1, 2), h = r.in(2, 4), n = r.in(1, 150), d = r.in(1, 12), m = r.in(1, 12);
    std::vector<double> g(h);
    for (std::size_t x = 0; x < h; ++x) g[x] = 1 - std::ldexp(1.0, -static_cast<int>(r.in(1, 7)));
    g[r.in(0, h - 1)] = trial == 0 ? 0 : 1;  // only the diagonal; no decay at all
    auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
    auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
    auto const e = retention_per_head<elu_plus_one>(g);
    auto const out_linear = cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v);
    auto const out_quadratic = cpu::evaluate(compile<order::quadratic>(e), Q = q, K = k, V = v);
    auto const out_written = cpu::evaluate(e, Q = q, K = k, V = v);
    auto const grad = cpu::gradient(compile<order::linear>(e), dout, Q = q, K = k, V = v);
    auto const grad_quadratic = cpu::gradient(compile<order::quadratic>(e), dout, Q = q, K = k, V = v);
    for (std::size_t x = 0; x < h; ++x) {
      CONTEXT(trial, x, g[x], n);
      auto const one = compile<order::quadratic>(retention<elu_plus_one>(g[x]));
      auto const want = cpu::evaluate(one, Q = head_of(q, x), K = head_of(k, x), V = head_of(v, x));
      double const tol = 1e-12 * (1 + test::max_abs(want));
      CHECK(max_abs_diff(head_of(out_linear, x), want) <= tol);
      CHECK(max_abs_diff(head_of(out_quadratic, x), want) <= tol);
      CHECK(max_abs_diff(head_of(out_written, x), want) <= tol);
      auto const gw = cpu::gradient(one, head_of(dout, x), Q = head_of(q, x), K = head_of(k, x), V = head_of(v, x));
      for (auto [got, ref] : {std::pair{head_of(grad[Q], x), gw[Q]}, std::pair{head_of(grad[K], x), gw[K]},
                              std::pair{head_of(grad[V], x), gw[V]}, std::pair{head_of(grad_quadratic[K], x), gw[K]}})
        CHECK(max_abs_diff(got, ref) <= 1e-11 * (1 + test::max_abs(ref)));
    }
  }
}

TEST_CASE("decay per head: orderings, central differences and recurrent steps through lina::check") {
  // check:: takes the heads from the decays (three here), everything else drawn
  auto const e = retention_per_head<elu_plus_one>({0.5, 0.9, 1});
  auto o = check::orderings(e, {.trials = 3});
  INFO(o);
  CHECK(o.ok());
  for (auto const& f : o.findings) CHECK(f.extents.find("H=3") != std::string::npos);
  auto gr = check::gradients(e, {.trials = 2});
  INFO(gr);
  CHECK(gr.ok());
  auto rec = check::recurrent(e, {.trials = 2, .seed = 3});
  INFO(rec);
  CHECK(rec.ok());
  auto sm = check::gradients(normalize(causal(exp(Q * transpose(K) * 0.25), head_decays::alibi(2))) * V, {.trials = 2});
  INFO(sm);
  CHECK(sm.ok());
}

TEST_CASE("decay per head: as many decays as heads, else a shape_error before anything is written") {
  auto const plan = compile(retention_per_head<elu_plus_one>({0.5, 0.9, 0.99}));
  auto q = tensor<float>::random({1, 2, 20, 4}, 1), k = tensor<float>::random({1, 2, 20, 4}, 2);
  auto v = tensor<float>::random({1, 2, 20, 3}, 3);
  tensor<float> out({1, 2, 20, 3});
  std::fill_n(out.data(), out.size(), 7.0f);
  auto into = [&] { cpu::evaluate_into(plan, out.view(), Q = q, K = k, V = v); };
  test::expect_shape_error(into, "decay per head", "H (heads)", 3, 2);
  CHECK(std::string(test::shape_error_of(into).what()).find("head_decays: one per head") != std::string::npos);
  CHECK(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 7.0f; }));
  CHECK_THROWS_AS(cpu::gradient(plan, out, Q = q, K = k, V = v), shape_error);
  CHECK_THROWS_AS(cpu::recurrent<float>(plan, 1, 2).step(Q = q.rows(0, 1), K = k.rows(0, 1), V = v.rows(0, 1)), shape_error);
}

TEST_CASE("decay per head: each decay in [0, 1] and at least one, RetNet's and ALiBi's as the papers give them") {
  CHECK_THROWS_WITH_AS((void)head_decays({0.5, 1.5}), doctest::Contains("gamma of head 1 must be in [0, 1]"), std::invalid_argument);
  CHECK_THROWS_AS((void)head_decays({std::numeric_limits<double>::quiet_NaN()}), std::invalid_argument);
  CHECK_THROWS_WITH_AS((void)head_decays({}), doctest::Contains("no decay given"), std::invalid_argument);
  auto const ret = head_decays::retnet(4).gammas;
  CHECK(ret == std::vector<double>{1 - 1.0 / 32, 1 - 1.0 / 64, 1 - 1.0 / 128, 1 - 1.0 / 256});
  // ALiBi: slopes 2^(-8(h+1)/H) (H = 8: 1/2, 1/4, …, 1/256) as decays e^(-m)
  auto const a8 = head_decays::alibi(8).gammas;
  REQUIRE(a8.size() == 8);
  for (std::size_t x = 0; x < 8; ++x) CHECK(a8[x] == doctest::Approx(std::exp(-std::ldexp(1.0, -static_cast<int>(x) - 1))));
  // H = 6: the 4 slopes of H = 4 (1/4, 1/16, 1/64, 1/256), then 2^-1, 2^-3 of H = 8
  auto const a6 = head_decays::alibi(6).gammas;
  std::vector<double> const m6{1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256, 1.0 / 2, 1.0 / 8};
  REQUIRE(a6.size() == 6);
  for (std::size_t x = 0; x < 6; ++x) CHECK(a6[x] == doctest::Approx(std::exp(-m6[x])));
}

TEST_CASE("decay per head: plans print the list, and copies of a plan share it") {
  auto const plan = compile<order::linear>(retention_per_head<elu_plus_one>({0.5, 0.75}));
  CHECK(to_string(plan).find("; decay per head=[0.5, 0.75])") != std::string::npos);
  auto back = to_string(gradient(plan));
  INFO(back);
  CHECK(back.find("suffix(") != std::string::npos);
  CHECK(back.find("; decay per head=[0.5, 0.75])") != std::string::npos);
  auto const copy = plan;
  CHECK(same_value(copy, plan));
  CHECK(!same_value(compile<order::linear>(retention_per_head<elu_plus_one>({0.5, 0.7})), plan));
}
