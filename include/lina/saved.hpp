// save_for_backward(plan): what a forward keeps so that its backward need not
// recompute it.
//
// The derived backward (gradient.hpp) reads values of the forward: the
// quotient rule of rowdiv(Y) reads Y, the forward's whole scan; a stacked
// layer's backward reads the layer below's output. Run on their own, the
// backward's schedule recomputes them, which for the causal linear plan is
// two of the backward's seven N·C·(M+1) multiply-adds. A training step has
// just run that forward: keeping those values is cheaper than a second pass.
//
// save_for_backward(plan) names them and rewrites the backward to read them
// as inputs saved1, saved2, …. The values kept are the forward's subtrees the
// backward reads, taken top-down, whose own op costs more than a pass over
// its operands' rows (a scan, a product, a parametric φ's X·W); a row-wise op
// over one (rowdiv(Y), φ(Y)) is recomputed from it, which the backward's scans
// do as they load their rows anyway. A matrix whose rows and columns both run
// over input rows (an N x N similarity) is never kept: that would hold
// O(N²) memory from the forward to the backward; the backward recomputes it,
// as it does without saving; nor is a value made from exp (softmax's
// E·[V|1]), whose rows the CPU backend keeps scaled (e^x may pass the
// range of the type). For rowdiv(contract(φQ, prefix(φK⊗[V|1]))) the one
// value kept is Y = contract(φQ, prefix(φK⊗[V|1])), N x (M+1) per slice.
//
// Values are told apart by type. Two reads of one type are one value when
// their ops carry equal values (an eps, a decay): `exact` says whether they
// do (decided at run time for ops whose values are run-time); a backend
// whose plan is not exact recomputes instead of saving.
//
// A backend runs bundle(plan, plan, values…) as the forward (the output and
// each value in one schedule: the values are that schedule's steps) and
// as_bundle(backward) with saved_i bound to value i. Select-free plans only:
// a backend resolves selects first (with_resolved_plan), so that the values
// are those of the order that ran.
#pragma once

#include <boost/hana/at.hpp>
#include <boost/hana/basic_tuple.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/size.hpp>
#include <boost/hana/unpack.hpp>
#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include "lina/gradient.hpp"

namespace lina {

namespace hana = boost::hana;

namespace detail {
// "saved1", "saved2", …: the input names of the kept values.
template <std::size_t I>
constexpr auto saved_name() {
  static_assert(I >= 1 && I < 1000, "lina: at most 999 saved values");
  constexpr std::size_t digits = I < 10 ? 1 : I < 100 ? 2 : 3;
  char s[6 + digits] = {'s', 'a', 'v', 'e', 'd'};
  std::size_t v = I;
  for (std::size_t d = 0; d < digits; ++d, v /= 10) s[4 + digits - d] = static_cast<char>('0' + v % 10);
  s[5 + digits] = '\0';
  return fixed_string<6 + digits>(s);
}

// "saved" and digits: a name save_for_backward gives.
constexpr bool is_saved_name(std::string_view n) {
  if (n.size() <= 5 || n.substr(0, 5) != "saved") return false;
  for (char c : n.substr(5))
    if (c < '0' || c > '9') return false;
  return true;
}

// Does X's own op cost more than a pass over its operands' rows?
template <class X>
constexpr bool costly_op() {
  using Op = typename X::op_type;
  if constexpr (std::is_same_v<Op, op::contract_rows> || std::is_same_v<Op, op::product>)
    return true;
  else if constexpr (requires { typename Op::map; })
    return X::arity == 2;  // a parametric φ: X·W before the map
  else
    return false;
}

// Is there an exp (softmax) in X?
template <class X>
constexpr bool has_exp() {
  bool found = false;
  visit_types<X>([&]<class Y>() { found = found || std::is_same_v<typename Y::op_type, op::exp>; });
  return found;
}

// Is X a value of forward plan F that its backward keeps (see the top)?
template <class F, class X>
constexpr bool kept_for_backward() {
  if constexpr (X::shape::rank != 2 || !costly_op<X>()) {
    return false;
  } else {
    using token_rows = typename rows_of_inputs<lina::inputs_of<F>>::type;
    using S = typename X::shape;
    if constexpr (contains<token_rows, typename S::rows>::value && contains<token_rows, typename S::cols>::value) {
      return false;  // N x N (or N x L): recomputed, never held
    } else if constexpr (has_exp<X>()) {
      return false;  // softmax's E·[V|1]: its rows may hold e^x past float's range, which the
                     // backend keeps as scaled rows with exponents and a saved tensor could not
    } else {
      bool found = false;
      visit_types<F>([&]<class Y>() { found = found || std::is_same_v<X, Y>; });
      return found;
    }
  }
}

// The kept values' types under N, top-down (a kept value's own subtree is not
// searched: the backward reads the value, not what it is made of).
template <class F, class N>
struct kept_types {
  static auto pick() {
    if constexpr (kept_for_backward<F, N>())
      return type_list<N>{};
    else
      return []<std::size_t... I>(std::index_sequence<I...>) {
        return typename concat_lists<
            typename kept_types<F, std::remove_cvref_t<decltype(kid<I>(std::declval<N>()))>>::type...>::type{};
      }(std::make_index_sequence<N::arity>{});
  }
  using type = decltype(pick());
};

// N with each kept value replaced by its input saved<i> (i: its place in Kept, from 1).
template <class F, class Kept, class N>
constexpr auto read_saved(N const& n) {
  if constexpr (kept_for_backward<F, N>()) {
    using S = typename N::shape;
    return node<op::input<saved_name<index_of_v<N, Kept> + 1>(), typename S::rows, typename S::cols>>{};
  } else if constexpr (N::arity == 0) {
    return n;
  } else {
    return unpack_kids(n, [&](auto const&... k) { return make_node(n.op, read_saved<F, Kept>(k)...); });
  }
}

// f(x) for every read of a kept value under n, in the order of kept_types.
template <class F, class N, class Fn>
constexpr void for_each_kept(N const& n, Fn& f) {
  if constexpr (kept_for_backward<F, N>())
    f(n);
  else
    for_each_kid(n, [&](auto const& k) { for_each_kept<F>(k, f); });
}

// The kept values' types of a whole backward plan, each once.
template <class F, class BP>
struct kept_of;
template <class F, class Fw, class... E>
struct kept_of<F, backward_plan<Fw, E...>> {
  using type = typename merge_unique<
      type_list<>, typename concat_lists<typename kept_types<F, decltype(E::expr)>::type...>::type>::type;
};

template <class F, class Kept>
struct kept_values;
template <class F, class... X>
struct kept_values<F, type_list<X...>> {
  using type = hana::basic_tuple<X...>;
};
}  // namespace detail

namespace diagnose {
template <bool NoClash>
struct saved_names {
  static_assert(NoClash,
                "lina::save_for_backward: saved1, saved2, … name the values the forward keeps; rename the input "
                "called saved<number>");
  static constexpr bool ok = NoClash;
};
}  // namespace diagnose

// The backward of a forward plan that reads the forward's kept values.
template <class BP, class Values>
struct saved_backward {
  using backward_type = BP;
  using values_type = Values;
  static constexpr std::size_t size = decltype(hana::size(std::declval<Values>()))::value;
  BP backward;    // a backward_plan whose entries read saved1, saved2, … as inputs
  Values values;  // the forward's subtrees they stand for (saved<i> is values[i-1])
  bool exact;     // every read of a value's type reads that value (else: recompute)
};

// save_for_backward(plan) -> saved_backward (see the top of this file).
template <class P>
  requires is_node<P>
constexpr auto save_for_backward(P const& plan) {
  static_assert(!has_select<P>(),
                "lina::save_for_backward: resolve the plan's selects first (with_resolved_plan): the values kept "
                "are those of the order that runs");
  auto const bp = gradient(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  using Kept = typename detail::kept_of<P, BP>::type;
  constexpr bool no_clash = []<class... I>(detail::type_list<I...>) {
    return (!detail::is_saved_name(I::name.view()) && ...);
  }(inputs_of<P>{});
  static_assert(diagnose::saved_names<no_clash>::ok || true);

  auto const backward = hana::unpack(bp.entries, [&](auto const&... e) {
    return backward_plan<P, gradient_entry<typename std::remove_cvref_t<decltype(e)>::input,
                                           decltype(detail::read_saved<P, Kept>(e.expr))>...>{
        plan, hana::make_basic_tuple(gradient_entry<typename std::remove_cvref_t<decltype(e)>::input,
                                                    decltype(detail::read_saved<P, Kept>(e.expr))>{
                  detail::read_saved<P, Kept>(e.expr)}...)};
  });
  // Each value from its first read; a later read of its type must carry its values.
  typename detail::kept_values<P, Kept>::type values{};
  std::array<bool, Kept::size + 1> seen{};
  bool exact = true;
  auto note = [&]<class X>(X const& x) {
    constexpr std::size_t i = detail::index_of_v<X, Kept>;
    if (!seen[i]) {
      hana::at_c<i>(values) = x;
      seen[i] = true;
    } else if (!same_value(hana::at_c<i>(values), x)) {
      exact = false;
    }
  };
  hana::for_each(bp.entries, [&](auto const& e) { detail::for_each_kept<P>(e.expr, note); });
  return saved_backward<std::remove_cvref_t<decltype(backward)>, decltype(values)>{backward, values, exact};
}

// The saved form as text: its backward plan, then what each saved<i> is.
template <class BP, class Values>
std::string to_string(saved_backward<BP, Values> const& s) {
  std::string out = to_string(s.backward);
  std::size_t i = 0;
  hana::for_each(s.values, [&](auto const& x) { out += "saved" + std::to_string(++i) + " = " + to_string(x) + "\n"; });
  return out;
}

}  // namespace lina
