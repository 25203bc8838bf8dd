// Quadratic plans in blocks of query rows (lina/cpu/row_blocks.hpp): the
// fast path runs a softmax or quadratic plan's forward, and a softmax plan's
// backward, a block of Q's rows at a time, reading only the keys up to the
// block's last row under a mask (the backward adding up the blocks' ∂K, ∂V
// and ∂W); the simple path, its
// oracle, runs it whole (and the fast path does, in one block: the forward's
// bits). Both in one process, over signed inputs, strided [B,N,H,D] views,
// N = 0, 1, around and past the block, and block heights that divide nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "cpu_props.hpp"

using namespace lina;
using namespace test::cpu_props;

namespace {
constexpr auto W = input<"W">(D, dim<"m">);

struct restore {  // the path and the block height, as they were
  cpu::path was = cpu::current_path();
  ~restore() {
    cpu::use_path(was);
    cpu::use_block_rows(0);
  }
};

// The plan on both paths, at block heights 1, 7, 16 and the automatic one
// (whole below 513 rows: one long sequence too), against the whole plan.
template <class T, class Plan, class Bind>
void blocks_agree_with_whole(Plan const& plan, std::uint64_t seed, Bind const& bind) {
  static_assert(cpu::row_blocks::eligible<Plan>(), "the plan runs in blocks");
  restore guard;
  test::rng r{seed};
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(6), std::size_t(16), std::size_t(17),
                        std::size_t(90), test::length(r), std::size_t(1100)}) {
    std::size_t b = r.in(1, 2), h = n > 200 ? 1 : r.in(1, 3), d = r.in(1, 20), m = r.in(1, 20);
    CONTEXT(n, b, h, d, m);
    auto q = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next())), k = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next()));
    auto v = bnhd_copy(tensor<T>::random({b, h, n, m}, r.next()));
    auto w = tensor<T>::random({b, h, d, 12}, r.next());
    auto run = [&] { return bind(plan, q.view(), k.view(), v.view(), w.view()); };
    cpu::use_path(cpu::path::simple);
    auto const whole = run();
    cpu::use_path(cpu::path::fast);
    cpu::use_block_rows(n + 1);  // one block: the fast path's whole plan
    auto const whole_fast = run();
    double const bound = test::rounding_bound<T>(double(4 * n * d + 1), 1 + test::max_abs(whole));
    for (std::size_t rows : {1u, 7u, 16u, 0u}) {
      CONTEXT(rows);
      cpu::use_block_rows(rows);
      auto const got = run();
      CHECK(got.shape() == whole.shape());
      CHECK(max_abs_diff(got, whole) <= bound);
      // the same sums in the same order: every score, exp and product term of
      // a block is the whole plan's, and a product's terms past the diagonal
      // are skipped in both
      CHECK(max_abs_diff(got, whole_fast) == 0);
    }
  }
}

auto qkv = [](auto const& plan, auto q, auto k, auto v, auto) { return cpu::evaluate(plan, Q = q, K = k, V = v); };
auto qkvw = [](auto const& plan, auto q, auto k, auto v, auto w) {
  return cpu::evaluate(plan, Q = q, K = k, V = v, W = w);
};
}  // namespace

TEST_CASE_TEMPLATE("softmax in blocks of query rows = softmax whole: causal, not, scores past exp's range", T, float,
                   double) {
  // (scores up to 8·d: rows whose exp overflows, shifted by their largest element)
  blocks_agree_with_whole<T>(compile(normalize(causal(exp(8.0 * (Q * transpose(K))))) * V), 1, qkv);
  blocks_agree_with_whole<T>(compile(normalize(exp(0.5 * (Q * transpose(K)))) * V), 2, qkv);
  // a decay per head: the mask's distance i − j from the block's diagonal
  auto decays = head_decays{std::vector<double>{0.9, 0.99, 0.5}};
  auto retention = causal(Q * transpose(K), decays) * V;
  restore guard;
  test::rng r{3};
  for (std::size_t n : {std::size_t(40), std::size_t(700)}) {
    auto q = tensor<T>::random({1, 3, n, 8}, r.next()), k = tensor<T>::random({1, 3, n, 8}, r.next()),
         v = tensor<T>::random({1, 3, n, 5}, r.next());
    cpu::use_path(cpu::path::simple);
    auto const whole = cpu::evaluate(compile<order::quadratic>(retention), Q = q, K = k, V = v);
    cpu::use_path(cpu::path::fast);
    cpu::use_block_rows(n == 40 ? 9 : 0);
    auto const got = cpu::evaluate(compile<order::quadratic>(retention), Q = q, K = k, V = v);
    CHECK(max_abs_diff(got, whole) <= test::rounding_bound<T>(double(4 * n * 8 + 1), 1 + test::max_abs(whole)));
  }
}

TEST_CASE_TEMPLATE("quadratic linear attention in blocks of query rows = whole: elu+1, poly2, FAVOR+", T, float, double) {
  auto causal_elu = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  blocks_agree_with_whole<T>(compile<order::quadratic>(causal_elu), 4, qkv);
  blocks_agree_with_whole<T>(compile<order::quadratic>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V), 5, qkv);
  auto favor_full = normalize(phi<favor>(Q, W) * transpose(phi<favor>(K, W))) * V;
  blocks_agree_with_whole<T>(compile<order::quadratic>(favor_full), 6, qkvw);
}

namespace {
// The gradients of the plan in blocks (heights 1, 7, 16, automatic) against
// the whole plan's on both paths, into [B,N,H,D] views through gradient_into;
// the gradients of inputs read as queries are the whole fast plan's bits (each
// row's sums are the whole plan's), the sums over blocks (∂K, ∂V, ∂W) agree to
// rounding. Returns the largest temporary of the automatic height at the last N.
template <class T, bool with_w = false, class Plan>
std::size_t gradient_blocks_agree_with_whole(Plan const& plan, std::uint64_t seed) {
  static_assert(cpu::row_blocks::eligible<Plan>(), "the plan runs in blocks");
  restore guard;
  test::rng r{seed};
  std::size_t largest = 0;
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(17), test::length(r), std::size_t(1100)}) {
    std::size_t b = r.in(1, 2), h = n > 200 ? 1 : r.in(1, 3), d = r.in(1, 12), m = r.in(1, 12);
    CONTEXT(n, b, h, d, m);
    auto q = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next())), k = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next()));
    auto v = bnhd_copy(tensor<T>::random({b, h, n, m}, r.next())), dout = bnhd_copy(tensor<T>::random({b, h, n, m}, r.next()));
    auto w = tensor<T>::random({b, h, d, 12}, r.next());
    auto run = [&] {
      auto g = cpu::gradient_views<T>(plan);
      auto dq = bnhd_copy(tensor<T>({b, h, n, d})), dk = dq, dv = bnhd_copy(tensor<T>({b, h, n, m}));
      tensor<T> dw({b, h, d, 12});
      g[Q] = dq.view(), g[K] = dk.view(), g[V] = dv.view();
      if constexpr (with_w) {
        g[W] = dw.view();
        cpu::gradient_into(plan, g, dout.view(), Q = q.view(), K = k.view(), V = v.view(), W = w.view());
      } else {
        cpu::gradient_into(plan, g, dout.view(), Q = q.view(), K = k.view(), V = v.view());
      }
      std::vector<tensor<T>> out;
      for (auto* x : {&dq, &dk, &dv}) {
        tensor<T> t({b, h, n, x->shape[3]});
        for_each_index(t.shape(), [&](auto... i) { t(i...) = x->view()(i...); });
        out.push_back(std::move(t));
      }
      if constexpr (with_w) out.push_back(std::move(dw));
      return out;
    };
    cpu::use_path(cpu::path::simple);
    auto const whole = run();
    cpu::use_path(cpu::path::fast);
    cpu::use_block_rows(n + 1);  // one block: the fast path's whole plan
    auto const whole_fast = run();
    for (std::size_t rows : {1u, 7u, 16u, 0u}) {
      if (rows == 1 && n > 100) continue;  // (a block is a backward call: 1100 of them under the sanitizers)
      CONTEXT(rows);
      cpu::use_block_rows(rows);
      cpu::release_cached_memory();
      cpu::memory().reset();
      auto const got = run();
      largest = cpu::memory().largest;
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);  // ∂Q, ∂K, ∂V, ∂W
        double const bound = test::rounding_bound<T>(double(8 * n * (d + m) + 1), 1 + test::max_abs(whole[i]));
        CHECK(max_abs_diff(got[i], whole[i]) <= bound);
        if (i == 0)
          CHECK(max_abs_diff(got[i], whole_fast[i]) == 0);
        else
          CHECK(max_abs_diff(got[i], whole_fast[i]) <= bound);
      }
    }
  }
  return largest;
}
}  // namespace

TEST_CASE_TEMPLATE("gradients in blocks of query rows = whole: softmax causal and not, decayed, projected", T, float,
                   double) {
  std::size_t const n = 1100, rows = cpu::row_blocks::rows_per_block(n);
  // (the largest temporary in blocks: a block's rows x N, where the whole backward's is N x N)
  std::size_t const largest =
      gradient_blocks_agree_with_whole<T>(compile(normalize(causal(exp(2.0 * (Q * transpose(K))))) * V), 21);
  CHECK(largest <= rows * n * sizeof(T));
  CHECK(largest < n * n * sizeof(T) / 2);
  gradient_blocks_agree_with_whole<T>(compile(normalize(exp(0.5 * (Q * transpose(K)))) * V), 22);
  gradient_blocks_agree_with_whole<T>(compile(normalize(causal(exp(Q * transpose(K)), decay{0.8})) * V), 23);
  // Q and K through a map with W (D x m): ∂W, a sum over the blocks of both sides' shares
  auto const favor_scores = phi<favor>(Q, W) * transpose(phi<favor>(K, W));
  gradient_blocks_agree_with_whole<T, true>(compile(normalize(causal(exp(favor_scores))) * V), 24);
}

TEST_CASE("a quadratic order of linear attention differentiates whole (its linear order is the O(N) one)") {
  // (no exp: the blocks' backward is not compiled for it; the forward still runs in blocks)
  restore guard;
  cpu::use_path(cpu::path::fast);
  auto const plan = compile<order::quadratic>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  std::size_t const n = 600;
  auto q = tensor<float>::random({1, 1, n, 8}, 40), k = tensor<float>::random({1, 1, n, 8}, 41),
       v = tensor<float>::random({1, 1, n, 8}, 42), dout = tensor<float>::random({1, 1, n, 8}, 43);
  cpu::use_block_rows(64);
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto const g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  CHECK(cpu::memory().largest == n * n * sizeof(float));
}

TEST_CASE("gradients in blocks: NaN where the whole plan puts it, a gradient over an input runs whole") {
  restore guard;
  auto const plan = compile(normalize(causal(exp(Q * transpose(K)))) * V);
  std::size_t const n = 50;
  auto q = tensor<double>::random({1, 2, n, 6}, 30), k = tensor<double>::random({1, 2, n, 6}, 31),
       v = tensor<double>::random({1, 2, n, 6}, 32), dout = tensor<double>::random({1, 2, n, 6}, 33);
  v(0, 1, 20, 3) = std::numeric_limits<double>::quiet_NaN();  // every row from 20 on reads it
  // (against the fast path whole, which skips the masked terms as the blocks
  // do; the simple path multiplies them out, 0 · NaN, into rows before 20 too)
  cpu::use_path(cpu::path::fast);
  cpu::use_block_rows(n + 1);
  auto const whole = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  cpu::use_block_rows(8);
  auto const got = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(h);
      CAPTURE(i);
      CHECK(std::isnan(got[Q](0, h, i, 0)) == std::isnan(whole[Q](0, h, i, 0)));
      // (rows from 20 read it; a row before may meet it as 0 · NaN where a
      // product's tile crosses the diagonal: as the whole plan's tiles do)
      if (h == 0 || i >= 20) CHECK(std::isnan(got[Q](0, h, i, 0)) == (h == 1));
      CHECK(std::isnan(got[K](0, h, i, 0)) == std::isnan(whole[K](0, h, i, 0)));
      CHECK(std::isnan(got[V](0, h, i, 3)) == std::isnan(whole[V](0, h, i, 3)));
    }
  v(0, 1, 20, 3) = 0.5;
  auto const want = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  // ∂V written over dout, which every block reads: the plan runs whole
  auto into = cpu::gradient_views<double>(plan);
  auto dq = tensor<double>({1, 2, n, 6}), dk = dq, d2 = dout;
  into[Q] = dq.view(), into[K] = dk.view(), into[V] = d2.view();
  cpu::gradient_into(plan, into, d2.view(), Q = q, K = k, V = v);
  CHECK(max_abs_diff(dq, want[Q]) == 0);
  CHECK(max_abs_diff(d2, want[V]) <= 1e-12);
}

TEST_CASE("a static sequence length runs in blocks too (its block plan's rows are dimensions of their own)") {
  constexpr auto Ns = dim<"N", 300>;
  constexpr auto Qs = input<"Q">(Ns, D);
  constexpr auto Ks = input<"K">(Ns, D);
  constexpr auto Vs = input<"V">(Ns, M);
  auto const plan = compile(normalize(causal(exp(Qs * transpose(Ks)))) * Vs);
  static_assert(cpu::row_blocks::eligible<decltype(plan)>());
  restore guard;
  auto q = tensor<double>::random({2, 1, 300, 5}, 13), k = tensor<double>::random({2, 1, 300, 5}, 14),
       v = tensor<double>::random({2, 1, 300, 4}, 15);
  cpu::use_path(cpu::path::fast);
  auto const whole = cpu::evaluate(plan, Q = q, K = k, V = v);
  cpu::use_block_rows(64);
  CHECK(max_abs_diff(cpu::evaluate(plan, Q = q, K = k, V = v), whole) == 0);
}

TEST_CASE("which plans run in blocks") {
  using cpu::row_blocks::eligible;
  constexpr auto X = input<"X">(N, D);
  constexpr auto S = Q * transpose(K);
  static_assert(eligible<decltype(compile(normalize(causal(exp(S))) * V))>());
  static_assert(eligible<decltype(compile<order::quadratic>(causal(S) * V))>());
  // a linear plan has no N x N step to cut
  constexpr auto F = phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K));
  static_assert(!eligible<decltype(compile<order::linear>(normalize(causal(F)) * V))>());
  // one input read as queries and as keys: its rows would be two dimensions
  static_assert(!eligible<decltype(compile<order::quadratic>(causal(X * transpose(X)) * X))>());
  // a normaliser before the mask sums keys past the diagonal: cut, they would be lost
  static_assert(!eligible<decltype(compile(causal(normalize(exp(S))) * V))>());
  // which the whole plan still runs right
  restore guard;
  cpu::use_path(cpu::path::fast);
  cpu::use_block_rows(5);
  auto q = tensor<float>::random({1, 2, 30, 4}, 7), k = tensor<float>::random({1, 2, 30, 4}, 8),
       v = tensor<float>::random({1, 2, 30, 3}, 9);
  auto const plan = compile(causal(normalize(exp(S))) * V);
  auto const got = cpu::evaluate(plan, Q = q, K = k, V = v);
  cpu::use_path(cpu::path::simple);
  CHECK(max_abs_diff(got, cpu::evaluate(plan, Q = q, K = k, V = v)) <= 1e-5);
}

TEST_CASE("blocks of query rows: NaN stays where the whole plan puts it, an output over an input runs whole") {
  restore guard;
  auto const plan = compile(normalize(causal(exp(Q * transpose(K)))) * V);
  std::size_t const n = 50;
  auto q = tensor<float>::random({1, 2, n, 6}, 10), k = tensor<float>::random({1, 2, n, 6}, 11),
       v = tensor<float>::random({1, 2, n, 6}, 12);
  k(0, 1, 20, 3) = std::numeric_limits<float>::quiet_NaN();  // every row from 20 on reads it
  cpu::use_path(cpu::path::simple);
  auto const whole = cpu::evaluate(plan, Q = q, K = k, V = v);
  cpu::use_path(cpu::path::fast);
  cpu::use_block_rows(8);
  auto const got = cpu::evaluate(plan, Q = q, K = k, V = v);
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(h);
      CAPTURE(i);
      CHECK(std::isnan(got(0, h, i, 0)) == (h == 1 && i >= 20));
      CHECK(std::isnan(whole(0, h, i, 0)) == std::isnan(got(0, h, i, 0)));
    }
  k(0, 1, 20, 3) = 0.5f;
  auto const want = cpu::evaluate(plan, Q = q, K = k, V = v);
  // into a [B,N,H,M] output through strides, in blocks
  auto into = bnhd_copy(tensor<float>({1, 2, n, 6}));
  cpu::evaluate_into(plan, into.view(), Q = q, K = k, V = v);
  CHECK(max_abs_diff(into.view(), want) == 0);
  // the output written over V, which every block reads: the plan runs whole
  auto v2 = v;
  cpu::evaluate_into(plan, v2.view(), Q = q, K = k, V = v2);
  CHECK(max_abs_diff(v2, want) == 0);
}
