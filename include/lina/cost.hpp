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

namespace lina {

struct cost_estimate {
  double flops = 0;
  double bytes = 0;
  constexpr cost_estimate& operator+=(cost_estimate const& o) {
    flops += o.flops;
    bytes += o.bytes;
    return *this;
  }
};

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

template <class D, class Source>
constexpr double ext(Source const& s) {
  return static_cast<double>(D::extent(s));
}

// The own cost of one node: op_cost<Op, Shape, KidShapes...>. The default is an
// element-wise pass over the result, in place.
template <class Op, class S, class... KS>
struct op_cost {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double) {
    return {ext<typename S::rows>(s) * ext<typename S::cols>(s), 0};
  }
};
template <fixed_string Name, class R, class C, class S>
struct op_cost<op::input<Name, R, C>, S> {
  template <class Src>
  static constexpr cost_estimate of(Src const&, double) {
    return {};
  }
};
template <class S, class X>
struct op_cost<op::transpose, S, X> {  // a view
  template <class Src>
  static constexpr cost_estimate of(Src const&, double) {
    return {};
  }
};
template <class S, class X>
struct op_cost<op::causal, S, X> {  // zeroes the upper triangle in place
  template <class Src>
  static constexpr cost_estimate of(Src const&, double) {
    return {};
  }
};
template <class Map, class S, class X>
struct op_cost<op::phi<Map>, S, X> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double n = ext<typename S::rows>(s) * ext<typename S::cols>(s);
    return {n, n * elem};
  }
};
template <class Map, class S, class X, class W>
struct op_cost<op::phi<Map>, S, X, W> {  // the projection x W, then one function per feature
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double r = ext<typename S::rows>(s), d = ext<typename X::cols>(s), m = ext<typename W::cols>(s);
    double n = r * ext<typename S::cols>(s);
    return {2 * r * d * m + n, n * elem};
  }
};
template <class S, class A, class B>
struct op_cost<op::product, S, A, B> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double r = ext<typename A::rows>(s), k = ext<typename A::cols>(s), c = ext<typename B::cols>(s);
    return {2 * r * k * c, r * c * elem};
  }
};
template <class S, class X>
struct op_cost<op::normalize, S, X> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double) {
    return {2 * ext<typename S::rows>(s) * ext<typename S::cols>(s), 0};
  }
};
template <class S, class X>
struct op_cost<op::append_ones, S, X> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    return {0, ext<typename S::rows>(s) * ext<typename S::cols>(s) * elem};
  }
};
template <class S, class X>
struct op_cost<op::row_divide, S, X> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double n = ext<typename S::rows>(s) * ext<typename S::cols>(s);
    return {n, n * elem};
  }
};
template <class S, class B, class C>
struct op_cost<op::outer_rows, S, B, C> {  // one multiply per state entry and row
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double) {
    return {ext<typename S::rows>(s) * ext<typename S::a>(s) * ext<typename S::b>(s), 0};
  }
};
template <class S, class X>
struct op_cost<op::prefix_scan, S, X> {  // one add per state entry and row; the state
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double ab = ext<typename S::a>(s) * ext<typename S::b>(s);
    return {ext<typename S::rows>(s) * ab, ab * elem};
  }
};
template <class S, class X>
struct op_cost<op::suffix_scan, S, X> : op_cost<op::prefix_scan, S, X> {};
template <class S, class X>
struct op_cost<op::transpose_rows, S, X> {
  template <class Src>
  static constexpr cost_estimate of(Src const&, double) {
    return {};
  }
};
template <class S, class A, class Seq>
struct op_cost<op::contract_rows, S, A, Seq> {  // out_i = A_i^T S_i: a x b multiply-adds per row
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    double r = ext<typename S::rows>(s), a = ext<typename Seq::a>(s), b = ext<typename Seq::b>(s);
    return {2 * r * a * b, r * b * elem};
  }
};
template <class S, class... X>
struct op_cost<op::chain, S, X...> {
  static_assert(detail::always_false<S>, "lina: a product chain has no cost until compile() brackets it");
};

template <class N>
struct cost_of_impl;
template <class Op, class... K>
struct cost_of_impl<node<Op, K...>> {
  template <class Src>
  static constexpr cost_estimate of(Src const& s, double elem) {
    if constexpr (is_select_op<Op>) {
      return select_branch<K...>(s, elem);
    } else {
      cost_estimate c = op_cost<Op, typename node<Op, K...>::shape, typename K::shape...>::of(s, elem);
      ((c += cost_of_impl<K>::of(s, elem)), ...);
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
