// The state of a causal linear plan, as every backend sees it: which plan it
// belongs to, for how many sequences, and the shape of each prefix scan's
// running sums (of a backward plan, each scan's: what a chained backward
// starts them from). A backend keeps the sums in its own memory (cpu::state holds
// them in host vectors); what they mean and the checks that a state fits an
// evaluation live here, once.
//
// For normalize(causal(φQ·φKᵀ))·V the plan has one scan, over φ(K)⊗[V|1], so
// the state is one C x (M+1) matrix per (batch, head): [s | z], the paper's
// attention memory s = Σ φ(k_j) v_jᵀ with the normaliser z = Σ φ(k_j) as its
// last column. Scans are numbered in the order of the plan's schedule
// (state_scans<Plan>), fixed by the plan's type.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <typeinfo>
#include <vector>

#include "lina/bind.hpp"
#include "lina/errors.hpp"
#include "lina/format.hpp"
#include "lina/node.hpp"
#include "lina/schedule.hpp"

namespace lina {

namespace diagnose {
template <bool HasScan, bool HasExp, bool HasSquare>
struct stateful_plan {
  static_assert(HasScan || HasExp,
                "lina: recurrent mode and stateful evaluation need a causal linear plan, and this plan has no "
                "prefix scan: without causal(...) every output reads every token, so there is no running state");
  static_assert(!HasExp,
                "lina: recurrent mode needs a finite feature map: exp(...) (softmax) has none, so it has no "
                "constant-size state; use phi<favor>(Q, W) to approximate it");
  static_assert(!HasScan || HasExp || !HasSquare,
                "lina: recurrent mode needs a linear plan: this one still materialises an N x N matrix");
  static constexpr bool ok = HasScan && !HasExp && !HasSquare;
};
}  // namespace diagnose

// The dimension a stateful plan's scans run over (the sequence length).
template <class L>
using scanned_dim = typename detail::front_t<state_scans<L>>::shape::rows;

// Is L (a select-free plan) one that can carry a state? Diagnosed if not.
template <class L>
constexpr bool check_stateful() {
  constexpr bool scans = state_scans<L>::size > 0;
  constexpr bool square = [] {
    if constexpr (scans)
      return has_square<L, scanned_dim<L>>();
    else
      return false;
  }();
  return diagnose::stateful_plan<scans, contains_op<L, op::exp>(), square>::ok;
}

// What a state records; copied with the state, compared when it is used.
class state_info {
 public:
  struct scan_shape {
    std::size_t a = 0, b = 0;  // the running sum of one (batch, head) is a x b, row-major
  };

  state_info() = default;
  template <class L>
  state_info(L const& plan, std::size_t batch, std::size_t heads)
      : plan_(&typeid(L)), plan_text_(to_string(plan)), batch_(batch), heads_(heads), scans_(state_scans<L>::size) {}

  std::size_t batch() const noexcept { return batch_; }
  std::size_t heads() const noexcept { return heads_; }
  std::size_t scans() const noexcept { return scans_.size(); }
  scan_shape const& scan(std::size_t k) const { return scans_.at(k); }
  // Sized once the extents are known, at the first evaluation.
  bool sized() const noexcept { return !extents_.empty(); }
  std::string const& plan() const noexcept { return plan_text_; }
  // Made for (or by a first evaluation of) no plan yet.
  bool unbound() const noexcept { return plan_ == nullptr; }
  // Does this state belong to the plan of this type?
  bool belongs_to(std::type_info const& plan) const noexcept { return plan_ && *plan_ == plan; }
  bool same_plan(state_info const& o) const noexcept { return plan_ && o.plan_ && *plan_ == *o.plan_; }

  // Check that this state fits an evaluation of L with these bindings, or give
  // an unbound state its plan; true when the scans were sized just now (the
  // backend then makes their storage, zeroed).
  template <class L, class Bound>
  bool prepare(L const& plan, Bound const& in) {
    return prepare(plan, in, in.batch, "B (batch)");
  }
  // The same for `count` sequences of these bindings, named `count_label` in
  // errors (packed sequences: one state row per sequence, lina/sequences.hpp).
  template <class L, class Bound>
  bool prepare(L const& plan, Bound const& in, std::size_t count, char const* count_label) {
    if (unbound()) *this = state_info(plan, count, in.heads);
    if (!belongs_to(typeid(L)))
      throw state_error("this state belongs to the plan " + plan_text_ + ", not to " + to_string(plan));
    std::string first(detail::front_t<typename Bound::inputs>::name.view());
    if (count != batch_) throw shape_error(first, count_label, count, batch_, "of the state");
    if (in.heads != heads_) throw shape_error(first, "H (heads)", in.heads, heads_, "of the state");

    // The scanned (sequence) dimension may change between evaluations; no other may.
    constexpr std::size_t seq_index = Bound::table_type::template index_of<scanned_dim<L>>();
    if (!sized()) {
      extents_.assign(in.table.value.begin(), in.table.value.end());
      std::size_t k = 0;
      [&]<class... S>(detail::type_list<S...>) {
        ((scans_[k++] = {static_cast<std::size_t>(S::shape::a::extent(in.table)),
                         static_cast<std::size_t>(S::shape::b::extent(in.table))}),
         ...);
      }(state_scans<L>{});
      return true;
    }
    [&]<class... D>(detail::type_list<D...>) {
      std::size_t i = 0;
      ((i != seq_index && in.table.value[i] != extents_[i]
            ? throw shape_error(in.table.bound_by[i].empty() ? first : in.table.bound_by[i], D::label(),
                                in.table.value[i], extents_[i], "of the state (fixed by its first evaluation)")
            : void(), ++i),
       ...);
    }(dims_of<L>{});
    return false;
  }

  // Refuse a state of another plan or shape (restoring a saved state).
  void check_replaces(state_info const& old) const {
    if (!same_plan(old)) throw state_error("this state belongs to the plan " + plan_text_ + ", not to " + old.plan_text_);
    if (batch_ != old.batch_ || heads_ != old.heads_)
      throw state_error("this state is for " + std::to_string(batch_) + " x " + std::to_string(heads_) +
                        " (batch x heads), not " + std::to_string(old.batch_) + " x " + std::to_string(old.heads_));
  }

 private:
  std::type_info const* plan_ = nullptr;  // compared by value: equal types, equal plans
  std::string plan_text_;
  std::size_t batch_ = 0, heads_ = 0;
  std::vector<scan_shape> scans_;
  std::vector<std::size_t> extents_;  // of every dimension, fixed at the first evaluation
};

}  // namespace lina
