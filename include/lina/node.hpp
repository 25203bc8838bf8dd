// The one node type of lina, and the vocabulary of operations.
//
// An expression or a plan is a tree of node<Op, Kids...> values. The type
// carries the structure (operation tags, input names, dimensions); the value
// carries only the few scalars an operation needs (a scale factor, an eps).
// Data is never stored: tensors are bound to input symbols at evaluation.
//
// The same vocabulary serves expressions (what users write), plans (what
// compile() produces) and backward plans (what gradient() produces); each op
// says which it belongs to in its comment. Backends dispatch on the op tag.
#pragma once

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/dims.hpp"
#include "lina/fixed_string.hpp"
#include "lina/tensor.hpp"

namespace lina {

namespace op {
// Shape rules: `shape_of<KidShapes...>` gives the node's shape.
template <class S>
using rows_of = typename S::rows;
template <class S>
using cols_of = typename S::cols;

// ---- expression vocabulary -------------------------------------------------
// A named input matrix (rows x cols) per batch and head.
template <fixed_string Name, class Rows, class Cols>
struct input {
  static constexpr auto name = Name;
  using rows = Rows;
  using cols = Cols;
  template <class...>
  using shape_of = matrix_shape<Rows, Cols>;
};
// The dimension C is a function of: X's columns, or a parameter's columns.
template <class X, class... P>
struct feature_base {
  using type = cols_of<X>;
};
template <class X, class P>
struct feature_base<X, P> {
  using type = cols_of<P>;
};
// φ applied to every row: (R x D) -> (R x C); a parametric map also reads W (D x m).
template <class Map>
struct phi {
  using map = Map;
  template <class X, class... P>
  using shape_of = matrix_shape<rows_of<X>, feature_dim_t<Map, typename feature_base<X, P...>::type>>;
};
struct transpose {
  template <class X>
  using shape_of = matrix_shape<cols_of<X>, rows_of<X>>;
};
// Matrix product; in a plan, its bracketing is the evaluation order.
struct product {
  template <class A, class B>
  using shape_of = matrix_shape<rows_of<A>, cols_of<B>>;
};
// The decay of a mask or a scan: none (the plain mask, an empty op, so the
// schedule merges equal subtrees by their type alone) or a run-time factor.
// A decay per head (RetNet's retention, ALiBi's slopes) is a third kind: a
// list, shared by the copies of a plan (so it cannot dangle), not a literal —
// an expression with one is built at run time. at(h) is head h's decay for
// every kind; a backend checks the list's length against the bound heads.
struct no_decay {
  static constexpr double decay = 1;
  static constexpr double at(std::size_t) { return 1; }
  friend constexpr bool operator==(no_decay, no_decay) { return true; }
};
struct decay_by {
  double decay = 1;
  constexpr double at(std::size_t) const { return decay; }
  friend constexpr bool operator==(decay_by const&, decay_by const&) = default;
};
struct decay_per_head {
  std::shared_ptr<std::vector<double> const> decays;
  double at(std::size_t h) const { return (*decays)[h]; }
  std::size_t heads() const { return decays->size(); }
  friend bool operator==(decay_per_head const& a, decay_per_head const& b) {
    return a.decays == b.decays || *a.decays == *b.decays;
  }
};
// Lower-triangular mask of a square matrix: keep decay^(i-j) S_ij for j <= i,
// zero above (decay = 1: the plain mask; < 1: RetNet-style decay of the past).
template <class Decay = no_decay>
struct causal_t : Decay {
  template <class X>
  using shape_of = X;
};
using causal = causal_t<>;
// Row normalisation: S_ij / (sum_k S_ik + eps).
struct normalize {
  double eps = 1e-6;
  friend constexpr bool operator==(normalize const&, normalize const&) = default;
  template <class X>
  using shape_of = X;
};
struct scale {
  double factor = 1;
  friend constexpr bool operator==(scale const&, scale const&) = default;
  template <class X>
  using shape_of = X;
};
// Element-wise exp: the softmax similarity, which has no finite feature map.
struct exp {
  template <class X>
  using shape_of = X;
};

// ---- rewrite-internal ------------------------------------------------------
// A flattened product chain A*B*C..., before the cost model brackets it.
template <class... T>
using last_of = std::tuple_element_t<sizeof...(T) - 1, std::tuple<T...>>;
struct chain {
  template <class First, class... Rest>
  using shape_of = matrix_shape<rows_of<First>, cols_of<last_of<First, Rest...>>>;
};

// ---- plan vocabulary -------------------------------------------------------
// [X | 1]: X with a ones column appended (R x (C+1)).
struct append_ones {
  template <class X>
  using shape_of = matrix_shape<rows_of<X>, plus_one<cols_of<X>>>;
};
// Divide each row's leading columns by its last column (+ eps), dropping it:
// the numerator/denominator split of normalize(S)*V computed in one pass.
struct row_divide {
  double eps = 1e-6;
  friend constexpr bool operator==(row_divide const&, row_divide const&) = default;
  template <class X>
  using shape_of = matrix_shape<rows_of<X>, minus_one_t<cols_of<X>>>;
};
// Row j of B (R x a) and of C (R x b) -> the a x b matrix B_j C_j^T, per row.
struct outer_rows {
  template <class B, class C>
  using shape_of = row_seq_shape<rows_of<B>, cols_of<B>, cols_of<C>>;
};
// Running sums over rows: S_i = sum_{j<=i} decay^(i-j) X_j (prefix) or
// sum_{j>=i} decay^(j-i) X_j (suffix). With a carried state the two differ at
// the boundary, as a map and its adjoint: a prefix scan decays the state it
// enters with before row 0 (S_i = decay S_{i-1} + X_i), a suffix scan adds
// it undecayed to its first row and leaves decay S_first (the gradient of
// the prefix scan's entering state).
template <class Decay = no_decay>
struct prefix_scan_t : Decay {
  template <class X>
  using shape_of = X;
};
template <class Decay = no_decay>
struct suffix_scan_t : Decay {
  template <class X>
  using shape_of = X;
};
using prefix_scan = prefix_scan_t<>;
using suffix_scan = suffix_scan_t<>;
// Transpose each per-row matrix.
struct transpose_rows {
  template <class X>
  using shape_of = row_seq_shape<typename X::rows, typename X::b, typename X::a>;
};
// Row contraction: out_i = A_i^T S_i, A (R x a), S a sequence of a x b.
struct contract_rows {
  template <class A, class S>
  using shape_of = matrix_shape<rows_of<A>, typename S::b>;
};

// ---- backward vocabulary (what gradient() adds) -------------------------------
// Row-wise vector-Jacobian product of φ: J_φ(X_i)^T G_i (φ'(X) ⊙ G when element-wise).
// Kids: X, G or X, W, G.
template <class Map>
struct phi_vjp {
  using vjp_of = Map;
  template <class X, class... R>
  using shape_of = X;
};
// Row-wise h_i with ∂L/∂W = Σ_i x_i h_iᵀ for a parametric map (kids X, W, G).
template <class Map>
struct phi_param_vjp {
  template <class X, class W, class G>
  using shape_of = matrix_shape<rows_of<X>, cols_of<W>>;
};
// A parametric map whose features are a function of Z = X·W (and of X)
// differentiates from their values (feature_maps.hpp, concepts::
// value_differentiable): H = ∂L/∂Z from W (for D and m), Φ = φ(X; W) and G,
// read by both gradients, ∂X = phi_dx(X, W, H) = H·Wᵀ plus the part not
// through Z, and ∂W = Xᵀ·H.
template <class Map>
struct phi_grad_z {
  template <class W, class P, class G>
  using shape_of = matrix_shape<rows_of<P>, cols_of<W>>;
};
template <class Map>
struct phi_dx {
  template <class X, class W, class H>
  using shape_of = X;
};
// The adjoint of normalize(S) at cotangent G: G_ij / d_i - (sum_k G_ik S_ik) / d_i^2.
struct normalize_vjp {
  double eps = 1e-6;
  friend constexpr bool operator==(normalize_vjp const&, normalize_vjp const&) = default;
  template <class S, class G>
  using shape_of = S;
};
// The adjoint of row_divide(Y) at cotangent G: G_e / d for the leading columns,
// -sum_e G_e Y_e / d^2 for the last one (d = last column + eps).
struct row_divide_vjp {
  double eps = 1e-6;
  friend constexpr bool operator==(row_divide_vjp const&, row_divide_vjp const&) = default;
  template <class Y, class G>
  using shape_of = Y;
};
struct hadamard {  // element-wise product
  template <class A, class B>
  using shape_of = A;
};
struct drop_last {  // X without its last column
  template <class X>
  using shape_of = matrix_shape<rows_of<X>, minus_one_t<cols_of<X>>>;
};
struct add {
  template <class A, class B>
  using shape_of = A;
};
// Several plans evaluated together (the gradients of one backward plan).
struct bundle {
  template <class First, class...>
  using shape_of = First;
};

// Run-time choice: the first kid while extent(Key) < Threshold, else the second.
template <class Key, std::size_t Threshold>
struct select {
  using key = Key;
  static constexpr std::size_t threshold = Threshold;
  template <class Small, class Large>
  using shape_of = Small;
};
}  // namespace op

template <class T>
inline constexpr bool is_input_op_v = false;
template <fixed_string N, class R, class C>
inline constexpr bool is_input_op_v<op::input<N, R, C>> = true;

// A node's kids: a plain aggregate, one member per kid, so that a node type
// instantiates no constructor (a Boost.Hana tuple's, one set per node type,
// made a third of the length of the names GCC mangles for a deep stack's
// gradient: docs/gradients.md).
template <class... K>
struct kid_list;
template <>
struct kid_list<> {};
template <class A>
struct kid_list<A> {
  [[no_unique_address]] A k0;
};
template <class A, class B>
struct kid_list<A, B> {
  [[no_unique_address]] A k0;
  [[no_unique_address]] B k1;
};
template <class A, class B, class C>
struct kid_list<A, B, C> {
  [[no_unique_address]] A k0;
  [[no_unique_address]] B k1;
  [[no_unique_address]] C k2;
};
template <class A, class B, class C, class D, class... R>
struct kid_list<A, B, C, D, R...> {  // (more: a bundle's or a chain's)
  [[no_unique_address]] A k0;
  [[no_unique_address]] B k1;
  [[no_unique_address]] C k2;
  [[no_unique_address]] kid_list<D, R...> rest;
};

template <class Op, class... Kids>
struct node {
  using op_type = Op;
  using shape = typename Op::template shape_of<typename Kids::shape...>;
  using kids_type = kid_list<Kids...>;
  static constexpr std::size_t arity = sizeof...(Kids);

  [[no_unique_address]] Op op{};
  [[no_unique_address]] kids_type kids{};

  // `Q = q` binds a tensor (a strided view, or a backend's own tensor) to an input symbol.
  template <class X, class O = Op>
    requires(is_input_op_v<O> && concepts::bindable<X>)
  constexpr auto operator=(X const& x) const {
    return make_binding<O::name>(x);
  }
};

namespace detail {
// Four kids and more, each list in its own braces (no brace elision: Clang
// warns of it).
template <class A, class B, class C, class D, class... R>
constexpr kid_list<A, B, C, D, R...> long_kid_list(A const& a, B const& b, C const& c, D const& d, R const&... r) {
  if constexpr (sizeof...(R) < 3)
    return {a, b, c, {d, r...}};
  else
    return {a, b, c, long_kid_list(d, r...)};
}
}  // namespace detail

template <class Op, class... Kids>
constexpr node<Op, Kids...> make_node(Op op, Kids const&... kids) {
  if constexpr (sizeof...(Kids) <= 3)
    return {op, {kids...}};
  else
    return {op, detail::long_kid_list(kids...)};
}

namespace detail {
template <std::size_t I, class L>
constexpr auto const& kid_at(L const& l) {
  if constexpr (I == 0)
    return l.k0;
  else if constexpr (I == 1)
    return l.k1;
  else if constexpr (I == 2)
    return l.k2;
  else
    return kid_at<I - 3>(l.rest);
}
}  // namespace detail

template <std::size_t I, class N>
constexpr auto const& kid(N const& n) {
  return detail::kid_at<I>(n.kids);
}
// f(kid<0>(n), kid<1>(n), ...): what f returns.
template <class N, class F>
constexpr decltype(auto) unpack_kids(N const& n, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return f(kid<I>(n)...);
  }(std::make_index_sequence<N::arity>{});
}
// f(kid) for each kid of n, in order.
template <class N, class F>
constexpr void for_each_kid(N const& n, F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) { (f(kid<I>(n)), ...); }(std::make_index_sequence<N::arity>{});
}

// Whether an op in the tree carries a value (a scale factor, an eps): a type
// property, so a walk over values can skip the subtrees that carry none.
template <class N>
inline constexpr bool carries_values = false;
template <class Op, class... K>
inline constexpr bool carries_values<node<Op, K...>> = !std::is_empty_v<Op> || (carries_values<K> || ...);

// Two nodes of one type are the same computation when their ops carry the
// same values (scale factors, eps) all the way down.
template <class Op, class... K>
constexpr bool same_value(node<Op, K...> const& a, node<Op, K...> const& b) {
  if constexpr (!carries_values<node<Op, K...>>) {
    return true;
  } else {
    bool ops = [&] {
      if constexpr (std::is_empty_v<Op>)
        return true;
      else
        return a.op == b.op;
    }();
    return ops && [&]<std::size_t... I>(std::index_sequence<I...>) {
      return (same_value(kid<I>(a), kid<I>(b)) && ...);
    }(std::index_sequence_for<K...>{});
  }
}

// The decay of a mask's or scan's op (op::no_decay, op::decay_by or op::decay_per_head).
template <template <class> class Op, class D>
constexpr D const& decay_of(Op<D> const& o) {
  return o;
}
// One operation whatever its decay: what a rewrite pattern's op variable matches.
template <class A, class B>
inline constexpr bool same_op_family = std::is_same_v<A, B>;
template <class D1, class D2>
inline constexpr bool same_op_family<op::causal_t<D1>, op::causal_t<D2>> = true;
template <class D1, class D2>
inline constexpr bool same_op_family<op::prefix_scan_t<D1>, op::prefix_scan_t<D2>> = true;
template <class D1, class D2>
inline constexpr bool same_op_family<op::suffix_scan_t<D1>, op::suffix_scan_t<D2>> = true;
template <class Op>
inline constexpr bool is_causal_op = same_op_family<Op, op::causal>;

template <class T>
inline constexpr bool is_node = false;
template <class Op, class... K>
inline constexpr bool is_node<node<Op, K...>> = true;

template <class T>
inline constexpr bool is_select_op = false;
template <class K, std::size_t T>
inline constexpr bool is_select_op<op::select<K, T>> = true;
// Whether a tree holds a run-time choice (select) anywhere (has_select<N>()).
template <class N>
inline constexpr bool contains_select = false;
template <class Op, class... K>
inline constexpr bool contains_select<node<Op, K...>> = is_select_op<Op> || (contains_select<K> || ...);

// Builders of plan nodes, spelled as in the printed notation; they take
// pattern variables too, so rule tables can be written with them.
namespace build {
template <class B, class C>
constexpr auto outer(B const& b, C const& c) {
  return make_node(op::outer_rows{}, b, c);
}
template <class X, class D = op::no_decay>
constexpr auto prefix(X const& x, D decay = {}) {
  return make_node(op::prefix_scan_t<D>{decay}, x);
}
template <class X, class D = op::no_decay>
constexpr auto suffix(X const& x, D decay = {}) {
  return make_node(op::suffix_scan_t<D>{decay}, x);
}
template <class X>
constexpr auto rows_transpose(X const& x) {
  return make_node(op::transpose_rows{}, x);
}
template <class A, class S>
constexpr auto contract(A const& a, S const& s) {
  return make_node(op::contract_rows{}, a, s);
}
template <class X>
constexpr auto ones_column(X const& x) {
  return make_node(op::append_ones{}, x);
}
template <class X>
constexpr auto drop_last(X const& x) {
  return make_node(op::drop_last{}, x);
}
template <class A, class B>
constexpr auto hadamard(A const& a, B const& b) {
  return make_node(op::hadamard{}, a, b);
}
template <class A, class B>
constexpr auto add(A const& a, B const& b) {
  return make_node(op::add{}, a, b);
}
}  // namespace build

namespace concepts {
// A matrix-valued expression or plan.
template <class T>
concept expression = is_node<std::remove_cvref_t<T>> && std::remove_cvref_t<T>::shape::rank == 2;
}  // namespace concepts

// ---- structure queries (type level) ----------------------------------------
namespace detail {
// Visit every node type of a tree, parents first.
template <class N, class F>
constexpr void visit_types(F&& f);
template <class Op, class... K, class F>
constexpr void visit_types_impl(node<Op, K...>*, F& f) {
  f.template operator()<node<Op, K...>>();
  (visit_types<K>(f), ...);
}
template <class N, class F>
constexpr void visit_types(F&& f) {
  visit_types_impl(static_cast<std::remove_cvref_t<N>*>(nullptr), f);
}

template <class N>
struct inputs_of;  // type_list of the distinct input ops
template <class Op, class... K>
struct inputs_of<node<Op, K...>> {
  using type = typename merge_unique<
      std::conditional_t<is_input_op_v<Op>, type_list<Op>, type_list<>>,
      typename concat_lists<typename inputs_of<K>::type...>::type>::type;
};

template <class Inputs>
struct dims_of_inputs;  // type_list of the distinct base dims of inputs
template <class... I>
struct dims_of_inputs<type_list<I...>> {  // (an input of a derived dimension, M+1, counts its base M)
  using type = typename merge_unique<
      type_list<>, typename concat_lists<typename I::rows::bases..., typename I::cols::bases...>::type>::type;
};
}  // namespace detail

template <class N>
using inputs_of = typename detail::inputs_of<std::remove_cvref_t<N>>::type;

namespace detail {
// Every node type of a tree, with repetitions, parents first.
template <class N>
struct all_nodes;
template <class Op, class... K>
struct all_nodes<node<Op, K...>> {
  using type = typename concat_lists<type_list<node<Op, K...>>, typename all_nodes<K>::type...>::type;
};
}  // namespace detail

template <class N>
using dims_of = typename detail::dims_of_inputs<inputs_of<N>>::type;

// Does any node of N have op type Op?
template <class N, class Op>
constexpr bool contains_op() {
  bool found = false;
  detail::visit_types<N>([&]<class X>() { found = found || std::is_same_v<typename X::op_type, Op>; });
  return found;
}
// Does any matrix node of N have shape Key x Key (an N x N intermediate)?
template <class N, class Key>
constexpr bool has_square() {
  bool found = false;
  detail::visit_types<N>([&]<class X>() {
    if constexpr (X::shape::rank == 2)
      found = found || (std::is_same_v<typename X::shape::rows, Key> && std::is_same_v<typename X::shape::cols, Key>);
  });
  return found;
}
template <class N>
constexpr bool has_select() {
  return contains_select<std::remove_cvref_t<N>>;
}

// The plan a run-time select takes for long sequences: every select replaced
// by its last branch. For a causal linear expression this is the prefix-scan
// plan, the one that has a state to carry from token to token.
template <class N>
constexpr auto longest_branch(N const& n) {
  if constexpr (is_select_op<typename N::op_type>)
    return longest_branch(kid<1>(n));
  else
    return unpack_kids(n, [&](auto const&... k) { return make_node(n.op, longest_branch(k)...); });
}

// No op in N carries a value (every op type is empty): two subtrees of N's
// type are then the same computation, which types alone prove.
template <class N>
constexpr bool value_free() {
  bool free = true;
  detail::visit_types<N>([&]<class X>() { free = free && std::is_empty_v<typename X::op_type>; });
  return free;
}

// contract(A, prefix(B⊗C)) or contract(A, suffix(B⊗C)): a row contraction of
// a running sum of outer products, which backends evaluate as one fused scan
// (per-row sequences never exist on their own).
template <class N>
struct fused_scan_parts {
  static constexpr bool fused = false;
};
template <class A, class D, class B, class C>
struct fused_scan_parts<node<op::contract_rows, A, node<op::prefix_scan_t<D>, node<op::outer_rows, B, C>>>> {
  static constexpr bool fused = true;
  static constexpr bool reverse = false;
};
template <class A, class D, class B, class C>
struct fused_scan_parts<node<op::contract_rows, A, node<op::suffix_scan_t<D>, node<op::outer_rows, B, C>>>> {
  static constexpr bool fused = true;
  static constexpr bool reverse = true;
};

}  // namespace lina
