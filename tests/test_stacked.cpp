// Stacked layers: the first layer's output feeds the second layer's feature
// map, so one scan's operand holds another scan. The plan has two states; each
// must be found by its place in the schedule (it once came from a run-time
// counter that disagreed with the type-level order and overflowed the heap).
// Stateless, chained in uneven blocks, token by token, and differentiated,
// against the same stack evaluated as written.
#include <doctest/doctest.h>

#include <array>
#include <lina/check.hpp>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#include "support.hpp"

using namespace lina;
using test::tokens;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);  // layer 1's output is layer 2's query: N x D
constexpr auto K2 = input<"K2">(N, D);
constexpr auto V2 = input<"V2">(N, M);
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
constexpr auto layer2 = normalize(causal(phi<poly2>(layer1) * transpose(phi<poly2>(K2)))) * V2;
// The same stack with positive features on both layers: poly2's features are
// signed, so its linear form sums terms that cancel to (q·k)² and is less
// accurate than the quadratic form where q·k is small (that is the math, not
// the plan); accuracy against the stack as written is checked on this one.
constexpr auto layer2_elu = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
using N_t = std::remove_cvref_t<decltype(N)>;


// The linear plan's state: layer 1's scan (C = D, M+1 = D+1) first, then
// layer 2's (C = D(D+1)/2, M+1), in the order of the schedule.
using linear_plan = decltype(compile<order::linear>(layer2));
static_assert(state_scans<linear_plan>::size == 2);
static_assert(std::is_same_v<typename lina::detail::type_at_t<0, state_scans<linear_plan>>::shape::a,
                             std::remove_cvref_t<decltype(D)>>);
static_assert(std::is_same_v<typename lina::detail::type_at_t<1, state_scans<linear_plan>>::shape::a,
                             feature_dim<poly2, std::remove_cvref_t<decltype(D)>>>);

struct inputs {
  tensor<double> q, k, v, k2, v2;
};
inputs random_inputs(test::rng& r, std::size_t b, std::size_t h, std::size_t n, std::size_t d, std::size_t m) {
  auto one = [&](std::size_t cols) { return tensor<double>::random({b, h, n, cols}, r.next()); };
  return {one(d), one(d), one(d), one(d), one(m)};
}


}  // namespace

TEST_CASE_TEMPLATE("stacked layers: stateless, chained blocks and steps agree with the stack as written", T, float,
                   double) {
  test::rng r{31};
  for (int trial = 0; trial < 4; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 3), n = r.in(1, 90), d = r.in(1, 5), m = r.in(1, 4);
    auto in = random_inputs(r, b, h, n, d, m);
    auto q = test::cast<T>(in.q), k = test::cast<T>(in.k), v = test::cast<T>(in.v), k2 = test::cast<T>(in.k2), v2 = test::cast<T>(in.v2);
    CONTEXT(b, h, n, d, m);
    auto ref = cpu::evaluate(layer2_elu, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    double bound = test::rounding_bound<T>(double(n * d * d), 1 + test::max_abs(ref));
    CHECK(max_abs_diff(cpu::evaluate(compile<order::linear>(layer2_elu), Q = q, K = k, V = v, K2 = k2, V2 = v2), ref) <=
          bound);
    CHECK(max_abs_diff(cpu::evaluate(compile(layer2_elu), Q = q, K = k, V = v, K2 = k2, V2 = v2), ref) <= bound);

    // poly2 on top: both orders agree in double (within poly2's own conditioning)
    auto once = cpu::evaluate(compile<order::linear>(layer2), Q = q, K = k, V = v, K2 = k2, V2 = v2);
    auto written = cpu::evaluate(layer2, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    auto linear = cpu::evaluate(compile<order::linear>(layer2), Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    CHECK(max_abs_diff(linear, written) <= 1e-9 * (1 + test::max_abs(written)));

    // uneven blocks carry both states: the same numbers as one linear evaluation
    cpu::state<T> st;
    for (std::size_t at = 0; at < n;) {
      std::size_t to = std::min(n, at + r.in(1, 30));
      auto y = cpu::evaluate(compile(layer2), st, Q = tokens(q, at, to), K = tokens(k, at, to), V = tokens(v, at, to),
                             K2 = tokens(k2, at, to), V2 = tokens(v2, at, to));
      CHECK(max_abs_diff(y, tokens(once, at, to)) == 0);
      at = to;
    }
    REQUIRE(st.scans() == 2);
    CHECK(st[0].shape() == shape4{b, h, d, d + 1});
    CHECK(st[1].shape() == shape4{b, h, d * (d + 1) / 2, m + 1});

    // token by token
    auto rnn = cpu::recurrent<T>(compile(layer2), b, h);
    double step_err = 0;
    for (std::size_t t = 0; t < n; ++t) {
      auto y = rnn.step(Q = tokens(q, t, t + 1), K = tokens(k, t, t + 1), V = tokens(v, t, t + 1),
                        K2 = tokens(k2, t, t + 1), V2 = tokens(v2, t, t + 1));
      step_err = std::max(step_err, max_abs_diff(y, tokens(once, t, t + 1)));
    }
    CHECK(step_err == 0);
  }
}

TEST_CASE("stacked layers: gradients of the linear plan equal those of the stack as written") {
  test::rng r{32};
  for (int trial = 0; trial < 3; ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 40), d = r.in(1, 4), m = r.in(1, 3);
    auto in = random_inputs(r, b, h, n, d, m);
    auto dout = tensor<double>::random({b, h, n, m}, r.next());
    auto lin = cpu::gradient(compile<order::linear>(layer2), dout, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    auto ref = cpu::gradient(layer2, dout, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    CONTEXT(n, d, m);
    CHECK(max_abs_diff(lin[Q], ref[Q]) <= 1e-10 * (1 + test::max_abs(ref[Q])));
    CHECK(max_abs_diff(lin[K], ref[K]) <= 1e-10 * (1 + test::max_abs(ref[K])));
    CHECK(max_abs_diff(lin[V], ref[V]) <= 1e-10 * (1 + test::max_abs(ref[V])));
    CHECK(max_abs_diff(lin[K2], ref[K2]) <= 1e-10 * (1 + test::max_abs(ref[K2])));
    CHECK(max_abs_diff(lin[V2], ref[V2]) <= 1e-10 * (1 + test::max_abs(ref[V2])));
  }
}

TEST_CASE("stacked layers: a central difference confirms the gradient of the first layer's query") {
  test::rng r{33};
  std::size_t b = 1, h = 2, n = 9, d = 3, m = 2;
  auto in = random_inputs(r, b, h, n, d, m);
  auto dout = tensor<double>::random({b, h, n, m}, r.next());
  auto g = cpu::gradient(compile<order::linear>(layer2), dout, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
  auto loss = [&] {
    auto out = cpu::evaluate(layer2, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
    double s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += out.data()[i] * dout.data()[i];
    return s;
  };
  for (std::size_t i = 0; i < in.q.size(); ++i) {
    double keep = in.q.data()[i];
    in.q.data()[i] = keep + 1e-6;
    double up = loss();
    in.q.data()[i] = keep - 1e-6;
    double down = loss();
    in.q.data()[i] = keep;
    double fd = (up - down) / 2e-6;
    CAPTURE(i);
    CHECK(std::abs(fd - g[Q].data()[i]) <= 1e-6 * (1 + std::abs(fd)));
  }
}

// Chained gradients of a stack: each scan of the backward starts from its
// layer's sums (the forward's from the state the block began with, the
// gradient's from ∂ of the state it left) and each layer hands back its own
// ∂initial; blocks differentiated last first and joined are the one-pass
// gradients.
TEST_CASE("stacked layers: chained gradients, block by block from the last, join to the one-pass gradients") {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    auto rec = check::recurrent(layer2_elu, {.trials = 1, .max_extent = 7, .seed = seed});
    INFO(rec);
    CHECK(rec.ok());
  }
  // three blocks by hand (a middle block both takes and hands back ∂state),
  // poly2 on the second layer: the states of both layers differ in shape
  test::rng r{34};
  std::size_t const b = 2, h = 2, n = 23, d = 3, m = 2;
  auto in = random_inputs(r, b, h, n, d, m);
  auto dout = tensor<double>::random({b, h, n, m}, r.next());
  auto const plan = compile<order::linear>(layer2);
  auto const whole = cpu::gradient(layer2, dout, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2);
  std::size_t const cut[] = {0, 7, 16, n};
  std::array<cpu::state<double>, 3> begin;  // the state each block starts from
  cpu::state<double> st;
  for (int x = 0; x < 3; ++x) {
    begin[x] = st;
    auto rows = [&](tensor<double> const& t) { return t.rows(cut[x], cut[x + 1] - cut[x]); };
    (void)cpu::evaluate(plan, st, Q = rows(in.q), K = rows(in.k), V = rows(in.v), K2 = rows(in.k2), V2 = rows(in.v2));
  }
  cpu::state<double> d_final;  // (unsized: zeros after the last block)
  std::array<tensor<double>, 5> joined{tensor<double>(in.q.shape()), tensor<double>(in.k.shape()),
                                       tensor<double>(in.v.shape()), tensor<double>(in.k2.shape()),
                                       tensor<double>(in.v2.shape())};
  for (int x = 2; x >= 0; --x) {
    std::size_t const first = cut[x], count = cut[x + 1] - cut[x];
    auto rows = [&](tensor<double> const& t) { return t.rows(first, count); };
    auto [g, d_initial] = cpu::gradient(plan, dout.rows(first, count), begin[x], d_final, Q = rows(in.q), K = rows(in.k),
                                        V = rows(in.v), K2 = rows(in.k2), V2 = rows(in.v2));
    CHECK(d_initial.scans() == 2);
    tensor<double> const* parts[] = {&g[Q], &g[K], &g[V], &g[K2], &g[V2]};
    for (std::size_t k = 0; k < 5; ++k)
      for_each_index(parts[k]->shape(), [&](std::size_t b0, std::size_t h0, std::size_t i, std::size_t j) {
        joined[k](b0, h0, first + i, j) = (*parts[k])(b0, h0, i, j);
      });
    d_final = d_initial;
  }
  tensor<double> const* want[] = {&whole[Q], &whole[K], &whole[V], &whole[K2], &whole[V2]};
  for (std::size_t k = 0; k < 5; ++k) {
    CAPTURE(k);
    CHECK(max_abs_diff(joined[k], *want[k]) <= 1e-9 * (1 + test::max_abs(*want[k])));
  }
}

// A layer read twice by the layer above (as its query and its values; as its
// keys and its values): the backward carries one adjoint per read into that
// layer, so its ∂state has a part per read — d_final must enter it once and
// ∂initial is the parts' sum (each part alone, or d_final in every part,
// fails this). ∂ of the state between two blocks, and the second block's
// inputs' gradients, against central differences of the loss through that
// block, in double.
TEST_CASE("stacked layers: a layer read twice above it, a chained block's gradients and ∂state = finite differences") {
  constexpr auto qv = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto kv = normalize(causal(phi<elu_plus_one>(K2) * transpose(phi<elu_plus_one>(layer1)))) * layer1;
  auto check_one = [](auto const& expr, std::uint64_t seed) {
    auto const plan = compile<order::linear>(expr);
    test::rng r{seed};
    std::size_t const b = 1, h = 2, n = 9, d = 3;
    auto x = [&](std::size_t rows) { return tensor<double>::random({b, h, rows, d}, r.next()); };
    auto p = x(5), q = x(n), k = x(n), v = x(n), k2 = x(n), dout = x(n);
    cpu::state<double> s0, d_final;  // s0: the sums after a first block (p)
    (void)cpu::evaluate(plan, s0, Q = p, K = p, V = p, K2 = p);
    (void)cpu::evaluate(plan, d_final, Q = x(4), K = x(4), V = x(4), K2 = x(4));  // any sums: ∂ of the state after
    auto [g, d0] = cpu::gradient(plan, dout, s0, d_final, Q = q, K = k, V = v, K2 = k2);
    // The loss through the second block: <dout, its output> + <d_final, the sums it leaves>.
    auto loss = [&](cpu::state<double> st) {
      auto y = cpu::evaluate(plan, st, Q = q, K = k, V = v, K2 = k2);
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y.data()[i] * dout.data()[i];
      for (std::size_t l2 = 0; l2 < st.scans(); ++l2)
        for_each_index(st[l2].shape(), [&](auto... i) { l += st[l2](i...) * d_final[l2](i...); });
      return l;
    };
    REQUIRE(d0.scans() == 2);
    double worst = 0, scale = 0;
    for (std::size_t l2 = 0; l2 < 2; ++l2)
      for_each_index(d0[l2].shape(), [&](auto... i) {
        double const eps = 1e-6;
        cpu::state<double> up = s0, down = s0;
        up[l2](i...) += eps;
        down[l2](i...) -= eps;
        double const fd = (loss(std::move(up)) - loss(std::move(down))) / (2 * eps);
        worst = std::max(worst, std::abs(d0[l2](i...) - fd));
        scale = std::max(scale, std::abs(fd));
      });
    CHECK(worst <= 1e-6 * (1 + scale));
    // The block's inputs' gradients against the same loss (d_final enters
    // them through layer 1's ∂state: once).
    tensor<double>* const inputs[] = {&q, &k, &v, &k2};
    tensor<double> const* const grads[] = {&g[Q], &g[K], &g[V], &g[K2]};
    for (std::size_t a = 0; a < 4; ++a) {
      CAPTURE(a);
      double worst_in = 0, scale_in = 0;
      for (std::size_t i = 0; i < inputs[a]->size(); ++i) {
        double const keep = inputs[a]->data()[i];
        inputs[a]->data()[i] = keep + 1e-6;
        double const up = loss(s0);
        inputs[a]->data()[i] = keep - 1e-6;
        double const down = loss(s0);
        inputs[a]->data()[i] = keep;
        double const fd = (up - down) / 2e-6;
        worst_in = std::max(worst_in, std::abs(fd - grads[a]->data()[i]));
        scale_in = std::max(scale_in, std::abs(fd));
      }
      CHECK(worst_in <= 1e-6 * (1 + scale_in));
    }
  };
  check_one(qv, 35);
  check_one(kv, 36);
}

// Three layers, each one's output the next one's query. The backward
// recomputes layers 1 and 2 many times over; those recomputed scans are twins
// (their normalize carries an eps) and share the first one's rows when the
// values agree, skipping their own turn. A twin scan once also emitted the
// row-wise steps that read it (layer 2's output, φ of it): skipped, they were
// never made, and every gradient was wrong (the simple path crashed). Every
// input's gradient against central differences of the stack's forward, in
// double; and no scan with a twin makes another step's rows.
TEST_CASE("stacked layers: three layers, every input's gradient = finite differences") {
  constexpr auto K3 = input<"K3">(N, M);
  constexpr auto V3 = input<"V3">(N, M);
  constexpr auto layer3 = normalize(causal(phi<elu_plus_one>(layer2_elu) * transpose(phi<elu_plus_one>(K3)))) * V3;
  auto const plan = compile<order::linear>(layer3);
  using S = schedule_of<std::remove_cvref_t<decltype(as_bundle(gradient(longest_branch(plan))))>>;
  for (std::size_t j = 0; j < S::size; ++j)
    if (S::twin[j] != sched::none) {
      CAPTURE(j);
      CHECK(S::emits[j] == sched::none);
      CHECK(S::dual_of[j] == sched::none);
    }
  test::rng r{37};
  std::size_t const b = 1, h = 2, n = 6, d = 3, m = 2;
  auto in = random_inputs(r, b, h, n, d, m);
  auto k3 = tensor<double>::random({b, h, n, m}, r.next()), v3 = tensor<double>::random({b, h, n, m}, r.next());
  auto dout = tensor<double>::random({b, h, n, m}, r.next());
  auto g = cpu::gradient(plan, dout, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2, K3 = k3, V3 = v3);
  auto loss = [&] {
    auto out = cpu::evaluate(plan, Q = in.q, K = in.k, V = in.v, K2 = in.k2, V2 = in.v2, K3 = k3, V3 = v3);
    double s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += out.data()[i] * dout.data()[i];
    return s;
  };
  std::array<tensor<double>*, 7> const x{&in.q, &in.k, &in.v, &in.k2, &in.v2, &k3, &v3};
  std::array<tensor<double> const*, 7> const dx{&g[Q], &g[K], &g[V], &g[K2], &g[V2], &g[K3], &g[V3]};
  for (std::size_t a = 0; a < x.size(); ++a) {
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < x[a]->size(); ++i) {
      double const keep = x[a]->data()[i];
      x[a]->data()[i] = keep + 1e-6;
      double const up = loss();
      x[a]->data()[i] = keep - 1e-6;
      double const down = loss();
      x[a]->data()[i] = keep;
      double const fd = (up - down) / 2e-6;
      worst = std::max(worst, std::abs(fd - dx[a]->data()[i]));
      scale = std::max(scale, std::abs(fd));
    }
    CAPTURE(a);
    CAPTURE(scale);
    CHECK(scale > 0);
    CHECK(worst <= 1e-6 * scale + 1e-9);
  }
}
