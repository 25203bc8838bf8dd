// The decayed mask causal(S, decay{g}) — RetNet's retention, decayed linear
// attention — on the CUDA backend without a GPU: its tile programs (the
// decay's powers in a register, masks that weigh a chunk's scores by g^(i−j),
// rows and state weighed by the powers that carry them across chunks) in the
// host emulation against the CPU backend and the expression as written, in
// double; the kernels compile with NVRTC. Softmax under a decayed mask (ALiBi's
// bias) runs the quadratic kernel with the bias in its exponents. Gradients, chained blocks and
// decoding steps of decayed plans are in test_cuda_backward.cpp and
// test_cuda_state.cpp beside the plain mask's; the kernels as written in
// test_cuda_simt.cpp.
#include "cuda_support.hpp"

namespace {
constexpr auto retention = causal(Q * transpose(K), decay{0.97}) * V;  // RetNet's form: no φ, no normaliser
constexpr auto decayed_linear = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V;
// Softmax with ALiBi's linear bias, one slope: exp(S_ij)·g^(i−j) = exp(S_ij + (i−j)·ln g).
constexpr auto alibi = normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.9})) * V;

cuda::attention_spec spec_at(cuda::attention_spec s, std::size_t d, std::size_t m) {
  s.d = d, s.m = m;
  return s;
}
}  // namespace

TEST_CASE("decayed forward (retention) = CPU backend = as written") {
  check_forward(decayed_linear, 101);
  check_forward(retention, 102);
  // A fast decay: powers past a chunk underflow fp32 (0 in the kernel's table).
  check_forward(causal(phi<relu>(Q) * transpose(phi<relu>(K)), decay{0.05}) * V, 103,
                {{1, 1, 70, 8, 5}, {2, 1, 130, 16, 9}, {1, 2, 1, 3, 4}});
  check_forward(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)), decay{0.8})) * V, 104, poly2_shapes(), true);
}

TEST_CASE("decayed forward: either order is one kernel, and the kernel says its decay") {
  auto const linear = cuda::spec_of(compile<order::linear>(retention));
  auto const quadratic = cuda::spec_of(compile<order::quadratic>(retention));
  CHECK(linear.decay == 0.97);
  CHECK(quadratic.decay == 0.97);
  CHECK(cuda::spec_of(compile(retention)).decay == 0.97);  // (a select between the two)
  auto const a = cuda::program_of(spec_at(linear, 16, 8)), b = cuda::program_of(spec_at(quadratic, 16, 8));
  CHECK(a.kernel_name == b.kernel_name);
  CHECK(cuda::emit(a) == cuda::emit(b));
  CHECK(a.kernel_name.find("_decay") != std::string::npos);
  CHECK(a.description.find("decay=0.97") != std::string::npos);
  CHECK(cuda::plan_text(linear) == fmt::format("{}", compile<order::linear>(retention)));  // printed as the plan
  std::string const src = cuda::emit(a), text = cuda::listing(a);
  CHECK(src.find("tl::decay_rows<") != std::string::npos);
  CHECK(src.find(fmt::format("{:#.9g}f", 0.97f)) != std::string::npos);  // g^1, as lina rounded it
  CHECK(text.find("powers pw") != std::string::npos);
  CHECK(text.find("mask_causal a, weighed by pw") != std::string::npos);
  // Another decay is another kernel; decay{1} is the plain mask's kernel.
  auto other = cuda::spec_of(compile<order::linear>(causal(Q * transpose(K), decay{0.5}) * V));
  CHECK(cuda::program_of(spec_at(other, 16, 8)).kernel_name != a.kernel_name);
  auto one = cuda::spec_of(compile<order::linear>(causal(Q * transpose(K), decay{1.0}) * V));
  auto plain = cuda::spec_of(compile<order::linear>(causal(Q * transpose(K)) * V));
  CHECK(cuda::emit(cuda::program_of(spec_at(one, 16, 8))) == cuda::emit(cuda::program_of(spec_at(plain, 16, 8))));
  // The powers are g^k rounded once from double, subnormal ones 0.
  auto tiny = linear;
  tiny.decay = 0.2;
  std::vector<float> const g = cuda::decay_powers(tiny, 65);
  CHECK(g[0] == 1.0f);
  CHECK(g[1] == 0.2f);
  for (int x = 0; x <= 54; ++x) {  // (0.2^54 ≈ 1.8e-38: fp32's last normal power)
    CAPTURE(x);
    CHECK(std::abs(g[static_cast<std::size_t>(x)] - std::pow(0.2, x)) <= std::ldexp(std::pow(0.2, x), -24));
  }
  CHECK(g[64] == 0.0f);  // 0.2^64 ≈ 1.8e-45: below fp32's normals
}

TEST_CASE("decayed forward: decay 0 keeps each row's own token, and NaN reaches every later row") {
  constexpr auto own = causal(Q * transpose(K), decay{0.0}) * V;
  constexpr auto plan = compile<order::linear>(own);
  std::size_t const b = 2, h = 1, n = 70, d = 5, m = 3;
  auto q = tensor<float>::random({b, h, n, d}, 1), k = tensor<float>::random({b, h, n, d}, 2),
       v = tensor<float>::random({b, h, n, m}, 3);
  auto got = cuda::emulate(plan, {}, Q = q, K = k, V = v);
  double worst = 0;
  for (std::size_t i = 0; i < b; ++i)
    for (std::size_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::size_t c = 0; c < d; ++c) s += double(q(i, 0, t, c)) * k(i, 0, t, c);
      for (std::size_t c = 0; c < m; ++c) worst = std::max(worst, std::abs(got(i, 0, t, c) - s * v(i, 0, t, c)));
    }
  CHECK(worst <= 1e-5);
  // A NaN in V at row 37 of batch 0: every row from it on reads it, however
  // small its weight there, as on the CPU. The kernel's products skip a masked
  // chunk's zero tiles by 16-row stripes, so the rows of stripes before it
  // (and the other batch) stay finite; within its stripe the masked zeros
  // meet it in the product (0·NaN), as with the plain mask.
  v(0, 0, 37, 1) = NAN;
  auto decayed_plan = compile<order::linear>(causal(Q * transpose(K), decay{0.5}) * V);
  auto with_nan = cuda::emulate(decayed_plan, {}, Q = q, K = k, V = v);
  auto on_cpu = cpu::evaluate(decayed_plan, Q = q, K = k, V = v);
  for (std::size_t t = 0; t < n; ++t) {
    CAPTURE(t);
    if (t >= 37 || t < 32) CHECK(std::isnan(with_nan(0, 0, t, 1)) == (t >= 37));
    CHECK(std::isnan(on_cpu(0, 0, t, 1)) == (t >= 37));
    CHECK(!std::isnan(with_nan(1, 0, t, 1)));
  }
}

TEST_CASE("decayed plans split along N too (Horner's rule over the groups), and bad specs are refused") {
  auto spec = spec_at(cuda::spec_of(compile<order::linear>(decayed_linear)), 8, 4);
  CHECK(cuda::splits(spec));
  auto const sp = cuda::split_programs_of(spec);
  CHECK(cuda::listing(sp.scan).find("add_partials state") != std::string::npos);
  CHECK(cuda::emit(sp.scan).find("tl::add_partials_decayed<") != std::string::npos);
  CHECK(cuda::split_backward_programs_of(spec).size() == 3);
  // What a program compiles ahead of time: every launch's kernel, decayed.
  auto const all = cuda::kernels_of(spec);
  for (std::string part : {"_partials", "_split", "_split_sums", "_split_adjoint_sums", "_split_walks"})
    CHECK(std::any_of(all.begin(), all.end(), [&](auto const& p) { return p.kernel_name.find(part) != std::string::npos; }));
  for (auto const& p : all) {
    CAPTURE(p.kernel_name);
    CHECK(p.kernel_name.find("_decay") != std::string::npos);
  }
  // Groups of rows (options::split_rows, or groups in the schedule) = one pass, forward and backward:
  // the same sums in another order. At g = 0.99 a group's sums reach the next groups with weight.
  constexpr auto plan = compile<order::linear>(
      normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.99})) * V);
  auto q = tensor<float>::random({1, 2, 200, 8}, 4), k = tensor<float>::random({1, 2, 200, 8}, 5),
       v = tensor<float>::random({1, 2, 200, 4}, 6), dout = tensor<float>::random({1, 2, 200, 4}, 7);
  auto once = cuda::emulate(plan, {}, Q = q, K = k, V = v);
  auto g_once = cuda::emulate_gradient(plan, {}, dout, Q = q, K = k, V = v);
  for (int groups : {2, 3, 4}) {
    CAPTURE(groups);
    cuda::options split;
    split.tiles.groups = groups;
    CHECK(relative_rms(cuda::emulate(plan, split, Q = q, K = k, V = v), once) <= tolerance(cuda::dtype::f32));
    auto g_split = cuda::emulate_gradient(plan, split, dout, Q = q, K = k, V = v);
    CHECK(relative_rms(g_split[Q], g_once[Q]) <= tolerance(cuda::dtype::f32));
    CHECK(relative_rms(g_split[K], g_once[K]) <= tolerance(cuda::dtype::f32));
    CHECK(relative_rms(g_split[V], g_once[V]) <= tolerance(cuda::dtype::f32));
  }
  // Specs built by hand: a decay outside [0, 1], or on an attention without a causal linear scan.
  for (double g : {1.5, -0.1, static_cast<double>(NAN)}) {
    CAPTURE(g);
    auto bad = spec;
    bad.decay = g;
    CHECK_THROWS_WITH_AS(cuda::program_of(bad), doctest::Contains("it is in [0, 1]"), std::invalid_argument);
    CHECK_THROWS_AS(cuda::backward_programs_of(bad), std::invalid_argument);
  }
  auto full = spec;
  full.causal = false;
  CHECK_THROWS_WITH_AS(cuda::program_of(full), doctest::Contains("non-causal attention has none"), std::invalid_argument);
  auto soft = cuda::spec_of(compile(alibi));
  soft.d = 8, soft.m = 4, soft.causal = false;
  CHECK_THROWS_WITH_AS(cuda::program_of(soft), doctest::Contains("non-causal attention has none"), std::invalid_argument);
  CHECK_THROWS_AS(cuda::backward_programs_of(soft), std::invalid_argument);
}

// Softmax under a decayed mask — ALiBi's bias with one slope — is the
// quadratic kernel with each valid score's exponent x = s·(q·k) + (i−j)·ln g:
// the running max is over x, so keys the decay has weighed down never set the
// shift (program.hpp, exp_rows).
TEST_CASE("decayed softmax (ALiBi's bias) = CPU backend = as written") {
  check_forward(alibi, 105);
  check_forward(causal(exp(Q * transpose(K) * 0.125), decay{0.97}) * V, 106);  // unnormalised
  check_forward(normalize(causal(exp(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)) * 0.03), decay{0.5})) * V, 107,
                {{1, 2, 9, 6, 5}, {2, 1, 70, 12, 20}});
  check_forward(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.0})) * V, 108,  // g = 0: each row's own key
                {{1, 1, 70, 8, 5}, {2, 1, 130, 16, 9}});
}

TEST_CASE("decayed softmax: the kernel says its decay, and a far key's large score does not set the shift") {
  auto spec = spec_at(cuda::spec_of(compile(alibi)), 16, 8);
  CHECK(spec.softmax);
  CHECK(spec.decay == 0.9);
  CHECK(cuda::plan_text(spec) == fmt::format("{}", compile(alibi)));  // printed as the plan
  auto const p = cuda::program_of(spec);
  CHECK(p.kernel_name.find("_decay") != std::string::npos);
  CHECK(cuda::listing(p).find(fmt::format("decayed: + (row − key)·{}", static_cast<float>(std::log(0.9)))) != std::string::npos);
  CHECK(cuda::emit(p).find(", true>(") != std::string::npos);  // tl::exp_rows<…, Decayed = true>
  CHECK(cuda::emit(p).find(fmt::format("{:#.9g}f", static_cast<float>(std::log(0.9)))) != std::string::npos);
  auto plain = cuda::spec_of(compile(normalize(causal(exp(Q * transpose(K) * 0.25))) * V));
  plain.d = 16, plain.m = 8;
  CHECK(cuda::program_of(plain).kernel_name.find("_decay") == std::string::npos);
  for (auto const& b : cuda::backward_programs_of(spec)) {
    CAPTURE(b.kernel_name);
    CHECK(b.kernel_name.find("_decay") != std::string::npos);
    check_compiles(b);
  }
  auto zero = spec;
  zero.decay = 0;
  CHECK(cuda::log_decay(zero) == -std::numeric_limits<float>::max());  // finite: no 0·∞ on the diagonal
  CHECK(cuda::log_decay(plain) == 0.0f);

  // Key 0 scores 120 against every query (scale 0.25), the others 0; at g = 0.5
  // its weight g^i·e^120 falls below theirs after row 173. A shift taken from
  // the scores alone (120) would leave exp(0 − 120) = 0 in fp32 for the near
  // keys of the later rows and divide 0 by eps; the decayed exponents keep them.
  constexpr auto plan = compile(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.5})) * V);
  std::size_t const n = 300;
  tensor<float> q({1, 1, n, 1}), k({1, 1, n, 1});
  for (std::size_t i = 0; i < n; ++i) q(0, 0, i, 0) = 1, k(0, 0, i, 0) = i == 0 ? 480.0f : 0.0f;
  auto v = tensor<float>::random({1, 1, n, 3}, 9);
  auto got = cuda::emulate(plan, {}, Q = q, K = k, V = v);
  auto want = cpu::evaluate(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.5})) * V, Q = widened(q),
                            K = widened(k), V = widened(v));
  CHECK(relative_rms(got, want) <= tolerance(cuda::dtype::f32));
  CHECK(std::abs(got(0, 0, n - 1, 0) - want(0, 0, n - 1, 0)) <= 1e-5);  // a late row: its near keys
}

// ---- a decay per head (causal(S, head_decays{…})): RetNet's heads, ALiBi's slopes
namespace {
auto retention_per_head() { return causal(Q * transpose(K), head_decays({0.5, 0.9, 0.99})) * V; }
auto linear_per_head() {
  return normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), head_decays({0.8, 1, 0.95}))) * V;
}
auto alibi_per_head() { return normalize(causal(exp(Q * transpose(K) * 0.25), head_decays::alibi(3))) * V; }
std::vector<shape> per_head_shapes() {
  return {{1, 3, 0, 5, 3}, {1, 3, 1, 7, 4}, {2, 3, 63, 16, 9}, {1, 3, 130, 24, 40}, {1, 3, 70, 64, 64}};
}
// Head x of t, dense [B, 1, N, C].
tensor<float> head_of(tensor<float> const& t, std::size_t x) {
  auto const s = t.shape();
  tensor<float> r({s[0], 1, s[2], s[3]});
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t i = 0; i < s[2]; ++i)
      for (std::size_t c = 0; c < s[3]; ++c) r(b, 0, i, c) = t(b, x, i, c);
  return r;
}
}  // namespace

TEST_CASE("decay per head: forwards = CPU backend = as written, every dtype, and the kernels compile") {
  check_forward(retention_per_head(), 111, per_head_shapes());
  check_forward(linear_per_head(), 112, per_head_shapes());
  check_forward(alibi_per_head(), 113, per_head_shapes());
}

TEST_CASE("decay per head: each head's rows are those of the kernel with that head's decay{g}, bit for bit") {
  // one table row per head: head x runs what decay{g_x}'s kernel runs, in one pass,
  // split along N and quadratic (ALiBi)
  std::vector<double> const g{0.5, 0.9, 0.99};
  auto const plan = compile<order::linear>(retention_per_head());
  auto const alibi_plan = compile(alibi_per_head());
  auto const slopes = head_decays::alibi(3).gammas;
  test::rng r{114};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (std::int64_t split : {0, 64}) {
      CONTEXT(cuda::name_of(dt), split);
      auto [q, k, v] = random_inputs({2, 3, 150, 16, 8}, dt, r, false);
      cuda::options opt{dt, dt};
      opt.split_rows = split;
      auto const all = cuda::emulate(plan, opt, Q = q, K = k, V = v);
      auto const all_alibi = cuda::emulate(alibi_plan, opt, Q = q, K = k, V = v);
      for (std::size_t x = 0; x < 3; ++x) {
        CAPTURE(x);
        auto const one = compile<order::linear>(causal(Q * transpose(K), decay{g[x]}) * V);
        CHECK(max_abs_diff(head_of(all, x), cuda::emulate(one, opt, Q = head_of(q, x), K = head_of(k, x), V = head_of(v, x))) == 0);
        auto const one_alibi = compile(normalize(causal(exp(Q * transpose(K) * 0.25), decay{slopes[x]})) * V);
        CHECK(max_abs_diff(head_of(all_alibi, x),
                           cuda::emulate(one_alibi, opt, Q = head_of(q, x), K = head_of(k, x), V = head_of(v, x))) == 0);
      }
    }
}

TEST_CASE("decay per head: the kernels carry a table per head, and one value throughout is decay{g}'s kernel") {
  auto const spec = spec_at(cuda::spec_of(compile<order::linear>(retention_per_head())), 16, 8);
  CHECK(spec.head_decays == std::vector<double>{0.5, 0.9, 0.99});
  CHECK(cuda::decayed(spec));
  CHECK(cuda::plan_text(spec) == fmt::format("{}", compile<order::linear>(retention_per_head())));
  auto const p = cuda::program_of(spec);
  CHECK(p.kernel_name.find("_decay3h") != std::string::npos);
  std::string const src = cuda::emit(p);
  CHECK(src.find("__device__ const float decay_powers[3][65] = {") != std::string::npos);
  CHECK(src.find("decay_powers[h]") != std::string::npos);
  CHECK(cuda::listing(p).find("g = the head's") != std::string::npos);
  auto other = spec;
  other.head_decays[2] = 0.98;
  CHECK(cuda::program_of(other).kernel_name != p.kernel_name);
  // ALiBi: a table of ln g per head that exp_rows reads
  auto const sm = cuda::program_of(spec_at(cuda::spec_of(compile(alibi_per_head())), 16, 8));
  CHECK(cuda::emit(sm).find("__constant__ float log_decays[] = {") != std::string::npos);
  CHECK(cuda::emit(sm).find("log_decays[h]") != std::string::npos);
  // the same decay for every head is the scalar decay's kernel
  auto const same = cuda::spec_of(compile<order::linear>(causal(Q * transpose(K), head_decays({0.97, 0.97})) * V));
  CHECK(same.head_decays.empty());
  CHECK(same.decay == 0.97);
  CHECK(cuda::emit(cuda::program_of(spec_at(same, 16, 8))) ==
        cuda::emit(cuda::program_of(spec_at(cuda::spec_of(compile<order::linear>(retention)), 16, 8))));
  // every kernel a launch of either may run compiles, forward, split, backward, steps
  for (auto const& k : cuda::kernels_of(spec)) {
    CAPTURE(k.kernel_name);
    CHECK(k.kernel_name.find("_decay3h") != std::string::npos);
    check_compiles(k);
  }
  // RetNet at 96 heads, D = M = 128, as a launch compiles it: the tables stay out of
  // local memory (ptxas's report: no stack beyond the kernels' usual few scalars; in
  // the kernel's body, the powers of 96 heads were 24960 bytes of stack a thread)
  auto wide = spec_at(spec, 128, 128);
  wide.in = wide.out = cuda::dtype::bf16;
  wide.head_decays = head_decays::retnet(96).gammas;
  wide.head_decays.back() = 0.5;  // (RetNet's last ones round to 1: keep the list per head)
  check_compiles(cuda::program_of(wide), true);
  auto wide_alibi = spec_at(cuda::spec_of(compile(alibi_per_head())), 128, 128);
  wide_alibi.in = wide_alibi.out = cuda::dtype::bf16;
  wide_alibi.head_decays = head_decays::alibi(96).gammas;
  check_compiles(cuda::program_of(wide_alibi), true);
  auto one = wide;  // and one decay's table (read by k: once a copy per thread too)
  one.head_decays.clear();
  one.decay = 0.97;
  check_compiles(cuda::program_of(one), true);
  auto bad = spec;
  bad.head_decays[1] = 1.5;
  CHECK_THROWS_WITH_AS(cuda::program_of(bad), doctest::Contains("a decay of 1.5 was given for head 1"), std::invalid_argument);
}

TEST_CASE("decay per head: a launch of another number of heads is a shape_error before anything is written") {
  auto const plan = compile<order::linear>(retention_per_head());
  auto q = tensor<float>::random({1, 2, 20, 4}, 1), k = tensor<float>::random({1, 2, 20, 4}, 2);
  auto v = tensor<float>::random({1, 2, 20, 3}, 3);
  tensor<float> out({1, 2, 20, 3});
  std::fill_n(out.data(), out.size(), 7.0f);
  auto into = [&] { cuda::emulate_into(plan, {}, out.view(), Q = q, K = k, V = v); };
  test::expect_shape_error(into, "decay per head", "H (heads)", 3, 2);
  CHECK(std::string(test::shape_error_of(into).what()).find("kernel lina_") != std::string::npos);
  CHECK(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 7.0f; }));
  cuda::options split;
  split.split_rows = 16;  // the first of two launches refuses
  CHECK_THROWS_AS(cuda::emulate_into(plan, split, out.view(), Q = q, K = k, V = v), shape_error);
  CHECK(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 7.0f; }));
  CHECK_THROWS_AS(cuda::emulate_gradient(plan, {}, out, Q = q, K = k, V = v), shape_error);
}

// On a device: decayed forwards, gradients and decoding steps against their
// emulation — with B·H = 2 and N = 1000 the launches split N (Horner's rule
// over the groups). (The per-instruction test in test_cuda.cpp cuts the
// decayed program too.)
TEST_CASE("device: decayed kernels = their emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto plan = compile<order::linear>(decayed_linear);
  constexpr auto ret = compile<order::linear>(retention);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16})
    for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{1, 2, 1000, 128, 128}}) {
      launch_vs_emulation(plan, dt, s, 1500);
      launch_vs_emulation(ret, dt, s, 1510);
      launch_vs_emulation(compile(alibi), dt, s, 1520);
    }
  auto gradient = [&]<class E>(auto const& p, shape s, std::uint64_t seed) {
    cuda::dtype const dt = cuda::dtype_of<E>;
    CONTEXT(cuda::name_of(dt), s.n, s.d, s.m);
    test::rng r{seed};
    auto inputs = random_inputs(s, dt, r, false);
    auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
    auto want = cuda::emulate_gradient(p, {dt, dt}, dout, Q = inputs.q, K = inputs.k, V = inputs.v);
    auto got = cuda::gradient(p, cuda::to_device<E>(dout), nullptr, Q = cuda::to_device<E>(inputs.q),
                              K = cuda::to_device<E>(inputs.k), V = cuda::to_device<E>(inputs.v));
    CHECK(relative_rms(cuda::to_host(got[Q]), want[Q]) <= gradient_tolerance(dt));
    CHECK(relative_rms(cuda::to_host(got[K]), want[K]) <= gradient_tolerance(dt));
    CHECK(relative_rms(cuda::to_host(got[V]), want[V]) <= gradient_tolerance(dt));
  };
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 1000, 64, 64}, shape{1, 1, 70, 128, 128}, shape{1, 1, 40, 256, 256}}) {
    gradient.template operator()<float>(plan, s, 1520);
    gradient.template operator()<cuda::bf16>(plan, s, 1530);
    gradient.template operator()<cuda::bf16>(ret, s, 1540);
  }
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 200, 64, 64}}) {  // softmax's two launches, decayed
    gradient.template operator()<float>(compile(alibi), s, 1545);
    gradient.template operator()<cuda::bf16>(compile(alibi), s, 1546);
  }
  // a decay per head: the tables' rows by the block's head
  auto const ret_h = compile<order::linear>(retention_per_head());
  auto const alibi_h = compile(alibi_per_head());
  // (bf16 alone, few kernels: what the device adds to the decay{g} cases is the table's row per head)
  launch_vs_emulation(ret_h, cuda::dtype::bf16, shape{1, 3, 1000, 128, 128}, 1560);  // split along N too
  launch_vs_emulation(alibi_h, cuda::dtype::bf16, shape{2, 3, 200, 64, 64}, 1561);
  gradient.template operator()<cuda::bf16>(ret_h, shape{1, 3, 1000, 64, 64}, 1562);
  gradient.template operator()<cuda::bf16>(alibi_h, shape{2, 3, 200, 64, 64}, 1563);
  // A prompt, then steps, on a device state, against the same in the emulation: outputs and state.
  std::size_t const b = 4, h = 3, n = 40, d = 64, m = 64, prompt = 17;
  auto q = tensor<float>::random({b, h, n, d}, 1550), k = tensor<float>::random({b, h, n, d}, 1551),
       v = tensor<float>::random({b, h, n, m}, 1552);
  auto gpu = cuda::recurrent(plan, b, h, {});
  auto host = cuda::recurrent(plan, b, h, {}, cuda::memory::host);
  cuda::tensor<float> out({b, h, n, m});
  tensor<float> want({b, h, n, m});
  for (std::size_t t = 0; t < n; t = t == 0 ? prompt : t + 1) {
    std::size_t const to = t == 0 ? prompt : t + 1;
    auto dq = cuda::to_device(test::tokens(q, t, to)), dk = cuda::to_device(test::tokens(k, t, to)),
         dv = cuda::to_device(test::tokens(v, t, to));
    if (t == 0) {
      gpu.prefill_into(out.rows(t, to - t), nullptr, Q = dq, K = dk, V = dv);
      host.prefill_into(rows_of(want, t, to), Q = test::tokens(q, t, to), K = test::tokens(k, t, to), V = test::tokens(v, t, to));
    } else {
      gpu.step_into(out.rows(t, 1), nullptr, Q = dq, K = dk, V = dv);
      host.step_into(rows_of(want, t, to), Q = test::tokens(q, t, to), K = test::tokens(k, t, to), V = test::tokens(v, t, to));
    }
  }
  CHECK(relative_rms(cuda::to_host(out), want) <= forward_tolerance(cuda::dtype::f32));
  CHECK(relative_rms(sums_of(cuda::to_host(gpu.state())), sums_of(host.state())) <= 1e-6);
}
