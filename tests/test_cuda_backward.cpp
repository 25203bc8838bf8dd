// The CUDA backend's backward kernels without a GPU: generated from the derived
// plans, run in the host emulation against cpu::gradient, the gradient of the
// expression in double and finite differences; they compile with NVRTC. The
// parametric maps' backward is in test_cuda_parametric.cpp.
#include "cuda_support.hpp"

// ---- gradients: the backward kernels -----------------------------------------------------
namespace {

// One backward case: the inputs and ∂out as a kernel reading dt sees them, and
// the two references — cpu::gradient of the plan (fp32, the same inputs) and
// of the expression in double.
template <class Cpu, class Exact>
struct backward_inputs {
  tensor<float> q, k, v, dout;
  Cpu cpu;
  Exact exact;
};
template <class Plan, class Expr>
auto backward_case(Plan const& plan, Expr const& expr, shape const& s, cuda::dtype dt, test::rng& r, bool positive) {
  auto inputs = random_inputs(s, dt, r, positive);
  auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
  auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
  auto cpu = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  auto exact = cpu::gradient(expr, widened(dout), Q = widened(q), K = widened(k), V = widened(v));
  return backward_inputs<decltype(cpu), decltype(exact)>{std::move(q), std::move(k), std::move(v), std::move(dout),
                                                         std::move(cpu), std::move(exact)};
}

// The emulated backward kernel of compile<order::linear>(expr) against
// cpu::gradient of the same plan (fp32, the same rounded inputs) and against
// the expression's gradient in double, for ∂Q, ∂K, ∂V.
// The kernels a launch uses compile (unless `compiles` is false: a caller
// that compiles its own) at the first shape and at D = 128.
template <class Expr>
void check_backward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, bool positive = false,
                    bool compiles = true) {
  auto const plan = compile<order::linear>(expr);
  bool const normalized = cuda::spec_of(plan).normalized;
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    double worst = 0, worst_mma = 0;
    for (shape const& s : cases) {
      CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
      auto bc = backward_case(plan, expr, s, dt, r, positive);
      auto &q = bc.q, &k = bc.k, &v = bc.v, &dout = bc.dout;
      auto const &cpu = bc.cpu;
      auto const &exact = bc.exact;
      for (bool exact_products : {true, false}) {
        if (!exact_products && dt == cuda::dtype::f32) continue;
        cuda::options opt{dt, dt, exact_products};
        auto g = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
        auto one = [&](auto const& x, std::string const& name) {
          CAPTURE(name);
          CAPTURE(exact_products);
          double const u = exact_products ? 0.0 : operand_roundoff(dt);
          if (normalized && s.n == 1 && name != "∂V") {
            // One token: its output is v·s/(s + eps), s = φq·φk > 0, which
            // depends on q and k through eps alone — the relative error of a
            // gradient that small is cancellation noise; its size is the
            // property. The two terms that cancel (through the numerator and
            // the denominator) are each about ‖dout‖, and the tensor cores
            // round their operands by u.
            double size = 0, scale = 0;
            for (std::size_t i = 0; i < g[x].size(); ++i) size += double(g[x].data()[i]) * g[x].data()[i];
            for (std::size_t i = 0; i < dout.size(); ++i) scale += double(dout.data()[i]) * dout.data()[i];
            CHECK(std::sqrt(size) <= (1e-4 + 2 * u) * std::sqrt(scale));
            return;
          }
          double e1 = relative_rms(g[x], cpu[x]), e2 = relative_rms(g[x], as_float(exact[x]));
          if (exact_products) {
            CHECK(e1 <= tolerance(dt));
            CHECK(e2 <= tolerance(dt));
            worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
          } else {
            double const bound = backward_mma_bound(dt, normalized);
            CAPTURE(bound);
            CHECK(e2 <= bound);
            worst_mma = std::max(worst_mma, e2 / bound);
          }
        };
        one(Q, "∂Q");
        one(K, "∂K");
        one(V, "∂V");
        auto spec = cuda::spec_of(plan, opt);
        spec.d = s.d, spec.m = s.m;
        if (compiles && (&s == &cases.front() || s.d == 128) && (!exact_products || dt == cuda::dtype::f32))
          for (auto const& p : cuda::backward_programs_of(spec)) check_compiles(p);
      }
    }
    MESSAGE(cuda::name_of(dt) << " backward: largest error / tolerance: " << worst << "; tensor-core products, error / bound: "
                              << worst_mma);
  }
}

std::vector<shape> backward_shapes(std::uint64_t seed, bool large = false) {
  // N = 0, 1, a chunk ± 1, several chunks; D ≠ M; (large) the largest D = M the kernel holds, T = 16.
  std::vector<shape> s = {{1, 1, 0, 5, 3}, {1, 2, 1, 7, 4}, {2, 1, 63, 16, 9}, {1, 1, 65, 24, 40}};
  if (large) s.push_back({1, 1, 150, 128, 128});
  test::rng r{seed};
  add_random_shapes(s, r, 2, 2, 200);
  return s;
}
}  // namespace

TEST_CASE("backward: emulated gradients = cpu::gradient = the expression's, causal") {
  check_backward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 81, backward_shapes(81, true));
  check_backward(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 82, backward_shapes(82));
  check_backward(causal(Q * transpose(K)) * V, 83, backward_shapes(83));
}
// A decayed mask (retention): the forward walk weighs as the forward does, the
// reverse walk carries the gradient of the state at each chunk's last row.
TEST_CASE("backward: decayed (retention) = cpu::gradient = the expression's") {
  check_backward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, 91,
                 backward_shapes(91, true));
  check_backward(causal(Q * transpose(K), decay{0.97}) * V, 92, backward_shapes(92));
  check_backward(causal(phi<relu>(Q) * transpose(phi<relu>(K)), decay{0.3}) * V, 93, {{1, 1, 70, 6, 5}, {2, 1, 140, 9, 12}});
  // a decay per head (RetNet's heads): each head's powers
  check_backward(causal(Q * transpose(K), head_decays({0.5, 0.9, 0.99})) * V, 94,
                 {{1, 3, 1, 5, 3}, {2, 3, 70, 12, 9}, {1, 3, 140, 24, 40}});
}

TEST_CASE("backward: emulated gradients = cpu::gradient = the expression's, non-causal and poly2") {
  check_backward(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V, 84, backward_shapes(84));
  check_backward(phi<relu>(Q) * transpose(phi<relu>(K)) * V, 85, backward_shapes(85));
  check_backward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 86, {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}}, true);
  // From D = 48 poly2's state does not fit a block even for one column of M:
  // two quadratic launches as softmax's, through poly2's kernel (q·k)² —
  // ∂S = 2·S∘(ĝ·[V|1]ᵀ), ∂Q = ∂S·K, ∂K = ∂Sᵀ·Q, ∂V = (S²)ᵀ·ĝ.
  check_backward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 87,
                 {{2, 1, 70, 48, 16}, {1, 2, 1, 64, 5}, {1, 1, 130, 64, 9}}, true);
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V));
  spec.d = 48, spec.m = 16;
  auto const ps = cuda::backward_programs_of(spec);
  REQUIRE(ps.size() == 2);
  CHECK((ps[0].quadratic && ps[1].quadratic && ps[1].key_major));
  CHECK(cuda::listing(ps[1]).find("square_grad") != std::string::npos);
  spec.d = 32, spec.m = 64;  // (C = 528 fits one block per slice of M's columns)
  CHECK_FALSE(cuda::backward_programs_of(spec).front().quadratic);
}

// Softmax's backward: two launches (program.hpp, backward_programs_of) — a
// block per chunk of query rows for ∂Q (storing ĝ and each row's shift), then
// a key-major block per chunk of key rows for ∂K and ∂V — against
// cpu::gradient of the plan and of the expression in double; causal and not,
// normalised and not, the mask before exp, elu+1 and poly2 inside exp. With
// exact products within the output's rounding; with the tensor cores'
// (identity maps, bf16 and f16 inputs: the scores' operands are exact) within
// c·u of Σ|terms| per gradient (softmax_terms), c = the rounded factors a term
// carries.
namespace {
// Per element of ∂Q, ∂K, ∂V of y = rowdiv(mask(exp(s·QKᵀ))·[V|1]) (or
// unnormalised, y = mask(exp(s·QKᵀ))·V; or the mask before exp), in double from the inputs as
// written: Σ over the sum that gives it of |its terms| — ∂Q_i = Σ_j ∂S_ij·k_j,
// ∂K_j = Σ_i ∂S_ij·q_i, ∂V_j = Σ_i P_ij·∂out_i with ∂S_ij = s·P_ij·(∂out_i·v_j
// − ∂out_i·y_i) (normalised; else s·E_ij·∂out_i·v_j), P = E / Σ_j E.
struct terms {
  tensor<double> q, k, v;
};
terms softmax_terms(tensor<float> const& q, tensor<float> const& k, tensor<float> const& v, tensor<float> const& dout,
                    cuda::attention_spec const& spec) {
  double const scale = spec.scale;
  bool const causal = spec.causal, normalized = spec.normalized, mask_scores = spec.mask_scores && !causal;
  auto const sh = q.shape(), sv = v.shape();
  std::size_t const n = sh[2], d = sh[3], m = sv[3];
  terms t{tensor<double>(sh), tensor<double>(sh), tensor<double>(sv)};
  for (std::size_t b = 0; b < sh[0]; ++b)
    for (std::size_t h = 0; h < sh[1]; ++h)
      for (std::size_t i = 0; i < n; ++i) {
        std::vector<double> e(n, 0.0);
        double den = 0;
        for (std::size_t j = 0; j < n && (!causal || j <= i); ++j) {
          double x = 0;  // (the mask before exp: a key after the row has score 0)
          for (std::size_t c = 0; c < d && !(mask_scores && j > i); ++c) x += double(q(b, h, i, c)) * k(b, h, j, c);
          double const g = cuda::decay_of_head(spec, static_cast<std::int64_t>(h));
          double const weight = g == 1 ? 1.0 : std::pow(g, static_cast<double>(i - j));  // (causal: j ≤ i)
          den += e[j] = std::exp(scale * x) * weight;
        }
        double const norm = normalized ? den + 1e-6 : 1.0;
        std::vector<double> y(m, 0.0);
        for (std::size_t j = 0; j < n; ++j)
          for (std::size_t c = 0; c < m; ++c) y[c] += e[j] / norm * v(b, h, j, c);
        double gy = 0;
        if (normalized)
          for (std::size_t c = 0; c < m; ++c) gy += double(dout(b, h, i, c)) * y[c];
        for (std::size_t j = 0; j < n; ++j) {
          double gv = 0;
          for (std::size_t c = 0; c < m; ++c) gv += double(dout(b, h, i, c)) * v(b, h, j, c);
          double const ds = mask_scores && j > i ? 0.0 : std::abs(scale * e[j] / norm * (gv - gy));
          for (std::size_t c = 0; c < d; ++c) {
            t.q(b, h, i, c) += ds * std::abs(double(k(b, h, j, c)));
            t.k(b, h, j, c) += ds * std::abs(double(q(b, h, i, c)));
          }
          for (std::size_t c = 0; c < m; ++c) t.v(b, h, j, c) += e[j] / norm * std::abs(double(dout(b, h, i, c)));
        }
      }
  return t;
}
// ‖terms‖ / ‖result‖ (RMS): how far a relative error per term moves the result.
double amplification(tensor<double> const& terms, tensor<double> const& exact) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < terms.size(); ++i) num += terms.data()[i] * terms.data()[i];
  for (std::size_t i = 0; i < exact.size(); ++i) den += exact.data()[i] * exact.data()[i];
  return den == 0 ? 0.0 : std::sqrt(num / den);
}

template <class Expr>
void check_softmax_backward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, bool positive = false) {
  auto const plan = compile(expr);
  auto const spec0 = cuda::spec_of(plan);
  bool const identity = spec0.map_q == cuda::feature_map::identity;
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    double worst = 0, worst_mma = 0;
    for (shape const& s : cases) {
      CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
      auto bc = backward_case(plan, expr, s, dt, r, positive);
      auto &q = bc.q, &k = bc.k, &v = bc.v, &dout = bc.dout;
      auto const &cpu = bc.cpu;
      auto const &exact = bc.exact;
      auto g = cuda::emulate_gradient(plan, {dt, dt, true}, dout, Q = q, K = k, V = v);
      bool const fast = dt != cuda::dtype::f32 && identity;
      decltype(g) mma;
      terms t;
      if (fast) {
        mma = cuda::emulate_gradient(plan, {dt, dt}, dout, Q = q, K = k, V = v);
        t = softmax_terms(q, k, v, dout, spec0);
      }
      auto one = [&](auto const& x, std::string const& name, tensor<double> const& term) {
        CAPTURE(name);
        if (spec0.normalized && s.n == 1 && name != "∂V") {
          // One token: its row is v·E/(E + eps), which depends on q and k through
          // eps alone: the gradient is cancellation noise; its size is the property.
          double size = 0, total = 0;
          for (std::size_t i = 0; i < g[x].size(); ++i) size += double(g[x].data()[i]) * g[x].data()[i];
          for (std::size_t i = 0; i < dout.size(); ++i) total += double(dout.data()[i]) * dout.data()[i];
          CHECK(std::sqrt(size) <= 1e-4 * std::sqrt(total));
          return;
        }
        double const e1 = relative_rms(g[x], cpu[x]), e2 = relative_rms(g[x], as_float(exact[x]));
        CHECK(e1 <= tolerance(dt));
        CHECK(e2 <= tolerance(dt));
        worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
        if (!fast) return;
        // A term of ∂Q or ∂K carries E, ĝ (or ∂out) and ∂S rounded as operands,
        // and ĝ divides by the recomputed rows (E rounded): 4u; of ∂V, E and ĝ: 2u.
        double const bound = tolerance(dt) + (name == "∂V" ? 2 : 4) * operand_roundoff(dt) * amplification(term, exact[x]);
        CAPTURE(bound);
        double const e3 = relative_rms(mma[x], as_float(exact[x]));
        CHECK(e3 <= bound);
        worst_mma = std::max(worst_mma, e3 / bound);
      };
      one(Q, "∂Q", t.q);
      one(K, "∂K", t.k);
      one(V, "∂V", t.v);
      // The kernels a launch uses compile: fp32 at the first shape, bf16 at the largest (T = 32).
      if ((&s == &cases.front() && dt == cuda::dtype::f32) || (s.d == 128 && dt == cuda::dtype::bf16)) {
        auto spec = cuda::spec_of(plan, {dt, dt});
        spec.d = s.d, spec.m = s.m;
        for (auto const& p : cuda::backward_programs_of(spec)) check_compiles(p);
      }
    }
    MESSAGE(cuda::name_of(dt) << " " << spec0.description << " backward: largest error / tolerance: " << worst
                              << "; tensor-core products, error / bound: " << worst_mma);
  }
}
}  // namespace

TEST_CASE("backward: softmax (two quadratic launches) = cpu::gradient = the expression's") {
  std::vector<shape> cases = {{1, 1, 0, 5, 3}, {1, 2, 1, 7, 4}, {2, 1, 63, 16, 9}, {1, 1, 65, 24, 40}, {1, 1, 130, 128, 128}};
  test::rng r{95};
  add_random_shapes(cases, r, 2, 2, 200);
  check_softmax_backward(normalize(causal(exp(Q * transpose(K) * 0.25))) * V, 95, cases);
  check_softmax_backward(normalize(exp(Q * transpose(K) / 4.0)) * V, 96, cases);
  check_softmax_backward(causal(exp(0.125 * (Q * transpose(K)))) * V, 97, cases);
  check_softmax_backward(normalize(exp(causal(Q * transpose(K)) * 0.25)) * V, 98, cases);
  check_softmax_backward(normalize(causal(exp(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)) * 0.03))) * V, 99,
                         {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}});
  check_softmax_backward(normalize(exp(phi<poly2>(Q) * transpose(phi<poly2>(K)) * 0.05)) * V, 100,
                         {{1, 2, 9, 6, 5}, {1, 1, 70, 8, 20}}, true);
  // A decayed mask (ALiBi's bias): E recomputed with the same exponents, the rest as above.
  check_softmax_backward(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.9})) * V, 101, cases);
  check_softmax_backward(causal(exp(Q * transpose(K) * 0.125), decay{0.97}) * V, 102, cases);
  // ALiBi's slopes, one per head
  check_softmax_backward(normalize(causal(exp(Q * transpose(K) * 0.25), head_decays::alibi(3))) * V, 103,
                         {{1, 3, 1, 5, 3}, {2, 3, 70, 12, 9}, {1, 3, 130, 16, 24}});
}

// A plan that reads one input twice (K as V, Q as K, all three as one): one
// gradient, the sum of its shares — the later shares' stores add to what the
// first stored (program.hpp, backward_programs_of). Against cpu::gradient of
// the plan and of the expression in double; linear causal and not, softmax.
namespace {
// (At size = 256: the launches over slices of M's columns, program.hpp.)
template <bool ReadsK, bool ReadsV, class Expr>
void check_tied(Expr const& expr, std::uint64_t seed, std::size_t size = 16) {
  auto const plan = plan_of(expr);
  auto spec = cuda::spec_of(plan);
  spec.d = spec.m = size;
  std::string listings;
  for (auto const& p : cuda::backward_programs_of(spec)) {
    CHECK(p.kernel_name.find("_same_") != std::string::npos);  // not the untied kernel's source under its name
    listings += cuda::listing(p);
    check_compiles(p);
  }
  CHECK(listings.find("added to what is there") != std::string::npos);
  test::rng r{seed};
  std::vector<shape> const shapes = size == 16 ? std::vector<shape>{{1, 2, 1, 8, 8}, {2, 1, 70, 16, 16}, {1, 1, 130, 24, 24}}
                                               : std::vector<shape>{{1, 2, 70, size, size}};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape s : shapes) {
      CONTEXT(cuda::name_of(dt), s.n, s.d);
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, r.next()), dt);
      auto const wd = widened(dout);
      auto got = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cuda::emulate_gradient(p, {dt, dt, true}, dout, b...); },
                              Q = q, K = k, V = v);
      auto cpu = on_inputs_of(plan, [&](auto const& p, auto const&... b) { return cpu::gradient(p, dout, b...); }, Q = q, K = k, V = v);
      auto exact = on_inputs_of(expr, [&](auto const& p, auto const&... b) { return cpu::gradient(p, wd, b...); },
                                Q = widened(q), K = widened(k), V = widened(v));
      // A causal linear plan's chunk-parallel form too (groups of one chunk): the shares tied over its launches.
      cuda::options split{dt, dt, true};
      auto split_spec = cuda::spec_of(plan, split);
      split_spec.d = s.d, split_spec.m = s.m;
      auto const sp = cuda::split_backward_programs_of(split_spec);
      split.split_rows = sp.empty() ? 0 : sp[0].tiles.chunk;
      auto split_got = sp.empty() ? got : on_inputs_of(plan, [&](auto const& p, auto const&... b) {
        return cuda::emulate_gradient(p, split, dout, b...);
      }, Q = q, K = k, V = v);
      auto one = [&](auto const& x) {
        CHECK(relative_rms(got[x], cpu[x]) <= tolerance(dt));
        CHECK(relative_rms(got[x], as_float(exact[x])) <= tolerance(dt));
        CHECK(relative_rms(split_got[x], cpu[x]) <= tolerance(dt));
      };
      if (s.n > 1 || !spec.normalized) {  // (one token of a normalised plan: ∂Q, ∂K are eps-sized)
        one(Q);
        if constexpr (ReadsK) one(K);
      }
      if constexpr (ReadsV) one(V);
    }
}
}  // namespace

TEST_CASE("backward: a plan that reads one input twice gets one gradient, the sum of its shares") {
  check_tied<true, false>(causal(Q * transpose(K)) * K, 101);                                                 // K as V
  check_tied<true, false>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * K, 102);
  check_tied<false, true>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * V, 103);       // Q as K
  check_tied<true, false>(normalize(causal(exp(Q * transpose(K) * 0.25))) * K, 104);                        // softmax, K as V
  check_tied<false, false>(normalize(exp(Q * transpose(Q) * 0.25)) * Q, 105);                               // all three one
  // D = M = 256, split over M's columns: the slices' ∂V columns each written,
  // the ∂Q and ∂K shares summed and stored (the second one added) by the last.
  check_tied<true, false>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * K, 106, 256);
  check_tied<false, true>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * V, 107, 256);
  // Q as V: the last slice adds ∂Q to each chunk's rows after their ∂V columns.
  check_tied<true, false>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * Q, 108);
  check_tied<true, false>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * Q, 109, 256);
}

// A C × (M+1) fp32 state past one block's shared memory (D = M = 256): one
// launch per slice of M's columns, each the backward of an M' spec on its
// columns of V, ∂out and ∂V, the later ones adding their shares of ∂Q and ∂K
// (program.hpp, backward_programs_of). Against cpu::gradient and the
// expression in double, causal and not, normalised and not, N = 0 and 1.
TEST_CASE("backward: a state too large for one block is split over M's columns (D = M = 256)") {
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V));
  spec.d = spec.m = 256;
  auto const ps = cuda::backward_programs_of(spec);
  REQUIRE(ps.size() >= 2);
  std::size_t const width = ps[0].spec.m;
  CHECK((ps.size() * width >= 256 && (ps.size() - 1) * width < 256));  // the fewest slices of ⌈M / P⌉ columns
  for (std::size_t t = 0; t < ps.size(); ++t) {
    CAPTURE(t);
    CHECK(ps[t].v_offset == t * width);
    CHECK(ps[t].kernel_name.ends_with(t == 0 ? "_slice_first" : t + 1 == ps.size() ? "_slice_last" : "_slice_adding"));
    CHECK(ps[t].shared_bytes() <= cuda::shared_memory_budget);
    CHECK(ps[t].extras == ps[0].extras);  // one forward_args feeds every slice
  }
  CHECK(cuda::listing(ps[0]).find("→ ∂Q sums") != std::string::npos);      // the first slice's shares: fp32 sums
  CHECK(cuda::listing(ps.back()).find("+= ∂Q sums") != std::string::npos);  // the last adds them, then stores ∂Q
  for (auto const& p : ps) check_compiles(p);  // (the fp32 slices: their 16-bit variants differ in types only)
  check_backward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 87,
                 {{1, 1, 70, 256, 256}, {1, 2, 1, 256, 256}, {1, 1, 0, 256, 256}}, false, false);
  check_backward(phi<relu>(Q) * transpose(phi<relu>(K)) * V, 88, {{2, 1, 40, 200, 250}}, false, false);
  // Chained (tested against one pass in "backward, chained: …"): ∂(the state
  // out)'s z column starts the first slice's reverse walk only, and the later
  // slices add their shares of ∂S0's z.
  spec.chained = true;
  auto const chained = cuda::backward_programs_of(spec);
  REQUIRE(chained.size() == ps.size());
  for (std::size_t t = 0; t < chained.size(); ++t) {
    CAPTURE(t);
    bool z_in = false, z_added = false;
    for (auto const& i : chained[t].passes.at(1).before) z_in = z_in || (i.op == cuda::opcode::load_state && i.z_column);
    for (auto const& i : chained[t].epilogue) z_added = z_added || (i.op == cuda::opcode::store_state && i.accumulate);
    CHECK(z_in == (t == 0));
    CHECK(z_added == (t > 0));
    check_compiles(chained[t]);
  }
  // Q read as V: the last slice's last pass ends by adding the ∂Q sums to the
  // gradient, after the chunk's ∂V columns (the results: "backward: a plan that
  // reads one input twice …").
  auto tied = cuda::spec_of(compile<order::linear>(causal(Q * transpose(K)) * Q));
  tied.d = tied.m = 256;
  auto const q_as_v = cuda::backward_programs_of(tied);
  REQUIRE(q_as_v.size() >= 2);
  auto const& last_pass = q_as_v.back().passes.back();
  REQUIRE(last_pass.size() >= 2);
  auto const& add = last_pass.back();
  CHECK((add.op == cuda::opcode::store && add.slot < 0 && add.accumulate));
  CHECK(last_pass[last_pass.size() - 2].op == cuda::opcode::load);
}

// A few small cases against central finite differences of the expression in
// double (the references above are cpu::gradient, itself checked so in the CPU suite).
// A user-defined element-wise map lowers with its CUDA formulas (cuda_apply,
// cuda_derivative: a struct at the top of the kernel source; the emulation
// calls its value<float> and derivative<float>): forward causal and not, φ(Q)
// and φ(K) with two different maps (user0, user1), softmax, the backward.
struct square_plus_one {
  static constexpr std::string_view name = "x²+1";
  template <class T> static T value(T x) { return x * x + 1; }
  template <class T> static T derivative(T x) { return 2 * x; }
  static constexpr std::string_view cuda_apply = "fmaf(x, x, 1.0f)";
  static constexpr std::string_view cuda_derivative = "2.0f * x";
};
TEST_CASE("user-defined feature maps lower with their CUDA formulas: forward and backward") {
  using test::softplus;
  std::vector<shape> cases = {{1, 2, 1, 7, 4}, {2, 1, 65, 16, 9}, {1, 1, 130, 48, 24}};
  test::rng r{91};
  add_random_shapes(cases, r, 1, 0, 200);
  check_forward(normalize(causal(phi<softplus>(Q) * transpose(phi<softplus>(K)))) * V, 91, cases, false, 1);
  check_forward(normalize(phi<softplus>(Q) * transpose(phi<square_plus_one>(K))) * V, 92, cases, false, 1);
  check_forward(normalize(causal(exp(phi<softplus>(Q) * transpose(phi<softplus>(K)) * 0.05))) * V, 93, cases, false, 0);
  check_backward(normalize(causal(phi<softplus>(Q) * transpose(phi<softplus>(K)))) * V, 94, {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}});
  check_backward(phi<softplus>(Q) * transpose(phi<square_plus_one>(K)) * V, 95, {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}});
  // The source defines each map once, named in the kernel and the plan's text.
  constexpr auto two = compile<order::linear>(normalize(causal(phi<softplus>(Q) * transpose(phi<square_plus_one>(K)))) * V);
  auto const spec = cuda::spec_of(two);
  CHECK(spec.map_q == cuda::feature_map::user0);
  CHECK(spec.map_k == cuda::feature_map::user1);
  CHECK(cuda::plan_text(spec) == fmt::format("{}", two));
  auto const p = cuda::program_of(two, {}, D = 16, M = 8);
  CHECK(p.kernel_name.find("usoftplus_ux1") != std::string::npos);
  std::string const src = cuda::emit(p);
  CHECK(src.find("return log1pf(expf(x));") != std::string::npos);
  CHECK(src.find("return fmaf(x, x, 1.0f);") != std::string::npos);
  check_compiles(p);
  auto sized = spec;
  sized.d = 16, sized.m = 8;
  check_compiles(cuda::backward_program_of(sized));
  // A spec whose user map lacks its formulas is refused before anything is generated.
  auto bad = sized;
  bad.user[1].cuda_apply.clear();
  CHECK_THROWS_WITH_AS(cuda::program_of(bad), doctest::Contains("x²+1"), std::invalid_argument);
}

TEST_CASE("backward: emulated gradients = finite differences in double, small cases") {
  auto check_fd = [](auto const& expr, shape s, std::uint64_t seed) {
    CONTEXT(s.n, s.d, s.m);
    auto const plan = plan_of(expr);
    auto q = tensor<float>::random({s.b, s.h, s.n, s.d}, seed), k = tensor<float>::random({s.b, s.h, s.n, s.d}, seed + 1);
    auto v = tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 2), dout = tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 3);
    auto g = cuda::emulate_gradient(plan, {cuda::dtype::f32, cuda::dtype::f32, true}, dout, Q = q, K = k, V = v);
    auto wq = widened(q), wk = widened(k), wv = widened(v), wd = widened(dout);
    auto loss = [&] {  // Σ dout ∘ f(q, k, v), in double
      auto y = cpu::evaluate(expr, Q = wq, K = wk, V = wv);
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y.data()[i] * wd.data()[i];
      return l;
    };
    auto fd = [&](tensor<double>& x, tensor<float> const& got) {
      double num = 0, den = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        double const keep = x.data()[i], h = 1e-6;
        x.data()[i] = keep + h;
        double const up = loss();
        x.data()[i] = keep - h;
        double const down = loss();
        x.data()[i] = keep;
        double const want = (up - down) / (2 * h);
        num += (got.data()[i] - want) * (got.data()[i] - want);
        den += want * want;
      }
      return std::sqrt(num / den);
    };
    CHECK(fd(wq, g[Q]) <= 1e-5);
    CHECK(fd(wk, g[K]) <= 1e-5);
    CHECK(fd(wv, g[V]) <= 1e-5);
  };
  check_fd(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, {1, 2, 7, 3, 2}, 91);
  check_fd(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V, {2, 1, 5, 4, 3}, 92);
  check_fd(causal(Q * transpose(K)) * V, {1, 1, 70, 3, 2}, 93);  // two chunks
  check_fd(normalize(causal(exp(Q * transpose(K) * 0.5))) * V, {1, 2, 7, 3, 2}, 94);  // softmax: two launches
  check_fd(normalize(exp(causal(Q * transpose(K)))) * V, {1, 1, 70, 3, 2}, 95);       // the mask before exp, two chunks
  check_fd(exp(Q * transpose(K)) * V, {2, 1, 5, 4, 3}, 96);
  check_fd(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, {1, 1, 70, 3, 2}, 97);
  check_fd(causal(Q * transpose(K), decay{0.8}) * V, {2, 1, 70, 3, 2}, 98);  // decayed, two chunks
  check_fd(normalize(causal(exp(Q * transpose(K) * 0.5), decay{0.8})) * V, {1, 1, 70, 3, 2}, 99);  // decayed softmax
}

// ---- the chunk-parallel backward (splitting N) -----------------------------------------
namespace {
// Groups of 1, 2 and 3 chunks (and one group for all) against one pass of the
// backward: the same sums in another order (fp32: to 1e-5; 16-bit: within the
// output's rounding). The three launches compile where `compiles`.
template <class Expr>
void check_split_backward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, bool positive = false,
                          bool compiles = false) {
  auto const plan = compile<order::linear>(expr);
  test::rng r{seed};
  double worst = 0;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape const& s : cases) {
      auto inputs = random_inputs(s, dt, r, positive);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
      for (bool exact : {true, false}) {
        if (!exact && dt == cuda::dtype::f32) continue;
        cuda::options opt{dt, dt, exact};
        auto const once = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
        auto spec = cuda::spec_of(plan, opt);
        spec.d = s.d, spec.m = s.m;
        auto const sp = cuda::split_backward_programs_of(spec);
        REQUIRE(sp.size() == 3);
        std::int64_t const t = sp[0].tiles.chunk;
        for (std::int64_t rows : {t, 2 * t, 3 * t, 1000 * t}) {
          CONTEXT(cuda::name_of(dt), exact, s.b, s.h, s.n, s.d, s.m);
          CAPTURE(rows);
          cuda::options split = opt;
          split.split_rows = rows;
          auto g = cuda::emulate_gradient(plan, split, dout, Q = q, K = k, V = v);
          double const tol = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);
          for (auto [name, x, y] : {std::tuple{"∂Q", &g[Q], &once[Q]}, std::tuple{"∂K", &g[K], &once[K]},
                                    std::tuple{"∂V", &g[V], &once[V]}}) {
            char const* const which = name;  // (Clang < 16 cannot capture a binding)
            CAPTURE(which);
            double const e = relative_rms(*x, *y);
            CHECK(e <= tol);
            worst = std::max(worst, e / tol);
          }
        }
        if (compiles && &s == &cases.front() && exact == (dt == cuda::dtype::f32))  // the kernels launches use
          for (auto const& p : sp) check_compiles(p);
      }
    }
  MESSAGE("split backward: largest error / tolerance: " << worst);
}
}  // namespace

// Too few (batch, head) blocks for the device (B·H below its SMs): groups of
// rows in three launches (program.hpp, split_backward_programs_of) — each
// group's Σ φ(K)ᵀ[V|1]; each group's Σ φ(Q)ᵀĝ after its rows' adjoint; then
// each group's forward and reverse walks from the groups before and after it
// (non-causal: ∂Q with the adjoint sums, ∂K and ∂V from all of them).
TEST_CASE("backward, split: the chunk-parallel form (groups of rows, three launches) = one pass") {
  // One token; several groups, D ≠ M; N not a multiple of the chunk (a short last group); D = M = 128 (T = 16).
  check_split_backward(causal_expr, 111, {{1, 2, 1, 7, 4}, {2, 1, 300, 16, 8}, {1, 2, 257, 24, 100}, {1, 1, 200, 128, 128}},
                       false, true);
  check_split_backward(causal(Q * transpose(K)) * V, 112, {{2, 1, 300, 16, 8}, {1, 1, 130, 128, 128}}, false, true);
  check_split_backward(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 113, {{1, 2, 150, 9, 70}});
  check_split_backward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 114, {{1, 2, 150, 6, 5}}, true);
  // Decayed: a group's adjoint sums are a reverse walk's; each walk adds the earlier groups' sums and, from
  // the last group down, the later groups' by Horner's rule (g near 1, so that they weigh).
  check_split_backward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.99})) * V, 117,
                       {{1, 2, 1, 7, 4}, {2, 1, 300, 16, 8}, {1, 2, 257, 24, 100}}, false, true);
  check_split_backward(causal(Q * transpose(K), decay{0.995}) * V, 118, {{2, 1, 300, 16, 8}, {1, 1, 130, 128, 128}}, false, true);
  check_split_backward(causal(Q * transpose(K), head_decays({0.9, 0.995, 1})) * V, 119, {{1, 3, 300, 16, 8}}, false, true);
  // Non-causal: the sums over groups of K's rows; each group of Q's rows its
  // rows, ĝ, ∂Q and Σ φ(Q)ᵀĝ from all of them; each group of K's rows ∂K, ∂V.
  check_split_backward(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V, 115,
                       {{2, 1, 300, 16, 8}, {1, 2, 257, 24, 100}, {1, 1, 200, 128, 128}}, false, true);
  check_split_backward(phi<relu>(Q) * transpose(phi<relu>(K)) * V, 116, {{2, 1, 300, 16, 8}});
  // The launches: the first two only sum (their registers trimmed), the last walks.
  auto spec = cuda::spec_of(compile<order::linear>(causal_expr));
  spec.d = spec.m = 128;
  auto const sp = cuda::split_backward_programs_of(spec);
  REQUIRE(sp.size() == 3);
  CHECK(sp[0].shared_bytes() < sp[2].shared_bytes());
  CHECK(sp[1].shared_bytes() < sp[2].shared_bytes());
  CHECK(sp[2].shared_bytes() == cuda::backward_program_of(spec).shared_bytes());
  std::string const walks = cuda::listing(sp[2]);
  CHECK(walks.find("add_partials state += Σ partials[g < group") != std::string::npos);
  CHECK(walks.find("add_partials state += Σ ∂ partials[g > group") != std::string::npos);
  CHECK(walks.find("rowdiv_grad") == std::string::npos);  // ĝ comes from the second launch
  auto full = cuda::spec_of(compile<order::linear>(full_expr));
  full.d = full.m = 16;
  auto const fp = cuda::split_backward_programs_of(full);
  REQUIRE(fp.size() == 3);
  CHECK((fp[0].key_major && !fp[1].key_major && fp[2].key_major));  // groups of K's rows, Q's, K's
  // A parametric map: a fourth launch adds the groups' shares of ∂W
  // (test_cuda_parametric.cpp) — causal, stored by the walks; non-causal,
  // φ(Q)'s by the launch over groups of Q's rows, φ(K)'s by the walks over
  // groups of K's rows, in a buffer of its own. No split form for softmax or
  // a state split over M's columns.
  auto fv = cuda::spec_of(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V));
  fv.d = fv.m = fv.f = 16;
  CHECK(cuda::split_backward_programs_of(fv).size() == 4);
  fv.causal = false;
  auto const nc = cuda::split_backward_programs_of(fv);
  REQUIRE(nc.size() == 4);
  std::size_t const q_shares = cuda::extra_named(nc[0], "∂W partials"), k_shares = cuda::extra_named(nc[0], "∂W (K's rows) partials");
  CHECK((!nc[0].extras.at(q_shares).keys && nc[0].extras.at(k_shares).keys));
  auto stores_to = [](cuda::program const& p, std::size_t slot) {
    bool found = false;
    cuda::for_each_instruction(p, [&](cuda::instruction const& i) {
      found = found || (i.op == cuda::opcode::store_partial && i.slot == static_cast<int>(slot));
    });
    return found;
  };
  CHECK((stores_to(nc[1], q_shares) && !stores_to(nc[1], k_shares)));  // groups of Q's rows: φ(Q)'s terms
  CHECK((stores_to(nc[2], k_shares) && !stores_to(nc[2], q_shares)));  // groups of K's rows: φ(K)'s
  CHECK((!nc[3].split && nc[3].passes.empty()));  // a block per (batch, head) adds them
  auto sm = cuda::spec_of(compile(normalize(causal(exp(Q * transpose(K) * 0.125))) * V));
  sm.d = sm.m = 16;
  CHECK(cuda::split_backward_programs_of(sm).empty());
  spec.d = spec.m = 256;
  CHECK(cuda::split_backward_programs_of(spec).empty());
}

// A sequence evaluated in two chained blocks is differentiated last block
// first: the second block's backward starts its forward walk from the state
// the first left and hands back the gradient of that state, which the first
// block's backward starts its reverse walk from. Together they give the
// one-pass gradients; for an unnormalised plan the gradient of the very first
// state is Σ_i φ(q_i)·dout_iᵀ over the whole sequence (the output is linear
// in it), checked in double.
TEST_CASE("backward, chained: blocks differentiated last first, handing back ∂state = one pass") {
  // (D = M = 256: a state past one block, the backward split over M's columns.)
  auto check = [](auto const& expr, std::uint64_t seed, std::vector<shape> const& large = {}) {
    auto const plan = compile<order::linear>(expr);
    auto const spec = cuda::spec_of(plan);
    test::rng r{seed};
    std::vector<shape> cases = {shape{2, 2, 100, 12, 9}, shape{1, 1, 65, 7, 20}, shape{1, 2, 1, 5, 3}};
    cases.insert(cases.end(), large.begin(), large.end());
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
      for (shape const& s : cases) {
        std::size_t const cut = s.n < 2 ? 0 : r.in(1, s.n - 1);
        CONTEXT(spec.description, cuda::name_of(dt), s.n, cut);
        auto inputs = random_inputs(s, dt, r, false);
        auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
        auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
        cuda::options const opt{dt, dt, true};
        auto whole = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
        auto first = [&](tensor<float> const& x) { return test::tokens(x, 0, cut); };
        auto second = [&](tensor<float> const& x) { return test::tokens(x, cut, s.n); };
        cuda::state s1(plan, s.b, s.h, cuda::memory::host), none(cuda::memory::host);
        cuda::emulate(plan, opt, s1, Q = first(q), K = first(k), V = first(v));  // s1: the sums after block 1
        auto [g2, d1] = cuda::emulate_gradient(plan, opt, second(dout), s1, none, Q = second(q), K = second(k), V = second(v));
        auto [g1, d0] = cuda::emulate_gradient(plan, opt, first(dout), none, d1, Q = first(q), K = first(k), V = first(v));
        {  // gradient_into: the same bits into the caller's views, ∂S returned
          std::vector<std::vector<float>> store;
          auto into = bnhc_views(cuda::emulate_gradient_views(plan), g2, store);
          cuda::state const e1 =
              cuda::emulate_gradient_into(plan, opt, into, second(dout), s1, none, Q = second(q), K = second(k), V = second(v));
          CHECK(max_abs_diff(into[Q], g2[Q]) == 0);
          CHECK(max_abs_diff(into[K], g2[K]) == 0);
          CHECK(max_abs_diff(into[V], g2[V]) == 0);
          CHECK(max_abs_diff(sums_of(e1), sums_of(d1)) == 0);
        }
        for (auto const& [name, w, a, b] : {std::tuple{"∂Q", &whole[Q], &g1[Q], &g2[Q]}, std::tuple{"∂K", &whole[K], &g1[K], &g2[K]},
                                            std::tuple{"∂V", &whole[V], &g1[V], &g2[V]}}) {
          char const* const which = name;  // (Clang < 16 cannot capture a binding)
          CAPTURE(which);
          tensor<float> joined(w->shape());
          for (std::size_t i = 0; i < s.b; ++i)
            for (std::size_t j = 0; j < s.h; ++j)
              for (std::size_t t = 0; t < s.n; ++t)
                for (std::size_t c = 0; c < w->shape()[3]; ++c) joined(i, j, t, c) = t < cut ? (*a)(i, j, t, c) : (*b)(i, j, t - cut, c);
          CHECK(relative_rms(joined, *w) <= tolerance(dt));
        }
        REQUIRE(d0.shape() == s1.shape());
        if (!spec.normalized && !cuda::decayed(spec))  // ∂S0 = Σ_i φ(q_i)·dout_iᵀ
          CHECK(relative_rms(sums_of(d0), test::outer_sums(q, dout)) <= 1e-5);
        // Each block's backward in groups of one chunk (the chunk-parallel form,
        // where the plan has one): the same gradients and states.
        auto split_spec = cuda::spec_of(plan, opt);
        split_spec.d = s.d, split_spec.m = s.m, split_spec.chained = true;
        if (auto const sp = cuda::split_backward_programs_of(split_spec); !sp.empty()) {
          cuda::options split = opt;
          split.split_rows = sp[0].tiles.chunk;
          auto [h2, e1] = cuda::emulate_gradient(plan, split, second(dout), s1, none, Q = second(q), K = second(k), V = second(v));
          auto [h1, e0] = cuda::emulate_gradient(plan, split, first(dout), none, e1, Q = first(q), K = first(k), V = first(v));
          double const tol = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);
          for (auto const& [name, a, b] : {std::tuple{"split ∂Q", &h1[Q], &g1[Q]}, std::tuple{"split ∂K", &h1[K], &g1[K]},
                                           std::tuple{"split ∂V", &h1[V], &g1[V]}, std::tuple{"split ∂Q", &h2[Q], &g2[Q]},
                                           std::tuple{"split ∂K", &h2[K], &g2[K]}, std::tuple{"split ∂V", &h2[V], &g2[V]}}) {
            char const* const which = name;  // (Clang < 16 cannot capture a binding)
            CAPTURE(which);
            CHECK(relative_rms(*a, *b) <= tol);
          }
          CHECK(relative_rms(sums_of(e1), sums_of(d1)) <= tol);
          CHECK(relative_rms(sums_of(e0), sums_of(d0)) <= tol);
        }
      }
    auto chained = cuda::spec_of(plan);
    chained.d = 12, chained.m = 9, chained.chained = true;
    check_compiles(cuda::backward_program_of(chained));
    for (auto const& p : cuda::split_backward_programs_of(chained)) check_compiles(p);
  };
  check(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 81, {{1, 2, 70, 256, 256}});
  check(causal(Q * transpose(K)) * V, 82, {{1, 1, 40, 256, 256}});
  check(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 83);
  // Decayed: ∂S0 is the reverse walk's gradient of the state carried past chunk 0 (D = M = 256: over M's slices).
  check(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, 84, {{1, 1, 40, 256, 256}});
  check(causal(Q * transpose(K), decay{0.95}) * V, 85);
  // States elsewhere than the emulation's memory, or of another plan, are refused.
  constexpr auto plan = compile<order::linear>(causal(Q * transpose(K)) * V);
  auto x = tensor<float>::random({1, 1, 4, 4}, 1);
  cuda::state on_device(cuda::memory::device), none(cuda::memory::host);
  CHECK_THROWS_AS(cuda::emulate_gradient(plan, {}, x, on_device, none, Q = x, K = x, V = x), std::invalid_argument);
  cuda::state other(compile<order::linear>(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), 1, 1, cuda::memory::host);
  CHECK_THROWS_AS(cuda::emulate_gradient(plan, {}, x, other, none, Q = x, K = x, V = x), state_error);
  auto spec = cuda::spec_of(compile<order::linear>(Q * transpose(K) * V));
  spec.d = spec.m = 4, spec.chained = true;
  CHECK_THROWS_AS(cuda::backward_program_of(spec), std::invalid_argument);  // non-causal: no state
}

// On a device: two chained blocks differentiated last first (device states),
// against their emulation (gradients and ∂S), N long enough for the
// chunk-parallel form at B·H = 2; gradient_into = cuda::gradient, bit for bit.
TEST_CASE("device: chained blocks' gradients = their emulation, and gradient_into = gradient") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto plan = compile<order::linear>(causal_expr);
  auto run = [&]<class E>(shape s, std::size_t cut, std::uint64_t seed) {
    cuda::dtype const dt = dtype_for<E>();
    CONTEXT(cuda::name_of(dt), s.n, s.d, cut);
    test::rng r{seed};
    auto inputs = random_inputs(s, dt, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
    auto first = [&](tensor<float> const& x) { return test::tokens(x, 0, cut); };
    auto second = [&](tensor<float> const& x) { return test::tokens(x, cut, s.n); };
    cuda::options const opt{dt, dt};
    cuda::state s1(plan, s.b, s.h, cuda::memory::host), none(cuda::memory::host);
    cuda::emulate(plan, opt, s1, Q = first(q), K = first(k), V = first(v));
    auto [w2, e1] = cuda::emulate_gradient(plan, opt, second(dout), s1, none, Q = second(q), K = second(k), V = second(v));
    auto [w1, e0] = cuda::emulate_gradient(plan, opt, first(dout), none, e1, Q = first(q), K = first(k), V = first(v));
    auto up = [](tensor_view<float const> x) { return cuda::to_device<E>(x); };
    auto dq2 = up(second(q)), dk2 = up(second(k)), dv2 = up(second(v)), dd2 = up(second(dout));
    auto dq1 = up(first(q)), dk1 = up(first(k)), dv1 = up(first(v)), dd1 = up(first(dout));
    cuda::state const ds1 = cuda::to_device(s1);
    auto [g2, d1] = cuda::gradient(plan, dd2, ds1, cuda::state(), nullptr, Q = dq2, K = dk2, V = dv2);
    auto [g1, d0] = cuda::gradient(plan, dd1, cuda::state(), d1, nullptr, Q = dq1, K = dk1, V = dv1);
    double const tol = gradient_tolerance(dt);
    for (auto [got, want] : {std::pair{&g1, &w1}, std::pair{&g2, &w2}}) {
      CHECK(relative_rms(cuda::to_host((*got)[Q]), (*want)[Q]) <= tol);
      CHECK(relative_rms(cuda::to_host((*got)[K]), (*want)[K]) <= tol);
      CHECK(relative_rms(cuda::to_host((*got)[V]), (*want)[V]) <= tol);
    }
    CHECK(relative_rms(sums_of(cuda::to_host(d1)), sums_of(e1)) <= 1e-5);
    CHECK(relative_rms(sums_of(cuda::to_host(d0)), sums_of(e0)) <= 1e-5);
    cuda::tensor<E> iq(dq2.shape()), ik(dk2.shape()), iv(dv2.shape());
    auto into = cuda::gradient_views<E>(plan);
    into[Q] = iq.view(), into[K] = ik.view(), into[V] = iv.view();
    cuda::state const i1 = cuda::gradient_into(plan, into, dd2, ds1, cuda::state(), nullptr, Q = dq2, K = dk2, V = dv2);
    CHECK(max_abs_diff(cuda::to_host(iq), cuda::to_host(g2[Q])) == 0);
    CHECK(max_abs_diff(cuda::to_host(ik), cuda::to_host(g2[K])) == 0);
    CHECK(max_abs_diff(cuda::to_host(iv), cuda::to_host(g2[V])) == 0);
    CHECK(max_abs_diff(sums_of(cuda::to_host(i1)), sums_of(cuda::to_host(d1))) == 0);
  };
  run.template operator()<float>(shape{2, 3, 100, 16, 8}, 37, 1001);
  run.template operator()<cuda::bf16>(shape{2, 3, 100, 16, 8}, 64, 1002);
  run.template operator()<cuda::bf16>(shape{1, 2, 1500, 64, 64}, 700, 1003);  // (B·H = 2: split into groups of rows)
  run.template operator()<float>(shape{1, 1, 90, 256, 256}, 45, 1004);         // (M in slices)
}

TEST_CASE("backward: bad input is refused before anything runs") {
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 2);
  auto wrong = tensor<float>::random({1, 2, 10, 4}, 3);  // M = 3, not 4
  CHECK_THROWS_WITH_AS(cuda::emulate_gradient(plan, {}, wrong, Q = q, K = q, V = v), doctest::Contains("dout"), shape_error);
  auto short_dout = tensor<float>::random({1, 2, 9, 3}, 4);
  CHECK_THROWS_AS(cuda::emulate_gradient(plan, {}, short_dout, Q = q, K = q, V = v), shape_error);
  // Too large for one block per (batch, head): a clear error.
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V));
  spec.d = spec.m = 256;
  CHECK_THROWS_WITH_AS(cuda::backward_program_of(spec), doctest::Contains("too large for the backward kernel"),
                       std::invalid_argument);  // (one program; backward_programs_of splits M: see above)
  spec.d = spec.m = 8;
  spec.chained = spec.step = true;  // a decoding step's kernel has no backward
  CHECK_THROWS_AS(cuda::backward_program_of(spec), std::invalid_argument);
  // On the device: without one, cuda_error naming the call; host memory is refused at compile time.
  if (!cuda::probe_device().available) {
    std::vector<float> fake(80);
    cuda::device_view<float const> dq(fake.data(), {1, 2, 10, 4}), dv(fake.data(), {1, 2, 10, 3});
    try {
      (void)cuda::gradient(plan, dv, nullptr, Q = dq, K = dq, V = dv);
      FAIL("no cuda_error");
    } catch (cuda::cuda_error const& e) {
      CHECK(e.call() == "cuda::gradient");
    }
    CHECK_THROWS_AS((void)cuda::gradient(plan, dq, nullptr, Q = dq, K = dq, V = dv), shape_error);  // dout of Q's shape
  }
}

// The backward kernels launched on the device = their emulation.
// gradient_into: the caller's views — here [B, N, H, C] storage seen as
// [B, H, N, C] — get what emulate_gradient returns, bit for bit (∂W of FAVOR+
// too); a view of another shape, or one not set, is a shape_error naming ∂ of
// its input before any view is written; columns that are not adjacent are
// refused. Without a device, cuda::gradient_into says so, naming itself.
TEST_CASE("backward: gradients into the caller's views (gradient_into, emulate_gradient_into)") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  std::size_t const b = 2, h = 3, n = 37, d = 8, m = 5;
  auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2),
       v = tensor<float>::random({b, h, n, m}, 3), dout = tensor<float>::random({b, h, n, m}, 4);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    cuda::options const opt{dt, dt};
    auto want = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
    std::vector<float> sq(b * n * h * d, 7.f), sk(b * n * h * d, 7.f), sv(b * n * h * m, 7.f);
    auto bnhc = [&](std::vector<float>& store, std::size_t rows, std::size_t cols) {
      auto const c = static_cast<std::ptrdiff_t>(cols), hh = static_cast<std::ptrdiff_t>(h);
      return tensor_view<float>(store.data(), {b, h, rows, cols}, {static_cast<std::ptrdiff_t>(rows) * hh * c, c, hh * c, 1});
    };
    auto into = cuda::emulate_gradient_views(plan);
    into[Q] = bnhc(sq, n, d), into[K] = bnhc(sk, n, d), into[V] = bnhc(sv, n, m);
    // errors first: nothing is written
    auto wrong = into;
    wrong[K] = bnhc(sk, n - 1, d);
    test::expect_shape_error([&] { cuda::emulate_gradient_into(plan, opt, wrong, dout, Q = q, K = k, V = v); }, "∂K", "rows",
                             n - 1, n);
    auto unset = cuda::emulate_gradient_views(plan);
    test::expect_shape_error([&] { cuda::emulate_gradient_into(plan, opt, unset, dout, Q = q, K = k, V = v); }, "∂Q",
                             "B (batch)", 0, b);
    auto spaced = into;
    spaced[V] = tensor_view<float>(sv.data(), {b, h, n, m}, {static_cast<std::ptrdiff_t>(n * h * m), 1,
                                                            static_cast<std::ptrdiff_t>(h * m), 2});
    CHECK_THROWS_WITH_AS(cuda::emulate_gradient_into(plan, opt, spaced, dout, Q = q, K = k, V = v),
                         doctest::Contains("adjacent columns"), std::invalid_argument);
    CHECK((std::all_of(sq.begin(), sq.end(), [](float x) { return x == 7.f; }) &&
           std::all_of(sk.begin(), sk.end(), [](float x) { return x == 7.f; })));
    cuda::emulate_gradient_into(plan, opt, into, dout, Q = q, K = k, V = v);
    CHECK(max_abs_diff(into[Q], want[Q]) == 0);
    CHECK(max_abs_diff(into[K], want[K]) == 0);
    CHECK(max_abs_diff(into[V], want[V]) == 0);
  }
  // FAVOR+: ∂W into the caller's view too.
  constexpr auto favor_plan = compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V);
  std::size_t const f = 12;
  auto const projection = gaussian_projection<float>(d, f, 5);
  auto const w = broadcast(projection, b, h);
  auto want = cuda::emulate_gradient(favor_plan, {}, dout, Q = q, K = k, V = v, W = w);
  tensor<float> gq({b, h, n, d}), gk({b, h, n, d}), gv({b, h, n, m}), gw({b, h, d, f});
  auto into = cuda::emulate_gradient_views(favor_plan);
  into[Q] = gq.view(), into[K] = gk.view(), into[V] = gv.view(), into[W] = gw.view();
  cuda::emulate_gradient_into(favor_plan, {}, into, dout, Q = q, K = k, V = v, W = w);
  CHECK(max_abs_diff(gw, want[W]) == 0);
  CHECK(max_abs_diff(gq, want[Q]) == 0);
  // Without a device: the device form names itself (the views' shapes are right).
  if (!cuda::probe_device().available) {
    float* const nowhere = nullptr;
    cuda::device_view<float> const dq(nowhere, {b, h, n, d}), dv(nowhere, {b, h, n, m});
    auto dinto = cuda::gradient_views<float>(plan);
    dinto[Q] = dq, dinto[K] = dq, dinto[V] = dv;
    CHECK_THROWS_WITH_AS(cuda::gradient_into(plan, dinto, dv, nullptr, Q = dq, K = dq, V = dv),
                         doctest::Contains("cuda::gradient_into"), cuda::cuda_error);
    CHECK_THROWS_WITH_AS((void)cuda::gradient_into(plan, dinto, dv, cuda::state(), cuda::state(), nullptr, Q = dq, K = dq, V = dv),
                         doctest::Contains("cuda::gradient_into"), cuda::cuda_error);  // (chained)
  }
}

TEST_CASE("device: gradients = their emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  auto run = [&]<class E>(auto const& plan, shape s, std::uint64_t seed) {
    cuda::dtype const dt = dtype_for<E>();
    CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
    test::rng r{seed};
    auto inputs = random_inputs(s, dt, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
    auto want = cuda::emulate_gradient(plan, {dt, dt}, dout, Q = q, K = k, V = v);
    auto dq = cuda::to_device<E>(q), dk = cuda::to_device<E>(k), dv = cuda::to_device<E>(v), dd = cuda::to_device<E>(dout);
    auto got = cuda::gradient(plan, dd, nullptr, Q = dq, K = dk, V = dv);
    double const tol = gradient_tolerance(dt);
    CHECK(relative_rms(cuda::to_host(got[Q]), want[Q]) <= tol);
    CHECK(relative_rms(cuda::to_host(got[K]), want[K]) <= tol);
    CHECK(relative_rms(cuda::to_host(got[V]), want[V]) <= tol);
    // gradient_into the caller's tensors: the same launches, the same bits.
    cuda::tensor<E> iq(dq.shape()), ik(dk.shape()), iv(dv.shape());
    auto into = cuda::gradient_views<E>(plan);
    into[Q] = iq.view(), into[K] = ik.view(), into[V] = iv.view();
    cuda::gradient_into(plan, into, dd, nullptr, Q = dq, K = dk, V = dv);
    CHECK(max_abs_diff(cuda::to_host(iq), cuda::to_host(got[Q])) == 0);
    CHECK(max_abs_diff(cuda::to_host(ik), cuda::to_host(got[K])) == 0);
    CHECK(max_abs_diff(cuda::to_host(iv), cuda::to_host(got[V])) == 0);
  };
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  constexpr auto full_plan = compile<order::linear>(full_expr);
  constexpr auto softmax_plan = compile(normalize(causal(exp(Q * transpose(K) * 0.125))) * V);  // two launches
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 150, 64, 64}, shape{1, 1, 70, 128, 128}}) {
    run.template operator()<float>(causal_plan, s, 900);
    run.template operator()<cuda::bf16>(causal_plan, s, 910);
    run.template operator()<cuda::bf16>(full_plan, s, 920);
    run.template operator()<float>(softmax_plan, s, 940);
    run.template operator()<cuda::bf16>(softmax_plan, s, 950);
  }
  run.template operator()<cuda::bf16>(causal_plan, shape{1, 2, 100, 256, 256}, 960);  // three slices of M's columns
  // Two (batch, head) blocks for the whole device: cuda::gradient splits N into
  // groups of rows (three launches; also the D = 128 shape above), against one
  // emulated pass.
  run.template operator()<float>(causal_plan, shape{1, 2, 1000, 64, 64}, 970);
  run.template operator()<cuda::bf16>(causal_plan, shape{1, 2, 1000, 64, 64}, 980);
  // poly2 past a block's state: two quadratic launches through its kernel (q·k)².
  constexpr auto poly2_plan = compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V);
  run.template operator()<float>(poly2_plan, shape{1, 2, 70, 64, 16}, 990);
  // favor: ∂W per (batch, head) too, W one device matrix shown to every (batch, head)
  // (zero strides); no rows: no launch runs, and ∂W is zeros; inside softmax: three launches.
  auto favor_case = [&](auto const& plan, std::size_t n) {
    CAPTURE(n);
    std::size_t const b = 2, h = 2, d = 32, m = 16, f = 24;
    auto q = tensor<float>::random({b, h, n, d}, 930), k = tensor<float>::random({b, h, n, d}, 931),
         v = tensor<float>::random({b, h, n, m}, 932), dout = tensor<float>::random({b, h, n, m}, 933);
    auto w = gaussian_projection<float>(d, f, 934);
    auto want = cuda::emulate_gradient(plan, {}, dout, Q = q, K = k, V = v, W = broadcast(w, b, h));
    auto dw = cuda::to_device(w);
    cuda::device_view<float const> const wv(dw.data(), {b, h, d, f}, {0, 0, static_cast<std::ptrdiff_t>(f), 1});
    auto got = cuda::gradient(plan, cuda::to_device(dout), nullptr, Q = cuda::to_device(q), K = cuda::to_device(k),
                              V = cuda::to_device(v), W = wv);
    for (auto [x, y] : {std::pair{cuda::to_host(got[Q]), want[Q]}, {cuda::to_host(got[K]), want[K]},
                        {cuda::to_host(got[V]), want[V]}, {cuda::to_host(got[W]), want[W]}})
      CHECK(relative_rms(x, y) <= 1e-5);
  };
  favor_case(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V), 100);
  favor_case(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V), 0);
  favor_case(compile(normalize(causal(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * 0.5))) * V), 100);
}
