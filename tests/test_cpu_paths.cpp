// The CPU backend, as properties of how inputs arrive and which path runs:
// grouped-query views, 64-bit offsets, static extents, a user's feature map,
// one long sequence split across threads, and the fast path against the simple
// path, its oracle (the orders' properties: test_cpu.cpp).
#include <doctest/doctest.h>

#include "cpu_props.hpp"

using namespace lina;
using namespace test::cpu_props;
using test::softplus;

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
    CONTEXT(n, h, d, m);
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
