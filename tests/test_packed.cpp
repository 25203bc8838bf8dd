// Packed sequences (lina/sequences.hpp): sequences of different lengths laid
// end to end in one batch row, each attended to on its own. The oracle of
// every property is each sequence copied out into a tensor of its own and
// evaluated alone; packing must change nothing, bit for bit (every sequence
// here is shorter than the CPU's split of one sequence across threads, 2048
// rows, the one thing that could reorder its sums).
#include <doctest/doctest.h>

#include <cmath>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <stdexcept>
#include <vector>

#include "support.hpp"

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto F = dim<"F">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto W = input<"W">(D, F);
constexpr auto causal_attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
constexpr auto full_attn = normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V;
constexpr auto decayed_attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V;
constexpr auto favor_attn = normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V;

// Random lengths, some 0 and 1, summing to the packed rows.
std::vector<std::size_t> random_lengths(test::rng& r, std::size_t count) {
  std::vector<std::size_t> n(count);
  for (auto& x : n) {
    switch (r.next() % 5) {
      case 0: x = r.in(0, 1); break;
      default: x = test::length(r) / 2; break;
    }
  }
  return n;
}

// A packed [1, H, T, cols] tensor, stored [1, H, T, cols] or as a [1, T, H, cols] layout.
template <class T>
tensor<T> packed_random(std::size_t heads, std::size_t total, std::size_t cols, bool tokens_outer, std::uint64_t seed) {
  auto dense = tensor<T>::random({1, heads, total, cols}, seed);
  if (!tokens_outer) return dense;
  tensor_view<T const> bnhd(nullptr, {1, heads, total, cols},
                            {static_cast<std::ptrdiff_t>(total * heads * cols), static_cast<std::ptrdiff_t>(cols),
                             static_cast<std::ptrdiff_t>(heads * cols), 1});
  auto t = tensor<T>::like(bnhd);
  for (std::size_t h = 0; h < heads; ++h)
    for (std::size_t n = 0; n < total; ++n)
      for (std::size_t c = 0; c < cols; ++c) t(0, h, n, c) = dense(0, h, n, c);
  return t;
}

// Sequence s of a packed tensor, copied into a [1, H, n, cols] tensor of its own.
template <class T, class X>
tensor<T> copy_rows(X const& x, sequences const& seqs, std::size_t s) {
  auto v = view_of(x);
  tensor<T> t({1, v.shape()[1], seqs.length(s), v.shape()[3]});
  for (std::size_t h = 0; h < v.shape()[1]; ++h)
    for (std::size_t n = 0; n < seqs.length(s); ++n)
      for (std::size_t c = 0; c < v.shape()[3]; ++c) t(0, h, n, c) = v(0, h, seqs.begin(s) + n, c);
  return t;
}

// `count` sequences of random lengths, each cut at a random point into two
// packed blocks a and b, and random H, D, M.
struct blocks {
  sequences a, b;
  std::size_t h, d, m;
};
blocks two_blocks(test::rng& r, std::size_t count) {
  auto const lengths = random_lengths(r, count);
  std::vector<std::size_t> first(count), second(count);
  for (std::size_t s = 0; s < count; ++s) {
    first[s] = r.in(0, lengths[s]);
    second[s] = lengths[s] - first[s];
  }
  blocks x{sequences::from_lengths(first), sequences::from_lengths(second), 0, 0, 0};
  x.h = r.in(1, 3), x.d = r.in(1, 16), x.m = r.in(1, 16);
  return x;
}

// Rows of sequence s of a packed result equal `alone`, exactly.
template <class T, class X>
bool rows_equal(X const& packed, tensor<T> const& alone, sequences const& seqs, std::size_t s) {
  return max_abs_diff(copy_rows<T>(packed, seqs, s), alone) == 0;
}

}  // namespace

TEST_CASE_TEMPLATE("packed sequences: each evaluates as it would alone, in either layout", T, float, double) {
  test::rng r{71};
  for (int trial = 0; trial < test::trials(12); ++trial) {
    // trial 0 has many sequences (the threads share them); the rest, a few.
    std::size_t const count = trial == 0 ? 13 : r.in(0, 5);
    auto const seqs = sequences::from_lengths(random_lengths(r, count));
    std::size_t const h = r.in(1, 3), d = r.in(1, 24), m = r.in(1, 20);
    bool const tokens_outer = trial % 2 == 1;
    CAPTURE(trial);
    CAPTURE(seqs.total());
    auto q = packed_random<T>(h, seqs.total(), d, tokens_outer, r.next());
    auto k = packed_random<T>(h, seqs.total(), d, tokens_outer, r.next());
    auto v = packed_random<T>(h, seqs.total(), m, tokens_outer, r.next());
    auto const causal_plan = compile(causal_attn);  // a select on N: each sequence picks its own order
    auto const full_plan = compile(full_attn);
    auto yc = cpu::evaluate(causal_plan, seqs, Q = q, K = k, V = v);
    auto yf = tensor<T>::like(v.view());  // into caller memory of the inputs' layout
    cpu::evaluate_into(full_plan, yf.view(), seqs, Q = q, K = k, V = v);
    auto const decayed_plan = compile(decayed_attn);  // each sequence's state starts undecayed from zero
    auto yd = cpu::evaluate(decayed_plan, seqs, Q = q, K = k, V = v);
    std::vector<double> g(h);  // and a decay per head
    for (auto& x : g) x = 1 - std::ldexp(1.0, -static_cast<int>(r.in(1, 6)));
    auto const per_head_plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), head_decays(g))) * V);
    auto yh = cpu::evaluate(per_head_plan, seqs, Q = q, K = k, V = v);
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      auto qs = copy_rows<T>(q, seqs, s), ks = copy_rows<T>(k, seqs, s), vs = copy_rows<T>(v, seqs, s);
      CHECK(rows_equal(yc, cpu::evaluate(causal_plan, Q = qs, K = ks, V = vs), seqs, s));
      CHECK(rows_equal(yf, cpu::evaluate(full_plan, Q = qs, K = ks, V = vs), seqs, s));
      CHECK(rows_equal(yd, cpu::evaluate(decayed_plan, Q = qs, K = ks, V = vs), seqs, s));
      CHECK(rows_equal(yh, cpu::evaluate(per_head_plan, Q = qs, K = ks, V = vs), seqs, s));
      // and against attention from its definition (double), so that the
      // cutting is checked by something that does not cut
      auto ref = test::reference_attention(qs, ks, vs, [](double x) { return elu_plus_one::value(x); }, true, true);
      CHECK(max_abs_diff(copy_rows<double>(yc, seqs, s), ref) <=
            test::rounding_bound<T>(static_cast<double>(seqs.length(s) * d), 1 + test::max_abs(ref)));
    }
  }
}

TEST_CASE_TEMPLATE("packed sequences: chained blocks carry one state per sequence", T, float, double) {
  test::rng r{72};
  for (int trial = 0; trial < test::trials(8); ++trial) {
    std::size_t const count = trial == 0 ? 12 : r.in(1, 5);
    auto const blk = two_blocks(r, count);
    auto const &a = blk.a, &b = blk.b;
    std::size_t const h = blk.h, d = blk.d, m = blk.m;
    CAPTURE(trial);
    auto qa = packed_random<T>(h, a.total(), d, false, r.next()), qb = packed_random<T>(h, b.total(), d, false, r.next());
    auto ka = packed_random<T>(h, a.total(), d, false, r.next()), kb = packed_random<T>(h, b.total(), d, false, r.next());
    auto va = packed_random<T>(h, a.total(), m, false, r.next()), vb = packed_random<T>(h, b.total(), m, false, r.next());
    auto const plan = compile(causal_attn);
    cpu::state<T> st;
    auto ya = cpu::evaluate(plan, st, a, Q = qa, K = ka, V = va);
    auto yb = cpu::evaluate(plan, st, b, Q = qb, K = kb, V = vb);
    REQUIRE(st.batch() == count);
    // Then one decoding step of every sequence from its own position: the
    // packed prompts' state handed to a recurrent of `count` sequences.
    auto rnn = cpu::recurrent<T>(plan, count, h);
    rnn.set_state(st);
    auto token = [&](std::size_t cols) { return tensor<T>::random({count, h, 1, cols}, r.next()); };
    auto qt = token(d), kt = token(d), vt = token(m);
    auto yt = rnn.step(Q = qt, K = kt, V = vt);
    auto row = [](tensor<T> const& x, std::size_t s) {  // batch row s, [1, H, 1, cols]
      tensor<T> one({1, x.shape()[1], 1, x.shape()[3]});
      for_each_index(one.shape(), [&](std::size_t, std::size_t hh, std::size_t, std::size_t c) { one(0, hh, 0, c) = x(s, hh, 0, c); });
      return one;
    };
    for (std::size_t s = 0; s < count; ++s) {
      CAPTURE(s);
      cpu::state<T> alone;  // the same two blocks of sequence s, alone
      auto y1 = cpu::evaluate(plan, alone, Q = copy_rows<T>(qa, a, s), K = copy_rows<T>(ka, a, s), V = copy_rows<T>(va, a, s));
      auto y2 = cpu::evaluate(plan, alone, Q = copy_rows<T>(qb, b, s), K = copy_rows<T>(kb, b, s), V = copy_rows<T>(vb, b, s));
      CHECK(rows_equal(ya, y1, a, s));
      CHECK(rows_equal(yb, y2, b, s));
      auto const& sums = alone[0];
      auto const& all = std::as_const(st)[0];
      double diff = 0;
      for (std::size_t hh = 0; hh < h; ++hh)
        for (std::size_t i = 0; i < sums.shape()[2]; ++i)
          for (std::size_t j = 0; j < sums.shape()[3]; ++j) diff = std::max(diff, std::abs(double(sums(0, hh, i, j)) - double(all(s, hh, i, j))));
      CHECK(diff == 0);
      CHECK(alone.rows(0, 0) == a.length(s) + b.length(s));  // the rows each sequence's sums hold
      CHECK(st.rows(0, s) == alone.rows(0, 0));
      auto solo = cpu::recurrent<T>(plan, 1, h);
      solo.set_state(std::move(alone));
      CHECK(max_abs_diff(solo.step(Q = row(qt, s), K = row(kt, s), V = row(vt, s)), row(yt, s)) == 0);
    }
  }
}

// The chained backward of packed blocks: the second block differentiated from
// the state rows the first left, then the first from the ∂ rows the second
// handed back — each sequence's gradients and ∂ state rows are those of its two
// blocks differentiated alone, bit for bit.
TEST_CASE("packed sequences: chained blocks differentiated last first, a state row per sequence") {
  test::rng r{74};
  for (int trial = 0; trial < test::trials(4); ++trial) {
    std::size_t const count = trial == 0 ? 9 : r.in(1, 5);
    auto const blk = two_blocks(r, count);
    auto const &a = blk.a, &b = blk.b;
    std::size_t const h = blk.h, d = blk.d, m = blk.m;
    CAPTURE(trial);
    auto x = [&](sequences const& p, std::size_t cols) { return packed_random<double>(h, p.total(), cols, false, r.next()); };
    auto qa = x(a, d), ka = x(a, d), va = x(a, m), da = x(a, m), qb = x(b, d), kb = x(b, d), vb = x(b, m), db = x(b, m);
    auto const plan = compile(causal_attn);
    cpu::state<double> st, none;
    (void)cpu::evaluate(plan, st, a, Q = qa, K = ka, V = va);
    auto [gb, dsa] = cpu::gradient(plan, db, st, none, b, Q = qb, K = kb, V = vb);
    auto [ga, ds0] = cpu::gradient(plan, da, none, dsa, a, Q = qa, K = ka, V = va);
    REQUIRE(ds0.batch() == count);
    for (std::size_t s = 0; s < count; ++s) {
      CAPTURE(s);
      cpu::state<double> s1, zero;  // sequence s's two blocks alone
      (void)cpu::evaluate(plan, s1, Q = copy_rows<double>(qa, a, s), K = copy_rows<double>(ka, a, s), V = copy_rows<double>(va, a, s));
      auto [g2, d1] = cpu::gradient(plan, copy_rows<double>(db, b, s), s1, zero, Q = copy_rows<double>(qb, b, s),
                                    K = copy_rows<double>(kb, b, s), V = copy_rows<double>(vb, b, s));
      auto [g1, d0] = cpu::gradient(plan, copy_rows<double>(da, a, s), zero, d1, Q = copy_rows<double>(qa, a, s),
                                    K = copy_rows<double>(ka, a, s), V = copy_rows<double>(va, a, s));
      CHECK(rows_equal(gb[Q], g2[Q], b, s));
      CHECK(rows_equal(gb[K], g2[K], b, s));
      CHECK(rows_equal(gb[V], g2[V], b, s));
      CHECK(rows_equal(ga[Q], g1[Q], a, s));
      CHECK(rows_equal(ga[K], g1[K], a, s));
      CHECK(rows_equal(ga[V], g1[V], a, s));
      double diff = 0;
      auto same_row = [&](cpu::state<double> const& all, cpu::state<double> const& alone) {
        for_each_index(alone[0].shape(), [&](std::size_t, std::size_t hh, std::size_t i, std::size_t j) {
          diff = std::max(diff, std::abs(all[0](s, hh, i, j) - alone[0](0, hh, i, j)));
        });
      };
      same_row(dsa, d1), same_row(ds0, d0);
      CHECK(diff == 0);
    }
  }
  // state rows for another number of sequences: a shape_error
  auto const seqs = sequences::from_lengths({3, 4});
  auto q = tensor<float>::random({1, 2, 7, 4}, 1), v = tensor<float>::random({1, 2, 7, 3}, 2);
  cpu::state<float> three, none;
  (void)cpu::evaluate(compile(causal_attn), three, sequences::from_lengths({2, 2, 3}), Q = q, K = q, V = v);
  test::expect_shape_error([&] { (void)cpu::gradient(compile(causal_attn), v, three, none, seqs, Q = q, K = q, V = v); },
                           "Q", "sequences (of packed sequences)", 2, 3);
}

TEST_CASE("packed sequences: gradients are each sequence's, and a shared projection's sum them") {
  test::rng r{73};
  for (int trial = 0; trial < test::trials(6); ++trial) {
    std::size_t const count = trial == 0 ? 12 : r.in(0, 4);
    auto const seqs = sequences::from_lengths(random_lengths(r, count));
    std::size_t const h = r.in(1, 2), d = r.in(1, 8), m = r.in(1, 8), f = r.in(1, 8);
    CAPTURE(trial);
    auto q = packed_random<double>(h, seqs.total(), d, trial % 2 == 1, r.next());
    auto k = packed_random<double>(h, seqs.total(), d, trial % 2 == 1, r.next());
    auto v = packed_random<double>(h, seqs.total(), m, trial % 2 == 1, r.next());
    auto w = tensor<double>::random({1, h, d, f}, r.next());
    auto dout = packed_random<double>(h, seqs.total(), m, false, r.next());
    auto const plan = compile<order::linear>(favor_attn);
    auto const g = cpu::gradient(plan, dout, seqs, Q = q, K = k, V = v, W = w);
    auto into = cpu::gradient_views<double>(plan);  // the same into caller views
    auto dq = tensor<double>::like(q.view()), dk = tensor<double>::like(k.view()), dv = tensor<double>::like(v.view());
    auto dw = tensor<double>::like(w.view());
    into[Q] = dq.view(), into[K] = dk.view(), into[V] = dv.view(), into[W] = dw.view();
    cpu::gradient_into(plan, into, dout, seqs, Q = q, K = k, V = v, W = w);
    tensor<double> dw_sum({1, h, d, f});
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      auto const gs = cpu::gradient(plan, copy_rows<double>(dout, seqs, s), Q = copy_rows<double>(q, seqs, s),
                                    K = copy_rows<double>(k, seqs, s), V = copy_rows<double>(v, seqs, s), W = w);
      CHECK(rows_equal(g[Q], gs[Q], seqs, s));
      CHECK(rows_equal(g[K], gs[K], seqs, s));
      CHECK(rows_equal(g[V], gs[V], seqs, s));
      for (std::size_t i = 0; i < dw_sum.size(); ++i) dw_sum.data()[i] += gs[W].data()[i];
    }
    CHECK(max_abs_diff(g[W], dw_sum) == 0);  // summed in sequence order, as here
    CHECK(max_abs_diff(g[Q], dq) == 0);
    CHECK(max_abs_diff(g[K], dk) == 0);
    CHECK(max_abs_diff(g[V], dv) == 0);
    CHECK(max_abs_diff(g[W], dw) == 0);
  }
}

TEST_CASE("packed sequences: bad offsets and shapes are clear errors, before anything is written") {
  CHECK_THROWS_WITH_AS(sequences::from_offsets({1, 4}), doctest::Contains("the first offset must be 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(sequences::from_offsets({0, 4, 3}), doctest::Contains("offsets never decrease"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(sequences::from_lengths(std::vector<int>{3, -1}), doctest::Contains("negative"),
                       std::invalid_argument);
  auto const seqs = sequences::from_offsets(std::vector<int>{0, 3, 3, 10});  // int32, as cu_seqlens
  CHECK(seqs.count() == 3);
  CHECK(seqs.length(1) == 0);
  CHECK(seqs.total() == 10);

  auto const plan = compile(causal_attn);
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), k = tensor<float>::random({1, 2, 10, 4}, 2);
  auto v = tensor<float>::random({1, 2, 10, 3}, 3);
  auto const untouched = tensor<float>({1, 2, 10, 3}, 7.f);
  auto out = untouched;
  // the packed rows must be the sequences' total
  test::expect_shape_error([&] { cpu::evaluate_into(plan, out.view(), sequences::from_lengths({3, 6}), Q = q, K = k, V = v); },
                           "Q", "N", 10, 9);
  // packed sequences share one batch row
  auto q2 = tensor<float>::random({2, 2, 10, 4}, 1), k2 = tensor<float>::random({2, 2, 10, 4}, 2);
  auto v2 = tensor<float>::random({2, 2, 10, 3}, 3);
  test::expect_shape_error([&] { (void)cpu::evaluate(plan, seqs, Q = q2, K = k2, V = v2); }, "Q", "B (batch)", 2, 1);
  // a state made for another number of sequences
  cpu::state<float> st;
  (void)cpu::evaluate(plan, st, seqs, Q = q, K = k, V = v);
  test::expect_shape_error(
      [&] { cpu::evaluate_into(plan, out.view(), st, sequences::from_lengths({4, 6}), Q = q, K = k, V = v); }, "Q",
      "sequences (of packed sequences)", 2, 3);
  // a dout of the wrong length
  auto dout = tensor<float>::random({1, 2, 9, 3}, 4);
  test::expect_shape_error([&] { (void)cpu::gradient(plan, dout, seqs, Q = q, K = k, V = v); }, "dout", "N", 9, 10);
  CHECK(max_abs_diff(out, untouched) == 0);
}
