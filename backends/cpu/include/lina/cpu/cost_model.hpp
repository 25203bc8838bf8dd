// The CPU backend's cost model: compile<order::automatic, cpu::cost_model>(e).
//
// Two rates fitted to the crossovers examples/orderings measures with the
// current kernels (docs/benchmarks.md has the table, measured against
// predicted), and one share known from the kernels: a byte of intermediate
// written weighs `flops_per_byte` flops (the quadratic order streams its
// N x N similarity through memory, which is what moves the non-causal
// crossover, where no scan is involved); a flop inside a fused scan weighs
// `scan_flop` (the chunked scan runs near the FMA peak, with phi, [V|1] and
// the normaliser made inside it, while the quadratic order's products and
// element-wise passes do not; that moves the causal crossover); and of the
// products a causal mask half zeroes, `masked_skipped` is not done (GEMM
// skips the masked triangle). The core decides with counting_cost_model
// (rates 1, nothing skipped); a backend with other costs (a GPU: flops cheap,
// bytes dear) brings its own.
#pragma once

#include "lina/cost.hpp"

namespace lina::cpu {

struct cost_model : counting_cost_model {
  // Fitted on a 2-core AVX-512 EPYC (2026-11-30), D = M = 64, fp32, with the
  // register-tiled products (kernels::gemm): measured crossovers N = 62-77
  // non-causal (flop-bound: any flops_per_byte in 0.5..2 predicts 65) and
  // N = 50 causal, i.e. in (40, 50] on the example's grid (scan_flop = 0.7
  // predicts 46; 1 predicts 65, 0.8 53, 0.6 40). A scan flop weighs 0.7 of a
  // product's: the causal quadratic order also makes passes over its N x N
  // similarity (mask, normalise) that the flop count leaves out. (With the
  // products of rows in memory, before, the causal crossover was N = 12 and
  // scan_flop 0.1.) When the products began to skip the masked triangle
  // (2026-12-06) the causal crossover moved to N = 77, 96, 96 (three runs):
  // counting half the masked products, scan_flop = 0.7 predicts 89 (0.6: 77,
  // 0.8: 102), so the rate stands.
  static constexpr double flops_per_byte = 1;
  static constexpr double scan_flop = 0.7;
  static constexpr double masked_skipped = 0.5;
  static constexpr double weight(cost_estimate c) {
    return c.flops - masked_skipped * c.masked_flops + (scan_flop - 1) * c.scan_flops + flops_per_byte * c.bytes;
  }
};

}  // namespace lina::cpu
