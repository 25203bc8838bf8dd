// The CUDA backend's forms that carry a state, without a GPU: chained blocks
// (a state in, a state out), the recurrent mode (a prompt, then one step per
// token) and the chunk-parallel form (groups of rows, two launches), each
// against one pass and the CPU backend through the host emulation.
#include "cuda_support.hpp"

namespace {
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
      auto inputs = random_inputs(s, dt, r, positive);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      cuda::options opt{dt, dt, true};  // exact products: the tight checks below; the tensor cores' after them
      int const chunk = chained_program(linear, opt, s.d, s.m).tiles.chunk;
      std::size_t mid = s.n < 3 ? s.n / 2 : r.in(1, s.n - 1);
      if (mid > 0 && mid % static_cast<std::size_t>(chunk) == 0) --mid;  // inside a chunk
      auto once = cuda::emulate(linear, opt, Q = q, K = k, V = v);
      for (std::size_t at : {std::size_t{0}, mid, s.n}) {
        CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m, at);
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

// A decayed mask (retention): the state carries the decayed sums, as the CPU's does.
TEST_CASE("chained, decayed: two emulated blocks = one pass = the CPU's chained result, and the same state") {
  check_chained(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, 45,
                chain_shapes(45));
  check_chained(causal(Q * transpose(K), decay{0.97}) * V, 46, chain_shapes(46));
  check_chained(causal(Q * transpose(K), head_decays({0.5, 0.9, 0.99})) * V, 47, {{1, 3, 130, 16, 8}, {2, 3, 1, 5, 3}});
}

// The chained backward of two blocks: the emulated kernels' gradients and ∂ of
// each state = the CPU backend's chained backward (cpu::gradient with states).
TEST_CASE("chained backward: the emulated blocks' gradients and ∂state = the CPU's") {
  auto check = [](auto const& plan) {
    CAPTURE(cuda::spec_of(plan).description);
    std::size_t const b = 2, h = 2, n = 150, d = 16, m = 12, cut = 70;
    auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2),
         v = tensor<float>::random({b, h, n, m}, 3), dout = tensor<float>::random({b, h, n, m}, 4);
    auto first = [&](tensor<float> const& x) { return test::tokens(x, 0, cut); };
    auto second = [&](tensor<float> const& x) { return test::tokens(x, cut, n); };
    cpu::state<float> c1, cnone;
    (void)cpu::evaluate(plan, c1, Q = first(q), K = first(k), V = first(v));
    auto [c2g, cd1] = cpu::gradient(plan, second(dout), c1, cnone, Q = second(q), K = second(k), V = second(v));
    auto [c1g, cd0] = cpu::gradient(plan, first(dout), cnone, cd1, Q = first(q), K = first(k), V = first(v));
    cuda::state e1(plan, b, h, cuda::memory::host), none(cuda::memory::host);
    (void)cuda::emulate(plan, {}, e1, Q = first(q), K = first(k), V = first(v));
    auto [e2g, ed1] = cuda::emulate_gradient(plan, {}, second(dout), e1, none, Q = second(q), K = second(k), V = second(v));
    auto [e1g, ed0] = cuda::emulate_gradient(plan, {}, first(dout), none, ed1, Q = first(q), K = first(k), V = first(v));
    CHECK(relative_rms(sums_of(ed1), sums_of(cd1)) <= 1e-5);
    CHECK(relative_rms(sums_of(ed0), sums_of(cd0)) <= 1e-5);
    for (auto [e, c] : {std::pair{&e1g, &c1g}, std::pair{&e2g, &c2g}}) {
      CHECK(relative_rms((*e)[Q], (*c)[Q]) <= 1e-5);
      CHECK(relative_rms((*e)[K], (*c)[K]) <= 1e-5);
      CHECK(relative_rms((*e)[V], (*c)[V]) <= 1e-5);
    }
  };
  check(compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V));
  check(compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V));  // retention's ∂S
  check(compile(causal(Q * transpose(K), decay{0.8}) * V));
}

// A long sequence in fp32: the kernels' carried sums (the state forward, R
// backward) grow by a chunk's sum at a time (program.hpp, product), so their
// error against fp64 is the CPU backend's (which sums in two levels past 4096
// rows). Row by row, as the kernels summed before, it was 10x the CPU's here
// (forward 3.1e-6 against 2.9e-7; ∂Q 3.5e-6 against 3.4e-7) and 40x at 2^20
// rows. One call, chained blocks that end inside chunks, and the gradients,
// against fp64 on the same (fp32) inputs: within 2x the CPU's fp32 error.
TEST_CASE("long sequences: the emulated kernels' fp32 sums stay as accurate as the CPU backend's") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  std::size_t const n = 65536, d = 16, block = 1000;
  auto q = tensor<float>::random({1, 1, n, d}, 61), k = tensor<float>::random({1, 1, n, d}, 62),
       v = tensor<float>::random({1, 1, n, d}, 63), dout = tensor<float>::random({1, 1, n, d}, 64);
  auto wide = [](tensor<float> const& x) {
    tensor<double> w(x.shape());
    std::copy(x.data(), x.data() + x.size(), w.data());
    return w;
  };
  auto const exact = cpu::evaluate(plan, Q = wide(q), K = wide(k), V = wide(v));
  double const cpu_error = relative_rms(cpu::evaluate(plan, Q = q, K = k, V = v), exact);
  cuda::options const opt{cuda::dtype::f32, cuda::dtype::f32, true};
  double const once = relative_rms(cuda::emulate(plan, opt, Q = q, K = k, V = v), exact);
  tensor<float> chained({1, 1, n, d});
  cuda::state st(cuda::memory::host);
  for (std::size_t r = 0; r < n; r += block) {
    std::size_t const e = std::min(n, r + block);
    cuda::emulate_into(plan, opt, rows_of(chained, r, e), st, Q = test::tokens(q, r, e), K = test::tokens(k, r, e),
                       V = test::tokens(v, r, e));
  }
  double const blocks = relative_rms(chained, exact);
  INFO("fp32 against fp64: the CPU ", cpu_error, ", emulated in one call ", once, ", in blocks of ", block, " ", blocks);
  CHECK(once <= 2 * cpu_error);
  CHECK(blocks <= 2 * cpu_error);

  auto const g64 = cpu::gradient(plan, wide(dout), Q = wide(q), K = wide(k), V = wide(v));
  auto const g32 = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  auto const ge = cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v);
  auto check = [&](std::string const& name, auto const& sym) {
    double const c = relative_rms(g32[sym], g64[sym]), e = relative_rms(ge[sym], g64[sym]);
    INFO(name, " against fp64: the CPU ", c, ", emulated ", e);
    CHECK(e <= 2 * c);
  };
  check("∂Q", Q);
  check("∂K", K);
  check("∂V", V);
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
  test::expect_shape_error([&] { cuda::emulate_into(plan, {}, ob.view(), st, Q = qb, K = qb, V = vb); }, "Q", "B (batch)", 1, 2);
  auto qh = tensor<float>::random({2, 1, 10, 4}, 5), vh = tensor<float>::random({2, 1, 10, 6}, 6);
  auto oh = tensor<float>({2, 1, 10, 6});
  test::expect_shape_error([&] { cuda::emulate_into(plan, {}, oh.view(), st, Q = qh, K = qh, V = vh); }, "Q", "H (heads)", 1, 3);
  auto qd = tensor<float>::random({2, 3, 10, 5}, 7);
  test::expect_shape_error([&] { cuda::emulate_into(plan, {}, out.view(), st, Q = qd, K = qd, V = v); }, "Q", "D", 5, 4);
  auto wrong = tensor<float>({2, 3, 10, 7});
  test::expect_shape_error([&] { cuda::emulate_into(plan, {}, wrong.view(), st, Q = q, K = q, V = v); }, "out", "cols", 7, 6);
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
  std::vector<float> fake(2 * 3 * 10 * 6), fake_out(2 * 3 * 10 * 6);  // never read: every check comes before the launch
  cuda::device_view<float const> dq(fake.data(), sq), dv(fake.data(), sv);
  cuda::device_view<float> dout(fake_out.data(), sv);
  CHECK_THROWS_WITH_AS(cuda::evaluate_into(plan, dout, st, nullptr, Q = dq, K = dq, V = dv),
                       doctest::Contains("the state is in host memory"), std::invalid_argument);
  // A device state of another plan or batch: refused before any launch or allocation.
  cuda::state foreign(other, 2, 3);
  CHECK_THROWS_WITH_AS(cuda::evaluate_into(plan, dout, foreign, nullptr, Q = dq, K = dq, V = dv),
                       doctest::Contains("this state belongs to the plan"), state_error);
  cuda::state small(plan, 1, 3);
  test::expect_shape_error([&] { cuda::evaluate_into(plan, dout, small, nullptr, Q = dq, K = dq, V = dv); }, "Q", "B (batch)", 2, 1);
  unchanged();
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
      auto inputs = random_inputs(s, dt, r, positive);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      std::size_t const prompt = s.n < 2 ? 0 : r.in(0, s.n / 2);
      CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m, prompt);
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
  // Decayed (retention): each step carries the state past its token, g·S + φ(k)vᵀ.
  check_steps(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V, 64, cases);
  check_steps(causal(Q * transpose(K), decay{0.97}) * V, 65, cases);
  check_steps(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), head_decays({0.5, 0.9, 0.99}))) * V, 66,
              {{2, 3, 20, 16, 8}, {1, 3, 5, 64, 64}});
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
    CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
    test::rng r{seed};
    auto inputs = random_inputs(s, dt, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
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
    auto rows = [&](std::size_t from, std::size_t to) { return out.rows(from, to - from); };
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
    CHECK(relative_rms(cuda::to_host(out), want) <= forward_tolerance(dt));
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
      auto inputs = random_inputs(s, dt, r, positive);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      for (bool exact : {true, false}) {
        cuda::options opt{dt, dt, exact};
        auto const once = cuda::emulate(plan, opt, Q = q, K = k, V = v);
        auto spec = cuda::spec_of(plan, opt);
        spec.d = s.d, spec.m = s.m;
        auto const sp = cuda::split_programs_of(spec);
        std::int64_t const t = sp.scan.tiles.chunk;
        for (std::int64_t rows : {t, 2 * t, 3 * t, 1000 * t}) {
          CONTEXT(cuda::name_of(dt), exact, s.b, s.h, s.n, s.d, s.m);
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
  // Decayed: each group from the earlier groups' sums by Horner's rule (g near 1, so that they weigh).
  check_split(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.99})) * V, 76, cases);
  check_split(causal(Q * transpose(K), decay{0.995}) * V, 77, {{2, 1, 300, 16, 8}, {1, 2, 257, 24, 100}});
  check_split(causal(Q * transpose(K), head_decays({0.9, 0.995, 1})) * V, 78, {{1, 3, 300, 16, 8}});
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
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
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
        CONTEXT(cuda::name_of(dt), s.n, s.d, s.m, rows);
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
  // Decayed: the state in weighs g^(rows before the group), the state out is the last group's.
  check(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.99})) * V),
        {2, 1, 300, 16, 8}, 76);
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
      CONTEXT(cuda::name_of(dt), s.n, s.d);
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
      CHECK(relative_rms(y, want) <= forward_tolerance(dt));
      // Chained through a state: the launch splits the same way; rows and the state out as emulated.
      cuda::state st(plan, s.b, s.h), host(plan, s.b, s.h, cuda::memory::host);
      auto want_chained = cuda::emulate(plan, opt, host, Q = q, K = k, V = v);
      auto got_chained = [&]<class E>() {
        auto dq = cuda::to_device<E>(q), dk = cuda::to_device<E>(k), dv = cuda::to_device<E>(v);
        return cuda::to_host(cuda::evaluate(plan, st, nullptr, Q = dq, K = dk, V = dv));
      };
      auto yc = dt == cuda::dtype::f32 ? got_chained.template operator()<float>() : got_chained.template operator()<cuda::bf16>();
      CHECK(relative_rms(yc, want_chained) <= forward_tolerance(dt));
      CHECK(relative_rms(sums_of(cuda::to_host(st)), sums_of(host)) <= 1e-6);
    }
}
