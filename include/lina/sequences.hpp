// Packed sequences of different lengths ("varlen"): S sequences laid end to
// end along the sequence dimension of one batch row — inputs [1, H, ΣN_s, D]
// (or [1, ΣN_s, H, D] views) and their offsets, as flash-linear-attention's
// cu_seqlens — each attended to on its own, as if it were alone in a batch of
// one. Padding a batch to its longest sequence costs the padding; packing
// costs nothing but the offsets.
//
// What is packed: the plan's sequence dimension, the rows of its result
// (N for attention). Every input whose rows are that dimension (Q, K, V) is
// cut into the sequences' rows; any other input (a feature map's projection
// W) is read whole by every sequence, and its gradient sums the sequences'.
// Backends evaluate sequence by sequence, each binding passed through
// sequence_binding(), so every sequence is bound (and resolves the plan's
// selects) at its own length.
#pragma once

#include <cstddef>
#include <concepts>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/bind.hpp"
#include "lina/errors.hpp"
#include "lina/node.hpp"

namespace lina {

namespace concepts {
// A range of integers (std::vector<int32_t> as torch's cu_seqlens, std::vector<std::size_t>, ...).
template <class R>
concept integer_range = requires(R const& r) {
  std::begin(r);
  requires std::integral<std::remove_cvref_t<decltype(*std::begin(r))>>;
};
}  // namespace concepts

// The offsets of S packed sequences: sequence s is rows [begin(s), begin(s) + length(s)).
class sequences {
 public:
  sequences() = default;  // none

  // From cumulative offsets {0, N_0, N_0 + N_1, ...} (fla's cu_seqlens):
  // S + 1 of them, starting at 0, never decreasing.
  template <concepts::integer_range R>
  static sequences from_offsets(R const& offsets) {
    sequences r;
    r.offsets_.clear();
    for (auto o : offsets) {
      if constexpr (std::is_signed_v<decltype(o)>)
        if (o < 0) throw std::invalid_argument("lina::sequences: offset " + std::to_string(r.offsets_.size()) + " is negative");
      auto u = static_cast<std::size_t>(o);
      if (r.offsets_.empty() && u != 0)
        throw std::invalid_argument("lina::sequences: the first offset must be 0, not " + std::to_string(u));
      if (!r.offsets_.empty() && u < r.offsets_.back())
        throw std::invalid_argument("lina::sequences: offset " + std::to_string(r.offsets_.size()) + " (" +
                                    std::to_string(u) + ") is below the one before it (" +
                                    std::to_string(r.offsets_.back()) + "): offsets never decrease");
      r.offsets_.push_back(u);
    }
    if (r.offsets_.empty()) r.offsets_.push_back(0);
    return r;
  }
  static sequences from_offsets(std::initializer_list<std::size_t> offsets) {
    return from_offsets(std::vector<std::size_t>(offsets));
  }
  // From the lengths {N_0, N_1, ...}.
  template <concepts::integer_range R>
  static sequences from_lengths(R const& lengths) {
    sequences r;
    for (auto n : lengths) {
      if constexpr (std::is_signed_v<decltype(n)>)
        if (n < 0) throw std::invalid_argument("lina::sequences: length " + std::to_string(r.count()) + " is negative");
      r.offsets_.push_back(r.offsets_.back() + static_cast<std::size_t>(n));
    }
    return r;
  }
  static sequences from_lengths(std::initializer_list<std::size_t> lengths) {
    return from_lengths(std::vector<std::size_t>(lengths));
  }

  std::size_t count() const noexcept { return offsets_.size() - 1; }
  std::size_t begin(std::size_t s) const { return offsets_.at(s); }
  std::size_t length(std::size_t s) const { return offsets_.at(s + 1) - offsets_.at(s); }
  std::size_t total() const noexcept { return offsets_.back(); }
  std::vector<std::size_t> const& offsets() const noexcept { return offsets_; }

 private:
  std::vector<std::size_t> offsets_{0};
};

namespace diagnose {
template <bool Dynamic, bool OnlyRows>
struct packed_sequences {
  static_assert(Dynamic,
                "lina: packed sequences need a run-time sequence dimension (the rows of the plan's result): "
                "declare it as dim<\"N\"> without an extent");
  static_assert(OnlyRows,
                "lina: packed sequences cut inputs along their rows: the sequence dimension (the rows of the "
                "plan's result) must not be the columns of an input");
  static constexpr bool ok = Dynamic && OnlyRows;
};
}  // namespace diagnose

// The dimension packed sequences share: the rows of the plan's result.
template <class P>
using packed_dim = typename P::shape::rows;

namespace detail {
template <class Dim, class Inputs>
struct packable;
template <class Dim, class... I>
struct packable<Dim, detail::type_list<I...>> {
  static constexpr bool ok =
      diagnose::packed_sequences<!Dim::is_static, (!std::is_same_v<typename I::cols, Dim> && ...)>::ok;
};
}  // namespace detail

// Check bound inputs against packed sequences along Dim: one batch row whose
// Dim extent is the sequences' total (else lina::shape_error).
template <class Dim, class Bound>
void check_packed(Bound const& in, sequences const& seqs) {
  static_assert(detail::packable<Dim, typename Bound::inputs>::ok || true);
  std::string first(detail::front_t<typename Bound::inputs>::name.view());
  if (in.batch != 1) throw shape_error(first, "B (batch)", in.batch, 1, "for packed sequences (they share one batch row)");
  constexpr std::size_t k = Bound::table_type::template index_of<Dim>();
  if (in.table.value[k] != seqs.total())
    throw shape_error(in.table.bound_by[k].empty() ? first : in.table.bound_by[k], Dim::label(), in.table.value[k],
                      seqs.total(), "the sum of the packed sequences' lengths");
}

// Is input In cut into sequences along Dim (are its rows Dim)?
template <class Dim, class In>
inline constexpr bool cut_input = std::is_same_v<typename In::rows, Dim>;

namespace detail {
template <fixed_string Name, class Inputs>
struct input_named;
template <fixed_string Name, class... I>
struct input_named<Name, detail::type_list<I...>> {
  using type = detail::type_at_t<detail::binding_position<Name, I...>(), detail::type_list<I...>>;
};
}  // namespace detail

// Binding b for sequence s alone: cut to its rows when b's input (among
// Inputs) has Dim as rows, else whole. A backend evaluates sequence s by
// calling its own evaluation with every binding passed through this.
template <class Dim, class Inputs, fixed_string Name, class View>
binding<Name, View> sequence_binding(binding<Name, View> const& b, sequences const& seqs, std::size_t s) {
  if constexpr (cut_input<Dim, typename detail::input_named<Name, Inputs>::type>)
    return {b.view.rows(seqs.begin(s), seqs.length(s))};
  else
    return b;
}

}  // namespace lina
