// The CPU backward: cpu::gradient(plan, dout, Q = q, K = k, V = v).
//
// Derives the backward plan (lina::gradient) at compile time, binds the
// inputs and dout (dout must have the output's shape, else lina::shape_error),
// and runs the schedule of bundle(forward, ∂In…) per (batch, head) slice:
// one program computes every gradient, each straight into its result tensor,
// and what the gradients share is computed once. For a linear plan each
// gradient is a few fused scans over rows, so the extra memory is
// O(N (C + M)) per slice for the matrices it reads (φ(Q), [V|1], ...) plus a
// C x (M+1) state: no N x N, no per-step state cache.
#pragma once

#include <array>
#include <boost/hana/for_each.hpp>
#include <boost/hana/range.hpp>
#include <cstddef>
#include <type_traits>

#include "lina/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/gradient.hpp"

namespace lina::cpu {

// gradient(plan or backward_plan, dout, bindings...) -> gradients: g[Q], g[K], ...
template <class P, class D, class... B>
auto gradient(P const& plan, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  auto dview = view_of(dout);
  using T = std::remove_const_t<typename decltype(dview)::element_type_>;
  auto all = as_bundle(bp);
  auto in = bind<decltype(all)>(bindings..., binding<cotangent_symbol, decltype(dview)>{dview});

  gradients_of<tensor<T>, BP> g;
  constexpr std::size_t count = decltype(hana::size(bp.entries))::value;
  std::array<tensor_view<T>, count> outs;
  hana::for_each(hana::make_range(hana::size_c<0>, hana::size_c<count>), [&](auto i) {
    using Entry = std::remove_cvref_t<decltype(hana::at_c<decltype(i)::value>(bp.entries))>;
    constexpr std::size_t k = decltype(in)::template input_index<typename Entry::input>();
    g.all()[i] = tensor<T>::like(in.views[k]);
    outs[i] = g.all()[i].view();
  });
  with_resolved_plan(all, in.table, [&](auto const& p) { detail::run_slices<T>(p, in, outs); });
  return g;
}

}  // namespace lina::cpu
