// Packed sequences against padding: S sequences of random lengths (a fixed
// seed, uniform in [min, max]), causal elu+1 attention, H = 8, D = M = 64,
// float, forward and backward. Three ways to run the same batch:
//   packed  one call on [1, H, ΣN, D] with the offsets (cpu::evaluate(plan, seqs, ...))
//   padded  one call on [S, H, max N, D], the padding computed and thrown away
//   looped  one call per sequence on [1, H, N_s, D]
// Each time is the best of 5; "useful" counts the sequences' own tokens, and
// GFLOP/s the useful work (4·H·ΣN·D·M forward, 8·H·ΣN·D·M backward, as
// bench/suite), against the FMA peak measured at the start.
//
//   packed [--sequences 32] [--min 64] [--max 4096]
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <vector>

#include "probes.hpp"

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

template <class F>
double best_ms(F&& f) {
  using clock = std::chrono::steady_clock;
  double b = 1e300;
  for (int r = 0; r < 5; ++r) {
    auto t0 = clock::now();
    f();
    b = std::min(b, std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t count = 32, lo = 64, hi = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--sequences")) count = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--min")) lo = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--max")) hi = std::strtoull(argv[i + 1], nullptr, 10);
  }
  std::vector<std::size_t> lengths(count);
  std::uint64_t x = 12345;
  for (auto& n : lengths) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    n = lo + (x >> 33) % (hi - lo + 1);
  }
  auto const seqs = sequences::from_lengths(lengths);
  std::size_t const longest = *std::max_element(lengths.begin(), lengths.end()), h = 8;
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  fmt::print("causal elu+1 attention, H=8 D=M=64 float, {} threads; {} sequences of {}..{} tokens: {} tokens, "
             "padded to {} x {} = {} ({:.0f}% padding)\n",
             threads, count, lo, hi, seqs.total(), count, longest, count * longest,
             100.0 * (1.0 - double(seqs.total()) / double(count * longest)));

  double const peak = bench::fma_gflops<float>();
  fmt::print("FMA peak {:.1f} GFLOP/s fp32 (measured now); rates count useful tokens only\n", peak);
  auto const plan = compile(attn);
  auto q = tensor<float>::random({1, h, seqs.total(), 64}, 1), k = tensor<float>::random({1, h, seqs.total(), 64}, 2);
  auto v = tensor<float>::random({1, h, seqs.total(), 64}, 3), dout = tensor<float>::random({1, h, seqs.total(), 64}, 4);
  tensor<float> pq({count, h, longest, 64}), pk({count, h, longest, 64}), pv({count, h, longest, 64}),
      pd({count, h, longest, 64});
  for (std::size_t s = 0; s < count; ++s)
    for (std::size_t hh = 0; hh < h; ++hh)
      for (std::size_t n = 0; n < seqs.length(s); ++n)
        for (std::size_t c = 0; c < 64; ++c) {
          pq(s, hh, n, c) = q(0, hh, seqs.begin(s) + n, c);
          pk(s, hh, n, c) = k(0, hh, seqs.begin(s) + n, c);
          pv(s, hh, n, c) = v(0, hh, seqs.begin(s) + n, c);
          pd(s, hh, n, c) = dout(0, hh, seqs.begin(s) + n, c);
        }

  tensor<float> out({1, h, seqs.total(), 64}), pout({count, h, longest, 64});
  double const packed_f = best_ms([&] { cpu::evaluate_into(plan, out.view(), seqs, Q = q, K = k, V = v); });
  double const padded_f = best_ms([&] { cpu::evaluate_into(plan, pout.view(), Q = pq, K = pk, V = pv); });
  double const looped_f = best_ms([&] {
    for (std::size_t s = 0; s < count; ++s) {
      std::size_t const at = seqs.begin(s), n = seqs.length(s);
      cpu::evaluate_into(plan, out.rows(at, n), Q = q.rows(at, n), K = k.rows(at, n), V = v.rows(at, n));
    }
  });
  double const packed_b = best_ms([&] { auto g = cpu::gradient(plan, dout, seqs, Q = q, K = k, V = v); });
  double const padded_b = best_ms([&] { auto g = cpu::gradient(plan, pd, Q = pq, K = pk, V = pv); });
  double const tokens = double(seqs.total()), flops = 4.0 * double(h) * tokens * 64 * 64;
  auto line = [&](char const* what, double f, double b) {
    fmt::print("{:>7} | forward {:>7.1f} ms {:>5.2f} M tokens/s {:>6.1f} GFLOP/s {:>4.1f}% |", what, f, tokens / f / 1e3,
               flops / f / 1e6, 100 * flops / f / 1e6 / peak);
    if (b > 0)
      fmt::print(" backward {:>7.1f} ms {:>5.2f} M tokens/s {:>6.1f} GFLOP/s {:>4.1f}%", b, tokens / b / 1e3,
                 2 * flops / b / 1e6, 100 * 2 * flops / b / 1e6 / peak);
    fmt::print("\n");
  };
  line("packed", packed_f, packed_b);
  line("padded", padded_f, padded_b);
  line("looped", looped_f, 0);
  fmt::print("packed vs padded: forward {:.2f}x, backward {:.2f}x; packed vs looped: forward {:.2f}x\n",
             padded_f / packed_f, padded_b / packed_b, looped_f / packed_f);
}
