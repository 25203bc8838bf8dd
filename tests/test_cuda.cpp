// The CUDA backend without a GPU: the generated kernels' tile programs run in
// the host emulation and agree with the CPU backend and with the expression
// evaluated as written (in double); every kernel the tests generate compiles
// with NVRTC for sm_80 and sm_90 with an empty log; the emitted sources of a
// few plans are pinned by golden files (tests/golden/).
//
// Regenerate the golden files after an intended change of the emitter with
//   LINA_UPDATE_GOLDEN=1 build/release/tests/lina_cuda_tests -tc="*golden*"
// and review the diff.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <lina/cpu.hpp>
#include <lina/cuda.hpp>
#include <lina/cuda/nvrtc.hpp>
#include <lina/lina.hpp>
#include <set>
#include <sstream>
#include <string>
#include <unistd.h>

#include "support.hpp"

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;  // dynamic, so shapes can be random
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);

// ‖a − ref‖₂ / ‖ref‖₂ (0 when both are empty or zero).
template <class A, class R>
double relative_rms(A const& a, R const& ref) {
  REQUIRE(a.shape() == ref.shape());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double d = static_cast<double>(a.data()[i]) - static_cast<double>(ref.data()[i]);
    num += d * d;
    den += static_cast<double>(ref.data()[i]) * static_cast<double>(ref.data()[i]);
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// The values a kernel reading dtype t sees: x rounded to t (nearest even).
tensor<float> rounded(tensor<float> const& x, cuda::dtype t) {
  tensor<float> r = x;
  for (std::size_t i = 0; i < r.size(); ++i) {
    float v = r.data()[i];
    if (t == cuda::dtype::bf16) r.data()[i] = cuda::from_bf16_bits(cuda::bf16_bits(v));
    if (t == cuda::dtype::f16) r.data()[i] = cuda::from_f16_bits(cuda::f16_bits(v));
  }
  return r;
}
tensor<double> widened(tensor<float> const& x) {
  tensor<double> r(x.shape());
  for (std::size_t i = 0; i < x.size(); ++i) r.data()[i] = x.data()[i];
  return r;
}

// Relative RMS tolerance of an emulated result against references computed
// from the same (rounded) inputs. Both sides then differ by fp32 summation
// order — about √(terms)·2⁻²⁴ relative, ≤ 1e-6 at these sizes — and by the
// rounding of the output to its dtype: nearest-even rounding errs by at most
// half an ulp, 2⁻⁹ relative for bf16 (8 bits of significand) and 2⁻¹² for
// fp16 (11 bits), with an RMS about half that. The tolerances are twice the
// worst case: 2⁻⁸ (bf16), 2⁻¹¹ (fp16), and 1e-5 for fp32 (the summation
// order alone, with room for cancellation in signed, unnormalised sums).
double tolerance(cuda::dtype out) {
  switch (out) {
    case cuda::dtype::bf16: return std::ldexp(1.0, -8);
    case cuda::dtype::f16: return std::ldexp(1.0, -11);
    default: return 1e-5;
  }
}

// Compile each distinct generated kernel once per architecture; any log fails.
void check_compiles(cuda::program const& p) {
  static std::set<std::string> done;
  std::string src = cuda::emit(p);
  if (!done.insert(src).second) return;
  for (char const* arch : {"sm_80", "sm_90"}) {
    CAPTURE(arch);
    CAPTURE(p.kernel_name);
    cuda::compiled_kernel k;
    REQUIRE_NOTHROW(k = cuda::compile(src, p.kernel_name, arch));
    CHECK(k.log == "");
    CHECK(!k.image.empty());
  }
}

struct shape {
  std::size_t b, h, n, d, m;
};

// Edge shapes first (N = 0, 1, a chunk ± 1; D ≠ M; non-powers of two up to
// 256, which take the smaller chunk), then random ones.
std::vector<shape> shapes(std::uint64_t seed, int random_count) {
  std::vector<shape> s = {{1, 1, 0, 5, 3},  {1, 2, 1, 7, 4},    {2, 1, 63, 16, 9},  {1, 1, 65, 48, 96},
                          {1, 1, 130, 96, 48}, {1, 1, 70, 200, 72}, {1, 1, 40, 256, 200}};
  test::rng r{seed};
  for (int i = 0; i < random_count; ++i) {
    shape x{r.in(1, 2), r.in(1, 3), r.in(0, 300), r.in(1, 40), 0};
    do x.m = r.in(1, 80);
    while (x.m == x.d);
    s.push_back(x);
  }
  return s;
}

// The emulated kernel of compile<order::linear>(expr) against cpu::evaluate of
// the same plan and against the expression as written, in double, all on the
// inputs as the kernel reads them.
template <class Expr>
void check_forward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& fixed = {}, bool positive = false) {
  auto const plan = compile<order::linear>(expr);
  static_assert(cuda::lowerable<decltype(plan)>);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    double worst = 0;
    test::rng r{seed};
    for (shape s : fixed.empty() ? shapes(seed, 3) : fixed) {
      CAPTURE(cuda::name_of(dt));
      CAPTURE(s.b); CAPTURE(s.h); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
      auto q = tensor<float>::random({s.b, s.h, s.n, s.d}, r.next());
      auto k = tensor<float>::random({s.b, s.h, s.n, s.d}, r.next());
      if (positive)
        for (auto* x : {&q, &k})
          for (std::size_t i = 0; i < x->size(); ++i) x->data()[i] = std::abs(x->data()[i]);
      q = rounded(q, dt);
      k = rounded(k, dt);
      auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, r.next()), dt);
      cuda::options opt{dt, dt};
      auto got = cuda::emulate(plan, opt, Q = q, K = k, V = v);
      auto cpu = cpu::evaluate(plan, Q = q, K = k, V = v);
      auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
      double e1 = relative_rms(got, cpu), e2 = relative_rms(got, exact);
      CHECK(e1 <= tolerance(dt));
      CHECK(e2 <= tolerance(dt));
      worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
      check_compiles(cuda::program_of(plan, opt, D = s.d, M = s.m));
    }
    MESSAGE(cuda::name_of(dt) << ": largest relative RMS error / tolerance: " << worst);
  }
}

}  // namespace

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

TEST_CASE("plans → tile programs: supported shapes, chunk and tile sizes") {
  constexpr auto causal_plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  constexpr auto full_plan = compile<order::linear>(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V);
  constexpr auto automatic = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  static_assert(cuda::lowerable<decltype(causal_plan)> && cuda::lowerable<decltype(full_plan)>);
  static_assert(cuda::lowerable<decltype(automatic)>);  // a select between the two orders of one attention
  static_assert(cuda::lowerable<decltype(compile<order::linear>(Q * transpose(K) * V))>);
  static_assert(!cuda::lowerable<decltype(compile(normalize(exp(Q * transpose(K))) * V))>);  // softmax: not yet
  static_assert(cuda::lowerable<decltype(compile<order::linear>(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V))>);
  constexpr auto W = input<"W">(D, dim<"F">);
  static_assert(!cuda::lowerable<decltype(compile<order::linear>(  // parametric maps: not yet
                    normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V))>);

  auto s = cuda::spec_of(causal_plan);
  CHECK(s.causal);
  CHECK(s.normalized);
  CHECK(s.map_q == cuda::feature_map::elu_plus_one);
  CHECK(s.eps == 1e-6);
  CHECK(s.description == "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])))");
  CHECK(!cuda::spec_of(full_plan).causal);
  CHECK(cuda::spec_of(automatic).causal);

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
// The emitted source of `plan` equals tests/golden/<file> byte for byte.
template <class Plan>
void check_golden(Plan const& plan, cuda::options opt, std::string const& file) {
  std::string src = cuda::source(plan, opt);
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
  check_compiles(cuda::program_of(plan, opt));
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

namespace {
// The 16-bit bit patterns of a float tensor (dense [B,H,N,C]).
std::vector<std::uint16_t> bits_of(tensor<float> const& x, cuda::dtype t) {
  std::vector<std::uint16_t> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    r[i] = t == cuda::dtype::bf16 ? cuda::bf16_bits(x.data()[i]) : cuda::f16_bits(x.data()[i]);
  return r;
}
cuda::device_buffer upload(tensor<float> const& x, cuda::dtype t) {
  cuda::device_buffer d(x.size() * cuda::size_of(t));
  if (t == cuda::dtype::f32)
    d.upload(x.data(), d.size());
  else
    d.upload(bits_of(x, t).data(), d.size());
  return d;
}
}  // namespace

// Where a GPU exists, generated kernels launched on it agree with their
// emulation (the maps' expf differs from the host's exp by a few ulps, so
// fp32 is close, not bitwise); elsewhere the test says it is skipped.
TEST_CASE("device: launched kernels agree with the emulation") {
  auto dev = cuda::probe_device();
  if (!dev.available) {
    MESSAGE("skipped: no CUDA device (" << dev.reason << ")");
    return;
  }
  MESSAGE("device " << dev.device << ": " << dev.arch);
  constexpr auto causal_plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  constexpr auto full_plan = compile<order::linear>(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V);
  auto run = [&](auto const& plan, cuda::dtype dt, shape s, std::uint64_t seed) {
    CAPTURE(cuda::name_of(dt)); CAPTURE(s.n); CAPTURE(s.d); CAPTURE(s.m);
    auto q = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed), dt);
    auto k = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed + 1), dt);
    auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 2), dt);
    auto want = cuda::emulate(plan, {dt, dt}, Q = q, K = k, V = v);
    auto dq = upload(q, dt), dk = upload(k, dt), dv = upload(v, dt);
    cuda::device_buffer dout(want.size() * cuda::size_of(dt));
    tensor<float> got(want.shape());
    shape4 sq{s.b, s.h, s.n, s.d}, sv{s.b, s.h, s.n, s.m};
    auto go = [&]<class E>() {
      cuda::evaluate_into(plan, cuda::device_view<E>(static_cast<E*>(dout.get()), sv), nullptr,
                          Q = cuda::device_view<E const>(static_cast<E const*>(dq.get()), sq),
                          K = cuda::device_view<E const>(static_cast<E const*>(dk.get()), sq),
                          V = cuda::device_view<E const>(static_cast<E const*>(dv.get()), sv));
    };
    if (dt == cuda::dtype::f32) go.template operator()<float>();
    if (dt == cuda::dtype::bf16) go.template operator()<cuda::bf16>();
    if (dt == cuda::dtype::f16) go.template operator()<cuda::f16>();
    cuda::synchronize();
    if (dt == cuda::dtype::f32) {
      dout.download(got.data(), dout.size());
    } else {
      std::vector<std::uint16_t> b(got.size());
      dout.download(b.data(), dout.size());
      for (std::size_t i = 0; i < b.size(); ++i)
        got.data()[i] = dt == cuda::dtype::bf16 ? cuda::from_bf16_bits(b[i]) : cuda::from_f16_bits(b[i]);
    }
    CHECK(relative_rms(got, want) <= (dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4));
  };
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16})
    for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{1, 1, 70, 256, 48}}) {
      run(causal_plan, dt, s, 100);
      run(full_plan, dt, s, 200);
    }
  // Host memory where device memory is needed: refused before any launch.
  tensor<float> q({1, 1, 4, 8}), v({1, 1, 4, 8});
  cuda::device_buffer dout(q.size() * 4);
  cuda::device_view<float const> hq(q.data(), q.shape()), hv(v.data(), v.shape());
  CHECK_THROWS_AS(cuda::evaluate_into(causal_plan, cuda::device_view<float>(static_cast<float*>(dout.get()), v.shape()),
                                      nullptr, Q = hq, K = hq, V = hv),
                  std::invalid_argument);
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
