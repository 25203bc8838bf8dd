// Peak extra memory and time of the derived backward against N: the linear
// plan (prefix/suffix scans) and the quadratic plan (N x N), causal elu+1
// attention, B = 1, H = 2, D = M = 64, float. Extra memory is what the CPU
// backend allocates beyond inputs, dout and gradients (cpu::memory().peak),
// including the workspace it keeps for the next call.
//
//   backward [--max-n 65536] [--quadratic-max-n 4096]  (or --rate, --maps, --favor, --softmax, --chained)
//
// --rate instead times the linear backward into the caller's buffers
// (cpu::gradient_into, no fresh tensors to first-touch) at B = 1, H = 8 and
// N = 4096, 16384: best of R calls (--reps R, default 30 and a quarter of that
// at 16384), GFLOP/s by the suite's count (8·H·N·D·M) and its forward's;
// then the same forward keeping its values in a cpu::tape and the backward
// reading them, and how much faster a training step (forward + backward) is so.
// --maps times the forward and backward of the element-wise maps (elu+1, relu,
// identity, and relu written with nested selects) at N = 4096, and --favor those of FAVOR+ and random Fourier
// features (m = 64), through a tape too.
// --softmax times causal softmax attention, normalize(causal(exp(Q Kᵀ/8))) V
// (quadratic), forward and backward into reused buffers at B = 1, H = 8,
// N = 1024 and 2048 (the forward alone at 4096 and 8192), GFLOP/s by the
// products it runs (forward 2·H·N²·(D + M + 1): Q Kᵀ and E·[V|1] in full, the
// mask applied after; the backward twice that), and the forward's extra memory.
// --chained times a training step over one sequence of N = 16384 in four
// blocks of 4096 (as truncated backpropagation runs it): each block's forward
// through the state, then the blocks' backward last first, each handing ∂ of
// its initial state to the one before; without tapes, then with one per block.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 64>;
constexpr auto M = dim<"M", 64>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

// The fastest of `reps` calls of f, in milliseconds.
template <class F>
double best_ms(int reps, F&& f) {
  double b = 1e300;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    b = std::min(b, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return b;
}

struct result {
  double fwd_ms, bwd_ms;
  std::size_t peak;
};

template <class Plan>
result measure(Plan const& plan, std::size_t n) {
  std::size_t heads = 2;
  auto q = tensor<float>::random({1, heads, n, 64}, 1), k = tensor<float>::random({1, heads, n, 64}, 2);
  auto v = tensor<float>::random({1, heads, n, 64}, 3), dout = tensor<float>::random({1, heads, n, 64}, 4);
  auto best = [](auto&& f) { return best_ms(3, f); };
  double fwd = best([&] { auto o = cpu::evaluate(plan, Q = q, K = k, V = v); });
  // Finished calls keep their workspaces for the next ones, and those count as
  // live memory: without this, the peak would include what the forward and the
  // previous lengths (the quadratic plan's N x N matrices) left cached.
  cpu::release_cached_memory();
  cpu::memory().reset();
  double bwd = best([&] { auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v); });
  return {fwd, bwd, cpu::memory().peak.load()};
}

// Inputs and dout at B = 1, H = 8, N = n, D = M = 64 (fixed seeds).
struct io {
  std::size_t heads = 8;
  tensor<float> q, k, v, dout;
  explicit io(std::size_t n)
      : q(tensor<float>::random({1, 8, n, 64}, 1)), k(tensor<float>::random({1, 8, n, 64}, 2)),
        v(tensor<float>::random({1, 8, n, 64}, 3)), dout(tensor<float>::random({1, 8, n, 64}, 4)) {}
};
// A first backward's gradients, and views of ∂Q, ∂K, ∂V in them for
// gradient_into (a plan's other inputs: the caller's to add).
template <class Plan, class... B>
auto gradient_buffers(Plan const& plan, tensor<float> const& dout, B const&... in) {
  auto g = std::make_unique<decltype(cpu::gradient(plan, dout, in...))>(cpu::gradient(plan, dout, in...));
  auto into = cpu::gradient_views<float>(plan);
  into[Q] = (*g)[Q].view();
  into[K] = (*g)[K].view();
  into[V] = (*g)[V].view();
  return std::pair{std::move(g), into};
}

// The backward into reused buffers, and the forward, at B = 1, H = 8, N = n.
void rate(std::size_t n, int reps) {
  auto plan = compile<order::linear>(attn);
  io x(n);
  auto buffers = gradient_buffers(plan, x.dout, Q = x.q, K = x.k, V = x.v);
  auto& into = buffers.second;  // (not a structured binding: Clang 14 captures none in lambdas)
  auto &q = x.q, &k = x.k, &v = x.v, &dout = x.dout;
  std::size_t const heads = x.heads;
  auto o = cpu::evaluate(plan, Q = q, K = k, V = v);
  cpu::tape<float> tp;
  double bwd = best_ms(reps, [&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v); });
  double fwd = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), Q = q, K = k, V = v); });
  double fwd_tape = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), tp, Q = q, K = k, V = v); });
  double bwd_tape = best_ms(reps, [&] { cpu::gradient_into(plan, into, tp, dout, Q = q, K = k, V = v); });
  double flops = 4.0 * double(heads) * double(n) * 64 * 64;  // the forward's; the backward counts twice that
  fmt::print("{:>6} | {:>9.2f} {:>8.1f} | {:>9.2f} {:>8.1f} | {:>9.2f} {:>9.2f} {:>8.1f} | {:>6.2f}x\n", n, bwd,
             2 * flops / bwd / 1e6, fwd, flops / fwd / 1e6, fwd_tape, bwd_tape, 2 * flops / bwd_tape / 1e6,
             (fwd + bwd) / (fwd_tape + bwd_tape));
}
// relu as a user might write it, its derivative as three nested selects
// (lina's relu until 94744f5): the row passes' code at -O3 (each_lane).
struct nested_relu {
  static constexpr std::string_view name = "relu3";
  template <class T>
  static constexpr T value(T x) {
    return x < T(0) ? T(0) : x;
  }
  template <class T>
  static constexpr T derivative(T x) {
    return x < T(0) ? T(0) : (x > T(0) ? T(1) : (x == T(0) ? T(0) : x));
  }
};
// The causal normalised plan with element-wise map Map at B = 1, H = 8,
// N = n: the forward and the backward into reused buffers, best of reps.
template <class Map>
void rate_map(std::size_t n, int reps) {
  auto plan = compile<order::linear>(normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)))) * V);
  io x(n);
  auto buffers = gradient_buffers(plan, x.dout, Q = x.q, K = x.k, V = x.v);
  auto& into = buffers.second;
  auto &q = x.q, &k = x.k, &v = x.v, &dout = x.dout;
  auto o = cpu::evaluate(plan, Q = q, K = k, V = v);
  double fwd = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), Q = q, K = k, V = v); });
  double bwd = best_ms(reps, [&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v); });
  fmt::print("{:>6} {:>6} | {:>9.2f} {:>9.2f}\n", Map::name, n, fwd, bwd);
}
// Causal softmax at B = 1, H = 8, N = n: forward and backward into reused
// buffers (the backward up to N = backward_max), and the extra memory of each
// (cpu::memory().peak of a first call, nothing cached before it).
void rate_softmax(std::size_t n, int reps, std::size_t backward_max) {
  auto plan = compile(normalize(causal(exp(Q * transpose(K) * 0.125))) * V);
  io x(n);
  auto &q = x.q, &k = x.k, &v = x.v, &dout = x.dout;
  std::size_t const heads = x.heads;
  tensor<float> o({1, heads, n, 64});
  cpu::release_cached_memory();
  cpu::memory().reset();
  cpu::evaluate_into(plan, o.view(), Q = q, K = k, V = v);
  double const mib = double(cpu::memory().peak) / (1 << 20);
  double fwd = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), Q = q, K = k, V = v); });
  double flops = 2.0 * double(heads) * double(n) * double(n) * (64 + 65);
  if (n > backward_max) {
    fmt::print("{:>6} | {:>9.2f} {:>8.1f} {:>9.1f} | {:>9} {:>8}\n", n, fwd, flops / fwd / 1e6, mib, "-", "-");
    return;
  }
  auto buffers = gradient_buffers(plan, dout, Q = q, K = k, V = v);
  auto& into = buffers.second;  // (not a structured binding: Clang 14 captures none in lambdas)
  cpu::release_cached_memory();
  cpu::memory().reset();
  cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v);
  double const bwd_mib = double(cpu::memory().peak) / (1 << 20);
  double bwd = best_ms(reps, [&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v); });
  fmt::print("{:>6} | {:>9.2f} {:>8.1f} {:>9.1f} | {:>9.2f} {:>8.1f} {:>9.1f}\n", n, fwd, flops / fwd / 1e6, mib, bwd,
             2 * flops / bwd / 1e6, bwd_mib);
}
// FAVOR+ (m = 64 random features of D = 64; normalised) and random Fourier
// features (m = 64, 128 features; signed, so unnormalised) at B = 1, H = 8,
// N = n: the forward, the backward into reused buffers (∂W included), and both
// through a tape.
constexpr auto F = dim<"F", 64>;
constexpr auto W = input<"W">(D, F);
template <class Map>
auto random_feature_plan() {
  auto scores = causal(phi<Map>(Q, W) * transpose(phi<Map>(K, W)));
  if constexpr (std::is_same_v<Map, favor>)
    return compile<order::linear>(normalize(scores) * V);
  else
    return compile<order::linear>(scores * V);
}
template <class Map>
void rate_favor(std::size_t n, int reps) {
  auto plan = random_feature_plan<Map>();
  io x(n);
  auto &q = x.q, &k = x.k, &v = x.v, &dout = x.dout;
  auto w = tensor<float>::random({1, x.heads, 64, 64}, 5);
  for (std::size_t i = 0; i < w.size(); ++i) w.data()[i] *= 0.125f;  // |w·x'| ~ 1
  auto buffers = gradient_buffers(plan, dout, Q = q, K = k, V = v, W = w);
  auto& into = buffers.second;
  into[W] = (*buffers.first)[W].view();
  auto o = cpu::evaluate(plan, Q = q, K = k, V = v, W = w);
  cpu::tape<float> tp;
  double fwd = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), Q = q, K = k, V = v, W = w); });
  double bwd = best_ms(reps, [&] { cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v, W = w); });
  double fwd_tape = best_ms(reps, [&] { cpu::evaluate_into(plan, o.view(), tp, Q = q, K = k, V = v, W = w); });
  double bwd_tape = best_ms(reps, [&] { cpu::gradient_into(plan, into, tp, dout, Q = q, K = k, V = v, W = w); });
  fmt::print("{:>6} {:>6} | {:>9.2f} {:>9.2f} | {:>9.2f} {:>9.2f} | {:>6.2f}x\n", Map::name, n, fwd, bwd, fwd_tape,
             bwd_tape, (fwd + bwd) / (fwd_tape + bwd_tape));
}
// A training step of `blocks` chained blocks of `rows` tokens at B = 1, H = 8:
// best of reps, without and with a tape per block.
void rate_chained(std::size_t blocks, std::size_t rows, int reps) {
  auto plan = compile<order::linear>(attn);
  std::size_t const heads = 8, n = blocks * rows;
  auto q = tensor<float>::random({1, heads, n, 64}, 1), k = tensor<float>::random({1, heads, n, 64}, 2);
  auto v = tensor<float>::random({1, heads, n, 64}, 3), dout = tensor<float>::random({1, heads, n, 64}, 4);
  tensor<float> o({1, heads, n, 64}), dq({1, heads, n, 64}), dk({1, heads, n, 64}), dv({1, heads, n, 64});
  std::vector<cpu::tape<float>> tapes(blocks);
  std::vector<cpu::state<float>> begin(blocks);
  // f(Q = block x of q, K = …, V = …)
  auto block = [&](std::size_t x, auto const& f) {
    return f(Q = q.rows(x * rows, rows), K = k.rows(x * rows, rows), V = v.rows(x * rows, rows));
  };
  auto step = [&](bool taped) {
    cpu::state<float> st, d_final;
    for (std::size_t x = 0; x < blocks; ++x) {
      begin[x] = st;
      auto const out = o.rows(x * rows, rows);
      if (taped)
        block(x, [&](auto const&... b) { cpu::evaluate_into(plan, out, st, tapes[x], b...); });
      else
        block(x, [&](auto const&... b) { cpu::evaluate_into(plan, out, st, b...); });
    }
    for (std::size_t x = blocks; x-- > 0;) {
      auto into = cpu::gradient_views<float>(plan);
      into[Q] = dq.rows(x * rows, rows);
      into[K] = dk.rows(x * rows, rows);
      into[V] = dv.rows(x * rows, rows);
      auto const d = dout.rows(x * rows, rows);
      d_final = block(x, [&](auto const&... b) {
        return taped ? cpu::gradient_into(plan, into, tapes[x], d, begin[x], d_final, b...)
                     : cpu::gradient_into(plan, into, d, begin[x], d_final, b...);
      });
    }
  };
  double plain = best_ms(reps, [&] { step(false); });
  double taped = best_ms(reps, [&] { step(true); });
  fmt::print("{:>6} | {:>6} | {:>9.2f} {:>9.2f} | {:>6.2f}x\n", n, blocks, plain, taped, plain / taped);
}
}  // namespace

int main(int argc, char** argv) {
  std::size_t max_n = 65536, quad_max = 4096;
  bool rates = false, favor_rates = false, chained = false, softmax = false, map_rates = false;
  int reps = 30;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rate")) rates = true;
    if (!std::strcmp(argv[i], "--favor")) favor_rates = true;
    if (!std::strcmp(argv[i], "--maps")) map_rates = true;
    if (!std::strcmp(argv[i], "--chained")) chained = true;
    if (!std::strcmp(argv[i], "--softmax")) softmax = true;
    if (i + 1 == argc) break;
    if (!std::strcmp(argv[i], "--max-n")) max_n = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--quadratic-max-n")) quad_max = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[i + 1]));
  }
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  if (chained) {
    fmt::print("causal elu+1 attention, B=1 H=8 D=M=64 float, {} threads: a training step in chained blocks\n", threads);
    fmt::print("{:>6} | {:>6} | {:>9} {:>9} | {:>7}\n", "N", "blocks", "step ms", "tapes ms", "faster");
    rate_chained(4, 4096, std::max(1, reps / 4));
    return 0;
  }
  if (softmax) {
    fmt::print("causal softmax attention (quadratic), B=1 H=8 D=M=64 float, {} threads, into reused buffers\n", threads);
    fmt::print("{:>6} | {:>9} {:>8} {:>9} | {:>9} {:>8} {:>9}\n", "N", "fwd ms", "GFLOP/s", "fwd MiB", "bwd ms",
               "GFLOP/s", "bwd MiB");
    rate_softmax(1024, reps, 4096);
    rate_softmax(2048, std::max(1, reps / 4), 4096);
    rate_softmax(4096, std::max(1, reps / 8), 4096);
    rate_softmax(8192, std::max(1, reps / 16), 4096);
    return 0;
  }
  if (map_rates) {
    fmt::print("causal normalised attention, B=1 H=8 D=M=64 float, {} threads, into reused buffers\n", threads);
    fmt::print("{:>6} {:>6} | {:>9} {:>9}\n", "map", "N", "fwd ms", "bwd ms");
    rate_map<elu_plus_one>(4096, reps);
    rate_map<relu>(4096, reps);
    rate_map<identity>(4096, reps);
    rate_map<nested_relu>(4096, reps);
    return 0;
  }
  if (favor_rates) {
    fmt::print("causal attention through random features (m = 64), B=1 H=8 D=M=64 float, {} threads, into reused "
               "buffers\n", threads);
    fmt::print("{:>6} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>7}\n", "map", "N", "fwd ms", "bwd ms", "fwd+tape",
               "bwd(tape)", "step");
    rate_favor<favor>(4096, reps);
    rate_favor<random_fourier>(4096, reps);
    return 0;
  }
  if (rates) {
    fmt::print("causal elu+1 attention, B=1 H=8 D=M=64 float, {} threads, into reused buffers\n", threads);
    fmt::print("{:>6} | {:>9} {:>8} | {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>7}\n", "N", "bwd ms", "GFLOP/s", "fwd ms",
               "GFLOP/s", "fwd+tape", "bwd(tape)", "GFLOP/s", "step");
    rate(4096, reps);
    rate(16384, std::max(1, reps / 4));
    return 0;
  }
  fmt::print("causal elu+1 attention, B=1 H=2 D=M=64 float, {} threads; peak = extra memory of the backward\n",
             threads);
  fmt::print("{:>6} | {:>9} {:>9} {:>10} {:>12} | {:>9} {:>10} {:>12}\n", "N", "lin fwd", "lin bwd", "peak MiB",
             "bytes/token", "quad bwd", "peak MiB", "bytes/token");
  auto lin = compile<order::linear>(attn);
  auto quad = compile<order::quadratic>(attn);
  for (std::size_t n = 1024; n <= max_n; n *= 2) {
    result l = measure(lin, n);
    fmt::print("{:>6} | {:>7.1f}ms {:>7.1f}ms {:>10.2f} {:>12.0f} |", n, l.fwd_ms, l.bwd_ms, l.peak / 1048576.0,
               double(l.peak) / double(n));
    if (n <= quad_max) {
      result qd = measure(quad, n);
      fmt::print(" {:>7.1f}ms {:>10.2f} {:>12.0f}\n", qd.bwd_ms, qd.peak / 1048576.0, double(qd.peak) / double(n));
    } else {
      fmt::print(" {:>9} {:>10} {:>12}\n", "-", "-", "-");
    }
  }
}
