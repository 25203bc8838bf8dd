// The CUDA backend's forward kernels for attention built of several parts,
// without a GPU: cross-attention (K and V over another sequence than Q),
// stacked layers (one kernel per layer), strided layouts read and written
// in place and packed sequences of different lengths, through the host emulation against the CPU backend and the
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
      CONTEXT(cuda::spec_of(plan).description, cuda::name_of(dt), n, s, d, m);
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
      CONTEXT(cuda::name_of(dt), s.n, s.d, s.m);
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
        CONTEXT(cuda::name_of(dt), s.n);
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

// A stack chained through a state: one state per layer (state::layer), each
// layer's kernel the chained single-layer one. Uneven blocks against one pass
// of the stack and against the CPU's chained stack (outputs, and layer k's sums
// = the CPU's scan k); a failed block leaves every layer as it was.
TEST_CASE("stacked layers chain through a state per layer: blocks = one pass = the CPU's chained stack") {
  constexpr auto stack = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
  constexpr auto two = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto three = normalize(causal(phi<relu>(two) * transpose(phi<relu>(K2)))) * V2;
  test::rng r{76};
  auto check = [&](auto const& expr, std::size_t layers, shape s) {
    auto const plan = compile(expr);
    CONTEXT(layers, s.b, s.h, s.n, s.d, s.m);
    auto one = [&](std::size_t cols) { return tensor<float>::random({s.b, s.h, s.n, cols}, r.next()); };
    auto q = one(s.d), k = one(s.d), v = one(s.d), k2 = one(s.d), v2 = one(s.m);
    auto once = on_inputs_of(plan, [](auto const& p, auto const&... b) { return cuda::emulate(p, {}, b...); }, Q = q, K = k,
                             Vd = v, K2 = k2, V2 = v2);
    cuda::state st(cuda::memory::host);
    cpu::state<float> cst;
    tensor<float> got(once.shape()), on_cpu(once.shape());
    for (std::size_t at = 0; at < s.n;) {
      std::size_t const to = std::min(s.n, at + r.in(1, 80));
      auto rows = [&](tensor<float> const& x) { return test::tokens(x, at, to); };
      on_inputs_of(plan, [&](auto const& p, auto const&... b) { cuda::emulate_into(p, {}, rows_of(got, at, to), st, b...); },
                   Q = rows(q), K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
      auto y = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cpu::evaluate(p, cst, b...); }, Q = rows(q),
                            K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
      for (std::size_t i = 0; i < s.b; ++i)
        for (std::size_t j = 0; j < s.h; ++j)
          for (std::size_t t = at; t < to; ++t)
            for (std::size_t c = 0; c < s.m; ++c) on_cpu(i, j, t, c) = y(i, j, t - at, c);
      at = to;
    }
    CHECK(relative_rms(got, once) <= tolerance(cuda::dtype::f32));
    CHECK(relative_rms(got, on_cpu) <= tolerance(cuda::dtype::f32));
    REQUIRE(st.layers() == layers);
    REQUIRE(cst.scans() == layers);
    for (std::size_t x = 0; x < layers; ++x) {
      CAPTURE(x);
      REQUIRE(st.layer(x).shape() == cst[x].shape());
      CHECK(relative_rms(sums_of(st.layer(x)), dense(cst[x])) <= 1e-5);
    }
    CHECK_THROWS_WITH_AS(st.sums(), doctest::Contains("layer(k).sums()"), std::invalid_argument);
    // A copy carries every layer; reset zeroes them.
    cuda::state copy = cuda::to_host(st);
    REQUIRE(copy.layers() == layers);
    CHECK(relative_rms(sums_of(copy.layer(layers - 1)), sums_of(st.layer(layers - 1))) == 0);
    copy.reset();
    for (std::size_t x = 0; x < layers; ++x) CHECK(test::max_abs(sums_of(copy.layer(x))) == 0);
  };
  check(stack, 2, {2, 2, 150, 12, 9});
  check(stack, 2, {1, 3, 70, 5, 4});
  check(three, 3, {1, 2, 130, 8, 5});

  // A block whose top layer's state refuses it (another M than the state's)
  // runs nothing that stays: the lower layer, which ran, flips back.
  auto const plan = compile(stack);
  auto x = [](std::size_t n, std::size_t cols, std::uint64_t seed) { return tensor<float>::random({1, 1, n, cols}, seed); };
  cuda::state st(cuda::memory::host);
  tensor<float> out({1, 1, 20, 4}), other({1, 1, 20, 5});
  cuda::emulate_into(plan, {}, out.view(), st, Q = x(20, 6, 1), K = x(20, 6, 2), Vd = x(20, 6, 3), K2 = x(20, 6, 4),
                     V2 = x(20, 4, 5));
  tensor<float> const lower = sums_of(st.layer(0)), upper = sums_of(st.layer(1));
  CHECK_THROWS_AS(cuda::emulate_into(plan, {}, other.view(), st, Q = x(20, 6, 6), K = x(20, 6, 7), Vd = x(20, 6, 8),
                                     K2 = x(20, 6, 9), V2 = x(20, 5, 10)),
                  shape_error);
  CHECK(relative_rms(sums_of(st.layer(0)), lower) == 0);
  CHECK(relative_rms(sums_of(st.layer(1)), upper) == 0);
  // Packed sequences (chunked prefill of S prompts): layer by layer over the
  // whole pack, each layer's state a row per sequence — row s = the state of
  // sequence s chained alone; a stack's recurrent prefills the same way.
  {
    auto const seqs = sequences::from_lengths({30, 0, 45, 7});
    std::size_t const h = 2, d = 6, m = 4, total = seqs.total();
    auto p = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({1, h, total, cols}, seed); };
    auto q = p(d, 11), k = p(d, 12), v = p(d, 13), k2 = p(d, 14), v2 = p(m, 15);
    cuda::state packed(cuda::memory::host);
    auto got = cuda::emulate(plan, {}, packed, seqs, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
    CHECK(relative_rms(got, cuda::emulate(plan, {}, seqs, Q = q, K = k, Vd = v, K2 = k2, V2 = v2)) <= tolerance(cuda::dtype::f32));
    REQUIRE(packed.layers() == 2);
    auto rnn = cuda::recurrent(plan, seqs.count(), h, {}, cuda::memory::host);
    tensor<float> prefilled(got.shape());
    rnn.prefill_into(prefilled.view(), seqs, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
    CHECK(relative_rms(prefilled, got) <= tolerance(cuda::dtype::f32));
    for (std::size_t x = 0; x < seqs.count(); ++x) {
      CAPTURE(x);
      std::size_t const from = seqs.begin(x), to = from + seqs.length(x);
      cuda::state alone(cuda::memory::host);
      cuda::emulate(plan, {}, alone, Q = test::tokens(q, from, to), K = test::tokens(k, from, to),
                    Vd = test::tokens(v, from, to), K2 = test::tokens(k2, from, to), V2 = test::tokens(v2, from, to));
      for (std::size_t l = 0; l < 2; ++l) {
        CAPTURE(l);
        tensor<float> const all = sums_of(packed.layer(l)), by_rnn = sums_of(rnn.state(l));
        tensor<float> const one = sums_of(alone.layer(l));
        double worst = 0, scale = 0;
        for (std::size_t j = 0; j < h; ++j)
          for (std::size_t a = 0; a < one.shape()[2]; ++a)
            for (std::size_t c = 0; c < one.shape()[3]; ++c) {
              worst = std::max({worst, std::abs(double(all(x, j, a, c)) - one(0, j, a, c)),
                                std::abs(double(by_rnn(x, j, a, c)) - one(0, j, a, c))});
              scale = std::max(scale, std::abs(double(one(0, j, a, c))));
            }
        CHECK(worst <= 1e-5 * (1 + scale));
      }
    }
  }
  // A single layer's state is not a stack's, nor the reverse.
  cuda::state single(cuda::memory::host);
  cuda::emulate_into(compile(layer1), {}, tensor<float>({1, 1, 20, 6}).view(), single, Q = x(20, 6, 1), K = x(20, 6, 2),
                     Vd = x(20, 6, 3));
  CHECK_THROWS_AS(cuda::emulate_into(plan, {}, out.view(), single, Q = x(20, 6, 1), K = x(20, 6, 2), Vd = x(20, 6, 3),
                                     K2 = x(20, 6, 4), V2 = x(20, 4, 5)),
                  state_error);
  CHECK_THROWS_AS(cuda::emulate_into(compile(layer1), {}, tensor<float>({1, 1, 20, 6}).view(), st, Q = x(20, 6, 1),
                                     K = x(20, 6, 2), Vd = x(20, 6, 3)),
                  state_error);
}

// A stack's chained gradient: `initial`, `d_final` and the ∂initial returned
// hold a state per layer, each layer's chained backward starts from its own,
// and the forward below a layer runs from copies of its layers' states. Three
// uneven blocks differentiated last first (the middle one both takes and
// hands back ∂state) join to one backward of the whole stack; the first
// block's ∂initial, layer by layer, equals central differences in double of
// the loss through the whole sequence with respect to the initial sums (the
// CPU's chained forward). fp32 and bf16.
TEST_CASE("stacked layers: chained gradients, block by block from the last = one pass, ∂state = finite differences") {
  constexpr auto stack = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
  constexpr auto two = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto three = normalize(causal(phi<relu>(two) * transpose(phi<relu>(K2)))) * V2;
  test::rng r{78};
  double worst[2] = {0, 0}, worst_state[2] = {0, 0};
  auto check = [&](auto const& expr, std::size_t layers, shape s, cuda::dtype dt) {
    auto const plan = compile(expr);
    auto const linear = compile<order::linear>(expr);
    int const which = dt == cuda::dtype::f32 ? 0 : 1;
    CONTEXT(layers, cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
    auto one = [&](std::size_t cols) { return rounded(tensor<float>::random({s.b, s.h, s.n, cols}, r.next()), dt); };
    auto q = one(s.d), k = one(s.d), v = one(s.d), k2 = one(s.d), v2 = one(s.m), dout = one(s.m);
    cuda::options const opt{dt, dt, true};
    auto const whole = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cuda::emulate_gradient(p, opt, dout, b...); },
                                    Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
    std::size_t const c1 = r.in(1, s.n / 2), c2 = r.in(c1 + 1, s.n - 1), cut[] = {0, c1, c2, s.n};
    CONTEXT(c1, c2);
    std::vector<cuda::state> begin;  // the state each block starts from
    cuda::state st(cuda::memory::host);
    for (int x = 0; x < 3; ++x) {
      begin.push_back(cuda::to_host(st));
      auto rows = [&](tensor<float> const& t) { return test::tokens(t, cut[x], cut[x + 1]); };
      on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cuda::emulate(p, opt, st, b...); }, Q = rows(q),
                   K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
    }
    auto joined = whole;
    cuda::state d_final(cuda::memory::host);  // (unbound: zeros after the last block)
    for (int x = 2; x >= 0; --x) {
      auto rows = [&](tensor<float> const& t) { return test::tokens(t, cut[x], cut[x + 1]); };
      auto [g, d_initial] = on_inputs_of(
          plan, [&](auto const& p, auto const&... b) { return cuda::emulate_gradient(p, opt, rows(dout), begin[x], d_final, b...); },
          Q = rows(q), K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
      REQUIRE(d_initial.layers() == layers);
      for (std::size_t i = 0; i < g.all().size(); ++i)
        for_each_index(g.all()[i].shape(), [&](std::size_t b0, std::size_t h0, std::size_t t, std::size_t c) {
          joined.all()[i](b0, h0, cut[x] + t, c) = g.all()[i](b0, h0, t, c);
        });
      d_final = std::move(d_initial);
    }
    for (std::size_t i = 0; i < whole.all().size(); ++i) {
      CAPTURE(i);
      double const e = relative_rms(joined.all()[i], whole.all()[i]);
      CHECK(e <= tolerance(dt));
      worst[which] = std::max(worst[which], e / tolerance(dt));
    }
    // ∂ of the first block's initial sums (zeros): central differences of the
    // loss Σ dout·out through the whole sequence, the CPU's chained forward in
    // double (layer k = scan k of its state).
    auto loss = [&](cpu::state<double> st) {
      auto y = on_inputs_of(linear, [&](auto const& p, auto const&... b) { return cpu::evaluate(p, st, b...); },
                            Q = widened(q), K = widened(k), Vd = widened(v), K2 = widened(k2), V2 = widened(v2));
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y.data()[i] * dout.data()[i];
      return l;
    };
    cpu::state<double> zeros;  // (sized by a block of no tokens)
    auto none_of = [](tensor<float> const& t) { return tensor<double>({t.shape()[0], t.shape()[1], 0, t.shape()[3]}); };
    on_inputs_of(linear, [&](auto const& p, auto const&... b) { return cpu::evaluate(p, zeros, b...); }, Q = none_of(q),
                 K = none_of(k), Vd = none_of(v), K2 = none_of(k2), V2 = none_of(v2));
    REQUIRE(zeros.scans() == layers);
    for (std::size_t x = 0; x < layers; ++x) {
      CAPTURE(x);
      REQUIRE(d_final.layer(x).shape() == zeros[x].shape());
      tensor<float> fd(zeros[x].shape());
      for_each_index(fd.shape(), [&](auto... i) {
        double const eps = 1e-6;
        cpu::state<double> up = zeros, down = zeros;
        up[x](i...) += eps;
        down[x](i...) -= eps;
        fd(i...) = static_cast<float>((loss(std::move(up)) - loss(std::move(down))) / (2 * eps));
      });
      // (Layer x's ∂state comes through the ∂ rows of every layer above it,
      // each rounded to the output type, as its own are: layers - x output
      // roundings, that many tolerances — as the stateless stack's test says.)
      double const e = relative_rms(sums_of(d_final.layer(x)), fd), tol = double(layers - x) * tolerance(dt);
      CHECK(e <= tol);
      worst_state[which] = std::max(worst_state[which], e / tol);
    }
  };
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    check(stack, 2, {2, 2, 150, 12, 9}, dt);
    check(stack, 2, {1, 3, 70, 5, 4}, dt);
    check(two, 2, {1, 2, 90, 6, 6}, dt);
    check(three, 3, {1, 2, 130, 8, 5}, dt);
  }
  MESSAGE("chained stack gradients, largest error / tolerance: joined " << worst[0] << " (f32), " << worst[1]
                                                                      << " (bf16); ∂initial " << worst_state[0] << ", "
                                                                      << worst_state[1]);

  // Packed sequences through a stack's state (a row per sequence in every
  // layer): the pack's gradients and ∂initial rows = each sequence's own,
  // chained alone from the state its own prompt left.
  auto const plan = compile(stack);
  {
    auto const prompts = sequences::from_lengths({30, 0, 45, 7}), block = sequences::from_lengths({20, 11, 0, 33});
    std::size_t const h = 2, d = 6, m = 4;
    auto p = [&](sequences const& sq, std::size_t cols) { return tensor<float>::random({1, h, sq.total(), cols}, r.next()); };
    auto qa = p(prompts, d), ka = p(prompts, d), va = p(prompts, d), k2a = p(prompts, d), v2a = p(prompts, m);
    auto qb = p(block, d), kb = p(block, d), vb = p(block, d), k2b = p(block, d), v2b = p(block, m), dout = p(block, m);
    cuda::state st(cuda::memory::host), none(cuda::memory::host);
    cuda::emulate(plan, {}, st, prompts, Q = qa, K = ka, Vd = va, K2 = k2a, V2 = v2a);
    auto [g, d_a] = cuda::emulate_gradient(plan, {}, dout, st, none, block, Q = qb, K = kb, Vd = vb, K2 = k2b, V2 = v2b);
    REQUIRE(d_a.layers() == 2);
    for (std::size_t x = 0; x < block.count(); ++x) {
      CAPTURE(x);
      auto a = [&](tensor<float> const& t) { return test::tokens(t, prompts.begin(x), prompts.begin(x) + prompts.length(x)); };
      auto b = [&](tensor<float> const& t) { return test::tokens(t, block.begin(x), block.begin(x) + block.length(x)); };
      cuda::state alone(cuda::memory::host);
      cuda::emulate(plan, {}, alone, Q = a(qa), K = a(ka), Vd = a(va), K2 = a(k2a), V2 = a(v2a));
      auto [gx, dx] = cuda::emulate_gradient(plan, {}, b(dout), alone, none, Q = b(qb), K = b(kb), Vd = b(vb), K2 = b(k2b), V2 = b(v2b));
      for (std::size_t i = 0; i < g.all().size(); ++i)
        CHECK(max_abs_diff(b(g.all()[i]), gx.all()[i]) <= 1e-5 * (1 + test::max_abs(gx.all()[i])));
      for (std::size_t l = 0; l < 2; ++l) {
        tensor<float> const all = sums_of(d_a.layer(l)), own = sums_of(dx.layer(l));
        double worst_row = 0;
        for_each_index(own.shape(), [&](std::size_t, std::size_t j, std::size_t i, std::size_t c) {
          worst_row = std::max(worst_row, std::abs(double(all(x, j, i, c)) - own(0, j, i, c)));
        });
        CHECK(worst_row <= 1e-5 * (1 + test::max_abs(own)));
      }
    }
  }
  // States not of this stack are refused before anything runs: a single
  // layer's, another stack's (a layer more), another batch's.
  auto x = [](std::size_t b, std::size_t cols, std::uint64_t seed) { return tensor<float>::random({b, 1, 20, cols}, seed); };
  auto grad = [&](cuda::state const& initial, cuda::state const& d_final, std::size_t b) {
    return cuda::emulate_gradient(plan, {}, x(b, 4, 9), initial, d_final, Q = x(b, 6, 1), K = x(b, 6, 2), Vd = x(b, 6, 3),
                                  K2 = x(b, 6, 4), V2 = x(b, 4, 5));
  };
  cuda::state single(cuda::memory::host), other(cuda::memory::host), mine(cuda::memory::host), none(cuda::memory::host);
  cuda::emulate(compile(layer1), {}, single, Q = x(1, 6, 1), K = x(1, 6, 2), Vd = x(1, 6, 3));
  cuda::emulate(compile(three), {}, other, Q = x(1, 6, 1), K = x(1, 6, 2), Vd = x(1, 6, 3), K2 = x(1, 6, 4), V2 = x(1, 4, 5));
  cuda::emulate(plan, {}, mine, Q = x(1, 6, 1), K = x(1, 6, 2), Vd = x(1, 6, 3), K2 = x(1, 6, 4), V2 = x(1, 4, 5));
  CHECK_THROWS_WITH_AS(grad(single, none, 1), doctest::Contains("not to the stack"), state_error);
  CHECK_THROWS_WITH_AS(grad(none, other, 1), doctest::Contains("not to the stack"), state_error);
  CHECK_THROWS_AS(grad(mine, none, 2), shape_error);
  CHECK(grad(mine, none, 1).second.layers() == 2);
}

// A stack decodes token by token: a recurrent per layer (stack_rnn), each step
// each layer's step kernel in turn. A prompt then steps against one pass of
// the stack, and each layer's state against the chained stack's after the
// same tokens; fp32 and bf16 (the intermediate rows kept in the inputs' type,
// as the stateless stack keeps them).
TEST_CASE("stacked layers decode: a prompt then steps, a recurrent per layer = one pass") {
  constexpr auto stack = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
  constexpr auto two = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto three = normalize(causal(phi<relu>(two) * transpose(phi<relu>(K2)))) * V2;
  test::rng r{77};
  auto check = [&](auto const& expr, std::size_t layers, shape s, cuda::dtype dt) {
    auto const plan = compile(expr);
    CONTEXT(layers, cuda::name_of(dt), s.n);
    cuda::options const opt{dt, dt};
    auto one = [&](std::size_t cols) { return rounded(tensor<float>::random({s.b, s.h, s.n, cols}, r.next()), dt); };
    auto q = one(s.d), k = one(s.d), v = one(s.d), k2 = one(s.d), v2 = one(s.m);
    auto once = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cuda::emulate(p, opt, b...); }, Q = q, K = k,
                             Vd = v, K2 = k2, V2 = v2);
    auto rnn = cuda::recurrent(plan, s.b, s.h, opt, cuda::memory::host);
    tensor<float> got(once.shape());
    std::size_t const prompt = s.n / 2;
    auto rows = [&](tensor<float> const& x, std::size_t from, std::size_t to) { return test::tokens(x, from, to); };
    on_inputs_of(plan, [&](auto const&, auto const&... b) { rnn.prefill_into(rows_of(got, 0, prompt), b...); },
                 Q = rows(q, 0, prompt), K = rows(k, 0, prompt), Vd = rows(v, 0, prompt), K2 = rows(k2, 0, prompt),
                 V2 = rows(v2, 0, prompt));
    for (std::size_t t = prompt; t < s.n; ++t)
      on_inputs_of(plan, [&](auto const&, auto const&... b) { rnn.step_into(rows_of(got, t, t + 1), b...); },
                   Q = rows(q, t, t + 1), K = rows(k, t, t + 1), Vd = rows(v, t, t + 1), K2 = rows(k2, t, t + 1),
                   V2 = rows(v2, t, t + 1));
    CHECK(relative_rms(got, once) <= tolerance(dt));
    // Each layer's state = the chained stack's layer state after the same tokens.
    cuda::state st(cuda::memory::host);
    tensor<float> sink(once.shape());
    on_inputs_of(plan, [&](auto const& p, auto const&... b) { cuda::emulate_into(p, opt, sink.view(), st, b...); }, Q = q,
                 K = k, Vd = v, K2 = k2, V2 = v2);
    REQUIRE(st.layers() == layers);
    for (std::size_t x = 0; x < layers; ++x) {
      CAPTURE(x);
      CHECK(relative_rms(sums_of(rnn.state(x)), sums_of(st.layer(x))) <= tolerance(dt));
    }
    CHECK_THROWS_AS(rnn.state(layers), std::out_of_range);
    // A prompt prefilled in parallel (the chained stack's state), then steps from it: the same rows.
    auto from_prompt = cuda::recurrent(plan, s.b, s.h, opt, cuda::memory::host);
    cuda::state prompt_state(cuda::memory::host);
    tensor<float> prompt_rows({s.b, s.h, prompt, s.m}), stepped(once.shape());
    on_inputs_of(plan, [&](auto const& p, auto const&... b) { cuda::emulate_into(p, opt, prompt_rows.view(), prompt_state, b...); },
                 Q = rows(q, 0, prompt), K = rows(k, 0, prompt), Vd = rows(v, 0, prompt), K2 = rows(k2, 0, prompt),
                 V2 = rows(v2, 0, prompt));
    CHECK_THROWS_AS(from_prompt.set_state(cuda::state(cuda::memory::host)), state_error);  // unbound
    auto on_device = cuda::recurrent(plan, s.b, s.h, opt);  // (its state in device memory: made without a device)
    CHECK_THROWS_WITH_AS(on_device.set_state(cuda::to_host(st)), doctest::Contains("the other memory"),
                         std::invalid_argument);
    from_prompt.set_state(std::move(prompt_state));
    for (std::size_t t = prompt; t < s.n; ++t)
      on_inputs_of(plan, [&](auto const&, auto const&... b) { from_prompt.step_into(rows_of(stepped, t, t + 1), b...); },
                   Q = rows(q, t, t + 1), K = rows(k, t, t + 1), Vd = rows(v, t, t + 1), K2 = rows(k2, t, t + 1),
                   V2 = rows(v2, t, t + 1));
    CHECK(relative_rms(dense(test::tokens(stepped, prompt, s.n)), dense(test::tokens(once, prompt, s.n))) <= tolerance(dt));
    rnn.reset();
    for (std::size_t x = 0; x < layers; ++x) CHECK(test::max_abs(sums_of(rnn.state(x))) == 0);
  };
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    check(stack, 2, {2, 2, 40, 12, 9}, dt);
    check(three, 3, {1, 2, 37, 8, 5}, dt);
  }
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

// Packed sequences (lina/sequences.hpp): sequences of different lengths end
// to end in one batch row, each evaluated as a batch of one. The packed
// emulation, forward and backward, must equal each sequence copied out and
// emulated alone, bit for bit, and the CPU backend's packed evaluation to the
// dtype's tolerance; for
// causal, non-causal, softmax, a stack and a cross-attention (Q packed, K and V
// over S read whole by every sequence), with sequences of 0 and 1 rows.
namespace {
template <class X>
tensor<float> sequence_rows(X const& x, sequences const& seqs, std::size_t s) {
  auto v = view_of(x);
  tensor<float> t({1, v.shape()[1], seqs.length(s), v.shape()[3]});
  for (std::size_t h = 0; h < v.shape()[1]; ++h)
    for (std::size_t n = 0; n < seqs.length(s); ++n)
      for (std::size_t c = 0; c < v.shape()[3]; ++c) t(0, h, n, c) = v(0, h, seqs.begin(s) + n, c);
  return t;
}
// Counts the kernels the emulation runs (each still run by the interpreter).
struct kernel_count {
  static inline int runs = 0;
  static void run(cuda::program const& p, cuda::forward_args const& a, std::int64_t) {
    ++runs;
    auto const self = cuda::set_kernel_runner(nullptr);
    cuda::emulate(p, a);
    cuda::set_kernel_runner(self);
  }
  kernel_count() { runs = 0, previous = cuda::set_kernel_runner(&run); }
  ~kernel_count() { cuda::set_kernel_runner(previous); }
  kernel_count(kernel_count const&) = delete;
  kernel_count& operator=(kernel_count const&) = delete;
  cuda::kernel_runner previous;
};
// (cross: K and V have `keys` rows of their own, bound whole.)
template <class Expr>
void check_packed_emulation(Expr const& expr, std::uint64_t seed, bool cross = false) {
  auto const plan = plan_of(expr);
  test::rng r{seed};
  auto const seqs = sequences::from_lengths({70, 0, 1, 129, 5});
  std::size_t const h = 2, d = r.in(1, 40), m = r.in(1, 40), keys = cross ? 33 : seqs.total();
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CONTEXT(cuda::name_of(dt), d, m);
    auto one = [&](std::size_t rows, std::size_t cols) { return rounded(tensor<float>::random({1, h, rows, cols}, r.next()), dt); };
    auto q = one(seqs.total(), d), k = one(keys, d), v = one(keys, m);
    cuda::options const opt{dt, dt, true};
    kernel_count launches;
    auto got = cuda::emulate(plan, opt, seqs, Q = q, K = k, V = v);
    // one launch for the pack where the program is packable (a block per
    // sequence, head and M tile); else one per sequence that has rows
    auto spec = cuda::spec_of(plan, opt);
    spec.d = d, spec.m = m;
    bool const packable = cuda::packable(cuda::program_of(spec)) && !cross;
    CHECK(launches.runs == (packable ? 1 : 4));
    CHECK(relative_rms(got, cpu::evaluate(expr, seqs, Q = widened(q), K = widened(k), V = widened(v))) <= tolerance(dt));
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      auto alone = cross ? cuda::emulate(plan, opt, Q = sequence_rows(q, seqs, s), K = k, V = v)
                         : cuda::emulate(plan, opt, Q = sequence_rows(q, seqs, s), K = sequence_rows(k, seqs, s),
                                         V = sequence_rows(v, seqs, s));
      CHECK(max_abs_diff(sequence_rows(got, seqs, s), alone) == 0);
    }
    // The backward: each sequence's gradients in its rows; K and V of a
    // cross-attention (read whole by every sequence) get the sum of the
    // sequences' shares, added in sequence order as here. Its programs run
    // once for the pack where each is packable (their buffers by rows: ∂K,
    // ∂V, scratch), else once per sequence that has rows.
    auto dout = one(seqs.total(), m);
    kernel_count::runs = 0;
    auto g = cuda::emulate_gradient(plan, opt, dout, seqs, Q = q, K = k, V = v);
    auto const backward = cuda::backward_programs_of(spec);
    bool const packs_backward =
        !cross && std::all_of(backward.begin(), backward.end(), [](cuda::program const& p) { return cuda::packable(p); });
    CHECK(packs_backward == packable);  // (linear plans, no W: both)
    CHECK(kernel_count::runs == static_cast<int>(backward.size()) * (packs_backward ? 1 : 4));
    auto want = cpu::gradient(expr, widened(dout), seqs, Q = widened(q), K = widened(k), V = widened(v));
    auto sums = g;
    for (auto& x : sums.all()) x = tensor<float>(x.shape());
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      auto ds = sequence_rows(dout, seqs, s), qs = sequence_rows(q, seqs, s);
      auto gs = cross ? cuda::emulate_gradient(plan, opt, ds, Q = qs, K = k, V = v)
                      : cuda::emulate_gradient(plan, opt, ds, Q = qs, K = sequence_rows(k, seqs, s), V = sequence_rows(v, seqs, s));
      for (std::size_t i = 0; i < g.all().size(); ++i) {
        if (g.all()[i].shape()[2] == seqs.total()) {
          CHECK(max_abs_diff(sequence_rows(g.all()[i], seqs, s), gs.all()[i]) == 0);
        } else {
          for (std::size_t e = 0; e < gs.all()[i].size(); ++e) sums.all()[i].data()[e] += gs.all()[i].data()[e];
        }
      }
    }
    for (std::size_t i = 0; i < g.all().size(); ++i) {
      CHECK(relative_rms(g.all()[i], as_float(want.all()[i])) <= tolerance(dt));
      if (g.all()[i].shape()[2] != seqs.total()) CHECK(max_abs_diff(g.all()[i], sums.all()[i]) == 0);
    }
    // gradient_into: the same bits into the caller's views ([1, ΣN, H, C]
    // storage), from the one launch or sequence by sequence (the chunk-parallel
    // form asked for: never one launch).
    for (std::int64_t split : {0, 64}) {
      CAPTURE(split);
      cuda::options o = opt;
      o.split_rows = split;
      auto const expected = split ? cuda::emulate_gradient(plan, o, dout, seqs, Q = q, K = k, V = v) : g;
      std::vector<std::vector<float>> store;
      auto into = bnhc_views(cuda::emulate_gradient_views(plan), expected, store);
      cuda::emulate_gradient_into(plan, o, into, dout, seqs, Q = q, K = k, V = v);
      for (std::size_t i = 0; i < expected.all().size(); ++i) CHECK(max_abs_diff(into.all()[i], expected.all()[i]) == 0);
    }
  }
}
}  // namespace

TEST_CASE("packed sequences: each emulates as it would alone, and as the CPU backend's packed evaluation") {
  check_packed_emulation(causal_expr, 81);
  check_packed_emulation(full_expr, 82);
  check_packed_emulation(softmax_expr, 83);
  check_packed_emulation(phi<relu>(Q) * transpose(phi<relu>(Kx)) * Vx, 84, true);
  check_packed_emulation(causal(Q * transpose(K), head_decays({0.5, 0.9})) * V, 85);  // a decay per head (h = 2)
  // a stack: every input of both layers is cut, one launch per layer and sequence
  constexpr auto stack = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2;
  auto const plan = compile(stack);
  auto const seqs = sequences::from_lengths({40, 1, 0, 90});
  auto x = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({1, 2, seqs.total(), cols}, seed); };
  auto q = x(8, 1), k = x(8, 2), v = x(8, 3), k2 = x(8, 4), v2 = x(5, 5);
  auto got = cuda::emulate(plan, {}, seqs, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
  CHECK(relative_rms(got, cpu::evaluate(stack, seqs, Q = widened(q), K = widened(k), Vd = widened(v), K2 = widened(k2),
                                        V2 = widened(v2))) <= 1e-5);
  for (std::size_t s = 0; s < seqs.count(); ++s) {
    auto rows = [&](tensor<float> const& t) { return sequence_rows(t, seqs, s); };
    CHECK(max_abs_diff(sequence_rows(got, seqs, s),
                       cuda::emulate(plan, {}, Q = rows(q), K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2))) == 0);
  }
  // what the CPU backend refuses, this refuses too
  tensor<float> out({1, 2, seqs.total() + 1, 5});
  test::expect_shape_error([&] { cuda::emulate_into(plan, {}, out.view(), seqs, Q = q, K = k, Vd = v, K2 = k2, V2 = v2); },
                           "out", "rows", seqs.total() + 1, seqs.total());
  test::expect_shape_error([&] { (void)cuda::emulate(plan, {}, sequences::from_lengths({3}), Q = q, K = k, Vd = v, K2 = k2, V2 = v2); },
                           "Q", "N", seqs.total(), 3);
}

// Packed sequences through a state: one state row per sequence, two packed
// blocks chained (chunked prefill of sequences of different lengths, some of
// them empty in a block), then a decoding step at every sequence's own
// position. Each sequence's rows and state row must be those of the sequence
// chained alone, bit for bit, and the CPU backend's packed chaining to the
// dtype's tolerance.
namespace {
// Batch row s of a dense tensor, [1, H, ·, ·] (a state's sums: sums_of).
tensor<float> batch_row(tensor<float> const& all, std::size_t s) {
  tensor<float> r({1, all.shape()[1], all.shape()[2], all.shape()[3]});
  std::copy(all.data() + s * r.size(), all.data() + (s + 1) * r.size(), r.data());
  return r;
}
}  // namespace

// A backward too large for one block runs over slices of M's columns (D = M =
// 256: several programs sharing fp32 sums by rows): each slice's program runs
// once for the pack, and each sequence's gradients are its own alone, bit for bit.
TEST_CASE("packed sequences: a backward over slices of M's columns runs each slice once for the pack") {
  auto const plan = plan_of(causal_expr);
  auto const seqs = sequences::from_lengths({70, 0, 1, 40});
  std::size_t const d = 256, m = 256;
  auto spec = cuda::spec_of(plan);
  spec.d = d, spec.m = m;
  auto const ps = cuda::backward_programs_of(spec);
  REQUIRE(ps.size() >= 2);
  for (auto const& p : ps) CHECK(cuda::packable(p));
  auto x = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({1, 1, seqs.total(), cols}, seed); };
  auto q = x(d, 1), k = x(d, 2), v = x(m, 3), dout = x(m, 4);
  kernel_count launches;
  auto g = cuda::emulate_gradient(plan, {}, dout, seqs, Q = q, K = k, V = v);
  CHECK(kernel_count::runs == static_cast<int>(ps.size()));
  for (std::size_t s = 0; s < seqs.count(); ++s) {
    CAPTURE(s);
    auto rows = [&](tensor<float> const& t) { return sequence_rows(t, seqs, s); };
    auto alone = cuda::emulate_gradient(plan, {}, rows(dout), Q = rows(q), K = rows(k), V = rows(v));
    CHECK(max_abs_diff(rows(g[Q]), alone[Q]) == 0);
    CHECK(max_abs_diff(rows(g[K]), alone[K]) == 0);
    CHECK(max_abs_diff(rows(g[V]), alone[V]) == 0);
  }
}

// FAVOR+ packed: one backward launch writes ∂W per (sequence, head), summed
// over the pack in sequence order (add_program's kernel, a launch per
// sequence, each sum rounded to the output type as on the device) — each
// sequence's share as it would be alone, so the pack's gradients equal the
// sequences' own, bit for bit.
// gradient_into writes the same bits into the caller's views, from the one
// launch or sequence by sequence, and checks every view before writing any.
TEST_CASE("packed sequences: favor's backward in one launch, ∂W summed over the sequences, also into the caller's views") {
  auto const plan = compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V);
  auto const seqs = sequences::from_lengths({70, 0, 1, 129, 5});
  std::size_t const h = 2, d = 16, m = 12, f = 24;
  auto const projection = gaussian_projection<float>(d, f, 4);
  auto const w = broadcast(projection, 1, h);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    cuda::options const opt{dt, dt};
    auto x = [&](std::size_t cols, std::uint64_t seed) {
      return rounded(tensor<float>::random({1, h, seqs.total(), cols}, seed), dt);
    };
    auto q = x(d, 1), k = x(d, 2), v = x(m, 3), dout = x(m, 4);
    kernel_count launches;
    auto g = cuda::emulate_gradient(plan, opt, dout, seqs, Q = q, K = k, V = v, W = w);
    int const pack_launches = 1 + static_cast<int>(seqs.count());  // (the backward, then an add per sequence)
    CHECK(kernel_count::runs == pack_launches);
    tensor<float> sum_w(g[W].shape());
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      auto rows = [&](tensor<float> const& t) { return sequence_rows(t, seqs, s); };
      auto alone = cuda::emulate_gradient(plan, opt, rows(dout), Q = rows(q), K = rows(k), V = rows(v), W = w);
      CHECK(max_abs_diff(rows(g[Q]), alone[Q]) == 0);
      CHECK(max_abs_diff(rows(g[K]), alone[K]) == 0);
      CHECK(max_abs_diff(rows(g[V]), alone[V]) == 0);
      for (std::size_t i = 0; i < sum_w.size(); ++i) sum_w.data()[i] += alone[W].data()[i];
      sum_w = rounded(sum_w, dt);
    }
    CHECK(max_abs_diff(g[W], sum_w) == 0);
    // gradient_into: the one launch's bits; sequence by sequence (the
    // chunk-parallel form asked for), ∂W summed from one share buffer, as
    // emulate_gradient's per-sequence path sums new tensors.
    for (std::int64_t split : {0, 64}) {
      CAPTURE(split);
      cuda::options o = opt;
      o.split_rows = split;
      kernel_count::runs = 0;
      auto const expected = split ? cuda::emulate_gradient(plan, o, dout, seqs, Q = q, K = k, V = v, W = w) : g;
      int const sequence_by_sequence = kernel_count::runs;
      CHECK(sequence_by_sequence >= (split ? 4 : 0));  // (per sequence with rows)
      std::vector<std::vector<float>> store;
      auto into = bnhc_views(cuda::emulate_gradient_views(plan), expected, store);
      kernel_count::runs = 0;
      cuda::emulate_gradient_into(plan, o, into, dout, seqs, Q = q, K = k, V = v, W = w);
      CHECK(kernel_count::runs == (split ? sequence_by_sequence : pack_launches));
      for (std::size_t i = 0; i < expected.all().size(); ++i) CHECK(max_abs_diff(into.all()[i], expected.all()[i]) == 0);
      // Errors before any view is written (∂W's would be zeroed first, per sequence).
      std::vector<std::vector<float>> untouched;
      auto fresh = bnhc_views(cuda::emulate_gradient_views(plan), expected, untouched);
      auto wrong = fresh;
      wrong[V] = fresh[V].rows(0, seqs.total() - 1);
      test::expect_shape_error([&] { cuda::emulate_gradient_into(plan, o, wrong, dout, seqs, Q = q, K = k, V = v, W = w); },
                               "∂V", "rows", seqs.total() - 1, seqs.total());
      auto const other = sequences::from_lengths({70, 0, 1, 129, 4});
      CHECK_THROWS_AS(cuda::emulate_gradient_into(plan, o, fresh, dout, other, Q = q, K = k, V = v, W = w), shape_error);
      for (auto const& one : untouched) CHECK(std::all_of(one.begin(), one.end(), [](float x) { return x == 7.f; }));
    }
  }
  // Without a device the device form names itself.
  if (!cuda::probe_device().available) {
    float* const nowhere = nullptr;
    cuda::device_view<float> const dq(nowhere, {1, h, seqs.total(), d}), dv(nowhere, {1, h, seqs.total(), m}),
        dw(nowhere, {1, h, d, f});
    auto into = cuda::gradient_views<float>(plan);
    into[Q] = dq, into[K] = dq, into[V] = dv, into[W] = dw;
    CHECK_THROWS_WITH_AS(cuda::gradient_into(plan, into, dv, nullptr, seqs, Q = dq, K = dq, V = dv, W = dw),
                         doctest::Contains("cuda::gradient_into"), cuda::cuda_error);
  }
}

TEST_CASE("packed sequences through a state: each chained alone, the CPU's packed chaining, then a step each") {
  auto const plan = compile(causal_expr);
  auto const first = sequences::from_lengths({70, 0, 1, 129, 5}), second = sequences::from_lengths({3, 40, 0, 65, 1});
  std::size_t const count = first.count(), h = 2, d = 24, m = 17;
  test::rng r{91};
  // Two schedules: one launch for the pack, and (groups of rows requested)
  // one launch per sequence, each on its state row, a long one split.
  for (auto [dt, groups] : {std::pair{cuda::dtype::f32, 0}, std::pair{cuda::dtype::bf16, 0}, std::pair{cuda::dtype::f32, 2}}) {
    CONTEXT(cuda::name_of(dt), groups);
    cuda::options opt{dt, dt, true};
    opt.tiles.groups = groups;
    auto one = [&](std::size_t batch, std::size_t rows, std::size_t cols) {
      return rounded(tensor<float>::random({batch, h, rows, cols}, r.next()), dt);
    };
    auto q1 = one(1, first.total(), d), k1 = one(1, first.total(), d), v1 = one(1, first.total(), m);
    auto q2 = one(1, second.total(), d), k2 = one(1, second.total(), d), v2 = one(1, second.total(), m);
    cuda::state st(cuda::memory::host);
    kernel_count launches;
    auto y1 = cuda::emulate(plan, opt, st, first, Q = q1, K = k1, V = v1);
    if (groups == 0)
      CHECK(launches.runs == 1);
    else  // one or two (split: partials, then the scan) per sequence, the empty one too (its state row copied)
      CHECK(launches.runs > static_cast<int>(count));
    auto y2 = cuda::emulate(plan, opt, st, second, Q = q2, K = k2, V = v2);
    REQUIRE(st.shape()[0] == count);
    cpu::state<float> cst;
    CHECK(relative_rms(y1, cpu::evaluate(plan, cst, first, Q = q1, K = k1, V = v1)) <= tolerance(dt));
    CHECK(relative_rms(y2, cpu::evaluate(plan, cst, second, Q = q2, K = k2, V = v2)) <= tolerance(dt));
    CHECK(relative_rms(sums_of(st), sums_of(cst)) <= 1e-5);
    // Prompts through a recurrent (the same kernels, so the same bits), then a
    // step of every sequence from its own position.
    auto rnn = cuda::recurrent(plan, count, h, opt, cuda::memory::host);
    tensor<float> prompt(y1.shape());
    rnn.prefill_into(prompt.view(), first, Q = q1, K = k1, V = v1);
    CHECK(max_abs_diff(prompt, y1) == 0);
    auto qs = one(count, 1, d), ks = one(count, 1, d), vs = one(count, 1, m);
    auto step = rnn.step(Q = qs, K = ks, V = vs);
    for (std::size_t s = 0; s < count; ++s) {
      CAPTURE(s);
      auto rows = [&](tensor<float> const& x, sequences const& seqs) { return sequence_rows(x, seqs, s); };
      cuda::state alone(cuda::memory::host);
      auto a1 = cuda::emulate(plan, opt, alone, Q = rows(q1, first), K = rows(k1, first), V = rows(v1, first));
      CHECK(max_abs_diff(rows(y1, first), a1) == 0);
      auto token = [&](tensor<float> const& x) { return batch_row(x, s); };
      auto solo = cuda::recurrent(plan, 1, h, opt, cuda::memory::host);
      solo.set_state(cuda::to_host(alone));
      CHECK(max_abs_diff(solo.step(Q = token(qs), K = token(ks), V = token(vs)), token(step)) == 0);
      auto a2 = cuda::emulate(plan, opt, alone, Q = rows(q2, second), K = rows(k2, second), V = rows(v2, second));
      CHECK(max_abs_diff(rows(y2, second), a2) == 0);
      CHECK(max_abs_diff(batch_row(sums_of(st), s), sums_of(alone)) == 0);
    }
  }
  // Errors, before anything runs: a state of other rows, a state in device memory.
  auto const seqs = sequences::from_lengths({4, 6});
  auto q = tensor<float>::random({1, 2, 10, 8}, 1), k = tensor<float>::random({1, 2, 10, 8}, 2),
       v = tensor<float>::random({1, 2, 10, 3}, 3);
  cuda::state three(plan, 3, 2, cuda::memory::host);
  test::expect_shape_error([&] { (void)cuda::emulate(plan, {}, three, seqs, Q = q, K = k, V = v); }, "Q",
                           "sequences (of packed sequences)", 2, 3);
  auto rnn = cuda::recurrent(plan, 3, 2, {}, cuda::memory::host);
  tensor<float> out({1, 2, 10, 3});
  test::expect_shape_error([&] { rnn.prefill_into(out.view(), seqs, Q = q, K = k, V = v); }, "Q",
                           "sequences (of packed sequences)", 2, 3);
  cuda::state on_device(plan, 2, 2);
  CHECK_THROWS_WITH_AS(cuda::emulate_into(plan, {}, out.view(), on_device, seqs, Q = q, K = k, V = v),
                       doctest::Contains("cuda::to_host"), std::invalid_argument);
}

// Packed blocks chained through a state, differentiated last first: each
// block's backward is one launch for the pack, reading the state row of each
// sequence and writing its row of ∂(the state it started from) — equal to each
// sequence's two blocks differentiated alone, bit for bit (gradients and ∂S).
TEST_CASE("packed sequences through a state: the backward, block by block, = each sequence's own") {
  auto const plan = compile(causal_expr);
  auto const first = sequences::from_lengths({70, 0, 1, 129, 5}), second = sequences::from_lengths({3, 40, 0, 65, 1});
  std::size_t const count = first.count(), h = 2, d = 24, m = 17;
  test::rng r{93};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    cuda::options const opt{dt, dt};
    auto one = [&](std::size_t rows, std::size_t cols) { return rounded(tensor<float>::random({1, h, rows, cols}, r.next()), dt); };
    auto q1 = one(first.total(), d), k1 = one(first.total(), d), v1 = one(first.total(), m), d1 = one(first.total(), m);
    auto q2 = one(second.total(), d), k2 = one(second.total(), d), v2 = one(second.total(), m), d2 = one(second.total(), m);
    cuda::state st(cuda::memory::host);
    (void)cuda::emulate(plan, opt, st, first, Q = q1, K = k1, V = v1);
    cuda::state const after_first = st.copy_to(cuda::memory::host, nullptr, "test");
    kernel_count launches;
    auto [g2, ds2] = cuda::emulate_gradient(plan, opt, d2, after_first, cuda::state(cuda::memory::host), second,
                                            Q = q2, K = k2, V = v2);
    auto [g1, ds1] = cuda::emulate_gradient(plan, opt, d1, cuda::state(cuda::memory::host), ds2, first,
                                            Q = q1, K = k1, V = v1);
    CHECK(kernel_count::runs == 2);
    REQUIRE(ds1.shape()[0] == count);
    {  // gradient_into: the same bits into the caller's views, ∂S rows returned
      std::vector<std::vector<float>> store;
      auto into = bnhc_views(cuda::emulate_gradient_views(plan), g1, store);
      cuda::state const es1 = cuda::emulate_gradient_into(plan, opt, into, d1, cuda::state(cuda::memory::host), ds2, first,
                                                          Q = q1, K = k1, V = v1);
      CHECK(kernel_count::runs == 3);
      for (std::size_t i = 0; i < g1.all().size(); ++i) CHECK(max_abs_diff(into.all()[i], g1.all()[i]) == 0);
      CHECK(max_abs_diff(sums_of(es1), sums_of(ds1)) == 0);
    }
    for (std::size_t s = 0; s < count; ++s) {
      CAPTURE(s);
      auto rows = [&](tensor<float> const& x, sequences const& seqs) { return sequence_rows(x, seqs, s); };
      cuda::state alone(cuda::memory::host);
      (void)cuda::emulate(plan, opt, alone, Q = rows(q1, first), K = rows(k1, first), V = rows(v1, first));
      auto [a2, as2] = cuda::emulate_gradient(plan, opt, rows(d2, second), alone, cuda::state(cuda::memory::host),
                                              Q = rows(q2, second), K = rows(k2, second), V = rows(v2, second));
      auto [a1, as1] = cuda::emulate_gradient(plan, opt, rows(d1, first), cuda::state(cuda::memory::host), as2,
                                              Q = rows(q1, first), K = rows(k1, first), V = rows(v1, first));
      for (auto [got, want, seqs] : {std::tuple{&g1, &a1, &first}, std::tuple{&g2, &a2, &second}}) {
        CHECK(max_abs_diff(rows((*got)[Q], *seqs), (*want)[Q]) == 0);
        CHECK(max_abs_diff(rows((*got)[K], *seqs), (*want)[K]) == 0);
        CHECK(max_abs_diff(rows((*got)[V], *seqs), (*want)[V]) == 0);
      }
      CHECK(max_abs_diff(batch_row(sums_of(ds2), s), sums_of(as2)) == 0);
      CHECK(max_abs_diff(batch_row(sums_of(ds1), s), sums_of(as1)) == 0);
    }
  }
  // A state of other rows than sequences: a shape_error before anything runs.
  auto const seqs = sequences::from_lengths({4, 6});
  auto q = tensor<float>::random({1, 2, 10, 8}, 1), k = tensor<float>::random({1, 2, 10, 8}, 2),
       v = tensor<float>::random({1, 2, 10, 3}, 3), dout = tensor<float>::random({1, 2, 10, 3}, 4);
  cuda::state three(plan, 3, 2, cuda::memory::host);
  test::expect_shape_error(
      [&] { (void)cuda::emulate_gradient(plan, {}, dout, three, cuda::state(cuda::memory::host), seqs, Q = q, K = k, V = v); },
      "Q", "sequences (of packed sequences)", 2, 3);
}

// On a device: a few sequences, one long, are launched one by one, each with
// the schedule its length gets (the 4100-row one split along N where the
// device has idle SMs); many short ones in one launch, forward and backward. Against the packed
// emulation (one launch, unsplit: the same sums in another order, so to the
// forward and gradient tolerances rather than bit for bit).
namespace {
// gradient_into the caller's device tensors = cuda::gradient's, bit for bit.
template <class E, class Plan, class G, class Dout, class... B>
void check_packed_into(Plan const& plan, G const& g, Dout const& dout, sequences const& seqs, B const&... bindings) {
  std::vector<cuda::tensor<E>> mine;
  mine.reserve(g.all().size());
  auto into = cuda::gradient_views<E>(plan);
  for (std::size_t i = 0; i < g.all().size(); ++i) into.all()[i] = mine.emplace_back(g.all()[i].shape()).view();
  cuda::gradient_into(plan, into, dout, nullptr, seqs, bindings...);
  for (std::size_t i = 0; i < g.all().size(); ++i)
    CHECK(max_abs_diff(cuda::to_host(mine[i]), cuda::to_host(g.all()[i])) == 0);
}
}  // namespace

// On a device: a stack chained through device states (a layer each) against
// its emulation — two blocks' outputs and states, then the two blocks
// differentiated last first: gradients and every layer's ∂initial.
TEST_CASE("device: a stack chained through device states = its emulation, forward and gradients") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  auto const plan = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2);
  std::size_t const b = 2, h = 2, n = 300, d = 64, m = 48, cut = 117;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    auto one = [&](std::size_t cols, std::uint64_t seed) { return rounded(tensor<float>::random({b, h, n, cols}, seed), dt); };
    auto q = one(d, 1), k = one(d, 2), v = one(d, 3), k2 = one(d, 4), v2 = one(m, 5), dout = one(m, 6);
    cuda::options const opt{dt, dt};
    auto first = [&](tensor<float> const& t) { return test::tokens(t, 0, cut); };
    auto second = [&](tensor<float> const& t) { return test::tokens(t, cut, n); };
    cuda::state s1(cuda::memory::host), none(cuda::memory::host);
    cuda::emulate(plan, opt, s1, Q = first(q), K = first(k), Vd = first(v), K2 = first(k2), V2 = first(v2));
    auto [w2, e1] = cuda::emulate_gradient(plan, opt, second(dout), s1, none, Q = second(q), K = second(k), Vd = second(v),
                                           K2 = second(k2), V2 = second(v2));
    auto [w1, e0] = cuda::emulate_gradient(plan, opt, first(dout), none, e1, Q = first(q), K = first(k), Vd = first(v),
                                           K2 = first(k2), V2 = first(v2));
    cuda::state host(cuda::memory::host);
    tensor<float> want({b, h, n, m});
    auto go = [&]<class E>() {
      cuda::state st;
      cuda::tensor<E> out({b, h, n, m});
      for (auto [from, to] : {std::pair<std::size_t, std::size_t>{0, cut}, {cut, n}}) {
        auto rows = [&](tensor<float> const& x) { return test::tokens(x, from, to); };
        cuda::emulate_into(plan, {dt, dt}, rows_of(want, from, to), host, Q = rows(q), K = rows(k), Vd = rows(v),
                           K2 = rows(k2), V2 = rows(v2));
        cuda::evaluate_into(plan, out.view().rows(from, to - from), st, nullptr, Q = cuda::to_device<E>(rows(q)),
                            K = cuda::to_device<E>(rows(k)), Vd = cuda::to_device<E>(rows(v)),
                            K2 = cuda::to_device<E>(rows(k2)), V2 = cuda::to_device<E>(rows(v2)));
      }
      CHECK(relative_rms(cuda::to_host(out), want) <= forward_tolerance(dt));
      cuda::state const back = cuda::to_host(st);
      REQUIRE(back.layers() == 2);
      for (std::size_t x = 0; x < 2; ++x) CHECK(relative_rms(sums_of(back.layer(x)), sums_of(host.layer(x))) <= 1e-5);
      auto up = [](tensor_view<float const> t) { return cuda::to_device<E>(t); };
      cuda::state const ds1 = cuda::to_device(s1);
      auto [g2, d1] = cuda::gradient(plan, up(second(dout)), ds1, cuda::state(), nullptr, Q = up(second(q)), K = up(second(k)),
                                     Vd = up(second(v)), K2 = up(second(k2)), V2 = up(second(v2)));
      auto [g1, d0] = cuda::gradient(plan, up(first(dout)), cuda::state(), d1, nullptr, Q = up(first(q)), K = up(first(k)),
                                     Vd = up(first(v)), K2 = up(first(k2)), V2 = up(first(v2)));
      for (auto [got, wanted] : {std::pair{&g1, &w1}, std::pair{&g2, &w2}})
        for (std::size_t i = 0; i < wanted->all().size(); ++i)
          CHECK(relative_rms(cuda::to_host(got->all()[i]), wanted->all()[i]) <= gradient_tolerance(dt));
      cuda::state const h1 = cuda::to_host(d1), h0 = cuda::to_host(d0);
      REQUIRE(h0.layers() == 2);
      for (std::size_t l = 0; l < 2; ++l) {
        CHECK(relative_rms(sums_of(h1.layer(l)), sums_of(e1.layer(l))) <= gradient_tolerance(dt));
        CHECK(relative_rms(sums_of(h0.layer(l)), sums_of(e0.layer(l))) <= gradient_tolerance(dt));
      }
    };
    if (dt == cuda::dtype::f32)
      go.template operator()<float>();
    else
      go.template operator()<cuda::bf16>();
  }
}

TEST_CASE("device: a stack's decoding steps = their emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  auto const plan = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2);
  std::size_t const b = 4, h = 3, n = 40, d = 64, m = 64, prompt = 17;
  cuda::options const opt{cuda::dtype::bf16, cuda::dtype::bf16};
  auto one = [&](std::size_t cols, std::uint64_t seed) {
    return rounded(tensor<float>::random({b, h, n, cols}, seed), cuda::dtype::bf16);
  };
  auto q = one(d, 1), k = one(d, 2), v = one(d, 3), k2 = one(d, 4), v2 = one(m, 5);
  auto host = cuda::recurrent(plan, b, h, opt, cuda::memory::host);
  auto gpu = cuda::recurrent(plan, b, h, opt);
  tensor<float> want({b, h, n, m});
  cuda::tensor<cuda::bf16> got({b, h, n, m});
  auto up = [](tensor<float> const& x, std::size_t from, std::size_t to) { return cuda::to_device<cuda::bf16>(test::tokens(x, from, to)); };
  for (std::size_t t = 0; t < n; t = t == 0 ? prompt : t + 1) {
    std::size_t const to = t == 0 ? prompt : t + 1;
    auto rows = [&](tensor<float> const& x) { return test::tokens(x, t, to); };
    auto dq = up(q, t, to), dk = up(k, t, to), dv = up(v, t, to), dk2 = up(k2, t, to), dv2 = up(v2, t, to);
    if (t == 0) {
      host.prefill_into(rows_of(want, t, to), Q = rows(q), K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
      gpu.prefill_into(got.view().rows(t, to - t), nullptr, Q = dq, K = dk, Vd = dv, K2 = dk2, V2 = dv2);
    } else {
      host.step_into(rows_of(want, t, to), Q = rows(q), K = rows(k), Vd = rows(v), K2 = rows(k2), V2 = rows(v2));
      gpu.step_into(got.view().rows(t, to - t), nullptr, Q = dq, K = dk, Vd = dv, K2 = dk2, V2 = dv2);
    }
  }
  CHECK(relative_rms(cuda::to_host(got), want) <= forward_tolerance(cuda::dtype::bf16));
  for (std::size_t x = 0; x < 2; ++x)
    CHECK(relative_rms(sums_of(cuda::to_host(gpu.state(x))), sums_of(host.state(x))) <= 1e-5);
}

TEST_CASE("device: packed sequences = their emulation, forward and backward") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  auto const plan = compile(causal_expr);
  auto const seqs = sequences::from_lengths({300, 0, 1, 4100, 77});
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    auto one = [&](std::size_t cols, std::uint64_t seed) {
      return rounded(tensor<float>::random({1, 2, seqs.total(), cols}, seed), dt);
    };
    auto q = one(64, 1), k = one(64, 2), v = one(48, 3);
    auto want = cuda::emulate(plan, {dt, dt}, seqs, Q = q, K = k, V = v);
    auto dout = one(48, 4);
    auto want_g = cuda::emulate_gradient(plan, {dt, dt}, dout, seqs, Q = q, K = k, V = v);
    cuda::state host(cuda::memory::host);
    auto want_chained = cuda::emulate(plan, {dt, dt}, host, seqs, Q = q, K = k, V = v);
    auto go = [&]<class E>() {
      auto dq = cuda::to_device<E>(q), dk = cuda::to_device<E>(k), dv = cuda::to_device<E>(v);
      auto got = cuda::evaluate(plan, nullptr, seqs, Q = dq, K = dk, V = dv);
      CHECK(relative_rms(cuda::to_host(got), want) <= forward_tolerance(dt));
      auto g = cuda::gradient(plan, cuda::to_device<E>(dout), nullptr, seqs, Q = dq, K = dk, V = dv);
      for (std::size_t i = 0; i < g.all().size(); ++i)
        CHECK(relative_rms(cuda::to_host(g.all()[i]), want_g.all()[i]) <= gradient_tolerance(dt));
      check_packed_into<E>(plan, g, cuda::to_device<E>(dout), seqs, Q = dq, K = dk, V = dv);
      // Chained: a device state of one row per sequence, as the host state's;
      // the same prompts packed into a recurrent: the same launches, the same bits.
      cuda::state st;
      auto yc = cuda::evaluate(plan, st, nullptr, seqs, Q = dq, K = dk, V = dv);
      CHECK(relative_rms(cuda::to_host(yc), want_chained) <= forward_tolerance(dt));
      CHECK(relative_rms(sums_of(cuda::to_host(st)), sums_of(host)) <= 1e-5);
      // The chained backward from those state rows: one launch for the pack.
      auto want_c = cuda::emulate_gradient(plan, {dt, dt}, dout, host, cuda::state(cuda::memory::host), seqs,
                                           Q = q, K = k, V = v);
      auto got_c = cuda::gradient(plan, cuda::to_device<E>(dout), st, cuda::state(), nullptr, seqs, Q = dq, K = dk, V = dv);
      for (std::size_t i = 0; i < got_c.first.all().size(); ++i)
        CHECK(relative_rms(cuda::to_host(got_c.first.all()[i]), want_c.first.all()[i]) <= gradient_tolerance(dt));
      CHECK(relative_rms(sums_of(cuda::to_host(got_c.second)), sums_of(want_c.second)) <= 1e-5);
      {  // gradient_into: the same launch into the caller's tensors, ∂S returned
        std::vector<cuda::tensor<E>> mine;
        mine.reserve(got_c.first.all().size());
        auto into = cuda::gradient_views<E>(plan);
        for (std::size_t i = 0; i < got_c.first.all().size(); ++i)
          into.all()[i] = mine.emplace_back(got_c.first.all()[i].shape()).view();
        cuda::state const ds = cuda::gradient_into(plan, into, cuda::to_device<E>(dout), st, cuda::state(), nullptr, seqs,
                                                   Q = dq, K = dk, V = dv);
        for (std::size_t i = 0; i < mine.size(); ++i)
          CHECK(max_abs_diff(cuda::to_host(mine[i]), cuda::to_host(got_c.first.all()[i])) == 0);
        CHECK(max_abs_diff(sums_of(cuda::to_host(ds)), sums_of(cuda::to_host(got_c.second))) == 0);
      }
      auto rnn = cuda::recurrent(plan, seqs.count(), 2, {dt, dt});
      cuda::tensor<E> prompt(yc.shape(), "test");
      rnn.prefill_into(prompt.view(), nullptr, seqs, Q = dq, K = dk, V = dv);
      CHECK(max_abs_diff(cuda::to_host(prompt), cuda::to_host(yc)) == 0);
      CHECK(max_abs_diff(sums_of(cuda::to_host(rnn.state())), sums_of(cuda::to_host(st))) == 0);
    };
    if (dt == cuda::dtype::f32) go.template operator()<float>();
    if (dt == cuda::dtype::bf16) go.template operator()<cuda::bf16>();
  }
  // Many short sequences: enough blocks for the device, so one launch reads
  // the offsets (a few long ones, above, are launched one by one).
  std::vector<std::size_t> lengths(300);
  test::rng r{5};
  for (auto& n : lengths) n = r.in(0, 100);
  auto const many = sequences::from_lengths(lengths);
  auto q = tensor<float>::random({1, 2, many.total(), 64}, 6), k = tensor<float>::random({1, 2, many.total(), 64}, 7),
       v = tensor<float>::random({1, 2, many.total(), 48}, 8);
  cuda::state host(cuda::memory::host);
  auto want = cuda::emulate(plan, {}, host, many, Q = q, K = k, V = v);
  auto dq = cuda::to_device<float>(q), dk = cuda::to_device<float>(k), dv = cuda::to_device<float>(v);
  CHECK(relative_rms(cuda::to_host(cuda::evaluate(plan, nullptr, many, Q = dq, K = dk, V = dv)),
                     cuda::emulate(plan, {}, many, Q = q, K = k, V = v)) <= forward_tolerance(cuda::dtype::f32));
  cuda::state st;
  CHECK(relative_rms(cuda::to_host(cuda::evaluate(plan, st, nullptr, many, Q = dq, K = dk, V = dv)), want) <=
        forward_tolerance(cuda::dtype::f32));
  CHECK(relative_rms(sums_of(cuda::to_host(st)), sums_of(host)) <= 1e-5);
  auto dout = tensor<float>::random({1, 2, many.total(), 48}, 9);
  auto want_g = cuda::emulate_gradient(plan, {}, dout, many, Q = q, K = k, V = v);
  auto g = cuda::gradient(plan, cuda::to_device<float>(dout), nullptr, many, Q = dq, K = dk, V = dv);
  for (std::size_t i = 0; i < g.all().size(); ++i)
    CHECK(relative_rms(cuda::to_host(g.all()[i]), want_g.all()[i]) <= gradient_tolerance(cuda::dtype::f32));
  check_packed_into<float>(plan, g, cuda::to_device<float>(dout), many, Q = dq, K = dk, V = dv);
}
