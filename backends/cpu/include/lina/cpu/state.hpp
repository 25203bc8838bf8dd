// cpu::state: a plan's running sums in host memory (what they are and the
// checks that a state fits an evaluation: lina/state.hpp). A state is a value:
// copy it to save it, assign it back (or set_state) to restore it; it
// remembers the plan it belongs to.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "lina/state.hpp"
#include "lina/tensor.hpp"

namespace lina::cpu {

template <class T>
class state : public state_info {
 public:
  state() = default;
  template <class L>
  state(L const& plan, std::size_t batch, std::size_t heads) : state_info(plan, batch, heads), sums_(scans()) {}

  // Scan k's running sums as a [B, H, a, b] tensor (for attention: [B, H, C, M+1],
  // the normaliser z in the last column).
  tensor_view<T> operator[](std::size_t k) { return view(k); }
  tensor_view<T const> operator[](std::size_t k) const { return const_cast<state*>(this)->view(k); }

  void reset() {
    for (auto& s : sums_) std::fill(s.begin(), s.end(), T(0));
    std::fill(rows_.begin(), rows_.end(), std::size_t(0));
  }

  // How many rows of the sequence scan k's sums hold for batch entry b: each
  // evaluation through the state adds its rows. A float scan that continues a
  // long sum sums its rows in two levels (kernels::two_level_rows), as one
  // call over the whole sequence would: blocks chained through a state keep
  // that call's accuracy. Sums written by hand count no rows.
  std::size_t rows(std::size_t k, std::size_t b) const { return rows_.empty() ? 0 : rows_[k * batch() + b]; }
  // For the backend: set them, or add n rows to every scan and batch entry.
  void set_rows(std::size_t k, std::size_t b, std::size_t n) {
    if (!rows_.empty()) rows_[k * batch() + b] = n;
  }
  void add_rows(std::size_t n) {
    for (auto& r : rows_) r += n;
  }

  // For the backend: check the state against an evaluation (sizing it at the
  // first), then the running sums of scan k for slice (b, h).
  template <class L, class Bound>
  void prepare(L const& plan, Bound const& in) {
    prepare(plan, in, in.batch, "B (batch)");
  }
  // For `count` sequences of these bindings (packed sequences: one per sequence).
  template <class L, class Bound>
  void prepare(L const& plan, Bound const& in, std::size_t count, char const* count_label) {
    if (!state_info::prepare(plan, in, count, count_label)) return;
    sums_.assign(scans(), {});
    for (std::size_t k = 0; k < scans(); ++k) sums_[k].assign(batch() * heads() * scan(k).a * scan(k).b, T(0));
    rows_.assign(scans() * batch(), 0);
  }
  // Running sums of every scan and slice (once sized).
  std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (auto const& s : sums_) n += s.size();
    return n;
  }
  T* at(std::size_t k, std::size_t b, std::size_t h) {
    return sums_[k].data() + (b * heads() + h) * scan(k).a * scan(k).b;
  }
  T const* at(std::size_t k, std::size_t b, std::size_t h) const {
    return sums_[k].data() + (b * heads() + h) * scan(k).a * scan(k).b;
  }

 private:
  tensor_view<T> view(std::size_t k) {
    return {sums_.at(k).data(), {batch(), heads(), scan(k).a, scan(k).b}};
  }
  std::vector<std::vector<T>> sums_;
  std::vector<std::size_t> rows_;  // rows(k, b) at [k * batch + b]
};

}  // namespace lina::cpu
