// The CUDA backend's forward kernels without a GPU: each plan's tile program
// runs in the host emulation and agrees with the CPU backend and with the
// expression evaluated as written (in double), for every map, softmax,
// parametric maps, cross-attention, stacked layers and strided layouts; the
// kernels the tests generate compile with NVRTC (sm_90 cubins, compute_80 PTX)
// with an empty log.
#include "cuda_support.hpp"

TEST_CASE("emulated causal forward = CPU backend = as written") {
  check_forward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 11);
  check_forward(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V, 12);
  check_forward(causal(phi<identity>(Q) * transpose(phi<identity>(K))) * V, 13);
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

// From D = 64 poly2's C × (M+1) state (C = D(D+1)/2 = 2080) no longer fits a
// block: the kernel then takes poly2's kernel, φ(q)·φ(k) = (q·k)², in the
// quadratic program softmax has (square_rows for exp), from Q's and K's D
// columns — the same attention, no feature tiles.
TEST_CASE("emulated poly2 forward past a block's state: quadratic, through its kernel (q·k)²") {
  std::vector<shape> const large = {{1, 1, 0, 64, 8}, {1, 2, 1, 64, 5}, {2, 1, 70, 64, 16}, {1, 1, 130, 96, 24}};
  check_forward(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V, 35, large, false, 3);
  check_forward(phi<poly2>(Q) * transpose(phi<poly2>(K)) * V, 36, large, false, 1);
  check_forward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V, 37, large, true, 3);
  check_forward(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V, 38, large, true, 1);
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V));
  spec.d = 32, spec.m = 16;
  CHECK_FALSE(cuda::program_of(spec).quadratic);  // (C = 528 still fits)
  spec.d = 64;
  auto const p = cuda::program_of(spec);
  CHECK(p.quadratic);
  CHECK(cuda::listing(p).find("square_rows") != std::string::npos);
  CHECK_THROWS_AS(cuda::split_programs_of(spec), std::invalid_argument);  // (no state to split)
  spec.chained = true;  // a chained block needs the C × (M+1) state itself: a clear error
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("too large"), std::invalid_argument);
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
// — so rows whose exp overflows fp32 still come out right, as the CPU's
// fp32 plan's (its rows carry their shift: lina/cpu/evaluate.hpp, "Exponents").
TEST_CASE("softmax: rows whose exp overflows fp32 still normalise (the running max), and NaN propagates") {
  constexpr auto expr = normalize(causal(exp(Q * transpose(K) * 8.0))) * V;
  constexpr auto plan = compile(expr);
  shape const s{1, 2, 150, 16, 12};
  test::rng r{45};
  auto inputs = random_inputs(s, cuda::dtype::f32, r, false);
  auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
  for (std::size_t i = 0; i < q.size(); ++i) q.data()[i] *= 3.0f;  // scores up to ~8·3·16: exp(300)
  double top = 0;
  for (std::size_t h = 0; h < s.h; ++h)
    for (std::size_t i = 0; i < s.n; ++i)
      for (std::size_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (std::size_t c = 0; c < s.d; ++c) dot += double(q(0, h, i, c)) * k(0, h, j, c);
        top = std::max(top, 8.0 * dot);
      }
  REQUIRE(top > std::log(double(std::numeric_limits<float>::max())));  // the case this test is about
  auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
  CHECK(relative_rms(cpu::evaluate(plan, Q = q, K = k, V = v), exact) <= 1e-5);
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

// The caller's tiles (options::tiles) are a schedule, not another computation:
// every chunk and M tile that fits gives the attention as written — fp32
// within the summation order's tolerance, 16-bit on the tensor cores within
// their operands' rounding — forward (causal, non-causal, softmax; one pass,
// split over N, chained) and backward (one pass and split); a request that
// does not fit shared memory, or is no schedule, throws before anything runs.
TEST_CASE("requested tiles: every chunk and M tile that fits computes the same attention") {
  shape const s{1, 2, 150, 24, 40};
  auto forward = [&](auto const& expr, std::uint64_t seed) {
    auto const plan = plan_of(expr);
    test::rng r{seed};
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
      double const bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);
      for (int t : {16, 32, 64})
        for (int tm : {0, 8, 24, 40, 100}) {
          CONTEXT(cuda::name_of(dt), t, tm);
          cuda::options opt{dt, dt};
          opt.tiles = {t, tm};
          auto const p = cuda::program_of(plan, opt, D = s.d, M = s.m);
          CHECK(p.tiles.chunk == t);
          CHECK(p.tiles.tile_m == (tm == 0 ? 40 : std::min(tm, 40)));  // (lina's own: min(M, 64); past M: M)
          auto const got = cuda::emulate(plan, opt, Q = q, K = k, V = v);
          CHECK(relative_rms(got, exact) <= bound);
          // Prefetching the next chunk's rows is a hint: the same program with
          // a prefetch before each chunk's loads, the same numbers.
          cuda::options hinted = opt;
          hinted.tiles.prefetch = true;
          auto const hp = cuda::program_of(plan, hinted, D = s.d, M = s.m);
          CHECK(hp.kernel_name == p.kernel_name + "_pf");
          CHECK(cuda::listing(hp).find("prefetch " + p.inputs.at(p.quadratic ? 1 : 0).name + "[next chunk") != std::string::npos);
          CHECK(cuda::emit(hp).find("tl::prefetch<in_type>") != std::string::npos);
          CHECK(max_abs_diff(cuda::emulate(plan, hinted, Q = q, K = k, V = v), got) == 0.0);
          // Other block sizes: the same block-wide instructions, the products' stripes over W warps.
          for (int threads : {128, 512}) {
            cuda::options wide = opt;
            wide.tiles.threads = threads;
            auto const wp = cuda::program_of(plan, wide, D = s.d, M = s.m);
            CHECK(wp.tiles.threads == threads);
            CHECK(wp.kernel_name == p.kernel_name + "_th" + std::to_string(threads));
            CHECK(cuda::emit(wp).find(fmt::format("__launch_bounds__({})", threads)) != std::string::npos);
            CHECK(max_abs_diff(cuda::emulate(plan, wide, Q = q, K = k, V = v), got) == 0.0);
          }
          if (p.quadratic) continue;
          opt.split_rows = 2 * t;  // the chunk-parallel form at these tiles
          CHECK(relative_rms(cuda::emulate(plan, opt, Q = q, K = k, V = v), exact) <= bound);
        }
    }
  };
  forward(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V, 71);
  forward(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V, 72);
  forward(normalize(causal(exp(Q * transpose(K) * 0.25))) * V, 73);

  constexpr auto expr = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto plan = compile<order::linear>(expr);
  test::rng r{74};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    auto inputs = random_inputs(s, dt, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
    auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
    auto exact_grad = cpu::gradient(expr, widened(dout), Q = widened(q), K = widened(k), V = widened(v));
    double const bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);
    double const grad_bound = dt == cuda::dtype::f32 ? tolerance(dt) : backward_mma_bound(dt, true);
    for (int t : {16, 32, 64}) {
      CONTEXT(cuda::name_of(dt), t);
      cuda::options opt{dt, dt};
      opt.tiles = {t, 16};
      // Chained: two blocks through a state, at these tiles, = the attention in one.
      tensor<float> chained({s.b, s.h, s.n, s.m});
      cuda::state st(plan, s.b, s.h, cuda::memory::host);
      cuda::emulate_into(plan, opt, rows_of(chained, 0, 70), st, Q = test::tokens(q, 0, 70), K = test::tokens(k, 0, 70),
                         V = test::tokens(v, 0, 70));
      cuda::emulate_into(plan, opt, rows_of(chained, 70, s.n), st, Q = test::tokens(q, 70, s.n),
                         K = test::tokens(k, 70, s.n), V = test::tokens(v, 70, s.n));
      CHECK(relative_rms(chained, exact) <= bound);
      // The backward's chunk (it holds every column of M: tile_m is the forward's alone).
      auto spec = cuda::spec_of(plan, opt);
      spec.d = s.d, spec.m = s.m;
      CHECK(cuda::backward_program_of(spec).tiles.chunk == t);
      for (std::int64_t split : {std::int64_t{0}, std::int64_t{2 * t}}) {
        CAPTURE(split);
        opt.split_rows = split;
        auto g = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
        CHECK(relative_rms(g[Q], as_float(exact_grad[Q])) <= grad_bound);
        CHECK(relative_rms(g[K], as_float(exact_grad[K])) <= grad_bound);
        CHECK(relative_rms(g[V], as_float(exact_grad[V])) <= grad_bound);
      }
    }
  }

  {  // The split forms' loops name the next chunk too (a reverse walk's: the one before): their kernels compile.
    auto spec = cuda::spec_of(plan, {cuda::dtype::bf16, cuda::dtype::bf16});
    spec.d = s.d, spec.m = s.m;
    spec.tiles = {32, 24, true};
    auto const split = cuda::split_programs_of(spec);
    check_compiles(split.partials);
    check_compiles(split.scan);
    for (auto const& p : cuda::split_backward_programs_of(spec)) check_compiles(p);
  }

  // What does not fit or is no schedule: an error that says what was asked, before anything is written.
  auto spec = cuda::spec_of(plan, {cuda::dtype::bf16, cuda::dtype::bf16});
  spec.d = spec.m = 256;
  spec.tiles = {64, 256};
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("requested tiles (T = 64, M tile = 256) need"),
                       std::invalid_argument);
  spec.d = spec.m = 128;
  spec.tiles = {64, 0};  // the forward fits; the backward's state at T = 64 does not, so its launches slice M
  CHECK(cuda::program_of(spec).tiles.chunk == 64);
  CHECK_THROWS_WITH_AS(cuda::backward_program_of(spec), doctest::Contains("T = 64 (requested)"), std::invalid_argument);
  for (auto const& p : cuda::backward_programs_of(spec)) CHECK(p.tiles.chunk == 64);
  spec.tiles = {48, 0};
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("a chunk of 48 rows was requested"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cuda::backward_programs_of(spec), doctest::Contains("a chunk of 48 rows"), std::invalid_argument);
  spec.tiles = {0, -8};
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("an M tile of -8 columns"), std::invalid_argument);
  spec.tiles = {0, 0, false, 384};
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("blocks of 384 threads were requested"), std::invalid_argument);
  spec.tiles = {0, 0, false, 512};
  CHECK(cuda::backward_programs_of(spec).front().tiles.threads == 512);
  spec.tiles = {32, 0};
  spec.chained = spec.step = true;  // a decoding step keeps its chunk of 16 (a recurrent's prefill takes the request)
  CHECK(cuda::program_of(spec).tiles.chunk == 16);
  auto q = tensor<float>::random({1, 1, 20, 8}, 1), k = tensor<float>::random({1, 1, 20, 8}, 2),
       v = tensor<float>::random({1, 1, 20, 8}, 3);
  tensor<float> out({1, 1, 20, 8});
  out.data()[0] = 7.0f;
  cuda::options bad{};
  bad.tiles = {20, 0};
  CHECK_THROWS_AS(cuda::emulate_into(plan, bad, out.view(), Q = q, K = k, V = v), std::invalid_argument);
  CHECK(out.data()[0] == 7.0f);
}

// An output (or a gradient's view) in memory an input may share, or one that
// reaches an element twice, is refused before anything runs, on the device
// and in its emulation alike: the kernel's blocks read inputs while others
// write, in no order. (The CPU
// backend computes through a copy instead: tests/test_errors.cpp.)
TEST_CASE("an output or a gradient view in an input's memory: alias_error, nothing written") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  std::size_t const b = 1, h = 2, n = 10, d = 4;
  auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2);
  auto v = tensor<float>::random({b, h, n, d}, 3), dout = tensor<float>::random({b, h, n, d}, 4);
  auto const q0 = q, v0 = v, dout0 = dout;
  auto refused = [](auto const& f, std::string const& says) {
    CAPTURE(says);
    try {
      f();
      FAIL("no alias_error");
    } catch (alias_error const& e) {
      CHECK(std::string(e.what()).find(says) != std::string::npos);
    }
  };
  refused([&] { cuda::emulate_into(plan, {}, v.view(), Q = q, K = k, V = v); },
          "lina::alias_error: cuda::emulate_into: the output may share memory with input V");
  std::vector<float> one_head(n * d);
  refused([&] { cuda::emulate_into(plan, {}, tensor_view<float>(one_head.data(), {b, h, n, d}, {0, 0, 4, 1}), Q = q, K = k, V = v); },
          "cuda::emulate_into: the output (shape [1, 2, 10, 4], strides [0, 0, 4, 1]) reaches some of its elements twice");
  cuda::state st(plan, b, h, cuda::memory::host);
  refused([&] { cuda::emulate_into(plan, {}, q.view().rows(0, n), st, Q = q, K = k, V = v); }, "with input Q");
  CHECK(!st.sized());
  // device views (over host memory: the check comes before the device is asked for)
  cuda::device_view<float const> dq(q.data(), q.shape()), dk(k.data(), k.shape()), dv(v.data(), v.shape());
  refused([&] { cuda::evaluate_into(plan, cuda::device_view<float>(k.data(), k.shape()), nullptr, Q = dq, K = dk, V = dv); },
          "cuda::evaluate_into: the output may share memory with input K");
  auto rnn = cuda::recurrent(plan, b, h, {}, cuda::memory::host);
  refused([&] { rnn.step_into(v.view().rows(0, 1), Q = q.rows(0, 1), K = k.rows(0, 1), V = v.rows(0, 1)); }, "with input V");
  // gradients: over an input, over dout, over each other
  auto into = cuda::emulate_gradient_views(plan);
  tensor<float> gq({b, h, n, d}), gk({b, h, n, d});
  into[Q] = gq.view(), into[K] = gk.view(), into[V] = q.view();
  refused([&] { cuda::emulate_gradient_into(plan, {}, into, dout, Q = q, K = k, V = v); },
          "cuda::emulate_gradient_into: the view of ∂V may share memory with input Q");
  into[V] = dout.view();
  refused([&] { cuda::emulate_gradient_into(plan, {}, into, dout, Q = q, K = k, V = v); },
          "the view of ∂V may share memory with dout");
  into[V] = gq.view();
  refused([&] { cuda::emulate_gradient_into(plan, {}, into, dout, Q = q, K = k, V = v); },
          "the view of ∂V may share memory with the view of ∂Q: give each gradient memory of its own");
  CHECK(max_abs_diff(q, q0) == 0);
  CHECK(max_abs_diff(v, v0) == 0);
  CHECK(max_abs_diff(dout, dout0) == 0);
}

// Launches take a schedule after the stream (evaluate_into, evaluate, gradient, each
// chained too): a request that is no schedule throws before anything runs, device
// or not, and without a device the launch is the usual cuda_error.
TEST_CASE("requested tiles on launches: checked before anything runs") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  shape4 const sq{1, 2, 10, 4}, sv{1, 2, 10, 3};
  std::vector<float> fake(80, 5.0f), fake_out(80, 5.0f);  // never read: nothing is launched
  cuda::device_view<float const> const dq(fake.data(), sq), dv(fake.data(), sv);
  cuda::device_view<float> const dout(fake_out.data(), sv);
  cuda::state st(plan, 1, 2);
  auto no_schedule = [](auto const& f) {
    CHECK_THROWS_WITH_AS(f(), doctest::Contains("a chunk of 24 rows was requested"), std::invalid_argument);
  };
  cuda::tile_request const bad{24, 0};
  no_schedule([&] { cuda::evaluate_into(plan, dout, nullptr, bad, Q = dq, K = dq, V = dv); });
  no_schedule([&] { cuda::evaluate_into(plan, dout, st, nullptr, bad, Q = dq, K = dq, V = dv); });
  no_schedule([&] { (void)cuda::gradient(plan, dv, nullptr, bad, Q = dq, K = dq, V = dv); });
  CHECK(std::all_of(fake_out.begin(), fake_out.end(), [](float x) { return x == 5.0f; }));
  if (!cuda::probe_device().available) {
    CHECK_THROWS_AS(cuda::evaluate_into(plan, dout, nullptr, cuda::tile_request{32, 2, true}, Q = dq, K = dq, V = dv),
                    cuda::cuda_error);
    CHECK_THROWS_AS((void)cuda::evaluate(plan, st, nullptr, cuda::tile_request{16, 0}, Q = dq, K = dq, V = dv),
                    cuda::cuda_error);
    CHECK_THROWS_AS((void)cuda::gradient(plan, dv, nullptr, cuda::tile_request{16, 0}, Q = dq, K = dq, V = dv),
                    cuda::cuda_error);
  }
}

// Grouped-query attention through views, as on the CPU (test_cpu.cpp): Q as
// [B·Hkv, g, N, D], K and V with a zero head stride. The kernels read each
// operand at its own strides, so the emulation gives attention on K, V
// repeated per query head, bit for bit, and per-query-head gradients whose
// sums over a group are the shared heads' (the same rows in the same order:
// equal up to the order of the group's sum).
TEST_CASE("grouped-query attention through views (a zero head stride) = K, V repeated per query head") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  std::size_t const b = 2, hkv = 2, g = 3, h = hkv * g, n = 70, d = 16, m = 12;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    auto q = rounded(tensor<float>::random({b, h, n, d}, 31), dt), k = rounded(tensor<float>::random({b, hkv, n, d}, 32), dt),
         v = rounded(tensor<float>::random({b, hkv, n, m}, 33), dt), dout = rounded(tensor<float>::random({b, h, n, m}, 34), dt);
    auto grouped = [&](tensor<float> const& x, bool shared) { return test::grouped_heads(x, g, shared); };
    auto const kr = test::repeat_heads(k, g), vr = test::repeat_heads(v, g);
    cuda::options const opt{dt, dt};
    auto const want = cuda::emulate(plan, opt, Q = q, K = kr, V = vr);
    auto const got = cuda::emulate(plan, opt, Q = grouped(q, false), K = grouped(k, true), V = grouped(v, true));
    CHECK(max_abs_diff(tensor_view<float const>(got.data(), {b, h, n, m}), want) == 0.0);
    auto const gw = cuda::emulate_gradient(plan, opt, dout, Q = q, K = kr, V = vr);
    auto const gg = cuda::emulate_gradient(plan, opt, tensor_view<float const>(dout.data(), {b * hkv, g, n, m}),
                                           Q = grouped(q, false), K = grouped(k, true), V = grouped(v, true));
    CHECK(max_abs_diff(tensor_view<float const>(gg[Q].data(), {b, h, n, d}), gw[Q]) == 0.0);
    // Summed over each group: the shared heads' gradients, against the repeated heads' summed
    // (each query head's share the same bits, summed in the same order).
    CHECK(max_abs_diff(test::sum_groups(gg[K], hkv, g, true), test::sum_groups(gw[K], hkv, g, false)) == 0.0);
    CHECK(max_abs_diff(test::sum_groups(gg[V], hkv, g, true), test::sum_groups(gw[V], hkv, g, false)) == 0.0);
  }
}

// 64-bit offsets (as on the CPU, test_cpu.cpp): every operand's second batch
// 2³¹ + 2²⁰ elements past its first. The emulation reads and writes fp32
// operands in place, through the same 64-bit offsets the kernels compute
// (`const long long in0_base = b * args.in[0].stride[0] + …`); on a device,
// launches on such views (one 8 GiB allocation) = the emulation.
TEST_CASE("offsets past 2³¹ elements: batches 2³¹ apart = the same batches dense") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  std::size_t const b = 2, h = 3, n = 90, d = 16, m = 12;
  auto q = tensor<float>::random({b, h, n, d}, 41), k = tensor<float>::random({b, h, n, d}, 42),
       v = tensor<float>::random({b, h, n, m}, 43), dout = tensor<float>::random({b, h, n, m}, 44);
  test::sparse_memory block(test::far_bytes<float>(b));
  auto fq = test::far_view<float>(block.data, 0, q.shape()), fk = test::far_view<float>(block.data, 1, k.shape()),
       fv = test::far_view<float>(block.data, 2, v.shape()), fo = test::far_view<float>(block.data, 3, v.shape());
  test::copy_into(fq, q), test::copy_into(fk, k), test::copy_into(fv, v);
  tensor_view<float const> const cq = fq, ck = fk, cv = fv;
  cuda::options const opt{};
  auto const want = cuda::emulate(plan, opt, Q = q, K = k, V = v);
  cuda::emulate_into(plan, opt, fo, Q = cq, K = ck, V = cv);
  CHECK(max_abs_diff(fo, want) == 0.0);
  cuda::options split = opt;
  split.split_rows = 64;  // the chunk-parallel form's partial sums: offsets of their own
  CHECK(max_abs_diff(cuda::emulate(plan, split, Q = cq, K = ck, V = cv), cuda::emulate(plan, split, Q = q, K = k, V = v)) == 0.0);
  auto const gw = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
  auto const gf = cuda::emulate_gradient(plan, opt, dout, Q = cq, K = ck, V = cv);
  CHECK(max_abs_diff(gf[Q], gw[Q]) == 0.0);
  CHECK(max_abs_diff(gf[K], gw[K]) == 0.0);
  CHECK(max_abs_diff(gf[V], gw[V]) == 0.0);

  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  cuda::device_buffer far(test::far_bytes<float>(b));
  auto at = [&](int slot, std::size_t batch) {  // where far_view puts a batch
    return static_cast<float*>(far.get()) + slot * test::far_slot + static_cast<std::ptrdiff_t>(batch) * test::far_batch;
  };
  auto put = [&](tensor<float> const& x, int slot) {
    std::size_t const per_batch = x.size() / b;
    for (std::size_t xb = 0; xb < b; ++xb)
      cuda::copy_to_device(at(slot, xb), x.data() + xb * per_batch, per_batch * sizeof(float), nullptr, "cudaMemcpy");
  };
  put(q, 0), put(k, 1), put(v, 2);
  auto view = [&](int slot, shape4 s) {
    auto const t = test::far_view<float>(far.get(), slot, s);
    return cuda::device_view<float>(t.data(), s, t.strides());
  };
  cuda::evaluate_into(plan, view(3, v.shape()), nullptr, Q = cuda::device_view<float const>(view(0, q.shape())),
                      K = cuda::device_view<float const>(view(1, k.shape())), V = cuda::device_view<float const>(view(2, v.shape())));
  cuda::synchronize();
  tensor<float> got(v.shape());
  for (std::size_t xb = 0; xb < b; ++xb)
    cuda::copy_to_host(got.data() + xb * h * n * m, at(3, xb), h * n * m * sizeof(float), nullptr, "cudaMemcpy");
  cuda::synchronize();
  CHECK(relative_rms(got, want) <= 1e-6);
}

// tile_request::groups: how many groups of rows a launch splits N into (the
// chunk-parallel form) instead of lina's choice from the device. The emulation
// at a schedule with groups is the emulation with those rows per group
// (options::split_rows), bit for bit; where the plan has no such form, the
// request changes nothing.
TEST_CASE("requested groups: N split into the groups asked for, = the same rows per group") {
  // The rows per group: whole chunks, at most G groups, none where that makes one.
  auto rows = [](int groups, std::int64_t n) { return cuda::split_rows(cuda::tile_request{.groups = groups}, 4, n, 16, 0); };
  CHECK(rows(0, 150) == 0);  // lina's choice, and no device: one pass
  CHECK(rows(1, 150) == 0);
  CHECK(rows(2, 150) == 80);  // 10 chunks: 5 + 5
  CHECK(rows(3, 150) == 64);  // 4 + 4 + 2
  CHECK(rows(10, 150) == 16);
  CHECK(rows(50, 150) == 16);  // at least a chunk per group
  CHECK(rows(4, 10) == 0);     // one chunk: one group
  CHECK(cuda::split_rows(cuda::tile_request{}, 4, 4096, 64, 132) == cuda::split_rows(4, 4096, 64, 132));
  CHECK(cuda::split_rows(cuda::tile_request{.groups = 1}, 4, 4096, 64, 132) == 0);

  shape const s{2, 2, 150, 24, 40};
  auto same_rows = [&](auto const& expr, bool has_split, std::uint64_t seed) {
    auto const plan = plan_of(expr);
    test::rng r{seed};
    auto inputs = random_inputs(s, cuda::dtype::bf16, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
    cuda::options opt{cuda::dtype::bf16, cuda::dtype::bf16};
    opt.tiles = {16, 0};
    auto const one = cuda::emulate(plan, opt, Q = q, K = k, V = v);
    opt.tiles.groups = 3;
    auto const grouped = cuda::emulate(plan, opt, Q = q, K = k, V = v);
    CHECK(relative_rms(grouped, exact) <= tolerance(cuda::dtype::bf16) + rounding_bound(expr, cuda::dtype::bf16, q, k, v, exact));
    cuda::options by_rows{cuda::dtype::bf16, cuda::dtype::bf16};
    by_rows.tiles = {16, 0};
    by_rows.split_rows = 64;
    CHECK(max_abs_diff(grouped, cuda::emulate(plan, by_rows, Q = q, K = k, V = v)) == 0.0);
    if (!has_split) CHECK(max_abs_diff(grouped, one) == 0.0);  // (no such form: the request is ignored)
    // The backward: the same, where the plan has a chunk-parallel form.
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), cuda::dtype::bf16);
    auto const g = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
    auto const h = cuda::emulate_gradient(plan, by_rows, dout, Q = q, K = k, V = v);
    CHECK(max_abs_diff(g[Q], h[Q]) == 0.0);
    CHECK(max_abs_diff(g[K], h[K]) == 0.0);
    CHECK(max_abs_diff(g[V], h[V]) == 0.0);
  };
  same_rows(causal_expr, true, 81);
  same_rows(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V, true, 82);
  same_rows(normalize(causal(exp(Q * transpose(K) * 0.25))) * V, false, 83);
  {  // a split forward differs from one pass only in the order of sums
    auto const plan = plan_of(causal_expr);
    test::rng r{84};
    auto inputs = random_inputs(s, cuda::dtype::f32, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    cuda::options opt{};
    opt.tiles = {16, 0};
    auto const one = cuda::emulate(plan, opt, Q = q, K = k, V = v);
    opt.tiles.groups = 5;
    auto const grouped = cuda::emulate(plan, opt, Q = q, K = k, V = v);
    CHECK(max_abs_diff(grouped, one) > 0.0);  // (it did split)
    CHECK(relative_rms(grouped, one) <= tolerance(cuda::dtype::f32));
  }

  auto spec = cuda::spec_of(plan_of(causal_expr), {});
  spec.d = spec.m = 16;
  spec.tiles.groups = -1;
  CHECK_THROWS_WITH_AS(cuda::program_of(spec), doctest::Contains("-1 groups of rows were requested"), std::invalid_argument);
  shape4 const sq{1, 2, 10, 4};
  std::vector<float> fake(80, 5.0f), fake_out(80, 5.0f);
  cuda::device_view<float const> const dq(fake.data(), sq);
  cuda::device_view<float> const dout(fake_out.data(), sq);
  CHECK_THROWS_WITH_AS(cuda::evaluate_into(plan_of(causal_expr), dout, nullptr, cuda::tile_request{.groups = -2}, Q = dq, K = dq, V = dq),
                       doctest::Contains("-2 groups"), std::invalid_argument);
  CHECK(std::all_of(fake_out.begin(), fake_out.end(), [](float x) { return x == 5.0f; }));
}

TEST_CASE("device: launches at a requested schedule = their emulation at it") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto plan = compile<order::linear>(causal_expr);
  // (D = 64: each schedule's kernels compile on the device within gpu-check's test stage;
  // the benchmark's sweep checks its D = 128 schedules against the emulation too)
  for (cuda::tile_request t : {cuda::tile_request{32, 64, true}, {16, 32}, {64, 64, false, 512}, {32, 0, false, 128},
                               {16, 0, false, 0, 4}}) {
    CONTEXT(t.chunk, t.tile_m, t.prefetch, t.threads, t.groups);
    shape const s{1, 2, 777, 64, 64};
    test::rng r{1100};
    auto inputs = random_inputs(s, cuda::dtype::bf16, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), cuda::dtype::bf16);
    cuda::options opt{cuda::dtype::bf16, cuda::dtype::bf16};
    opt.tiles = t;
    auto dq = cuda::to_device<cuda::bf16>(q), dk = cuda::to_device<cuda::bf16>(k), dv = cuda::to_device<cuda::bf16>(v),
         dd = cuda::to_device<cuda::bf16>(dout);
    // (the device splits N where its SMs ask for it: the same up to the order of sums)
    auto y = cuda::to_host(cuda::evaluate(plan, nullptr, t, Q = dq, K = dk, V = dv));
    CHECK(relative_rms(y, cuda::emulate(plan, opt, Q = q, K = k, V = v)) <= tolerance(cuda::dtype::bf16) / 4);
    auto got = cuda::gradient(plan, dd, nullptr, t, Q = dq, K = dk, V = dv);
    auto want = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
    CHECK(relative_rms(cuda::to_host(got[Q]), want[Q]) <= tolerance(cuda::dtype::bf16) / 2);
    CHECK(relative_rms(cuda::to_host(got[K]), want[K]) <= tolerance(cuda::dtype::bf16) / 2);
    CHECK(relative_rms(cuda::to_host(got[V]), want[V]) <= tolerance(cuda::dtype::bf16) / 2);
  }
}
