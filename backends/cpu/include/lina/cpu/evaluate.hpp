// Evaluating an expression or a plan on the CPU.
//
// The backend-neutral layer does the rest: bind() checks the inputs,
// with_resolved_plan() picks every select's branch once per call, and
// schedule_of<Plan> is the program to run. This file only walks that
// program: per (batch, head) slice, each step writes into a destination (a
// counted buffer, or the caller's output directly), reading its operands in
// place (inputs and views of earlier results, never copies), and a result is
// released after its last use. lower<Op> is the dispatch table, one
// specialisation per operation tag (as Eigen's evaluators); a node with no
// lowering is a compile error naming it. Batch x heads run in parallel with
// OpenMP.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "lina/bind.hpp"
#include "lina/cpu/kernels.hpp"
#include "lina/cpu/matrix.hpp"
#include "lina/cpu/path.hpp"
#include "lina/cpu/row_blocks.hpp"
#include "lina/cpu/state.hpp"
#include "lina/detail/each_lane.hpp"
#include "lina/detail/exp.hpp"
#include "lina/node.hpp"
#include "lina/schedule.hpp"
#include "lina/tensor.hpp"

namespace lina::cpu {

template <class T>
matrix<T> alias(matrix<T> const& m) {  // a view of m's elements, not owning them (and of its exponents)
  matrix<T> a = view(m.data, m.rows, m.cols, m.rs, m.cs);
  a.row_exp = m.row_exp;
  a.col_exp = m.col_exp;
  return a;
}

// lower<Op>::run(o, out, operands...): the result of a node with op value o
// (its eps, factor, decays) into `out`, sized by the caller (rows contiguous),
// from its kids' values. It takes the op, not the node (whose type spells its
// whole subtree): the code depends on the op alone, and nodes of one op share it.
template <class Op>
struct lower {
  static_assert(lina::detail::always_false<Op>,
                "lina::cpu cannot lower this node (its op is in the instantiation of lower<> above)");
};

// Parametric maps read their projection W too (not row-wise: W is a whole matrix).
template <class Map>
struct lower<op::phi<Map>> {
  template <class T>
  static void run(op::phi<Map> const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w) {
    kernels::feature_map<Map>(x, w, out);
  }
};
template <>
struct lower<op::product> {  // (zeros: those program::product knows of; the simple path multiplies in full)
  template <class T>
  static void run(op::product const&, matrix<T>& out, matrix<T> const& a, matrix<T> b,
                  kernels::product_zeros zeros = {}) {
    if (current_path() == path::simple)
      kernels::gemm_simple(a, b, out);
    else
      kernels::gemm(a, std::move(b), out, false, zeros);
  }
};

// row<Op>::run(o, i, in, in_cols, out): row i of a row-wise op (sched::row_wise;
// exp's rows are made by program::group_row, which may shift them: Exponents)
// from row i of its operand (a causal mask also takes the slice's head before
// i: its decay may be the head's). A fused group of row-wise steps runs these
// one after another on each row, so its intermediate rows are never stored.
template <class Op>
struct row;
template <class Map>
struct row<op::phi<Map>> {
  template <class T>
  static void run(op::phi<Map> const&, index, T const* in, index cols, T* out) {
    if constexpr (concepts::elementwise_map<Map>) {
      // (In fixed-width blocks, vectorised at -O2 too: lina::detail::each_lane. No
      // `#pragma omp simd`: Clang, asked to, warns where a user's map calls
      // the C library: tests/clang/user_map.cpp.)
      lina::detail::each_lane(out, cols, [in](index j) { return Map::value(in[j]); });
    } else {
      Map::apply(in, static_cast<std::size_t>(cols), out);
    }
  }
};
template <>
struct row<op::scale> {
  template <class T>
  static void run(op::scale const& o, index, T const* in, index cols, T* out) {
    T s = static_cast<T>(o.factor);
    lina::detail::each_lane(out, cols, [s, in](index j) { return s * in[j]; });
  }
};
template <class D>
struct row<op::causal_t<D>> {  // keep decay^(i-j) S_ij for j <= i (head's decay: it takes the head)
  template <class T>
  static void run(op::causal_t<D> const& o, std::size_t head, index i, T const* in, index cols, T* out) {
    double const g = o.at(head);
    lina::detail::each_lane(out, cols, [i, in](index j) { return j <= i ? in[j] : T(0); });
    if (g == 1) return;
    double w = 1;  // g^(i-j), from the diagonal leftwards (in double: a relative error of (i-j) ulp of double)
    for (index j = std::min(i, cols - 1); j >= 0; --j, w *= g) out[j] = static_cast<T>(w) * out[j];
  }
};
template <>
struct row<op::normalize> {  // S_ij / (sum_k S_ik + eps)
  template <class T>
  static void run(op::normalize const& o, index, T const* in, index cols, T* out) {
    T sum = 0;
    for (index j = 0; j < cols; ++j) sum += in[j];
    T den = sum + static_cast<T>(o.eps);
    lina::detail::each_lane(out, cols, [den, in](index j) { return in[j] / den; });
  }
};
template <>
struct row<op::append_ones> {  // [x | 1]
  template <class T>
  static void run(op::append_ones const&, index, T const* in, index cols, T* out) {
    std::copy_n(in, cols, out);
    out[cols] = T(1);
  }
};
template <>
struct row<op::row_divide> {  // x[:-1] / (x[-1] + eps)
  template <class T>
  static void run(op::row_divide const& o, index, T const* in, index cols, T* out) {
    T r = T(1) / (in[cols - 1] + static_cast<T>(o.eps));  // one division a row, not one per element
    lina::detail::each_lane(out, cols - 1, [r, in](index j) { return in[j] * r; });
  }
};

// Is element (i, j) of a row-wise op's result made from element (i, j) of its
// operand alone? (Then a causal mask after it drops what it would make past
// the diagonal; a normaliser, which sums the row, is not.)
template <class Op>
inline constexpr bool column_local = is_causal_op<Op> || std::is_same_v<Op, op::scale> || std::is_same_v<Op, op::exp>;
template <class Map>
inline constexpr bool column_local<op::phi<Map>> = concepts::elementwise_map<Map>;

// ---- Exponents --------------------------------------------------------------
// exp(x) overflows past x ≈ 88.7 in float (709.8 in double), and softmax rows
// as written, normalize(exp(S)) or rowdiv(exp(S)·[V|1]), become inf/inf = NaN
// although their values are ordinary numbers; the backward's normaliser
// adjoints divide by the square of such sums, which overflows from half
// that. So an exp step makes e^(x − m), m = max(0, the row's largest
// element), and the row carries its exponent m (matrix::row_exp: the row
// stands for its elements × e^m), as the CUDA kernels' running max does;
// rows whose elements are all ≤ 0 carry none and keep the bits of exp as
// written. Readers that understand an exponent keep it: a product's rows
// take those of its left operand, and the exponents of a contraction's two
// sides cancel when they are opposite; the normalisers end it (eps · e^−m,
// so the value is the one written); a mask, a scale and [x | e^−m] keep it;
// a Hadamard product adds them; the adjoints of the normalisers subtract
// theirs. Any other reader gets the values multiplied out (inf where the
// value itself overflows).
namespace exponents {
// The shift of a row of exp's argument (its first n elements count): their
// largest when positive and finite, else 0.
template <class T>
T shift_of(T const* x, index n) {
  T m = 0;
  for (index j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;  // (NaN: skipped; it propagates through exp)
  return m < std::numeric_limits<T>::infinity() ? m : T(0);
}

// What a row-wise op does to its row's exponent r.
enum class rule {
  values,  // reads the row's values: r multiplied out first
  makes,   // exp: may start one
  keeps,   // linear in the row (a mask, a scale, [x | e^−r])
  ends,    // a normaliser: eps · e^−r, its result as written
};
template <class Op>
inline constexpr rule rule_of = is_causal_op<Op> ? rule::keeps : rule::values;
template <>
inline constexpr rule rule_of<op::exp> = rule::makes;
template <>
inline constexpr rule rule_of<op::scale> = rule::keeps;
template <>
inline constexpr rule rule_of<op::append_ones> = rule::keeps;
template <>
inline constexpr rule rule_of<op::normalize> = rule::ends;
template <>
inline constexpr rule rule_of<op::row_divide> = rule::ends;

// Row-local pairs that read their operands' exponents: the result's r from
// theirs (x, y: the operands' in order).
template <class Op>
inline constexpr bool pair_reads = false;
template <>
inline constexpr bool pair_reads<op::hadamard> = true;  // r_x + r_y
template <>
inline constexpr bool pair_reads<op::row_divide_vjp> = true;  // (y, g): r_g − r_y, eps · e^−r_y
template <>
inline constexpr bool pair_reads<op::normalize_vjp> = true;  // (s, g): r_g − r_s, eps · e^−r_s

// An op whose eps is scaled by e^−r (the value of a normaliser of rows that
// carry r: (x e^r) / (Σ x e^r + eps) = x / (Σ x + eps e^−r)).
template <class Op, class T>
Op with_eps_scaled(Op o, T r) {
  if (r != 0) o.eps = o.eps * std::exp(-static_cast<double>(r));
  return o;
}

// Row i multiplied by e^r (r = 0: untouched).
template <class T>
void multiply_out(T* row, index cols, T r) {
  if (r == 0) return;
  T f = std::exp(r);
  lina::detail::each_lane(row, cols, [row, f](index j) { return row[j] * f; });
}
}  // namespace exponents

// Memory a program reuses: arenas of buffers, each handed out again once
// given back. A call keeps one arena per thread, so the slices a thread runs
// one after another reuse the memory of the first (fresh N-row temporaries
// cost a page fault per page, 4 KiB or, from 2 MiB, a huge page:
// lina/detail/allocate.hpp); a recurrent step keeps one per slice across
// calls, so that a step allocates nothing.
template <class T>
class workspace {
 public:
  workspace() = default;
  workspace(workspace const&) {}  // a copy starts with no memory of its own
  workspace& operator=(workspace const&) {
    arenas_.clear();
    return *this;
  }
  workspace(workspace&&) noexcept = default;
  workspace& operator=(workspace&&) noexcept = default;

  // At least `arenas` arenas, every buffer free.
  void begin(std::size_t arenas) {
    if (arenas_.size() < arenas) arenas_.resize(arenas);
    for (auto& a : arenas_) give_all(a);
  }
  // The smallest free buffer of at least n elements of arena `a`, else a new
  // one. (In lina's sanitized tests only its first n elements are
  // addressable, and a buffer given back none: detail::poison.)
  T* take(std::size_t a, std::size_t n) {
    auto& blocks = arenas_[a];
    block* best = nullptr;
    for (auto& b : blocks)
      if (!b.used && b.mem.size() >= n && (!best || b.mem.size() < best->mem.size())) best = &b;
    if (!best) best = &blocks.emplace_back(block{buffer<T>(std::max<std::size_t>(n, 1)), false});
    best->used = true;
    detail::unpoison(best->mem.get(), n);
    detail::poison(best->mem.get() + n, best->mem.size() - n);
    return best->mem.get();
  }
  void give(std::size_t a, T const* p) {
    for (auto& b : arenas_[a])
      if (b.mem.get() == p) set_free(b);
  }
  void give_all(std::size_t a) { give_all(arenas_[a]); }

 private:
  struct block {
    buffer<T> mem;
    bool used;
  };
  static void set_free(block& b) {
    b.used = false;
    detail::poison(b.mem.get(), b.mem.size());
  }
  static void give_all(std::vector<block>& blocks) {
    for (auto& b : blocks) set_free(b);
  }
  std::vector<std::vector<block>> arenas_;
};

// Workspaces kept from call to call: a call takes one (a fresh one when none
// is free) and gives it back when it ends, so that repeated calls (training
// steps, a benchmark loop) reuse memory already faulted in instead of
// mapping fresh pages (at N = 16k a backward's temporaries are ~30 MB per
// thread). Concurrent calls take different ones. The cached buffers count in
// cpu::memory().live; cpu::release_cached_memory() frees them.
namespace detail {
struct cache_registry {
  std::mutex m;
  std::vector<void (*)()> clearers;
  static cache_registry& instance() {
    static cache_registry r;
    return r;
  }
};
template <class T>
class workspace_pool {
 public:
  static workspace_pool& instance() {
    static workspace_pool* p = [] {
      auto* pool = new workspace_pool;  // lives as long as the process (calls may run during exit)
      auto& r = cache_registry::instance();
      std::lock_guard lock(r.m);
      r.clearers.push_back([] { instance().clear(); });
      return pool;
    }();
    return *p;
  }
  std::unique_ptr<workspace<T>> take() {
    std::lock_guard lock(m_);
    if (free_.empty()) return std::make_unique<workspace<T>>();
    auto w = std::move(free_.back());
    free_.pop_back();
    return w;
  }
  void give(std::unique_ptr<workspace<T>> w) {
    std::lock_guard lock(m_);
    free_.push_back(std::move(w));
  }
  void clear() {
    std::lock_guard lock(m_);
    free_.clear();
  }

 private:
  std::mutex m_;
  std::vector<std::unique_ptr<workspace<T>>> free_;
};
template <class T>
class cached_workspace {  // one call's workspace, back to the pool at the end of the call
 public:
  cached_workspace() : w_(workspace_pool<T>::instance().take()) {}
  cached_workspace(cached_workspace const&) = delete;
  ~cached_workspace() { workspace_pool<T>::instance().give(std::move(w_)); }
  workspace<T>* get() const { return w_.get(); }
  // Begun with an arena per thread, for a call whose loop runs on the threads.
  workspace<T>& per_thread() {
#ifdef _OPENMP
    w_->begin(static_cast<std::size_t>(omp_get_max_threads()));
#else
    w_->begin(1);
#endif
    return *w_;
  }

 private:
  std::unique_ptr<workspace<T>> w_;
};
// Whether a parallel loop here gets threads of its own (not inside another's).
inline bool outside_parallel() {
#ifdef _OPENMP
  return !omp_in_parallel();
#else
  return false;
#endif
}
}  // namespace detail

// Free the memory that finished calls keep for the next ones (detail::workspace_pool).
inline void release_cached_memory() {
  auto& r = detail::cache_registry::instance();
  std::lock_guard lock(r.m);
  for (auto clear : r.clearers) clear();
}

// ---- backward ops ----
// Row-local pairs (sched::row_local_pair): row<Op>::run(o, i, x, y, x_cols,
// y_cols, out) makes row i from row i of each operand, so a step runs them
// row by row and a scan can hand them its finished rows.
template <class Map>
struct row<op::phi_vjp<Map>> {  // J_φ(x_i)ᵀ g_i
  template <class T>
  static void run(op::phi_vjp<Map> const&, index, T const* x, T const* g, index cols, index, T* out) {
    if constexpr (concepts::elementwise_map<Map>) {  // (no pragma: row<op::phi>)
      lina::detail::each_lane(out, cols, [x, g](index j) { return g[j] * Map::derivative(x[j]); });
    } else {
      Map::vjp(x, static_cast<std::size_t>(cols), g, out);
    }
  }
};
template <>
struct row<op::hadamard> {
  template <class T>
  static void run(op::hadamard const&, index, T const* x, T const* y, index cols, index, T* out) {
    lina::detail::each_lane(out, cols, [x, y](index j) { return x[j] * y[j]; });
  }
};
template <>
struct row<op::add> {
  template <class T>
  static void run(op::add const&, index, T const* x, T const* y, index cols, index, T* out) {
    lina::detail::each_lane(out, cols, [x, y](index j) { return x[j] + y[j]; });
  }
};
template <>
struct row<op::normalize_vjp> {  // g_j / d - (Σ_k g_k s_k) / d², d = Σ_k s_k + eps
  template <class T>
  static void run(op::normalize_vjp const& o, index, T const* s, T const* g, index cols, index, T* out) {
    T sum = 0, dot = 0;
    for (index j = 0; j < cols; ++j) {
      sum += s[j];
      dot += g[j] * s[j];
    }
    T den = sum + static_cast<T>(o.eps);
    lina::detail::each_lane(out, cols, [g, den, dot](index j) { return g[j] / den - dot / (den * den); });
  }
};
template <>
struct row<op::row_divide_vjp> {  // g_e / d for the leading columns, -Σ_e g_e y_e / d² for the last
  template <class T>
  static void run(op::row_divide_vjp const& o, index, T const* y, T const* g, index cols, index, T* out) {
    index m = cols - 1;
    T den = y[m] + static_cast<T>(o.eps);
    T dot = 0;
    for (index e = 0; e < m; ++e) dot += g[e] * y[e];
    lina::detail::each_lane(out, m, [g, den](index e) { return g[e] / den; });
    out[m] = -dot / (den * den);
  }
};
// A parametric map's adjoints read the whole projection W: lowered as matrices.
template <class Map>
struct lower<op::phi_vjp<Map>> {
  template <class T>
  static void run(op::phi_vjp<Map> const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w,
                  matrix<T> const& g) {
    kernels::feature_map_vjp<Map, false>(x, w, g, out);
  }
};
template <class Map>
struct lower<op::phi_param_vjp<Map>> {
  template <class T>
  static void run(op::phi_param_vjp<Map> const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w,
                  matrix<T> const& g) {
    kernels::feature_map_vjp<Map, true>(x, w, g, out);
  }
};
template <class Map>
struct lower<op::phi_grad_z<Map>> {
  template <class T>
  static void run(op::phi_grad_z<Map> const&, matrix<T>& out, matrix<T> const& w, matrix<T> const& phi,
                  matrix<T> const& g) {
    kernels::feature_map_grad_z<Map>(w, phi, g, out);
  }
};
template <class Map>
struct lower<op::phi_dx<Map>> {
  template <class T>
  static void run(op::phi_dx<Map> const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w,
                  matrix<T> const& h) {
    kernels::feature_map_dx<Map>(x, w, h, out, current_path() == path::simple);
  }
};

// One long sequence with idle threads (a single slice, or slices run one at a
// time): its scans are split across the threads (kernels::scan_rows_split),
// each part at least half this many rows. Below it the split's extra work and
// thread start-up cost more than they save.
inline constexpr index sequence_split_min_rows = 2048;
inline int sequence_parts(index rows) {
#ifdef _OPENMP
  if (omp_in_parallel() || rows < sequence_split_min_rows) return 1;
  return static_cast<int>(std::min<index>(omp_get_max_threads(), 2 * rows / sequence_split_min_rows));
#else
  (void)rows;
  return 1;
#endif
}

// Threads pay off from a few slices of some size; below that, starting them
// costs more than the work (and oversubscribed machines make it worse). The
// size is the elements a call reads: its inputs, and a state's running sums,
// which a recurrent step reads and writes in full for one token of input (B =
// 1, H = 8, C = M = 64: 33k elements; a step on both threads measured 3.0-3.2
// us against 4.8-5.2 us on one, the OpenMP start and join included).
inline constexpr std::size_t parallel_min_elements = std::size_t(1) << 15;
template <class Bound, class T>
bool worth_threads(Bound const& in, state<T> const* st) {
#ifdef _OPENMP
  if (omp_in_parallel()) return false;  // the caller's threads share the work (packed sequences)
#endif
  std::size_t elements = st ? st->elements() : 0;
  for (auto const& v : in.views) elements += v.shape()[0] * v.shape()[1] * v.shape()[2] * v.shape()[3];
  return in.batch * in.heads > 1 && elements >= parallel_min_elements;
}

namespace detail {
// Write one slice's result into [b, h] of an output of any layout.
template <class T>
void store(matrix<T> const& m, tensor_view<T> out, std::size_t b, std::size_t h) {
  for (index i = 0; i < m.rows; ++i)
    for (index j = 0; j < m.cols; ++j) out(b, h, static_cast<std::size_t>(i), static_cast<std::size_t>(j)) = m(i, j);
}
// Every element of `from` into `to`, of the same shape, in any layouts.
template <class T>
void copy_elements(tensor_view<T const> from, tensor_view<T> to) {
  auto const& s = from.shape();
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1]; ++h)
      for (std::size_t i = 0; i < s[2]; ++i)
        for (std::size_t j = 0; j < s[3]; ++j) to(b, h, i, j) = from(b, h, i, j);
}
// Slice [b, h] of a bound input or an output as a matrix.
template <class V>
auto slice_of(V const& t, std::size_t b, std::size_t h) {
  using T = std::remove_const_t<typename V::element_type_>;
  auto const& s = t.strides();
  T const* base = t.data() + static_cast<index>(b) * s[0] + static_cast<index>(h) * s[1];
  return view<T>(base, static_cast<index>(t.shape()[2]), static_cast<index>(t.shape()[3]), s[2], s[3]);
}

// A node type's shape, void for one without a matrix shape (a bundle of outputs).
template <class N>
struct matrix_shape_of {
  using type = void;
};
template <class N>
  requires requires { typename N::shape; }
struct matrix_shape_of<N> {
  using type = typename N::shape;
};
// The rows and columns of a step of shape Shape at these bindings' extents
// ({0, 0} for void). One function per shape and bindings, not per step and plan.
template <class Shape, class Bound>
std::array<index, 2> step_extent(Bound const& in) {
  if constexpr (requires { Shape::rows::extent(in.table); })
    return {static_cast<index>(Shape::rows::extent(in.table)), static_cast<index>(Shape::cols::extent(in.table))};
  else
    return {0, 0};
}

// Memory from one arena of a workspace, given back when it goes.
template <class T>
struct scratch {
  workspace<T>* ws = nullptr;
  std::size_t arena = 0;
  T* p = nullptr;
  scratch() = default;  // holds nothing
  scratch(workspace<T>& w, std::size_t a, std::size_t n) : ws(&w), arena(a), p(n ? w.take(a, n) : nullptr) {}
  scratch(scratch const&) = delete;
  scratch& operator=(scratch&& o) noexcept {
    std::swap(ws, o.ws);
    std::swap(arena, o.arena);
    std::swap(p, o.p);
    return *this;
  }
  ~scratch() {
    if (p) ws->give(arena, p);
  }
};

// One select-free plan's schedule, run slice by slice into `outs` (one
// output tensor per schedule output).
template <class T, class Plan, class Bound, std::size_t Outputs>
class program {
  using S = schedule_of<Plan>;
  static constexpr std::size_t steps = S::size;

 public:
  // ws: per_thread, one arena per thread for this call (and the sequence
  // may be split across threads); else one per slice, kept across calls.
  program(Plan const& plan, Bound const& in, std::array<tensor_view<T>, Outputs> outs, state<T>* st,
          workspace<T>& ws, bool per_thread)
      : plan_(plan), in_(in), outs_(outs), st_(st), ws_(ws), per_thread_(per_thread),
        simple_(current_path() == path::simple) {
    static_assert(S::outputs::size == Outputs, "lina::cpu: one output tensor per output of the schedule");
    // Same-typed steps with values: shared when their values are equal (once
    // per call). Code for the steps with a twin only, and one extent function
    // per shape: a fold over every step was, for a deep stack's gradient, the
    // largest function its test file compiled.
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((share_[twinned.step[K]] = same_value(S::template node_at<S::twin[twinned.step[K]]>(plan_),
                                             S::template node_at<twinned.step[K]>(plan_))),
       ...);
    }(std::make_index_sequence<twinned.count>{});
    for (std::size_t j = 0; j < steps; ++j) extent_[j] = extent_fns[j](in_);
  }

  // The rows its scans run over (the sequence's), 0 without a scan.
  std::size_t scanned_rows() const {
    for (std::size_t j = 0; j < steps; ++j)
      if (S::scan_index[j] != sched::none) return static_cast<std::size_t>(extent_[j][0]);
    return 0;
  }

  void run(std::size_t b, std::size_t h) const {
    std::array<matrix<T>, steps + 1> slot{};
    std::array<bool, Outputs> direct{};
    turn w{b, h, b * in_.heads + h, {}, {}};
#ifdef _OPENMP
    if (per_thread_) w.arena = static_cast<std::size_t>(omp_get_thread_num());
#else
    if (per_thread_) w.arena = 0;
#endif
    [&]<std::size_t... K>(std::index_sequence<K...>) { (step<passes.step[K]>(slot, direct, w), ...); }(
        std::make_index_sequence<passes.count>{});
    [&]<class... O>(lina::detail::type_list<O...>) {
      std::size_t k = 0;
      ((direct[k] ? void() : store(operand<O>(slot, w), outs_[k], b, h), ++k), ...);
    }(typename S::outputs{});
    ws_.give_all(w.arena);
  }

 private:
  // One slice's run: which slice, the workspace arena it takes memory from,
  // and which results are that arena's (given back after their last use).
  struct turn {
    std::size_t b, h, arena;
    std::array<bool, steps + 1> pooled;
    std::array<T*, steps + 1> exps;  // a result's row exponents, from the arena
  };

  // A kernel's scratch from the run's arena (scratch<T>, outside the class:
  // one type per element type, not per plan).
  using lease = scratch<T>;

  // An operand: a bound input's slice, an earlier result, or a view of either.
  template <class O>
  matrix<T> operand(std::array<matrix<T>, steps + 1> const& slot, turn& w) const {
    if constexpr (requires { typename O::input; }) {
      return slice_of(in_.views[Bound::template input_index<typename O::input>()], w.b, w.h);
    } else if constexpr (requires { O::step; }) {
      return alias(slot[O::step]);
    } else if constexpr (std::is_same_v<O, sched::transposed_operand<typename O::of>>) {
      return operand<typename O::of>(slot, w).transposed();
    } else {
      matrix<T> m = operand<typename O::of>(slot, w);
      m.cols -= 1;
      return m;
    }
  }

  // The steps that make their rows in a pass of their own, in order (the
  // others' rows are made in another step's pass: a fused group, a scan's
  // loads or output). run() instantiates step<J> only for these.
  struct step_list {
    std::array<std::size_t, steps> step{};
    std::size_t count = 0;
  };
  static constexpr step_list make_passes() {
    step_list r{};
    for (std::size_t j = 0; j < steps; ++j)
      if (S::runs_in[j] == j) r.step[r.count++] = j;
    return r;
  }
  static constexpr step_list passes = make_passes();
  // The steps that may share a same-typed earlier step's result (share_).
  static constexpr step_list make_twinned() {
    step_list r{};
    for (std::size_t j = 0; j < steps; ++j)
      if (S::twin[j] != sched::none) r.step[r.count++] = j;
    return r;
  }
  static constexpr step_list twinned = make_twinned();

  // Per step j: output k when it is step j's result and the first output that is, else Outputs.
  template <class Out>
  static constexpr std::size_t output_step() {  // the step output Out is, else none (a view of one, an input)
    if constexpr (requires { Out::step; })
      return std::is_same_v<Out, sched::step_operand<Out::step>> ? Out::step : sched::none;
    else
      return sched::none;
  }
  template <class... O>
  static constexpr std::array<std::size_t, steps> make_output_index(lina::detail::type_list<O...>) {
    std::array<std::size_t, steps> r{};
    r.fill(Outputs);
    constexpr std::array<std::size_t, sizeof...(O) + 1> step{output_step<O>()..., sched::none};
    for (std::size_t k = 0; k < sizeof...(O); ++k)
      if (step[k] != sched::none && r[step[k]] == Outputs) r[step[k]] = k;
    return r;
  }
  static constexpr std::array<std::size_t, steps> output_index = make_output_index(typename S::outputs{});

  // Each step's rows and columns at this call's extents: a function per shape
  // (step_extent), from a table per step.
  using extent_fn = std::array<index, 2> (*)(Bound const&);
  template <std::size_t... J>
  static constexpr std::array<extent_fn, steps> make_extent_fns(std::index_sequence<J...>) {
    return {&step_extent<typename matrix_shape_of<typename S::template node_type<J>>::type, Bound>...};
  }
  static constexpr std::array<extent_fn, steps> extent_fns = make_extent_fns(std::make_index_sequence<steps>{});

  template <std::size_t J>
  void step(std::array<matrix<T>, steps + 1>& slot, std::array<bool, Outputs>& direct, turn& w) const {
    using N = typename S::template node_type<J>;
    if constexpr (S::runs_in[J] != J) {
      return;  // its rows are made in another step's pass (a fused group, a scan's loads or output)
    } else {
      if constexpr (S::twin[J] != sched::none) {
        if (share_[J]) {
          slot[J] = alias(slot[S::twin[J]]);
          if constexpr (S::template is_scan<J>)  // a carried state: J's sums are the twin's
            if (st_) {
              auto const& sc = st_->scan(S::scan_index[J]);
              std::copy_n(st_->at(S::scan_index[S::twin[J]], w.b, w.h), sc.a * sc.b, st_->at(S::scan_index[J], w.b, w.h));
            }
          release(J, slot, w);
          return;
        }
      }
      if constexpr (S::template is_scan<J>) {
        run_scan<J>(slot, direct, w);
      } else {
        destination(J, slot, direct, w);
        if constexpr (sched::row_wise<N>()) {
          rows_of_group<J>(slot, w);
        } else if constexpr (sched::row_local_pair<N>()) {
          rows_of_pair<J>(slot, w);
        } else if constexpr (std::is_same_v<typename N::op_type, op::product>) {
          product<J>(slot, w);
        } else {
          [&]<class... O>(lina::detail::type_list<O...>) {
            lower<typename N::op_type>::run(S::template node_at<J>(plan_).op, slot[J], operand<O>(slot, w)...);
          }(typename S::template operands<J>{});
        }
        if constexpr (with_exp) {
          constexpr bool kept = keeps_exponents()[J];
          if (!kept && slot[J].row_exp) {  // a reader that needs the values
            matrix<T>& m = slot[J];
            for (index i = 0; i < m.rows; ++i) exponents::multiply_out(m.row_mut(i), m.cols, m.row_exp[i]);
            m.row_exp = nullptr;
          }
        }
      }
      release(J, slot, w);
    }
  }

  // slot[J]: straight into the caller's output when J is one and its rows are
  // contiguous, else fresh memory.
  void destination(std::size_t j, std::array<matrix<T>, steps + 1>& slot, std::array<bool, Outputs>& direct,
                   turn& w) const {
    auto const [rows, cols] = extent_[j];
    if (std::size_t const k = output_index[j]; k < Outputs) {
      matrix<T> out = slice_of(outs_[k], w.b, w.h);
      if (out.cs == 1 || cols <= 1) {
        out.cs = 1;
        slot[j] = std::move(out);
        direct[k] = true;
        return;
      }
    }
    slot[j] = view<T>(ws_.take(w.arena, static_cast<std::size_t>(rows * cols)), rows, cols, cols, 1);
    w.pooled[j] = true;
  }

  // A fused scan: its operands from their matrices, or made chunk by chunk as
  // it loads them (a group it absorbs); its output into slot[J], or finished
  // chunk by chunk by the group it emits into that group's result. A scan
  // paired with an earlier one (S::dual_of) makes that one's rows too, as the
  // second output of one scan over its running sum (kernels::second); the
  // simple path runs the two as written, one after the other.
  template <std::size_t J>
  void run_scan(std::array<matrix<T>, steps + 1>& slot, std::array<bool, Outputs>& direct, turn& w) const {
    using N = typename S::template node_type<J>;
    using ops = typename S::template operands<J>;
    constexpr bool reverse = fused_scan_parts<N>::reverse;
    constexpr std::size_t D = S::dual_of[J];
    auto a = source<J, lina::detail::type_at_t<0, ops>>(slot, w);
    auto bs = source<J, lina::detail::type_at_t<1, ops>>(slot, w);
    auto c = source<J, lina::detail::type_at_t<2, ops>>(slot, w);
    index rows = static_cast<index>(N::shape::rows::extent(in_.table));
    // scan K's running sums: the plan's state (carried across evaluations), or zeros
    auto sums_of = [&]<std::size_t K>(lease& space, std::size_t size) {
      if (S::scan_index[K] != sched::none && st_) return st_->at(S::scan_index[K], w.b, w.h);
      space = lease(ws_, w.arena, size);
      std::fill_n(space.p, size, T(0));
      return space.p;
    };
    // the rows the state's sums hold already (chained blocks: two levels past
    // two_level_rows; a step there adds to the state's pending sums)
    index const before = S::scan_index[J] != sched::none && st_ ? static_cast<index>(st_->rows(S::scan_index[J], w.b)) : 0;
    T const decay = scan_decay<J>(w.h);
    bool const pending_step = D == sched::none && !scan_decays<J>() && rows == 1 && !simple_ && st_ &&
                              S::scan_index[J] != sched::none && st_->has_pending() &&
                              kernels::past_one_level<T>(before, 1);
    lease sums_space;
    T* sums = pending_step ? st_->unfolded_at(S::scan_index[J], w.b, w.h)
                           : sums_of.template operator()<J>(sums_space, static_cast<std::size_t>(bs.cols() * c.cols()));
    T* const pending = pending_step ? st_->pending_at(S::scan_index[J], w.b, w.h) : nullptr;
    // one scan, as written (the simple path), split over threads (not a
    // decayed one: the parts' sums would need powers of the decay), or in one
    // pass (with a second output)
    auto scan = [&](auto const& a_, auto const& b_, auto const& c_, auto const& sink, T* sums_, auto const& sec) {
      if (simple_) {
        simple_scan(a_, b_, c_, sink, rows, sums_, reverse, decay, w);
      } else if (int parts = sequence_parts(rows); parts > 1 && per_thread_ && decay == T(1)) {
        kernels::scan_rows_split(a_.rows(), b_.rows(), c_.rows(), sink, rows, sums_, reverse, parts, sec, before);
      } else {
        lease space(ws_, w.arena, kernels::scan_scratch_size<T>(rows, a_.rows(), b_.rows(), c_.rows(), sink, sec));
        if constexpr (scan_decays<J>())
          kernels::scan_rows(a_.rows(), b_.rows(), c_.rows(), sink, 0, rows, sums_, reverse, space.p, sec, decay,
                             before);
        else  // (no decayed kernels compiled for a plan without one)
          kernels::scan_rows(a_.rows(), b_.rows(), c_.rows(), sink, 0, rows, sums_, reverse, space.p, sec,
                             kernels::unit_decay{}, before, sums_ == sums ? pending : nullptr);
      }
    };
    with_sink<J>(slot, direct, w, c.cols(), [&](auto const& sink) {
      if constexpr (D == sched::none) {
        scan(a, bs, c, sink, sums, kernels::no_second{});
      } else {
        using opsd = typename S::template operands<D>;
        auto x = source<D, lina::detail::type_at_t<0, opsd>>(slot, w);
        with_sink<D>(slot, direct, w, bs.cols(), [&](auto const& sink2) {
          bool paired = same_operand<lina::detail::type_at_t<1, opsd>, lina::detail::type_at_t<2, ops>>() &&
                        same_operand<lina::detail::type_at_t<2, opsd>, lina::detail::type_at_t<1, ops>>() &&
                        scan_decay<D>(w.h) == decay;
          if (simple_ || !paired) {  // the two scans one after the other
            scan(a, bs, c, sink, sums, kernels::no_second{});
            auto b2 = source<D, lina::detail::type_at_t<1, opsd>>(slot, w);
            auto c2 = source<D, lina::detail::type_at_t<2, opsd>>(slot, w);
            lease space2;
            T* sums2 = sums_of.template operator()<D>(space2, static_cast<std::size_t>(b2.cols() * c2.cols()));
            scan(x, b2, c2, sink2, sums2, kernels::no_second{});
          } else {
            auto const& xr = x.rows();
            scan(a, bs, c, sink, sums,
                 kernels::second<std::remove_cvref_t<decltype(xr)>, std::remove_cvref_t<decltype(sink2)>>{xr, sink2});
          }
        });
      }
    });
    if (pending_step) st_->pending_step(S::scan_index[J], w.b, w.h);  // (folded every fold_rows steps)
  }
  // The decay of scan step J's running sums in head h (1: none), and whether
  // its mask has one at all (else it is 1 whatever the head).
  template <std::size_t J>
  T scan_decay(std::size_t h) const {
    return static_cast<T>(kid<1>(S::template node_at<J>(plan_)).op.at(h));
  }
  template <std::size_t J>
  static constexpr bool scan_decays() {
    using scan = std::remove_cvref_t<decltype(kid<1>(S::template node_at<J>(std::declval<Plan const&>())))>;
    return !std::is_base_of_v<op::no_decay, typename scan::op_type>;  // (prefix_scan_t<Decay> is a Decay)
  }
  // Do two operands hold the same rows: the same, or twins whose values are equal (shared)?
  template <class O1, class O2>
  bool same_operand() const {
    if constexpr (std::is_same_v<O1, O2>) {
      return true;
    } else if constexpr (requires { O1::step; O2::step; }) {
      auto root = [&](std::size_t x) { return S::twin[x] != sched::none && share_[x] ? S::twin[x] : x; };
      return root(O1::step) == root(O2::step);
    } else {
      return false;
    }
  }
  // f(the sink of scan J's rows, `cols` wide): slot[J], or the group J emits
  // (its destination made here).
  template <std::size_t J, class F>
  void with_sink(std::array<matrix<T>, steps + 1>& slot, std::array<bool, Outputs>& direct, turn& w, index cols,
                 F&& f) const {
    constexpr std::size_t E = S::emits[J] == sched::none ? J : S::emits[J];
    destination(E, slot, direct, w);
    if constexpr (E == J)
      f(kernels::matrix_sink<T>{slot[J]});
    else if constexpr (sched::row_wise<typename S::template node_type<E>>())
      f(group_sink<E>{*this, slot[E], cols, group_width(S::chain_start[E], E, cols), w.h});
    else
      f(pair_sink<E, J>{*this, slot[E], cols, operand<typename pair_sink<E, J>::side>(slot, w)});
  }

  // The simple path's scan: operands in full (a group it would load made
  // into a matrix first), the plain row-by-row scan into a full result, which
  // then goes through the group it would emit into.
  template <class A, class B, class C, class Out>
  void simple_scan(A const& a, B const& b, C const& c, Out const& sink, index rows, T* sums, bool reverse, T decay,
                   turn& w) const {
    std::array<lease, 4> mem;
    auto whole = [&](auto const& x, lease& m) { return x.whole(rows, m, *this, w); };
    matrix<T> am = whole(a, mem[0]), bm = whole(b, mem[1]), cm = whole(c, mem[2]);
    if constexpr (std::is_same_v<Out, kernels::matrix_sink<T>>) {
      kernels::scan_simple(am, bm, cm, sink.m, sums, reverse, decay);
    } else {
      mem[3] = lease(ws_, w.arena, static_cast<std::size_t>(rows * cm.cols));
      matrix<T> out = view<T>(mem[3].p, rows, cm.cols, cm.cols, 1);
      kernels::scan_simple(am, bm, cm, out, sums, reverse, decay);
      lease work(ws_, w.arena, sink.work());
      sink.take(0, rows, false, mem[3].p, cm.cols, work.p);
    }
  }

  // ---- fused groups of row-wise steps -------------------------------------
  // The widest row a group First ... Last handles (its source's and members' columns).
  index group_width(std::size_t first, std::size_t last, index source_cols) const {
    index widest = source_cols;
    for (std::size_t m = first;; m = S::absorbed_by[m]) {
      widest = std::max(widest, extent_[m][1]);
      if (m == last) return widest;
    }
  }
  // Where step j's diagonal lies: j_diag = i + its columns less its rows (0
  // for a square matrix; r0 for the R x (r0 + R) scores of a block of query
  // rows from r0, row_blocks.hpp).
  index diagonal(std::size_t j) const { return extent_[j][1] - extent_[j][0]; }
  // Row i of group First ... Last from `in` (the source's row i, contiguous,
  // `cols` wide) into `dst`, each member after the other between two rows of
  // `work` (2 x widest), so its intermediate rows are never stored.
  // r: the source row's exponent (0 unless the first member keeps or ends
  // it); the row's exponent at the end goes to *r_out, or is multiplied out
  // of dst when r_out is null.
  template <std::size_t First, std::size_t Last>
  void group_row(std::size_t head, index i, T const* in, index cols, T* dst, T* work, index widest, T r = 0,
                 T* r_out = nullptr) const {
    T const* cur = in;
    T* spare[2] = {work, work + widest};
    int which = 0;
    for_members<First, Last>([&]<std::size_t M>() {
      using MN = typename S::template node_type<M>;
      using Op = typename MN::op_type;
      constexpr exponents::rule rule = exponents::rule_of<Op>;
      [[maybe_unused]] auto const& o = S::template node_at<M>(plan_).op;
      T* to = M == Last ? dst : spare[which];
      if constexpr (rule == exponents::rule::values || rule == exponents::rule::makes)
        if (r != 0) {  // (cur is a spare row here: r is 0 at the first member, see rows_of_group)
          exponents::multiply_out(const_cast<T*>(cur), cols, r);
          r = 0;
        }
      if constexpr (rule == exponents::rule::makes) {  // exp (vectorised: detail/exp.hpp)
        // The columns the row keeps: those up to the diagonal when a causal
        // mask drops the others before anything reads across them (lower_read;
        // their exp may overflow and is not made).
        constexpr bool masked = lower_read<M>();
        index kept = masked ? std::max<index>(0, std::min(i + 1 + diagonal(M), cols)) : cols;
        T m = exponents::shift_of(cur, kept);  // (x − 0 is x: an unshifted row is exp as written)
        lina::detail::each_lane(to, kept, [cur, m](index j) { return lina::detail::exp(cur[j] - m); });
        std::fill(to + kept, to + cols, T(0));
        r = m;
      } else if constexpr (rule == exponents::rule::ends) {
        row<Op>::run(exponents::with_eps_scaled(o, r), i, cur, cols, to);
        r = 0;
      } else if constexpr (is_causal_op<Op>) {  // (its decay may be the head's; row i's diagonal is at i + offset)
        row<Op>::run(o, head, i + diagonal(M), cur, cols, to);
      } else {
        row<Op>::run(o, i, cur, cols, to);
        if constexpr (std::is_same_v<Op, op::append_ones>)
          if (r != 0) to[cols] = std::exp(-r);  // [x | 1] of the row as written
      }
      cur = to;
      cols = static_cast<index>(MN::shape::cols::extent(in_.table));
      which ^= 1;
    });
    if (r_out)
      *r_out = r;
    else
      exponents::multiply_out(dst, cols, r);
  }
  // How step J's value is among operands O (J's, or a twin's that may be
  // J's): 0 not, 1 directly only, 2 through a view.
  template <std::size_t J, class... O>
  static constexpr int reads_of(lina::detail::type_list<O...>) {
    int r = 0;
    auto note = [&](std::size_t step, bool direct) {
      if (step != sched::none && (step == J || S::twin[step] == J)) r = std::max(r, direct ? 1 : 2);
    };
    (note(sched::reads<O>::step, std::is_same_v<O, sched::step_operand<sched::reads<O>::step>>), ...);
    return r;
  }
  // Does the group First ... Last have an exp?
  template <std::size_t First, std::size_t Last>
  static constexpr bool group_exps() {
    bool any = false;
    for_members<First, Last>([&]<std::size_t M>() {
      any = any || exponents::rule_of<typename S::template node_type<M>::op_type> == exponents::rule::makes;
    });
    return any;
  }
  // Row i of a group's source, contiguous: in place, or copied into `copy`.
  static T const* source_row(matrix<T> const& src, index i, T* copy) {
    if (src.cs == 1) return src.data + i * src.rs;
    for (index j = 0; j < src.cols; ++j) copy[j] = src(i, j);
    return copy;
  }
  // f.template operator()<M>() for the members of the group from First to K, in order.
  template <std::size_t First, std::size_t K, class F>
  static constexpr void for_members(F&& f) {
    f.template operator()<First>();
    if constexpr (First != K) for_members<S::absorbed_by[First], K>(f);
  }

  // A group on its own: every row of its source through it into slot[K].
  template <std::size_t K>
  void rows_of_group(std::array<matrix<T>, steps + 1>& slot, turn& w) const {
    constexpr std::size_t first = S::chain_start[K];
    matrix<T> src = operand<lina::detail::type_at_t<0, typename S::template operands<first>>>(slot, w);
    index widest = group_width(first, K, src.cols);
    lease rowbuf(ws_, w.arena, static_cast<std::size_t>(3 * widest));
    T* work = rowbuf.p;
    matrix<T>& out = slot[K];
    lease values;
    if constexpr (with_exp) {
      constexpr exponents::rule rule = exponents::rule_of<typename S::template node_type<first>::op_type>;
      if constexpr (rule != exponents::rule::keeps && rule != exponents::rule::ends)
        if (src.row_exp) src = multiplied_out(std::move(src), values, w);
      // (rows end with an exponent when the group exps, or its first op passes its source's on)
      constexpr bool exps = group_exps<first, K>();
      if (exps || src.row_exp) {
        w.exps[K] = ws_.take(w.arena, static_cast<std::size_t>(src.rows));
        bool any = false;
        for (index i = 0; i < src.rows; ++i) {
          group_row<first, K>(w.h, i, source_row(src, i, work + 2 * widest), src.cols, out.row_mut(i), work, widest,
                              src.row_exp ? src.row_exp[i] : T(0), w.exps[K] + i);
          any = any || w.exps[K][i] != 0;
        }
        keep_exponents(K, slot, w, any);
        return;
      }
    }
    for (index i = 0; i < src.rows; ++i)
      group_row<first, K>(w.h, i, source_row(src, i, work + 2 * widest), src.cols, out.row_mut(i), work, widest);
  }

  // A scan operand made chunk by chunk: the rows of group ... Last, from its source.
  template <std::size_t Last>
  struct group_source {
    static constexpr std::size_t first = S::chain_start[Last];
    program const& p;
    matrix<T> src;
    index width, widest;
    std::size_t head;
    index cols() const { return width; }
    T const* in_place() const { return nullptr; }
    index stride() const { return 0; }
    std::size_t work() const { return static_cast<std::size_t>(3 * widest); }
    void pack(index first_row, index n, bool reverse, T* to, index ld, T* work) const {
      for (index t = 0; t < n; ++t) {
        index i = reverse ? first_row - t : first_row + t;
        T* dst = to + t * ld;
        p.template group_row<first, Last>(head, i, source_row(src, i, work + 2 * widest), src.cols, dst, work, widest);
        std::fill(dst + width, dst + ld, T(0));
      }
    }
  };
  // A scan's finished rows through the group ... Last it emits, into `out`.
  template <std::size_t Last>
  struct group_sink {
    static constexpr std::size_t first = S::chain_start[Last];
    program const& p;
    matrix<T>& out;
    index cols, widest;  // the scan's row width, the group's widest row
    std::size_t head;
    T* in_place() const { return nullptr; }
    index stride() const { return 0; }
    std::size_t work() const { return static_cast<std::size_t>(2 * widest); }
    void take(index first_row, index n, bool reverse, T const* rows, index ld, T* work) const {
      for (index t = 0; t < n; ++t) {
        index i = reverse ? first_row - t : first_row + t;
        p.template group_row<first, Last>(head, i, rows + t * ld, cols, out.row_mut(i), work, widest);
      }
    }
  };
  // A row-local pair on its own: row i of each operand into row i of slot[K].
  template <std::size_t K>
  void rows_of_pair(std::array<matrix<T>, steps + 1>& slot, turn& w) const {
    using ops = typename S::template operands<K>;
    matrix<T> x = operand<lina::detail::type_at_t<0, ops>>(slot, w);
    matrix<T> y = operand<lina::detail::type_at_t<1, ops>>(slot, w);
    lease copies(ws_, w.arena, static_cast<std::size_t>(x.cols + y.cols));
    auto const& o = S::template node_at<K>(plan_).op;
    using Op = typename S::template node_type<K>::op_type;
    if constexpr (with_exp && exponents::pair_reads<Op>) {
      if (x.row_exp || y.row_exp) {
        w.exps[K] = ws_.take(w.arena, static_cast<std::size_t>(x.rows));
        bool any = false;
        for (index i = 0; i < x.rows; ++i) {
          T rx = x.row_exp ? x.row_exp[i] : T(0), ry = y.row_exp ? y.row_exp[i] : T(0), r;
          T const *xr = source_row(x, i, copies.p), *yr = source_row(y, i, copies.p + x.cols);
          if constexpr (std::is_same_v<Op, op::hadamard>) {
            row<Op>::run(o, i, xr, yr, x.cols, y.cols, slot[K].row_mut(i));
            r = rx + ry;
          } else {  // an adjoint of a normaliser: x is the rows it divided, y the gradient
            row<Op>::run(exponents::with_eps_scaled(o, rx), i, xr, yr, x.cols, y.cols, slot[K].row_mut(i));
            r = ry - rx;
          }
          w.exps[K][i] = r;
          any = any || r != 0;
        }
        keep_exponents(K, slot, w, any);
        return;
      }
    }
    for (index i = 0; i < x.rows; ++i)
      row<Op>::run(o, i, source_row(x, i, copies.p), source_row(y, i, copies.p + x.cols), x.cols, y.cols,
                   slot[K].row_mut(i));
  }
  // After step k wrote its row exponents into w.exps[k]: kept when any is not 0.
  void keep_exponents(std::size_t k, std::array<matrix<T>, steps + 1>& slot, turn& w, bool any) const {
    if (any) {
      slot[k].row_exp = w.exps[k];
    } else {
      ws_.give(w.arena, w.exps[k]);
      w.exps[k] = nullptr;
    }
  }
  // m with its exponents multiplied out, in memory from `mem` (m itself when it has none).
  matrix<T> multiplied_out(matrix<T> m, lease& mem, turn& w) const {
    if (!m.row_exp && !m.col_exp) return m;
    mem = lease(ws_, w.arena, static_cast<std::size_t>(m.rows * m.cols));
    matrix<T> v = view<T>(mem.p, m.rows, m.cols, m.cols, 1);
    for (index i = 0; i < m.rows; ++i)
      for (index j = 0; j < m.cols; ++j) {
        T e = (m.row_exp ? m.row_exp[i] : T(0)) + (m.col_exp ? m.col_exp[j] : T(0));
        v.at_mut(i, j) = e == 0 ? m(i, j) : m(i, j) * std::exp(e);
      }
    return v;
  }
  // A product A·B, skipping the zeros known at compile time (triangle_of,
  // lower_only). Its operands may carry exponents: A's rows give the
  // result's; along the contraction, A's column and B's row exponents cancel
  // when opposite (the backward's Eᵀ·ĝ), else are multiplied out.
  template <std::size_t J>
  void product(std::array<matrix<T>, steps + 1>& slot, turn& w) const {
    using ops = typename S::template operands<J>;
    constexpr kernels::triangle at = triangle_of<lina::detail::type_at_t<0, ops>, true>();
    constexpr bool lower_half = lower_only<J>();
    multiply(operand<lina::detail::type_at_t<0, ops>>(slot, w), operand<lina::detail::type_at_t<1, ops>>(slot, w), at,
             lower_half, J, slot, w);
  }
  // The product itself, at step j (one function per program, not per step:
  // what depends on the step is known before, in product<J>).
  void multiply(matrix<T> a, matrix<T> b, kernels::triangle at, bool lower_half, std::size_t j,
                std::array<matrix<T>, steps + 1>& slot, turn& w) const {
    // (diagonals: a lower triangle's lies its columns less its rows right of
    // the first column, `diagonal`; an upper one, a lower one's transpose, its
    // rows less its columns)
    kernels::product_zeros const zeros{at, lower_half, at == kernels::triangle::upper ? a.rows - a.cols : a.cols - a.rows,
                                       diagonal(j)};
    [[maybe_unused]] T const* rows_exp = nullptr;
    lease ma, mb;
    if constexpr (with_exp) {
      rows_exp = std::exchange(a.row_exp, nullptr);
      if (b.col_exp) b = multiplied_out(std::move(b), mb, w);
      if (a.col_exp || b.row_exp) {
        bool cancel = a.col_exp && b.row_exp;
        for (index k = 0; cancel && k < a.cols; ++k) cancel = a.col_exp[k] == -b.row_exp[k];
        if (cancel) {
          a.col_exp = b.row_exp = nullptr;
        } else {
          a = multiplied_out(std::move(a), ma, w);
          b = multiplied_out(std::move(b), mb, w);
        }
      }
    }
    lower<op::product>::run(op::product{}, slot[j], a, std::move(b), zeros);
    if constexpr (with_exp)
      if (rows_exp) {
        w.exps[j] = ws_.take(w.arena, static_cast<std::size_t>(a.rows));
        std::copy_n(rows_exp, a.rows, w.exps[j]);
        slot[j].row_exp = w.exps[j];
      }
  }

  // ---- products that skip known zeros ----
  // A causal mask zeroes a score matrix past the diagonal, and softmax's
  // products read such matrices (E·[V|1] forward; Eᵀ·ĝ, dS·K, dSᵀ·Q in the
  // backward) or make scores of which only the lower triangle is read (Q·Kᵀ
  // before exp and the mask; ĝ·[V|1]ᵀ before ⊙E). Both are known from the
  // plan: triangle_of says which triangle of an operand may be non-zero,
  // lower_only whether a product's readers keep only its lower triangle;
  // kernels::gemm then skips the zero terms and the tiles no one reads.

  // Which triangle of operand O may be non-zero. Demand: count the products
  // made lower only as lower triangular (not when asked on lower_only's
  // behalf: that would ask lower_only again).
  template <class O, bool Demand>
  static constexpr kernels::triangle triangle_of() {
    using kernels::triangle;
    if constexpr (requires { O::step; }) {
      return step_triangle<O::step, Demand>();
    } else if constexpr (requires { typename O::input; }) {
      return triangle::full;
    } else if constexpr (std::is_same_v<O, sched::transposed_operand<typename O::of>>) {
      constexpr triangle t = triangle_of<typename O::of, Demand>();
      return t == triangle::lower ? triangle::upper : t == triangle::upper ? triangle::lower : triangle::full;
    } else {  // all but its last column
      return triangle_of<typename O::of, Demand>();
    }
  }
  // Ops that keep a zero element zero (a mask makes them).
  template <class Op>
  static constexpr bool keeps_zeros = is_causal_op<Op> || std::is_same_v<Op, op::scale> ||
                                      std::is_same_v<Op, op::normalize> || std::is_same_v<Op, op::row_divide>;
  template <std::size_t J, bool Demand>
  static constexpr kernels::triangle step_triangle() {
    using kernels::triangle;
    using N = typename S::template node_type<J>;
    using Op = typename N::op_type;
    using ops = typename S::template operands<J>;
    if constexpr (S::template is_scan<J>) {
      return triangle::full;
    } else if constexpr (std::is_same_v<Op, op::product>) {
      return Demand && lower_only<J>() ? triangle::lower : triangle::full;
    } else if constexpr (sched::row_wise<N>()) {  // the group that ends at J
      return group_triangle<S::chain_start[J], J>(
          triangle_of<lina::detail::type_at_t<0, typename S::template operands<S::chain_start[J]>>, Demand>());
    } else if constexpr (std::is_same_v<Op, op::hadamard> || std::is_same_v<Op, op::add>) {
      constexpr triangle x = triangle_of<lina::detail::type_at_t<0, ops>, Demand>();
      constexpr triangle y = triangle_of<lina::detail::type_at_t<1, ops>, Demand>();
      if constexpr (std::is_same_v<Op, op::add>)
        return x == y ? x : triangle::full;
      else
        return x != triangle::full ? x : y;
    } else {
      return triangle::full;
    }
  }
  // Members M ... Last of a group, from its source's triangle t.
  template <std::size_t M, std::size_t Last>
  static constexpr kernels::triangle group_triangle(kernels::triangle t) {
    using Op = typename S::template node_type<M>::op_type;
    t = is_causal_op<Op> ? kernels::triangle::lower : keeps_zeros<Op> ? t : kernels::triangle::full;
    if constexpr (M == Last)
      return t;
    else
      return group_triangle<S::absorbed_by[M], Last>(t);
  }
  // Does step K, if it reads step J (or a twin J may stand for), keep only
  // J's lower triangle (j <= i)? A causal mask does; so do column-local ops
  // whose own value is read so (a scale, exp on the way to a mask: a group's
  // members or steps of their own), and a Hadamard product with a
  // lower-triangular matrix — each reading J directly. A normaliser, which
  // sums the row, does not: causal(normalize(exp(S))) needs exp(S) in full.
  template <std::size_t J, std::size_t K>
  static constexpr bool keeps_lower() {
    using ops = typename S::template operands<K>;
    using N = typename S::template node_type<K>;
    using Op = typename N::op_type;
    constexpr int how = how_read[J * steps + K];
    if constexpr (how == 0) {
      return true;
    } else if constexpr (how == 2 || S::template is_scan<K>) {
      return false;
    } else if constexpr (sched::row_wise<N>()) {
      if constexpr (is_causal_op<Op>)
        return true;
      else if constexpr (column_local<Op>)
        return lower_read<K>();
      else
        return false;
    } else if constexpr (std::is_same_v<Op, op::hadamard>) {
      using X = lina::detail::type_at_t<0, ops>;
      using Y = lina::detail::type_at_t<1, ops>;
      constexpr bool x_is_j = reads_of<J>(lina::detail::type_list<X>{}) != 0;
      constexpr bool y_is_j = reads_of<J>(lina::detail::type_list<Y>{}) != 0;
      if constexpr (x_is_j && y_is_j)
        return false;
      else if constexpr (x_is_j)
        return triangle_of<Y, false>() == kernels::triangle::lower;
      else
        return triangle_of<X, false>() == kernels::triangle::lower;
    } else {
      return false;
    }
  }
  // how_read[J * steps + K]: reads_of<J>(step K's operands), for every J and
  // K from one pass over the steps, so that the questions below are asked of
  // J's readers only (asked of every pair, they were steps² instantiations).
  template <class... O>
  static constexpr void note_reads(std::array<std::uint8_t, (steps + 1) * steps>& how, std::size_t k,
                                   lina::detail::type_list<O...>) {
    auto note = [&](std::size_t step, std::uint8_t v) {
      if (step == sched::none) return;
      for (std::size_t j : {step, static_cast<std::size_t>(S::twin[step])})
        if (j != sched::none && how[j * steps + k] < v) how[j * steps + k] = v;
    };
    (note(sched::reads<O>::step, std::is_same_v<O, sched::step_operand<sched::reads<O>::step>> ? 1 : 2), ...);
  }
  template <std::size_t... K>
  static constexpr std::array<std::uint8_t, (steps + 1) * steps> make_how_read(std::index_sequence<K...>) {
    std::array<std::uint8_t, (steps + 1) * steps> how{};
    (note_reads(how, K, typename S::template operands<K>{}), ...);
    return how;
  }
  static constexpr std::array<std::uint8_t, (steps + 1) * steps> how_read =
      make_how_read(std::make_index_sequence<steps>{});
  template <std::size_t J>
  static constexpr step_list readers_of() {
    step_list r{};
    for (std::size_t k = 0; k < steps; ++k)
      if (how_read[J * steps + k] != 0) r.step[r.count++] = k;
    return r;
  }
  template <std::size_t J, std::size_t... I>
  static constexpr bool all_keep_lower(std::index_sequence<I...>) {
    constexpr step_list readers = readers_of<J>();
    return (keeps_lower<J, readers.step[I]>() && ...);
  }
  // Is only the lower triangle of step J's value read (by some reader; J no output)?
  template <std::size_t J>
  static constexpr bool lower_read() {
    if constexpr (reads_of<J>(typename S::outputs{}) != 0)
      return false;
    else
      return readers_of<J>().count > 0 && all_keep_lower<J>(std::make_index_sequence<readers_of<J>().count>{});
  }
  // Is product J made in its lower triangle only (the rest zeros)? When
  // only that is read of J and of its twins (one of which may make the value
  // all of them share): lower_read of the first of them, whose readers
  // (reads_of) are all of theirs.
  template <std::size_t J>
  static constexpr bool lower_only() {
    if constexpr (S::template is_scan<J>)
      return false;
    else
      return lower_read<S::twin[J] == sched::none ? J : S::twin[J]>();
  }

  // ---- which results keep their exponents ----
  static constexpr bool with_exp = [] {
    return []<std::size_t... J>(std::index_sequence<J...>) {
      return (std::is_same_v<typename S::template node_type<J>::op_type, op::exp> || ...);
    }(std::make_index_sequence<steps>{});
  }();
  // Is operand O a transposed view (anywhere between the step and the reader)?
  template <class O>
  static constexpr bool transposes() {
    if constexpr (requires { typename O::of; })
      return std::is_same_v<O, sched::transposed_operand<typename O::of>> || transposes<typename O::of>();
    else
      return false;
  }
  // Does step K read its operand O with the exponents it carries? Row-wise
  // readers take row exponents only (not a transposed view's column ones).
  template <std::size_t K, class O>
  static constexpr bool reads_exponents() {
    using N = typename S::template node_type<K>;
    using Op = typename N::op_type;
    if constexpr (std::is_same_v<Op, op::product>)
      return S::runs_in[K] == K;
    else if constexpr (sched::row_wise<N>())  // a group's first step, the group on its own
      return S::chain_start[K] == K && !S::template is_scan<S::runs_in[K] % steps> && !transposes<O>();
    else if constexpr (sched::row_local_pair<N>())
      return exponents::pair_reads<Op> && S::runs_in[K] == K && !transposes<O>();
    else
      return false;
  }
  // keeps_exponents()[J]: may step J's result keep its exponents (every
  // reader reads them; not an output)? Else they are multiplied out after it.
  template <std::size_t K, class... O>
  static constexpr void note_readers(std::array<bool, steps + 1>& ok, lina::detail::type_list<O...>) {
    ((sched::reads<O>::step != sched::none && !reads_exponents<K, O>() ? void(ok[sched::reads<O>::step] = false) : void()),
     ...);
  }
  template <class... O>
  static constexpr void note_outputs(std::array<bool, steps + 1>& ok, lina::detail::type_list<O...>) {
    ((sched::reads<O>::step != sched::none ? void(ok[sched::reads<O>::step] = false) : void()), ...);
  }
  template <std::size_t... K>
  static constexpr void note_all(std::array<bool, steps + 1>& ok, std::index_sequence<K...>) {
    (note_readers<K>(ok, typename S::template operands<K>{}), ...);
  }
  static constexpr std::array<bool, steps + 1> keeps_exponents() {
    std::array<bool, steps + 1> ok{};
    ok.fill(true);
    note_all(ok, std::make_index_sequence<steps>{});
    note_outputs(ok, typename S::outputs{});
    for (std::size_t j = steps; j-- > 0;)
      if (S::twin[j] != sched::none && S::row_absorbed[j] == sched::none) ok[S::twin[j]] = ok[S::twin[j]] && ok[j];
    return ok;
  }
  // A scan's finished rows as one operand of the row-local pair K (the
  // other, `side`, read row by row), into `out`.
  template <std::size_t K, std::size_t Scan>
  struct pair_sink {
    using ops = typename S::template operands<K>;
    static constexpr bool scan_first = std::is_same_v<lina::detail::type_at_t<0, ops>, sched::step_operand<Scan>>;
    using side = lina::detail::type_at_t<scan_first ? 1 : 0, ops>;
    program const& p;
    matrix<T>& out;
    index cols;  // the scan's row width
    matrix<T> side_rows;
    T* in_place() const { return nullptr; }
    index stride() const { return 0; }
    std::size_t work() const { return static_cast<std::size_t>(side_rows.cols); }
    void take(index first_row, index n, bool reverse, T const* rows, index ld, T* work) const {
      auto const& o = S::template node_at<K>(p.plan_).op;
      using Op = typename S::template node_type<K>::op_type;
      for (index t = 0; t < n; ++t) {
        index i = reverse ? first_row - t : first_row + t;
        T const* other = source_row(side_rows, i, work);
        if constexpr (scan_first)
          row<Op>::run(o, i, rows + t * ld, other, cols, side_rows.cols, out.row_mut(i));
        else
          row<Op>::run(o, i, other, rows + t * ld, side_rows.cols, cols, out.row_mut(i));
      }
    }
  };

  // A scan's operand O: a group it loads, or a matrix.
  template <class M>
  struct matrix_source {
    M m;
    index cols() const { return m.cols; }
    kernels::matrix_rows<T> rows() const { return {m}; }
    matrix<T> whole(index, lease&, program const&, turn&) const { return alias(m); }
  };
  template <class G>
  struct made_source {
    G g;
    index cols() const { return g.cols(); }
    G const& rows() const { return g; }
    matrix<T> whole(index n, lease& mem, program const& p, turn& w) const {  // every row, into memory of its own
      mem = lease(p.ws_, w.arena, static_cast<std::size_t>(n * g.cols()));
      lease work(p.ws_, w.arena, g.work());
      g.pack(0, n, false, mem.p, g.cols(), work.p);
      return view<T>(mem.p, n, g.cols(), g.cols(), 1);
    }
  };
  template <std::size_t J, class O>
  auto source(std::array<matrix<T>, steps + 1> const& slot, turn& w) const {
    if constexpr (requires { O::step; }) {
      if constexpr (S::absorbed_by[O::step] == J) {
        constexpr std::size_t G = O::step, first = S::chain_start[G];
        matrix<T> src = operand<lina::detail::type_at_t<0, typename S::template operands<first>>>(slot, w);
        index width = static_cast<index>(S::template node_type<G>::shape::cols::extent(in_.table));
        index widest = group_width(first, G, src.cols);
        return made_source<group_source<G>>{group_source<G>{*this, std::move(src), width, widest, w.h}};
      } else {
        return matrix_source<matrix<T>>{operand<O>(slot, w)};
      }
    } else {
      return matrix_source<matrix<T>>{operand<O>(slot, w)};
    }
  }


  // Release every result whose last reader was step j (its memory back to the arena).
  // (A function of j at run time, as destination and group_width: one per
  // program rather than one per step, for the compiler.)
  void release(std::size_t j, std::array<matrix<T>, steps + 1>& slot, turn& w) const {
    auto one = [&](std::size_t i) {
      if (w.pooled[i]) ws_.give(w.arena, slot[i].data);
      if (w.exps[i]) ws_.give(w.arena, w.exps[i]);
      w.pooled[i] = false;
      w.exps[i] = nullptr;
      slot[i] = matrix<T>{};
    };
    for (std::size_t i = 0; i <= j; ++i)  // (a loop, not a fold: steps² expressions for a deep stack's gradient)
      if (S::last_use[i] == j) one(i);
  }

  Plan const& plan_;
  Bound const& in_;
  std::array<tensor_view<T>, Outputs> outs_;
  state<T>* st_;
  workspace<T>& ws_;
  bool per_thread_;
  bool simple_;  // cpu::path::simple, the oracle
  std::array<bool, steps + 1> share_{};
  std::array<std::array<index, 2>, steps> extent_{};  // each step's rows and columns (step_extent)
};

// The position of the input named Name in a list of inputs (bind's rule for bindings).
template <fixed_string Name, class... I>
constexpr std::size_t index_named(lina::detail::type_list<I...>) {
  return lina::detail::binding_position<Name, I...>();
}
// Dimension X's extent in a block of `rows` query rows reading `keys` keys
// of the sequence dimension Nd (others: the whole plan's).
template <class X, class Nd, class Table>
std::size_t block_extent(Table const& t, std::size_t rows, std::size_t keys) {
  if constexpr (std::is_same_v<X, row_blocks::query_rows<Nd>>)
    return rows;
  else if constexpr (std::is_same_v<X, row_blocks::key_rows<Nd>>)
    return keys;
  else
    return t.template get<X>();
}

// Run a select-free plan over every (batch, head) slice.
template <class T, class Plan, class Bound, std::size_t Outputs>
void run_slices(Plan const& plan, Bound const& in, std::array<tensor_view<T>, Outputs> outs, state<T>* st = nullptr,
                workspace<T>* ws = nullptr) {
  check_head_decays(plan, in.heads);
  // An output in memory an input may share (evaluate_into(plan, q.view(),
  // Q = q, …), a gradient into its own input) is made in a fresh tensor and
  // copied in at the end: a scan zeroes and writes its first output rows
  // before it has read its inputs' later rows.
  // An output that reaches one element twice (a zero or an overlapping
  // stride) would have two results written there, by two threads.
  for (auto const& o : outs)
    if (lina::detail::overlaps_itself(o))
      throw alias_error("an output view " + lina::detail::layout_text(o) +
                        " reaches some of its elements twice: give each element memory of its own");
  std::array<tensor<T>, Outputs> spare;
  auto const callers = outs;
  for (std::size_t k = 0; k < Outputs; ++k) {
    auto shared = [&](auto const& v) { return lina::detail::may_share_memory(outs[k], v); };
    if (std::any_of(in.views.begin(), in.views.end(), shared)) {
      spare[k] = tensor<T>(outs[k].shape(), uninitialized);
      outs[k] = spare[k].view();
    }
  }
  std::optional<cached_workspace<T>> per_call;  // from the pool only when the caller brings none (a step does)
  bool per_thread = ws == nullptr;
  if (per_thread) {
    ws = &per_call.emplace().per_thread();
  } else {
    ws->begin(in.batch * in.heads);
  }
  program<T, Plan, Bound, Outputs> prog(plan, in, outs, st, *ws, per_thread);
  if (st && prog.scanned_rows() == 1) st->make_pending(kernels::two_level_rows<T>);  // (steps past it: once)
  long total = static_cast<long>(in.batch * in.heads);
  [[maybe_unused]] bool const threads = worth_threads(in, st);  // (read by the pragmas alone)
  auto run = [&](long bh) { prog.run(static_cast<std::size_t>(bh) / in.heads, static_cast<std::size_t>(bh) % in.heads); };
  if (st) {
    // with a state, every call gives each thread the same slices, so a
    // slice's running sums stay in the cache of the core that updates them
#pragma omp parallel for schedule(static) if (threads)
    for (long bh = 0; bh < total; ++bh) run(bh);
    st->add_rows(prog.scanned_rows());
  } else {
#pragma omp parallel for schedule(dynamic, 1) if (threads)
    for (long bh = 0; bh < total; ++bh) run(bh);
  }
  for (std::size_t k = 0; k < Outputs; ++k)
    if (spare[k].size()) copy_elements<T>(spare[k].view(), callers[k]);
}

// The bindings of a block of `rows` query rows from r0 reading `keys` keys
// (all of them, or with a mask those up to its last row): the inputs read
// as queries cut to its rows, those read as keys to its keys, the others
// whole (BlockBound: the block plan's bound inputs; Nd: the sequence).
template <class BlockBound, class Nd, class Bound>
BlockBound block_bindings(Bound const& in, std::size_t r0, std::size_t rows, std::size_t keys) {
  BlockBound b;
  b.batch = in.batch;
  b.heads = in.heads;
  [&]<class... I>(lina::detail::type_list<I...>) {
    std::size_t k = 0;
    ((b.views[k++] = [&] {
       auto const& v = in.views[index_named<I::name>(typename Bound::inputs{})];
       if constexpr (std::is_same_v<typename I::rows, row_blocks::query_rows<Nd>>)
         return v.rows(r0, rows);
       else if constexpr (std::is_same_v<typename I::rows, row_blocks::key_rows<Nd>>)
         return v.rows(0, keys);
       else
         return v;
     }()),
     ...);
  }(typename BlockBound::inputs{});
  [&]<class... X>(lina::detail::type_list<X...>) {
    ((b.table.value[BlockBound::table_type::template index_of<X>()] = block_extent<X, Nd>(in.table, rows, keys)), ...);
  }(typename BlockBound::table_type::dims{});
  return b;
}

// A quadratic plan in blocks of query rows (row_blocks.hpp): every (block,
// slice) pair runs the block plan, in parallel (the last rows first: with a
// mask they read the most keys, so what a thread's first pair takes from its
// arena fits every later one; and the larger pairs start first). False where
// it runs whole instead: the simple path (the oracle), a sequence of one
// block, an output in memory an input may share (a block would overwrite rows
// a later block reads), or one that reaches an element twice (run_slices
// says so).
template <class T, class P, class Bound>
bool run_row_blocks(P const& plan, Bound const& in, tensor_view<T> out) {
  using Nd = typename P::shape::rows;
  using blocks_of = decltype(row_blocks::block_plan(plan));
  using block_bound = bound_inputs<inputs_of<blocks_of>, dims_of<blocks_of>, typename Bound::view_type>;
  std::size_t const n = in.table.template get<Nd>(), r = row_blocks::rows_per_block(n);
  if (current_path() == path::simple || n <= r || lina::detail::overlaps_itself(out)) return false;
  for (auto const& v : in.views)
    if (lina::detail::may_share_memory(out, v)) return false;
  check_head_decays(plan, in.heads);  // (before the threads: it throws)
  auto const blocked = row_blocks::block_plan(plan);
  constexpr bool cut_keys = row_blocks::verdict_of<P>().masks;
  cached_workspace<T> per_call;
  workspace<T>& ws = per_call.per_thread();
  [[maybe_unused]] bool const threads = outside_parallel();  // (read by the pragma alone)
  long const slices = static_cast<long>(in.batch * in.heads), blocks = static_cast<long>((n + r - 1) / r);
#pragma omp parallel for schedule(dynamic, 1) if (threads)
  for (long t = 0; t < blocks * slices; ++t) {
    std::size_t const r0 = static_cast<std::size_t>(blocks - 1 - t / slices) * r, rows = std::min(r, n - r0);
    auto const bh = static_cast<std::size_t>(t % slices);
    auto const b = block_bindings<block_bound, Nd>(in, r0, rows, cut_keys ? r0 + rows : n);
    program<T, blocks_of, block_bound, 1> prog(blocked, b, std::array{out.rows(r0, rows)}, nullptr, ws, true);
    prog.run(bh / in.heads, bh % in.heads);
  }
  return true;
}

template <class T, class Plan, class Bound>
void evaluate_slices(Plan const& plan, Bound const& in, tensor_view<T> out) {
  with_resolved_plan(plan, in.table, [&](auto const& p) {
    if constexpr (row_blocks::eligible<std::remove_cvref_t<decltype(p)>>())
      if (run_row_blocks<T>(p, in, out)) return;
    run_slices<T>(p, in, std::array{out});
  });
}
}  // namespace detail

// evaluate(plan, Q = q, K = k, V = v) -> [B, H, rows, cols] (an expression
// evaluates as written, which makes it the oracle of its compiled plans).
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  using T = typename decltype(in)::value_type;
  tensor<T> out(result_shape<Plan>(in), uninitialized);
  detail::evaluate_slices<T>(plan, in, out.view());
  return out;
}

// Like evaluate, into caller memory of any layout (e.g. a [B,N,H,M] view).
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  check_result_shape<Plan>(out.shape(), in);
  detail::evaluate_slices<T>(plan, in, out);
}

}  // namespace lina::cpu
