// The state of a causal linear plan: the running sums of its prefix scans.
//
// For normalize(causal(φQ·φKᵀ))·V the plan has one scan, over φ(K)⊗[V|1], so
// the state is one C x (M+1) matrix per (batch, head): [s | z], the paper's
// attention memory s = Σ φ(k_j) v_jᵀ with the normaliser z = Σ φ(k_j) as its
// last column. A state is a value: copy it to save it, assign it back (or
// set_state) to restore it; it remembers the plan it belongs to.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <typeinfo>
#include <vector>

#include "lina/errors.hpp"
#include "lina/tensor.hpp"

namespace lina::cpu {

template <class T>
class state {
 public:
  state() = default;
  state(std::type_info const& plan, std::string plan_text, std::size_t batch, std::size_t heads, std::size_t scans)
      : plan_(&plan), plan_text_(std::move(plan_text)), batch_(batch), heads_(heads), scans_(scans) {}

  std::size_t batch() const noexcept { return batch_; }
  std::size_t heads() const noexcept { return heads_; }
  std::size_t scans() const noexcept { return scans_.size(); }
  // Sized (and zero) once the extents are known, at the first evaluation.
  bool sized() const noexcept { return !scans_.empty() && !scans_[0].data.empty(); }
  std::string const& plan() const noexcept { return plan_text_; }
  // Made for (or by a first evaluation of) no plan yet.
  bool unbound() const noexcept { return plan_ == nullptr; }
  // Does this state belong to the plan of this type?
  bool belongs_to(std::type_info const& plan) const noexcept { return plan_ && *plan_ == plan; }
  bool same_plan(state const& o) const noexcept { return plan_ && o.plan_ && *plan_ == *o.plan_; }

  // Scan k's running sums as a [B, H, a, b] tensor (for attention: [B, H, C, M+1],
  // the normaliser z in the last column).
  tensor_view<T> operator[](std::size_t k) { return view(k); }
  tensor_view<T const> operator[](std::size_t k) const { return const_cast<state*>(this)->view(k); }

  void reset() {
    for (auto& s : scans_) std::fill(s.data.begin(), s.data.end(), T(0));
  }

  // Internals for the backend.
  struct scan {
    std::size_t a = 0, b = 0;
    std::vector<T> data;
  };
  std::vector<scan>& scan_data() noexcept { return scans_; }
  std::vector<std::size_t>& extents() noexcept { return extents_; }
  T* at(std::size_t k, std::size_t b, std::size_t h) {
    auto& s = scans_[k];
    return s.data.data() + (b * heads_ + h) * s.a * s.b;
  }

 private:
  tensor_view<T> view(std::size_t k) {
    auto& s = scans_.at(k);
    return {s.data.data(), {batch_, heads_, s.a, s.b}};
  }
  std::type_info const* plan_ = nullptr;  // compared by value: equal types, equal plans
  std::string plan_text_;
  std::size_t batch_ = 0, heads_ = 0;
  std::vector<scan> scans_;
  std::vector<std::size_t> extents_;  // of every dimension, fixed at the first evaluation
};

}  // namespace lina::cpu
