// Training through a tape (cpu::tape, lina/saved.hpp): the forward keeps the
// values its backward reads, the backward reads them instead of recomputing.
// Its output and gradients against the recomputing path (cpu::evaluate,
// cpu::gradient: the same operations, so to rounding) over random shapes,
// signed inputs and every kind of plan; against central differences once
// directly; which values are kept; memory reused; and every misuse an error.
#include <string>

#include "gradient_support.hpp"

using namespace gradient_test;

namespace {

constexpr auto V2 = input<"V2">(N, M);

// |got − want| ≤ tol (1 + |want|) everywhere (NaN fails).
template <class T>
bool close(tensor<T> const& got, tensor<T> const& want, double tol) {
  if (got.shape() != want.shape()) return false;
  bool ok = true;
  for_each_index(want.shape(), [&](auto... i) {
    double g = got.view()(i...), w = want.view()(i...);
    ok = ok && std::abs(g - w) <= tol * (1 + std::abs(w));
  });
  return ok;
}

// One random trial of plan p over inputs Q, K, V: the tape's output and
// gradients against the recomputing path's.
template <class P>
void agrees(P const& plan, test::rng& r, std::size_t kept) {
  std::size_t b = r.in(1, 2), h = r.in(1, 3), n = r.next() % 4 ? r.in(1, 40) : r.in(41, 300), d = r.in(1, 9),
              m = r.in(1, 9);
  CONTEXT(b, h, n, d, m);
  auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
  auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
  auto run = [&](auto const& body) { return body(Q = q, K = k, V = v); };
  cpu::tape<double> tp;
  auto out = run([&](auto const&... in) { return cpu::evaluate(plan, tp, in...); });
  auto want = run([&](auto const&... in) { return cpu::evaluate(plan, in...); });
  CHECK(close(out, want, 1e-13));
  CHECK(tp.filled());
  CHECK(tp.size() == kept);
  auto g = run([&](auto const&... in) { return cpu::gradient(plan, tp, dout, in...); });
  auto gw = run([&](auto const&... in) { return cpu::gradient(plan, dout, in...); });
  for (std::size_t i = 0; i < g.all().size(); ++i) {
    CAPTURE(i);
    CHECK(close(g.all()[i], gw.all()[i], 1e-12));
  }
}

// Layer 2 reads two layer-1 attentions of one type that may differ in their decay only.
auto stack(double g1, double g2) {
  auto a = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{g1})) * V;
  auto c = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{g2})) * V;
  return compile<order::linear>(normalize(causal(phi<elu_plus_one>(a) * transpose(phi<elu_plus_one>(c)))) * V2);
}

// Plan p over blocks of one random sequence cut at random rows, each block's
// forward through the state into its own tape and its backward from that
// tape, last block first: outputs, states, gradients and ∂initial equal the
// recomputing chained path's block by block, and joined they are the
// one-pass output and gradients.
template <bool Stacked, class P>
void chained_agrees(P const& plan, test::rng& r, std::size_t kept) {
  std::size_t const b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 3) == 1 ? r.in(0, 12) : r.in(13, 160), d = r.in(1, 6),
                    m = r.in(1, 6);
  std::size_t cut[4] = {0, r.in(0, n), r.in(0, n), n};
  if (cut[1] > cut[2]) std::swap(cut[1], cut[2]);
  CONTEXT(b, h, n, d, m, cut[1], cut[2]);
  auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
  auto v = tensor<double>::random({b, h, n, m}, r.next()), v2 = tensor<double>::random({b, h, n, m}, r.next());
  auto dout = tensor<double>::random({b, h, n, m}, r.next());
  auto rows = [&](tensor<double> const& t, int x) { return t.rows(cut[x], cut[x + 1] - cut[x]); };
  auto run = [&](int x, auto const& body) {
    if constexpr (Stacked)
      return body(Q = rows(q, x), K = rows(k, x), V = rows(v, x), V2 = rows(v2, x));
    else
      return body(Q = rows(q, x), K = rows(k, x), V = rows(v, x));
  };
  auto whole = [&](auto const& body) {
    if constexpr (Stacked)
      return body(Q = q, K = k, V = v, V2 = v2);
    else
      return body(Q = q, K = k, V = v);
  };
  auto copy = [](auto const& view) {  // a view (a block's rows, a state's sums) as a tensor
    tensor<double> t(view.shape());
    for_each_index(view.shape(), [&](auto... i) { t.view()(i...) = view(i...); });
    return t;
  };
  auto const out = whole([&](auto const&... in) { return cpu::evaluate(plan, in...); });
  auto const grads = whole([&](auto const&... in) { return cpu::gradient(plan, dout, in...); });
  cpu::state<double> st, st_recomputed, begin[3];
  cpu::tape<double> tp[3];
  for (int x = 0; x < 3; ++x) {
    begin[x] = st;
    auto y = run(x, [&](auto const&... in) { return cpu::evaluate(plan, st, tp[x], in...); });
    auto y_recomputed = run(x, [&](auto const&... in) { return cpu::evaluate(plan, st_recomputed, in...); });
    CHECK(close(y, y_recomputed, 1e-13));
    CHECK(close(y, copy(rows(out, x)), 1e-12));
    CHECK(tp[x].size() == kept);
    for (std::size_t l = 0; l < st.scans(); ++l) CHECK(close(copy(st[l]), copy(st_recomputed[l]), 1e-13));
  }
  cpu::state<double> d_final;  // (unsized: zeros after the last block)
  auto joined = grads;
  for (int x = 2; x >= 0; --x) {
    auto [g, d0] = run(x, [&](auto const&... in) { return cpu::gradient(plan, tp[x], rows(dout, x), begin[x], d_final, in...); });
    auto [gw, dw] = run(x, [&](auto const&... in) { return cpu::gradient(plan, rows(dout, x), begin[x], d_final, in...); });
    for (std::size_t i = 0; i < g.all().size(); ++i) {
      CAPTURE(i);
      CHECK(close(g.all()[i], gw.all()[i], 1e-12));
      for_each_index(g.all()[i].shape(), [&](std::size_t b0, std::size_t h0, std::size_t t, std::size_t c) {
        joined.all()[i].view()(b0, h0, cut[x] + t, c) = g.all()[i].view()(b0, h0, t, c);
      });
    }
    REQUIRE(d0.scans() == dw.scans());
    for (std::size_t l = 0; l < d0.scans(); ++l) CHECK(close(copy(d0[l]), copy(dw[l]), 1e-12));
    d_final = d0;
  }
  for (std::size_t i = 0; i < joined.all().size(); ++i) CHECK(close(joined.all()[i], grads.all()[i], 1e-10));
}

}  // namespace

TEST_CASE("tape: the output and gradients of every order equal the recomputing path's") {
  test::rng r{71};
  constexpr auto e = causal_attn<elu_plus_one>;
  for (int trial = 0; trial < test::trials(6); ++trial) {
    agrees(compile<order::linear>(e), r, 1);     // Y = contract(φQ, prefix(φK⊗[V|1]))
    agrees(compile<order::quadratic>(e), r, 1);  // causal(φQ·φKᵀ)·[V|1] (not the N x N factor)
  }
  // One long sequence (B·H = 1) is split across idle threads (cpu::sequence_parts):
  // the kept Y is written by both parts of the forward's scan.
  {
    auto plan = compile<order::linear>(e);
    std::size_t const n = 2 * static_cast<std::size_t>(cpu::sequence_split_min_rows) + 5;
    auto q = tensor<double>::random({1, 1, n, 3}, 7), k = tensor<double>::random({1, 1, n, 3}, 8);
    auto v = tensor<double>::random({1, 1, n, 2}, 9), dout = tensor<double>::random({1, 1, n, 2}, 10);
    cpu::tape<double> tp;
    auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v);
    CHECK(close(out, cpu::evaluate(plan, Q = q, K = k, V = v), 1e-13));
    auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);
    auto want = cpu::gradient(plan, dout, Q = q, K = k, V = v);
    for (std::size_t i = 0; i < g.all().size(); ++i) CHECK(close(g.all()[i], want.all()[i], 1e-12));
  }
  // As written, the backward reads only N x N values of the forward: none is kept.
  static_assert(decltype(save_for_backward(e))::size == 0);
  // Softmax: its values are N x N or made from exp, so none is kept either; its
  // forward and backward run as without a tape, a block of query rows at a time
  // (tests/test_memory.cpp).
  for (int trial = 0; trial < test::trials(3); ++trial) agrees(compile(normalize(causal(exp(Q * transpose(K)))) * V), r, 0);
  // (FAVOR+ through a tape: tests/test_gradient_fd_maps.cpp, beside its other checks.)
}

TEST_CASE("tape: gradients read from a tape equal central differences") {
  test::rng r{73};
  constexpr auto e = causal_attn<elu_plus_one>;
  auto plan = compile<order::linear>(e);
  std::size_t const b = 1, h = 2, n = 9, d = 3, m = 2;
  auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
  auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
  cpu::tape<double> tp;
  cpu::evaluate(plan, tp, Q = q, K = k, V = v);
  auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);
  auto loss = [&] {
    auto o = cpu::evaluate(e, Q = q, K = k, V = v);
    double s = 0;
    for (std::size_t i = 0; i < o.size(); ++i) s += o.data()[i] * dout.data()[i];
    return s;
  };
  double worst = 0;
  for (auto* x : {&q, &k, &v}) {
    auto const& gx = x == &q ? g[Q] : x == &k ? g[K] : g[V];
    for_each_index(x->shape(), [&](auto... i) {
      double& at = x->view()(i...);
      double const keep = at, step = 1e-6;
      at = keep + step;
      double up = loss();
      at = keep - step;
      double down = loss();
      at = keep;
      double fd = (up - down) / (2 * step);
      worst = std::max(worst, std::abs(gx.view()(i...) - fd) / (1 + std::abs(fd)));
    });
  }
  CAPTURE(worst);
  CHECK(worst < 1e-7);
}

TEST_CASE("tape: the saved backward prints what it reads, and reads Y instead of its scan") {
  auto sv = save_for_backward(compile<order::linear>(causal_attn<elu_plus_one>));
  std::string s = to_string(sv);
  CAPTURE(s);
  CHECK(s.find("rowdiv′(saved1, dout)") != std::string::npos);
  CHECK(s.find("saved1 = contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1]))") != std::string::npos);
  // The backward's scans: ∂Q's prefix scan and the suffix scan ∂K, ∂V share; no forward scan.
  CHECK(s.find("prefix(φ[elu+1](K)⊗[V|1])") == s.rfind("prefix(φ[elu+1](K)⊗[V|1])"));
  using SB = schedule_of<std::remove_cvref_t<decltype(as_bundle(sv.backward))>>;
  std::size_t scans = 0;
  [&]<std::size_t... J>(std::index_sequence<J...>) { ((scans += SB::template is_scan<J> ? 1 : 0), ...); }(
      std::make_index_sequence<SB::size>{});
  CHECK(scans == 3);  // ∂Q's, ∂K's and ∂V's (the last two one paired pass); without the tape, 4
}

TEST_CASE("tape: a stack keeps each layer's scan once, and two reads of one type with other values recompute") {
  test::rng r{74};
  CHECK(save_for_backward(stack(0.9, 0.9)).exact);
  CHECK_FALSE(save_for_backward(stack(0.9, 0.5)).exact);
  for (int trial = 0; trial < test::trials(4); ++trial) {
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 150), d = r.in(1, 6), m = r.in(1, 6);
    CONTEXT(n, d, m);
    auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
    auto v = tensor<double>::random({b, h, n, m}, r.next()), v2 = tensor<double>::random({b, h, n, m}, r.next());
    auto dout = tensor<double>::random({b, h, n, m}, r.next());
    for (double g2 : {0.9, 0.5}) {
      auto plan = stack(0.9, g2);
      cpu::tape<double> tp;
      auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v, V2 = v2);
      CHECK(close(out, cpu::evaluate(plan, Q = q, K = k, V = v, V2 = v2), 1e-13));
      // Equal decays: one Y for both reads of layer 1, and layer 2's; else nothing.
      REQUIRE(tp.size() == (g2 == 0.9 ? 2u : 0u));
      if (tp.size()) CHECK(tp.value(0).shape() == shape4{b, h, n, m + 1});
      auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v, V2 = v2);
      auto want = cpu::gradient(plan, dout, Q = q, K = k, V = v, V2 = v2);
      for (std::size_t i = 0; i < g.all().size(); ++i) CHECK(close(g.all()[i], want.all()[i], 1e-12));
    }
  }
}

TEST_CASE("tape: chained blocks, a tape each, give the recomputing chained path's results and join to one pass") {
  test::rng r{75};
  constexpr auto decayed = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V;
  // Two layers (a state each), layer 1's output layer 2's query, V2 its keys and values.
  constexpr auto two = normalize(causal(phi<elu_plus_one>(decayed) * transpose(phi<elu_plus_one>(V2)))) * V2;
  for (int trial = 0; trial < test::trials(3); ++trial) {
    chained_agrees<false>(compile<order::linear>(causal_attn<elu_plus_one>), r, 1);
    chained_agrees<false>(compile<order::linear>(decayed), r, 1);  // the kept Y's scan a twin of the forward's (a decay is a value)
    chained_agrees<true>(compile<order::linear>(two), r, 2);
  }
  // Layer 2 reading two layer-1 attentions of one type: twin scans in the plan's
  // own state. Through a tape, blocks leave every scan's sums as the recomputing
  // forward does. (Its chained backward cannot tell the twins' layers apart: it
  // is refused at compile time, tape or not.)
  auto const twins = stack(0.9, 0.9);
  auto q = tensor<double>::random({1, 2, 30, 3}, 1), k = tensor<double>::random({1, 2, 30, 3}, 2);
  auto v = tensor<double>::random({1, 2, 30, 4}, 3), v2 = tensor<double>::random({1, 2, 30, 4}, 4);
  cpu::state<double> st, st_recomputed;
  cpu::tape<double> tp;
  for (std::size_t at : {0, 13}) {
    std::size_t const rows = at ? 17 : 13;
    auto y = cpu::evaluate(twins, st, tp, Q = q.rows(at, rows), K = k.rows(at, rows), V = v.rows(at, rows),
                           V2 = v2.rows(at, rows));
    auto want = cpu::evaluate(twins, st_recomputed, Q = q.rows(at, rows), K = k.rows(at, rows), V = v.rows(at, rows),
                              V2 = v2.rows(at, rows));
    CHECK(close(y, want, 1e-13));
    REQUIRE(st.scans() == 3);
    for (std::size_t l = 0; l < st.scans(); ++l)
      for_each_index(st[l].shape(), [&](auto... i) { CHECK(st[l](i...) == doctest::Approx(st_recomputed[l](i...)).epsilon(1e-13)); });
  }
}

TEST_CASE("tape: its memory is reused while the extents repeat, and gradient_into writes caller views") {
  auto plan = compile<order::linear>(causal_attn<elu_plus_one>);
  auto q = tensor<double>::random({1, 2, 50, 4}, 1), k = tensor<double>::random({1, 2, 50, 4}, 2);
  auto v = tensor<double>::random({1, 2, 50, 3}, 3), dout = tensor<double>::random({1, 2, 50, 3}, 4);
  cpu::tape<double> tp;
  tensor<double> out({1, 2, 50, 3});
  cpu::evaluate_into(plan, out.view(), tp, Q = q, K = k, V = v);
  double const* first = tp.value(0).data();
  CHECK(tp.bytes() == 2 * 50 * 4 * sizeof(double));
  cpu::evaluate_into(plan, out.view(), tp, Q = q, K = k, V = v);
  CHECK(tp.value(0).data() == first);
  // Gradients into views of [B, N, H, C] buffers, as the allocating form's.
  auto bnhc = [](std::size_t c) {
    return tensor<double>::like(tensor_view<double const>(nullptr, {1, 2, 50, c}, {std::ptrdiff_t(100 * c), std::ptrdiff_t(c),
                                                                                std::ptrdiff_t(2 * c), 1}));
  };
  auto dq = bnhc(4), dk = bnhc(4), dv = bnhc(3);
  auto into = cpu::gradient_views<double>(plan);
  into[Q] = dq.view();
  into[K] = dk.view();
  into[V] = dv.view();
  cpu::gradient_into(plan, into, tp, dout, Q = q, K = k, V = v);
  auto want = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  for_each_index(want[Q].shape(), [&](auto... i) { CHECK(into[Q](i...) == doctest::Approx(want[Q].view()(i...))); });
  for_each_index(want[V].shape(), [&](auto... i) { CHECK(into[V](i...) == doctest::Approx(want[V].view()(i...))); });
  tp.clear();
  CHECK_FALSE(tp.filled());
  CHECK(tp.bytes() == 0);
  // No tokens: empty results, an empty value kept.
  auto none = tensor<double>::random({1, 2, 0, 4}, 5), none_v = tensor<double>::random({1, 2, 0, 3}, 6);
  auto empty = cpu::evaluate(plan, tp, Q = none, K = none, V = none_v);
  CHECK(empty.shape() == shape4{1, 2, 0, 3});
  CHECK(tp.value(0).shape() == shape4{1, 2, 0, 4});
  auto g0 = cpu::gradient(plan, tp, none_v, Q = none, K = none, V = none_v);
  CHECK(g0[Q].shape() == shape4{1, 2, 0, 4});
}

TEST_CASE("tape: misuse is an error before anything is written") {
  auto plan = compile<order::linear>(causal_attn<elu_plus_one>);
  auto q = tensor<double>::random({1, 2, 20, 4}, 1), k = tensor<double>::random({1, 2, 20, 4}, 2);
  auto v = tensor<double>::random({1, 2, 20, 3}, 3), dout = tensor<double>::random({1, 2, 20, 3}, 4);
  cpu::tape<double> tp;
  auto contains = [](std::string const& what, std::string const& part) { return what.find(part) != std::string::npos; };
  // No forward has filled it.
  try {
    cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);
    FAIL("no tape_error");
  } catch (lina::tape_error const& e) {
    CHECK(contains(e.what(), "holds no forward's values"));
  }
  // A forward into an output of the wrong shape throws first and keeps nothing.
  tensor<double> wrong({1, 2, 20, 4});
  test::expect_shape_error([&] { cpu::evaluate_into(plan, wrong.view(), tp, Q = q, K = k, V = v); }, "out", "cols", 4, 3);
  CHECK_FALSE(tp.filled());
  cpu::evaluate(plan, tp, Q = q, K = k, V = v);
  CHECK(contains(tp.plan(), "rowdiv(contract("));
  // The values of another plan: another type, or the same type with another eps.
  auto other = compile<order::quadratic>(causal_attn<elu_plus_one>);
  try {
    cpu::gradient(other, tp, dout, Q = q, K = k, V = v);
    FAIL("no tape_error");
  } catch (lina::tape_error const& e) {
    CHECK(contains(e.what(), "holds the values of the plan rowdiv(contract("));
  }
  auto other_eps = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))), 1e-3) * V);
  static_assert(std::is_same_v<decltype(other_eps), decltype(plan)>);
  CHECK_THROWS_AS(cpu::gradient(other_eps, tp, dout, Q = q, K = k, V = v), lina::tape_error);
  // Inputs of other extents than the forward's: its value is named.
  auto q2 = tensor<double>::random({1, 2, 21, 4}, 5), k2 = tensor<double>::random({1, 2, 21, 4}, 6);
  auto v2 = tensor<double>::random({1, 2, 21, 3}, 7), dout2 = tensor<double>::random({1, 2, 21, 3}, 8);
  test::expect_shape_error([&] { cpu::gradient(plan, tp, dout2, Q = q2, K = k2, V = v2); }, "saved1", "N", 20, 21);
  // dout and the gradient views are checked as without a tape.
  test::expect_shape_error([&] { cpu::gradient(plan, tp, dout2, Q = q, K = k, V = v); }, "dout", "N", 21, 20);
  tensor<double> dq({1, 2, 20, 4}), dk({1, 2, 20, 4}), dv({1, 2, 20, 3});
  auto into = cpu::gradient_views<double>(plan);
  into[Q] = dq.view();
  into[K] = dq.view();
  into[V] = dv.view();
  CHECK_THROWS_AS(cpu::gradient_into(plan, into, tp, dout, Q = q, K = k, V = v), lina::alias_error);
  into[K] = dk.view();
  into[V] = wrong.view();
  test::expect_shape_error([&] { cpu::gradient_into(plan, into, tp, dout, Q = q, K = k, V = v); }, "∂V", "cols", 4, 3);
  for (std::size_t i = 0; i < dv.size(); ++i) REQUIRE(dv.data()[i] == 0);  // nothing was written
  // A tape filled without a state read by a block's backward, and one filled
  // through a state (its values are the block's from that state) by the
  // stateless backward.
  cpu::state<double> st, d_final;
  try {
    cpu::gradient(plan, tp, dout, st, d_final, Q = q, K = k, V = v);
    FAIL("no tape_error");
  } catch (lina::tape_error const& e) {
    CHECK(contains(e.what(), "filled without a state"));
  }
  cpu::tape<double> block;
  cpu::evaluate(plan, st, block, Q = q, K = k, V = v);
  try {
    cpu::gradient(plan, block, dout, Q = q, K = k, V = v);
    FAIL("no tape_error");
  } catch (lina::tape_error const& e) {
    CHECK(contains(e.what(), "filled through a state"));
  }
  // A state of other heads: refused before the tape or the state changes.
  cpu::state<double> other_heads(plan, 1, 3);
  CHECK_THROWS_AS(cpu::evaluate(plan, other_heads, block, Q = q, K = k, V = v), lina::shape_error);
  CHECK(block.filled());
}
