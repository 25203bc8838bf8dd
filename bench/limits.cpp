// The CPU issue's remaining checks, measured (never timed tests):
//   - a recurrent step against the per-token time of the chunked forward
//     (causal elu+1, fp32, B = 1, H = 8, D = M = 64, N = 4096 tokens), and
//     the same steps after a prefill of 8192 tokens;
//   - accuracy of a long sequence: fp32 against fp64 at N = 2^20, D = M = 16,
//     relative RMS error, both from the same (fp32-rounded) inputs, in one call,
//     in blocks chained through a state and in recurrent steps;
//   - subnormal and NaN inputs against normal ones (B·H = 8, N = 16384, D = 64);
//   - where the CUDA backend is built (LINA_LIMITS_CUDA), the same long sequence
//     through its kernels' host emulation (no GPU needed): one call, blocks of
//     1024, the gradients and decoding steps.
//
//   limits
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#ifdef LINA_LIMITS_CUDA
#include <lina/cuda.hpp>
#endif

#include "probes.hpp"

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);

template <class T>
tensor_view<T const> token(tensor<T> const& t, std::size_t i) {
  return t.rows(i, 1);
}

void step_against_forward() {
  std::size_t n = 4096, h = 8, d = 64;
  auto q = tensor<float>::random({1, h, n, d}, 1), k = tensor<float>::random({1, h, n, d}, 2);
  auto v = tensor<float>::random({1, h, n, d}, 3);
  tensor<float> out({1, h, n, d});
  double fwd = bench::best_seconds([&] { cpu::evaluate_into(plan, out.view(), Q = q, K = k, V = v); }, 7);
  auto rnn = cpu::recurrent<float>(plan, 1, h);
  tensor<float> y({1, h, 1, d});
  double steps = bench::best_seconds([&] {
    rnn.reset();
    for (std::size_t i = 0; i < n; ++i) rnn.step_into(y.view(), Q = token(q, i), K = token(k, i), V = token(v, i));
  }, 3);
  fmt::print("recurrent step, B1 H8 D=M=64: {:.2f} us per token; chunked forward over N = {}: {:.2f} us per token; "
             "step / forward = {:.1f}x\n", 1e6 * steps / n, n, 1e6 * fwd / n, steps / fwd);
  // the same steps after a prefill of 2n tokens (past two_level_rows: two-level steps)
  cpu::state<float> prefill;
  tensor<float> out2({1, h, 2 * n, d});
  auto q2 = tensor<float>::random({1, h, 2 * n, d}, 10);
  cpu::evaluate_into(plan, out2.view(), prefill, Q = q2, K = q2, V = q2);
  double late = bench::best_seconds([&] {
    rnn.set_state(prefill);
    for (std::size_t i = 0; i < n; ++i) rnn.step_into(y.view(), Q = token(q, i), K = token(k, i), V = token(v, i));
  }, 3);
  fmt::print("  the same steps after {} tokens: {:.2f} us per token\n", 2 * n, 1e6 * late / n);
}

void long_sequence_accuracy() {
  std::size_t n = std::size_t(1) << 20, d = 16;
  auto qf = tensor<float>::random({1, 1, n, d}, 4), kf = tensor<float>::random({1, 1, n, d}, 5);
  auto vf = tensor<float>::random({1, 1, n, d}, 6);
  tensor<double> qd({1, 1, n, d}), kd({1, 1, n, d}), vd({1, 1, n, d});
  for (std::size_t i = 0; i < qf.size(); ++i) {
    qd.data()[i] = qf.data()[i];
    kd.data()[i] = kf.data()[i];
    vd.data()[i] = vf.data()[i];
  }
  auto of = cpu::evaluate(plan, Q = qf, K = kf, V = vf);
  auto od = cpu::evaluate(plan, Q = qd, K = kd, V = vd);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < od.size(); ++i) {
    double e = of.data()[i] - od.data()[i];
    num += e * e;
    den += od.data()[i] * od.data()[i];
  }
  fmt::print("N = 2^20, D = M = 16: fp32 relative RMS error against fp64 {:.2e}\n", std::sqrt(num / den));
  // the same sequence in blocks chained through a state (a prefill in blocks)
  for (std::size_t blk : {std::size_t(1024), std::size_t(4096)}) {
    tensor<float> chained({1, 1, n, d});
    cpu::state<float> st;
    for (std::size_t r = 0; r < n; r += blk)
      cpu::evaluate_into(plan, chained.rows(r, blk), st, Q = qf.rows(r, blk), K = kf.rows(r, blk), V = vf.rows(r, blk));
    num = 0;
    for (std::size_t i = 0; i < od.size(); ++i) {
      double e = chained.data()[i] - od.data()[i];
      num += e * e;
    }
    fmt::print("  in blocks of {} chained through a state: {:.2e}\n", blk, std::sqrt(num / den));
  }
  // and token by token (recurrent steps: one row a call, summed in one level)
  tensor<float> stepped({1, 1, n, d});
  auto rnn = cpu::recurrent<float>(plan, 1, 1);
  for (std::size_t t = 0; t < n; ++t)
    rnn.step_into(stepped.rows(t, 1), Q = qf.rows(t, 1), K = kf.rows(t, 1), V = vf.rows(t, 1));
  num = 0;
  for (std::size_t i = 0; i < od.size(); ++i) {
    double e = stepped.data()[i] - od.data()[i];
    num += e * e;
  }
  fmt::print("  in recurrent steps: {:.2e}\n", std::sqrt(num / den));
#ifdef LINA_LIMITS_CUDA
  // The CUDA kernels (fp32 in and out), emulated on the host, against the same fp64 result.
  auto error = [](auto const& got, auto const& want) {
    double n2 = 0, d2 = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      double e = got.data()[i] - want.data()[i];
      n2 += e * e;
      d2 += want.data()[i] * want.data()[i];
    }
    return std::sqrt(n2 / d2);
  };
  cuda::options const opt{cuda::dtype::f32, cuda::dtype::f32};
  tensor<float> blocks({1, 1, n, d}), steps({1, 1, n, d});
  cuda::state st(cuda::memory::host);
  for (std::size_t r = 0; r < n; r += 1024)
    cuda::emulate_into(plan, opt, blocks.rows(r, 1024), st, Q = qf.rows(r, 1024), K = kf.rows(r, 1024), V = vf.rows(r, 1024));
  auto crnn = cuda::recurrent(plan, 1, 1, opt, cuda::memory::host);
  for (std::size_t t = 0; t < n; ++t)
    crnn.step_into(steps.rows(t, 1), Q = qf.rows(t, 1), K = kf.rows(t, 1), V = vf.rows(t, 1));
  fmt::print("  the CUDA kernels, emulated: in one call {:.2e}, in blocks of 1024 {:.2e}, in decoding steps {:.2e}\n",
             error(cuda::emulate(plan, opt, Q = qf, K = kf, V = vf), od), error(blocks, od), error(steps, od));
  auto df = tensor<float>::random({1, 1, n, d}, 11);
  tensor<double> dd({1, 1, n, d});
  std::copy(df.data(), df.data() + df.size(), dd.data());
  auto gd = cpu::gradient(plan, dd, Q = qd, K = kd, V = vd);
  auto gf = cpu::gradient(plan, df, Q = qf, K = kf, V = vf);
  auto gc = cuda::emulate_gradient(plan, opt, df, Q = qf, K = kf, V = vf);
  fmt::print("  gradients ∂Q, ∂K, ∂V: the CPU's {:.2e} {:.2e} {:.2e}, the CUDA kernels' (emulated) {:.2e} {:.2e} {:.2e}\n",
             error(gf[Q], gd[Q]), error(gf[K], gd[K]), error(gf[V], gd[V]), error(gc[Q], gd[Q]), error(gc[K], gd[K]),
             error(gc[V], gd[V]));
#endif
}

void subnormals_and_nan() {
  std::size_t n = 16384, h = 8, d = 64;
  auto q = tensor<float>::random({1, h, n, d}, 7), k = tensor<float>::random({1, h, n, d}, 8);
  auto v = tensor<float>::random({1, h, n, d}, 9);
  tensor<float> out({1, h, n, d});
  auto time = [&](tensor<float> const& qq, tensor<float> const& kk, tensor<float> const& vv) {
    return bench::best_seconds([&] { cpu::evaluate_into(plan, out.view(), Q = qq, K = kk, V = vv); }, 5);
  };
  double normal = time(q, k, v);
  auto v_sub = v;
  for (std::size_t i = 0; i < v_sub.size(); ++i) v_sub.data()[i] *= 1e-39f;  // every value subnormal
  auto q_sub = q;
  for (std::size_t i = 0; i < q_sub.size(); ++i) q_sub.data()[i] = -90.f - std::abs(q_sub.data()[i]);  // φ = e^x subnormal
  auto k_nan = k;
  k_nan.data()[12345] = std::numeric_limits<float>::quiet_NaN();
  fmt::print("subnormal V: {:.2f}x the normal time; subnormal φ(Q): {:.2f}x; a NaN in K: {:.2f}x (normal {:.2f} ms)\n",
             time(q, k, v_sub) / normal, time(q_sub, k, v) / normal, time(q, k_nan, v) / normal, 1e3 * normal);
}
}  // namespace

int main() {
  step_against_forward();
  long_sequence_accuracy();
  subnormals_and_nan();
}
