// The CUDA backend's kernels for the parametric maps without a GPU: favor and
// random Fourier features (φ of X·W), forward and backward (∂W per batch and
// head), linear and inside softmax, one W or a W per side, split over M's
// columns, cross-attention and chained, through the host emulation against
// the CPU backend and the expression in double.
#include "cuda_support.hpp"

#include <optional>

// The parametric maps (favor, random Fourier features): φ(X; W) reads x·W
// (a product into z, W loaded once per block from input slot 3), then a row
// map out of place. Against the CPU backend and the expression as written
// (W = a Gaussian projection shared by batch and heads, as broadcast() binds
// it), causal and not, normalised favor and signed, unnormalised rff;
// chained blocks = one pass. The tensor-core products: within the output's
// rounding plus 6u·Σ|terms|/|result| (rounding_bound's argument): favor's
// features are positive, so Σ|terms| is the plan on |V|; rff's features of
// a row have unit norm (Σ cos² + sin² = F/F), so by Cauchy–Schwarz a term
// |φ(q)·φ(k)|·|v| is at most |v|, and Σ|terms| ≤ Σ_j |v_j| over the keys a
// row reads.
namespace {
template <class Expr>
void check_parametric(Expr const& expr, std::uint64_t seed) {
  auto const plan = compile(expr);
  static_assert(cuda::lowerable<decltype(plan)>);
  auto const spec = cuda::spec_of(plan);
  CHECK(cuda::plan_text(spec) == cuda::plan_text(cuda::spec_of(compile<order::linear>(expr))));
  test::rng r{seed};
  std::vector<shape> cases = {{1, 2, 1, 7, 4}, {2, 1, 65, 16, 9}, {1, 1, 130, 32, 24}};
  add_random_shapes(cases, r, 2, 0, 200);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    double worst = 0, worst_mma = 0;
    for (shape const& s : cases) {
      std::size_t const f = r.in(1, 48);
      CONTEXT(cuda::name_of(dt), s.n, s.d, s.m, f);
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto w = rounded(gaussian_projection<float>(s.d, f, r.next()), dt);
      auto wb = broadcast(w, s.b, s.h);
      auto const wd = widened(w);
      auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v), W = broadcast(wd, s.b, s.h));
      cuda::options const opt{dt, dt, true};
      auto got = cuda::emulate(plan, opt, Q = q, K = k, V = v, W = wb);
      double const e1 = relative_rms(got, cpu::evaluate(plan, Q = q, K = k, V = v, W = wb)), e2 = relative_rms(got, exact);
      CHECK(e1 <= tolerance(dt));
      CHECK(e2 <= tolerance(dt));
      worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
      if (&s == &cases.front() && dt == cuda::dtype::f32) check_compiles(cuda::program_of(plan, opt, D = s.d, M = s.m, Fw = f));
      if (dt == cuda::dtype::f32) continue;
      cuda::options const fast{dt, dt};
      auto mma = cuda::emulate(plan, fast, Q = q, K = k, V = v, W = wb);
      tensor<double> terms(exact.shape());
      if (spec.map_q == cuda::feature_map::favor) {
        tensor<double> av(v.shape());
        for (std::size_t i = 0; i < v.size(); ++i) av.data()[i] = std::abs(static_cast<double>(v.data()[i]));
        terms = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = av, W = broadcast(wd, s.b, s.h));
      } else {  // Σ_j |v_j| over the keys row i reads
        for (std::size_t b = 0; b < s.b; ++b)
          for (std::size_t h = 0; h < s.h; ++h)
            for (std::size_t c = 0; c < s.m; ++c) {
              double total = 0, prefix = 0;
              for (std::size_t j = 0; j < s.n; ++j) total += std::abs(static_cast<double>(v(b, h, j, c)));
              for (std::size_t i = 0; i < s.n; ++i) {
                prefix += std::abs(static_cast<double>(v(b, h, i, c)));
                terms(b, h, i, c) = spec.causal ? prefix : total;
              }
            }
      }
      double num = 0, den = 0;
      for (std::size_t i = 0; i < terms.size(); ++i) num += terms.data()[i] * terms.data()[i];
      for (std::size_t i = 0; i < exact.size(); ++i) den += exact.data()[i] * exact.data()[i];
      double const bound = tolerance(dt) + (den == 0 ? 0.0 : 6 * operand_roundoff(dt) * std::sqrt(num / den));
      CAPTURE(bound);
      double const e3 = relative_rms(mma, exact);
      CHECK(e3 <= bound);
      worst_mma = std::max(worst_mma, e3 / bound);
      if (&s == &cases.front() && dt == cuda::dtype::bf16) check_compiles(cuda::program_of(plan, fast, D = s.d, M = s.m, Fw = f));
    }
    MESSAGE(cuda::name_of(dt) << " " << spec.description << ": largest error / tolerance: " << worst
                              << "; tensor-core products, error / bound: " << worst_mma);
  }
}
}  // namespace

TEST_CASE("emulated favor and random Fourier features (φ of X·W) = CPU backend = as written") {
  check_parametric(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 61);
  check_parametric(normalize(phi<favor>(Q, W) * transpose(phi<favor>(K, W))) * V, 62);
  check_parametric(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V, 63);
  check_parametric(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W)) * V, 64);
}

// φ(Q) and φ(K) with random projections of their own: φ(K)'s W is input slot 4
// (a second whole load into a second register). Against the CPU backend and
// the expression as written — linear causal and not, softmax, chained blocks;
// the same W given twice reproduces the one-W kernel bit for bit.
TEST_CASE("favor and random Fourier features with a W for φ(Q) and another for φ(K)") {
  constexpr auto W2 = input<"W2">(D, Fw);
  constexpr auto favor2 = normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)))) * V;
  constexpr auto rff2 = phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W2)) * V;
  constexpr auto soft2 = normalize(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)) * 0.01)) * V;  // (finite in fp32)
  constexpr auto plan = compile<order::linear>(favor2);
  auto const spec = cuda::spec_of(plan);
  CHECK(spec.w_name == "W");
  CHECK(spec.w_k_name == "W2");
  CHECK(cuda::plan_text(spec) == fmt::format("{}", plan));
  {  // (the DSL lowers a W per side only for one parametric map on both; a spec built by hand is refused)
    auto mixed = spec;
    mixed.d = mixed.m = mixed.f = 8;  // (as many features: F = D)
    mixed.map_k = cuda::feature_map::elu_plus_one;
    CHECK_THROWS_WITH_AS(cuda::program_of(mixed), doctest::Contains("one parametric map"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(cuda::program_of(mixed), doctest::Contains("one parametric map"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(cuda::backward_program_of(mixed), doctest::Contains("one parametric map"), std::invalid_argument);
  }
  test::rng r{65};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape const s : {shape{1, 2, 1, 7, 4}, shape{2, 1, 70, 16, 9}, shape{1, 2, 130, 24, 33}}) {
      std::size_t const f = r.in(1, 40);
      CONTEXT(cuda::name_of(dt), s.n, s.d, s.m, f);
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto const p1 = rounded(gaussian_projection<float>(s.d, f, r.next()), dt), p2 = rounded(gaussian_projection<float>(s.d, f, r.next()), dt);
      auto const w1 = broadcast(p1, s.b, s.h), w2 = broadcast(p2, s.b, s.h);
      auto const wd1 = widened(p1), wd2 = widened(p2);
      cuda::options const opt{dt, dt, true};
      auto check = [&](auto const& expr, auto const& p) {
        CAPTURE(cuda::spec_of(p).description);
        auto got = cuda::emulate(p, opt, Q = q, K = k, V = v, W = w1, W2 = w2);
        CHECK(relative_rms(got, cpu::evaluate(p, Q = q, K = k, V = v, W = w1, W2 = w2)) <= tolerance(dt));
        CHECK(relative_rms(got, cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v), W = broadcast(wd1, s.b, s.h),
                                              W2 = broadcast(wd2, s.b, s.h))) <= tolerance(dt));
        if (s.n == 70) check_compiles(cuda::program_of(p, opt, D = s.d, M = s.m, Fw = f));
      };
      check(favor2, plan);
      check(rff2, compile<order::linear>(rff2));
      check(soft2, compile(soft2));
      auto const one_w = cuda::emulate(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V),
                                       opt, Q = q, K = k, V = v, W = w1);
      auto const whole = cuda::emulate(plan, opt, Q = q, K = k, V = v, W = w1, W2 = w2);
      CHECK(max_abs_diff(cuda::emulate(plan, opt, Q = q, K = k, V = v, W = w1, W2 = w1), one_w) == 0.0);
      // Two chained blocks (each reading both W) = one pass.
      cuda::state st(plan, s.b, s.h, cuda::memory::host);
      tensor<float> out(whole.shape());
      std::size_t const cut = s.n / 3;
      for (auto [from, to] : {std::pair<std::size_t, std::size_t>{0, cut}, {cut, s.n}})
        cuda::emulate_into(plan, opt, rows_of(out, from, to), st, Q = test::tokens(q, from, to),
                           K = test::tokens(k, from, to), V = test::tokens(v, from, to), W = w1, W2 = w2);
      CHECK(relative_rms(out, whole) <= tolerance(dt));
      // Decoding: a prompt, then one token at a time (the step kernel reads both W).
      auto rnn = cuda::recurrent(plan, s.b, s.h, opt, cuda::memory::host);
      tensor<float> steps(whole.shape());
      rnn.prefill_into(rows_of(steps, 0, cut), Q = test::tokens(q, 0, cut), K = test::tokens(k, 0, cut),
                       V = test::tokens(v, 0, cut), W = w1, W2 = w2);
      for (std::size_t t = cut; t < s.n; ++t)
        rnn.step_into(rows_of(steps, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                      V = test::tokens(v, t, t + 1), W = w1, W2 = w2);
      CHECK(relative_rms(steps, whole) <= tolerance(dt));
    }
}

namespace {

// favor and random Fourier features: the backward reloads x, z = x·W, turns z
// into ∂z (map_grad), ∂X = ∂z·Wᵀ (− s·x·Σ∂z for favor's norm: param_grad), and
// sums xᵀ·∂z over Q's and K's rows into ∂W per (batch, head), stored once at
// the end (inside softmax: by a third launch, from the ∂φ rows the two
// quadratic ones stored). Against cpu::gradient of the plan and of the
// expression in double (exact products: the per-dtype tolerance; a linear
// plan's bf16 on the tensor cores: the expression's, within the bound of the
// other linear backward tests), one W and a W for each side.
std::vector<shape> const parametric_shapes = {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}, {1, 1, 130, 20, 7}};
template <class Expr, class... W>
void check_parametric_backward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, std::size_t features,
                               bool compiles, W const&... ws) {
  auto const plan = plan_of(expr);
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    double worst = 0, worst_mma = 0;
    for (shape const s : cases) {
      // F: given, or drawn (F = 1 leaves a normalised favor row φ(q)-free but for eps: ∂Q is noise)
      std::size_t const f = features ? features : r.in(2, 24);
      CONTEXT(cuda::name_of(dt), s.n, s.d, s.m, f);
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
      std::vector<tensor<float>> proj;  // one projection per W symbol, shared by batch and heads
      for (std::size_t i = 0; i < sizeof...(W); ++i) proj.push_back(rounded(gaussian_projection<float>(s.d, f, r.next()), dt));
      std::vector<tensor<double>> projd;
      for (auto const& x : proj) projd.push_back(widened(x));
      auto const [wb, wd] = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return std::pair{std::tuple{(ws = broadcast(proj[I], s.b, s.h))...}, std::tuple{(ws = broadcast(projd[I], s.b, s.h))...}};
      }(std::index_sequence_for<W...>{});
      cuda::options const opt{dt, dt, true};
      auto g = std::apply([&](auto const&... w) { return cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v, w...); }, wb);
      auto cpu = std::apply([&](auto const&... w) { return cpu::gradient(plan, dout, Q = q, K = k, V = v, w...); }, wb);
      auto exact = std::apply(
          [&](auto const&... w) { return cpu::gradient(expr, widened(dout), Q = widened(q), K = widened(k), V = widened(v), w...); }, wd);
      // bf16 on the tensor cores too (linear plans: inside softmax's exp a
      // score's rounding error grows with the score, which this bound does not
      // count): every product operand rounded to bf16 as it is read.
      using grads = decltype(g);
      std::optional<grads> mma;
      if (dt != cuda::dtype::f32 && !cuda::spec_of(plan).softmax)
        mma = std::apply([&](auto const&... w) { return cuda::emulate_gradient(plan, {dt, dt}, dout, Q = q, K = k, V = v, w...); }, wb);
      bool const normalized = cuda::spec_of(plan).normalized;
      auto one = [&](auto const& x, std::string const& name) {
        CAPTURE(name);
        REQUIRE(g[x].shape() == cpu[x].shape());
        // (the CPU lays out the gradient of a broadcast W by its strides: compare elements, not memory)
        double const e1 = relative_rms(g[x], dense(cpu[x])), e2 = relative_rms(g[x], as_float(dense(exact[x])));
        CHECK(e1 <= tolerance(dt));
        CHECK(e2 <= tolerance(dt));
        worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
        if (mma) {
          double const bound = backward_mma_bound(dt, normalized);
          double const e = relative_rms((*mma)[x], as_float(dense(exact[x])));
          CAPTURE(bound);
          CHECK(e <= bound);
          worst_mma = std::max(worst_mma, e / bound);
        }
      };
      one(Q, "∂Q");
      one(K, "∂K");
      one(V, "∂V");
      (one(ws, "∂W"), ...);
      // A causal linear plan's chunk-parallel form, groups of one chunk: each
      // group's share of ∂W, added in the groups' order by a fourth launch.
      auto split_spec = cuda::spec_of(plan, opt);
      split_spec.d = s.d, split_spec.m = s.m, split_spec.f = f;
      if (auto const sp = cuda::split_backward_programs_of(split_spec); !sp.empty()) {
        cuda::options split = opt;
        split.split_rows = sp[0].tiles.chunk;
        auto gs = std::apply([&](auto const&... w) { return cuda::emulate_gradient(plan, split, dout, Q = q, K = k, V = v, w...); }, wb);
        double const same = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);
        auto agree = [&](auto const& x, std::string const& name) {
          CAPTURE(name);
          CHECK(relative_rms(gs[x], g[x]) <= same);
        };
        agree(Q, "split ∂Q");
        agree(K, "split ∂K");
        agree(V, "split ∂V");
        (agree(ws, "split ∂W"), ...);
        if (compiles && s.n == 70 && dt == cuda::dtype::f32)
          for (auto const& p : sp) check_compiles(p);
      }
      auto spec = cuda::spec_of(plan, opt);
      spec.d = s.d, spec.m = s.m, spec.f = f;
      if (compiles && s.n == 70 && dt == cuda::dtype::f32)
        for (auto const& p : cuda::backward_programs_of(spec)) check_compiles(p);
    }
    MESSAGE(cuda::name_of(dt) << " " << cuda::spec_of(plan).description << " backward: largest error / tolerance: " << worst
                              << "; tensor-core products, error / bound: " << worst_mma);
  }
}

}  // namespace

TEST_CASE("backward: favor and random Fourier features (∂W per batch and head) = cpu::gradient = the expression's") {
  constexpr auto W2 = input<"W2">(D, Fw);
  check_parametric_backward(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 101, parametric_shapes, 0, true, W);
  check_parametric_backward(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W)) * V, 102, parametric_shapes, 0, true, W);
  check_parametric_backward(normalize(phi<favor>(Q, W) * transpose(phi<favor>(K, W2))) * V, 103, parametric_shapes, 0, true, W, W2);
  check_parametric_backward(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W2))) * V, 104, parametric_shapes, 0, true, W, W2);
  // Inside softmax's exp: causal and not, normalised and not, one W and two.
  check_parametric_backward(normalize(causal(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * 0.5))) * V, 110, parametric_shapes, 0, true, W);
  check_parametric_backward(normalize(exp(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W2)))) * V, 111, parametric_shapes, 0, true, W, W2);
  check_parametric_backward(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)) * 0.25) * V, 112, parametric_shapes, 0, true, W, W2);
  // A C × (M+1) state too large for one block (F = M = 256): launches over
  // slices of M's columns, each adding its share of ∂W (and of ∂Q, ∂K).
  check_parametric_backward(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 114, {{1, 1, 70, 8, 256}},
                            256, true, W);
  check_parametric_backward(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W2)) * V, 115, {{2, 1, 70, 8, 200}},
                            128, false, W, W2);  // (kernels like the one above: not compiled again)
  {  // Cross-attention inside exp: the third launch walks K's N_keys rows (N_keys ≠ N, either zero).
    constexpr auto S = dim<"S">;
    constexpr auto Kc = input<"K">(S, D);
    constexpr auto Vc = input<"V">(S, M);
    auto const expr = normalize(exp(phi<favor>(Q, W) * transpose(phi<favor>(Kc, W)) * 0.5)) * Vc;
    auto const plan = compile(expr);
    test::rng r{113};
    for (auto const& ns : {std::pair<std::size_t, std::size_t>{10, 130}, {130, 10}, {0, 7}, {7, 0}}) {
      std::size_t const n = ns.first, s = ns.second;  // (not a binding: Clang < 16 cannot capture one)
      std::size_t const b = 2, h = 1, d = 12, m = 9, f = 16;
      CONTEXT(n, s);
      auto q = tensor<float>::random({b, h, n, d}, r.next()), k = tensor<float>::random({b, h, s, d}, r.next());
      auto v = tensor<float>::random({b, h, s, m}, r.next()), dout = tensor<float>::random({b, h, n, m}, r.next());
      auto const w = gaussian_projection<float>(d, f, r.next());
      auto const wd = widened(w);
      auto g = cuda::emulate_gradient(plan, {cuda::dtype::f32, cuda::dtype::f32, true}, dout, Q = q, Kc = k, Vc = v,
                                      W = broadcast(w, b, h));
      auto want = cpu::gradient(expr, widened(dout), Q = widened(q), Kc = widened(k), Vc = widened(v), W = broadcast(wd, b, h));
      CHECK(relative_rms(g[Q], as_float(want[Q])) <= tolerance(cuda::dtype::f32));
      CHECK(relative_rms(g[Kc], as_float(want[Kc])) <= tolerance(cuda::dtype::f32));
      CHECK(relative_rms(g[Vc], as_float(want[Vc])) <= tolerance(cuda::dtype::f32));
      CHECK(relative_rms(g[W], as_float(dense(want[W]))) <= tolerance(cuda::dtype::f32));
    }
  }
  {  // Linear cross-attention split (non-causal): φ(Q)'s shares of ∂W per group of Q's rows, φ(K)'s per
     // group of K's rows (N_keys ≠ N: each side its own count of groups), one W and a W per side.
    constexpr auto S = dim<"S">;
    constexpr auto Kc = input<"K">(S, D);
    constexpr auto Vc = input<"V">(S, M);
    constexpr auto W2 = input<"W2">(D, Fw);
    auto const one_w = compile<order::linear>(normalize(phi<favor>(Q, W) * transpose(phi<favor>(Kc, W))) * Vc);
    auto const two_w = compile<order::linear>(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(Kc, W2)) * Vc);
    test::rng r{116};
    for (auto const& ns : {std::pair<std::size_t, std::size_t>{20, 130}, {130, 20}, {65, 64}}) {
      std::size_t const n = ns.first, s = ns.second;  // (not a binding: Clang < 16 cannot capture one)
      std::size_t const b = 2, h = 1, d = 12, m = 9, f = 16;
      CONTEXT(n, s);
      auto q = tensor<float>::random({b, h, n, d}, r.next()), k = tensor<float>::random({b, h, s, d}, r.next());
      auto v = tensor<float>::random({b, h, s, m}, r.next()), dout = tensor<float>::random({b, h, n, m}, r.next());
      auto const p1 = gaussian_projection<float>(d, f, r.next()), p2 = gaussian_projection<float>(d, f, r.next());
      auto const w = broadcast(p1, b, h), w2 = broadcast(p2, b, h);  // (views of p1, p2)
      cuda::options opt{cuda::dtype::f32, cuda::dtype::f32, true};
      opt.tiles = {16, 0};
      cuda::options split = opt;
      split.split_rows = 32;  // groups of two chunks: 1 and 5, 5 and 1, 3 and 2 of Q's and K's rows
      auto g = cuda::emulate_gradient(one_w, opt, dout, Q = q, Kc = k, Vc = v, W = w);
      auto gs = cuda::emulate_gradient(one_w, split, dout, Q = q, Kc = k, Vc = v, W = w);
      auto want = cpu::gradient(one_w, dout, Q = q, Kc = k, Vc = v, W = w);
      CHECK(relative_rms(g[W], dense(want[W])) <= tolerance(cuda::dtype::f32));
      for (auto const& [x, y] : {std::pair{&gs[Q], &g[Q]}, {&gs[Kc], &g[Kc]}, {&gs[Vc], &g[Vc]}, {&gs[W], &g[W]}})
        CHECK(relative_rms(*x, *y) <= 1e-5);
      auto h2 = cuda::emulate_gradient(two_w, opt, dout, Q = q, Kc = k, Vc = v, W = w, W2 = w2);
      auto hs = cuda::emulate_gradient(two_w, split, dout, Q = q, Kc = k, Vc = v, W = w, W2 = w2);
      auto want2 = cpu::gradient(two_w, dout, Q = q, Kc = k, Vc = v, W = w, W2 = w2);
      CHECK(relative_rms(h2[W2], dense(want2[W2])) <= tolerance(cuda::dtype::f32));
      for (auto const& [x, y] : {std::pair{&hs[Q], &h2[Q]}, {&hs[Kc], &h2[Kc]}, {&hs[Vc], &h2[Vc]}, {&hs[W], &h2[W]},
                                 {&hs[W2], &h2[W2]}})
        CHECK(relative_rms(*x, *y) <= 1e-5);
    }
  }
  // Chained: two blocks differentiated last first; their ∂W add up to the one pass's.
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V);
  std::size_t const b = 2, h = 2, n = 100, d = 12, m = 9, f = 16, cut = 37;
  auto q = tensor<float>::random({b, h, n, d}, 105), k = tensor<float>::random({b, h, n, d}, 106),
       v = tensor<float>::random({b, h, n, m}, 107), dout = tensor<float>::random({b, h, n, m}, 108);
  auto const w = gaussian_projection<float>(d, f, 109);
  auto const wb = broadcast(w, b, h);
  auto whole = cuda::emulate_gradient(plan, {}, dout, Q = q, K = k, V = v, W = wb);
  auto first = [&](tensor<float> const& x) { return test::tokens(x, 0, cut); };
  auto second = [&](tensor<float> const& x) { return test::tokens(x, cut, n); };
  cuda::state s1(plan, b, h, cuda::memory::host), none(cuda::memory::host);
  cuda::emulate(plan, {}, s1, Q = first(q), K = first(k), V = first(v), W = wb);
  auto [g2, d1] = cuda::emulate_gradient(plan, {}, second(dout), s1, none, Q = second(q), K = second(k), V = second(v), W = wb);
  auto [g1, d0] = cuda::emulate_gradient(plan, {}, first(dout), none, d1, Q = first(q), K = first(k), V = first(v), W = wb);
  tensor<float> dw(whole[W].shape()), dq(whole[Q].shape());
  for (std::size_t i = 0; i < dw.size(); ++i) dw.data()[i] = g1[W].data()[i] + g2[W].data()[i];
  for (std::size_t i = 0; i < b; ++i)
    for (std::size_t j = 0; j < h; ++j)
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t c = 0; c < d; ++c) dq(i, j, t, c) = t < cut ? g1[Q](i, j, t, c) : g2[Q](i, j, t - cut, c);
  CHECK(relative_rms(dw, whole[W]) <= tolerance(cuda::dtype::f32));
  CHECK(relative_rms(dq, whole[Q]) <= tolerance(cuda::dtype::f32));
}
