// The CUDA backend without a GPU: the generated kernels' tile programs run in
// the host emulation and agree with the CPU backend and with the expression
// evaluated as written (in double); every kernel the tests generate compiles
// with NVRTC for sm_80 and sm_90 with an empty log; the emitted sources of a
// few plans are pinned by golden files (tests/golden/).
//
// Regenerate the golden files after an intended change of the emitter with
//   LINA_UPDATE_GOLDEN=1 build/release/tests/lina_cuda_tests -tc="*golden*"
// and review the diff. The backward kernels' tests are in test_cuda_backward.cpp.
#include "cuda_support.hpp"

TEST_CASE("numeric: fp16 and bf16 conversions round to nearest even") {
  using namespace lina::cuda;
  // Every finite 16-bit value converts to fp32 and back unchanged.
  for (std::uint32_t u = 0; u < 0x10000u; ++u) {
    auto h = static_cast<std::uint16_t>(u);
    if ((h & 0x7c00u) != 0x7c00u) REQUIRE(f16_bits(from_f16_bits(h)) == h);
    if ((h & 0x7f80u) != 0x7f80u) REQUIRE(bf16_bits(from_bf16_bits(h)) == h);
  }
  CHECK(from_f16_bits(f16_bits(1.0f + 0x1p-11f)) == 1.0f);                  // tie → even (down)
  CHECK(from_f16_bits(f16_bits(1.0f + 3 * 0x1p-11f)) == 1.0f + 0x1p-9f);   // tie → even (up)
  CHECK(from_bf16_bits(bf16_bits(1.0f + 0x1p-8f)) == 1.0f);
  CHECK(from_bf16_bits(bf16_bits(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);
  CHECK(from_f16_bits(f16_bits(65520.0f)) == INFINITY);   // rounds past the largest half
  CHECK(from_f16_bits(f16_bits(65519.0f)) == 65504.0f);
  CHECK(from_f16_bits(f16_bits(0x1p-25f)) == 0.0f);       // half the smallest subnormal: tie → 0
  CHECK(from_f16_bits(f16_bits(0x1.8p-25f)) == 0x1p-24f);
  CHECK(from_f16_bits(f16_bits(0x1.7fep-15f)) == 0x1.8p-15f);  // a subnormal half
  CHECK(std::isnan(from_bf16_bits(bf16_bits(NAN))));
  CHECK(std::isnan(from_f16_bits(f16_bits(NAN))));
}

// A user-defined map with no CUDA formulas: the CPU runs it, the kernels cannot.
struct host_only {
  static constexpr std::string_view name = "host_only";
  template <class T> static T value(T x) { return x * x; }
  template <class T> static T derivative(T x) { return 2 * x; }
};

TEST_CASE("plans → tile programs: supported shapes, chunk and tile sizes") {
  constexpr auto causal_plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  constexpr auto full_plan = compile<order::linear>(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V);
  constexpr auto automatic = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  static_assert(cuda::lowerable<decltype(causal_plan)> && cuda::lowerable<decltype(full_plan)>);
  static_assert(cuda::lowerable<decltype(automatic)>);  // a select between the two orders of one attention
  static_assert(cuda::lowerable<decltype(compile<order::linear>(Q * transpose(K) * V))>);
  static_assert(cuda::lowerable<decltype(compile(normalize(exp(Q * transpose(K))) * V))>);  // softmax: quadratic
  static_assert(cuda::lowerable<decltype(compile(normalize(exp(causal(Q * transpose(K)))) * V))>);  // exp(0) = 1 above the diagonal
  static_assert(cuda::lowerable<decltype(compile<order::linear>(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V))>);
  constexpr auto W = input<"W">(D, dim<"F">);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // parametric maps, one W
                    normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V))>);
  constexpr auto W2 = input<"W2">(D, dim<"F">);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // a W for Q and another for K
                    normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)))) * V))>);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // a user-defined map with its CUDA formulas
                    normalize(causal(phi<test::softplus>(Q) * transpose(phi<test::softplus>(K)))) * V))>);
  static_assert(!cuda::lowerable<decltype(compile<order::linear>(  // … without them
                    normalize(causal(phi<host_only>(Q) * transpose(phi<host_only>(K)))) * V))>);

  auto s = cuda::spec_of(causal_plan);
  CHECK(s.causal);
  CHECK(s.normalized);
  CHECK(s.map_q == cuda::feature_map::elu_plus_one);
  CHECK(s.eps == 1e-6);
  CHECK(s.description == "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])))");
  CHECK(!cuda::spec_of(full_plan).causal);
  CHECK(cuda::spec_of(automatic).causal);

  // poly2 is a row map even at D = 1, where it has as many features as columns (x²).
  auto one = cuda::program_of(compile<order::linear>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V), {}, D = 1, M = 2);
  CHECK(std::count_if(one.passes[0].begin(), one.passes[0].end(),
                      [](cuda::instruction const& i) { return i.op == cuda::opcode::map && i.a >= 0; }) == 2);
  auto q1 = tensor<float>::random({1, 1, 9, 1}, 1), v1 = tensor<float>::random({1, 1, 9, 2}, 2);
  auto poly2_d1 = compile<order::linear>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V);
  CHECK(relative_rms(cuda::emulate(poly2_d1, Q = q1, K = q1, V = v1), cpu::evaluate(poly2_d1, Q = q1, K = q1, V = v1)) <= 1e-6);

  auto p = cuda::program_of(causal_plan, {}, D = 64, M = 64);
  CHECK(p.tiles.chunk == 64);
  CHECK(p.tiles.tile_m == 64);
  CHECK(p.m_tiles == 1);
  CHECK(p.shared_bytes() <= cuda::shared_memory_budget);
  auto wide = cuda::program_of(causal_plan, {}, D = 256, M = 200);
  CHECK(wide.tiles.chunk == 32);  // 64 rows of φ(Q), φ(K) and a 256 × 65 state do not fit
  CHECK(wide.m_tiles == 4);
  CHECK(wide.shared_bytes() <= cuda::shared_memory_budget);
  CHECK_THROWS_WITH_AS(cuda::program_of(causal_plan, {}, D = 64), doctest::Contains("dimension M"), std::invalid_argument);
  // Beyond what a block's shared memory holds even at T = 16: refused, saying why.
  CHECK_THROWS_WITH_AS(cuda::program_of(causal_plan, {}, D = 1500, M = 64), doctest::Contains("too large"),
                       std::invalid_argument);
  // compile()'s select between the two orders is the same kernel as the linear plan.
  auto q = tensor<float>::random({1, 2, 90, 7}, 1), k = tensor<float>::random({1, 2, 90, 7}, 2),
       v = tensor<float>::random({1, 2, 90, 5}, 3);
  CHECK(cuda::emit(cuda::program_of(automatic, {}, D = 7, M = 5)) == cuda::emit(cuda::program_of(causal_plan, {}, D = 7, M = 5)));
  CHECK(max_abs_diff(cuda::emulate(automatic, Q = q, K = k, V = v), cuda::emulate(causal_plan, Q = q, K = k, V = v)) == 0.0);
  MESSAGE(cuda::listing(p));
}

TEST_CASE("emulated causal forward = CPU backend = as written") {
  check_forward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 11);
  check_forward(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V, 12);
  check_forward(causal(phi<identity>(Q) * transpose(phi<identity>(K))) * V, 13);
}

// poly2 has C = D(D+1)/2 features: D up to 20 (C = 210).
std::vector<shape> poly2_shapes() {
  return {{1, 1, 0, 3, 2}, {1, 2, 1, 4, 5}, {2, 1, 65, 8, 3}, {1, 1, 130, 13, 24}, {1, 1, 70, 20, 9}};
}

// poly2's features are signed: φ(q)·φ(k) = (q·k)² comes out of sums that
// cancel, so a normaliser (q·k)² near 0 is ill-conditioned in any precision
// (fp32 CPU plans differ from double by 1e-2 there). Signed inputs are checked
// unnormalised; the normalised plans with non-negative inputs.
TEST_CASE("emulated poly2 forward (a row map) = CPU backend = as written") {
  check_forward(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V, 31, poly2_shapes());
  check_forward(phi<poly2>(Q) * transpose(phi<poly2>(K)) * V, 32, poly2_shapes());
  check_forward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 33, poly2_shapes(), true);
  check_forward(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V, 34, poly2_shapes(), true);
}

TEST_CASE("emulated non-causal forward = CPU backend = as written") {
  check_forward(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V, 21);
  check_forward(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 22);
  check_forward(Q * transpose(K) * V, 23);
}

// Softmax stays quadratic: a block per chunk of query rows walks the key
// chunks with a running max. The edge shapes and random ones; the kernels
// compile at the first shapes of each plan (the causal normalised one also at
// D = 256, M = 200, which takes T = 32). exp turns a score's absolute error
// into a relative one, so the fp32 tolerance holds for scores of moderate
// size, as scaled attention has them (|score| ≲ 10 here; elu+1's features are
// positive, so its scores grow with D and take a smaller scale).
TEST_CASE("emulated softmax forward (quadratic) = CPU backend = as written") {
  std::vector<shape> cases = {{1, 1, 0, 5, 3},    {1, 1, 40, 256, 200}, {1, 2, 1, 7, 4},    {2, 1, 63, 16, 9},
                              {1, 1, 65, 48, 96}, {1, 1, 130, 96, 48},  {1, 1, 70, 200, 72}};
  test::rng r{41};
  add_random_shapes(cases, r, 3, 0, 300);
  check_forward(normalize(causal(exp(Q * transpose(K) * 0.25))) * V, 41, cases, false, 2);
  check_forward(normalize(exp(Q * transpose(K) / 4.0)) * V, 42, cases, false, 1);
  check_forward(causal(exp(0.5 * (Q * transpose(K)))) * V, 43, cases, false, 1);
  check_forward(normalize(causal(exp(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)) * 0.03))) * V, 44, cases,
                false, 0);
  // The mask before exp: a score past the diagonal is 0, so its key weighs exp(0) = 1 (as written).
  check_forward(normalize(exp(causal(Q * transpose(K)) * 0.25)) * V, 46, cases, false, 1);
  check_forward(exp(0.5 * causal(Q * transpose(K))) * V, 47, cases, false, 0);
}

// The kernel shifts each row by its running max (at least 0), an identity of
// the normalised plan — exp(x)/(Σexp(x) + eps) = exp(x−m)/(Σexp(x−m) + eps·e^−m)
// — so rows whose exp overflows fp32 still come out right: the CPU's fp32
// plan, which exponentiates as written, gives inf/inf there.
TEST_CASE("softmax: rows whose exp overflows fp32 still normalise (the running max), and NaN propagates") {
  constexpr auto expr = normalize(causal(exp(Q * transpose(K) * 8.0))) * V;
  constexpr auto plan = compile(expr);
  shape const s{1, 2, 150, 16, 12};
  test::rng r{45};
  auto [q, k, v] = random_inputs(s, cuda::dtype::f32, r, false);
  for (std::size_t i = 0; i < q.size(); ++i) q.data()[i] *= 3.0f;  // scores up to ~8·3·16: exp(300)
  auto cpu32 = cpu::evaluate(plan, Q = q, K = k, V = v);
  bool overflowed = false;
  for (std::size_t i = 0; i < cpu32.size(); ++i) overflowed = overflowed || !std::isfinite(cpu32.data()[i]);
  REQUIRE(overflowed);  // the case this test is about
  auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
  for (bool exact_products : {true, false}) {
    auto got = cuda::emulate(plan, {cuda::dtype::f32, cuda::dtype::f32, exact_products}, Q = q, K = k, V = v);
    CHECK(relative_rms(got, exact) <= 1e-5);
  }
  auto bf = cuda::emulate(plan, {cuda::dtype::bf16, cuda::dtype::bf16}, Q = rounded(q, cuda::dtype::bf16),
                          K = rounded(k, cuda::dtype::bf16), V = rounded(v, cuda::dtype::bf16));
  auto exact_bf = cpu::evaluate(expr, Q = widened(rounded(q, cuda::dtype::bf16)), K = widened(rounded(k, cuda::dtype::bf16)),
                                V = widened(rounded(v, cuda::dtype::bf16)));
  CHECK(relative_rms(bf, exact_bf) <= tolerance(cuda::dtype::bf16) + std::ldexp(2.0, -9));
  // A NaN key reaches the rows that read it and no others.
  std::size_t const bad = 70;
  k(0, 1, bad, 3) = std::nanf("");
  auto nan = cuda::emulate(plan, {}, Q = q, K = k, V = v);
  for (std::size_t i = 0; i < s.n; ++i) {
    CAPTURE(i);
    CHECK(std::isnan(nan(0, 1, i, 0)) == (i >= bad));
    CHECK(std::isfinite(nan(0, 0, i, 0)));
  }
}

TEST_CASE("softmax: the quadratic program, its source, and what it does not do") {
  constexpr auto plan = compile(normalize(causal(exp(Q * transpose(K) * 0.125))) * V);
  auto spec = cuda::spec_of(plan);
  CHECK(spec.softmax);
  CHECK(spec.causal);
  CHECK(spec.scale == 0.125);
  CHECK(cuda::plan_text(spec) == fmt::format("{}", plan));  // the kernel names the plan as compile() prints it
  auto p = cuda::program_of(plan, {}, D = 64, M = 200);
  CHECK(p.quadratic);
  CHECK(p.m_tiles == 4);
  cuda::forward_args a;
  a.batch = 2, a.heads = 3, a.n = 130;
  CHECK(cuda::blocks_of(p, a) == 2 * 3 * 4 * 3);  // (batch, head, M tile, chunk of query rows)
  CHECK(cuda::listing(p).find("exp_rows") != std::string::npos);
  spec.d = spec.m = 16;
  spec.chained = true;  // no state: exp has no finite feature map
  CHECK_THROWS_AS(cuda::program_of(spec), std::invalid_argument);
  spec.chained = false;
  CHECK_THROWS_WITH_AS(cuda::backward_program_of(spec), doctest::Contains("backward_programs_of"), std::invalid_argument);
  auto const backward = cuda::backward_programs_of(spec);  // ∂Q per query chunk, then ∂K, ∂V per key chunk
  REQUIRE(backward.size() == 2);
  CHECK((backward[0].quadratic && !backward[0].key_major && backward[1].quadratic && backward[1].key_major));
  CHECK(backward[0].extras == backward[1].extras);  // one forward_args feeds both
  a.n_keys = 70;  // (cross-attention's blocks: the key-major launch divides K's rows)
  CHECK(cuda::blocks_of(backward[0], a) == 2 * 3 * 3);
  CHECK(cuda::blocks_of(backward[1], a) == 2 * 3 * 2);
  CHECK(cuda::listing(backward[1]).find("for each chunk of queries from this block's key rows on") != std::string::npos);
  spec.map_q = spec.map_k = cuda::feature_map::favor;
  spec.f = 16;
  auto const three = cuda::backward_programs_of(spec);  // favor inside exp: a third launch for ∂Q, ∂K and ∂W
  REQUIRE(three.size() == 3);
  CHECK((!three[2].quadratic && three[2].extras == three[0].extras && three[1].extras == three[0].extras));
  CHECK(cuda::blocks_of(three[2], a) == 2 * 3);  // a block per (batch, head): ∂W sums over every row
  spec.map_q = spec.map_k = cuda::feature_map::identity;
  CHECK_THROWS_AS(cuda::split_programs_of(spec), std::invalid_argument);
  // options.split_rows (the linear plans' chunk-parallel form) does not apply
  auto q = tensor<float>::random({1, 1, 200, 16}, 1), k = tensor<float>::random({1, 1, 200, 16}, 2),
       v = tensor<float>::random({1, 1, 200, 16}, 3);
  cuda::options split{};
  split.split_rows = 64;
  CHECK(max_abs_diff(cuda::emulate(plan, split, Q = q, K = k, V = v), cuda::emulate(plan, Q = q, K = k, V = v)) == 0.0);
}

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
      CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m); CAPTURE(f);
      auto [q, k, v] = random_inputs(s, dt, r, false);
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
      CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m); CAPTURE(f);
      auto [q, k, v] = random_inputs(s, dt, r, false);
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

// Cross-attention: K and V over another sequence (S rows) than Q (N rows) —
// non-causal, so the passes over K and V walk S rows (forward_args::n_keys)
// and the kernels are the self-attention ones (the same sources: nothing new
// to compile). Forward and backward against the CPU backend and the
// expression as written, S < N, S > N, S or N zero, fp32 and bf16 (exact
// products: the per-dtype tolerance).
namespace {
constexpr auto S = dim<"S">;
constexpr auto Kx = input<"K">(S, D);
constexpr auto Vx = input<"V">(S, M);
template <class Expr>
void check_cross(Expr const& expr, std::uint64_t seed, std::size_t max_d = 40) {
  auto const plan = plan_of(expr);
  static_assert(cuda::lowerable<decltype(plan)>);
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (auto [n, s] : {std::pair<std::size_t, std::size_t>{10, 130}, {130, 10}, {0, 7}, {7, 0}, {65, 64}, {1, 200}}) {
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
constexpr auto Q2 = input<"Q2">(N, D);
constexpr auto K2 = input<"K2">(N, D);
constexpr auto V2 = input<"V2">(N, M);
constexpr auto Vd = input<"V">(N, D);  // layer 1's values: its output is N x D, an operand of layer 2
constexpr auto L = input<"L">(N, D);   // layer 1's output, as the CPU reference binds it
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * Vd;
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

namespace {
// The chained program of `plan` (what emulate_into with a state runs).
template <class Plan>
cuda::program chained_program(Plan const& plan, cuda::options opt, std::size_t d, std::size_t m, std::size_t f = 0) {
  auto s = cuda::spec_of(plan, opt);
  s.d = d;
  s.m = m;
  s.f = f;
  s.chained = true;
  return cuda::program_of(s);
}

// Two chained blocks of the emulated kernel, split at `at`, against one pass
// of the same kernel and against the CPU backend chained the same way: the
// outputs by relative RMS within the dtype's tolerance, the final state
// against the CPU's (both fp32 sums of the same rounded inputs) within 1e-5.
// A third chain starts from the CPU's state after the first block, written
// into a fresh CUDA state: the sums mean the same on both sides.
template <class Expr>
void check_chained(Expr const& expr, std::uint64_t seed, std::vector<shape> const& fixed, bool positive = false) {
  auto const plan = compile(expr);  // a select: chaining runs its linear branch
  auto const linear = compile<order::linear>(expr);
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    double worst = 0;
    for (shape const& s : fixed) {
      auto [q, k, v] = random_inputs(s, dt, r, positive);
      cuda::options opt{dt, dt, true};  // exact products: the tight checks below; the tensor cores' after them
      int const chunk = chained_program(linear, opt, s.d, s.m).tiles.chunk;
      std::size_t mid = s.n < 3 ? s.n / 2 : r.in(1, s.n - 1);
      if (mid > 0 && mid % static_cast<std::size_t>(chunk) == 0) --mid;  // inside a chunk
      auto once = cuda::emulate(linear, opt, Q = q, K = k, V = v);
      for (std::size_t at : {std::size_t{0}, mid, s.n}) {
        CAPTURE(cuda::name_of(dt)); CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m); CAPTURE(at);
        cuda::state st(cuda::memory::host);
        tensor<float> chained(once.shape());
        cuda::emulate_into(plan, opt, rows_of(chained, 0, at), st, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at),
                           V = test::tokens(v, 0, at));
        cuda::emulate_into(plan, opt, rows_of(chained, at, s.n), st, Q = test::tokens(q, at, s.n),
                           K = test::tokens(k, at, s.n), V = test::tokens(v, at, s.n));
        cpu::state<float> cst;
        tensor<float> cpu_chained(once.shape());
        cpu::evaluate(plan, cst, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
        auto second = cpu::evaluate(plan, cst, Q = test::tokens(q, at, s.n), K = test::tokens(k, at, s.n),
                                    V = test::tokens(v, at, s.n));
        auto first = cpu::evaluate(plan, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
        for (std::size_t i = 0; i < s.b; ++i)
          for (std::size_t j = 0; j < s.h; ++j)
            for (std::size_t t = 0; t < s.n; ++t)
              for (std::size_t c = 0; c < s.m; ++c) cpu_chained(i, j, t, c) = t < at ? first(i, j, t, c) : second(i, j, t - at, c);
        double e_once = relative_rms(chained, once), e_cpu = relative_rms(chained, cpu_chained);
        CHECK(e_once <= tolerance(dt));
        CHECK(e_cpu <= tolerance(dt));
        // The final sums: [B, H, C, W], W = M + 1 when normalised.
        REQUIRE(st.shape() == shape4{s.b, s.h, cuda::features(cuda::spec_of(linear).map_q, s.d),
                                     s.m + (cuda::spec_of(linear).normalized ? 1 : 0)});
        REQUIRE(cst[0].shape() == st.shape());
        double e_state = relative_rms(sums_of(st), sums_of(cst));
        CHECK(e_state <= 1e-5);
        worst = std::max({worst, e_once / tolerance(dt), e_cpu / tolerance(dt), e_state / 1e-5});

        // Start a fresh CUDA state from the CPU's sums after the first block.
        cpu::state<float> prefix;
        cpu::evaluate(plan, prefix, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
        cuda::state seeded(plan, s.b, s.h, cuda::memory::host);
        cuda::emulate(plan, opt, seeded, Q = test::tokens(q, 0, 0), K = test::tokens(k, 0, 0), V = test::tokens(v, 0, 0));
        auto sums = seeded.sums();  // sized by the empty block, zero
        for (std::size_t i = 0; i < s.b; ++i)
          for (std::size_t j = 0; j < s.h; ++j)
            for (std::size_t a = 0; a < sums.shape()[2]; ++a)
              for (std::size_t c = 0; c < sums.shape()[3]; ++c) {
                CHECK(sums(i, j, a, c) == 0.0f);
                sums(i, j, a, c) = prefix[0](i, j, a, c);
              }
        auto rest = cuda::emulate(plan, opt, seeded, Q = test::tokens(q, at, s.n), K = test::tokens(k, at, s.n),
                                  V = test::tokens(v, at, s.n));
        CHECK(relative_rms(rest, second) <= tolerance(dt));

        if (dt != cuda::dtype::f32) {  // tensor-core products, chained: within their rounding of the exact result
          cuda::options fast{dt, dt};
          cuda::state sf(cuda::memory::host);
          tensor<float> fast_chained(once.shape());
          cuda::emulate_into(plan, fast, rows_of(fast_chained, 0, at), sf, Q = test::tokens(q, 0, at),
                             K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
          cuda::emulate_into(plan, fast, rows_of(fast_chained, at, s.n), sf, Q = test::tokens(q, at, s.n),
                             K = test::tokens(k, at, s.n), V = test::tokens(v, at, s.n));
          auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
          double bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);
          CAPTURE(bound);
          CHECK(relative_rms(fast_chained, exact) <= bound);
          if (tensor_core_edge(s, fixed)) check_compiles(chained_program(linear, fast, s.d, s.m));
        }
      }
      if (!s.random && (dt == cuda::dtype::f32 || &s == &fixed.front())) check_compiles(chained_program(linear, opt, s.d, s.m));
    }
    MESSAGE(cuda::name_of(dt) << " chained: largest error / tolerance: " << worst);
  }
}

// Edge shapes (several M tiles: M > 64, so blocks of one (batch, head) share z;
// D ≠ M; N = 1, 2) and random ones.
std::vector<shape> chain_shapes(std::uint64_t seed) {
  std::vector<shape> s = {{1, 1, 1, 5, 3}, {1, 2, 2, 4, 7}, {2, 1, 150, 16, 100}, {1, 2, 130, 48, 130}, {1, 1, 97, 96, 40}};
  test::rng r{seed};
  add_random_shapes(s, r, 3, 2, 260);
  return s;
}
}  // namespace

TEST_CASE("chained: two emulated blocks = one pass = the CPU's chained result, and the same state") {
  check_chained(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 41, chain_shapes(41));
  check_chained(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 42, chain_shapes(42));
  check_chained(causal(Q * transpose(K)) * V, 43, chain_shapes(43));
  check_chained(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 44, poly2_shapes(), true);
}

// favor's state has C = F rows (the random features), and W comes with every
// block: two chained blocks equal one pass, and the sums are the CPU's.
TEST_CASE("chained: favor blocks = one pass, and the same state as the CPU's, and so do decoding steps and split rows") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V);
  std::size_t const b = 2, h = 2, n = 100, d = 16, m = 12, f = 32, cut = 37;
  auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2),
       v = tensor<float>::random({b, h, n, m}, 3);
  auto w = gaussian_projection<float>(d, f, 4);
  auto whole = cuda::emulate(plan, Q = q, K = k, V = v, W = broadcast(w, b, h));
  cuda::state st(plan, b, h, cuda::memory::host);
  cpu::state<float> cst;
  tensor<float> out(whole.shape());
  for (auto [from, to] : {std::pair<std::size_t, std::size_t>{0, cut}, {cut, n}}) {
    cuda::emulate_into(plan, {}, rows_of(out, from, to), st, Q = test::tokens(q, from, to), K = test::tokens(k, from, to),
                       V = test::tokens(v, from, to), W = broadcast(w, b, h));
    cpu::evaluate(plan, cst, Q = test::tokens(q, from, to), K = test::tokens(k, from, to), V = test::tokens(v, from, to),
                  W = broadcast(w, b, h));
  }
  CHECK(relative_rms(out, whole) <= tolerance(cuda::dtype::f32));
  REQUIRE(st.shape() == shape4{b, h, f, m + 1});
  REQUIRE(cst[0].shape() == st.shape());
  CHECK(relative_rms(sums_of(st), sums_of(cst)) <= 1e-5);
  check_compiles(chained_program(plan, {}, d, m, f));
  // Decoding: a prompt, then one token at a time, W with every call.
  auto rnn = cuda::recurrent(plan, b, h, {}, cuda::memory::host);
  tensor<float> steps(whole.shape());
  rnn.prefill_into(rows_of(steps, 0, cut), Q = test::tokens(q, 0, cut), K = test::tokens(k, 0, cut),
                   V = test::tokens(v, 0, cut), W = broadcast(w, b, h));
  for (std::size_t t = cut; t < n; ++t)
    rnn.step_into(rows_of(steps, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                  V = test::tokens(v, t, t + 1), W = broadcast(w, b, h));
  CHECK(relative_rms(steps, whole) <= tolerance(cuda::dtype::f32));
  // The chunk-parallel form (groups of rows) reads W in both launches.
  cuda::options split{};
  split.split_rows = 64;
  CHECK(relative_rms(cuda::emulate(plan, split, Q = q, K = k, V = v, W = broadcast(w, b, h)), whole) <= tolerance(cuda::dtype::f32));
}

TEST_CASE("chained: the program loads and stores the state, and non-causal plans have none") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto p = chained_program(plan, {}, 16, 130);
  CHECK(p.m_tiles == 3);
  REQUIRE(p.prologue.size() == 1);
  CHECK(p.prologue[0].op == cuda::opcode::load_state);
  CHECK(p.prologue[0].z_column);
  REQUIRE(p.epilogue.size() == 1);
  CHECK(p.epilogue[0].op == cuda::opcode::store_state);
  CHECK(p.kernel_name.ends_with("_state"));
  auto plain = cuda::program_of(plan, {}, D = 16, M = 130);
  CHECK(plain.prologue[0].op == cuda::opcode::zero);
  CHECK(plain.epilogue.empty());
  CHECK(plain.kernel_name != p.kernel_name);
  MESSAGE(cuda::listing(p));

  // Non-causal: no running state (compile-time for plans, tests/compile_fail_cuda/state_needs_causal.cpp).
  auto s = cuda::spec_of(compile<order::linear>(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V));
  s.d = 8;
  s.m = 8;
  s.chained = true;
  CHECK_THROWS_WITH_AS(cuda::program_of(s), doctest::Contains("only a causal attention carries a state"), std::invalid_argument);

  // The emulation refuses a chained program without a state, or with one buffer for in and out.
  std::vector<float> qk(2 * 16, 0.5f), v(2 * 130, 0.25f), o(2 * 130), sums(2 * 16 * 131);
  cuda::forward_args a;
  a.in[0] = a.in[1] = {qk.data(), {0, 0, 16, 1}, 16};
  a.in[2] = {v.data(), {0, 0, 130, 1}, 130};
  a.out = {o.data(), {0, 0, 130, 1}, 130};
  a.batch = a.heads = 1;
  a.n = 2;
  CHECK_THROWS_WITH_AS(cuda::emulate(p, a), doctest::Contains("needs a state in and out"), std::invalid_argument);
  a.state_in = {sums.data(), {0, 0, 131, 1}, 131};
  a.state_out = {sums.data() + 16 * 131 - 1, {0, 0, 131, 1}, 131};  // its first element is state_in's last
  CHECK_THROWS_WITH_AS(cuda::emulate(p, a), doctest::Contains("overlap"), std::invalid_argument);
  a.state_out.data = sums.data() + 16 * 131;
  CHECK_NOTHROW(cuda::emulate(p, a));
}

TEST_CASE("chained: a state of another plan, batch, heads or extent is refused before anything runs") {
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  constexpr auto other = compile(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V);
  auto q = tensor<float>::random({2, 3, 10, 4}, 1), v = tensor<float>::random({2, 3, 10, 6}, 2);
  auto expect = [](auto f, std::string symbol, std::string dimension, std::size_t got, std::size_t want) {
    try {
      f();
      FAIL("no shape_error");
    } catch (shape_error const& err) {
      CHECK(err.symbol() == symbol);
      CHECK(err.dimension() == dimension);
      CHECK(err.extent() == got);
      CHECK(err.expected_extent() == want);
    }
  };
  cuda::state st(plan, 2, 3, cuda::memory::host);
  auto out = tensor<float>({2, 3, 10, 6});
  cuda::emulate_into(plan, {}, out.view(), st, Q = q, K = q, V = v);  // fixes D = 4, M = 6
  auto const before = tensor<float>(out);
  std::vector<float> sums(st.data(), st.data() + st.size());
  auto unchanged = [&] {
    CHECK(max_abs_diff(out, before) == 0.0);
    CHECK(std::equal(sums.begin(), sums.end(), st.data()));
  };
  CHECK_THROWS_WITH_AS(cuda::emulate_into(other, {}, out.view(), st, Q = q, K = q, V = v),
                       doctest::Contains("this state belongs to the plan"), state_error);
  auto qb = tensor<float>::random({1, 3, 10, 4}, 3), vb = tensor<float>::random({1, 3, 10, 6}, 4);
  auto ob = tensor<float>({1, 3, 10, 6});
  expect([&] { cuda::emulate_into(plan, {}, ob.view(), st, Q = qb, K = qb, V = vb); }, "Q", "B (batch)", 1, 2);
  auto qh = tensor<float>::random({2, 1, 10, 4}, 5), vh = tensor<float>::random({2, 1, 10, 6}, 6);
  auto oh = tensor<float>({2, 1, 10, 6});
  expect([&] { cuda::emulate_into(plan, {}, oh.view(), st, Q = qh, K = qh, V = vh); }, "Q", "H (heads)", 1, 3);
  auto qd = tensor<float>::random({2, 3, 10, 5}, 7);
  expect([&] { cuda::emulate_into(plan, {}, out.view(), st, Q = qd, K = qd, V = v); }, "Q", "D", 5, 4);
  auto wrong = tensor<float>({2, 3, 10, 7});
  expect([&] { cuda::emulate_into(plan, {}, wrong.view(), st, Q = q, K = q, V = v); }, "out", "cols", 7, 6);
  unchanged();
  // A longer or shorter block is fine: N may change from one block to the next.
  auto q5 = tensor<float>::random({2, 3, 5, 4}, 8), v5 = tensor<float>::random({2, 3, 5, 6}, 9);
  CHECK_NOTHROW(cuda::emulate(plan, {}, st, Q = q5, K = q5, V = v5));
  sums.assign(st.data(), st.data() + st.size());

  // Memory in the wrong place: a device state for the emulation, a host one for a launch.
  cuda::state on_device(plan, 2, 3);
  CHECK(on_device.where() == cuda::memory::device);
  CHECK_THROWS_WITH_AS(cuda::emulate_into(plan, {}, out.view(), on_device, Q = q, K = q, V = v),
                       doctest::Contains("the state is in device memory"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(on_device.sums(), doctest::Contains("cuda::to_host"), std::invalid_argument);
  shape4 sq{2, 3, 10, 4}, sv{2, 3, 10, 6};
  std::vector<float> fake(2 * 3 * 10 * 6);  // never read: every check comes before the launch
  cuda::device_view<float const> dq(fake.data(), sq), dv(fake.data(), sv);
  cuda::device_view<float> dout(fake.data(), sv);
  CHECK_THROWS_WITH_AS(cuda::evaluate_into(plan, dout, st, nullptr, Q = dq, K = dq, V = dv),
                       doctest::Contains("the state is in host memory"), std::invalid_argument);
  // A device state of another plan or batch: refused before any launch or allocation.
  cuda::state foreign(other, 2, 3);
  CHECK_THROWS_WITH_AS(cuda::evaluate_into(plan, dout, foreign, nullptr, Q = dq, K = dq, V = dv),
                       doctest::Contains("this state belongs to the plan"), state_error);
  cuda::state small(plan, 1, 3);
  expect([&] { cuda::evaluate_into(plan, dout, small, nullptr, Q = dq, K = dq, V = dv); }, "Q", "B (batch)", 2, 1);
  unchanged();
}

namespace {
// The emitted source of program p equals tests/golden/<file> byte for byte.
void check_golden(cuda::program const& p, std::string const& file) {
  std::string src = cuda::emit(p);
  std::string const path = std::string(LINA_GOLDEN_DIR) + "/" + file;
  if (char const* update = std::getenv("LINA_UPDATE_GOLDEN"); update && *update) {
    std::ofstream(path, std::ios::binary) << src;
    MESSAGE("rewrote " << path);
  }
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "missing golden file " << path << " (LINA_UPDATE_GOLDEN=1 writes it)");
  std::stringstream want;
  want << in.rdbuf();
  CHECK_MESSAGE(src == want.str(), "the emitted source differs from " << path
                                   << "; if the change is intended, rerun with LINA_UPDATE_GOLDEN=1 and review the diff");
  check_compiles(p);
}
// The emitted source of `plan` (static extents) equals tests/golden/<file>.
template <class Plan>
void check_golden(Plan const& plan, cuda::options opt, std::string const& file) {
  CHECK(cuda::source(plan, opt) == cuda::emit(cuda::program_of(plan, opt)));
  check_golden(cuda::program_of(plan, opt), file);
}
}  // namespace

TEST_CASE("golden: the emitted sources of a few small plans") {
  constexpr auto Ds = dim<"D", 16>;
  constexpr auto Ms = dim<"M", 8>;
  constexpr auto Qs = input<"Q">(N, Ds);
  constexpr auto Ks = input<"K">(N, Ds);
  constexpr auto Vs = input<"V">(N, Ms);
  check_golden(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
               {cuda::dtype::bf16, cuda::dtype::bf16}, "cuda_causal_elu1_d16_m8_bf16.cu");
  check_golden(compile<order::linear>(phi<relu>(Qs) * transpose(phi<relu>(Ks)) * Vs), {cuda::dtype::f16, cuda::dtype::f32},
               "cuda_full_relu_d16_m8_f16_f32_unnormalized.cu");
  constexpr auto Dp = dim<"D", 4>;
  constexpr auto Qp = input<"Q">(N, Dp);
  constexpr auto Kp = input<"K">(N, Dp);
  check_golden(compile<order::linear>(normalize(causal(phi<poly2>(Qp) * transpose(phi<poly2>(Kp)))) * Vs), {},
               "cuda_causal_poly2_d4_m8_f32.cu");
  // Chained: the state loaded before the chunks and stored after them.
  check_golden(chained_program(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
                               {cuda::dtype::bf16, cuda::dtype::bf16}, 16, 8),
               "cuda_causal_elu1_d16_m8_bf16_state.cu");
  // Backward: a forward pass (rows again, rowdiv's adjoint, ∂Q) and a reverse pass (∂K, ∂V).
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
                            {cuda::dtype::bf16, cuda::dtype::bf16});
  check_golden(cuda::backward_program_of(spec), "cuda_causal_backward_elu1_d16_m8_bf16.cu");
  // Softmax: a block per chunk of query rows, the key chunks up to it, a running max.
  check_golden(compile(normalize(causal(exp(Qs * transpose(Ks) * 0.25))) * Vs), {cuda::dtype::bf16, cuda::dtype::bf16},
               "cuda_softmax_causal_d16_m8_bf16.cu");
  // Its backward: ∂Q per chunk of query rows (the rows again, ĝ and the shift stored), then ∂K, ∂V per chunk of key rows.
  auto const softmax_backward =
      cuda::backward_programs_of(cuda::spec_of(compile(normalize(causal(exp(Qs * transpose(Ks) * 0.25))) * Vs),
                                               {cuda::dtype::bf16, cuda::dtype::bf16}));
  check_golden(softmax_backward.at(0), "cuda_softmax_causal_backward_q_d16_m8_bf16.cu");
  check_golden(softmax_backward.at(1), "cuda_softmax_causal_backward_kv_d16_m8_bf16.cu");
}

// The kernels scripts/gpu-check's benchmark launches first compile here, so a
// device session is not spent finding an NVRTC error.
TEST_CASE("the benchmark's kernels (bench/cuda_forward.cpp: forward, backward, steps) compile for sm_80 and sm_90") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};
  for (std::size_t d : {128, 64}) {
    CAPTURE(d);
    auto p = cuda::program_of(plan, bf16, D = d, M = d);
    CHECK(p.shared_bytes() <= cuda::shared_memory_budget);
    check_compiles(p);
    check_compiles(chained_program(plan, bf16, d, d));
    auto spec = cuda::spec_of(plan, bf16);
    spec.d = spec.m = d;
    auto backward = cuda::backward_program_of(spec);  // its backward rows
    CHECK(backward.shared_bytes() <= cuda::shared_memory_budget);
    check_compiles(backward);
    spec.chained = spec.step = true;  // its decode steps
    check_compiles(cuda::program_of(spec));
  }
}

TEST_CASE("NVRTC errors name the call and the kernel and carry the log") {
  std::string bad = "extern \"C\" __global__ void broken_kernel() { this is not CUDA; }\n";
  try {
    cuda::compile(bad, "broken_kernel", "sm_90");
    FAIL("compiled a broken kernel");
  } catch (cuda::nvrtc_error const& e) {
    CHECK(e.call() == "nvrtcCompileProgram");
    CHECK(e.kernel() == "broken_kernel");
    CHECK(!e.log().empty());
    CHECK(std::string(e.what()).find("broken_kernel") != std::string::npos);
  }
  CHECK_THROWS_AS(cuda::compile("", "k", "gfx90a"), cuda::nvrtc_error);
  MESSAGE("NVRTC " << cuda::nvrtc_version());
}




// Where a GPU exists, generated kernels launched on it agree with their
// emulation; elsewhere the test says it is skipped.
// The kernel that adds the gradients of an input two stacked layers share on
// a device (add_program): emulated, it is the sum rounded to the element type,
// and it compiles.
TEST_CASE("add_program: out += x, rounded to the element type") {
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    std::size_t const b = 2, h = 3, n = 150, cols = 40;
    auto x = rounded(tensor<float>::random({b, h, n, cols}, 76), dt), y = rounded(tensor<float>::random({b, h, n, cols}, 77), dt);
    auto const p = cuda::add_program(dt, cols);
    std::vector<std::uint16_t> xs = bits_of(x, dt), ys = bits_of(y, dt);
    bool const wide = dt == cuda::dtype::f32;
    cuda::forward_args a;
    a.in[0] = cuda::detail::dense_operand(wide ? static_cast<void const*>(x.data()) : xs.data(), x.shape());
    a.out = cuda::detail::dense_operand(wide ? static_cast<void*>(y.data()) : ys.data(), y.shape());
    a.batch = b, a.heads = h, a.n = n;
    auto const want = y;
    cuda::emulate(p, a);
    tensor<float> const got = wide ? y : widened_from(ys, dt, {b, h, n, cols});
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      float const sum = x.data()[i] + want.data()[i];
      worst = std::max(worst, std::abs(double(got.data()[i]) - double(wide ? sum : cuda::from_bf16_bits(cuda::bf16_bits(sum)))));
    }
    CHECK(worst == 0.0);
    check_compiles(p);
  }
}

TEST_CASE("device: launched kernels agree with the emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  MESSAGE("device " << dev.device << ": " << dev.arch);
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  constexpr auto full_plan = compile<order::linear>(full_expr);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16})
    for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{1, 1, 70, 256, 48}}) {
      launch_vs_emulation(causal_plan, dt, s, 100);
      launch_vs_emulation(full_plan, dt, s, 200);
      launch_vs_emulation(compile(softmax_expr), dt, s, 300);
    }
  // Stacked layers: one launch per layer, the intermediate in device memory.
  {
    constexpr auto stack = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2);
    auto t = [](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({2, 2, 150, cols}, seed); };
    auto q = t(16, 1), k = t(16, 2), v = t(16, 3), k2 = t(16, 4), v2 = t(24, 5);
    auto want = cuda::emulate(stack, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
    auto got = cuda::evaluate(stack, nullptr, Q = cuda::to_device(q), K = cuda::to_device(k), Vd = cuda::to_device(v),
                              K2 = cuda::to_device(k2), V2 = cuda::to_device(v2));
    CHECK(relative_rms(cuda::to_host(got), want) <= 1e-6);
    // Its gradient with K in both layers: the two layers' shares added on the device (add_program).
    constexpr auto shared = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K)))) * V2);
    auto dout = t(24, 6);
    auto g_want = cuda::emulate_gradient(shared, {}, dout, Q = q, K = k, Vd = v, V2 = v2);
    auto g = cuda::gradient(shared, cuda::to_device(dout), nullptr, Q = cuda::to_device(q), K = cuda::to_device(k),
                            Vd = cuda::to_device(v), V2 = cuda::to_device(v2));
    CHECK(relative_rms(cuda::to_host(g[K]), g_want[K]) <= 1e-5);
    CHECK(relative_rms(cuda::to_host(g[Q]), g_want[Q]) <= 1e-5);
  }
  // Cross-attention: K and V over 130 rows, Q over 70 (n_keys).
  for (auto const& cross : {compile<order::linear>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Kx))) * Vx)}) {
    auto q = tensor<float>::random({1, 2, 70, 16}, 7), k = tensor<float>::random({1, 2, 130, 16}, 8),
         v = tensor<float>::random({1, 2, 130, 24}, 9);
    auto want = cuda::emulate(cross, Q = q, Kx = k, Vx = v);
    auto dq = cuda::to_device(q), dk = cuda::to_device(k), dv = cuda::to_device(v);
    CHECK(relative_rms(cuda::to_host(cuda::evaluate(cross, nullptr, Q = dq, Kx = dk, Vx = dv)), want) <= 1e-6);
    auto dout = tensor<float>::random({1, 2, 70, 24}, 10);
    auto g = cuda::gradient(cross, cuda::to_device(dout), nullptr, Q = dq, Kx = dk, Vx = dv);
    auto g_want = cuda::emulate_gradient(cross, {}, dout, Q = q, Kx = k, Vx = v);
    CHECK(relative_rms(cuda::to_host(g[Kx]), g_want[Kx]) <= 1e-6);
  }
  // Host memory where device memory is needed: refused before any launch.
  tensor<float> q({1, 1, 4, 8}), v({1, 1, 4, 8});
  cuda::device_buffer dout(q.size() * 4);
  cuda::device_view<float const> hq(q.data(), q.shape()), hv(v.data(), v.shape());
  CHECK_THROWS_AS(cuda::evaluate_into(causal_plan, cuda::device_view<float>(static_cast<float*>(dout.get()), v.shape()),
                                      nullptr, Q = hq, K = hq, V = hv),
                  std::invalid_argument);
}

// A few small launches, one per kind of product (fma, tf32 and bf16 tensor
// cores; causal and not): what scripts/gpu-check runs under racecheck, whose
// shared-memory tracking is too slow for the whole device suite.
TEST_CASE("device: small launches (racecheck)") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    launch_vs_emulation(compile<order::linear>(causal_expr), dt, shape{1, 1, 100, 24, 40}, 500);
    launch_vs_emulation(compile<order::linear>(full_expr), dt, shape{1, 1, 70, 16, 12}, 600);
  }
}

// The causal chained program cut after each instruction of its pass (but the
// store), with a store of the register that instruction wrote: what the device
// test below launches, one program per instruction.
std::vector<cuda::program> cut_programs(cuda::program const& base) {
  std::vector<cuda::program> r;
  auto const& pass = base.passes.at(0);
  for (std::size_t cut = 0; cut < pass.size(); ++cut) {
    if (pass[cut].op == cuda::opcode::store) continue;
    cuda::program p = base;
    p.passes[0].resize(cut + 1);
    p.passes[0].push_back({.op = cuda::opcode::store, .dst = pass[cut].dst, .width = 64, .by_m_tile = true});
    p.kernel_name += "_cut" + std::to_string(cut) + "_" + std::string(cuda::name_of(pass[cut].op));
    r.push_back(std::move(p));
  }
  return r;
}

// Without a device: the cut programs emit, compile for sm_80/sm_90 with an
// empty log, and the last one (everything but the store) emulates to the
// whole program's result.
TEST_CASE("cut programs (the per-instruction device test's) compile, and the last one is the whole program") {
  constexpr auto linear = compile<order::linear>(causal_expr);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    CAPTURE(cuda::name_of(dt));
    cuda::program const base = chained_program(linear, {dt, dt}, 64, 64);
    auto cuts = cut_programs(base);
    REQUIRE(cuts.size() + 1 == base.passes[0].size());
    for (auto const& p : cuts) check_compiles(p);
    CHECK(cuts.back().passes[0] == base.passes[0]);  // row_divide o, then store o (64 columns): the program itself
  }
}

// Each tile instruction's CUDA side against its host side: the causal chained
// program cut after one instruction, with a store of the register it wrote,
// launched and emulated on the same inputs and state (output and final state
// compared). A cut after an instruction agrees only if it and everything
// before it agree, so the first failing cut names the instruction.
TEST_CASE("device: each tile instruction = its emulation (the program cut after it)") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto linear = compile<order::linear>(causal_expr);
  std::size_t const b = 1, h = 2, n = 150, d = 64, m = 64;  // every register has ≥ 64 columns: a store of 64 fits
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    cuda::program const base = chained_program(linear, {dt, dt}, d, m);
    auto q = rounded(tensor<float>::random({b, h, n, d}, 700), dt), k = rounded(tensor<float>::random({b, h, n, d}, 701), dt);
    auto v = rounded(tensor<float>::random({b, h, n, m}, 702), dt);
    auto s0 = tensor<float>::random({b, h, d, m + 1}, 703);
    for (std::size_t i = 0; i < s0.size(); ++i) s0.data()[i] = std::abs(s0.data()[i]);  // sums of elu+1 features are ≥ 0
    auto dq = upload(q, dt), dk = upload(k, dt), dv = upload(v, dt), ds0 = upload(s0, cuda::dtype::f32);
    std::size_t const out_bytes = b * h * n * m * cuda::size_of(dt), state_bytes = s0.size() * 4;
    cuda::device_buffer dout(out_bytes), ds1(state_bytes);
    auto operand_of = [](void const* data, std::size_t rows, std::size_t cols) {
      cuda::operand o;
      o.data = data;
      o.stride[0] = static_cast<std::int64_t>(h * rows * cols), o.stride[1] = static_cast<std::int64_t>(rows * cols);
      o.stride[2] = static_cast<std::int64_t>(cols), o.stride[3] = 1;
      o.cols = static_cast<std::int64_t>(cols);
      return o;
    };
    auto args = [&](void const* qp, void const* kp, void const* vp, void const* op, void const* si, void const* so) {
      cuda::forward_args a;
      a.in[0] = operand_of(qp, n, d), a.in[1] = operand_of(kp, n, d), a.in[2] = operand_of(vp, n, m);
      a.out = operand_of(op, n, m);
      a.state_in = operand_of(si, d, m + 1), a.state_out = operand_of(so, d, m + 1);
      a.batch = b, a.heads = h, a.n = n;
      return a;
    };
    for (cuda::program const& p : cut_programs(base)) {
      CAPTURE(cuda::name_of(dt));
      CAPTURE(p.kernel_name);
      // The emulation, on host copies in the kernel's element type.
      std::vector<std::uint16_t> hq = bits_of(q, dt), hk = bits_of(k, dt), hv = bits_of(v, dt);
      std::vector<std::uint16_t> hout16(b * h * n * m);
      tensor<float> hout32({b, h, n, m}), hs1({b, h, d, m + 1});
      bool const wide = dt == cuda::dtype::f32;
      void* hout = wide ? static_cast<void*>(hout32.data()) : static_cast<void*>(hout16.data());
      cuda::emulate(p, wide ? args(q.data(), k.data(), v.data(), hout, s0.data(), hs1.data())
                            : args(hq.data(), hk.data(), hv.data(), hout, s0.data(), hs1.data()));
      cuda::launch(p, args(dq.get(), dk.get(), dv.get(), dout.get(), ds0.get(), ds1.get()));
      cuda::synchronize(p.kernel_name);
      tensor<float> const want = wide ? hout32 : widened_from(hout16, dt, {b, h, n, m});
      tensor<float> const got = widened_from(dout, dt, {b, h, n, m});
      tensor<float> const got_state = widened_from(ds1, cuda::dtype::f32, {b, h, d, m + 1});
      double const bound = wide ? 1e-6 : tolerance(dt) / 4;  // as the whole-kernel launches
      CHECK(relative_rms(got, want) <= bound);
      CHECK(relative_rms(got_state, hs1) <= 1e-6);
    }
  }
}

// Without a GPU every entry point that needs one throws cuda_error saying "no
// CUDA device" and naming the call; nothing else is reachable here. (Where a
// device exists the device tests below run instead.)
TEST_CASE("no device: device tensors, copies, evaluate and chained launches throw cuda_error naming the call") {
  if (cuda::probe_device().available) {
    MESSAGE("not applicable: a CUDA device is present (the device tests run instead)");
    return;
  }
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto expect = [](auto f, std::string const& call) {
    CAPTURE(call);
    try {
      f();
      FAIL("no cuda_error");
    } catch (cuda::cuda_error const& e) {
      CHECK(e.call() == call);
      CHECK(std::string(e.what()).find(call) != std::string::npos);
      CHECK(std::string(e.what()).find("no CUDA device") != std::string::npos);
    }
  };
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 2);
  expect([&] { cuda::tensor<float> t({1, 2, 10, 4}); }, "cuda::tensor");
  expect([&] { cuda::tensor<cuda::bf16> t({1, 1, 1, 1}); }, "cuda::tensor");
  CHECK_NOTHROW(cuda::tensor<float>({1, 2, 0, 4}));  // nothing to allocate
  expect([&] { (void)cuda::to_device(q); }, "cuda::to_device");
  try {
    (void)cuda::to_device(q);
  } catch (cuda::cuda_error const& e) {
    MESSAGE("what a caller sees: " << std::string(e.what()));
  }
  expect([&] { (void)cuda::to_device<cuda::bf16>(q.view()); }, "cuda::to_device");
  cuda::tensor<float> empty;
  expect([&] { (void)cuda::to_host(empty); }, "cuda::to_host");

  shape4 sq{1, 2, 10, 4}, sv{1, 2, 10, 3};
  std::vector<float> fake(80);  // never read: nothing is launched
  cuda::device_view<float const> dq(fake.data(), sq), dv(fake.data(), sv);
  cuda::device_view<float> dout(fake.data(), sv);
  expect([&] { (void)cuda::evaluate(plan, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  expect([&] { (void)cuda::evaluate<cuda::bf16>(plan, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  expect([&] { cuda::evaluate_into(plan, dout, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate_into");
  cuda::state st(plan, 1, 2);
  expect([&] { cuda::evaluate_into(plan, dout, st, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate_into");
  CHECK(!st.sized());  // the failed first use left the state as it was
  expect([&] { (void)cuda::evaluate(plan, st, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  // States: to the device needs one; a host copy of a host state does not.
  cuda::state host(plan, 1, 2, cuda::memory::host);
  cuda::emulate(plan, {}, host, Q = q, K = q, V = v);
  expect([&] { (void)cuda::to_device(host); }, "cuda::to_device");
  expect([&] { (void)cuda::to_host(st); }, "cuda::to_host");
  cuda::state copy = cuda::to_host(host);
  CHECK(copy.where() == cuda::memory::host);
  CHECK(copy.shape() == host.shape());
  CHECK(std::equal(host.data(), host.data() + host.size(), copy.data()));
  // Decoding: a prompt and a step on the device (one token: [1, 2, 1, ·]).
  auto rnn = cuda::recurrent(plan, 1, 2);
  cuda::device_view<float const> tq(fake.data(), {1, 2, 1, 4}), tv(fake.data(), {1, 2, 1, 3});
  cuda::device_view<float> tout(fake.data(), {1, 2, 1, 3});
  expect([&] { rnn.step_into(tout, nullptr, Q = tq, K = tq, V = tv); }, "cuda::recurrent::step_into");
  expect([&] { rnn.prefill_into(dout, nullptr, Q = dq, K = dq, V = dv); }, "cuda::recurrent::prefill_into");
  CHECK(!rnn.state().sized());
  // The kernel launcher itself says so too, and a kernel cannot be prepared.
  cuda::forward_args a;
  expect([&] { cuda::launch(cuda::program_of(plan, {}, D = 4, M = 3), a); }, "launch");
  expect([&] { cuda::prepared_kernel k(cuda::program_of(plan, {}, D = 4, M = 3)); }, "cuda::prepared_kernel");
}

namespace {
// A float tensor as a device tensor of element type E (rounded to it).
template <class E>
cuda::tensor<E> device_copy(tensor<float> const& x) {
  return cuda::to_device<E>(x);
}
}  // namespace

TEST_CASE("device: to_device / to_host round trip, evaluate = CPU backend, chained launches = emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto expr = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto plan = compile(expr);
  // Round trips: fp32 exactly, 16-bit types as rounded on the host.
  auto x = tensor<float>::random({2, 3, 37, 5}, 7);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device(x)), x) == 0.0);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device<cuda::bf16>(x)), rounded(x, cuda::dtype::bf16)) == 0.0);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device<cuda::f16>(x)), rounded(x, cuda::dtype::f16)) == 0.0);
  {  // a strided host view comes back dense, with the same values
    auto t = tensor<float>::like(tensor_view<float const>(x.data(), {2, 5, 37, 3}, {555, 1, 15, 5}));
    for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i);
    CHECK(max_abs_diff(cuda::to_host(cuda::to_device(t)), t) == 0.0);
  }
  cuda::tensor<float> moved = cuda::to_device(x);
  float const* where = moved.data();
  cuda::tensor<float> owner = std::move(moved);
  CHECK(owner.data() == where);
  CHECK(moved.data() == nullptr);

  auto run = [&]<class E>(shape s, std::uint64_t seed) {
    cuda::dtype const dt = dtype_for<E>();
    CAPTURE(cuda::name_of(dt)); CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
    auto q = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed), dt);
    auto k = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed + 1), dt);
    auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 2), dt);
    auto dq = device_copy<E>(q), dk = device_copy<E>(k), dv = device_copy<E>(v);
    // evaluate → a device tensor, against the CPU backend on the same inputs.
    auto got = cuda::to_host(cuda::evaluate(plan, nullptr, Q = dq, K = dk, V = dv));
    auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
    double const bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);  // the tensor cores round operands
    CHECK(relative_rms(got, exact) <= bound);
    auto wide = cuda::to_host(cuda::evaluate<float>(plan, nullptr, Q = dq, K = dk, V = dv));  // fp32 out
    // fp32 products: the same fma chains (1e-6: expf's ulps). Tensor cores sum
    // in their own order, so a score or a state element can round to the
    // neighbouring bf16 on one side and not the other (measured on an H200:
    // 1.4e-5 at N = 200, D = M = 64): the 16-bit outputs' bound.
    CHECK(relative_rms(wide, cuda::emulate(plan, {dt, cuda::dtype::f32}, Q = q, K = k, V = v)) <=
          (dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4));
    // Two chained launches = the chained emulation, state included.
    std::size_t at = s.n / 3 + 1;
    cuda::state st(plan, s.b, s.h), host(plan, s.b, s.h, cuda::memory::host);
    auto sub = [&](cuda::tensor<E> const& t, std::size_t from, std::size_t to) {
      auto vw = t.view();
      auto sh = vw.shape();
      return cuda::device_view<E const>(vw.data() + static_cast<std::ptrdiff_t>(from) * vw.strides()[2],
                                        {sh[0], sh[1], to - from, sh[3]}, vw.strides());
    };
    cuda::tensor<E> out({s.b, s.h, s.n, s.m});
    for (auto [from, to] : {std::pair{std::size_t{0}, at}, std::pair{at, s.n}}) {
      auto ov = out.view();
      cuda::device_view<E> rows(ov.data() + static_cast<std::ptrdiff_t>(from) * ov.strides()[2],
                                {s.b, s.h, to - from, s.m}, ov.strides());
      cuda::evaluate_into(plan, rows, st, nullptr, Q = sub(dq, from, to), K = sub(dk, from, to), V = sub(dv, from, to));
      cuda::emulate(plan, {dt, dt}, host, Q = test::tokens(q, from, to), K = test::tokens(k, from, to),
                    V = test::tokens(v, from, to));
    }
    CHECK(relative_rms(cuda::to_host(out), exact) <= bound);
    cuda::state back = cuda::to_host(st);
    tensor<float> a(back.shape()), b(host.shape());
    std::copy(back.data(), back.data() + back.size(), a.data());
    std::copy(host.data(), host.data() + host.size(), b.data());
    CHECK(relative_rms(a, b) <= 1e-6);
    // A host state continued on the device, and a device state copied on the device.
    cuda::state resumed = cuda::to_device(host);
    cuda::state twin = cuda::to_device(st);
    auto y1 = cuda::to_host(cuda::evaluate(plan, resumed, nullptr, Q = sub(dq, 0, at), K = sub(dk, 0, at), V = sub(dv, 0, at)));
    auto y2 = cuda::to_host(cuda::evaluate(plan, twin, nullptr, Q = sub(dq, 0, at), K = sub(dk, 0, at), V = sub(dv, 0, at)));
    auto y3 = cuda::emulate(plan, {dt, dt}, host, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
    CHECK(relative_rms(y1, y3) <= tolerance(dt) / 4);
    CHECK(relative_rms(y2, y3) <= tolerance(dt) / 4);
  };
  for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{2, 2, 150, 16, 100}}) {
    run.template operator()<float>(s, 300);
    run.template operator()<cuda::bf16>(s, 400);
  }
}

TEST_CASE("NVRTC on-disk cache: keyed by source and architecture, checked on read") {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("lina-cuda-cache-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ::setenv("LINA_CUDA_CACHE", dir.c_str(), 1);
  cuda::attention_spec s;
  s.d = 8;
  s.m = 4;
  auto p = cuda::program_of(s);
  auto src = cuda::emit(p);
  auto first = cuda::compile_cached(src, p.kernel_name, "sm_90");
  auto again = cuda::compile_cached(src, p.kernel_name, "sm_90");
  auto other = cuda::compile_cached(src, p.kernel_name, "sm_80");
  CHECK(!first.from_cache);
  CHECK(again.from_cache);
  CHECK(!other.from_cache);
  CHECK(again.image == first.image);
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 2);
  // A damaged file is recompiled, not trusted.
  for (auto const& e : fs::directory_iterator(dir)) std::ofstream(e.path(), std::ios::binary) << "garbage";
  CHECK(!cuda::compile_cached(src, p.kernel_name, "sm_90").from_cache);
  ::setenv("LINA_CUDA_CACHE", "off", 1);
  CHECK(cuda::cache_directory().empty());
  CHECK(!cuda::compile_cached(src, p.kernel_name, "sm_90").from_cache);
  ::unsetenv("LINA_CUDA_CACHE");
  fs::remove_all(dir);
}

// ---- recurrent mode ------------------------------------------------------------------------
namespace {
// A prompt of p tokens, then one step per token, through cuda::recurrent in
// host memory (the emulation of the chunked and the step kernels), against
// one emulated pass, the CPU backend, and the CPU's state after all tokens.
template <class Expr>
void check_steps(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, bool positive = false) {
  auto const plan = compile(expr);
  auto const linear = compile<order::linear>(expr);
  test::rng r{seed};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    double worst = 0;
    for (shape const& s : cases) {
      auto [q, k, v] = random_inputs(s, dt, r, positive);
      std::size_t const prompt = s.n < 2 ? 0 : r.in(0, s.n / 2);
      CAPTURE(cuda::name_of(dt)); CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m); CAPTURE(prompt);
      for (bool exact : {true, false}) {
        cuda::options opt{dt, dt, exact};
        if (!exact && dt == cuda::dtype::f32) continue;
        auto rnn = cuda::recurrent(plan, s.b, s.h, opt, cuda::memory::host);
        tensor<float> got({s.b, s.h, s.n, s.m});
        rnn.prefill_into(rows_of(got, 0, prompt), Q = test::tokens(q, 0, prompt), K = test::tokens(k, 0, prompt),
                         V = test::tokens(v, 0, prompt));
        for (std::size_t t = prompt; t < s.n; ++t)
          rnn.step_into(rows_of(got, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                        V = test::tokens(v, t, t + 1));
        auto exact_result = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
        if (exact) {
          auto once = cuda::emulate(linear, opt, Q = q, K = k, V = v);
          auto cpu = cpu::evaluate(plan, Q = q, K = k, V = v);
          double e_once = relative_rms(got, once), e_cpu = relative_rms(got, cpu);
          CHECK(e_once <= tolerance(dt));
          CHECK(e_cpu <= tolerance(dt));
          cpu::state<float> cst;
          cpu::evaluate(plan, cst, Q = q, K = k, V = v);
          REQUIRE(rnn.state().shape() == cst[0].shape());
          double e_state = relative_rms(sums_of(rnn.state()), sums_of(cst));
          CHECK(e_state <= 1e-5);
          worst = std::max({worst, e_once / tolerance(dt), e_cpu / tolerance(dt), e_state / 1e-5});
        } else {  // tensor-core products: within their rounding of the exact result
          double bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact_result);
          CAPTURE(bound);
          CHECK(relative_rms(got, exact_result) <= bound);
        }
        // The step kernel: chained, T = 16, and (at the largest shape, as launched) it compiles.
        auto spec = cuda::spec_of(linear, opt);
        spec.d = s.d, spec.m = s.m, spec.chained = true, spec.step = true;
        auto const p = cuda::program_of(spec);
        CHECK(p.tiles.chunk == 16);
        if (&s == &cases.back() && exact == (dt == cuda::dtype::f32)) check_compiles(p);
        // Reset: the sums are zero again and the next token starts a new sequence.
        rnn.reset();
        CHECK(std::all_of(rnn.state().data(), rnn.state().data() + rnn.state().size(), [](float x) { return x == 0.0f; }));
        if (s.n > 0) {
          auto first = rnn.step(Q = test::tokens(q, 0, 1), K = test::tokens(k, 0, 1), V = test::tokens(v, 0, 1));
          auto alone = cuda::emulate(linear, opt, Q = test::tokens(q, 0, 1), K = test::tokens(k, 0, 1), V = test::tokens(v, 0, 1));
          CHECK(relative_rms(first, alone) <= tolerance(dt));
        }
      }
    }
    MESSAGE(cuda::name_of(dt) << " steps: largest error / tolerance: " << worst);
  }
}
}  // namespace

TEST_CASE("recurrent: emulated prompt + steps = one pass = the CPU backend, and the same state") {
  // Several M tiles (M > 64) share z; D ≠ M; a prompt of no tokens; N = 1.
  std::vector<shape> const cases = {{1, 1, 1, 5, 3}, {2, 3, 20, 16, 8}, {1, 2, 12, 24, 100}, {2, 1, 40, 64, 64}};
  check_steps(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 61, cases);
  check_steps(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 62, cases);
  check_steps(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 63, {{1, 2, 9, 6, 5}, {2, 1, 17, 12, 70}}, true);
}

TEST_CASE("recurrent: bad input is refused before anything runs, and the state survives") {
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto rnn = cuda::recurrent(plan, 2, 3, {}, cuda::memory::host);
  auto q = tensor<float>::random({2, 3, 1, 8}, 1), v = tensor<float>::random({2, 3, 1, 4}, 2);
  rnn.step(Q = q, K = q, V = v);
  std::vector<float> before(rnn.state().data(), rnn.state().data() + rnn.state().size());
  auto unchanged = [&] { return std::equal(before.begin(), before.end(), rnn.state().data()); };
  auto two = tensor<float>::random({2, 3, 2, 8}, 3), two_v = tensor<float>::random({2, 3, 2, 4}, 4);
  CHECK_THROWS_WITH_AS(rnn.step(Q = two, K = two, V = two_v), doctest::Contains("a step takes one token"), shape_error);
  auto wide = tensor<float>::random({2, 3, 1, 9}, 5);
  CHECK_THROWS_WITH_AS(rnn.step(Q = wide, K = wide, V = v), doctest::Contains("dimension D"), shape_error);
  auto other_batch = tensor<float>::random({1, 3, 1, 8}, 6), other_v = tensor<float>::random({1, 3, 1, 4}, 7);
  CHECK_THROWS_AS(rnn.step(Q = other_batch, K = other_batch, V = other_v), shape_error);
  CHECK(unchanged());
  // A state of another plan, or of another batch, is refused.
  auto relu_rnn = cuda::recurrent(compile(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), 2, 3, {}, cuda::memory::host);
  CHECK_THROWS_AS(rnn.set_state(cuda::state(relu_rnn.plan(), 2, 3, cuda::memory::host)), state_error);
  CHECK_THROWS_AS(rnn.set_state(cuda::state(rnn.plan(), 1, 3, cuda::memory::host)), state_error);
  CHECK(unchanged());
  // A host recurrent given device views, or a device one given host tensors at run time.
  auto dev_rnn = cuda::recurrent(plan, 2, 3);  // device memory: without a GPU nothing runs
  CHECK_THROWS_AS(dev_rnn.step(Q = q, K = q, V = v), std::invalid_argument);
  // A saved state continues the sequence.
  cuda::state saved = cuda::to_host(rnn.state());
  auto next = rnn.step(Q = q, K = q, V = v);
  rnn.set_state(std::move(saved));
  auto again = rnn.step(Q = q, K = q, V = v);
  CHECK(max_abs_diff(next, again) == 0.0);
}

// Steps launched on the device = the same steps emulated (state included),
// and after the first a step allocates nothing on the host.
TEST_CASE("device: recurrent steps = their emulation, and allocate nothing after the first") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto run = [&]<class E>(shape s, std::uint64_t seed) {
    cuda::dtype const dt = dtype_for<E>();
    CAPTURE(cuda::name_of(dt)); CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
    auto q = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed), dt);
    auto k = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed + 1), dt);
    auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 2), dt);
    auto gpu = cuda::recurrent(plan, s.b, s.h, {dt, dt});
    auto host = cuda::recurrent(plan, s.b, s.h, {dt, dt}, cuda::memory::host);
    std::size_t const prompt = s.n / 2;
    cuda::tensor<E> out({s.b, s.h, s.n, s.m});
    tensor<float> want({s.b, s.h, s.n, s.m});
    std::vector<cuda::tensor<E>> dq, dk, dv;  // every token's inputs, uploaded before the steps
    for (std::size_t t = prompt; t < s.n; ++t) {
      dq.push_back(cuda::to_device<E>(test::tokens(q, t, t + 1)));
      dk.push_back(cuda::to_device<E>(test::tokens(k, t, t + 1)));
      dv.push_back(cuda::to_device<E>(test::tokens(v, t, t + 1)));
    }
    auto pq = cuda::to_device<E>(test::tokens(q, 0, prompt)), pk = cuda::to_device<E>(test::tokens(k, 0, prompt)),
         pv = cuda::to_device<E>(test::tokens(v, 0, prompt));
    auto rows = [&](std::size_t from, std::size_t to) {
      auto ov = out.view();
      return cuda::device_view<E>(ov.data() + static_cast<std::ptrdiff_t>(from) * ov.strides()[2],
                                  {s.b, s.h, to - from, s.m}, ov.strides());
    };
    gpu.prefill_into(rows(0, prompt), nullptr, Q = pq, K = pk, V = pv);
    host.prefill_into(rows_of(want, 0, prompt), Q = test::tokens(q, 0, prompt), K = test::tokens(k, 0, prompt),
                      V = test::tokens(v, 0, prompt));
    std::size_t heap = 0;
    for (std::size_t t = prompt; t < s.n; ++t) {
      std::size_t const i = t - prompt;
      test::heap_counter c;
      gpu.step_into(rows(t, t + 1), nullptr, Q = dq[i], K = dk[i], V = dv[i]);
      if (i > 0) heap += c.allocations();
      host.step_into(rows_of(want, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                     V = test::tokens(v, t, t + 1));
    }
    CHECK(heap == 0);
    CHECK(relative_rms(cuda::to_host(out), want) <= (dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4));
    cuda::state back = cuda::to_host(gpu.state());
    tensor<float> a(back.shape()), b(host.state().shape());
    std::copy(back.data(), back.data() + back.size(), a.data());
    std::copy(host.state().data(), host.state().data() + host.state().size(), b.data());
    CHECK(relative_rms(a, b) <= 1e-6);
    // Element types other than the recurrent's: refused before any launch.
    auto f = cuda::to_device(test::tokens(q, 0, 1));
    auto fv = cuda::to_device(test::tokens(v, 0, 1));
    cuda::tensor<float> fo({s.b, s.h, 1, s.m});
    if (dt != cuda::dtype::f32) CHECK_THROWS_AS(gpu.step_into(fo.view(), nullptr, Q = f, K = f, V = fv), std::invalid_argument);
  };
  for (shape s : {shape{2, 3, 9, 16, 8}, shape{1, 2, 40, 64, 64}, shape{2, 1, 20, 48, 130}}) {
    run.template operator()<float>(s, 700);
    run.template operator()<cuda::bf16>(s, 800);
  }
}

// ---- the chunk-parallel form (splitting N) -----------------------------------------------
namespace {
// Groups of 1, 2 and 3 chunks (and one group for all) against one pass of the
// same kernel: the same sums in another order (exact products: the fp32
// tolerance; tensor cores: the output's rounding, as two launches agree).
template <class Expr>
void check_split(Expr const& expr, std::uint64_t seed, std::vector<shape> const& cases, bool positive = false) {
  auto const plan = compile<order::linear>(expr);
  test::rng r{seed};
  double worst = 0;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    for (shape const& s : cases) {
      auto [q, k, v] = random_inputs(s, dt, r, positive);
      for (bool exact : {true, false}) {
        cuda::options opt{dt, dt, exact};
        auto const once = cuda::emulate(plan, opt, Q = q, K = k, V = v);
        auto spec = cuda::spec_of(plan, opt);
        spec.d = s.d, spec.m = s.m;
        auto const sp = cuda::split_programs_of(spec);
        std::int64_t const t = sp.scan.tiles.chunk;
        for (std::int64_t rows : {t, 2 * t, 3 * t, 1000 * t}) {
          CAPTURE(cuda::name_of(dt)); CAPTURE(exact); CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
          CAPTURE(rows);
          cuda::options split = opt;
          split.split_rows = rows;
          double const e = relative_rms(cuda::emulate(plan, split, Q = q, K = k, V = v), once);
          double const tol = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);
          CHECK(e <= tol);
          worst = std::max(worst, e / tol);
        }
        if ((&s == &cases.front() || s.d == 128) && exact == (dt == cuda::dtype::f32)) {  // the kernels launches use
          check_compiles(sp.partials);
          check_compiles(sp.scan);
        }
      }
    }
  }
  MESSAGE("split: largest error / tolerance: " << worst);
}
}  // namespace

TEST_CASE("split: the chunk-parallel form (groups of rows, two launches) = one pass") {
  // Several groups and M tiles; N not a multiple of the chunk; a group shorter than the others; N = 0.
  std::vector<shape> const cases = {{1, 1, 0, 8, 8}, {2, 1, 300, 16, 8}, {1, 2, 257, 24, 100}, {1, 1, 200, 128, 128}};
  check_split(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 71, cases);
  check_split(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 72, {{2, 1, 300, 16, 8}, {1, 2, 150, 9, 70}});
  check_split(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 73, {{1, 2, 150, 6, 5}}, true);
  // Non-causal: the partials over groups of K's rows, every group of Q's rows starting from all of them.
  check_split(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V, 78, cases);
  check_split(phi<relu>(Q) * transpose(phi<relu>(K)) * V, 79, {{2, 1, 300, 16, 8}});
  // When to split: only when the unsplit blocks leave SMs idle and N has chunks to share.
  CHECK(cuda::split_rows(192, 8192, 64, 132) == 0);   // enough blocks
  CHECK(cuda::split_rows(16, 100, 64, 132) == 0);     // two chunks
  std::int64_t const rows = cuda::split_rows(32, 16384, 64, 132);  // B2 H16: 9 groups of 29 chunks
  CHECK(rows % 64 == 0);
  CHECK((16384 + rows - 1) / rows * 32 >= 132);
  CHECK(rows >= 128);
}

// A chained evaluation (a block of a longer sequence, the decode prefill)
// splits too: each group starts from the state in plus the groups before it,
// and the last group leaves the state out. Against the same block in one
// pass, rows and state, after a first block that left a state.
TEST_CASE("split: a chained block (groups of rows from the state in) = one pass, rows and state") {
  auto check = [](auto const& plan, shape s, std::uint64_t seed) {
    auto spec = cuda::spec_of(plan);
    spec.d = s.d, spec.m = s.m, spec.chained = true;
    auto const sp = cuda::split_programs_of(spec);
    auto unchained = spec;
    unchained.chained = false;
    CHECK(sp.partials.kernel_name == cuda::split_programs_of(unchained).partials.kernel_name);  // one kernel for both
    std::int64_t const t = sp.scan.tiles.chunk;
    std::size_t const cut = 70;
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
      test::rng r{seed};
      auto [q, k, v] = random_inputs(s, dt, r, false);
      cuda::options const opt{dt, dt};
      auto run = [&](std::int64_t rows, tensor<float>& out) {  // two blocks; the second split into groups of `rows`
        cuda::state st(plan, s.b, s.h, cuda::memory::host);
        cuda::emulate_into(plan, opt, rows_of(out, 0, cut), st, Q = test::tokens(q, 0, cut), K = test::tokens(k, 0, cut),
                           V = test::tokens(v, 0, cut));
        cuda::options split = opt;
        split.split_rows = rows;
        cuda::emulate_into(plan, split, rows_of(out, cut, s.n), st, Q = test::tokens(q, cut, s.n),
                           K = test::tokens(k, cut, s.n), V = test::tokens(v, cut, s.n));
        return sums_of(st);
      };
      tensor<float> once({s.b, s.h, s.n, s.m});
      auto const state = run(0, once);
      for (std::int64_t rows : {t, 2 * t, 1000 * t}) {
        CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m); CAPTURE(rows);
        tensor<float> got({s.b, s.h, s.n, s.m});
        auto const got_state = run(rows, got);
        double const tol = dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt);  // the same sums in another order
        CHECK(relative_rms(got, once) <= tol);
        CHECK(relative_rms(got_state, state) <= 1e-5);  // fp32 sums whatever the inputs
      }
    }
    check_compiles(sp.scan);
  };
  check(compile<order::linear>(causal_expr), {2, 1, 300, 16, 8}, 74);
  check(compile<order::linear>(causal(phi<relu>(Q) * transpose(phi<relu>(K))) * V), {1, 2, 331, 24, 100}, 75);
}

// Launches that split N (too few (batch, head) blocks for the device) = the
// emulation of the same split.
TEST_CASE("device: the chunk-parallel form = its emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto plan = compile<order::linear>(causal_expr);
  {  // non-causal: the partials over groups of K's rows
    constexpr auto full = compile<order::linear>(full_expr);
    shape const s{1, 1, 1000, 64, 64};
    auto spec = cuda::spec_of(full, {});
    spec.d = s.d, spec.m = s.m;
    std::int64_t const rows = cuda::split_rows(cuda::program_of(spec).m_tiles, 1000, cuda::program_of(spec).tiles.chunk, dev.sms);
    REQUIRE(rows > 0);
    auto q = tensor<float>::random({1, 1, 1000, 64}, 4), k = tensor<float>::random({1, 1, 1000, 64}, 5),
         v = tensor<float>::random({1, 1, 1000, 64}, 6);
    cuda::options opt{};
    opt.split_rows = rows;
    auto want = cuda::emulate(full, opt, Q = q, K = k, V = v);
    auto got = cuda::to_host(cuda::evaluate(full, nullptr, Q = cuda::to_device(q), K = cuda::to_device(k), V = cuda::to_device(v)));
    CHECK(relative_rms(got, want) <= 1e-6);
  }
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape s : {shape{1, 1, 1000, 64, 64}, shape{1, 2, 777, 128, 128}, shape{2, 1, 300, 16, 8}}) {
      CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d);
      auto spec = cuda::spec_of(plan, {dt, dt});
      spec.d = s.d, spec.m = s.m;
      auto const p = cuda::program_of(spec);
      std::int64_t const rows = cuda::split_rows(static_cast<std::int64_t>(s.b * s.h) * p.m_tiles,
                                                 static_cast<std::int64_t>(s.n), p.tiles.chunk, dev.sms);
      REQUIRE(rows > 0);
      auto q = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, 1), dt);
      auto k = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, 2), dt);
      auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, 3), dt);
      cuda::options opt{dt, dt};
      opt.split_rows = rows;
      auto want = cuda::emulate(plan, opt, Q = q, K = k, V = v);
      auto got = [&]<class E>() {
        auto dq = cuda::to_device<E>(q), dk = cuda::to_device<E>(k), dv = cuda::to_device<E>(v);
        return cuda::to_host(cuda::evaluate(plan, nullptr, Q = dq, K = dk, V = dv));
      };
      auto y = dt == cuda::dtype::f32 ? got.template operator()<float>() : got.template operator()<cuda::bf16>();
      CHECK(relative_rms(y, want) <= (dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4));
      // Chained through a state: the launch splits the same way; rows and the state out as emulated.
      cuda::state st(plan, s.b, s.h), host(plan, s.b, s.h, cuda::memory::host);
      auto want_chained = cuda::emulate(plan, opt, host, Q = q, K = k, V = v);
      auto got_chained = [&]<class E>() {
        auto dq = cuda::to_device<E>(q), dk = cuda::to_device<E>(k), dv = cuda::to_device<E>(v);
        return cuda::to_host(cuda::evaluate(plan, st, nullptr, Q = dq, K = dk, V = dv));
      };
      auto yc = dt == cuda::dtype::f32 ? got_chained.template operator()<float>() : got_chained.template operator()<cuda::bf16>();
      CHECK(relative_rms(yc, want_chained) <= (dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4));
      CHECK(relative_rms(sums_of(cuda::to_host(st)), sums_of(host)) <= 1e-6);
    }
}
