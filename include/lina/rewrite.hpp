// A small term-rewriting engine over node trees, in the style of Halide's
// rewrite tables: a rule is (pattern, replacement, condition); patterns are
// ordinary expressions built with the DSL over pattern variables x_, y_, z_;
// rules are tried in order and the first match wins; rewriting goes bottom-up
// to a fixed point, with a static_assert on the number of rounds.
//
//   rule(transpose(transpose(x_)), x_)
//   rule(transpose(x_ * y_),       transpose(y_) * transpose(x_))
//   rule(causal_(s_ * x_),         s_ * causal_(x_))
//
// Matching is decided on types alone (Hana's optional: just/nothing are
// distinct types), so which rule fires is known at compile time; the values
// carried along are the few scalars nodes hold (scale factors, eps).
#pragma once

#include <boost/hana/all_of.hpp>
#include <boost/hana/at_key.hpp>
#include <boost/hana/contains.hpp>
#include <boost/hana/keys.hpp>
#include <boost/hana/bool.hpp>
#include <boost/hana/integral_constant.hpp>
#include <boost/hana/map.hpp>
#include <boost/hana/optional.hpp>
#include <boost/hana/pair.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/size.hpp>
#include <boost/hana/union.hpp>
#include <boost/hana/unpack.hpp>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "lina/node.hpp"

namespace lina::rewrite {

namespace hana = boost::hana;

// A node's kids as a Hana tuple, for the algorithms (zip, concat) over them.
template <class N>
constexpr auto kids_tuple(N const& n) {
  return unpack_kids(n, [](auto const&... k) { return hana::make_tuple(k...); });
}

// ---- pattern variables -----------------------------------------------------
// var<I>: matches any subexpression and binds it to I.
template <int I>
struct var {
  static constexpr int index = I;
  template <class...>
  using shape_of = any_shape;
};
// op_var<I, Op>: matches a node whose op is an Op (of any value) and binds the
// op value to I, e.g. the factor of a scale or the eps of a normalize.
template <class Op, class... S>
struct shape_apply;
template <class Op, class S>
struct shape_apply<Op, S> {
  using type = typename Op::template shape_of<S>;
};
template <class Op, class S1, class S2>
struct shape_apply<Op, S1, S2> {
  using type = typename Op::template shape_of<S1, S2>;
};
template <int I, class Op>
struct op_var {
  static constexpr int index = I;
  using op = Op;
  template <class... S>
  using shape_of = typename shape_apply<Op, S...>::type;
};
// kind<I, Op>: matches any node whose op is an Op, whatever its kids (n-ary
// nodes such as chain), and binds the whole node to I.
template <int I, class Op>
struct kind {
  static constexpr int index = I;
  using op = Op;
  template <class...>
  using shape_of = any_shape;
};

template <class T>
inline constexpr bool is_var = false;
template <int I>
inline constexpr bool is_var<var<I>> = true;
template <class T>
inline constexpr bool is_op_var = false;
template <int I, class Op>
inline constexpr bool is_op_var<op_var<I, Op>> = true;
template <class T>
inline constexpr bool is_kind = false;
template <int I, class Op>
inline constexpr bool is_kind<kind<I, Op>> = true;

inline constexpr node<var<0>> x_{};
inline constexpr node<var<1>> y_{};
inline constexpr node<var<2>> z_{};

// A scalar pattern: `s_ * x_` matches any scale node and binds its factor.
template <int I>
struct scalar_var {
  template <class X>
    requires is_node<X>
  friend constexpr auto operator*(scalar_var, X const& x) {
    return make_node(op_var<I, op::scale>{}, x);
  }
};
inline constexpr scalar_var<10> s_{};
inline constexpr scalar_var<11> t_{};

// normalize_(x_) matches normalize with any eps, binding the op to 12.
template <class X>
constexpr auto normalize_(X const& x) {
  return make_node(op_var<12, op::normalize>{}, x);
}
// causal_(x_) matches a causal mask of any decay (same_op_family), binding the op to 14;
// prefix_(x_), suffix_(x_) a scan of any decay, binding it to 15.
template <class X>
constexpr auto causal_(X const& x) {
  return make_node(op_var<14, op::causal>{}, x);
}
template <class X>
constexpr auto prefix_(X const& x) {
  return make_node(op_var<15, op::prefix_scan>{}, x);
}
template <class X>
constexpr auto suffix_(X const& x) {
  return make_node(op_var<15, op::suffix_scan>{}, x);
}
// any_node<Op>: matches any node of kind Op, bound to 13.
template <class Op>
inline constexpr node<kind<13, Op>> any_node{};

// ---- bindings --------------------------------------------------------------
template <int I, class B>
constexpr auto const& get(B const& b) {
  return b[hana::int_c<I>];
}
template <int I, class B>
constexpr auto const& get(B const& b, node<var<I>>) {
  return b[hana::int_c<I>];
}

// ---- matching ----------------------------------------------------------------
// Sound before clever (Halide's IRMatch): a variable that occurs twice in a
// pattern matches only equal subtrees, and a pattern never fixes an op's value.
// Matching is decided on types, so "equal" must be decidable from types: two
// occurrences match when they are the same type and carry no values (every op
// empty); same-typed subtrees with values (a scale factor, an eps) could
// differ at run time, so such a pattern does not match them.
namespace diagnose {
template <bool ValueFree>
struct pattern_op_value {
  static_assert(ValueFree,
                "lina::rewrite: a pattern node carries a value (a scale factor, an eps) that matching would ignore; "
                "match the op with an op variable (s_ * x_, normalize_(x_), causal_(x_)) and use its value in the "
                "replacement");
  static constexpr bool ok = ValueFree;
};
}  // namespace diagnose

template <class P, class E>
constexpr auto match(P const& p, E const& e);

// Add the bindings of one kid to those so far; a variable bound twice must
// be bound to equal subtrees.
template <class Acc, class New>
constexpr auto merge_bindings(Acc const& acc, New const& m) {
  auto consistent = hana::all_of(hana::keys(m), [&](auto key) {
    if constexpr (decltype(hana::contains(acc, key))::value) {
      using A = std::remove_cvref_t<decltype(acc[key])>;
      using B = std::remove_cvref_t<decltype(m[key])>;
      if constexpr (std::is_same_v<A, B> && is_node<A>)
        return hana::bool_c<value_free<A>()>;
      else
        return hana::false_c;
    } else {
      return hana::true_c;
    }
  });
  if constexpr (decltype(consistent)::value)
    return hana::just(hana::union_(acc, m));
  else
    return hana::nothing;
}

template <std::size_t I, std::size_t N, class Acc, class P, class E>
constexpr auto match_kids(Acc const& acc, P const& p, E const& e) {
  if constexpr (I == N) {
    return hana::just(acc);
  } else {
    auto m = match(kid<I>(p), kid<I>(e));
    if constexpr (decltype(hana::is_nothing(m))::value) {
      return hana::nothing;
    } else {
      auto merged = merge_bindings(acc, m.value());
      if constexpr (decltype(hana::is_nothing(merged))::value)
        return hana::nothing;
      else
        return match_kids<I + 1, N>(merged.value(), p, e);
    }
  }
}

template <class P, class E>
constexpr auto match(P const& p, E const& e) {
  using POp = typename P::op_type;
  using EOp = typename E::op_type;
  if constexpr (is_var<POp>) {
    return hana::just(hana::make_map(hana::make_pair(hana::int_c<POp::index>, e)));
  } else if constexpr (is_kind<POp>) {
    if constexpr (std::is_same_v<typename POp::op, EOp>)
      return hana::just(hana::make_map(hana::make_pair(hana::int_c<POp::index>, e)));
    else
      return hana::nothing;
  } else if constexpr (!diagnose::pattern_op_value<std::is_empty_v<POp>>::ok) {
    return hana::nothing;  // diagnosed above
  } else if constexpr (P::arity != E::arity) {
    return hana::nothing;
  } else if constexpr (is_op_var<POp>) {
    if constexpr (same_op_family<typename POp::op, EOp>)
      return match_kids<0, P::arity>(hana::make_map(hana::make_pair(hana::int_c<POp::index>, e.op)), p, e);
    else
      return hana::nothing;
  } else if constexpr (std::is_same_v<POp, EOp>) {
    return match_kids<0, P::arity>(hana::make_map(), p, e);
  } else {
    return hana::nothing;
  }
}

// ---- substitution ----------------------------------------------------------
template <class P, class B>
constexpr auto subst(P const& p, B const& b) {
  using POp = typename P::op_type;
  if constexpr (is_var<POp> || is_kind<POp>) {
    return b[hana::int_c<POp::index>];
  } else {
    auto op = [&] {
      if constexpr (is_op_var<POp>)
        return b[hana::int_c<POp::index>];
      else
        return p.op;
    }();
    return unpack_kids(p, [&](auto const&... k) { return make_node(op, subst(k, b)...); });
  }
}

// ---- rules -----------------------------------------------------------------
struct always {
  template <class B>
  constexpr auto operator()(B const&) const {
    return hana::true_c;
  }
};

template <class Pattern, class Replacement, class Condition>
struct rule_t {
  Pattern pattern;
  Replacement replacement;  // a pattern to substitute, or a callable on the bindings
  Condition condition;      // callable on the bindings, returning a compile-time bool
};

template <class P, class R, class C = always>
constexpr rule_t<P, R, C> rule(P p, R r, C c = {}) {
  return {p, r, c};
}

template <class Rule, class E>
constexpr auto try_rule(Rule const& r, E const& e) {
  auto m = match(r.pattern, e);
  if constexpr (decltype(hana::is_nothing(m))::value) {
    return hana::nothing;
  } else {
    auto const& b = m.value();
    if constexpr (!decltype(r.condition(b))::value) {
      return hana::nothing;
    } else if constexpr (is_node<std::remove_cvref_t<decltype(r.replacement)>>) {
      return hana::just(subst(r.replacement, b));
    } else {
      return hana::just(r.replacement(b));
    }
  }
}

// Whether a pattern's root can match a node's, from the two types alone: the
// first test of match(), without instantiating it. Most rules of a table fail
// here, at most nodes; skipping them keeps match(), its bindings and the
// rule's condition out of the compiler's way (try_rule was a fifth of the
// front end of a test file of gradients). A pattern op carrying a value goes
// on to match(), which diagnoses it. (A function: as a variable template
// initialised by a lambda, under GCC 12, examples/orderings printed the default
// cost model's causal crossover for cpu::cost_model's.)
template <class P, class E>
constexpr bool root_may_match() {
  using POp = typename P::op_type;
  using EOp = typename E::op_type;
  if constexpr (is_var<POp>)
    return true;
  else if constexpr (is_kind<POp>)
    return std::is_same_v<typename POp::op, EOp>;
  else if constexpr (!std::is_empty_v<POp>)
    return true;
  else if constexpr (P::arity != E::arity)
    return false;
  else if constexpr (is_op_var<POp>)
    return same_op_family<typename POp::op, EOp>;
  else
    return std::is_same_v<POp, EOp>;
}

// First matching rule wins; nothing if none matches.
template <std::size_t I, class Rules, class E>
constexpr auto apply_first(Rules const& rules, E const& e) {
  if constexpr (I == decltype(hana::size(rules))::value) {
    return hana::nothing;
  } else {
    auto const& rule = hana::at_c<I>(rules);
    if constexpr (!root_may_match<std::remove_cvref_t<decltype(rule.pattern)>, E>()) {
      return apply_first<I + 1>(rules, e);
    } else {
      auto r = try_rule(rule, e);
      if constexpr (decltype(hana::is_just(r))::value)
        return r;
      else
        return apply_first<I + 1>(rules, e);
    }
  }
}

// Rounds of rewriting at one node before giving up: a rule table that cycles
// is a bug in the table, reported here rather than as a compiler stack overflow.
inline constexpr std::size_t max_rounds = 64;

// Bottom-up to a fixed point: kids first, then the first matching rule at this
// node, then again on what it produced.
template <std::size_t Round, class Rules, class E>
constexpr auto rewrite_node(Rules const& rules, E const& e);

// Rewriting that leaves a tree's type as it was leaves its values as they
// were: rules match on types alone, so a rule that fired on a node of a type
// would fire again on its result of the same type until max_rounds. Such a
// subtree is returned as it is, without code for its nodes (the type is
// found at compile time; the function that found it is never called).
template <class Rules, class E>
constexpr auto rewrite(Rules const& rules, E const& e) {
  if constexpr (std::is_same_v<decltype(rewrite_node<0>(rules, e)), E>)
    return e;
  else
    return rewrite_node<0>(rules, e);
}

template <std::size_t Round, class Rules, class E>
constexpr auto rewrite_node(Rules const& rules, E const& e) {
  static_assert(Round < max_rounds,
                "lina: the rewrite rules did not reach a fixed point (a rule table cycles); "
                "this is a bug in lina, please report the expression");
  auto e1 = unpack_kids(e, [&](auto const&... k) { return make_node(e.op, rewrite(rules, k)...); });
  auto r = apply_first<0>(rules, e1);
  if constexpr (decltype(hana::is_just(r))::value)
    return rewrite_node<Round + 1>(rules, r.value());
  else
    return e1;
}

}  // namespace lina::rewrite
