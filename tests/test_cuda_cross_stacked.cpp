// The CUDA backend's forward kernels for attention built of several parts,
// without a GPU: cross-attention (K and V over another sequence than Q),
// stacked layers (one kernel per layer) and strided layouts read and written
// in place, through the host emulation against the CPU backend and the
// expression as written.
#include "cuda_support.hpp"

// Cross-attention: K and V over another sequence (S rows) than Q (N rows) —
// non-causal, so the passes over K and V walk S rows (forward_args::n_keys)
// and the kernels are the self-attention ones (the same sources: nothing new
// to compile). Forward and backward against the CPU backend and the
// expression as written, S < N, S > N, S or N zero, fp32 and bf16 (exact
// products: the per-dtype tolerance).
namespace {
template <class Expr>
void check_cross(Expr const& expr, std::uint64_t seed, std::size_t max_d = 40) {
  auto const plan = plan_of(expr);
  static_assert(cuda::lowerable<decltype(plan)>);
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (auto const& ns : {std::pair<std::size_t, std::size_t>{10, 130}, {130, 10}, {0, 7}, {7, 0}, {65, 64}, {1, 200}}) {
      std::size_t const n = ns.first, s = ns.second;  // (not a binding: Clang < 16 cannot capture one)
      std::size_t const d = r.in(1, max_d), m = r.in(1, 80), b = 2, h = 2;
      CAPTURE(cuda::spec_of(plan).description); CAPTURE(cuda::name_of(dt)); CAPTURE(n); CAPTURE(s); CAPTURE(d); CAPTURE(m);
      auto q = rounded(tensor<float>::random({b, h, n, d}, r.next()), dt);
      auto k = rounded(tensor<float>::random({b, h, s, d}, r.next()), dt);
      auto v = rounded(tensor<float>::random({b, h, s, m}, r.next()), dt);
      cuda::options const opt{dt, dt, true};
      auto got = cuda::emulate(plan, opt, Q = q, Kx = k, Vx = v);
      auto exact = cpu::evaluate(expr, Q = widened(q), Kx = widened(k), Vx = widened(v));
      CHECK(relative_rms(got, cpu::evaluate(plan, Q = q, Kx = k, Vx = v)) <= tolerance(dt));
      CHECK(relative_rms(got, exact) <= tolerance(dt));
      // The chunk-parallel form (linear plans): groups of K's rows for the sums, of Q's for the rows.
      cuda::options split = opt;
      split.split_rows = 64;
      CHECK(relative_rms(cuda::emulate(plan, split, Q = q, Kx = k, Vx = v), got) <= tolerance(dt));
      // (softmax: the key-major launch's blocks divide K's rows, its passes walk Q's)
      auto dout = rounded(tensor<float>::random({b, h, n, m}, r.next()), dt);
      auto g = cuda::emulate_gradient(plan, opt, dout, Q = q, Kx = k, Vx = v);
      auto want = cpu::gradient(expr, widened(dout), Q = widened(q), Kx = widened(k), Vx = widened(v));
      CHECK(g[Kx].shape() == k.shape());
      CHECK(g[Vx].shape() == v.shape());
      if (n > 1) {  // (one query row of a normalised plan: ∂Q, ∂K are eps-sized, see check_backward)
        CHECK(relative_rms(g[Q], as_float(want[Q])) <= tolerance(dt));
        CHECK(relative_rms(g[Kx], as_float(want[Kx])) <= tolerance(dt));
      }
      CHECK(relative_rms(g[Vx], as_float(want[Vx])) <= tolerance(dt));
      // The backward's chunk-parallel form (linear plans): the sums over groups of
      // K's rows, the rows and ∂Q over groups of Q's, ∂K and ∂V over K's again.
      auto gs = cuda::emulate_gradient(plan, split, dout, Q = q, Kx = k, Vx = v);
      double const same = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);
      if (n > 1) {
        CHECK(relative_rms(gs[Q], g[Q]) <= same);
        CHECK(relative_rms(gs[Kx], g[Kx]) <= same);
      }
      CHECK(relative_rms(gs[Vx], g[Vx]) <= same);
    }
}
}  // namespace

TEST_CASE("cross-attention (K, V over another sequence than Q): forward and backward = CPU backend = as written") {
  check_cross(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Kx))) * Vx, 51);
  check_cross(phi<relu>(Q) * transpose(phi<relu>(Kx)) * Vx, 52);
  check_cross(normalize(phi<poly2>(Q) * transpose(phi<poly2>(Kx))) * Vx, 53, 8);  // C = D(D+1)/2
  check_cross(normalize(exp(Q * transpose(Kx) * 0.25)) * Vx, 54);
  // One kernel for self- and cross-attention: the sources are the same.
  auto const self = compile<order::linear>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V);
  auto const cross = compile<order::linear>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Kx))) * Vx);
  CHECK(cuda::source(self, {}, D = 16, M = 8) == cuda::source(cross, {}, D = 16, M = 8));
  // A causal kernel needs K, V with Q's rows: the argument block is refused otherwise.
  auto p = cuda::program_of(compile<order::linear>(causal(Q * transpose(K)) * V), {}, D = 4, M = 4);
  std::vector<float> x(64);
  cuda::forward_args a;
  a.batch = a.heads = 1, a.n = 4, a.n_keys = 3;
  for (int i = 0; i < 3; ++i) a.in[i] = cuda::detail::dense_operand(x.data(), {1, 1, 4, 4});
  a.out = cuda::detail::dense_operand(x.data(), {1, 1, 4, 4});
  CHECK_THROWS_WITH_AS(cuda::emulate(p, a), doctest::Contains("as many rows as Q"), std::invalid_argument);
}

// Stacked layers: a layer's operand is another layer's attention (Q's side,
// K's, V's). The stack runs one kernel per layer, lower first; the
// intermediate is stored in the output type and read as the input type.
// fp32 against the CPU backend and the stack as written in double; bf16
// against the CPU's layers with the intermediate rounded to bf16 as the
// kernels store it.
namespace {
template <class Stack, class Flat>
void check_stack(Stack const& stack, Flat const& flat, std::uint64_t seed) {
  auto const plan = compile(stack);
  static_assert(cuda::lowerable<decltype(plan)>);
  test::rng r{seed};
  std::vector<shape> cases = {{1, 1, 0, 5, 3}, {1, 2, 1, 7, 4}, {2, 1, 65, 16, 9}};
  add_random_shapes(cases, r, 2, 0, 150);
  auto emulate = [](cuda::options o) { return [o](auto const& p, auto const&... b) { return cuda::emulate(p, o, b...); }; };
  auto on_cpu = [](auto const& p, auto const&... b) { return cpu::evaluate(p, b...); };
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape const& s : cases) {
      CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
      auto one = [&](std::size_t cols) { return rounded(tensor<float>::random({s.b, s.h, s.n, cols}, r.next()), dt); };
      auto q = one(s.d), k = one(s.d), v = one(s.d), q2 = one(s.d), k2 = one(s.d), v2 = one(s.m);
      auto got = on_inputs_of(plan, emulate({dt, dt, true}), Q = q, K = k, Vd = v, Q2 = q2, K2 = k2, V2 = v2);
      if (dt == cuda::dtype::f32) {
        CHECK(relative_rms(got, on_inputs_of(plan, on_cpu, Q = q, K = k, Vd = v, Q2 = q2, K2 = k2, V2 = v2)) <= tolerance(dt));
        auto exact = on_inputs_of(stack, on_cpu, Q = widened(q), K = widened(k), Vd = widened(v), Q2 = widened(q2),
                                  K2 = widened(k2), V2 = widened(v2));
        CHECK(relative_rms(got, exact) <= tolerance(dt));
      } else {
        auto mid = rounded(cpu::evaluate(compile(layer1), Q = q, K = k, Vd = v), dt);
        auto ref = on_inputs_of(compile(flat), on_cpu, L = mid, Q2 = q2, K2 = k2, V2 = v2);
        CHECK(relative_rms(got, ref) <= tolerance(dt));
      }
    }
}
}  // namespace

TEST_CASE("stacked layers: one kernel per layer = CPU backend = the stack as written") {
  // layer 1 as layer 2's query (Q's side)
  check_stack(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2,
              normalize(causal(phi<elu_plus_one>(L) * transpose(phi<elu_plus_one>(K2)))) * V2, 71);
  // as keys and values, non-causal, unnormalised poly2
  check_stack(phi<poly2>(Q2) * transpose(phi<poly2>(layer1)) * layer1, phi<poly2>(Q2) * transpose(phi<poly2>(L)) * L, 72);
  // Their gradients: the chain rule one layer at a time (each input belongs to one layer).
  {
    constexpr auto stack = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
    auto const plan = compile(stack);
    test::rng r{73};
    double worst = 0;
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
      for (shape const& s : {shape{2, 2, 70, 12, 9}, shape{1, 1, 1, 5, 3}}) {
        CAPTURE(cuda::name_of(dt)); CAPTURE(s.n);
        auto one = [&](std::size_t cols) { return rounded(tensor<float>::random({s.b, s.h, s.n, cols}, r.next()), dt); };
        auto q = one(s.d), k = one(s.d), v = one(s.d), k2 = one(s.d), v2 = one(s.m), dout = one(s.m);
        auto g = cuda::emulate_gradient(plan, {dt, dt, true}, dout, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
        auto want = cpu::gradient(stack, widened(dout), Q = widened(q), K = widened(k), Vd = widened(v), K2 = widened(k2),
                                  V2 = widened(v2));
        // Layer 1's gradients come through layer 2's ∂Q, rounded to the output
        // type before layer 1's backward reads it and rounded again after: two
        // output roundings, twice the tolerance. (One token: a normalised
        // layer's ∂Q, ∂K are eps-sized — see check_backward — and so is all
        // that layer 1 receives.)
        if (s.n > 1) {
          for (auto const& [x, ref, tol] : {std::tuple{&g[Q], &want[Q], 2 * tolerance(dt)}, {&g[K], &want[K], 2 * tolerance(dt)},
                                            {&g[Vd], &want[Vd], 2 * tolerance(dt)}, {&g[K2], &want[K2], tolerance(dt)}}) {
            double const e = relative_rms(*x, as_float(*ref));
            CHECK(e <= tol);
            worst = std::max(worst, e / tol);
          }
        }
        CHECK(relative_rms(g[V2], as_float(want[V2])) <= tolerance(dt));
      }
    MESSAGE("stacked gradients: largest error / tolerance " << worst);
  }
  // Layers that share an input (K in both; layer 1 read twice by the layer
  // above, as its Q and its V): that input's gradient is the sum of the two
  // layers' (add_program's kernel on a device). Against the stack's gradient
  // in double: layer 1's share is rounded twice (as above) and the sum once more.
  auto check_shared = [](auto const& stack, std::uint64_t seed, auto const&... names) {
    auto const plan = compile(stack);
    test::rng r{seed};
    double worst = 0;
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
      shape const s{2, 2, 70, 12, 12};
      CAPTURE(cuda::name_of(dt));
      auto one = [&](std::size_t cols) { return rounded(tensor<float>::random({s.b, s.h, s.n, cols}, r.next()), dt); };
      auto q = one(s.d), k = one(s.d), v = one(s.d), k2 = one(s.d), v2 = one(s.m), dout = one(s.m);
      auto g = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cuda::emulate_gradient(p, {dt, dt, true}, dout, b...); },
                            Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
      auto const wd = widened(dout);
      auto want = on_inputs_of(stack, [&](auto const& p, auto const&... b) { return cpu::gradient(p, wd, b...); },
                               Q = widened(q), K = widened(k), Vd = widened(v), K2 = widened(k2), V2 = widened(v2));
      auto compare = [&](auto const& x) {
        double const e = relative_rms(g[x], as_float(want[x])), tol = 3 * tolerance(dt);
        CHECK(e <= tol);
        worst = std::max(worst, e / tol);
      };
      (compare(names), ...);
    }
    MESSAGE("stacked gradients, a shared input: largest error / tolerance " << worst);
  };
  check_shared(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K)))) * V2, 74, Q, K, Vd, V2);
  check_shared(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1, 75, Q, K, Vd, K2);

  // three layers: the stack above as the query of a third
  constexpr auto two = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto three = normalize(causal(phi<relu>(two) * transpose(phi<relu>(K2)))) * V2;
  auto const plan = compile(three);
  static_assert(cuda::lowerable<decltype(plan)>);
  std::size_t const b = 1, h = 2, n = 90, d = 8, m = 5;
  auto x = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({b, h, n, cols}, seed); };
  auto q = x(d, 1), k = x(d, 2), v = x(d, 3), k2 = x(d, 4), v2 = x(m, 5);
  CHECK(relative_rms(cuda::emulate(plan, Q = q, K = k, Vd = v, K2 = k2, V2 = v2),
                     cpu::evaluate(three, Q = widened(q), K = widened(k), Vd = widened(v), K2 = widened(k2),
                                   V2 = widened(v2))) <= 1e-5);
}

TEST_CASE("emulation reads and writes strided layouts in place: [B,N,H,D] = [B,H,N,D]") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  std::size_t b = 2, h = 3, n = 77, d = 12, m = 10;
  auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2),
       v = tensor<float>::random({b, h, n, m}, 3);
  // The same values stored [B,N,H,C], seen through [B,H,N,C] views.
  auto relayout = [&](tensor<float> const& x) {
    auto s = x.shape();
    std::vector<float> store(x.size());
    strides4 st{static_cast<std::ptrdiff_t>(s[2] * s[1] * s[3]), static_cast<std::ptrdiff_t>(s[3]),
                static_cast<std::ptrdiff_t>(s[1] * s[3]), 1};
    tensor_view<float> view(store.data(), s, st);
    for (std::size_t i = 0; i < s[0]; ++i)
      for (std::size_t j = 0; j < s[1]; ++j)
        for (std::size_t r = 0; r < s[2]; ++r)
          for (std::size_t c = 0; c < s[3]; ++c) view(i, j, r, c) = x(i, j, r, c);
    return std::pair{std::move(store), st};
  };
  auto [qs, qst] = relayout(q);
  auto [ks, kst] = relayout(k);
  auto [vs, vst] = relayout(v);
  tensor_view<float const> qv(qs.data(), q.shape(), qst), kv(ks.data(), k.shape(), kst), vv(vs.data(), v.shape(), vst);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    cuda::options opt{dt, dt};
    auto dense = cuda::emulate(plan, opt, Q = q, K = k, V = v);
    auto strided = cuda::emulate(plan, opt, Q = qv, K = kv, V = vv);
    CHECK(max_abs_diff(dense, strided) == 0.0);
    // Into a [B,N,H,M] output.
    auto [os, ost] = relayout(tensor<float>({b, h, n, m}));
    tensor_view<float> ov(os.data(), {b, h, n, m}, ost);
    cuda::emulate_into(plan, opt, ov, Q = qv, K = kv, V = vv);
    CHECK(max_abs_diff(dense, ov) == 0.0);
  }
  tensor<float> wrong({b, h, n, m + 1});
  CHECK_THROWS_AS(cuda::emulate_into(plan, {}, wrong.view(), Q = q, K = k, V = v), shape_error);
}
