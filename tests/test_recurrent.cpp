// Transformers are RNNs: recurrent steps and chained blocks equal one parallel
// evaluation; states save, restore and reset; the feature-map family (poly2
// exact, favor and random Fourier features converging as m grows).
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <thread>
#include <utility>
#include <vector>

#include "heap_counter.hpp"
#include "support.hpp"

using namespace lina;
using test::tokens;
using test::softplus;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto F = dim<"F">;  // random features
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto W = input<"W">(D, F);



struct shape {
  std::size_t b, h, n, d, m;
};
shape random_shape(test::rng& r) {
  shape s{r.in(1, 2), r.in(1, 3), r.in(1, 120), r.in(1, 12), 0};
  do s.m = r.in(1, 12);
  while (s.m == s.d);
  return s;
}

// Steps and chained blocks against the quadratic plan evaluated at once.
template <class T, class Expr, class... Extra>
void check_recurrent(Expr const& expr, std::uint64_t seed, Extra const&... extra) {
  test::rng r{seed};
  for (int trial = 0; trial < 5; ++trial) {
    shape s = random_shape(r);
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next()), k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<T>::random({s.b, s.h, s.n, s.m}, r.next());
    auto ref = cpu::evaluate(compile<order::quadratic>(expr), Q = q, K = k, V = v, extra...);
    auto once = cpu::evaluate(compile<order::linear>(expr), Q = q, K = k, V = v, extra...);
    double bound = test::rounding_bound<T>(double(s.n * s.d * 4), 1.0) * (1 + test::max_abs(ref));
    CONTEXT(s.b, s.h, s.n, s.d, s.m);
    CHECK(max_abs_diff(once, ref) <= bound);

    // token by token: the same scan, so the same numbers as one linear evaluation
    auto rnn = cpu::recurrent<T>(compile(expr), s.b, s.h);
    double step_err = 0;
    for (std::size_t t = 0; t < s.n; ++t) {
      auto y = rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1), extra...);
      step_err = std::max(step_err, max_abs_diff(y, tokens(once, t, t + 1)));
    }
    CHECK(step_err == 0);

    // blocks at random boundaries, then steps continuing from the blocks' state;
    // every other block into its rows of a [B, N, H, M] output (evaluate_into)
    cpu::state<T> st;
    std::vector<T> bnhm(s.b * s.n * s.h * s.m, T(-7));
    tensor_view<T> const into(bnhm.data(), {s.b, s.h, s.n, s.m},
                                {std::ptrdiff_t(s.n * s.h * s.m), std::ptrdiff_t(s.m), std::ptrdiff_t(s.h * s.m), 1});
    std::size_t at = 0;
    for (int block = 0; at < s.n; ++block) {
      std::size_t to = std::min(s.n, at + r.in(1, 40));
      if (block % 2 == 0) {
        auto y = cpu::evaluate(compile(expr), st, Q = tokens(q, at, to), K = tokens(k, at, to), V = tokens(v, at, to), extra...);
        CHECK(max_abs_diff(y, tokens(once, at, to)) == 0);
      } else {
        auto rows = into.rows(at, to - at);
        cpu::evaluate_into(compile(expr), rows, st, Q = tokens(q, at, to), K = tokens(k, at, to), V = tokens(v, at, to), extra...);
        CHECK(max_abs_diff(rows, tokens(once, at, to)) == 0);
      }
      at = to;
    }
    std::size_t prompt = s.n / 2;
    cpu::state<T> prefill;
    cpu::evaluate(compile(expr), prefill, Q = tokens(q, 0, prompt), K = tokens(k, 0, prompt), V = tokens(v, 0, prompt), extra...);
    auto gen = cpu::recurrent<T>(compile(expr), s.b, s.h);
    gen.set_state(prefill);
    for (std::size_t t = prompt; t < s.n; ++t)
      CHECK(max_abs_diff(gen.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1), extra...),
                         tokens(once, t, t + 1)) == 0);
  }
}

template <class Map>
constexpr auto causal_attn = normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)))) * V;

}  // namespace

TEST_CASE_TEMPLATE("recurrent steps and chained blocks equal the parallel plan", T, float, double) {
  check_recurrent<T>(causal_attn<elu_plus_one>, 1);
  check_recurrent<T>(causal_attn<softplus>, 2);
  check_recurrent<T>(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 3);
  check_recurrent<T>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V, 4);
  // a decayed mask: steps, blocks and one pass decay the state by one rounded multiply per row alike
  check_recurrent<T>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.95})) * V, 5);
  check_recurrent<T>(causal(Q * transpose(K), decay{0.5}) * V, 6);
}

// Chained blocks' backward: blocks cut at a random point, differentiated last
// first (the second from the state the first left, handing back ∂ of that
// state), joined equal the one-pass gradients; for an unnormalised identity
// map ∂ of the first state is Σ_t q_t dout_tᵀ over the whole sequence; in
// double, ∂ of the state between the blocks equals finite differences of the
// loss Σ dout ⊙ out through the second block. The last trial is one long slice
// (split over threads on the fast path).
template <class T, class Expr, class... Extra>
void check_chained_gradient(Expr const& expr, std::uint64_t seed, bool identity, Extra const&... extra) {
  auto const plan = compile(expr);
  test::rng r{seed};
  for (int trial = 0; trial < 4; ++trial) {
    shape s = trial < 3 ? random_shape(r) : shape{1, 1, 5000, 6, 5};
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next()), k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<T>::random({s.b, s.h, s.n, s.m}, r.next()), dout = tensor<T>::random({s.b, s.h, s.n, s.m}, r.next());
    std::size_t const cut = r.in(0, s.n);
    CONTEXT(s.b, s.h, s.n, s.d, s.m, cut);
    auto first = [&](tensor<T> const& x) { return tokens(x, 0, cut); };
    auto second = [&](tensor<T> const& x) { return tokens(x, cut, s.n); };
    auto whole = cpu::gradient(plan, dout, Q = q, K = k, V = v, extra...);
    cpu::state<T> s1, none;
    (void)cpu::evaluate(plan, s1, Q = first(q), K = first(k), V = first(v), extra...);
    auto [g2, d1] = cpu::gradient(plan, second(dout), s1, none, Q = second(q), K = second(k), V = second(v), extra...);
    auto [g1, d0] = cpu::gradient(plan, first(dout), none, d1, Q = first(q), K = first(k), V = first(v), extra...);
    {  // into the caller's views (the plan's own gradient_views): the same bits, ∂S returned
      tensor<T> gq(second(q).shape()), gk(second(k).shape()), gv(second(v).shape());
      auto into = cpu::gradient_views<T>(plan);
      into[Q] = gq.view(), into[K] = gk.view(), into[V] = gv.view();
      cpu::state<T> const d =
          cpu::gradient_into(plan, into, second(dout), s1, none, Q = second(q), K = second(k), V = second(v), extra...);
      CHECK(max_abs_diff(gq, g2[Q]) == 0);
      CHECK(max_abs_diff(gk, g2[K]) == 0);
      CHECK(max_abs_diff(gv, g2[V]) == 0);
      CHECK(max_abs_diff(d[0], d1[0]) == 0);
    }
    double const tol = std::is_same_v<T, float> ? 1e-4 : 1e-11;
    auto joined = [&](auto const& x, char const* name, auto const& a, auto const& b) {  // (Clang < 16 cannot capture a binding)
      CAPTURE(name);
      double const scale = 1 + test::max_abs(whole[x]);
      CHECK(max_abs_diff(a[x], first(whole[x])) <= tol * scale);
      CHECK(max_abs_diff(b[x], second(whole[x])) <= tol * scale);
    };
    joined(Q, "∂Q", g1, g2), joined(K, "∂K", g1, g2), joined(V, "∂V", g1, g2);
    if (identity) {  // ∂S0 = Σ_t q_t dout_tᵀ
      auto const want = test::outer_sums(q, dout);
      auto const got = d0[0];
      REQUIRE(want.shape() == got.shape());
      double err = 0;
      for_each_index(want.shape(), [&](auto... i) { err = std::max(err, std::abs(double(got(i...)) - want(i...))); });
      CHECK(err <= tol * (1 + test::max_abs(want)));
    }
    if constexpr (std::is_same_v<T, double>) {  // ∂S1 against finite differences through the second block
      auto loss = [&](cpu::state<T> const& from) {
        cpu::state<T> st = from;
        auto y = cpu::evaluate(plan, st, Q = second(q), K = second(k), V = second(v), extra...);
        double l = 0;
        for_each_index(y.shape(), [&](auto... i) { l += y(i...) * second(dout)(i...); });
        return l;
      };
      auto const sums = s1[0].shape();
      for (int probe = 0; probe < 4; ++probe) {
        std::size_t const b = r.in(0, sums[0] - 1), h = r.in(0, sums[1] - 1), a = r.in(0, sums[2] - 1),
                          c = r.in(0, sums[3] - 1);
        double const eps = 1e-6 * (1 + std::abs(s1[0](b, h, a, c)));
        cpu::state<T> up = s1, down = s1;
        up[0](b, h, a, c) += eps;
        down[0](b, h, a, c) -= eps;
        double const fd = (loss(up) - loss(down)) / (2 * eps);
        CHECK(std::abs(fd - d1[0](b, h, a, c)) <= 1e-6 * (1 + std::abs(fd)));
      }
    }
  }
}

TEST_CASE_TEMPLATE("chained blocks differentiated last first, handing back ∂state, = one backward", T, float, double) {
  check_chained_gradient<T>(causal_attn<elu_plus_one>, 11, false);
  check_chained_gradient<T>(causal(Q * transpose(K)) * V, 12, true);
  check_chained_gradient<T>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 13, false);
  // decayed masks: the ∂state handed back is checked against finite differences (double)
  check_chained_gradient<T>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, 14, false);
  check_chained_gradient<T>(causal(Q * transpose(K), decay{0.7}) * V, 15, false);
  // a state of another plan, or of another batch, is refused
  auto q = tensor<T>::random({2, 1, 6, 4}, 1), v = tensor<T>::random({2, 1, 6, 3}, 2);
  constexpr auto plan = compile(causal_attn<elu_plus_one>);
  cpu::state<T> other, small, none;
  (void)cpu::evaluate(compile(causal(Q * transpose(K)) * V), other, Q = q, K = q, V = v);
  CHECK_THROWS_AS((void)cpu::gradient(plan, v, other, none, Q = q, K = q, V = v), state_error);
  (void)cpu::evaluate(plan, small, Q = q, K = q, V = v);
  auto q1 = tensor<T>::random({1, 1, 6, 4}, 3), v1 = tensor<T>::random({1, 1, 6, 3}, 4);
  CHECK_THROWS_AS((void)cpu::gradient(plan, v1, none, small, Q = q1, K = q1, V = v1), shape_error);
}

// Blocks chained through a state past kernels::two_level_rows (4096 float rows)
// sum in two levels as one call does: the state counts the rows it holds. Row
// by row (each block in one level from the state it was handed) the error grew
// like √N ε: at N = 65536 in blocks of 1024 the chained forward was 7x, its
// gradients 4.7-5.5x, as far from fp64 as one call; now within 2x of it. And
// so do recurrent steps, through the state's pending sums.
TEST_CASE("blocks chained through a state, and steps, are as accurate as one call over them") {
  std::size_t const n = 65536, d = 4, blk = 1024, blocks = n / blk;
  auto const plan = compile<order::linear>(causal_attn<elu_plus_one>);
  auto qf = tensor<float>::random({1, 1, n, d}, 4), kf = tensor<float>::random({1, 1, n, d}, 5);
  auto vf = tensor<float>::random({1, 1, n, d}, 6), df = tensor<float>::random({1, 1, n, d}, 7);
  auto wide = [](tensor<float> const& x) {
    tensor<double> y(x.shape());
    for (std::size_t i = 0; i < x.size(); ++i) y.data()[i] = x.data()[i];
    return y;
  };
  auto qd = wide(qf), kd = wide(kf), vd = wide(vf), dd = wide(df);
  auto rel = [](auto const& got, tensor<double> const& want) {  // relative RMS error
    double e = 0, w = 0;
    for_each_index(want.shape(), [&](auto... i) {
      e += (double(got(i...)) - want(i...)) * (double(got(i...)) - want(i...));
      w += want(i...) * want(i...);
    });
    return std::sqrt(e / w);
  };
  auto block = [&](tensor<float> const& x, std::size_t b) { return x.rows(b * blk, blk); };
  // forward
  auto const exact = cpu::evaluate(plan, Q = qd, K = kd, V = vd);
  auto const once = cpu::evaluate(plan, Q = qf, K = kf, V = vf);
  tensor<float> chained({1, 1, n, d});
  std::vector<cpu::state<float>> begin(blocks);
  cpu::state<float> st;
  for (std::size_t b = 0; b < blocks; ++b) {
    begin[b] = st;
    CHECK(st.rows(0, 0) == b * blk);
    cpu::evaluate_into(plan, chained.rows(b * blk, blk), st, Q = block(qf, b), K = block(kf, b), V = block(vf, b));
  }
  CHECK(st.rows(0, 0) == n);
  CHECK(rel(chained, exact) <= 2 * rel(once, exact));
  // backward, last block first
  auto const g_exact = cpu::gradient(plan, dd, Q = qd, K = kd, V = vd);
  auto const g_once = cpu::gradient(plan, df, Q = qf, K = kf, V = vf);
  tensor<float> gq({1, 1, n, d}), gk({1, 1, n, d}), gv({1, 1, n, d});
  cpu::state<float> d_final;
  for (std::size_t b = blocks; b-- > 0;) {
    auto into = cpu::gradient_views<float>(plan);
    into[Q] = gq.rows(b * blk, blk), into[K] = gk.rows(b * blk, blk), into[V] = gv.rows(b * blk, blk);
    d_final = cpu::gradient_into(plan, into, block(df, b), begin[b], d_final, Q = block(qf, b), K = block(kf, b),
                                 V = block(vf, b));
    CHECK(d_final.rows(0, 0) == n - b * blk);  // ∂ of the state before block b: the rows from it on
  }
  CHECK(rel(gq, g_exact[Q]) <= 2 * rel(g_once[Q], g_exact[Q]));
  CHECK(rel(gk, g_exact[K]) <= 2 * rel(g_once[K], g_exact[K]));
  CHECK(rel(gv, g_exact[V]) <= 2 * rel(g_once[V], g_exact[V]));
  // recurrent steps past two_level_rows: each row into pending sums, folded
  // into the state every fold_rows steps (row by row onto the state they erred
  // like the row-by-row blocks); the state read between folds includes them
  auto rnn = cpu::recurrent<float>(plan, 1, 1);
  tensor<float> stepped({1, 1, n, d});
  std::size_t const mid = n / 2 + 5;  // (5 steps into a fold's 64)
  double mid_err = 0;
  for (std::size_t t = 0; t < n; ++t) {
    rnn.step_into(stepped.rows(t, 1), Q = qf.rows(t, 1), K = kf.rows(t, 1), V = vf.rows(t, 1));
    if (t + 1 == mid) {
      cpu::state<double> exact_sums;
      (void)cpu::evaluate(plan, exact_sums, Q = qd.rows(0, mid), K = kd.rows(0, mid), V = vd.rows(0, mid));
      auto const want = std::as_const(exact_sums)[0];
      auto const got = std::as_const(rnn.state())[0];
      double scale = 0;
      for_each_index(want.shape(), [&](auto... i) {
        mid_err = std::max(mid_err, std::abs(double(got(i...)) - want(i...)));
        scale = std::max(scale, std::abs(want(i...)));
      });
      mid_err /= scale;
    }
  }
  CHECK(rel(stepped, exact) <= 2 * rel(once, exact));
  CHECK(mid_err <= 1e-5);  // (without the 5 pending rows: ~1e-4)
  CHECK(rnn.state().rows(0, 0) == n);
  // a reset state holds no rows; a copy holds the rows of what it copies
  cpu::state<float> copy = st;
  st.reset();
  CHECK(st.rows(0, 0) == 0);
  CHECK(copy.rows(0, 0) == n);
}

// Reading a state folds its pending sums in (steps past two_level_rows): a
// const member that writes. Two threads reading one const state at once, or
// one reading while another copies it, must still leave the sums a fold makes
// once (before the fold took a lock, both readers added the same pending sums).
TEST_CASE("a const state holding pending sums may be read and copied from two threads at once") {
  std::size_t const h = 8, d = 64, steps = 4096 + 37;  // 37 steps into a fold, 8 slices of 64 x 65 sums
  auto const plan = compile<order::linear>(causal_attn<elu_plus_one>);
  auto q = tensor<float>::random({1, h, steps, d}, 21), k = tensor<float>::random({1, h, steps, d}, 22);
  auto v = tensor<float>::random({1, h, steps, d}, 23);
  auto rnn = cpu::recurrent<float>(plan, 1, h);
  tensor<float> y({1, h, 1, d});
  for (std::size_t t = 0; t < steps; ++t) rnn.step_into(y.view(), Q = q.rows(t, 1), K = k.rows(t, 1), V = v.rows(t, 1));
  REQUIRE(rnn.state().has_pending());
  auto sums = [](cpu::state<float> const& st) {  // folded by this read
    auto s = st[0];
    std::vector<float> out;
    for_each_index(s.shape(), [&](auto... i) { out.push_back(s(i...)); });
    return out;
  };
  cpu::state<float> const held = rnn.state();  // still pending: a copy carries them
  auto const want = sums(cpu::state<float>(held));
  int wrong = 0;
  for (int trial = 0; trial < 40; ++trial) {
    cpu::state<float> const shared = held;
    cpu::state<float> copied;
    std::atomic<int> ready{0};
    auto start = [&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
    };
    std::vector<float> read1, read2;
    std::thread first([&] {
      start();
      read1 = sums(shared);
    });
    std::thread second([&] {
      start();
      if (trial % 2 == 0)
        read2 = sums(shared);
      else
        copied = shared;
    });
    first.join();
    second.join();
    if (trial % 2 != 0) read2 = sums(copied);
    wrong += read1 != want || read2 != want || sums(shared) != want;
  }
  CHECK(wrong == 0);
}

TEST_CASE_TEMPLATE("favor attention steps like any linear attention", T, float, double) {
  constexpr auto e = normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V;
  test::rng r{7};
  for (int trial = 0; trial < 3; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 3), n = r.in(1, 80), d = r.in(2, 10), m = r.in(1, 6), f = r.in(4, 40);
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next());
    auto w = gaussian_projection<T>(d, f, r.next());
    auto wb = broadcast(w, b, h);
    auto once = cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v, W = wb);
    auto ref = cpu::evaluate(compile<order::quadratic>(e), Q = q, K = k, V = v, W = wb);
    CHECK(max_abs_diff(once, ref) <= test::rounding_bound<T>(double(n * f), 1.0));
    auto rnn = cpu::recurrent<T>(compile(e), b, h);
    for (std::size_t t = 0; t < n; ++t)
      CHECK(max_abs_diff(rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1), W = wb),
                         tokens(once, t, t + 1)) == 0);
  }
}

TEST_CASE("reset starts over, and a saved state restores the sequence where it was") {
  constexpr auto e = causal_attn<elu_plus_one>;
  auto q = tensor<double>::random({2, 2, 30, 5}, 1), k = tensor<double>::random({2, 2, 30, 5}, 2);
  auto v = tensor<double>::random({2, 2, 30, 3}, 3);
  auto rnn = cpu::recurrent<double>(compile(e), 2, 2);
  std::vector<tensor<double>> first;
  cpu::state<double> saved;
  for (std::size_t t = 0; t < 30; ++t) {
    first.push_back(rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1)));
    if (t == 11) saved = rnn.state();
  }
  // the state is the paper's (s | z): z = Σ φ(k_j) is its last column
  auto st = rnn.state()[0];
  REQUIRE(st.shape() == shape4{2, 2, 5, 4});
  double z = 0;
  for (std::size_t j = 0; j < 30; ++j) z += elu_plus_one::value(k(1, 0, j, 2));
  CHECK(st(1, 0, 2, 3) == doctest::Approx(z).epsilon(1e-12));

  rnn.reset();
  for (std::size_t t = 0; t < 30; ++t)
    CHECK(max_abs_diff(rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1)), first[t]) == 0);
  rnn.set_state(saved);
  for (std::size_t t = 12; t < 30; ++t)
    CHECK(max_abs_diff(rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1)), first[t]) == 0);
}

TEST_CASE("stepping with the wrong shape throws shape_error, and a foreign state is rejected") {
  constexpr auto e = causal_attn<elu_plus_one>;
  auto rnn = cpu::recurrent<float>(compile(e), 2, 3);
  auto tok = [](std::size_t b, std::size_t h, std::size_t n, std::size_t d) {
    return tensor<float>::random({b, h, n, d}, b * 1000 + h * 100 + n * 10 + d);
  };
  auto q = tok(2, 3, 1, 4), v = tok(2, 3, 1, 6);
  rnn.step(Q = q, K = q, V = v);  // fixes D = 4, M = 6
  auto qb = tok(3, 3, 1, 4), vb = tok(3, 3, 1, 6);
  test::expect_shape_error([&] { rnn.step(Q = qb, K = qb, V = vb); }, "Q", "B (batch)", 3, 2);
  auto qh = tok(2, 1, 1, 4), vh = tok(2, 1, 1, 6);
  test::expect_shape_error([&] { rnn.step(Q = qh, K = qh, V = vh); }, "Q", "H (heads)", 1, 3);
  auto qd = tok(2, 3, 1, 5);
  test::expect_shape_error([&] { rnn.step(Q = qd, K = qd, V = v); }, "Q", "D", 5, 4);
  auto q2 = tok(2, 3, 2, 4), v2 = tok(2, 3, 2, 6);
  test::expect_shape_error([&] { rnn.step(Q = q2, K = q2, V = v2); }, "Q", "N", 2, 1);

  // a state from another plan, or for another batch, is refused
  auto other = cpu::recurrent<float>(compile(causal_attn<relu>), 2, 3);
  other.step(Q = q, K = q, V = v);
  CHECK_THROWS_AS(rnn.set_state(other.state()), state_error);
  CHECK_THROWS_WITH_AS(rnn.set_state(other.state()), doctest::Contains("this state belongs to the plan"), state_error);
  auto small = cpu::recurrent<float>(compile(e), 1, 3);
  CHECK_THROWS_AS(rnn.set_state(small.state()), state_error);
  cpu::state<float> foreign = other.state();
  CHECK_THROWS_AS(cpu::evaluate(compile(e), foreign, Q = q, K = q, V = v), state_error);

  // evaluate_into a chained block: a wrong output or a foreign state throws
  // before the state or the output is touched
  tensor<float> out({2, 3, 1, 6}, 5.0f), wide({2, 3, 1, 7}, 5.0f);
  cpu::state<float> st = rnn.state();
  auto const kept = st;
  test::expect_shape_error([&] { cpu::evaluate_into(compile(e), wide.view(), st, Q = q, K = q, V = v); }, "out",
                           "cols", 7, 6);
  CHECK_THROWS_AS(cpu::evaluate_into(compile(e), out.view(), foreign, Q = q, K = q, V = v), state_error);
  cpu::state<float> fresh;
  test::expect_shape_error([&] { cpu::evaluate_into(compile(e), wide.view(), fresh, Q = q, K = q, V = v); }, "out",
                           "cols", 7, 6);
  CHECK(fresh.unbound());
  for (auto const* t : {&out, &wide})
    for (std::size_t i = 0; i < t->size(); ++i) CHECK(t->data()[i] == 5.0f);
  for (std::size_t k = 0; k < st.scans(); ++k) CHECK(max_abs_diff(st[k], kept[k]) == 0);
  cpu::evaluate_into(compile(e), out.view(), st, Q = q, K = q, V = v);  // and then it runs
  cpu::state<float> again = kept;
  CHECK(max_abs_diff(out, cpu::evaluate(compile(e), again, Q = q, K = q, V = v)) == 0);
  CHECK(max_abs_diff(st[0], again[0]) == 0);
}

TEST_CASE_TEMPLATE("poly2 is exact: (q·k)² through C = D(D+1)/2 features", T, float, double) {
  constexpr auto e = causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V;
  test::rng r{8};
  for (int trial = 0; trial < 5; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 150), d = r.in(1, 9), m = r.in(1, 7);
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next());
    tensor<double> ref({b, h, n, m});
    for (std::size_t x = 0; x < b; ++x)
      for (std::size_t y = 0; y < h; ++y)
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (std::size_t c = 0; c < d; ++c) dot += double(q(x, y, i, c)) * double(k(x, y, j, c));
            for (std::size_t e2 = 0; e2 < m; ++e2) ref(x, y, i, e2) += dot * dot * double(v(x, y, j, e2));
          }
    double bound = test::rounding_bound<T>(double(n * d * d), test::max_abs(ref));
    CONTEXT(n, d);
    CHECK(max_abs_diff(cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v), ref) <= bound);
    CHECK(max_abs_diff(cpu::evaluate(compile<order::quadratic>(e), Q = q, K = k, V = v), ref) <= bound);
  }
  static_assert(std::is_same_v<typename decltype(phi<poly2>(Q))::shape::cols, feature_dim<poly2, std::remove_cvref_t<decltype(D)>>>);
  CHECK(poly2::features(64) == 2080);
}

TEST_CASE("favor: the error against softmax attention falls as m grows") {
  // Softmax attention exp(q·k/√D), normalised, against favor with m features;
  // the error of a random-feature estimate shrinks like 1/√m, so four times
  // the features should roughly halve it. Mean over four projections.
  constexpr auto Dd = dim<"D", 16>;
  constexpr auto Qs = input<"Q">(N, Dd);
  constexpr auto Ks = input<"K">(N, Dd);
  constexpr auto Ws = input<"W">(Dd, F);
  constexpr auto softmax = normalize(causal(exp(Qs * transpose(Ks) / 4.0))) * V;
  constexpr auto approx = normalize(causal(phi<favor>(Qs, Ws) * transpose(phi<favor>(Ks, Ws)))) * V;
  std::size_t n = 256;
  auto q = tensor<double>::random({1, 2, n, 16}, 1), k = tensor<double>::random({1, 2, n, 16}, 2);
  auto v = tensor<double>::random({1, 2, n, 8}, 3);
  auto exact = cpu::evaluate(softmax, Qs = q, Ks = k, V = v);
  std::vector<double> errors;
  for (std::size_t m : {8u, 32u, 128u, 512u}) {
    double sum = 0;
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      auto w = gaussian_projection<double>(16, m, seed);
      auto out = cpu::evaluate(compile(approx), Qs = q, Ks = k, V = v, Ws = broadcast(w, 1, 2));
      double num = 0, den = 0;  // relative RMS error
      for (std::size_t i = 0; i < out.size(); ++i) {
        num += (out.data()[i] - exact.data()[i]) * (out.data()[i] - exact.data()[i]);
        den += exact.data()[i] * exact.data()[i];
      }
      sum += std::sqrt(num / den);
    }
    errors.push_back(sum / 4);
    MESSAGE("m = " << m << ": relative RMS error " << sum / 4);
  }
  // Each quadrupling must cut the error by a quarter at least, and 64x the
  // features by 70% (1/√64 = 1/8 is the Monte Carlo rate; measured: 0.21).
  for (std::size_t i = 1; i < errors.size(); ++i) CHECK(errors[i] < 0.75 * errors[i - 1]);
  CHECK(errors.back() < 0.3 * errors.front());
  CHECK(errors.back() < 0.2);  // measured 0.128 at 512 features
}

TEST_CASE("random Fourier features approximate the Gaussian kernel better as m grows") {
  constexpr auto kernel = phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W));
  std::size_t n = 40, d = 6;
  auto q = tensor<double>::random({1, 1, n, d}, 1), k = tensor<double>::random({1, 1, n, d}, 2);
  double s = std::pow(double(d), -0.25);
  std::vector<double> errors;
  for (std::size_t m : {16u, 64u, 256u, 1024u}) {
    double sum = 0;
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      auto w = gaussian_projection<double>(d, m, seed);
      auto approx = cpu::evaluate(kernel, Q = q, K = k, W = broadcast(w, 1, 1));
      double err = 0;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          double dist2 = 0;
          for (std::size_t c = 0; c < d; ++c) dist2 += std::pow(s * (q(0, 0, i, c) - k(0, 0, j, c)), 2);
          err = std::max(err, std::abs(approx(0, 0, i, j) - std::exp(-dist2 / 2)));
        }
      sum += err;
    }
    errors.push_back(sum / 4);
    MESSAGE("m = " << m << ": max kernel error " << sum / 4);
  }
  for (std::size_t i = 1; i < errors.size(); ++i) CHECK(errors[i] < 0.75 * errors[i - 1]);
  CHECK(errors.back() < 0.1);
}

// d = m = 64: 8 states of 64 x 65, which steps update on every thread (run_slices).
TEST_CASE_TEMPLATE("a recurrent step allocates nothing after the first", T, float, double) {
  for (std::size_t d : {16, 64}) {
    CAPTURE(d);
    constexpr auto e = causal_attn<elu_plus_one>;
    std::size_t b = 1, h = 8, m = d, n = 40;
    auto q = tensor<T>::random({b, h, n, d}, 1), k = tensor<T>::random({b, h, n, d}, 2);
    auto v = tensor<T>::random({b, h, n, m}, 3);
    auto once = cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v);
    auto rnn = cpu::recurrent<T>(compile(e), b, h);
    tensor<T> y({b, h, 1, m});
    rnn.step_into(y.view(), Q = tokens(q, 0, 1), K = tokens(k, 0, 1), V = tokens(v, 0, 1));  // sizes state and workspace
    CHECK(max_abs_diff(y, tokens(once, 0, 1)) == 0);
    std::size_t heap = 0, counted = 0;
    double err = 0;
    for (std::size_t t = 1; t < n; ++t) {
      auto qt = tokens(q, t, t + 1), kt = tokens(k, t, t + 1), vt = tokens(v, t, t + 1);
      cpu::memory().reset();
      {
        test::heap_counter c;
        rnn.step_into(y.view(), Q = qt, K = kt, V = vt);
        heap += c.allocations();
      }
      counted += cpu::memory().allocations;
      err = std::max(err, max_abs_diff(y, tokens(once, t, t + 1)));
    }
    CHECK(heap == 0);     // no operator new at all
    CHECK(counted == 0);  // and no buffer of the backend's
    CHECK(err == 0);      // the same numbers as the parallel plan
    // a wrong output shape is refused before anything is written
    tensor<T> wrong({b, h, 1, m + 1});
    CHECK_THROWS_AS(rnn.step_into(wrong.view(), Q = tokens(q, 0, 1), K = tokens(k, 0, 1), V = tokens(v, 0, 1)), shape_error);
  }
}
