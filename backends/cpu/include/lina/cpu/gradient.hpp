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
#include <utility>

#include "lina/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/gradient.hpp"

namespace lina::cpu {

namespace detail {
// The backward plan's bundle bound to the inputs and dout.
template <class BP, class D, class... B>
auto bind_backward(BP const& bp, D const& dout, B const&... bindings) {
  auto dview = view_of(dout);
  return bind<decltype(as_bundle(bp))>(bindings..., binding<cotangent_symbol, decltype(dview)>{dview});
}
// Position in the bound inputs of the input gradient i is of.
template <class BP, class Bound, std::size_t I>
constexpr std::size_t gradient_input_index() {
  using Entry = std::remove_cvref_t<decltype(hana::at_c<I>(std::declval<BP const&>().entries))>;
  return Bound::template input_index<typename Entry::input>();
}
template <class BP>
inline constexpr std::size_t gradient_count = decltype(hana::size(std::declval<BP const&>().entries))::value;

// New gradient tensors, each laid out like its input, and views of them.
template <class T, class BP, class Bound>
auto new_gradients(Bound const& in, std::array<tensor_view<T>, gradient_count<BP>>& outs) {
  gradients_of<tensor<T>, BP> g;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((g.all()[I] = tensor<T>::like(in.views[gradient_input_index<BP, Bound, I>()]), outs[I] = g.all()[I].view()), ...);
  }(std::make_index_sequence<gradient_count<BP>>{});
  return g;
}
// The caller's gradient views, each checked against the shape of its input.
template <class BP, class Bound, class T, class... In>
auto checked_gradient_views(Bound const& in, gradients<tensor_view<T>, In...>& into) {
  std::array<tensor_view<T>, gradient_count<BP>> outs;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto one = [&]<std::size_t K>(std::size_t i) {
      auto const& want = in.views[K].shape();
      auto const& got = into.all()[i].shape();
      using Input = lina::detail::type_at_t<K, typename Bound::inputs>;
      static constexpr char const* dims[4] = {"B (batch)", "H (heads)", "rows", "cols"};
      for (std::size_t d = 0; d < 4; ++d)
        if (got[d] != want[d])
          throw shape_error("∂" + std::string(Input::name.view()), dims[d], got[d], want[d],
                            "of input " + std::string(Input::name.view()));
      outs[i] = into.all()[i];
    };
    (one.template operator()<gradient_input_index<BP, Bound, I>()>(I), ...);
  }(std::make_index_sequence<gradient_count<BP>>{});
  return outs;
}
}  // namespace detail

// gradient(plan or backward_plan, dout, bindings...) -> gradients: g[Q], g[K], ...
template <class P, class D, class... B>
  requires(is_binding<B> && ...)
auto gradient(P const& plan, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  auto in = detail::bind_backward(bp, dout, bindings...);
  using T = typename decltype(in)::value_type;
  std::array<tensor_view<T>, detail::gradient_count<BP>> outs;
  auto g = detail::new_gradients<T, BP>(in, outs);
  with_resolved_plan(as_bundle(bp), in.table, [&](auto const& p) { detail::run_slices<T>(p, in, outs); });
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
  requires(is_binding<B> && ...)
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_of<tensor_view<T>, BP>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(view_of(dout))::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views and dout must have one element type");
  auto in = detail::bind_backward(bp, dout, bindings...);
  auto outs = detail::checked_gradient_views<BP>(in, into);
  with_resolved_plan(as_bundle(bp), in.table, [&](auto const& p) { detail::run_slices<T>(p, in, outs); });
}

}  // namespace lina::cpu
