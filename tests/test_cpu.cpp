// The CPU backend, as properties over random shapes and signed inputs:
// linear and quadratic plans agree with each other and with the expression
// evaluated as written; causal plans agree with a masked loop written here;
// normalize behaves as a weighted average; layouts bind without copies.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <vector>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#include "support.hpp"

using namespace lina;
using test::softplus;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;  // dynamic, so shapes can be random
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);

struct shape {
  std::size_t b, h, n, d, m;
};

shape random_shape(test::rng& r) {
  shape s{r.in(1, 2), r.in(1, 3), test::length(r), r.in(1, 24), 0};
  do s.m = r.in(1, 24);
  while (s.m == s.d);
  return s;
}

// Evaluate the expression as written, its quadratic and its linear plan, and
// compare them with the independent reference loop (in double).
template <class T, class Map, class Expr>
void check_orders(Expr const& expr, bool causal, bool normalized, std::uint64_t seed) {
  test::rng r{seed};
  double worst = 0;  // largest error / bound seen, reported to show the bound is not slack
  for (int trial = 0; trial < test::trials(12); ++trial) {
    shape s = random_shape(r);
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<T>::random({s.b, s.h, s.n, s.m}, r.next());
    auto ref = test::reference_attention(q, k, v, [](double x) { return Map::value(x); }, causal, normalized);
    auto as_written = cpu::evaluate(expr, Q = q, K = k, V = v);
    auto quadratic = cpu::evaluate(compile<order::quadratic>(expr), Q = q, K = k, V = v);
    auto linear = cpu::evaluate(compile<order::linear>(expr), Q = q, K = k, V = v);
    auto automatic = cpu::evaluate(compile(expr), Q = q, K = k, V = v);
    // Terms per output: n similarities of d products each, times v. Unnormalised
    // sums scale with their size; normalised ones are averages of v (|v| < 1).
    double scale = normalized ? 1.0 : test::max_abs(ref);
    double bound = test::rounding_bound<T>(static_cast<double>(s.n * s.d), scale);
    CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
    for (auto const* out : {&as_written, &quadratic, &linear, &automatic}) {
      double err = max_abs_diff(*out, ref);
      CHECK(err <= bound);
      worst = std::max(worst, err / bound);
    }
  }
  MESSAGE("largest error / bound: " << worst);
}

double elu1(double x) { return elu_plus_one::value(x); }

// The same numbers stored [B,N,H,*], seen as [B,H,N,*] through strides.
template <class T>
struct bnhd {
  std::vector<T> buf;
  std::array<std::size_t, 4> shape;
  tensor_view<T> view() {
    auto [b, h, n, last] = shape;
    return {buf.data(), {b, h, n, last},
            strides4{std::ptrdiff_t(n * h * last), std::ptrdiff_t(last), std::ptrdiff_t(h * last), 1}};
  }
};
template <class T>
bnhd<T> bnhd_copy(tensor<T> const& t) {
  auto s = t.shape();
  bnhd<T> c{std::vector<T>(t.size()), {s[0], s[1], s[2], s[3]}};
  for (std::size_t i = 0; i < s[0]; ++i)
    for (std::size_t j = 0; j < s[1]; ++j)
      for (std::size_t x = 0; x < s[2]; ++x)
        for (std::size_t y = 0; y < s[3]; ++y) c.buf[((i * s[2] + x) * s[1] + j) * s[3] + y] = t(i, j, x, y);
  return c;
}

}  // namespace

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

// Grouped-query attention (GQA; MQA with one head of K and V): each of Hkv
// heads of K and V serves g = H / Hkv heads of Q. The inputs bind as views,
// without copies — Q as [B·Hkv, g, N, D], K and V as [B·Hkv, g, N, ·] with a
// zero head stride — and give attention on K, V repeated per query head.
// Gradients come per query head, in the views' shape: summed over the group,
// they are the shared heads' ∂K and ∂V.
TEST_CASE("grouped-query attention through views (a zero head stride) = K, V repeated per query head") {
  auto const plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  std::size_t const b = 2, hkv = 2, g = 3, h = hkv * g, n = 41, d = 6, m = 5;
  auto q = tensor<float>::random({b, h, n, d}, 11), k = tensor<float>::random({b, hkv, n, d}, 12),
       v = tensor<float>::random({b, hkv, n, m}, 13), dout = tensor<float>::random({b, h, n, m}, 14);
  auto const kr = test::repeat_heads(k, g), vr = test::repeat_heads(v, g);
  auto grouped = [&](tensor<float> const& x, bool shared) { return test::grouped_heads(x, g, shared); };
  auto const want = cpu::evaluate(plan, Q = q, K = kr, V = vr);
  auto const got = cpu::evaluate(plan, Q = grouped(q, false), K = grouped(k, true), V = grouped(v, true));
  CHECK(got.shape() == shape4{b * hkv, g, n, m});
  CHECK(max_abs_diff(tensor_view<float const>(got.data(), {b, h, n, m}), want) == 0);  // (the same rows, in the same order)

  auto const gw = cpu::gradient(plan, dout, Q = q, K = kr, V = vr);
  auto const gg = cpu::gradient(plan, tensor_view<float const>(dout.data(), {b * hkv, g, n, m}), Q = grouped(q, false),
                                K = grouped(k, true), V = grouped(v, true));
  CHECK(max_abs_diff(tensor_view<float const>(gg[Q].data(), {b, h, n, d}), gw[Q]) == 0);
  // Summed over each group (in double, in the same order): the shared heads' ∂K and ∂V.
  CHECK(max_abs_diff(test::sum_groups(gg[K], hkv, g, true), test::sum_groups(gw[K], hkv, g, false)) == 0);
  CHECK(max_abs_diff(test::sum_groups(gg[V], hkv, g, true), test::sum_groups(gw[V], hkv, g, false)) == 0);
}

// 64-bit offsets: the second batch of every operand lies 2³¹ + 2²⁰ elements
// past the first (an int32 offset wraps there: flash-linear-attention's users
// met that at B·T·H·K > 2³¹), in one block of address space of which only the
// used pages are backed (test::sparse_memory). Forward, into a far output too,
// and the gradients = the same on dense copies, bit for bit.
TEST_CASE("offsets past 2³¹ elements: batches 2³¹ apart = the same batches dense") {
  auto const plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  std::size_t const b = 2, h = 3, n = 50, d = 8, m = 6;
  auto q = tensor<float>::random({b, h, n, d}, 21), k = tensor<float>::random({b, h, n, d}, 22),
       v = tensor<float>::random({b, h, n, m}, 23), dout = tensor<float>::random({b, h, n, m}, 24);
  test::sparse_memory block(test::far_bytes<float>(b));
  auto fq = test::far_view<float>(block.data, 0, q.shape()), fk = test::far_view<float>(block.data, 1, k.shape()),
       fv = test::far_view<float>(block.data, 2, v.shape()), fo = test::far_view<float>(block.data, 3, v.shape());
  CHECK(fq.strides()[0] > std::numeric_limits<std::int32_t>::max());
  test::copy_into(fq, q), test::copy_into(fk, k), test::copy_into(fv, v);
  tensor_view<float const> const cq = fq, ck = fk, cv = fv;
  auto const want = cpu::evaluate(plan, Q = q, K = k, V = v);
  CHECK(max_abs_diff(cpu::evaluate(plan, Q = cq, K = ck, V = cv), want) == 0);
  cpu::evaluate_into(plan, fo, Q = cq, K = ck, V = cv);
  CHECK(max_abs_diff(fo, want) == 0);
  auto const gw = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  auto const gf = cpu::gradient(plan, dout, Q = cq, K = ck, V = cv);
  CHECK(max_abs_diff(gf[Q], gw[Q]) == 0);
  CHECK(max_abs_diff(gf[K], gw[K]) == 0);
  CHECK(max_abs_diff(gf[V], gw[V]) == 0);
}

TEST_CASE("the README program: static D and M, dynamic N") {
  constexpr auto Ds = dim<"D", 32>;
  constexpr auto Ms = dim<"M", 16>;
  constexpr auto Qs = input<"Q">(N, Ds);
  constexpr auto Ks = input<"K">(N, Ds);
  constexpr auto Vs = input<"V">(N, Ms);
  constexpr auto attn = normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs;
  for (std::size_t n : {1u, 22u, 23u, 24u, 100u}) {  // both sides of the select threshold
    auto q = tensor<float>::random({2, 3, n, 32}, 1), k = tensor<float>::random({2, 3, n, 32}, 2);
    auto v = tensor<float>::random({2, 3, n, 16}, 3);
    auto ref = test::reference_attention(q, k, v, elu1, true, true);
    CHECK(max_abs_diff(cpu::evaluate(compile(attn), Qs = q, Ks = k, Vs = v), ref) < 1e-5);
  }
}

// softplus is the user-defined map of docs/dsl.md (tests/support.hpp).
TEST_CASE_TEMPLATE("a user-defined feature map works like a built-in one", T, float, double) {
  static_assert(concepts::feature_map<softplus>);
  check_orders<T, softplus>(normalize(causal(phi<softplus>(Q) * transpose(phi<softplus>(K)))) * V, true, true, 11);
  check_orders<T, softplus>(phi<softplus>(Q) * transpose(phi<softplus>(K)) * V, false, false, 12);
}

// One long sequence and idle threads: the scans are split across threads
// (kernels::scan_rows_split, from N = cpu::sequence_split_min_rows). The
// result, the carried state and the gradients still agree with the
// independent references.
TEST_CASE_TEMPLATE("one long sequence split across threads agrees with the references", T, float, double) {
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  std::size_t n = 2 * static_cast<std::size_t>(cpu::sequence_split_min_rows) + 77, d = 6, m = 5;
  auto q = tensor<T>::random({1, 1, n, d}, 1), k = tensor<T>::random({1, 1, n, d}, 2);
  auto v = tensor<T>::random({1, 1, n, m}, 3);
  auto ref = test::reference_attention(q, k, v, [](double x) { return elu_plus_one::value(x); }, true, true);
  double bound = test::rounding_bound<T>(double(n * d), 1 + test::max_abs(ref));
  auto once = cpu::evaluate(compile<order::linear>(e), Q = q, K = k, V = v);
  CHECK(max_abs_diff(once, ref) <= bound);

  // two long blocks with a carried state (each split again) = one evaluation, to rounding
  cpu::state<T> st;
  std::size_t half = n / 2;
  auto y1 = cpu::evaluate(compile(e), st, Q = test::tokens(q, 0, half), K = test::tokens(k, 0, half), V = test::tokens(v, 0, half));
  auto y2 = cpu::evaluate(compile(e), st, Q = test::tokens(q, half, n), K = test::tokens(k, half, n), V = test::tokens(v, half, n));
  CHECK(max_abs_diff(y1, test::tokens(once, 0, half)) <= bound);
  CHECK(max_abs_diff(y2, test::tokens(once, half, n)) <= bound);
  double z = 0;  // the normaliser column of the final state: Σ_j φ(k_j)
  for (std::size_t j = 0; j < n; ++j) z += elu_plus_one::value(double(k(0, 0, j, 2)));
  CHECK(std::abs(st[0](0, 0, 2, m) - z) <= test::rounding_bound<T>(double(n), z));

  // the backward's prefix and suffix scans split too: linear = quadratic gradients
  auto dout = tensor<T>::random({1, 1, n, m}, 4);
  auto gl = cpu::gradient(compile<order::linear>(e), dout, Q = q, K = k, V = v);
  auto gq = cpu::gradient(compile<order::quadratic>(e), dout, Q = q, K = k, V = v);
  CHECK(max_abs_diff(gl[Q], gq[Q]) <= test::rounding_bound<T>(double(n * d * 4), 1 + test::max_abs(gq[Q])));
  CHECK(max_abs_diff(gl[K], gq[K]) <= test::rounding_bound<T>(double(n * d * 4), 1 + test::max_abs(gq[K])));
  CHECK(max_abs_diff(gl[V], gq[V]) <= test::rounding_bound<T>(double(n * d * 4), 1 + test::max_abs(gq[V])));
}

// The fast path (chunked scans, groups fused into them, the sequence split)
// against its oracle, the simple path (operands in full, the plain scan), in
// one process: forward, gradients and chained blocks with a state, on
// [B,N,H,D] views, N = 0, 1, around the chunk (64) and past the split.
template <class T, class Plan>
void fast_agrees_with_simple(Plan const& plan, std::uint64_t seed) {
  struct restore {
    cpu::path was = cpu::current_path();
    ~restore() { cpu::use_path(was); }
  } guard;
  test::rng r{seed};
  std::size_t split = 2 * static_cast<std::size_t>(cpu::sequence_split_min_rows) + 5;
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(63), std::size_t(64), std::size_t(65),
                        std::size_t(200), split, test::length(r)}) {
    std::size_t b = 1, h = n >= split ? 1 : r.in(1, 3), d = r.in(1, 24), m = r.in(1, 24);
    CAPTURE(n); CAPTURE(h); CAPTURE(d); CAPTURE(m);
    auto q = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next())), k = bnhd_copy(tensor<T>::random({b, h, n, d}, r.next()));
    auto v = bnhd_copy(tensor<T>::random({b, h, n, m}, r.next()));
    auto dout = tensor<T>::random({b, h, n, m}, r.next());
    struct results {
      tensor<T> out, dq, dk, dv, second, sums;
    };
    auto run = [&](cpu::path p) {
      cpu::use_path(p);
      auto qv = q.view(), kv = k.view(), vv = v.view();
      auto out = cpu::evaluate(plan, Q = qv, K = kv, V = vv);
      auto g = cpu::gradient(plan, dout, Q = qv, K = kv, V = vv);
      cpu::state<T> st;  // two blocks, the first ending off the chunk grid
      std::size_t cut = n / 3;
      auto block = [&](tensor_view<T> t, std::size_t from, std::size_t to) {
        return tensor_view<T const>(t.rows(from, to - from));
      };
      cpu::evaluate(plan, st, Q = block(qv, 0, cut), K = block(kv, 0, cut), V = block(vv, 0, cut));
      auto second = cpu::evaluate(plan, st, Q = block(qv, cut, n), K = block(kv, cut, n), V = block(vv, cut, n));
      tensor<T> sums({1, 1, d, m + 1});
      if (n > 0)
        for (std::size_t x = 0; x < d; ++x)
          for (std::size_t y = 0; y <= m; ++y) sums(0, 0, x, y) = st[0](0, 0, x, y);
      return results{std::move(out), std::move(g[Q]), std::move(g[K]), std::move(g[V]), std::move(second),
                     std::move(sums)};
    };
    results fast = run(cpu::path::fast), simple = run(cpu::path::simple);
    double bound = test::rounding_bound<T>(double(4 * n * d + 1), 1 + test::max_abs(simple.out));
    CHECK(max_abs_diff(fast.out, simple.out) <= bound);
    CHECK(max_abs_diff(fast.second, simple.second) <= bound);
    CHECK(max_abs_diff(fast.sums, simple.sums) <= test::rounding_bound<T>(double(4 * n + 1), 1 + test::max_abs(simple.sums)));
    CHECK(max_abs_diff(fast.dq, simple.dq) <= test::rounding_bound<T>(double(4 * n * d + 1), 1 + test::max_abs(simple.dq)));
    CHECK(max_abs_diff(fast.dk, simple.dk) <= test::rounding_bound<T>(double(4 * n * d + 1), 1 + test::max_abs(simple.dk)));
    CHECK(max_abs_diff(fast.dv, simple.dv) <= test::rounding_bound<T>(double(4 * n * d + 1), 1 + test::max_abs(simple.dv)));
  }
}

TEST_CASE_TEMPLATE("the fast path agrees with the simple path, its oracle", T, float, double) {
  fast_agrees_with_simple<T>(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V), 91);
  // a decayed mask: the register tiles decay their state (before a forward row, after a reverse one), not split
  fast_agrees_with_simple<T>(
      compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.97})) * V), 92);
}
