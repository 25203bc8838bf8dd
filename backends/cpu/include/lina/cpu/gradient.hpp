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

// Gradients written into caller memory, for loops that reuse their buffers
// (each fresh gradient tensor is first-touched memory: at B·H = 8, N = 16384,
// D = 64, three of them are 96 MB a call). `into[Q]` is a view shaped like Q,
// in any layout: auto into = cpu::gradient_views<float>(plan); into[Q] = dq.view();
// ...; cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v). A view of
// the wrong shape (or one not set) is a lina::shape_error before anything runs.
template <class T, class P>
auto gradient_views(P const& plan) {
  return gradients_of<tensor_view<T>, std::remove_cvref_t<decltype(backward_of(plan))>>{};
}
template <class P, class T, class... In, class D, class... B>
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_of<tensor_view<T>, BP>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  auto dview = view_of(dout);
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(dview)::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views and dout must have one element type");
  auto all = as_bundle(bp);
  auto in = bind<decltype(all)>(bindings..., binding<cotangent_symbol, decltype(dview)>{dview});
  constexpr std::size_t count = decltype(hana::size(bp.entries))::value;
  std::array<tensor_view<T>, count> outs;
  hana::for_each(hana::make_range(hana::size_c<0>, hana::size_c<count>), [&](auto i) {
    using Entry = std::remove_cvref_t<decltype(hana::at_c<decltype(i)::value>(bp.entries))>;
    constexpr std::size_t k = decltype(in)::template input_index<typename Entry::input>();
    auto const& want = in.views[k].shape();
    auto const& got = into.all()[i].shape();
    static constexpr char const* dims[4] = {"B (batch)", "H (heads)", "rows", "cols"};
    for (std::size_t d = 0; d < 4; ++d)
      if (got[d] != want[d])
        throw shape_error("∂" + std::string(Entry::input::name.view()), dims[d], got[d], want[d],
                          "of input " + std::string(Entry::input::name.view()));
    outs[i] = into.all()[i];
  });
  with_resolved_plan(all, in.table, [&](auto const& p) { detail::run_slices<T>(p, in, outs); });
}

}  // namespace lina::cpu
