// compile(expr): expression -> plan, entirely at compile time.
//
// Three rule tables run one after the other, each bottom-up to a fixed point:
//   1. canonical_rules: push transposes to the leaves, hoist scale factors,
//      and turn normalize(S)*V into one pass over [V|1] (numerator and
//      normaliser together) followed by a row division;
//   2. flatten_rules: products become n-ary chains of factors;
//   3. ordering_rules: each chain is bracketed by the cost model. Candidates
//      are all bracketings; a causal(A*B)*C pair may also become the prefix
//      scan  contract_rows(A, prefix_scan(outer_rows(B^T, C)))  (row i reads
//      A_i and the running sum of B_j C_j^T, j <= i). With every extent static
//      the cheapest candidate is chosen here; with a dynamic sequence length
//      the candidates that win somewhere become an op::select on that length.
//
// compile<order::quadratic> keeps a candidate with an N x N intermediate where
// one exists; compile<order::linear> refuses (static_assert) when none exists
// without one, e.g. for exp, which has no finite feature map.
#pragma once

#include <array>
#include <boost/hana/concat.hpp>
#include <boost/hana/flatten.hpp>
#include <boost/hana/transform.hpp>
#include <boost/hana/tuple.hpp>
#include <cstddef>
#include <tuple>
#include <utility>

#include "lina/cost.hpp"
#include "lina/expr.hpp"
#include "lina/node.hpp"
#include "lina/rewrite.hpp"

namespace lina {

namespace hana = boost::hana;

enum class order {
  automatic,  // cheapest by the cost model, per sequence length
  quadratic,  // materialise the N x N similarity where there is one
  linear,     // never materialise an N x N matrix; a compile error where impossible
};

namespace rules {
using namespace rewrite;

// ---- 1. canonical form ----------------------------------------------------
inline constexpr auto merge_scales = [](auto const& b) {
  return make_node(op::scale{get<10>(b).factor * get<11>(b).factor}, get<0>(b));
};
// normalize(S) * V = diag(S 1 + eps)^-1 S V: the last column of S [V|1] is the
// normaliser, so numerator and denominator come out of the same pass.
inline constexpr auto one_pass_normalize = [](auto const& b) {
  return make_node(op::row_divide{get<12>(b).eps}, get<0>(b) * make_node(op::append_ones{}, get<1>(b)));
};

inline constexpr auto canonical_rules = hana::make_tuple(
    rule(transpose(transpose(x_)), x_),                      //
    rule(transpose(x_ * y_), transpose(y_) * transpose(x_)),  //
    rule(transpose(s_ * x_), s_ * transpose(x_)),            //
    rule(s_ * (t_ * x_), merge_scales),                      //
    rule((s_ * x_) * y_, s_ * (x_ * y_)),                    //
    rule(x_ * (s_ * y_), s_ * (x_ * y_)),                    //
    rule(causal_(s_ * x_), s_ * causal_(x_)),                //
    rule(normalize_(x_) * y_, one_pass_normalize));

// ---- 2. product chains ------------------------------------------------------
template <class X>
constexpr auto factors(X const& x) {
  if constexpr (std::is_same_v<typename X::op_type, op::chain>)
    return rewrite::kids_tuple(x);
  else
    return hana::make_tuple(x);
}
inline constexpr auto make_chain = [](auto const& b) {
  return hana::unpack(hana::concat(factors(get<0>(b)), factors(get<1>(b))),
                      [](auto const&... f) { return make_node(op::chain{}, f...); });
};

inline constexpr auto flatten_rules = hana::make_tuple(rule(x_ * y_, make_chain));

// ---- 3. ordering ------------------------------------------------------------
// causal(A * B) * C as a prefix scan: row i is A_i^T sum_{j<=i} g^(i-j) B^T_j C_j^T
// (g the mask's decay).
template <class A, class B, class C, class D>
constexpr auto prefix_contract(A const& a, B const& b, C const& c, D decay) {
  auto bt = rewrite::rewrite(canonical_rules, transpose(b));
  return build::contract(a, build::prefix(build::outer(bt, c), decay));
}

// The ways to multiply two bracketed operands.
template <class L, class R>
constexpr auto combine(L const& l, R const& r) {
  auto m = match(causal_(x_ * y_), l);
  if constexpr (decltype(hana::is_just(m))::value)
    return hana::make_tuple(make_node(op::product{}, l, r),
                            prefix_contract(get<0>(m.value()), get<1>(m.value()), r, decay_of(get<14>(m.value()))));
  else
    return hana::make_tuple(make_node(op::product{}, l, r));
}

template <std::size_t I, std::size_t J, class F>
constexpr auto brackets(F const& f);

template <std::size_t I, std::size_t S, std::size_t J, class F>
constexpr auto split_at(F const& f) {
  auto ls = brackets<I, S>(f);
  auto rs = brackets<S, J>(f);
  return hana::flatten(hana::transform(
      ls, [&](auto const& l) { return hana::flatten(hana::transform(rs, [&](auto const& r) { return combine(l, r); })); }));
}

// Every bracketing of factors [I, J), with every way to multiply each pair.
template <std::size_t I, std::size_t J, class F>
constexpr auto brackets(F const& f) {
  if constexpr (J - I == 1) {
    return hana::make_tuple(kid<I>(f));
  } else {
    return [&]<std::size_t... S>(std::index_sequence<S...>) {
      return hana::flatten(hana::make_tuple(split_at<I, I + 1 + S, J>(f)...));
    }(std::make_index_sequence<J - I - 1>{});
  }
}

// Extents seen by the cost model while deciding: the sequence dimension at a
// sample length n, other dynamic dimensions at the model's assumed extent.
template <class Key, class Model>
struct sample_extents {
  double n;
  template <class D>
  constexpr double get() const {
    return std::is_same_v<D, Key> ? n : Model::assumed_extent;
  }
};

// Which candidate wins at which sequence length.
template <order O, class Key, class Model, class Cands>
struct chain_choice;
template <order O, class Key, class Model, class... C>
struct chain_choice<O, Key, Model, hana::tuple<C...>> {
  static constexpr std::size_t count = sizeof...(C);

  static constexpr std::array<bool, count> allowed = [] {
    std::array<bool, count> sq{has_square<C, Key>()...}, ok{};
    bool any_sq = false, any_lin = false;
    for (bool s : sq) (s ? any_sq : any_lin) = true;
    for (std::size_t i = 0; i < count; ++i)
      ok[i] = O == order::automatic                   ? true
              : O == order::quadratic                 ? (sq[i] || !any_sq)
                                                      : (!sq[i] || !any_lin);
    return ok;
  }();

  static constexpr std::size_t best_at(double n) {
    sample_extents<Key, Model> s{n};
    std::array<double, count> w{Model::weight(cost_of<C>(s, Model::bytes_per_element))...};
    std::size_t best = count;
    for (std::size_t i = 0; i < count; ++i)
      if (allowed[i] && (best == count || w[i] < w[best])) best = i;
    return best;
  }

  struct piece {
    std::size_t index = 0;  // candidate
    std::size_t from = 0;   // first sequence length where it is chosen
  };
  static constexpr std::size_t max_pieces = 8;
  // Largest sequence length probed; beyond it the last winner is kept.
  static constexpr double max_length = 1099511627776.0;  // 2^40

  struct pieces_t {
    std::array<piece, max_pieces> p{};
    std::size_t size = 0;
  };
  static constexpr pieces_t pieces = [] {
    pieces_t r;
    std::size_t cur = best_at(1);
    r.p[r.size++] = {cur, 0};
    if (Key::is_static) return r;  // decided at compile time: one piece
    for (double lo = 1, hi = 2; hi <= max_length && r.size < max_pieces; lo = hi, hi *= 2) {
      if (best_at(hi) == cur) continue;
      while (hi - lo > 1) {  // first length where `cur` stops winning
        double mid = lo + static_cast<double>(static_cast<std::size_t>((hi - lo) / 2));
        (best_at(mid) == cur ? lo : hi) = mid;
      }
      cur = best_at(hi);
      r.p[r.size++] = {cur, static_cast<std::size_t>(hi)};
    }
    return r;
  }();
};

template <class Choice, class Key, std::size_t P, class Cands>
constexpr auto build_choice(Cands const& c) {
  constexpr auto pieces = Choice::pieces;
  if constexpr (P + 1 == pieces.size)
    return hana::at_c<pieces.p[P].index>(c);
  else
    return make_node(op::select<Key, pieces.p[P + 1].from>{}, hana::at_c<pieces.p[P].index>(c),
                     build_choice<Choice, Key, P + 1>(c));
}

template <order O, class Key, class Model>
struct order_chain {
  template <class B>
  constexpr auto operator()(B const& b) const {
    auto const& ch = get<13>(b);
    auto cands = brackets<0, std::remove_cvref_t<decltype(ch)>::arity>(ch);
    using choice = chain_choice<O, Key, Model, std::remove_cvref_t<decltype(cands)>>;
    return build_choice<choice, Key, 0>(cands);
  }
};

template <order O, class Key, class Model>
inline constexpr auto ordering_rules = hana::make_tuple(rule(any_node<op::chain>, order_chain<O, Key, Model>{}));

}  // namespace rules

namespace detail {
// The sequence dimension, found from the expression's structure (never by
// counting how often a dimension is named). Tokens are the rows of inputs
// (Q(N,D): N tokens of D features); `token_axes` follows which axes of each
// node still run over tokens (transpose swaps them, φ keeps the rows, a
// product keeps A's rows and B's columns). The sequence is
//   1. the dimension a causal mask runs over; else
//   2. the dimension of a similarity: a product whose rows and columns both
//      run over tokens (φQ·φKᵀ, N x N); else
//   3. the dimension a product sums over tokens (φKᵀ·V sums over N); else
//   4. the rows of the inputs, when all inputs have the same rows.
// Where these give no single dimension, the user names it: compile(e, N).
// The cost model varies this dimension; an N x N matrix is one whose rows
// and columns are both this dimension.
template <class N>
struct token_axes {  // ops that keep their kid's axes (causal, normalize, scale, exp)
  static constexpr bool rows = token_axes<std::remove_cvref_t<decltype(kid<0>(std::declval<N>()))>>::rows;
  static constexpr bool cols = token_axes<std::remove_cvref_t<decltype(kid<0>(std::declval<N>()))>>::cols;
};
template <fixed_string Name, class R, class C>
struct token_axes<node<op::input<Name, R, C>>> {
  static constexpr bool rows = true, cols = false;
};
template <class X>
struct token_axes<node<op::transpose, X>> {
  static constexpr bool rows = token_axes<X>::cols, cols = token_axes<X>::rows;
};
template <class Map, class X, class... W>
struct token_axes<node<op::phi<Map>, X, W...>> {
  static constexpr bool rows = token_axes<X>::rows, cols = false;
};
template <class A, class B>
struct token_axes<node<op::product, A, B>> {
  static constexpr bool rows = token_axes<A>::rows, cols = token_axes<B>::cols;
};

// Per node type X: the dimensions X contributes under rules 1, 2 and 3.
template <class X>
struct sequence_evidence {
  using causal = type_list<>;
  using similarity = type_list<>;
  using summed = type_list<>;
};
template <class D, class K>
struct sequence_evidence<node<op::causal_t<D>, K>> {
  using causal = type_list<typename K::shape::rows>;
  using similarity = type_list<>;
  using summed = type_list<>;
};
template <class A, class B>
struct sequence_evidence<node<op::product, A, B>> {
  using S = typename node<op::product, A, B>::shape;
  static constexpr bool square = token_axes<A>::rows && token_axes<B>::cols && std::is_same_v<typename S::rows, typename S::cols>;
  static constexpr bool sums = token_axes<A>::cols && token_axes<B>::rows;
  using causal = type_list<>;
  using similarity = std::conditional_t<square, type_list<typename S::rows>, type_list<>>;
  using summed = std::conditional_t<sums, type_list<typename A::shape::cols>, type_list<>>;
};

template <class Inputs>
struct rows_of_inputs;
template <class... I>
struct rows_of_inputs<type_list<I...>> {
  using type = typename merge_unique<type_list<>, type_list<typename I::rows...>>::type;
};

template <class Nodes, class InputRows>
struct sequence_candidates_impl;
template <class... X, class InputRows>
struct sequence_candidates_impl<type_list<X...>, InputRows> {
  template <class... L>
  using distinct = typename merge_unique<type_list<>, typename concat_lists<L...>::type>::type;
  using causal = distinct<typename sequence_evidence<X>::causal...>;
  using similarity = distinct<typename sequence_evidence<X>::similarity...>;
  using summed = distinct<typename sequence_evidence<X>::summed...>;
  using type = std::conditional_t<
      (causal::size > 0), causal,
      std::conditional_t<(similarity::size > 0), similarity, std::conditional_t<(summed::size > 0), summed, InputRows>>>;
};

template <class E>
struct sequence_candidates {
  using type = typename sequence_candidates_impl<typename all_nodes<std::remove_cvref_t<E>>::type,
                                                 typename rows_of_inputs<lina::inputs_of<E>>::type>::type;
};
}  // namespace detail

namespace diagnose {
template <std::size_t Candidates>
struct sequence_dimension {
  static_assert(Candidates == 1,
                "lina: compile(e): the sequence dimension cannot be told from the expression's structure (no "
                "causal mask, similarity or sum over tokens names exactly one dimension, and the inputs' rows "
                "differ); name it: compile(e, N)");
  static constexpr bool ok = Candidates == 1;
};
}  // namespace diagnose

namespace detail {
template <class List>
struct sole_or_void {
  using type = void;
};
template <class D>
struct sole_or_void<type_list<D>> {
  using type = D;
};
}  // namespace detail

// The sequence dimension of an expression (see detail::sequence_candidates);
// void when it must be named.
template <class E>
using sequence_dim = typename detail::sole_or_void<typename detail::sequence_candidates<E>::type>::type;

namespace diagnose {
template <bool HasExp, bool HasSquare>
struct linear_order {
  static_assert(!HasExp,
                "lina: compile<order::linear>: exp(...) has no finite feature map, so softmax attention "
                "cannot be evaluated in linear order; use order::automatic, or a feature map such as "
                "phi<elu_plus_one> (or phi<favor>(Q, W) to approximate softmax)");
  static_assert(HasExp || !HasSquare,
                "lina: compile<order::linear>: no evaluation order avoids an N x N matrix here (the result "
                "or an unmasked similarity that is not multiplied on is N x N); use order::automatic");
  static constexpr bool ok = !HasExp && !HasSquare;
};
}  // namespace diagnose

// compile<order, CostModel>(expr) -> plan (a node tree in the plan vocabulary);
// compile(expr, N) names the sequence dimension where the structure does not
// tell it (see sequence_dim).
namespace detail {
// The three rule tables applied in turn: compile's work, before its checks.
template <order O, class Model, class E, class Key>
constexpr auto ordered(E const& e, Key) {
  auto canonical = rewrite::rewrite(rules::canonical_rules, e);
  auto chains = rewrite::rewrite(rules::flatten_rules, canonical);
  return rewrite::rewrite(rules::ordering_rules<O, Key, Model>, chains);
}
template <class P, class Key>
inline constexpr bool is_linear_order = !contains_op<P, op::exp>() && !has_square<P, Key>();
}  // namespace detail

template <order O = order::automatic, class Model = default_cost_model, class E, class Key>
  requires(is_node<E> && concepts::base_dimension<Key>)
constexpr auto compile(E const& e, Key key) {
  auto plan = detail::ordered<O, Model>(e, key);
  if constexpr (O == order::linear) {
    using P = decltype(plan);
    static_assert(diagnose::linear_order<contains_op<P, op::exp>(), has_square<P, Key>()>::ok || true);
  }
  return plan;
}

// Does compile<order::linear>(e, key) compile (no exp, no N x N left)? For
// code that tries every order where it exists (lina::check).
template <class E, class Key>
inline constexpr bool has_linear_order =
    detail::is_linear_order<decltype(detail::ordered<order::linear, default_cost_model>(std::declval<E const&>(), Key{})),
                            Key>;

template <order O = order::automatic, class Model = default_cost_model, class E>
  requires is_node<E>
constexpr auto compile(E const& e) {
  using candidates = typename detail::sequence_candidates<E>::type;
  if constexpr (!diagnose::sequence_dimension<candidates::size>::ok)
    return e;  // diagnosed above
  else
    return compile<O, Model>(e, detail::front_t<candidates>{});
}

}  // namespace lina
