// Bad input at run time: shape mismatches throw lina::shape_error naming the
// symbol, the dimension and both extents; N = 0 and N = 1 work; NaN
// propagates where the mathematics puts it and nowhere else.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 4>;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
}  // namespace

TEST_CASE("a sequence length that disagrees between inputs names both extents") {
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), k = tensor<float>::random({1, 2, 9, 4}, 2);
  auto v = tensor<float>::random({1, 2, 10, 3}, 3);
  auto e = test::shape_error_of([&] { cpu::evaluate(compile(attn), Q = q, K = k, V = v); });
  CHECK(e.symbol() == "K");
  CHECK(e.dimension() == "N");
  CHECK(e.extent() == 9);
  CHECK(e.expected_extent() == 10);
  CHECK(std::string(e.what()) == "lina::shape_error: input K, dimension N: extent 9 does not match extent 10 bound by input Q");
}

TEST_CASE("a static extent that the tensor does not have") {
  auto q = tensor<double>::random({1, 1, 10, 5}, 1), k = tensor<double>::random({1, 1, 10, 4}, 2);
  auto v = tensor<double>::random({1, 1, 10, 3}, 3);
  auto e = test::shape_error_of([&] { cpu::evaluate(compile(attn), Q = q, K = k, V = v); });
  CHECK(e.symbol() == "Q");
  CHECK(e.dimension() == "D");
  CHECK(e.extent() == 5);
  CHECK(e.expected_extent() == 4);
  CHECK(std::string(e.what()).find("declared static by dim<\"D\", 4>") != std::string::npos);
}

TEST_CASE("batch and heads must agree across inputs") {
  auto q = tensor<float>::random({2, 2, 10, 4}, 1), k = tensor<float>::random({1, 2, 10, 4}, 2);
  auto v = tensor<float>::random({2, 3, 10, 3}, 3);
  auto e = test::shape_error_of([&] { cpu::evaluate(compile(attn), Q = q, K = k, V = q); });
  CHECK(e.symbol() == "K");
  CHECK(e.dimension() == "B (batch)");
  auto e2 = test::shape_error_of([&] { cpu::evaluate(compile(attn), Q = q, K = q, V = v); });
  CHECK(e2.symbol() == "V");
  CHECK(e2.dimension() == "H (heads)");
  CHECK(e2.extent() == 3);
  CHECK(e2.expected_extent() == 2);
}

TEST_CASE("evaluate_into checks the output's shape") {
  auto q = tensor<float>::random({1, 2, 10, 4}, 1);
  auto v = tensor<float>::random({1, 2, 10, 3}, 3);
  tensor<float> out({1, 2, 10, 4});
  auto e = test::shape_error_of([&] { cpu::evaluate_into(compile(attn), out.view(), Q = q, K = q, V = v); });
  CHECK(e.symbol() == "out");
  CHECK(e.extent() == 4);
  CHECK(e.expected_extent() == 3);
}

TEST_CASE("rows(first, count) is a block of a sequence in any layout, and past the rows throws") {
  // [B, N, H, D] memory: rows of every (batch, head) are H·D apart
  std::size_t const b = 2, h = 3, n = 7, d = 4;
  std::vector<float> mem(b * n * h * d);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<float>(i);
  tensor_view<float> const v(mem.data(), {b, h, n, d}, {std::ptrdiff_t(n * h * d), std::ptrdiff_t(d),
                                                        std::ptrdiff_t(h * d), 1});
  auto const block = v.rows(2, 4);
  CHECK(block.shape() == shape4{b, h, 4, d});
  CHECK(block.strides() == v.strides());
  for_each_index(block.shape(), [&](auto bb, auto hh, auto i, auto j) { CHECK(block(bb, hh, i, j) == v(bb, hh, 2 + i, j)); });
  CHECK(v.rows(7, 0).shape()[2] == 0);  // an empty block at the end
  auto t = tensor<float>::random({b, h, n, d}, 5);
  CHECK(max_abs_diff(t.rows(3, 4), std::as_const(t).rows(3, 4)) == 0);
  CHECK(t.rows(0, n).data() == t.data());
  CHECK_THROWS_WITH_AS((void)v.rows(5, 3), "lina: rows [5, 5 + 3) of a view of 7 rows", std::out_of_range);
  CHECK_THROWS_AS((void)v.rows(8, 0), std::out_of_range);
  CHECK_THROWS_AS((void)t.rows(1, std::size_t(-1)), std::out_of_range);  // no wrap-around
}

TEST_CASE("N = 0 gives an empty result, N = 1 a single row") {
  for (std::size_t n : {0u, 1u}) {
    auto q = tensor<float>::random({2, 2, n, 4}, 1), k = tensor<float>::random({2, 2, n, 4}, 2);
    auto v = tensor<float>::random({2, 2, n, 3}, 3);
    for (auto const& out : {cpu::evaluate(compile(attn), Q = q, K = k, V = v),
                            cpu::evaluate(compile<order::linear>(attn), Q = q, K = k, V = v),
                            cpu::evaluate(compile<order::quadratic>(attn), Q = q, K = k, V = v)}) {
      CHECK(out.shape() == shape4{2, 2, n, 3});
      if (n == 1)  // one token attends to itself: the output is its value (up to eps)
        for (std::size_t i = 0; i < out.size(); ++i) CHECK(out.data()[i] == doctest::Approx(v.data()[i]).epsilon(1e-5));
    }
  }
  auto empty = tensor<float>({0, 2, 5, 4});
  CHECK(cpu::evaluate(compile(attn), Q = empty, K = empty, V = tensor<float>({0, 2, 5, 3})).size() == 0);
}

TEST_CASE("NaN propagates along the causal order and nowhere else") {
  std::size_t n = 12, bad = 5;
  auto q = tensor<float>::random({2, 2, n, 4}, 1), k = tensor<float>::random({2, 2, n, 4}, 2);
  auto v = tensor<float>::random({2, 2, n, 3}, 3);
  k(1, 0, bad, 2) = std::numeric_limits<float>::quiet_NaN();  // key of token 5, batch 1, head 0
  for (auto const& out : {cpu::evaluate(compile<order::linear>(attn), Q = q, K = k, V = v),
                          cpu::evaluate(compile<order::quadratic>(attn), Q = q, K = k, V = v)}) {
    for (std::size_t b = 0; b < 2; ++b)
      for (std::size_t h = 0; h < 2; ++h)
        for (std::size_t i = 0; i < n; ++i) {
          bool poisoned = b == 1 && h == 0 && i >= bad;  // token i attends to token 5
          CAPTURE(b); CAPTURE(h); CAPTURE(i);
          CHECK(std::isnan(out(b, h, i, 0)) == poisoned);
        }
  }
  // relu and identity keep the NaN too.
  auto r = cpu::evaluate(compile(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), Q = q, K = k, V = v);
  CHECK(std::isnan(r(1, 0, n - 1, 0)));
  CHECK(!std::isnan(r(0, 0, n - 1, 0)));
}
