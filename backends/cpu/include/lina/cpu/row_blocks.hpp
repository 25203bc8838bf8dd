// Quadratic plans in blocks of query rows.
//
// A quadratic plan (softmax, or compile<order::quadratic>) makes N x N score
// matrices per (batch, head). Every row of its result reads one row of Q and
// every row of K and V, so it can run on a block of Q's rows at a time: the
// scores are then R x N, not N x N (16 MiB at most per matrix, below). With a
// causal mask the block's rows [r0, r0 + R) read only keys [0, r0 + R), and
// the mask keeps j <= i + r0: the diagonal of an R x (r0 + R) block lies
// r0 columns right of its first column (the CPU's masks, exps and triangular
// products take a matrix's diagonal offset as its columns less its rows,
// which is 0 for the whole plan's square matrices).
//
// The block's plan is the plan with its sequence dimension renamed where it
// stands for query rows (query_rows<N>) and where it stands for keys
// (key_rows<N>), so that the shapes of every step follow from the bindings as
// usual. Which inputs are which follows from the plan's type: the result's
// rows are query rows; a product's contraction over N runs over keys; a
// transpose swaps rows and columns. A plan qualifies (`eligible`) when it is
// made of the forward vocabulary only (inputs, φ, transpose, products,
// causal, scale, normalize, exp, [x|1], rowdiv, dropcol), has an N x N step,
// each input is read in one role, and, with a mask, cutting the keys at the
// block's diagonal changes no value it keeps: every product over keys reads a
// left operand that is masked (zero past the diagonal) and whose kept values
// read no key past it (a normaliser of a row of scores sums a masked row).
// Anything else runs whole, as before.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <string>
#include <type_traits>

#include "lina/dims.hpp"
#include "lina/node.hpp"

namespace lina::cpu::row_blocks {

// What a node's rows or columns run over.
enum class role { other, query, key };

// A block's query rows (R = query), or the keys it reads (R = key), of the
// sequence dimension D: dimensions of their own, looked up in a block's table.
template <class D, role R>
struct block_dim {
  static constexpr bool is_static = false;
  static constexpr std::size_t static_extent = dynamic_extent;
  using bases = lina::detail::type_list<block_dim>;
  template <class Source>
  static constexpr auto extent(Source const& s) {
    return s.template get<block_dim>();
  }
  static std::string label() { return D::label() + (R == role::query ? " (a block's rows)" : " (a block's keys)"); }
};
template <class D>
using query_rows = block_dim<D, role::query>;
template <class D>
using key_rows = block_dim<D, role::key>;

// What the walk found of a node: ok (the node qualifies), kept (its values
// where a block keeps them are those of the whole plan when the keys are
// cut at the block's diagonal), masked (zero past the diagonal), masks (a
// causal mask below it).
struct verdict {
  bool ok = false, kept = false, masked = false, masks = false;
};

// Row-wise ops of the forward: those that keep a matrix's shape (and of
// them, those that keep its zeros: a mask's stays), and those that add or
// drop a column (on rows of features, never of scores); two sum a row.
template <class Op>
inline constexpr bool keeps_mask = std::is_same_v<Op, op::scale> || std::is_same_v<Op, op::normalize>;
template <class Op>
inline constexpr bool keeps_shape = std::is_same_v<Op, op::exp> || keeps_mask<Op>;
template <class Op>
inline constexpr bool on_columns = std::is_same_v<Op, op::append_ones> || std::is_same_v<Op, op::row_divide> ||
                                   std::is_same_v<Op, op::drop_last>;
template <class Op>
inline constexpr bool sums_rows = std::is_same_v<Op, op::normalize> || std::is_same_v<Op, op::row_divide>;
template <class Op>
inline constexpr bool is_phi = false;
template <class Map>
inline constexpr bool is_phi<op::phi<Map>> = true;

// The contraction of A·B: over keys when it runs over the sequence.
template <class Nd, class A>
inline constexpr role contraction = std::is_same_v<typename A::shape::cols, Nd> ? role::key : role::other;

template <class Nd, role R, role C, class Op, class... K>
constexpr verdict check(node<Op, K...> const*);
template <class Nd, role R, role C, class N>
constexpr verdict check_of() {
  return check<Nd, R, C>(static_cast<N const*>(nullptr));
}
template <class Nd, role R, role C, class Op, class... K>
constexpr verdict check(node<Op, K...> const*) {
  using K0 = lina::detail::type_at_t<0, lina::detail::type_list<K..., void, void>>;
  using K1 = lina::detail::type_at_t<1, lina::detail::type_list<K..., void, void>>;
  if constexpr (is_input_op_v<Op>) {
    constexpr bool rows = R == role::other ? !std::is_same_v<typename Op::rows, Nd>
                                           : std::is_same_v<typename Op::rows, Nd>;
    return {rows && C == role::other && !std::is_same_v<typename Op::cols, Nd>, true, false, false};
  } else if constexpr (std::is_same_v<Op, op::transpose>) {
    return check_of<Nd, C, R, K0>();
  } else if constexpr (std::is_same_v<Op, op::product>) {
    constexpr role X = contraction<Nd, K0>;
    verdict a = check_of<Nd, R, X, K0>(), b = check_of<Nd, X, C, K1>();
    return {a.ok && b.ok, a.kept && b.kept && (X != role::key || a.masked), false, a.masks || b.masks};
  } else if constexpr (is_causal_op<Op>) {
    verdict k = check_of<Nd, R, C, K0>();
    return {k.ok && R == role::query && C == role::key, k.kept, true, true};
  } else if constexpr (keeps_shape<Op> || on_columns<Op>) {
    verdict k = check_of<Nd, R, C, K0>();
    bool across = sums_rows<Op> && C == role::key;  // a sum over the row's keys
    return {k.ok && (!on_columns<Op> || C == role::other), k.kept && (!across || k.masked),
            keeps_mask<Op> && k.masked, k.masks};
  } else if constexpr (is_phi<Op>) {  // (rows of features: columns of no sequence)
    verdict x = check_of<Nd, R, role::other, K0>();
    if constexpr (sizeof...(K) == 2) {
      verdict w = check_of<Nd, role::other, role::other, K1>();
      return {x.ok && w.ok && C == role::other, x.kept, false, x.masks};
    } else {
      return {x.ok && C == role::other, x.kept, false, x.masks};
    }
  } else {
    return {};
  }
}

// The plan P's verdict, its rows the query rows.
template <class P>
constexpr verdict verdict_of() {
  using Nd = typename P::shape::rows;
  if constexpr (!is_dim_t<Nd>)
    return {};
  else
    return check_of<Nd, role::query, role::other, P>();
}

// The plan with its sequence dimension renamed in its query and key roles.
template <class Nd, role R, role C, class Op, class... K>
constexpr auto rename(node<Op, K...> const& n) {
  if constexpr (is_input_op_v<Op>) {
    if constexpr (R == role::other)
      return n;
    else
      return make_node(op::input<Op::name, block_dim<Nd, R>, typename Op::cols>{});
  } else if constexpr (std::is_same_v<Op, op::transpose>) {
    return make_node(n.op, rename<Nd, C, R>(kid<0>(n)));
  } else if constexpr (std::is_same_v<Op, op::product>) {
    constexpr role X = contraction<Nd, std::tuple_element_t<0, std::tuple<K...>>>;
    return make_node(n.op, rename<Nd, R, X>(kid<0>(n)), rename<Nd, X, C>(kid<1>(n)));
  } else if constexpr (is_phi<Op> && sizeof...(K) == 2) {
    return make_node(n.op, rename<Nd, R, role::other>(kid<0>(n)), rename<Nd, role::other, role::other>(kid<1>(n)));
  } else {
    return make_node(n.op, rename<Nd, R, C>(kid<0>(n)));
  }
}
template <class P>
constexpr auto block_plan(P const& plan) {
  return rename<typename P::shape::rows, role::query, role::other>(plan);
}

// Each input name once among the block plan's inputs (an input read both as
// queries and as keys, self-attention on one symbol, would be two).
template <class... I>
constexpr bool distinct_names(lina::detail::type_list<I...>) {
  constexpr std::size_t n = sizeof...(I);
  std::string_view names[n + 1] = {I::name.view()..., {}};
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = a + 1; b < n; ++b)
      if (names[a] == names[b]) return false;
  return true;
}

template <class P>
constexpr bool eligible() {
  constexpr verdict v = verdict_of<P>();
  if constexpr (!v.ok || (v.masks && !v.kept)) {
    return false;
  } else {
    using Nd = typename P::shape::rows;
    return has_square<P, Nd>() && distinct_names(inputs_of<decltype(block_plan(std::declval<P const&>()))>{});
  }
}

inline std::atomic<std::size_t>& rows_setting() {
  static std::atomic<std::size_t> rows{0};
  return rows;
}

// Rows per block: scores of at most 4 Mi elements (16 MiB in float), 64 to
// 512 rows (fewer make the keys' per-block costs show: a product copies Kᵀ
// into rows once per block); or what use_block_rows set.
inline std::size_t rows_per_block(std::size_t n) {
  if (std::size_t const set = rows_setting().load()) return set;
  std::size_t r = (std::size_t(1) << 22) / std::max<std::size_t>(n, 1);
  return std::clamp<std::size_t>(r / 8 * 8, 64, 512);
}

}  // namespace lina::cpu::row_blocks

namespace lina::cpu {
// Rows of Q per block of a quadratic plan's forward from now on, for the
// whole process (0: chosen by the sequence's length, the default). Fewer
// rows, less memory: the scores of a block are rows x N.
inline void use_block_rows(std::size_t rows) { row_blocks::rows_setting().store(rows); }
}  // namespace lina::cpu
