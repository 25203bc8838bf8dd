// The CPU backend's cost model: compile<order::automatic, cpu::cost_model>(e).
//
// Two rates, fitted to the crossovers examples/orderings measures with the
// current kernels (docs/benchmarks.md has the table, measured against
// predicted): a byte of intermediate written weighs `flops_per_byte` flops
// (the quadratic order streams its N x N similarity through memory, which is
// what moves the non-causal crossover, where no scan is involved), and a flop
// inside a fused scan weighs `scan_flop` (the chunked scan runs near the FMA
// peak, with phi, [V|1] and the normaliser made inside it, while the quadratic
// order's products and element-wise passes do not; that moves the causal
// crossover). The core decides with counting_cost_model (both 1); a backend
// with other costs (a GPU: flops cheap, bytes dear) brings its own.
#pragma once

#include "lina/cost.hpp"

namespace lina::cpu {

struct cost_model : counting_cost_model {
  // Fitted on a 2-core AVX-512 EPYC (2026-11-30), D = M = 64, fp32: measured
  // crossovers N = 62 non-causal (flop-bound: any flops_per_byte in 0.5..1.25
  // predicts 65) and N = 12 causal (scan_flop = 0.1 predicts 12; 1 predicted
  // 65). A scan flop weighs a tenth of the quadratic order's: at these lengths
  // the quadratic causal plan's cost is its passes over the N x N similarity
  // (product, mask, normalise, product), not its flop count.
  static constexpr double flops_per_byte = 1;
  static constexpr double scan_flop = 0.1;
  static constexpr double weight(cost_estimate c) {
    return c.flops + (scan_flop - 1) * c.scan_flops + flops_per_byte * c.bytes;
  }
};

}  // namespace lina::cpu
