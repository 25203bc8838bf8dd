// The generated kernels run as written on the host (tests/simt): the emulated
// paths with the interpreter swapped for each kernel's own source — tiles.cuh's
// loads, fragments, products and stores, the emitter's barriers — against the
// interpreter, at the device tests' shapes and tolerances. What the `device:`
// tests check on a GPU, checked on every commit, less the device's own
// arithmetic (its expf, its tensor cores' order of summation).
#include "cuda_support.hpp"
#include "simt/runner.hpp"

// Where ctest starts these tests with AddressSanitizer preloaded (tests/CMakeLists.txt):
// no leak check at exit (the loaded kernels and the test's statics are not leaks
// worth a failure here; the sanitized build of the CPU tests checks leaks).
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }

namespace {

// f() through the interpreter and as written: {as written, interpreter}.
template <class F>
auto both_ways(F&& f) {
  auto want = f();
  ::test::simt::scope as_written;
  return std::pair{f(), std::move(want)};
}

// The forward, or the backward (every gradient), of `plan` both ways, on random
// Q, K, V of shape s as dtype dt reads them and the other bindings given (a W).
template <class Plan, class... Bound>
void forward_both_ways(Plan const& plan, cuda::dtype dt, shape s, std::uint64_t seed, cuda::options opt, Bound const&... bound) {
  CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
  test::rng r{seed};
  auto inputs = random_inputs(s, dt, r, false);
  auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
  auto [got, want] = both_ways([&] { return cuda::emulate(plan, opt, Q = q, K = k, V = v, bound...); });
  CHECK(relative_rms(got, want) <= forward_tolerance(dt));
}
template <class Plan>
void forward_both_ways(Plan const& plan, cuda::dtype dt, shape s, std::uint64_t seed) {
  forward_both_ways(plan, dt, s, seed, {dt, dt});
}

template <class Plan, class... Bound>
void gradient_both_ways(Plan const& plan, cuda::dtype dt, shape s, std::uint64_t seed, cuda::options opt, Bound const&... bound) {
  CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m, opt.split_rows);
  test::rng r{seed};
  auto inputs = random_inputs(s, dt, r, false);
  auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
  auto dout = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
  auto [got, want] = both_ways([&] { return cuda::emulate_gradient(plan, opt, dout, Q = q, K = k, V = v, bound...); });
  REQUIRE(got.all().size() == want.all().size());
  for (std::size_t i = 0; i < got.all().size(); ++i) {
    CAPTURE(i);  // (Q, K, V, then W's)
    CHECK(relative_rms(got.all()[i], want.all()[i]) <= gradient_tolerance(dt));
  }
}
template <class Plan>
void gradient_both_ways(Plan const& plan, cuda::dtype dt, shape s, std::uint64_t seed) {
  gradient_both_ways(plan, dt, s, seed, {dt, dt});
}

}  // namespace

TEST_CASE("simt: forward kernels as written = the interpreter") {
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  // The device test's cases, less some of the fp32 and f16 kernels (the same
  // shape logic as bf16's; their loads, conversions and tf32 products at two shapes each).
  for_each_launch_case([](auto const& plan, cuda::dtype dt, shape s, std::uint64_t seed) {
    bool const small_or_odd_m = s.n == 1 || s.m == 200;
    if (dt == cuda::dtype::bf16 || (dt == cuda::dtype::f32) == small_or_odd_m) forward_both_ways(plan, dt, s, seed);
  });
  // The benchmark's head size (two 64-column M tiles), in bf16 and fp32; f16 inputs
  // with an fp32 output (tensor cores at tf32).
  forward_both_ways(causal_plan, cuda::dtype::bf16, shape{1, 2, 150, 128, 128}, 400);
  forward_both_ways(causal_plan, cuda::dtype::f32, shape{1, 2, 150, 128, 128}, 410, {});
  cuda::options tf32{cuda::dtype::f16, cuda::dtype::f32};
  forward_both_ways(causal_plan, cuda::dtype::f16, shape{1, 2, 150, 48, 40}, 420, tf32);
}

TEST_CASE("simt: layouts, poly2 past a block's state, stacked layers and cross-attention as written = the interpreter") {
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    // Odd M (16-bit rows aligned every eighth row) and [B,N,H,M] outputs: stores in part element by element.
    forward_both_ways(causal_plan, dt, shape{1, 2, 77, 24, 13}, 800);
    std::size_t const b = 2, h = 3, n = 90, d = 16, m = 24;
    auto q = rounded(tensor<float>::random({b, h, n, d}, 801), dt), k = rounded(tensor<float>::random({b, h, n, d}, 802), dt),
         v = rounded(tensor<float>::random({b, h, n, m}, 803), dt);
    auto [got, want] = both_ways([&] {
      tensor<float> bnhm({b, n, h, m});
      tensor_view<float> out(bnhm.data(), {b, h, n, m}, {static_cast<std::ptrdiff_t>(n * h * m), static_cast<std::ptrdiff_t>(m),
                                                         static_cast<std::ptrdiff_t>(h * m), 1});
      cuda::emulate_into(causal_plan, {dt, dt}, out, Q = q, K = k, V = v);
      return bnhm;
    });
    CHECK(relative_rms(got, want) <= forward_tolerance(dt));
    // poly2 past a block's state (C = 2080): quadratic, through its kernel (q·k)².
    forward_both_ways(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V), dt,
                      shape{1, 2, 130, 64, 16}, 700);
  }
  // Grouped-query attention: K and V with a zero head stride.
  {
    std::size_t const b = 2, hkv = 2, g = 3, n = 70, d = 16, m = 12;
    auto q = tensor<float>::random({b, hkv * g, n, d}, 901), k = tensor<float>::random({b, hkv, n, d}, 902),
         v = tensor<float>::random({b, hkv, n, m}, 903);
    auto const gq = test::grouped_heads(q, g, false), gk = test::grouped_heads(k, g, true), gv = test::grouped_heads(v, g, true);
    auto [got, want] = both_ways([&] { return cuda::emulate(causal_plan, Q = gq, K = gk, V = gv); });
    CHECK(relative_rms(got, want) <= 1e-6);
  }
  // Stacked layers, and the gradient of one with K in both layers (add_program).
  {
    constexpr auto stack = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2);
    auto t = [](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({2, 2, 150, cols}, seed); };
    auto q = t(16, 1), k = t(16, 2), v = t(16, 3), k2 = t(16, 4), v2 = t(24, 5), dout = t(24, 6);
    auto [got, want] = both_ways([&] { return cuda::emulate(stack, Q = q, K = k, Vd = v, K2 = k2, V2 = v2); });
    CHECK(relative_rms(got, want) <= 1e-6);
    constexpr auto shared = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K)))) * V2);
    auto [g, g_want] = both_ways([&] { return cuda::emulate_gradient(shared, {}, dout, Q = q, K = k, Vd = v, V2 = v2); });
    CHECK(relative_rms(g[K], g_want[K]) <= 1e-5);
    CHECK(relative_rms(g[Q], g_want[Q]) <= 1e-5);
    cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};  // (the add kernel on 16-bit sums)
    auto [gb, gb_want] = both_ways([&] { return cuda::emulate_gradient(shared, bf16, dout, Q = q, K = k, Vd = v, V2 = v2); });
    CHECK(relative_rms(gb[K], gb_want[K]) <= gradient_tolerance(cuda::dtype::bf16));
    CHECK(relative_rms(gb[Q], gb_want[Q]) <= gradient_tolerance(cuda::dtype::bf16));
  }
  // Cross-attention: K and V over 130 rows, Q over 70 (n_keys).
  {
    constexpr auto cross = compile<order::linear>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Kx))) * Vx);
    auto q = tensor<float>::random({1, 2, 70, 16}, 7), k = tensor<float>::random({1, 2, 130, 16}, 8),
         v = tensor<float>::random({1, 2, 130, 24}, 9), dout = tensor<float>::random({1, 2, 70, 24}, 10);
    auto [got, want] = both_ways([&] { return cuda::emulate(cross, Q = q, Kx = k, Vx = v); });
    CHECK(relative_rms(got, want) <= 1e-6);
    auto [g, g_want] = both_ways([&] { return cuda::emulate_gradient(cross, {}, dout, Q = q, Kx = k, Vx = v); });
    CHECK(relative_rms(g[Kx], g_want[Kx]) <= 1e-5);
    CHECK(relative_rms(g[Q], g_want[Q]) <= 1e-5);
  }
}

// Packed sequences in one launch: the kernel finds each sequence's rows from
// row_offsets (Q, K, V and the output from its first row, W whole, the state's
// row b), as written = the interpreter; and the interpreter's one launch =
// each sequence evaluated alone, bit for bit (favor: a W every sequence reads).
TEST_CASE("simt: packed sequences in one launch as written = the interpreter") {
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  constexpr auto favor_plan = compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V);
  auto const seqs = sequences::from_lengths({70, 0, 1, 129, 5});
  std::size_t const h = 2, d = 16, m = 12, f = 24;
  auto x = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({1, h, seqs.total(), cols}, seed); };
  auto q = x(d, 1), k = x(d, 2), v = x(m, 3);
  auto const projection = gaussian_projection<float>(d, f, 4);
  auto const w = broadcast(projection, 1, h);
  auto rows = [&](tensor<float> const& t, std::size_t s) {  // sequence s alone, [1, H, N_s, ·]
    tensor<float> r({1, h, seqs.length(s), t.shape()[3]});
    for_each_index(r.shape(), [&](std::size_t, std::size_t hh, std::size_t n, std::size_t c) { r(0, hh, n, c) = t(0, hh, seqs.begin(s) + n, c); });
    return r;
  };
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    cuda::options const opt{dt, dt};
    auto [got, want] = both_ways([&] { return cuda::emulate(causal_plan, opt, seqs, Q = q, K = k, V = v); });
    CHECK(relative_rms(got, want) <= forward_tolerance(dt));
    auto [fg, fw] = both_ways([&] { return cuda::emulate(favor_plan, opt, seqs, Q = q, K = k, V = v, W = w); });
    CHECK(relative_rms(fg, fw) <= forward_tolerance(dt));
    for (std::size_t s = 0; s < seqs.count(); ++s) {
      CAPTURE(s);
      CHECK(max_abs_diff(rows(fw, s), cuda::emulate(favor_plan, opt, Q = rows(q, s), K = rows(k, s), V = rows(v, s), W = w)) == 0);
    }
    // chained: each sequence's state row (the interpreter's run first, into `interpreted`)
    cuda::state interpreted(cuda::memory::host), as_written(cuda::memory::host);
    int runs = 0;
    auto [cg, cw] = both_ways([&] {
      return cuda::emulate(causal_plan, opt, runs++ == 0 ? interpreted : as_written, seqs, Q = q, K = k, V = v);
    });
    CHECK(relative_rms(cg, cw) <= forward_tolerance(dt));
    CHECK(relative_rms(sums_of(as_written), sums_of(interpreted)) <= 1e-6);
    // the backward in one launch: ∂K, ∂V and the scratch rows from each sequence's first row
    auto const dout = x(m, 5);
    auto [gg, gw] = both_ways([&] { return cuda::emulate_gradient(causal_plan, opt, dout, seqs, Q = q, K = k, V = v); });
    for (auto const& [a, b] : {std::pair{gg[Q], gw[Q]}, {gg[K], gw[K]}, {gg[V], gw[V]}})
      CHECK(relative_rms(a, b) <= gradient_tolerance(dt));
    // chained (a state row per sequence in, the gradient of each row out)
    auto [cgg, cgw] = both_ways([&] {
      return cuda::emulate_gradient(causal_plan, opt, dout, interpreted, as_written, seqs, Q = q, K = k, V = v);
    });
    for (auto const& [a, b] : {std::pair{cgg.first[Q], cgw.first[Q]}, {cgg.first[K], cgw.first[K]}, {cgg.first[V], cgw.first[V]}})
      CHECK(relative_rms(a, b) <= gradient_tolerance(dt));
    CHECK(relative_rms(sums_of(cgg.second), sums_of(cgw.second)) <= 1e-5);
    // favor's: ∂W per (sequence, head), then summed
    auto [fgg, fgw] = both_ways([&] { return cuda::emulate_gradient(favor_plan, opt, dout, seqs, Q = q, K = k, V = v, W = w); });
    for (auto const& [a, b] : {std::pair{fgg[Q], fgw[Q]}, {fgg[K], fgw[K]}, {fgg[V], fgw[V]}, {fgg[W], fgw[W]}})
      CHECK(relative_rms(a, b) <= gradient_tolerance(dt));
  }
}

TEST_CASE("simt: gradient kernels as written = the interpreter") {
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  constexpr auto full_plan = compile<order::linear>(full_expr);
  constexpr auto softmax_plan = compile(softmax_expr);
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 150, 64, 64}, shape{1, 1, 70, 128, 128}}) {
    gradient_both_ways(causal_plan, cuda::dtype::f32, s, 900);
    gradient_both_ways(causal_plan, cuda::dtype::bf16, s, 910);
    gradient_both_ways(full_plan, cuda::dtype::bf16, s, 920);
    gradient_both_ways(softmax_plan, cuda::dtype::f32, s, 940);
    gradient_both_ways(softmax_plan, cuda::dtype::bf16, s, 950);
  }
  gradient_both_ways(causal_plan, cuda::dtype::bf16, shape{1, 1, 40, 256, 256}, 960);  // M's columns in slices
  // N in groups of rows (the split backward: three kernels).
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    cuda::options opt{dt, dt};
    opt.split_rows = 128;
    gradient_both_ways(causal_plan, dt, shape{1, 2, 300, 64, 64}, 970, opt);
  }
  gradient_both_ways(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V),
                     cuda::dtype::f32, shape{1, 2, 70, 64, 16}, 990);
  // favor: ∂W per (batch, head); inside softmax.
  auto favor_case = [&](auto const& plan) {
    std::size_t const b = 2, h = 2, n = 100, d = 32, m = 16, f = 24;
    auto q = tensor<float>::random({b, h, n, d}, 930), k = tensor<float>::random({b, h, n, d}, 931),
         v = tensor<float>::random({b, h, n, m}, 932), dout = tensor<float>::random({b, h, n, m}, 933);
    auto const w = gaussian_projection<float>(d, f, 934);
    auto [got, want] = both_ways([&] { return cuda::emulate_gradient(plan, {}, dout, Q = q, K = k, V = v, W = broadcast(w, b, h)); });
    for (auto const& [x, y] : {std::pair{got[Q], want[Q]}, {got[K], want[K]}, {got[V], want[V]}, {got[W], want[W]}})
      CHECK(relative_rms(x, y) <= 1e-5);
  };
  favor_case(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V));
  favor_case(compile(normalize(causal(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * 0.5))) * V));
}

TEST_CASE("simt: steps, chained and split forwards, requested schedules as written = the interpreter") {
  constexpr auto plan = compile<order::linear>(causal_expr);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    for (shape s : {shape{2, 3, 9, 16, 8}, shape{1, 2, 40, 64, 64}, shape{2, 1, 20, 48, 130}, shape{1, 2, 6, 128, 128}}) {
      CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
      test::rng r{700};
      auto inputs = random_inputs(s, dt, r, false);
      auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
      // A prompt, then a step per token: the outputs and the state.
      auto decode = [&] {
        auto rnn = cuda::recurrent(plan, s.b, s.h, {dt, dt}, cuda::memory::host);
        tensor<float> out({s.b, s.h, s.n, s.m});
        std::size_t const prompt = s.n / 2;
        rnn.prefill_into(rows_of(out, 0, prompt), Q = test::tokens(q, 0, prompt), K = test::tokens(k, 0, prompt),
                         V = test::tokens(v, 0, prompt));
        for (std::size_t t = prompt; t < s.n; ++t)
          rnn.step_into(rows_of(out, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                        V = test::tokens(v, t, t + 1));
        tensor<float> st(rnn.state().shape());
        std::copy(rnn.state().data(), rnn.state().data() + rnn.state().size(), st.data());
        return std::pair{out, st};
      };
      auto [got, want] = both_ways(decode);
      CHECK(relative_rms(got.first, want.first) <= forward_tolerance(dt));
      CHECK(relative_rms(got.second, want.second) <= 1e-6);
      // Two chained blocks of rows, and N in groups of rows (partials, then the scan).
      auto chained = [&] {
        cuda::state st(plan, s.b, s.h, cuda::memory::host);
        std::size_t const cut = s.n / 3;
        tensor<float> out({s.b, s.h, s.n, s.m});
        cuda::emulate_into(plan, {dt, dt}, rows_of(out, 0, cut), st, Q = test::tokens(q, 0, cut), K = test::tokens(k, 0, cut),
                           V = test::tokens(v, 0, cut));
        cuda::emulate_into(plan, {dt, dt}, rows_of(out, cut, s.n), st, Q = test::tokens(q, cut, s.n),
                           K = test::tokens(k, cut, s.n), V = test::tokens(v, cut, s.n));
        return std::pair{out, sums_of(st)};
      };
      auto [c, c_want] = both_ways(chained);
      CHECK(relative_rms(c.first, c_want.first) <= forward_tolerance(dt));
      CHECK(relative_rms(c.second, c_want.second) <= 1e-6);
      if (dt == cuda::dtype::bf16) {  // (fp32's split kernels differ in types only; the gradients split fp32 too)
        cuda::options split{dt, dt};
        split.split_rows = chained_program(plan, split, s.d, s.m).tiles.chunk;
        forward_both_ways(plan, dt, s, 710, split);
      }
    }
  // The schedules the benchmark's sweep and the device test request.
  for (cuda::tile_request t : {cuda::tile_request{32, 64, true}, {16, 32}, {64, 64, false, 512}, {32, 0, false, 128},
                               {16, 0, false, 0, 4}}) {
    CONTEXT(t.chunk, t.tile_m, t.prefetch, t.threads, t.groups);
    cuda::options opt{cuda::dtype::bf16, cuda::dtype::bf16};
    opt.tiles = t;
    forward_both_ways(plan, cuda::dtype::bf16, shape{1, 2, 177, 64, 64}, 1100, opt);
    gradient_both_ways(plan, cuda::dtype::bf16, shape{1, 2, 177, 64, 64}, 1110, opt);
  }
  // The benchmark's sweep at D = 128 (bench/cuda_forward.cpp, --tiles): an M tile of all 128 columns.
  for (cuda::tile_request t : {cuda::tile_request{64, 128}, {32, 128, true}, {16, 128}, {64, 128, false, 512}}) {
    CONTEXT(t.chunk, t.tile_m, t.prefetch, t.threads);
    cuda::options opt{cuda::dtype::bf16, cuda::dtype::bf16};
    opt.tiles = t;
    forward_both_ways(plan, cuda::dtype::bf16, shape{1, 1, 100, 128, 128}, 1200, opt);
  }
}

// A decayed mask (retention): the powers' table, the decayed masks and the rows
// weighed by decay_rows, as written in tiles.cuh, in every kind of launch.
TEST_CASE("simt: decayed kernels (retention) as written = the interpreter") {
  constexpr auto plan = compile<order::linear>(
      normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V);
  constexpr auto retention = compile<order::linear>(causal(Q * transpose(K), decay{0.97}) * V);
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 150, 64, 64}, shape{1, 1, 70, 128, 128}}) {
    forward_both_ways(plan, cuda::dtype::f32, s, 1300);
    forward_both_ways(plan, cuda::dtype::bf16, s, 1310);
    forward_both_ways(retention, cuda::dtype::bf16, s, 1320);
    gradient_both_ways(plan, cuda::dtype::f32, s, 1330);
    gradient_both_ways(plan, cuda::dtype::bf16, s, 1340);
    gradient_both_ways(retention, cuda::dtype::bf16, s, 1350);
  }
  constexpr auto alibi = compile(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.9})) * V);  // decayed softmax
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 2, 150, 64, 64}}) {
    forward_both_ways(alibi, cuda::dtype::f32, s, 1355);
    forward_both_ways(alibi, cuda::dtype::bf16, s, 1356);
    gradient_both_ways(alibi, cuda::dtype::f32, s, 1357);
    gradient_both_ways(alibi, cuda::dtype::bf16, s, 1358);
  }
  // a decay per head: the tables' rows by the block's head
  auto const ret_h = compile<order::linear>(causal(Q * transpose(K), head_decays({0.5, 0.9, 0.99})) * V);
  auto const alibi_h = compile(normalize(causal(exp(Q * transpose(K) * 0.25), head_decays::alibi(3))) * V);
  for (shape s : {shape{2, 3, 40, 16, 8}, shape{1, 3, 150, 64, 64}}) {
    forward_both_ways(ret_h, cuda::dtype::bf16, s, 1351);
    gradient_both_ways(ret_h, cuda::dtype::bf16, s, 1352);
    forward_both_ways(alibi_h, cuda::dtype::bf16, s, 1353);
    gradient_both_ways(alibi_h, cuda::dtype::f32, s, 1354);
  }
  cuda::options tf32{cuda::dtype::f16, cuda::dtype::f32};
  forward_both_ways(plan, cuda::dtype::f16, shape{1, 2, 150, 48, 40}, 1360, tf32);
  gradient_both_ways(plan, cuda::dtype::bf16, shape{1, 1, 40, 256, 256}, 1370);  // M's columns in slices
  for (cuda::tile_request t : {cuda::tile_request{16, 32}, {32, 64, true}}) {  // other chunks: other tables
    CAPTURE(t.chunk);
    cuda::options opt{cuda::dtype::bf16, cuda::dtype::bf16};
    opt.tiles = t;
    forward_both_ways(plan, cuda::dtype::bf16, shape{1, 2, 177, 64, 64}, 1380, opt);
    gradient_both_ways(plan, cuda::dtype::bf16, shape{1, 2, 177, 64, 64}, 1390, opt);
  }
  // N in groups of rows: the forward's two launches, the backward's three (Horner's rule over the groups).
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    cuda::options opt{dt, dt};
    opt.split_rows = 64;
    forward_both_ways(plan, dt, shape{1, 2, 300, 64, 64}, 1395, opt);
    gradient_both_ways(plan, dt, shape{1, 2, 300, 64, 64}, 1396, opt);
  }
  // A prompt, then a step per token (the step kernel: T = 16), and the state.
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    shape const s{2, 3, 21, 16, 70};
    CAPTURE(cuda::name_of(dt));
    test::rng r{1400};
    auto inputs = random_inputs(s, dt, r, false);
    auto &q = inputs.q, &k = inputs.k, &v = inputs.v;
    auto decode = [&] {
      auto rnn = cuda::recurrent(plan, s.b, s.h, {dt, dt}, cuda::memory::host);
      tensor<float> out({s.b, s.h, s.n, s.m});
      std::size_t const prompt = 8;
      rnn.prefill_into(rows_of(out, 0, prompt), Q = test::tokens(q, 0, prompt), K = test::tokens(k, 0, prompt),
                       V = test::tokens(v, 0, prompt));
      for (std::size_t t = prompt; t < s.n; ++t)
        rnn.step_into(rows_of(out, t, t + 1), Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1),
                      V = test::tokens(v, t, t + 1));
      return std::pair{out, sums_of(rnn.state())};
    };
    auto [got, want] = both_ways(decode);
    CHECK(relative_rms(got.first, want.first) <= forward_tolerance(dt));
    CHECK(relative_rms(got.second, want.second) <= 1e-6);
  }
}

// Every other kind of kernel the emitter writes, each map and mask forward and
// backward: what the cases above leave to the interpreter alone (the row maps
// of poly2 below a block's state, relu, user formulas; sin and cos of random
// features; W per side; softmax without a mask, or with the mask before exp, or
// a row map or W inside exp).
TEST_CASE("simt: every feature map, causal and not, forward and backward, as written = the interpreter") {
  constexpr auto W2 = input<"W2">(D, Fw);
  auto both_types = [](auto const& plan, shape s, std::uint64_t seed, auto const&... bound) {
    for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
      forward_both_ways(plan, dt, s, seed, {dt, dt}, bound...);
      gradient_both_ways(plan, dt, s, seed + 1, {dt, dt}, bound...);
    }
  };
  shape const small{2, 2, 40, 8, 12}, chunks{1, 2, 150, 16, 24};
  for (shape s : {small, chunks}) {
    both_types(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V), s, 1500);
    both_types(compile<order::linear>(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V), s, 1510);
    both_types(compile<order::linear>(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V), s, 1520);
    both_types(compile<order::linear>(Q * transpose(K) * V), s, 1530);
    both_types(compile<order::linear>(normalize(causal(phi<test::softplus>(Q) * transpose(phi<test::softplus>(K)))) * V), s,
               1540);
    both_types(compile<order::linear>(normalize(phi<test::softplus>(Q) * transpose(phi<elu_plus_one>(K))) * V), s, 1550);
    both_types(compile(normalize(exp(Q * transpose(K) * 0.25)) * V), s, 1560);
    both_types(compile(normalize(exp(causal(Q * transpose(K)) * 0.25)) * V), s, 1570);
    auto const projection = gaussian_projection<float>(s.d, 24, 1580), projection2 = gaussian_projection<float>(s.d, 24, 1581);
    auto const w = broadcast(projection, s.b, s.h), w2 = broadcast(projection2, s.b, s.h);
    both_types(compile<order::linear>(normalize(phi<favor>(Q, W) * transpose(phi<favor>(K, W))) * V), s, 1590, W = w);
    both_types(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)))) * V), s, 1600, W = w,
               W2 = w2);
    both_types(compile<order::linear>(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V), s, 1610,
               W = w);
    both_types(compile<order::linear>(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W2)) * V), s, 1620, W = w,
               W2 = w2);
    both_types(compile(normalize(exp(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W)) * 0.5)) * V), s, 1630,
               W = w);
    both_types(compile(normalize(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)) * 0.01)) * V), s, 1650, W = w, W2 = w2);
    both_types(compile(normalize(causal(exp(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)) * 0.25))) * V), s, 1660);
  }
  // poly2 past a block's state without a mask: quadratic, through (q·k)².
  both_types(compile<order::linear>(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V), shape{1, 2, 130, 64, 16}, 1640);
}
