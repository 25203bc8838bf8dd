// cpu::state: a plan's running sums in host memory (what they are and the
// checks that a state fits an evaluation: lina/state.hpp). A state is a value:
// copy it to save it, assign it back (or set_state) to restore it; it
// remembers the plan it belongs to.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
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
  // A copy reads the sums under the fold's lock: a const state may be copied
  // while another thread reads it (and so folds its pending sums).
  state(state const& o) : state_info(o) { o.copy_sums_to(*this); }
  state& operator=(state const& o) {
    if (this != &o) {
      state_info::operator=(o);
      o.copy_sums_to(*this);
    }
    return *this;
  }
  state(state&&) = default;
  state& operator=(state&&) = default;

  // Scan k's running sums as a [B, H, a, b] tensor (for attention: [B, H, C, M+1],
  // the normaliser z in the last column).
  tensor_view<T> operator[](std::size_t k) { return view(k); }
  tensor_view<T const> operator[](std::size_t k) const { return const_cast<state*>(this)->view(k); }

  void reset() {
    for (auto& s : sums_) std::fill(s.begin(), s.end(), T(0));
    std::fill(rows_.begin(), rows_.end(), std::size_t(0));
    pending_.clear();
    pending_rows_.clear();
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
    pending_.clear();
    pending_rows_.clear();
  }
  // Running sums of every scan and slice (once sized).
  std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (auto const& s : sums_) n += s.size();
    return n;
  }
  T* at(std::size_t k, std::size_t b, std::size_t h) {
    settle(k, b, h);
    return sums_[k].data() + offset(k, b, h);
  }
  T const* at(std::size_t k, std::size_t b, std::size_t h) const {
    settle(k, b, h);
    return sums_[k].data() + offset(k, b, h);
  }
  // For the backend: scan k's sums of batch entry b, every head's, and the
  // rows they hold, from scan kf of `from`'s batch entry bf (a packed
  // sequence's row of a state, a tape's share of one).
  void copy_entry(std::size_t k, std::size_t b, state const& from, std::size_t kf, std::size_t bf) {
    std::size_t const n = from.scan(kf).a * from.scan(kf).b;
    for (std::size_t h = 0; h < heads(); ++h) std::copy_n(from.at(kf, bf, h), n, at(k, b, h));
    set_rows(k, b, from.rows(kf, bf));
  }

  // Recurrent steps past two_level_rows sum in two levels too: each step adds
  // its row to pending sums (from zero since the last fold) and reads the
  // state plus them; every `fold_rows` steps they are added to the state once
  // (kernels::scan_rows's `pending`). Row by row onto the state itself, steps
  // over 2^20 tokens erred 40x more than one call over them (bench/limits).
  // Every other reader (at, operator[], copies made through them) sees the
  // pending sums folded in first. For the backend: make the pending sums
  // (outside any parallel region) where a scan holds `threshold` rows; the
  // state's and the pending sums of slice (k, b, h), unfolded; one more step
  // taken there.
  static constexpr unsigned fold_rows = 64;
  void make_pending(std::size_t threshold) {
    if (!pending_.empty() || std::none_of(rows_.begin(), rows_.end(), [&](std::size_t r) { return r >= threshold; }))
      return;
    pending_.resize(scans());
    for (std::size_t k = 0; k < scans(); ++k) pending_[k].assign(sums_[k].size(), T(0));
    pending_rows_.assign(scans() * batch() * heads(), 0);
  }
  bool has_pending() const noexcept { return !pending_.empty(); }
  T* unfolded_at(std::size_t k, std::size_t b, std::size_t h) { return sums_[k].data() + offset(k, b, h); }
  T* pending_at(std::size_t k, std::size_t b, std::size_t h) { return pending_[k].data() + offset(k, b, h); }
  void pending_step(std::size_t k, std::size_t b, std::size_t h) {
    if (++pending_rows_[(k * batch() + b) * heads() + h] == fold_rows) settle(k, b, h);
  }

 private:
  // Where slice (b, h) of scan k starts in its sums (and pending sums).
  std::size_t offset(std::size_t k, std::size_t b, std::size_t h) const { return (b * heads() + h) * scan(k).a * scan(k).b; }
  tensor_view<T> view(std::size_t k) {
    for (std::size_t b = 0; b < batch(); ++b)
      for (std::size_t h = 0; h < heads(); ++h) settle(k, b, h);
    return {sums_.at(k).data(), {batch(), heads(), scan(k).a, scan(k).b}};
  }
  // Fold slice (k, b, h)'s pending sums into its state. Logically const (the
  // sums they make are the same), so a const state's readers may run at once,
  // as a value's may: they fold under a lock (rare: a fold is every 64 steps
  // or at a read; without the lock two readers added the same pending sums twice).
  void settle(std::size_t k, std::size_t b, std::size_t h) const {
    if (pending_.empty()) return;
    std::lock_guard<std::mutex> lock(fold_.m);
    unsigned& n = pending_rows_[(k * batch() + b) * heads() + h];
    if (n == 0) return;
    std::size_t const size = scan(k).a * scan(k).b, at = offset(k, b, h);
    T* s = sums_[k].data() + at;
    T* p = pending_[k].data() + at;
    for (std::size_t e = 0; e < size; ++e) {
      s[e] += p[e];
      p[e] = T(0);
    }
    n = 0;
  }
  void copy_sums_to(state& to) const {
    std::lock_guard<std::mutex> lock(fold_.m);
    to.sums_ = sums_, to.rows_ = rows_, to.pending_ = pending_, to.pending_rows_ = pending_rows_;
  }
  mutable std::vector<std::vector<T>> sums_;
  std::vector<std::size_t> rows_;  // rows(k, b) at [k * batch + b]
  mutable std::vector<std::vector<T>> pending_;  // as sums_, once a step sums in two levels
  mutable std::vector<unsigned> pending_rows_;   // steps in each slice's pending sums, [(k * batch + b) * heads + h]
  struct fold_lock {  // a state's own: copies and moves of a state take none along
    std::mutex m;
    fold_lock() = default;
    fold_lock(fold_lock const&) noexcept {}
    fold_lock& operator=(fold_lock const&) noexcept { return *this; }
  };
  mutable fold_lock fold_;
};

}  // namespace lina::cpu
