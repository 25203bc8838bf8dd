// The CPU benchmark suite (issue: CPU speed): forward and backward, causal and
// non-causal linear attention, D = M in {32, 64, 128}, N in {1k, 4k, 16k, 64k},
// B·H in {1, 8}, float and double; poly2 and favor (m = 256) at D = 64; and
// both orders of the causal forward against N. Every rate is a fraction of
// this machine's peak measured in the same run (bench/probes.hpp).
//
// Flops: 4·B·H·N·C·M forward, 8·B·H·N·C·M backward (C = D for elu+1; the
// feature count for poly2 and favor), the convention of fast-transformers'
// comparisons; bytes: q, k, v read and o written once (forward), plus dout
// read and dq, dk, dv written (backward).
//
//   suite [--quick] [--maps] [--mask causal|full] [--csv FILE] [--orders-csv FILE] [--reps R]
//
// --maps runs the feature-map rows alone (poly2, favor); --mask the elu+1 grid's
// rows of one mask alone.
#include <fmt/core.h>
#include <fmt/os.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <optional>
#include <string>
#include <vector>

#include "probes.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto F = dim<"F">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto W = input<"W">(D, F);

template <class Map>
constexpr auto causal_attn = normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)))) * V;
template <class Map>
constexpr auto full_attn = normalize(phi<Map>(Q) * transpose(phi<Map>(K))) * V;
constexpr auto favor_attn = normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V;
constexpr auto decayed_attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.97})) * V;

struct options {
  bool quick = false;
  bool maps_only = false;
  std::optional<std::string> mask;  // the elu+1 grid of this mask alone
  int reps = 3;
  std::optional<std::string> csv, orders_csv;
};

struct peaks {
  double f32, f64, triad;
};

struct row {
  std::string map, mask, pass, type;
  std::size_t bh, n, d, m, c;
  double ms, gflops, peak_fraction, gbytes, triad_fraction;
};

struct report {
  options const& opt;
  peaks p;
  std::vector<row> rows;

  void header() const {
    fmt::print("| map | mask | pass | type | B·H | N | D=M | ms | GFLOP/s | % FMA peak | GB/s | % triad |\n");
    fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  void add(row r) {
    fmt::print("| {} | {} | {} | {} | {} | {} | {} | {:.3f} | {:.1f} | {:.0f}% | {:.2f} | {:.0f}% |\n", r.map, r.mask,
               r.pass, r.type, r.bh, r.n, r.d, r.ms, r.gflops, 100 * r.peak_fraction, r.gbytes,
               100 * r.triad_fraction);
    std::fflush(stdout);
    rows.push_back(std::move(r));
  }
};

template <class T, class Plan, class... Extra>
void measure(report& rep, Plan const& plan, std::string map, std::string mask, std::size_t bh, std::size_t n,
             std::size_t d, std::size_t c, bool backward, Extra const&... extra) {
  std::size_t m = d;
  auto q = tensor<T>::random({1, bh, n, d}, 1), k = tensor<T>::random({1, bh, n, d}, 2);
  auto v = tensor<T>::random({1, bh, n, m}, 3);
  double s;
  if (!backward) {
    tensor<T> out({1, bh, n, m});
    s = bench::best_seconds([&] { cpu::evaluate_into(plan, out.view(), Q = q, K = k, V = v, extra...); }, rep.opt.reps);
  } else {
    auto dout = tensor<T>::random({1, bh, n, m}, 4);
    auto bp = gradient(plan);
    s = bench::best_seconds([&] { auto g = cpu::gradient(bp, dout, Q = q, K = k, V = v, extra...); }, rep.opt.reps);
  }
  double flops = (backward ? 8.0 : 4.0) * double(bh) * double(n) * double(c) * double(m);
  double bytes = double(sizeof(T)) * double(bh) * double(n) * double(2 * d + 2 * m) * (backward ? 2.0 : 1.0);
  double peak = sizeof(T) == 4 ? rep.p.f32 : rep.p.f64;
  rep.add({map, mask, backward ? "bwd" : "fwd", sizeof(T) == 4 ? "float" : "double", bh, n, d, m, c, 1e3 * s,
           flops / s / 1e9, flops / s / 1e9 / peak, bytes / s / 1e9, bytes / s / 1e9 / rep.p.triad});
}

template <class T>
void elu_grid(report& rep) {
  std::vector<std::size_t> lengths = rep.opt.quick ? std::vector<std::size_t>{1024, 4096, 16384}
                                                   : std::vector<std::size_t>{1024, 4096, 16384, 65536};
  for (bool backward : {false, true})
    for (bool causal : {true, false}) {
      if (rep.opt.mask && *rep.opt.mask != (causal ? "causal" : "full")) continue;
      for (std::size_t d : {32u, 64u, 128u})
        for (std::size_t bh : {1u, 8u})
          for (std::size_t n : lengths) {
            if (causal)
              measure<T>(rep, compile<order::linear>(causal_attn<elu_plus_one>), "elu+1", "causal", bh, n, d, d, backward);
            else
              measure<T>(rep, compile<order::linear>(full_attn<elu_plus_one>), "elu+1", "full", bh, n, d, d, backward);
          }
    }
}

void feature_maps(report& rep) {
  std::size_t d = 64, m = 256;
  for (std::size_t n : {1024u, 4096u}) {
    measure<float>(rep, compile<order::linear>(causal_attn<poly2>), "poly2", "causal", 8, n, d, poly2::features(d), false);
    auto const projection = gaussian_projection<float>(d, m, 7);
    auto w = broadcast(projection, 1, 8);
    measure<float>(rep, compile<order::linear>(favor_attn), "favor256", "causal", 8, n, d, m, false, W = w);
  }
  // a decayed mask against the plain one, in the same run (one multiply more per state element and row),
  // and a decay per head (RetNet's: 1 − 2^(−5−h), h < 8)
  for (bool backward : {false, true})
    for (std::size_t n : {1024u, 4096u}) {
      measure<float>(rep, compile<order::linear>(causal_attn<elu_plus_one>), "elu+1", "causal", 8, n, d, d, backward);
      measure<float>(rep, compile<order::linear>(decayed_attn), "elu+1", "causal, decay 0.97", 8, n, d, d, backward);
      auto const retnet = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), head_decays::retnet(8))) * V;
      measure<float>(rep, compile<order::linear>(retnet), "elu+1", "causal, RetNet's decay per head", 8, n, d, d, backward);
    }
}

// Both orders of the causal forward against N (float, B·H = 8, D = M = 64).
void orders(options const& opt) {
  std::optional<fmt::ostream> csv;
  if (opt.orders_csv) csv.emplace(fmt::output_file(*opt.orders_csv));
  if (csv) csv->print("n,quadratic_ms,linear_ms\n");
  fmt::print("\n| N | quadratic ms | linear ms |\n|---|---|---|\n");
  for (std::size_t n = 256; n <= (opt.quick ? 8192u : 65536u); n *= 2) {
    auto q = tensor<float>::random({1, 8, n, 64}, 1), k = tensor<float>::random({1, 8, n, 64}, 2);
    auto v = tensor<float>::random({1, 8, n, 64}, 3);
    tensor<float> out({1, 8, n, 64});
    double lin = bench::best_seconds(
        [&] { cpu::evaluate_into(compile<order::linear>(causal_attn<elu_plus_one>), out.view(), Q = q, K = k, V = v); },
        opt.reps);
    double quad = -1;
    if (n <= 4096)
      quad = bench::best_seconds([&] {
        cpu::evaluate_into(compile<order::quadratic>(causal_attn<elu_plus_one>), out.view(), Q = q, K = k, V = v);
      }, opt.reps);
    fmt::print("| {} | {} | {:.3f} |\n", n, quad < 0 ? std::string("skipped (N x N)") : fmt::format("{:.3f}", 1e3 * quad),
               1e3 * lin);
    if (csv) csv->print("{},{},{:.6f}\n", n, quad < 0 ? std::string("NaN") : fmt::format("{:.6f}", 1e3 * quad), 1e3 * lin);
  }
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      opt.quick = true;
    } else if (!std::strcmp(argv[i], "--maps")) {
      opt.maps_only = true;
    } else if (!std::strcmp(argv[i], "--mask") && i + 1 < argc &&
               (!std::strcmp(argv[i + 1], "causal") || !std::strcmp(argv[i + 1], "full"))) {
      opt.mask = argv[++i];
    } else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) {
      opt.csv = argv[++i];
    } else if (!std::strcmp(argv[i], "--orders-csv") && i + 1 < argc) {
      opt.orders_csv = argv[++i];
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      opt.reps = std::max(1, std::atoi(argv[++i]));
    } else {
      fmt::print(stderr, "usage: suite [--quick] [--maps] [--mask causal|full] [--csv FILE] [--orders-csv FILE] [--reps R]\n");
      return 2;
    }
  }
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  report rep{opt, {bench::fma_gflops<float>(), bench::fma_gflops<double>(), bench::triad_gbytes()}, {}};
  fmt::print("threads {}: FMA peak {:.1f} GFLOP/s fp32, {:.1f} fp64; triad {:.1f} GB/s (measured now)\n\n", threads,
             rep.p.f32, rep.p.f64, rep.p.triad);
  rep.header();
  if (!opt.maps_only) {
    elu_grid<float>(rep);
    elu_grid<double>(rep);
  }
  if (!opt.mask) feature_maps(rep);
  if (opt.csv) {
    auto out = fmt::output_file(*opt.csv);
    out.print("map,mask,pass,type,bh,n,d,m,c,ms,gflops,peak_fraction,gbytes,triad_fraction\n");
    for (auto const& r : rep.rows)
      out.print("{},{},{},{},{},{},{},{},{},{:.6f},{:.3f},{:.4f},{:.3f},{:.4f}\n", r.map, r.mask, r.pass, r.type, r.bh,
                r.n, r.d, r.m, r.c, r.ms, r.gflops, r.peak_fraction, r.gbytes, r.triad_fraction);
  }
  if (!opt.maps_only && !opt.mask) orders(opt);
}
