// The CPU backend's cost model: compile<order::automatic, cpu::cost_model>(e).
//
// The quadratic order streams its N x N similarity through memory twice,
// which is what moves the crossover; one byte of intermediate written weighs
// as much as one flop here, the value whose predicted crossover (N = 65 at
// D = M = 64) matched the measured one of examples/orderings best
// (docs/benchmarks.md: 62 non-causal; the causal scan crosses later, at 120,
// until the scan kernels are tuned). It equals the core's counting model
// today; it lives here because its constants are the CPU's, and a backend
// with other costs (a GPU: flops cheap, bytes dear) brings its own.
#pragma once

#include "lina/cost.hpp"

namespace lina::cpu {

struct cost_model : counting_cost_model {
  static constexpr double flops_per_byte = 1;  // measured crossover, see above
  static constexpr double weight(cost_estimate c) { return c.flops + flops_per_byte * c.bytes; }
};

}  // namespace lina::cpu
