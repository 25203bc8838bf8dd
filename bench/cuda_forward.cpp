// The CUDA forward on a GPU: causal elu+1 attention, normalised, bf16 inputs
// and output (fp32 state), the kernel lina generates for it, timed with CUDA
// events. Per shape: the median of repeated launches after a warm-up (the
// first launch, which also compiles the kernel with NVRTC), TFLOP/s counting
// 4·B·H·N·D·M flops, the bandwidth of reading q, k, v and writing o once
// (bf16), and that bandwidth as a fraction of a device-to-device copy
// (cudaMemcpyAsync of a large buffer) measured in the same run. Each shape's
// result is checked against the host emulation on the first rows of one
// (batch, head), so a fast wrong kernel does not pass for a benchmark.
//
//   cuda_forward [--shapes BxTxHxD,…] [--decode BxHxD|none] [--packed SxLxHxD,…|none] [--retention BxTxHxD,…|none]
//                [--no-backward] [--budget seconds]
//                [--tsv file] [--check-rows n]
//                [--copy-mib m] [--ablate] [--tiles TxTM[p][sG][/N],…] [--compile-only sm_XY [--sms n]]
//
// Per shape also the backward (--no-backward skips it): the generated backward
// kernel (cuda::backward_program_of) launched on preallocated ∂Q, ∂K, ∂V (bf16)
// and its fp32 scratch rows, timed the same way; forward + backward against the
// floor of reading q, k, v, ∂o (twice: forward and backward) and writing o,
// ∂q, ∂k, ∂v once, bf16 (11 tensors of the input's size: the anchors' arithmetic), and ∂Q of the first
// rows of one (batch, head) checked against the emulation (∂Q of a row depends on
// earlier rows alone). Its tsv row has its ms in a sixth column.
//
// --decode BxHxD (default 64x32x128; "none" skips it) times decode steps:
// cuda::recurrent's step_into for B sequences × H heads at D = M, bf16 in and
// out, one token per sequence per launch, from a state of earlier tokens; µs per
// step and GB/s counting the fp32 state read and written once (the floor of a
// step), against the copy. The first step is checked against the emulation.
// Its tsv row has T = 1.
//
// --packed SxLxHxD,… (default 512x64x16x64,32x1024x16x128,4x8192x16x128; "none"
// skips it) times packed sequences, the workload of fla's cu_seqlens: S
// sequences of mean length L (sequence i has L/2 + (40503·i mod (L+1)) rows;
// bench/fla_forward.py draws the same) end to end in one batch row, bf16
// [1, H, ΣN, D = M]: the forward through evaluate_into(plan, out, stream, seqs,
// …) — one launch where the pack fills the device, else a launch per sequence —
// beside the same sequences evaluated one by one (evaluate_into on each one's
// rows: what one launch saves), and unless --no-backward the gradients through
// cuda::gradient(plan, dout, stream, seqs, …), the allocating call, and through
// gradient_into into gradients made once (the tsv's backward: fla's autograd
// takes its tensors from PyTorch's caching allocator, not cudaMalloc). Checked:
// the last sequence's first rows (output and ∂Q of both) of the last head
// against the emulation. Its tsv rows have B = pS and T = L.
//
// --retention BxTxHxD,… (default 1x8192x96x128,8x2048x32x64; "none" skips it)
// times the decayed mask: RetNet's retention causal(Q·Kᵀ, decay{0.96875})·V
// (no feature map, no normaliser), forward through evaluate_into and backward
// as cuda::gradient launches it, checked like the rows above; its tsv rows have
// B = rB. fla's chunk_simple_gla with g_gamma = log 0.96875 on every head is
// the same attention (bench/fla_forward.py).
//
// --tiles TxTM[p][sG][/N],… (default 64x64p,32x64,64x128,32x128,32x128p,16x128,
// 64x128/512,64x64s4,64x64s16,32x128s8; "none": no sweep) times the forward again
// at each of these schedules (options::tiles: T rows per chunk, TM columns of M
// per block, p: the next chunk's rows prefetched to L2, sG: N split into G groups
// of rows per (batch, head) — the chunk-parallel form — where lina would split
// only when the (batch, head) blocks leave SMs idle, N threads per block; those
// that give lina's own tiles are skipped, those that do not fit say so), split
// along N where evaluate_into would split at that schedule, and the backward at
// each other T (and groups); each with a sixth of the
// budget, checked against the emulation at its own tiles, in a table of its
// own after the decode steps (what the issues ask for comes first, should a
// deadline cut the run short): where lina's choice
// (choose_tiles: 64x64 at D = 64 and 128) leaves time on the table.
//
// --compile-only sm_XY [--sms n] needs no device: it compiles, through NVRTC's
// on-disk cache (LINA_CUDA_CACHE), every kernel a run with the same options
// would launch on a device of that architecture with n SMs (default 132, an
// H200), so that a device session starts with its kernels compiled
// (scripts/gpu-prebuild).
//
// --ablate adds, per shape, the times of the same program launched with
// cuda::launch (no host-side checks: the host overhead of evaluate_into)
// and of variants with one kind of instruction left out (their results are
// wrong; only the time counts): where a chunk's time goes, without counters.
//
// Prints Markdown (scripts/gpu-check collects it). Exits 2, saying "no CUDA
// device", where there is none; 1 when a check fails or CUDA reports an error.
#include <cuda_runtime_api.h>
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <lina/cuda.hpp>
#include <lina/cuda/emit.hpp>
#include <lina/cuda/nvrtc.hpp>
#include <lina/lina.hpp>
#include <limits>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
using elu_plan = std::remove_cvref_t<decltype(plan)>;
// --retention's plan: RetNet's retention causal(Q·Kᵀ, decay{g})·V (no feature
// map, no normaliser) at g = 1 − 2⁻⁵, the slowest-decaying head of fla's
// chunk_retention; fla's chunk_simple_gla with g_gamma = log g on every head
// is the same attention (bench/fla_forward.py).
constexpr double retention_decay = 0.96875;
constexpr auto retention = compile<order::linear>(causal(Q * transpose(K), decay{retention_decay}) * V);

void check(cudaError_t e, char const* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

struct events {
  cudaEvent_t start = nullptr, stop = nullptr;
  events() {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  events(events&& o) noexcept : start(o.start), stop(o.stop) { o.start = o.stop = nullptr; }
  events(events const&) = delete;
  ~events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
  float ms() const {
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    return t;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Uniform in [-1, 1), as bf16 bit patterns (splitmix64; fast enough for 10⁸ elements).
std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint16_t> r(n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (auto& x : r) {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x = cuda::bf16_bits(static_cast<float>(static_cast<double>(z >> 40) * 0x1.0p-24 * 2.0 - 1.0));
  }
  return r;
}

struct shape {
  std::size_t b, t, h, d;
};

std::vector<shape> parse_shapes(std::string_view text) {
  std::vector<shape> r;
  while (!text.empty()) {
    std::size_t comma = text.find(',');
    std::string one(text.substr(0, comma));
    shape s{};
    if (std::sscanf(one.c_str(), "%zux%zux%zux%zu", &s.b, &s.t, &s.h, &s.d) != 4 || !s.b || !s.t || !s.h || !s.d)
      throw std::invalid_argument("cuda_forward: a shape is BxTxHxD, e.g. 1x8192x96x128, not '" + one + "'");
    r.push_back(s);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
  }
  return r;
}

// The arguments of a kernel launched directly on one shape's q, k, v and out.
cuda::forward_args args_of(shape const& s, cuda::tensor<cuda::bf16> const& q, cuda::tensor<cuda::bf16> const& k,
                           cuda::tensor<cuda::bf16> const& v, cuda::tensor<cuda::bf16>& out) {
  cuda::forward_args a;
  a.in[0] = cuda::detail::device_operand(q.view());
  a.in[1] = cuda::detail::device_operand(k.view());
  a.in[2] = cuda::detail::device_operand(v.view());
  a.out = cuda::detail::device_operand(out.view());
  a.batch = static_cast<std::int64_t>(s.b), a.heads = static_cast<std::int64_t>(s.h), a.n = static_cast<std::int64_t>(s.t);
  return a;
}

cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};

// The kernel spec of one shape (M = D) at a schedule ({0, 0}: lina's own), of
// the elu+1 plan unless another is given.
template <class P = elu_plan>
cuda::attention_spec spec_at(shape const& s, cuda::tile_request tiles = {}, P const& p = plan) {
  auto spec = cuda::spec_of(p, bf16);
  spec.d = spec.m = s.d;
  spec.tiles = tiles;
  return spec;
}

cuda::forward_args extents_of(shape const& s) {
  cuda::forward_args a;
  a.batch = static_cast<std::int64_t>(s.b), a.heads = static_cast<std::int64_t>(s.h), a.n = static_cast<std::int64_t>(s.t);
  return a;
}

// What evaluate_into launches for a spec on a device of `sms` SMs: the
// one-pass program, or the chunk-parallel form over groups of `rows` rows
// where split_rows chooses it at the spec's schedule (the one pass is timed beside it).
struct forward_launch {
  cuda::program one;
  std::vector<cuda::split_programs> split;  // none, or one
  std::int64_t rows = 0;
};
forward_launch forward_launch_of(cuda::attention_spec const& spec, shape const& s, int sms) {
  forward_launch f{cuda::program_of(spec), {}, 0};
  f.rows = cuda::split_rows(spec.tiles, cuda::blocks_of(f.one, extents_of(s)), static_cast<std::int64_t>(s.t),
                            f.one.tiles.chunk, sms);
  if (f.rows > 0) f.split.push_back(cuda::split_programs_of(spec));
  return f;
}

// The same for cuda::gradient: the backward's one pass, and its three
// launches over groups of `rows` rows where it splits.
struct backward_launch {
  cuda::program one;
  std::vector<cuda::program> split;
  std::int64_t rows = 0;
};
backward_launch backward_launch_of(cuda::attention_spec const& spec, shape const& s, int sms) {
  backward_launch b{cuda::backward_program_of(spec), cuda::split_backward_programs_of(spec), 0};
  if (!b.split.empty())
    b.rows = cuda::split_rows(spec.tiles, cuda::blocks_of(b.one, extents_of(s)), static_cast<std::int64_t>(s.t),
                              b.one.tiles.chunk, sms);
  if (b.rows == 0) b.split.clear();
  return b;
}

// "TxTM[p][sG][/N],…" → the schedules of --tiles.
std::vector<cuda::tile_request> parse_tiles(std::string_view text) {
  std::vector<cuda::tile_request> r;
  while (!text.empty()) {
    std::size_t comma = text.find(',');
    std::string one(text.substr(0, comma));
    cuda::tile_request t;
    int used = 0;
    bool ok = std::sscanf(one.c_str(), "%dx%d%n", &t.chunk, &t.tile_m, &used) == 2 && t.chunk > 0 && t.tile_m > 0;
    std::string_view rest = std::string_view(one).substr(ok ? static_cast<std::size_t>(used) : one.size());
    auto number = [&](int& x) {  // digits at the front of rest, consumed
      std::size_t i = 0;
      for (x = 0; i < rest.size() && rest[i] >= '0' && rest[i] <= '9' && i < 6; ++i) x = 10 * x + (rest[i] - '0');
      rest.remove_prefix(i);
      return i > 0 && x > 0;
    };
    if (ok && rest.starts_with('p')) t.prefetch = true, rest.remove_prefix(1);
    if (ok && rest.starts_with('s')) rest.remove_prefix(1), ok = number(t.groups);
    if (ok && rest.starts_with('/')) rest.remove_prefix(1), ok = number(t.threads);
    if (!ok || !rest.empty())
      throw std::invalid_argument("cuda_forward: a schedule is TxTM (rows per chunk x columns of M per block), with p "
                                  "for prefetching the next chunk, sG for G groups of rows per (batch, head) and /N for "
                                  "N threads per block, e.g. 32x128, 64x64p, 64x64s8 or 64x128/512; not '" + one + "'");
    r.push_back(t);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
  }
  return r;
}

// A schedule in words, for the table ("T = 32, M tile = 128, prefetch, 256 threads, 8 group(s) of rows").
std::string describe(cuda::tile_request const& t, std::size_t d) {
  std::string r = fmt::format("T = {}", t.chunk);
  if (t.tile_m > 0) r += fmt::format(", M tile = {}", std::min<std::size_t>(static_cast<std::size_t>(t.tile_m), d));
  if (t.prefetch) r += ", prefetch";
  r += fmt::format(", {} threads", t.threads > 0 ? t.threads : 256);
  if (t.groups > 0) r += fmt::format(", {} group(s) of rows", t.groups);
  return r;
}

// Device-to-device copy bandwidth: the median of cudaMemcpyAsync of `bytes`,
// counting the bytes read and the bytes written.
double copy_gbytes(std::size_t bytes, cudaStream_t stream, double* ms_out) {
  void *src = nullptr, *dst = nullptr;
  check(cudaMalloc(&src, bytes), "cudaMalloc (copy probe)");
  check(cudaMalloc(&dst, bytes), "cudaMalloc (copy probe)");
  check(cudaMemsetAsync(src, 1, bytes, stream), "cudaMemsetAsync");
  for (int i = 0; i < 3; ++i) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  std::vector<events> ev(15);
  for (auto& e : ev) {
    check(cudaEventRecord(e.start, stream), "cudaEventRecord");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    check(cudaEventRecord(e.stop, stream), "cudaEventRecord");
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> t;
  for (auto& e : ev) t.push_back(e.ms());
  cudaFree(src);
  cudaFree(dst);
  double ms = median(t);
  *ms_out = ms;
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

// Median ms of `reps` launches of f, each between two events, all queued at
// once (the host stays ahead of the device), after one more to warm up.
template <class F>
double time_launches(F const& f, int reps, cudaStream_t stream) {
  f();
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<events> ev(static_cast<std::size_t>(reps));
  for (auto& e : ev) {
    check(cudaEventRecord(e.start, stream), "cudaEventRecord");
    f();
    check(cudaEventRecord(e.stop, stream), "cudaEventRecord");
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> t;
  for (auto& e : ev) t.push_back(e.ms());
  return median(t);
}

// f launched once to warm up (the first launch compiles and loads its kernel),
// once timed alone, then as many times as `budget` seconds allow (3 to `cap`):
// the median ms, and the repetitions in *reps.
template <class F>
double time_within(F const& f, double budget, double cap, cudaStream_t stream, int* reps) {
  f();
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (first launch)");
  events one;
  check(cudaEventRecord(one.start, stream), "cudaEventRecord");
  f();
  check(cudaEventRecord(one.stop, stream), "cudaEventRecord");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  *reps = static_cast<int>(std::clamp(budget * 1e3 / std::max(double(one.ms()), 1e-3), 3.0, cap));
  return time_launches(f, *reps, stream);
}

// --ablate's variants of a program: each with every instruction of some
// kinds removed from its passes (what it measures, the program).
std::vector<std::pair<std::string, cuda::program>> ablation_variants(cuda::program const& base) {
  using cuda::opcode;
  struct variant {
    char const* what;
    char const* tag;
    std::vector<opcode> drop;
  };
  variant const variants[] = {
      {"the same program through cuda::launch", "same", {}},
      {"without the products", "noproduct", {opcode::product}},
      {"without loads, maps, ones (stale tiles)", "noload", {opcode::load, opcode::map, opcode::ones_column}},
      {"without the store", "nostore", {opcode::store}},
      {"loads and store only", "io", {opcode::product, opcode::mask_causal, opcode::row_divide, opcode::map}},
      {"products only", "products", {opcode::load, opcode::map, opcode::ones_column, opcode::mask_causal,
                                     opcode::row_divide, opcode::store}},
  };
  std::vector<std::pair<std::string, cuda::program>> r;
  for (auto const& v : variants) {
    cuda::program p = base;
    for (auto& pass : p.passes)
      std::erase_if(pass, [&](cuda::instruction const& i) { return std::find(v.drop.begin(), v.drop.end(), i.op) != v.drop.end(); });
    p.kernel_name += std::string("_") + v.tag;
    r.emplace_back(v.what, std::move(p));
  }
  return r;
}

void ablate(cuda::program const& base, cuda::forward_args const& a, double full_ms, int reps, cudaStream_t stream) {
  fmt::print("\n| variant of {} | median ms | of the full kernel |\n|---|---|---|\n", base.kernel_name);
  fmt::print("| evaluate_into (the table above) | {:.3f} | 100 % |\n", full_ms);
  for (auto const& [what, p] : ablation_variants(base)) {
    double ms = time_launches([&] { cuda::launch(p, a, stream); }, reps, stream);
    fmt::print("| {} | {:.3f} | {:.0f} % |\n", what, ms, 100.0 * ms / full_ms);
    std::fflush(stdout);
  }
}

// The first `rows` rows of the last (batch, head) of a [B, H, T, cols] tensor
// given as bf16 bits, as a float tensor [1, 1, rows, cols] (the checks' inputs:
// in a causal attention those rows depend on the same rows alone).
lina::tensor<float> first_rows(std::vector<std::uint16_t> const& bits, shape const& s, std::size_t cols, std::size_t rows) {
  std::size_t const slice = s.b * s.h - 1;
  lina::tensor<float> r({1, 1, rows, cols});
  for (std::size_t i = 0; i < rows * cols; ++i) r.data()[i] = cuda::from_bf16_bits(bits[slice * s.t * cols + i]);
  return r;
}

// The relative RMS error of n bf16 values in device memory against `want`.
double device_error(cuda::bf16 const* got_on_device, std::size_t n, float const* want) {
  std::vector<std::uint16_t> got(n);
  check(cudaMemcpy(got.data(), got_on_device, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double const g = cuda::from_bf16_bits(got[i]), w = want[i];
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The backward of one shape at a schedule (`tiles`: lina's own when {0, 0}):
// its kernels launched on preallocated gradients, as cuda::gradient would, and
// timed like the forward; prints a row labelled `label`. Where cuda::gradient
// splits N (too few (batch, head) blocks for the SMs), the three launches of
// the chunk-parallel form, with the one-pass kernel timed beside them. True
// when ∂Q's first rows of the last (batch, head) match the emulation at the
// same tiles. Of the elu+1 plan unless another is given.
template <class P = elu_plan>
bool time_backward(shape const& s, cuda::tile_request tiles, std::string const& label, std::vector<std::uint16_t> const& hq,
                   std::vector<std::uint16_t> const& hk, std::vector<std::uint16_t> const& hv,
                   cuda::tensor<cuda::bf16> const& q, cuda::tensor<cuda::bf16> const& k, cuda::tensor<cuda::bf16> const& v,
                   double fwd_ms, double copy_bw, double budget, std::size_t check_rows, int sms, cudaStream_t stream,
                   double* ms_out, P const& attention = plan) {
  std::size_t const m = s.d;
  backward_launch b;
  try {
    b = backward_launch_of(spec_at(s, tiles, attention), s, sms);
  } catch (std::invalid_argument const& e) {
    fmt::print("| {}: not one block's ({}) | | | | | {} | | | | | | |\n", label, e.what(), tiles.chunk);
    return true;
  }
  shape4 const sq{s.b, s.h, s.t, s.d}, sv{s.b, s.h, s.t, m};
  auto hd = random_bf16(s.b * s.h * s.t * m, 99);
  cuda::tensor<cuda::bf16> dout(sv), gq(sq), gk(sq), gv(sv);
  cuda::tensor<float> scratch({s.b, s.h, s.t, m + 1});
  check(cudaMemcpy(dout.data(), hd.data(), dout.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
  cuda::program const& p = b.one;
  cuda::forward_args a = args_of(s, q, k, v, gq);
  a.in[3] = cuda::detail::device_operand(dout.view());
  a.extra[0] = cuda::detail::device_operand(gk.view());
  a.extra[1] = cuda::detail::device_operand(gv.view());
  a.extra[2] = cuda::detail::device_operand(scratch.view());
  // The chunk-parallel form where cuda::gradient takes it: the groups' sums in two more fp32 buffers.
  std::vector<cuda::program> const& split = b.split;
  std::int64_t const group_rows = b.rows;
  std::size_t const groups = group_rows > 0 ? (s.t + static_cast<std::size_t>(group_rows) - 1) / static_cast<std::size_t>(group_rows) : 0;
  cuda::tensor<float> partials({s.b, s.h, groups * s.d, m + 1}), adjoint_partials({s.b, s.h, groups * s.d, m + 1});
  cuda::forward_args sa = a;
  if (group_rows > 0) {
    sa.group_rows = group_rows;
    sa.extra[cuda::extra_named(split[0], "partials")] = cuda::detail::device_operand(partials.view());
    sa.extra[cuda::extra_named(split[0], "∂ partials")] = cuda::detail::device_operand(adjoint_partials.view());
  }
  auto run = [&] {
    if (group_rows > 0)
      for (cuda::program const& x : split) cuda::launch(x, sa, stream);
    else
      cuda::launch(p, a, stream);
  };
  int reps = 0;
  double const ms = time_within(run, budget, 50, stream, &reps);
  *ms_out = ms;

  // ∂Q of the first rows of the last (batch, head): they depend on those rows alone.
  std::size_t const rows = std::min(check_rows, s.t);
  cuda::options at = bf16;
  at.tiles = tiles;
  auto want = cuda::emulate_gradient(attention, at, first_rows(hd, s, m, rows), Q = first_rows(hq, s, s.d, rows),
                                     K = first_rows(hk, s, s.d, rows), V = first_rows(hv, s, m, rows));
  double const err = device_error(gq.data() + (s.b * s.h - 1) * s.t * s.d, rows * s.d, want[Q].data());
  bool const ok = err <= std::ldexp(1.0, -8);
  double const bytes = 11.0 * 2.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d);  // D = M
  double const gbs = bytes / ((fwd_ms + ms) * 1e-3) / 1e9;
  fmt::print("| {} | | | | {} | {} | {} | {:.3f} (fwd+bwd {:.3f}) | | {:.0f} (fwd+bwd floor bytes) | {:.1f} % | ∂Q {:.1e} {} |\n",
             label, group_rows > 0 ? split.back().kernel_name : p.kernel_name, p.tiles.chunk, reps, ms, fwd_ms + ms, gbs,
             100.0 * gbs / copy_bw, err, ok ? "ok" : "**MISMATCH**");
  if (group_rows > 0) {
    double const one_ms = time_launches([&] { cuda::launch(p, a, stream); }, std::min(reps, 20), stream);
    fmt::print("| ↳ above: split into groups of {} rows (three launches); one pass | | | | {} | {} | {} | {:.3f} | | | | |\n",
               group_rows, p.kernel_name, p.tiles.chunk, std::min(reps, 20), one_ms);
  }
  std::fflush(stdout);
  return ok;
}

// --decode's BxHxD.
std::tuple<std::size_t, std::size_t, std::size_t> parse_decode(std::string const& text) {
  std::size_t b = 0, h = 0, d = 0;
  if (std::sscanf(text.c_str(), "%zux%zux%zu", &b, &h, &d) != 3 || !b || !h || !d)
    throw std::invalid_argument("cuda_forward: --decode is BxHxD, e.g. 64x32x128, or none; not '" + text + "'");
  return {b, h, d};
}
constexpr std::size_t decode_warm = 64;  // tokens of the prompt before the timed steps

// Decode steps (--decode): B sequences × H heads, D = M, bf16, from a state
// holding `warm` earlier tokens. True when the first step matches the emulation.
bool decode_steps(std::string const& text, double budget, double copy_bw, cudaStream_t stream, std::FILE* tsv) {
  auto const [b, h, d] = parse_decode(text);
  std::size_t const m = d, warm = decode_warm;
  shape4 const one{b, h, 1, d}, prompt{b, h, warm, d};
  auto to = [&](shape4 s, std::uint64_t seed) {
    auto bits = random_bf16(s[0] * s[1] * s[2] * s[3], seed);
    cuda::tensor<cuda::bf16> t(s);
    check(cudaMemcpy(t.data(), bits.data(), t.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
    return std::pair{std::move(t), std::move(bits)};
  };
  auto [pq, hpq] = to(prompt, 11);
  auto [pk, hpk] = to(prompt, 12);
  auto [pv, hpv] = to(prompt, 13);
  auto [q, hq] = to(one, 14);
  auto [k, hk] = to(one, 15);
  auto [v, hv] = to(one, 16);
  cuda::tensor<cuda::bf16> po(prompt), o(one);
  cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};
  auto rnn = cuda::recurrent(plan, b, h, bf16);
  rnn.prefill_into(po.view(), stream, Q = pq, K = pk, V = pv);
  rnn.step_into(o.view(), stream, Q = q, K = k, V = v);  // prepares (compiles, loads) the step kernel
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (first step)");

  // The last (batch, head): its prompt and first step, emulated.
  std::size_t const slice = b * h - 1;
  lina::tensor<float> eq({1, 1, warm + 1, d}), ek({1, 1, warm + 1, d}), ev({1, 1, warm + 1, m});
  for (std::size_t r = 0; r <= warm; ++r)
    for (std::size_t c = 0; c < d; ++c) {
      bool const last = r == warm;
      std::size_t const at = last ? slice * d + c : (slice * warm + r) * d + c;
      eq(0, 0, r, c) = cuda::from_bf16_bits(last ? hq[at] : hpq[at]);
      ek(0, 0, r, c) = cuda::from_bf16_bits(last ? hk[at] : hpk[at]);
      ev(0, 0, r, c) = cuda::from_bf16_bits(last ? hv[at] : hpv[at]);
    }
  auto want = cuda::emulate(plan, bf16, Q = eq, K = ek, V = ev);
  double const err = device_error(o.data() + slice * m, m, &want(0, 0, warm, 0));
  bool const ok = err <= std::ldexp(1.0, -8);

  int reps = 0;
  double const ms = time_within([&] { rnn.step_into(o.view(), stream, Q = q, K = k, V = v); }, budget, 200, stream, &reps);
  double const state_bytes = double(b) * double(h) * double(d) * double(m + 1) * 4.0;
  double const gbs = 2.0 * state_bytes / (ms * 1e-3) / 1e9;
  fmt::print("\n## CUDA decode step: cuda::recurrent::step_into, causal elu+1, normalised, bf16 in and out, fp32 state\n\n");
  fmt::print("| sequences | H | D = M | state MiB | reps | median µs per step | GB/s (state read + written) | of copy | "
             "check (first step vs emulation) |\n|---|---|---|---|---|---|---|---|---|\n");
  fmt::print("| {} | {} | {} | {:.1f} | {} | {:.1f} | {:.0f} | {:.1f} % | {:.1e} {} |\n", b, h, d, state_bytes / (1 << 20),
             reps, ms * 1e3, gbs, 100.0 * gbs / copy_bw, err, ok ? "ok" : "**MISMATCH**");
  fmt::print("\nfloor (the state read and written once at the copy's bandwidth): {:.1f} µs; a step takes {:.2f}× that\n",
             2.0 * state_bytes / (copy_bw * 1e9) * 1e6, ms * 1e-3 / (2.0 * state_bytes / (copy_bw * 1e9)));
  std::fflush(stdout);
  if (tsv) std::fprintf(tsv, "%zu\t1\t%zu\t%zu\t%.6f\n", b, h, d, ms);
  return ok;
}

// --packed's SxLxHxD: S sequences of mean length L, H heads, D = M.
struct pack {
  std::size_t s, l, h, d;
};
std::vector<pack> parse_packs(std::string_view text) {
  std::vector<pack> r;
  if (text == "none") return r;
  for (shape const& x : parse_shapes(text)) r.push_back({x.b, x.t, x.h, x.d});  // (the same four numbers)
  return r;
}
// The pack's lengths: L/2 + (40503·i mod (L+1)), mean about L (fla_forward.py draws the same).
sequences lengths_of(pack const& p) {
  std::vector<std::size_t> n(p.s);
  for (std::size_t i = 0; i < p.s; ++i) n[i] = p.l / 2 + (40503 * i) % (p.l + 1);
  return sequences::from_lengths(n);
}

// One pack timed (--packed): a table row; its ms in the tsv (B = pS, T = L).
// True when the last sequence's first rows of the last head (output, ∂Q)
// match the emulation.
bool time_packed(pack const& pk, bool backward, double budget, double copy_bw, std::size_t check_rows, int sms,
                 cudaStream_t stream, std::FILE* tsv) {
  sequences const seqs = lengths_of(pk);
  std::size_t const total = seqs.total(), h = pk.h, d = pk.d, last = pk.s - 1;
  shape4 const sh{1, h, total, d};
  auto upload = [&](std::uint64_t seed) {
    auto bits = random_bf16(h * total * d, seed);
    cuda::tensor<cuda::bf16> t(sh);
    check(cudaMemcpy(t.data(), bits.data(), t.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
    return std::pair{std::move(t), std::move(bits)};
  };
  auto [q, hq] = upload(21);
  auto [k, hk] = upload(22);
  auto [v, hv] = upload(23);
  cuda::tensor<cuda::bf16> o(sh), alone_o(sh);
  auto const in = cuda::detail::check_sequences<std::remove_cvref_t<decltype(plan)>>(o.view(), "cuda::evaluate_into", seqs, Q = q, K = k, V = v);
  bool const one = cuda::detail::one_launch(plan, bf16, in, seqs, false, sms);
  bool const one_backward = cuda::detail::one_launch(plan, bf16, in, seqs, false, sms, true);

  int reps = 0, alone_reps = 0;
  double const ms = time_within([&] { cuda::evaluate_into(plan, o.view(), stream, seqs, Q = q, K = k, V = v); }, budget,
                                50, stream, &reps);
  auto rows = [&](cuda::tensor<cuda::bf16>& t, std::size_t x) {
    return t.view().rows(seqs.begin(x), seqs.length(x));
  };
  double const alone_ms = time_within(
      [&] {
        for (std::size_t x = 0; x < seqs.count(); ++x)
          cuda::evaluate_into(plan, rows(alone_o, x), stream, Q = rows(q, x), K = rows(k, x), V = rows(v, x));
      },
      budget / 2, 20, stream, &alone_reps);

  // The last sequence's first rows of the last head, [1, 1, rows, d].
  std::size_t const n = std::min(check_rows, seqs.length(last)), first = (h - 1) * total + seqs.begin(last);
  auto pick = [&](std::vector<std::uint16_t> const& bits) {
    lina::tensor<float> t({1, 1, n, d});
    for (std::size_t i = 0; i < n * d; ++i) t.data()[i] = cuda::from_bf16_bits(bits[first * d + i]);
    return t;
  };
  auto const want = cuda::emulate(plan, bf16, Q = pick(hq), K = pick(hk), V = pick(hv));
  double const err = device_error(o.data() + first * d, n * d, want.data());
  bool ok = err <= std::ldexp(1.0, -8);

  double bwd_ms = 0, into_ms = 0, bwd_err = 0, into_err = 0;
  if (backward) {
    auto [dout, hd] = upload(24);
    int bwd_reps = 0, into_reps = 0;
    bwd_ms = time_within([&] { cuda::gradient(plan, dout, stream, seqs, Q = q, K = k, V = v); }, budget / 2, 50, stream,
                         &bwd_reps);
    // Into gradients made once, as a training loop keeps them (and as fla's
    // autograd gets its tensors from PyTorch's caching allocator).
    cuda::tensor<cuda::bf16> gq(sh), gk(sh), gv(sh);
    auto into = cuda::gradient_views<cuda::bf16>(plan);
    into[Q] = gq.view(), into[K] = gk.view(), into[V] = gv.view();
    into_ms = time_within([&] { cuda::gradient_into(plan, into, dout, stream, seqs, Q = q, K = k, V = v); }, budget / 2, 50,
                          stream, &into_reps);
    auto const g = cuda::gradient(plan, dout, stream, seqs, Q = q, K = k, V = v);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    auto const want_g = cuda::emulate_gradient(plan, bf16, pick(hd), Q = pick(hq), K = pick(hk), V = pick(hv));
    bwd_err = device_error(g[Q].data() + first * d, n * d, want_g[Q].data());
    into_err = device_error(gq.data() + first * d, n * d, want_g[Q].data());
    ok = ok && bwd_err <= std::ldexp(1.0, -8) && into_err <= std::ldexp(1.0, -8);
  }
  double const flops = 4.0 * double(h) * double(total) * double(d) * double(d);
  double const gbs = 2.0 * 4.0 * double(h * total * d) / (ms * 1e-3) / 1e9;  // q, k, v read, o written, bf16
  fmt::print("| {} | {} | {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {:.0f} | {:.1f} % | {:.3f} ({:.2f}×) | {} | {} | {:.1e}{} {} |\n",
             pk.s, pk.l, total, h, d, one ? "one" : "per sequence", reps, ms, flops / (ms * 1e-3) / 1e12, gbs,
             100.0 * gbs / copy_bw, alone_ms, alone_ms / ms,
             backward ? fmt::format("{:.3f} ({})", bwd_ms, one_backward ? "one launch" : "per sequence") : std::string(),
             backward ? fmt::format("{:.3f}", into_ms) : std::string(), err,
             backward ? fmt::format(", ∂Q {:.1e}, into {:.1e}", bwd_err, into_err) : std::string(), ok ? "ok" : "**MISMATCH**");
  std::fflush(stdout);
  if (tsv) {
    if (backward)
      std::fprintf(tsv, "p%zu\t%zu\t%zu\t%zu\t%.6f\t%.6f\n", pk.s, pk.l, h, d, ms, into_ms);
    else
      std::fprintf(tsv, "p%zu\t%zu\t%zu\t%zu\t%.6f\n", pk.s, pk.l, h, d, ms);
  }
  return ok;
}

}  // namespace

// The relative RMS error of `o`'s first rows of the last (batch, head)
// against the emulation at `opt` (causal: those rows depend on the same rows
// of the inputs alone). Of the elu+1 plan unless another is given.
template <class P = elu_plan>
double forward_error(shape const& s, std::vector<std::uint16_t> const& hq, std::vector<std::uint16_t> const& hk,
                     std::vector<std::uint16_t> const& hv, cuda::tensor<cuda::bf16> const& o, cuda::options const& opt,
                     std::size_t check_rows, P const& p = plan) {
  std::size_t const m = s.d, rows = std::min(check_rows, s.t);
  auto want = cuda::emulate(p, opt, Q = first_rows(hq, s, s.d, rows), K = first_rows(hk, s, s.d, rows),
                            V = first_rows(hv, s, m, rows));
  return device_error(o.data() + (s.b * s.h - 1) * s.t * m, rows * m, want.data());
}

// The forward of one shape at a schedule of --tiles, launched as evaluate_into
// would launch it at those tiles (split along N where split_rows says so); a
// row of the table, against lina's own choice (`own_ms`); its ms in *ms_out
// (infinity where it does not fit or disagrees). True when it matches the
// emulation at the same tiles (or does not fit: a row saying so).
bool time_schedule(shape const& s, cuda::tile_request tiles, std::vector<std::uint16_t> const& hq,
                   std::vector<std::uint16_t> const& hk, std::vector<std::uint16_t> const& hv, cuda::tensor<cuda::bf16> const& q,
                   cuda::tensor<cuda::bf16> const& k, cuda::tensor<cuda::bf16> const& v, cuda::tensor<cuda::bf16>& o,
                   double own_ms, double copy_bw, double budget, std::size_t check_rows, int sms, cudaStream_t stream,
                   double* ms_out) {
  *ms_out = std::numeric_limits<double>::infinity();
  forward_launch f;
  try {
    f = forward_launch_of(spec_at(s, tiles), s, sms);
  } catch (std::invalid_argument const& e) {
    fmt::print("| ↳ tiles {}: does not fit ({}) | | | | | | | | | | | |\n", describe(tiles, s.d), e.what());
    return true;
  }
  cuda::forward_args const a = args_of(s, q, k, v, o);
  auto run = [&] {
    if (f.rows > 0)
      cuda::launch_split(f.split.front(), a, f.rows, stream);
    else
      cuda::launch(f.one, a, stream);
  };
  int reps = 0;
  double const ms = time_within(run, budget, 50, stream, &reps);
  cuda::options at = bf16;
  at.tiles = tiles;
  double const err = forward_error(s, hq, hk, hv, o, at, check_rows);
  bool const ok = err <= std::ldexp(1.0, -8);
  double const flops = 4.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d) * double(s.d);
  double const gbs = 2.0 * 4.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d) / (ms * 1e-3) / 1e9;
  fmt::print("| ↳ tiles {} ({} block(s) per (batch, head), {:.1f} KiB{}): {:.2f}× lina's choice "
             "| | | | {} | {} | {} | {:.3f} | {:.2f} | {:.0f} | {:.1f} % | {:.1e} {} |\n",
             describe(tiles, s.d), f.one.m_tiles, f.one.shared_bytes() / 1024.0,
             f.rows > 0 ? fmt::format(", split into groups of {} rows", f.rows) : std::string(), own_ms / ms,
             f.rows > 0 ? f.split.front().scan.kernel_name : f.one.kernel_name, f.one.tiles.chunk, reps, ms,
             flops / (ms * 1e-3) / 1e12, gbs, 100.0 * gbs / copy_bw, err, ok ? "ok" : "**MISMATCH**");
  std::fflush(stdout);
  if (ok) *ms_out = ms;
  return ok;
}

// The schedules of --tiles that give a shape other tiles than lina's own and
// than one another (an M tile past M is M), in their order; those that do not
// fit are kept (their row says so).
std::vector<cuda::tile_request> distinct_schedules(shape const& s, std::vector<cuda::tile_request> const& tiles) {
  cuda::tile_config const own = cuda::program_of(spec_at(s)).tiles;
  // (compared as launched: an M tile past M is M, 0 threads are 256)
  auto launched = [&](cuda::tile_request t) {
    t.tile_m = std::min(t.tile_m, static_cast<int>(s.d));
    t.threads = t.threads > 0 ? t.threads : 256;
    return t;
  };
  std::vector<cuda::tile_request> seen = {launched({own.chunk, own.tile_m, false, own.threads})};
  std::vector<cuda::tile_request> r;
  for (auto const& t : tiles) {
    if (std::find(seen.begin(), seen.end(), launched(t)) != seen.end()) continue;
    seen.push_back(launched(t));
    r.push_back(t);
  }
  return r;
}

// The chunk lengths --tiles asks the backward to run at, other than lina's own
// for the shape (the backward holds every column of M: T alone is its schedule).
std::vector<cuda::tile_request> backward_chunks(shape const& s, std::vector<cuda::tile_request> const& tiles) {
  int own = 0;
  try {
    own = cuda::backward_program_of(spec_at(s)).tiles.chunk;
  } catch (std::invalid_argument const&) {
  }
  std::vector<cuda::tile_request> r;
  for (auto const& t : tiles) {
    cuda::tile_request const b{t.chunk, 0, t.prefetch, t.threads == 256 ? 0 : t.threads, t.groups};
    if ((t.chunk != own || t.prefetch || b.threads > 0 || b.groups > 0) && std::find(r.begin(), r.end(), b) == r.end())
      r.push_back(b);
  }
  return r;
}

// --compile-only: every kernel a run with these options would launch on a
// device of architecture `arch` with `sms` SMs, compiled through NVRTC's
// on-disk cache. No device needed.
// One shape's inputs (random bf16 in [-1, 1), seeds seed, seed + 1, seed + 2),
// on the host for the checks and on the device; o for the output.
struct shape_inputs {
  std::vector<std::uint16_t> hq, hk, hv;
  cuda::tensor<cuda::bf16> q, k, v, o;
};
shape_inputs random_inputs(shape const& s, std::uint64_t seed) {
  shape4 const sq{s.b, s.h, s.t, s.d};  // (M = D)
  std::size_t const n = s.b * s.h * s.t * s.d;
  shape_inputs in{random_bf16(n, seed), random_bf16(n, seed + 1), random_bf16(n, seed + 2), cuda::tensor<cuda::bf16>(sq),
            cuda::tensor<cuda::bf16>(sq), cuda::tensor<cuda::bf16>(sq), cuda::tensor<cuda::bf16>(sq)};
  check(cudaMemcpy(in.q.data(), in.hq.data(), in.q.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(in.k.data(), in.hk.data(), in.k.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(in.v.data(), in.hv.data(), in.v.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
  return in;
}

// --retention: one shape of the decayed plan, forward through evaluate_into
// and (unless --no-backward) its backward launched as cuda::gradient would,
// each checked against the emulation on the first rows of the last (batch,
// head) like the elu+1 rows; a table row each, and a tsv row keyed rB (fla's
// chunk_simple_gla writes the same key). True when both checks pass.
bool time_retention(shape const& s, std::uint64_t seed, bool backward, double budget, double copy_bw,
                    std::size_t check_rows, int sms, cudaStream_t stream, std::FILE* tsv) {
  shape_inputs in = random_inputs(s, seed);
  forward_launch const own = forward_launch_of(spec_at(s, {}, retention), s, sms);  // what evaluate_into launches
  int reps = 0;
  double const ms = time_within([&] { cuda::evaluate_into(retention, in.o.view(), stream, Q = in.q, K = in.k, V = in.v); },
                                budget, 50, stream, &reps);
  double const flops = 4.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d) * double(s.d);
  double const gbs = 2.0 * 4.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d) / (ms * 1e-3) / 1e9;
  double const err = forward_error(s, in.hq, in.hk, in.hv, in.o, bf16, check_rows, retention);
  bool ok = err <= std::ldexp(1.0, -8);
  fmt::print("| {} | {} | {} | {} | {}{} | {} | {} | {:.3f} | {:.2f} | {:.0f} | {:.1f} % | {:.1e} {} |\n", s.b, s.t, s.h, s.d,
             own.rows > 0 ? own.split.front().scan.kernel_name : own.one.kernel_name,
             own.rows > 0 ? fmt::format(" (split into groups of {} rows)", own.rows) : std::string(), own.one.tiles.chunk,
             reps, ms, flops / (ms * 1e-3) / 1e12, gbs, 100.0 * gbs / copy_bw, err, ok ? "ok" : "**MISMATCH**");
  std::fflush(stdout);
  double bwd_ms = 0;
  if (backward)
    ok = time_backward(s, {}, "↳ backward", in.hq, in.hk, in.hv, in.q, in.k, in.v, ms, copy_bw, budget, check_rows, sms,
                       stream, &bwd_ms, retention) &&
         ok;
  if (tsv) {
    if (backward)
      std::fprintf(tsv, "r%zu\t%zu\t%zu\t%zu\t%.6f\t%.6f\n", s.b, s.t, s.h, s.d, ms, bwd_ms);
    else
      std::fprintf(tsv, "r%zu\t%zu\t%zu\t%zu\t%.6f\n", s.b, s.t, s.h, s.d, ms);
  }
  return ok;
}

int compile_only(std::string const& arch, int sms, std::vector<shape> const& shapes, std::vector<cuda::tile_request> const& tiles,
                 bool backward, std::string const& decode, bool ablation, std::vector<pack> const& packs,
                 std::vector<shape> const& retentions) {
  std::vector<cuda::program> ps;
  auto forward = [&](forward_launch const& f) {
    ps.push_back(f.one);  // (timed beside a split)
    for (auto const& sp : f.split) ps.push_back(sp.partials), ps.push_back(sp.scan);
  };
  auto backward_at = [&](shape const& s, cuda::tile_request t) {
    backward_launch const b = backward_launch_of(spec_at(s, t), s, sms);
    ps.push_back(b.one);
    ps.insert(ps.end(), b.split.begin(), b.split.end());
  };
  for (shape const& s : shapes) {
    forward_launch const own = forward_launch_of(spec_at(s), s, sms);
    forward(own);
    if (backward) backward_at(s, {});
    if (ablation)
      for (auto const& [what, p] : ablation_variants(own.one)) ps.push_back(p);
    for (auto const& t : distinct_schedules(s, tiles)) try {
        forward(forward_launch_of(spec_at(s, t), s, sms));
      } catch (std::invalid_argument const&) {  // (does not fit: the run says so)
      }
    if (backward)
      for (auto const& t : backward_chunks(s, tiles)) try {
          backward_at(s, t);
        } catch (std::invalid_argument const&) {
        }
  }
  for (pack const& pk : packs) {  // one launch's program, and each sequence's own where it runs alone (a long one split)
    std::set<std::size_t> lengths;
    sequences const seqs = lengths_of(pk);
    for (std::size_t x = 0; x < seqs.count(); ++x) lengths.insert(seqs.length(x));
    for (std::size_t n : lengths) {
      if (n == 0) continue;
      shape const s{1, n, pk.h, pk.d};
      forward(forward_launch_of(spec_at(s), s, sms));
      if (backward) backward_at(s, {});
    }
  }
  for (shape const& s : retentions) {
    forward(forward_launch_of(spec_at(s, {}, retention), s, sms));
    if (backward) {
      backward_launch const b = backward_launch_of(spec_at(s, {}, retention), s, sms);
      ps.push_back(b.one);
      ps.insert(ps.end(), b.split.begin(), b.split.end());
    }
  }
  if (decode != "none") {  // cuda::recurrent: its prefill (a chained evaluation of the prompt), then its step kernel
    auto const [b, h, d] = parse_decode(decode);
    auto spec = spec_at({b, decode_warm, h, d});
    spec.chained = true;
    ps.push_back(cuda::program_of(spec));
    spec.step = true;
    ps.push_back(cuda::program_of(spec));
  }
  std::set<std::string> seen;
  std::vector<std::pair<std::string, std::string>> work;  // (source, kernel name)
  for (auto const& p : ps)
    if (std::string src = cuda::emit(p); seen.insert(src).second) work.emplace_back(std::move(src), p.kernel_name);
  auto const start = std::chrono::steady_clock::now();
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex print;
  auto compile_some = [&] {
    for (std::size_t i; (i = next++) < work.size();) try {
        cuda::compiled_kernel const k = cuda::compile_cached(work[i].first, work[i].second, arch);
        if (!k.log.empty()) {
          std::lock_guard lock(print);
          fmt::print(stderr, "cuda_forward: NVRTC's log for {}:\n{}\n", work[i].second, k.log);
        }
      } catch (std::exception const& e) {
        std::lock_guard lock(print);
        fmt::print(stderr, "cuda_forward: {}\n", e.what());
        failed = true;
      }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 1; t < std::max(1u, std::thread::hardware_concurrency()); ++t) threads.emplace_back(compile_some);
  compile_some();
  for (auto& t : threads) t.join();
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string const dir = cuda::cache_directory();
  cuda::cache_counts const c = cuda::cache_statistics();
  fmt::print("cuda_forward --compile-only {}: {} kernels for {} SMs, {} compiled and {} already in the cache {} ({:.1f} s)\n",
             arch, work.size(), sms, c.compiled, c.hits, dir.empty() ? std::string("(off: LINA_CUDA_CACHE=off)") : dir, secs);
  return failed || dir.empty() ? 1 : 0;
}

constexpr char const* usage =
    "cuda_forward [--shapes BxTxHxD,…] [--decode BxHxD|none] [--packed SxLxHxD,…|none] [--retention BxTxHxD,…|none] [--no-backward] [--budget seconds per shape] [--tsv file] "
    "[--check-rows n] [--copy-mib m] [--ablate] [--tiles TxTM[p][sG][/N],…] [--compile-only sm_XY [--sms n]]";

int main(int argc, char** argv) {
  std::vector<shape> shapes = {{1, 8192, 96, 128}, {2, 16384, 16, 128}, {8, 2048, 32, 64}, {8, 1024, 8, 64}};
  double budget = 6.0;  // seconds of timed launches per shape, at most
  std::string tsv;
  std::size_t check_rows = 2048, copy_mib = 2048;
  bool ablation = false;
  std::string decode = "64x32x128";
  std::string packed = "512x64x16x64,32x1024x16x128,4x8192x16x128";
  std::vector<shape> retentions = {{1, 8192, 96, 128}, {8, 2048, 32, 64}};
  bool backward = true;
  std::vector<cuda::tile_request> tiles =
      parse_tiles("64x64p,32x64,64x128,32x128,32x128p,16x128,64x128/512,64x64s4,64x64s16,32x128s8");  // (lina's own at D = 64, 128: 64x64/256)
  std::string compile_arch;
  int sms_given = 132;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string_view a = argv[i];
      auto value = [&]() -> std::string_view {
        if (i + 1 >= argc) throw std::invalid_argument(fmt::format("cuda_forward: {} needs a value", a));
        return argv[++i];
      };
      if (a == "--help") {
        fmt::print("usage: {}\n", usage);
        return 0;
      }
      if (a == "--shapes")
        shapes = parse_shapes(value());
      else if (a == "--decode")
        decode = value();
      else if (a == "--packed")
        packed = value();
      else if (a == "--retention")
        retentions = value() == std::string_view("none") ? std::vector<shape>{} : parse_shapes(argv[i]);
      else if (a == "--no-backward")
        backward = false;
      else if (a == "--budget")
        budget = std::stod(std::string(value()));
      else if (a == "--tsv")
        tsv = value();
      else if (a == "--check-rows")
        check_rows = std::stoul(std::string(value()));
      else if (a == "--copy-mib")
        copy_mib = std::stoul(std::string(value()));
      else if (a == "--ablate")
        ablation = true;
      else if (a == "--tiles")
        tiles = value() == std::string_view("none") ? std::vector<cuda::tile_request>{} : parse_tiles(argv[i]);
      else if (a == "--compile-only")
        compile_arch = value();
      else if (a == "--sms")
        sms_given = std::stoi(std::string(value()));
      else
        throw std::invalid_argument(fmt::format("cuda_forward: unknown argument {}; usage: {}", a, usage));
    }
  } catch (std::exception const& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  std::vector<pack> packs;
  try {
    packs = parse_packs(packed);
  } catch (std::exception const& e) {
    fmt::print(stderr, "cuda_forward: --packed is SxLxHxD (S sequences of mean length L), e.g. 512x64x16x64, or none: {}\n",
               e.what());
    return 1;
  }
  if (!compile_arch.empty()) try {
      return compile_only(compile_arch, sms_given, shapes, tiles, backward, decode, ablation, packs, retentions);
    } catch (std::exception const& e) {
      fmt::print(stderr, "cuda_forward --compile-only: {}\n", e.what());
      return 1;
    }

  cuda::device_status dev = cuda::probe_device();
  if (!dev.available) {
    fmt::print(stderr, "cuda_forward: {}\n",
               dev.count == 0 ? "no CUDA device (" + dev.reason + ")" : dev.reason);
    return 2;
  }

  int failures = 0;
  try {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, dev.device), "cudaGetDeviceProperties");
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

    fmt::print("## CUDA forward: causal elu+1, normalised, bf16 in and out, fp32 state\n\n");
    fmt::print("device {}: {} ({}, {} SMs, {:.0f} GiB), driver {}.{}, runtime {}.{}\n\n", dev.device, prop.name, dev.arch,
               prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1ull << 30), driver / 1000,
               driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    double copy_ms = 0;
    double const copy_bw = copy_gbytes(copy_mib << 20, stream, &copy_ms);
    fmt::print("reference: cudaMemcpyAsync device→device of {} MiB, median {:.3f} ms: {:.0f} GB/s (bytes read + written)\n\n",
               copy_mib, copy_ms, copy_bw);
    fmt::print("| B | T | H | D = M | kernel | T chunk | reps | median ms | TFLOP/s | GB/s (q,k,v read, o written) | of copy | check (rel. RMS vs emulation) |\n");
    fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::FILE* out = tsv.empty() ? nullptr : std::fopen(tsv.c_str(), "w");
    if (!tsv.empty() && !out) throw std::runtime_error("cuda_forward: cannot write " + tsv);
    auto inputs_at = [&](std::size_t x) { return random_inputs(shapes[x], 3 * x + 1); };  // the x-th shape's
    int const sms = prop.multiProcessorCount;
    std::vector<double> own_ms(shapes.size()), own_bwd_ms(shapes.size());
    for (std::size_t x = 0; x < shapes.size(); ++x) {
      shape const& s = shapes[x];
      std::size_t const m = s.d, nq = s.b * s.h * s.t * s.d, nv = nq;
      auto [hq, hk, hv, q, k, v, o] = inputs_at(x);
      forward_launch const own = forward_launch_of(spec_at(s), s, sms);  // what evaluate_into launches
      cuda::program const& program = own.one;
      auto launch = [&] { cuda::evaluate_into(plan, o.view(), stream, Q = q, K = k, V = v); };

      int reps = 0;
      double const ms = time_within(launch, budget, 50, stream, &reps);
      double const flops = 4.0 * double(s.b) * double(s.h) * double(s.t) * double(s.d) * double(m);
      double const bytes = 2.0 * (2.0 * double(nq) + 2.0 * double(nv));  // q, k, v read, o written, bf16
      double const gbs = bytes / (ms * 1e-3) / 1e9;
      double const err = forward_error(s, hq, hk, hv, o, bf16, check_rows);
      bool const ok = err <= std::ldexp(1.0, -8);  // the tests' bf16 tolerance
      failures += ok ? 0 : 1;

      fmt::print("| {} | {} | {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {:.0f} | {:.1f} % | {:.1e} {} |\n", s.b, s.t, s.h,
                 s.d, program.kernel_name, program.tiles.chunk, reps, ms, flops / (ms * 1e-3) / 1e12, gbs,
                 100.0 * gbs / copy_bw, err, ok ? "ok" : "**MISMATCH**");
      std::fflush(stdout);
      // Split along N (the chunk-parallel form) where evaluate_into chose to: the one-pass kernel beside it.
      if (own.rows > 0) {
        cuda::forward_args const a = args_of(s, q, k, v, o);
        double const one_ms = time_launches([&] { cuda::launch(program, a, stream); }, std::min(reps, 20), stream);
        fmt::print("| ↳ above: split into groups of {} rows (two launches); one pass | | | | {} | {} | {} | {:.3f} | {:.2f} | | | |\n",
                   own.rows, program.kernel_name, program.tiles.chunk, std::min(reps, 20), one_ms,
                   flops / (one_ms * 1e-3) / 1e12);
      }
      double bwd_ms = 0;
      if (backward) {
        bool const bwd_ok = time_backward(s, {}, "↳ backward", hq, hk, hv, q, k, v, ms, copy_bw, budget, check_rows, sms,
                                          stream, &bwd_ms);
        failures += bwd_ok ? 0 : 1;
      }
      own_ms[x] = ms, own_bwd_ms[x] = bwd_ms;
      if (out) {
        if (backward)
          std::fprintf(out, "%zu\t%zu\t%zu\t%zu\t%.6f\t%.6f\n", s.b, s.t, s.h, s.d, ms, bwd_ms);
        else
          std::fprintf(out, "%zu\t%zu\t%zu\t%zu\t%.6f\n", s.b, s.t, s.h, s.d, ms);
      }
      if (ablation) {
        cuda::forward_args const a = args_of(s, q, k, v, o);
        ablate(program, a, ms, std::min(reps, 20), stream);
        fmt::print("\n");
      }
    }
    if (decode != "none") failures += decode_steps(decode, budget, copy_bw, stream, out) ? 0 : 1;
    if (!packs.empty()) {
      fmt::print("\n## Packed sequences (fla's cu_seqlens): S sequences of mean length L end to end, bf16 [1, H, ΣN, D], "
                 "causal elu+1\n\n");
      fmt::print("| S | L (mean) | ΣN | H | D = M | launches | reps | median ms | TFLOP/s | GB/s (q,k,v read, o written) | "
                 "of copy | one by one ms (its time / packed) | cuda::gradient ms | gradient_into ms | check (rel. RMS vs "
                 "emulation) |\n");
      fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
      for (pack const& pk : packs) try {  // (a pack that fails leaves the schedules' table below to run)
          failures += time_packed(pk, backward, budget / 2, copy_bw, std::min<std::size_t>(check_rows, 512), sms, stream, out) ? 0 : 1;
        } catch (std::exception const& e) {
          fmt::print("| {} | {} | | {} | {} | failed: {} | | | | | | | | | |\n", pk.s, pk.l, pk.h, pk.d, e.what());
          ++failures;
          cudaGetLastError();  // (a launch error is sticky only when the context is lost)
        }
    }
    if (!retentions.empty()) {
      fmt::print("\n## Retention: causal(Q·Kᵀ, decay{{{}}})·V, bf16 in and out, fp32 state (fla: chunk_simple_gla, the same "
                 "g_gamma on every head)\n\n",
                 retention_decay);
      fmt::print("| B | T | H | D = M | kernel | T chunk | reps | median ms | TFLOP/s | GB/s (q,k,v read, o written) | of copy | "
                 "check (rel. RMS vs emulation) |\n");
      fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
      for (std::size_t x = 0; x < retentions.size(); ++x) try {
          failures += time_retention(retentions[x], 1000 + 3 * x, backward, budget, copy_bw, check_rows, sms, stream, out) ? 0 : 1;
        } catch (std::exception const& e) {  // (the schedules' table below still runs)
          shape const& s = retentions[x];
          fmt::print("| {} | {} | {} | {} | failed: {} | | | | | | | |\n", s.b, s.t, s.h, s.d, e.what());
          ++failures;
          cudaGetLastError();
        }
    }
    // --tiles, after what the issues ask for: the same forward (and backward) at
    // other schedules, a sixth of the budget each, against lina's choice above.
    if (!tiles.empty()) {
      fmt::print("\n## Schedules (--tiles): the rows above at other tiles\n\n");
      fmt::print("| B | T | H | D = M | kernel | T chunk | reps | median ms | TFLOP/s | GB/s (q,k,v read, o written) | of copy | check (rel. RMS vs emulation at the same tiles) |\n");
      fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
      std::size_t const sweep_rows = std::min<std::size_t>(check_rows, 512);
      for (std::size_t x = 0; x < shapes.size(); ++x) {
        shape const& s = shapes[x];
        auto [hq, hk, hv, q, k, v, o] = inputs_at(x);
        fmt::print("| {} | {} | {} | {} | lina's choice: {:.3f} ms{} | | | | | | | |\n", s.b, s.t, s.h, s.d, own_ms[x],
                   backward ? fmt::format(", backward {:.3f} ms", own_bwd_ms[x]) : std::string());
        double best_ms = own_ms[x];
        std::string best = "lina's choice";
        for (auto const& t : distinct_schedules(s, tiles)) {
          double ms = 0;
          failures += time_schedule(s, t, hq, hk, hv, q, k, v, o, own_ms[x], copy_bw, budget / 6, sweep_rows, sms, stream, &ms)
                          ? 0
                          : 1;
          if (ms < best_ms) best_ms = ms, best = describe(t, s.d);
        }
        fmt::print("| ↳ fastest forward: {} ({:.3f} ms, {:.2f}× lina's choice) | | | | | | | | | | | |\n", best, best_ms,
                   own_ms[x] / best_ms);
        if (backward)
          for (auto const& t : backward_chunks(s, tiles)) {
            double other_ms = 0;
            std::string const label = "↳ backward at " + describe(t, s.d);
            failures += time_backward(s, t, label, hq, hk, hv, q, k, v, own_ms[x], copy_bw, budget / 6, sweep_rows, sms,
                                      stream, &other_ms)
                            ? 0
                            : 1;
          }
      }
    }
    cuda::cache_counts const c = cuda::cache_statistics();
    fmt::print("\nNVRTC: {} kernels read from the on-disk cache, {} compiled in this run (first launches)\n", c.hits,
               c.compiled);
    if (out) std::fclose(out);
    cudaStreamDestroy(stream);
  } catch (std::exception const& e) {
    fmt::print(stderr, "cuda_forward: {}\n", e.what());
    return 1;
  }
  if (failures) fmt::print(stderr, "cuda_forward: {} shape(s) disagree with the emulation\n", failures);
  return failures ? 1 : 0;
}
