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
    rule(causal(s_ * x_), s_ * causal(x_)),                  //
    rule(normalize_(x_) * y_, one_pass_normalize));

// ---- 2. product chains ------------------------------------------------------
template <class X>
constexpr auto factors(X const& x) {
  if constexpr (std::is_same_v<typename X::op_type, op::chain>)
    return hana::to_tuple(x.kids);
  else
    return hana::make_tuple(x);
}
inline constexpr auto make_chain = [](auto const& b) {
  return hana::unpack(hana::concat(factors(get<0>(b)), factors(get<1>(b))),
                      [](auto const&... f) { return make_node(op::chain{}, f...); });
};

inline constexpr auto flatten_rules = hana::make_tuple(rule(x_ * y_, make_chain));

// ---- 3. ordering ------------------------------------------------------------
// causal(A * B) * C as a prefix scan: row i is A_i^T sum_{j<=i} B^T_j C_j^T.
template <class A, class B, class C>
constexpr auto prefix_contract(A const& a, B const& b, C const& c) {
  auto bt = rewrite::rewrite(canonical_rules, transpose(b));
  return build::contract(a, build::prefix(build::outer(bt, c)));
}

// The ways to multiply two bracketed operands.
template <class L, class R>
constexpr auto combine(L const& l, R const& r) {
  auto m = match(causal(x_ * y_), l);
  if constexpr (decltype(hana::is_just(m))::value)
    return hana::make_tuple(make_node(op::product{}, l, r), prefix_contract(get<0>(m.value()), get<1>(m.value()), r));
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
    return hana::make_tuple(hana::at_c<I>(f));
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
    auto cands = brackets<0, std::remove_cvref_t<decltype(ch)>::arity>(ch.kids);
    using choice = chain_choice<O, Key, Model, std::remove_cvref_t<decltype(cands)>>;
    return build_choice<choice, Key, 0>(cands);
  }
};

template <order O, class Key, class Model>
inline constexpr auto ordering_rules = hana::make_tuple(rule(any_node<op::chain>, order_chain<O, Key, Model>{}));

}  // namespace rules

namespace detail {
// The sequence dimension: the base dimension named most often by the inputs'
// shapes (N in Q(N,D), K(N,D), V(N,M)). The cost model varies it; an N x N
// matrix is one whose rows and columns are both this dimension.
template <class Inputs, class Dims>
struct sequence_dim_impl;
template <class... I, class... D>
struct sequence_dim_impl<type_list<I...>, type_list<D...>> {
  template <class X>
  static constexpr std::size_t uses = ((std::is_same_v<typename I::rows, X> + std::is_same_v<typename I::cols, X>) + ...);
  static constexpr std::array<std::size_t, sizeof...(D)> counts{uses<D>...};
  static constexpr std::size_t best = [] {
    std::size_t b = 0;
    for (std::size_t i = 1; i < counts.size(); ++i)
      if (counts[i] > counts[b]) b = i;
    return b;
  }();
  using type = std::tuple_element_t<best, std::tuple<D...>>;
};
}  // namespace detail

template <class E>
using sequence_dim = typename detail::sequence_dim_impl<inputs_of<E>, dims_of<E>>::type;

namespace diagnose {
template <bool HasExp, bool HasSquare>
struct linear_order {
  static_assert(!HasExp,
                "lina: compile<order::linear>: exp(...) has no finite feature map, so softmax attention "
                "cannot be evaluated in linear order; use order::automatic, or a feature map such as "
                "phi<elu_plus_one> (or favor<m> to approximate softmax)");
  static_assert(HasExp || !HasSquare,
                "lina: compile<order::linear>: no evaluation order avoids an N x N matrix here (the result "
                "or an unmasked similarity that is not multiplied on is N x N); use order::automatic");
  static constexpr bool ok = !HasExp && !HasSquare;
};
}  // namespace diagnose

// compile<order, CostModel>(expr) -> plan (a node tree in the plan vocabulary).
template <order O = order::automatic, class Model = default_cost_model, class E>
  requires is_node<E>
constexpr auto compile(E const& e) {
  using Key = sequence_dim<E>;
  auto canonical = rewrite::rewrite(rules::canonical_rules, e);
  auto chains = rewrite::rewrite(rules::flatten_rules, canonical);
  auto plan = rewrite::rewrite(rules::ordering_rules<O, Key, Model>, chains);
  if constexpr (O == order::linear) {
    using P = decltype(plan);
    static_assert(diagnose::linear_order<contains_op<P, op::exp>(), has_square<P, Key>()>::ok || true);
  }
  return plan;
}

}  // namespace lina
