// The CPU backend, as properties over random shapes and signed inputs:
// linear and quadratic plans agree with each other and with the expression
// evaluated as written; causal plans agree with a masked loop written here;
// normalize behaves as a weighted average; layouts bind without copies.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "cpu_props.hpp"

using namespace lina;
using namespace test::cpu_props;

TEST_CASE_TEMPLATE("causal normalised attention: scan = masked quadratic = as written", T, float, double) {
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  check_orders<T, elu_plus_one>(e, true, true, 1);
}

TEST_CASE_TEMPLATE("non-causal normalised attention: both orders agree", T, float, double) {
  constexpr auto e = normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V;
  check_orders<T, elu_plus_one>(e, false, true, 2);
}

TEST_CASE_TEMPLATE("unnormalised attention, signed maps: both orders agree", T, float, double) {
  check_orders<T, identity>(causal(phi<identity>(Q) * transpose(phi<identity>(K))) * V, true, false, 3);
  check_orders<T, identity>(Q * transpose(K) * V, false, false, 4);
  check_orders<T, relu>(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, true, false, 5);
  check_orders<T, relu>(phi<relu>(Q) * transpose(phi<relu>(K)) * V, false, false, 6);
}

TEST_CASE_TEMPLATE("normalize: constant rows of V come out unchanged", T, float, double) {
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  test::rng r{7};
  for (int trial = 0; trial < 6; ++trial) {
    shape s = random_shape(r);
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    tensor<T> v({s.b, s.h, s.n, s.m}, T(0.625));
    for (auto const& out : {cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v),
                            cpu::evaluate(compile<order::quadratic>(e), Q = q, K = k, V = v)}) {
      // out = c den / (den + eps), den >= n_i d e^-1 > 0.3: |out - c| < c eps / 0.3 + rounding
      double err = 0;
      for (std::size_t i = 0; i < out.size(); ++i) err = std::max(err, std::abs(double(out.data()[i]) - 0.625));
      CHECK(err <= 0.625 * 1e-6 / 0.3 + test::rounding_bound<T>(double(s.n * s.d), 1.0));
    }
  }
}

// The element-wise maps' derivatives where they switch: relu's is 0 at 0 (-0
// too) and below, 1 above, NaN for NaN; elu+1's 1 above 0 and e^x at and below.
TEST_CASE_TEMPLATE("element-wise maps: values and derivatives at 0, signed zeros and NaN", T, float, double) {
  T const nan = std::numeric_limits<T>::quiet_NaN();
  CHECK(relu::value(T(-2)) == 0);
  CHECK(relu::value(T(3)) == 3);
  CHECK(std::isnan(relu::value(nan)));
  CHECK(relu::derivative(T(-2)) == 0);
  CHECK(relu::derivative(T(0)) == 0);
  CHECK(relu::derivative(-T(0)) == 0);
  CHECK(relu::derivative(T(1e-30)) == 1);
  CHECK(relu::derivative(T(3)) == 1);
  CHECK(std::isnan(relu::derivative(nan)));
  CHECK(elu_plus_one::derivative(T(2)) == 1);
  CHECK(elu_plus_one::derivative(T(0)) == 1);
  CHECK(elu_plus_one::derivative(T(-1)) == doctest::Approx(std::exp(-1.0)));
  CHECK(std::isnan(elu_plus_one::derivative(nan)));
  CHECK(identity::derivative(T(-5)) == 1);
  CHECK(std::isnan(identity::derivative(nan)));
}

TEST_CASE_TEMPLATE("denominators stay positive for positive maps", T, float, double) {
  // With V = 1 the unnormalised causal product is the normaliser itself.
  test::rng r{8};
  for (int trial = 0; trial < 6; ++trial) {
    shape s = random_shape(r);
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    tensor<T> ones({s.b, s.h, s.n, 1}, T(1));
    auto elu_den = cpu::evaluate(compile(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V),
                                 Q = q, K = k, V = ones);
    auto relu_den = cpu::evaluate(compile(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), Q = q, K = k, V = ones);
    for (std::size_t i = 0; i < elu_den.size(); ++i) {
      CHECK(elu_den.data()[i] > T(0));
      CHECK(relu_den.data()[i] >= T(0));
    }
  }
}

TEST_CASE("softmax attention (exp) matches its definition") {
  constexpr auto e = normalize(exp((Q * transpose(K)) * 0.25)) * V;
  test::rng r{9};
  for (int trial = 0; trial < 6; ++trial) {
    shape s = random_shape(r);
    auto q = tensor<double>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<double>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<double>::random({s.b, s.h, s.n, s.m}, r.next());
    auto out = cpu::evaluate(compile(e), Q = q, K = k, V = v);
    tensor<double> ref({s.b, s.h, s.n, s.m});
    for (std::size_t b = 0; b < s.b; ++b)
      for (std::size_t h = 0; h < s.h; ++h)
        for (std::size_t i = 0; i < s.n; ++i) {
          double den = 0;
          std::vector<double> num(s.m, 0.0);
          for (std::size_t j = 0; j < s.n; ++j) {
            double dot = 0;
            for (std::size_t c = 0; c < s.d; ++c) dot += q(b, h, i, c) * k(b, h, j, c);
            double w = std::exp(0.25 * dot);
            den += w;
            for (std::size_t x = 0; x < s.m; ++x) num[x] += w * v(b, h, j, x);
          }
          for (std::size_t x = 0; x < s.m; ++x) ref(b, h, i, x) = num[x] / (den + 1e-6);
        }
    CHECK(max_abs_diff(out, ref) <= test::rounding_bound<double>(double(s.n * s.d), 1.0));
  }
}

TEST_CASE("scaled, chained and transposed expressions agree with their as-written evaluation") {
  constexpr auto P = dim<"P">;
  constexpr auto W = input<"W">(M, P);
  constexpr auto fQ = phi<elu_plus_one>(Q);
  constexpr auto fK = phi<elu_plus_one>(K);
  test::rng r{10};
  for (int trial = 0; trial < 6; ++trial) {
    shape s = random_shape(r);
    std::size_t p = r.in(1, 9);
    auto q = tensor<double>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<double>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<double>::random({s.b, s.h, s.n, s.m}, r.next());
    auto w = tensor<double>::random({s.b, s.h, s.m, p}, r.next());
    auto agree = [&](auto const& expr) {
      auto ref = cpu::evaluate(expr, Q = q, K = k, V = v, W = w);
      double bound = test::rounding_bound<double>(double(s.n * s.d * s.m), test::max_abs(ref));
      CHECK(max_abs_diff(cpu::evaluate(compile<order::linear>(expr), Q = q, K = k, V = v, W = w), ref) <= bound);
      CHECK(max_abs_diff(cpu::evaluate(compile<order::quadratic>(expr), Q = q, K = k, V = v, W = w), ref) <= bound);
    };
    agree(0.5 * causal(fQ * transpose(2.0 * fK)) * V * W);
    agree(normalize(causal(fQ * transpose(fK))) * (V * W));
    agree(transpose(transpose(V * W) * transpose(fQ * transpose(fK))));
    agree(fQ * (transpose(fK) * V) * W / 3.0);
  }
}

TEST_CASE_TEMPLATE("[B,N,H,D] views bind without copies and give the same result", T, float, double) {
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  std::size_t b = 2, h = 3, n = 37, d = 5, m = 7;
  auto q = tensor<T>::random({b, h, n, d}, 1), k = tensor<T>::random({b, h, n, d}, 2);
  auto v = tensor<T>::random({b, h, n, m}, 3);
  auto qb = bnhd_copy(q), kb = bnhd_copy(k), vb = bnhd_copy(v);
  auto qv = qb.view(), kv = kb.view(), vv = vb.view();
  auto plan = compile(e);
  auto expected = cpu::evaluate(plan, Q = q, K = k, V = v);
  CHECK(max_abs_diff(cpu::evaluate(plan, Q = qv, K = kv, V = vv), expected) == 0);
  // And into a [B,N,H,M] output.
  bnhd<T> ob{std::vector<T>(b * n * h * m, T(-7)), {b, h, n, m}};
  tensor_view<T> ov = ob.view();
  cpu::evaluate_into(plan, ov, Q = qv, K = kv, V = vv);
  CHECK(max_abs_diff(ov, expected) == 0);
}
