// One traits struct per operation: its name, how tightly it binds, and how it
// prints. The printer (format.hpp) and the backend-neutral layer read these
// instead of testing op types one by one.
//
//   op_traits<Op>::name         a short name ("product", "prefix_scan")
//   op_traits<Op>::precedence   prec::sum < prec::product < prec::atom
//   op_traits<Op>::print(n, p)  writes node n through printer p (kids by p.kid / p.call)
//
// The other per-op facts live beside the machinery that uses them, each keyed
// on the same tag: the cost (detail::op_cost), the adjoint (adjoint::rule) and
// each backend's lowering.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "lina/feature_maps.hpp"
#include "lina/node.hpp"

namespace lina {

enum class prec { sum = 1, product = 2, atom = 3 };

namespace detail {
// A value printed exactly: the shortest decimal that reads back as the same double.
inline std::string exact(double x) { return fmt::format("{}", x); }
inline constexpr double default_eps = 1e-6;
// "; eps=…" after the operands when eps is not the default.
inline std::string eps_suffix(double eps) { return eps == default_eps ? std::string() : "; eps=" + exact(eps); }
template <class Map>
std::string map_tag() {
  return "[" + std::string(Map::name) + "]";
}

// Ops printed as name(kid, kid, …), with an optional suffix from the op's value.
template <fixed_string Name>
struct call_notation {
  static constexpr std::string_view name = Name.view();
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(name, n);
  }
};
template <fixed_string Name>
struct eps_call_notation {
  static constexpr std::string_view name = Name.view();
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(name, n, eps_suffix(n.op.eps));
  }
};
// Ops printed as kid SYMBOL kid.
template <fixed_string Name, fixed_string Symbol, prec Prec = prec::product>
struct infix_notation {
  static constexpr std::string_view name = Name.view();
  static constexpr prec precedence = Prec;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.kid(kid<0>(n), Prec == prec::sum ? prec::sum : prec::atom);
    p.text(Symbol.view());
    p.kid(kid<1>(n), Prec == prec::sum ? prec::product : prec::atom);
  }
};
}  // namespace detail

template <class Op>
struct op_traits {
  static constexpr bool defined = false;
};

template <fixed_string Name, class R, class C>
struct op_traits<op::input<Name, R, C>> {
  static constexpr std::string_view name = "input";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const&, P& p) {
    p.text(Name.view());
  }
};
// φ[elu+1](Q), φ[favor](Q; W): the map is part of the printed plan, so two
// plans that differ only in their map never print alike.
template <class Map>
struct op_traits<op::phi<Map>> {
  static constexpr std::string_view name = "phi";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text("φ" + detail::map_tag<Map>() + "(");
    p(kid<0>(n));
    if constexpr (N::arity == 2) {
      p.text("; ");
      p(kid<1>(n));
    }
    p.text(")");
  }
};
template <>
struct op_traits<op::transpose> {
  static constexpr std::string_view name = "transpose";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.kid(kid<0>(n), prec::atom);
    p.text("ᵀ");
  }
};
// A product kid of a product keeps its parentheses: the bracketing is the order.
template <>
struct op_traits<op::product> : detail::infix_notation<"product", "·"> {};
template <>
struct op_traits<op::causal> : detail::call_notation<"causal"> {};
template <>
struct op_traits<op::normalize> : detail::eps_call_notation<"normalize"> {};
template <>
struct op_traits<op::scale> {
  static constexpr std::string_view name = "scale";
  static constexpr prec precedence = prec::product;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text(detail::exact(n.op.factor) + "·");
    p.kid(kid<0>(n), prec::atom);
  }
};
template <>
struct op_traits<op::exp> : detail::call_notation<"exp"> {};
template <>
struct op_traits<op::chain> : detail::call_notation<"chain"> {};
template <>
struct op_traits<op::append_ones> {
  static constexpr std::string_view name = "append_ones";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text("[");
    p(kid<0>(n));
    p.text("|1]");
  }
};
template <>
struct op_traits<op::row_divide> : detail::eps_call_notation<"rowdiv"> {};
template <>
struct op_traits<op::outer_rows> : detail::infix_notation<"outer_rows", "⊗"> {};
template <>
struct op_traits<op::prefix_scan> : detail::call_notation<"prefix"> {};
template <>
struct op_traits<op::suffix_scan> : detail::call_notation<"suffix"> {};
template <>
struct op_traits<op::transpose_rows> : detail::call_notation<"rowsᵀ"> {};
template <>
struct op_traits<op::contract_rows> : detail::call_notation<"contract"> {};
template <class Key, std::size_t Threshold>
struct op_traits<op::select<Key, Threshold>> {
  static constexpr std::string_view name = "select";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text(fmt::format("({} < {} ? ", Key::label(), Threshold));
    p(kid<0>(n));
    p.text(" : ");
    p(kid<1>(n));
    p.text(")");
  }
};

// ---- backward ops ----
template <class Map>
struct op_traits<op::phi_vjp<Map>> {
  static constexpr std::string_view name = "phi_vjp";
  static constexpr prec precedence = prec::product;
  template <class N, class P>
  static void print(N const& n, P& p) {
    if constexpr (concepts::elementwise_map<Map>) {  // φ′[elu+1](X)⊙G
      p.text("φ′" + detail::map_tag<Map>() + "(");
      p(kid<0>(n));
      p.text(")⊙");
      p.kid(kid<1>(n), prec::atom);
    } else {
      p.call("φ_vjp" + detail::map_tag<Map>(), n);
    }
  }
};
template <class Map>
struct op_traits<op::phi_param_vjp<Map>> {
  static constexpr std::string_view name = "phi_param_vjp";
  static constexpr prec precedence = prec::atom;
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call("φ_w′" + detail::map_tag<Map>(), n);
  }
};
template <>
struct op_traits<op::normalize_vjp> : detail::eps_call_notation<"normalize′"> {};
template <>
struct op_traits<op::row_divide_vjp> : detail::eps_call_notation<"rowdiv′"> {};
template <>
struct op_traits<op::hadamard> : detail::infix_notation<"hadamard", "⊙"> {};
template <>
struct op_traits<op::add> : detail::infix_notation<"add", " + ", prec::sum> {};
template <>
struct op_traits<op::drop_last> : detail::call_notation<"dropcol"> {};
template <>
struct op_traits<op::bundle> : detail::call_notation<"bundle"> {};

}  // namespace lina
