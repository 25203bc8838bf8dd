// Bad input at run time: shape mismatches throw lina::shape_error naming the
// symbol, the dimension and both extents; N = 0 and N = 1 work; NaN
// propagates where the mathematics puts it and nowhere else; an output in an
// input's own memory gets the numbers fresh memory gets.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
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
          CONTEXT(b, h, i);
          CHECK(std::isnan(out(b, h, i, 0)) == poisoned);
        }
  }
  // relu and identity keep the NaN too.
  auto r = cpu::evaluate(compile(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), Q = q, K = k, V = v);
  CHECK(std::isnan(r(1, 0, n - 1, 0)));
  CHECK(!std::isnan(r(0, 0, n - 1, 0)));
}

// evaluate_into(plan, q.view(), Q = q, …): the scan zeroes and writes its
// first output rows before it reads the inputs' later rows, so the backend
// computes through a copy when the output may share an input's memory.
// Checked for each input, plans with and without a fused group around the
// scan, the quadratic order, a chained block, and an output laid out
// [B,N,H,M] over the input's [B,H,N,D] buffer.
TEST_CASE("an output in an input's memory gets the numbers fresh memory gets") {
  std::size_t const b = 2, h = 3, n = 150;
  auto const plain = causal(Q * transpose(K)) * V;
  auto const full = (phi<relu>(Q) * transpose(phi<relu>(K))) * V;
  auto check = [&](auto const& plan, char const* name) {
    auto q = tensor<double>::random({b, h, n, 4}, 1), k = tensor<double>::random({b, h, n, 4}, 2);
    auto v = tensor<double>::random({b, h, n, 4}, 3);
    tensor<double> const want = cpu::evaluate(plan, Q = q, K = k, V = v);
    for (int which = 0; which < 3; ++which) {
      for (bool bnhd : {false, true}) {
        CONTEXT(name, which, bnhd);
        auto q2 = q, k2 = k, v2 = v;
        tensor<double>& mem = which == 0 ? q2 : which == 1 ? k2 : v2;
        strides4 const layout = bnhd ? strides4{std::ptrdiff_t(n * h * 4), 4, std::ptrdiff_t(h * 4), 1}
                                     : tensor_view<double>::contiguous_strides({b, h, n, 4});
        tensor_view<double> out(mem.data(), {b, h, n, 4}, layout);
        cpu::evaluate_into(plan, out, Q = q2, K = k2, V = v2);
        double worst = 0;
        for (std::size_t x = 0; x < b; ++x)
          for (std::size_t y = 0; y < h; ++y)
            for (std::size_t i = 0; i < n; ++i)
              for (std::size_t j = 0; j < 4; ++j) worst = std::max(worst, std::abs(out(x, y, i, j) - want(x, y, i, j)));
        CHECK(worst == 0);
      }
    }
  };
  check(compile(attn), "normalised elu+1");
  check(compile<order::linear>(plain), "plain causal, linear");
  check(compile<order::quadratic>(plain), "plain causal, quadratic");
  check(compile<order::linear>(full), "relu, not causal, linear");

  // a chained block (evaluate_into with a state) writing over its own V
  auto plan = compile<order::linear>(plain);
  auto q = tensor<double>::random({b, h, n, 4}, 4), k = tensor<double>::random({b, h, n, 4}, 5);
  auto v = tensor<double>::random({b, h, n, 4}, 6);
  cpu::state<double> fresh, over;
  (void)cpu::evaluate(plan, fresh, Q = q.rows(0, 40), K = k.rows(0, 40), V = v.rows(0, 40));
  (void)cpu::evaluate(plan, over, Q = q.rows(0, 40), K = k.rows(0, 40), V = v.rows(0, 40));
  auto const want = cpu::evaluate(plan, fresh, Q = q.rows(40, n - 40), K = k.rows(40, n - 40), V = v.rows(40, n - 40));
  cpu::evaluate_into(plan, v.rows(40, n - 40), over, Q = q.rows(40, n - 40), K = k.rows(40, n - 40), V = v.rows(40, n - 40));
  auto const got = v.rows(40, n - 40);
  double worst = 0;
  for (std::size_t x = 0; x < b; ++x)
    for (std::size_t y = 0; y < h; ++y)
      for (std::size_t i = 0; i < n - 40; ++i)
        for (std::size_t j = 0; j < 4; ++j) worst = std::max(worst, std::abs(got(x, y, i, j) - want(x, y, i, j)));
  CHECK(worst == 0);
}

TEST_CASE("may_share_memory: views of one buffer share memory where they share an element") {
  using detail::may_share_memory;
  std::size_t const b = 2, n = 5, h = 3, d = 4;
  std::vector<float> buf(b * n * 4 * h * d);  // [B, N, 4, H, D]: Q, K, V and the output side by side
  auto slot = [&](std::size_t k, std::size_t heads = 3, std::size_t first_head = 0) {  // (3: h, all heads)
    return tensor_view<float>(buf.data() + k * h * d + first_head * d, {b, heads, n, d},
                              {std::ptrdiff_t(n * 4 * h * d), std::ptrdiff_t(d), std::ptrdiff_t(4 * h * d), 1});
  };
  CHECK(may_share_memory(slot(0), slot(0)));
  for (std::size_t x = 0; x < 4; ++x)
    for (std::size_t y = 0; y < 4; ++y) CHECK(may_share_memory(slot(x), slot(y)) == (x == y));  // interleaved, no element shared
  CHECK(!may_share_memory(slot(1, 1, 0), slot(1, 2, 1)));  // head 0 against heads 1 and 2 of one slot
  CHECK(may_share_memory(slot(1, 2, 0), slot(1, 2, 1)));   // heads 0–1 against 1–2: head 1 in both
  // one element of the output's last row and head: in slot 3 only
  tensor_view<float> one(buf.data() + buf.size() - 1, {1, 1, 1, 1});
  CHECK(may_share_memory(slot(3), one));
  CHECK(!may_share_memory(slot(2), one));
  // a row-major [B, H, N, D] view of the same buffer reaches all of it
  tensor_view<float> dense(buf.data(), {b, 4 * h, n, d});
  CHECK(may_share_memory(dense, slot(2)));
  // empty, or no memory: none
  CHECK(!may_share_memory(tensor_view<float>(buf.data(), {0, h, n, d}), dense));
  CHECK(!may_share_memory(tensor_view<float>(nullptr, {b, h, n, d}), tensor_view<float>(nullptr, {b, h, n, d})));
  // a reversed view (negative stride) reaches down from its first element; a zero
  // stride (a broadcast head) reaches one head's memory
  tensor_view<float> reversed(buf.data() + 9, {1, 1, 10, 1}, {0, 0, -1, 0});
  CHECK(may_share_memory(reversed, tensor_view<float>(buf.data(), {1, 1, 1, 1})));
  CHECK(!may_share_memory(reversed, tensor_view<float>(buf.data() + 10, {1, 1, 1, 1})));
  tensor_view<float> broadcast(buf.data(), {1, 8, n, d}, {0, 0, std::ptrdiff_t(4 * h * d), 1});
  CHECK(may_share_memory(broadcast, slot(0, 1)));
  CHECK(!may_share_memory(broadcast, slot(0, 2, 1)));
}

// Never "no" where two views share an element: random shapes and strides
// (negative, zero, overlapping) over one small buffer, against the sets of
// elements each view reaches.
TEST_CASE("may_share_memory: never false where two random views share an element") {
  test::rng r{77};
  std::vector<float> buf(1024);
  auto make = [&] {
    shape4 s{};
    strides4 st{};
    std::ptrdiff_t low = 0;
    for (int d = 0; d < 4; ++d) {
      s[d] = r.in(0, 3) == 0 ? 1 : r.in(1, 4);
      st[d] = static_cast<std::ptrdiff_t>(r.in(0, 40)) - 20;
      low += std::min<std::ptrdiff_t>(0, (static_cast<std::ptrdiff_t>(s[d]) - 1) * st[d]);
    }
    return tensor_view<float>(buf.data() - low + static_cast<std::ptrdiff_t>(r.in(0, 200)), s, st);
  };
  auto elements = [](tensor_view<float> v) {
    std::vector<float*> e;
    for (std::size_t i = 0; i < v.shape()[0]; ++i)
      for (std::size_t j = 0; j < v.shape()[1]; ++j)
        for (std::size_t k = 0; k < v.shape()[2]; ++k)
          for (std::size_t l = 0; l < v.shape()[3]; ++l) e.push_back(&v(i, j, k, l));
    std::sort(e.begin(), e.end());
    return e;
  };
  int shared = 0;
  for (int t = 0; t < test::trials(3000); ++t) {
    auto const a = make(), b = make();
    auto const ea = elements(a), eb = elements(b);
    std::vector<float*> both;
    std::set_intersection(ea.begin(), ea.end(), eb.begin(), eb.end(), std::back_inserter(both));
    CAPTURE(t);
    if (!both.empty()) CHECK(detail::may_share_memory(a, b));
    shared += !both.empty();
  }
  CHECK(shared > 0);
}

// An output view that reaches one element twice (a zero or an overlapping
// stride) would get two results there, written by two threads: alias_error,
// with the view's shape and strides, before anything is written.
TEST_CASE("an output view that reaches an element twice is an alias_error") {
  using detail::overlaps_itself;
  std::vector<float> buf(2 * 3 * 10 * 4);
  CHECK(!overlaps_itself(tensor_view<float>(buf.data(), {2, 3, 10, 4})));
  CHECK(!overlaps_itself(tensor_view<float>(buf.data(), {2, 3, 10, 4}, {120, 4, 12, 1})));  // [B, N, H, D]
  CHECK(!overlaps_itself(tensor_view<float>(buf.data() + 39, {1, 1, 10, 4}, {0, 0, -4, -1})));  // reversed
  CHECK(!overlaps_itself(tensor_view<float>(buf.data(), {1, 1, 10, 1}, {0, 0, 4, 7})));  // one column: its stride unused
  CHECK(overlaps_itself(tensor_view<float>(buf.data(), {2, 3, 10, 4}, {120, 0, 12, 1})));  // heads on one another
  CHECK(!overlaps_itself(tensor_view<float>(buf.data(), {2, 3, 0, 4}, {0, 0, 4, 1})));  // empty: no element at all
  CHECK(overlaps_itself(tensor_view<float>(buf.data(), {2, 3, 10, 4}, {120, 40, 2, 1})));  // rows overlapping
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 3);
  std::vector<float> out(30, -7.f);
  tensor_view<float> heads_shared(out.data(), {1, 2, 10, 3}, {30, 0, 3, 1});
  try {
    cpu::evaluate_into(compile(attn), heads_shared, Q = q, K = q, V = v);
    FAIL("no alias_error");
  } catch (alias_error const& e) {
    CHECK(std::string(e.what()) == "lina::alias_error: an output view (shape [1, 2, 10, 3], strides [30, 0, 3, 1]) "
                                   "reaches some of its elements twice: give each element memory of its own");
  }
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.f; }));
}
