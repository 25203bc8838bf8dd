// The cost model: flops and bytes of intermediates of a plan, written once as
// constexpr arithmetic over extents. With static extents it is a compile-time
// constant (so compile() picks a plan type); with a dynamic sequence length
// compile() evaluates it at sample lengths to find the crossover, which
// becomes one run-time comparison (op::select) against that threshold.
//
// Counting convention (docs/architecture.md): a multiply-add is 2 flops; bytes
// are those of materialised intermediates (inputs and views are free); a
// scan's state counts once (a x b), never per row, because no backend
// materialises per-row matrices.
#pragma once

#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "lina/dims.hpp"
#include "lina/node.hpp"
#include "lina/op_traits.hpp"

namespace lina {

// A cost model turns a plan's counts into one weight to minimise. The DSL
// core decides with the plain count below; each backend calibrates its own
// (cpu::cost_model, measured on the CPU) and is chosen with
// compile<order::automatic, Model>(e). A model is any struct with these members.
struct counting_cost_model {
  // Decisions are made for fp32 elements.
  static constexpr double bytes_per_element = 4;
  // One byte of intermediate written weighs as much as this many flops.
  static constexpr double flops_per_byte = 1;
  // Dynamic dimensions other than the sequence length are assumed to have this
  // extent when the order is decided (make them static for exact decisions).
  static constexpr double assumed_extent = 64;

  static constexpr double weight(cost_estimate c) { return c.flops + flops_per_byte * c.bytes; }
};
// What compile(e) uses when no model is named.
using default_cost_model = counting_cost_model;

namespace detail {

// The own cost of each node is op_traits<Op>::cost (op_traits.hpp); a plan's
// cost is the sum over its nodes, a select counting the branch it takes.
template <class N>
struct cost_of_impl;
// Is N a causal mask's result, or a transposed view of one? And is N a
// product whose left operand is (its masked flops counted at N itself)?
template <class N>
inline constexpr bool masked_node = is_causal_op<typename N::op_type>;
template <class X>
inline constexpr bool masked_node<node<op::transpose, X>> = masked_node<X>;
template <class N>
inline constexpr bool product_of_masked = false;
template <class A, class B>
inline constexpr bool product_of_masked<node<op::product, A, B>> = masked_node<A>;
template <class Op, class... K>
struct cost_of_impl<node<Op, K...>> {
  template <class Src>
  static constexpr cost_estimate own(Src const& s, double elem) {
    return op_traits<Op>::template cost<typename node<Op, K...>::shape, typename K::shape...>(s, elem);
  }
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    if constexpr (is_select_op<Op>) {
      return select_branch<K...>(s, elem);
    } else {
      cost_estimate c = own(s, elem);
      if constexpr (product_of_masked<node<Op, K...>>) c.masked_flops = c.flops;  // causal(…)·B
      ((c += cost_of_impl<K>::of(s, elem)), ...);
      if constexpr (is_causal_op<Op> && sizeof...(K) == 1) {  // causal(A·B)
        using X = type_at_t<0, type_list<K...>>;
        if constexpr (std::is_same_v<typename X::op_type, op::product> && !product_of_masked<X>)
          c.masked_flops += cost_of_impl<X>::own(s, elem).flops;
      }
      return c;
    }
  }
  template <class Small, class Large, class Src>
  static constexpr cost_estimate select_branch(Src const& s, double elem) {
    if (ext<typename Op::key>(s) < static_cast<double>(Op::threshold))
      return cost_of_impl<Small>::of(s, elem);
    return cost_of_impl<Large>::of(s, elem);
  }
};

}  // namespace detail

// Flops and bytes of plan N for the extents in `source` (an object with
// `template <class Dim> get()`), elements of `elem` bytes.
template <class N, class Source>
constexpr cost_estimate cost_of(Source const& source, double elem) {
  return detail::cost_of_impl<N>::of(source, elem);
}

namespace diagnose {
template <class Dim, bool Given>
struct estimate_extent {
  static_assert(Given,
                "lina::estimate: give an extent for every dynamic dimension of the plan, e.g. "
                "estimate(plan, N = 4096) (the missing dimension is in the instantiation above)");
  static constexpr bool ok = Given;
};
}  // namespace diagnose

namespace detail {
template <class... D>
struct given_extents {
  std::tuple<extent_binding<D>...> e;
  template <class X>
  constexpr double get() const {
    if constexpr ((std::is_same_v<X, D> || ...))
      return static_cast<double>(std::get<extent_binding<X>>(e).extent);
    else
      return 0;
  }
};
}  // namespace detail

// estimate<T>(plan, N = 4096, ...): the flops and intermediate bytes the plan
// costs at those extents, for elements of type T (float by default). A select
// counts the branch it takes at those extents.
template <class T = float, class P, class... D>
  requires is_node<P>
constexpr cost_estimate estimate(P const&, extent_binding<D>... extents) {
  [&]<class... X>(detail::type_list<X...>) {
    static_assert(((diagnose::estimate_extent<X, X::is_static || detail::contains<detail::type_list<D...>, X>::value>::ok) && ...) || true);
  }(dims_of<P>{});
  return cost_of<P>(detail::given_extents<D...>{{extents...}}, sizeof(T));
}

// The thresholds of the run-time choices in a plan, outermost first.
template <class P>
constexpr auto select_thresholds() {
  std::array<std::size_t, 8> t{};
  std::size_t n = 0;
  detail::visit_types<P>([&]<class X>() {
    if constexpr (is_select_op<typename X::op_type>)
      if (n < t.size()) t[n++] = X::op_type::threshold;
  });
  return std::pair{t, n};
}

}  // namespace lina
