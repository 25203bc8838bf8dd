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
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "lina/bind.hpp"
#include "lina/cpu/kernels.hpp"
#include "lina/cpu/matrix.hpp"
#include "lina/cpu/state.hpp"
#include "lina/node.hpp"
#include "lina/schedule.hpp"
#include "lina/tensor.hpp"

namespace lina::cpu {

template <class T>
matrix<T> alias(matrix<T> const& m) {  // a view of m's elements, not owning them
  return view(m.data, m.rows, m.cols, m.rs, m.cs);
}

// lower<Op>::run(n, out, operands...): node n's result into `out`, sized by
// the caller (rows contiguous), from its kids' values.
template <class Op>
struct lower {
  static_assert(lina::detail::always_false<Op>,
                "lina::cpu cannot lower this node (its op is in the instantiation of lower<> above)");
};

// Parametric maps read their projection W too (not row-wise: W is a whole matrix).
template <class Map>
struct lower<op::phi<Map>> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w) {
    kernels::feature_map<Map>(x, w, out);
  }
};
template <>
struct lower<op::product> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& a, matrix<T> b) {
    kernels::gemm(a, std::move(b), out);
  }
};

// row<Op>::run(n, i, in, in_cols, out): row i of a row-wise op (sched::row_wise)
// from row i of its operand. A fused group of row-wise steps runs these one
// after another on each row, so its intermediate rows are never stored.
template <class Op>
struct row;
template <class Map>
struct row<op::phi<Map>> {
  template <class N, class T>
  static void run(N const&, index, T const* in, index cols, T* out) {
    if constexpr (concepts::elementwise_map<Map>) {
#pragma omp simd
      for (index j = 0; j < cols; ++j) out[j] = Map::value(in[j]);
    } else {
      Map::apply(in, static_cast<std::size_t>(cols), out);
    }
  }
};
template <>
struct row<op::scale> {
  template <class N, class T>
  static void run(N const& n, index, T const* in, index cols, T* out) {
    T s = static_cast<T>(n.op.factor);
    for (index j = 0; j < cols; ++j) out[j] = s * in[j];
  }
};
template <>
struct row<op::exp> {
  template <class N, class T>
  static void run(N const&, index, T const* in, index cols, T* out) {
    for (index j = 0; j < cols; ++j) out[j] = std::exp(in[j]);
  }
};
template <>
struct row<op::causal> {  // keep j <= i
  template <class N, class T>
  static void run(N const&, index i, T const* in, index cols, T* out) {
    for (index j = 0; j < cols; ++j) out[j] = j <= i ? in[j] : T(0);
  }
};
template <>
struct row<op::normalize> {  // S_ij / (sum_k S_ik + eps)
  template <class N, class T>
  static void run(N const& n, index, T const* in, index cols, T* out) {
    T sum = 0;
    for (index j = 0; j < cols; ++j) sum += in[j];
    T den = sum + static_cast<T>(n.op.eps);
    for (index j = 0; j < cols; ++j) out[j] = in[j] / den;
  }
};
template <>
struct row<op::append_ones> {  // [x | 1]
  template <class N, class T>
  static void run(N const&, index, T const* in, index cols, T* out) {
    for (index j = 0; j < cols; ++j) out[j] = in[j];
    out[cols] = T(1);
  }
};
template <>
struct row<op::row_divide> {  // x[:-1] / (x[-1] + eps)
  template <class N, class T>
  static void run(N const& n, index, T const* in, index cols, T* out) {
    T den = in[cols - 1] + static_cast<T>(n.op.eps);
    for (index j = 0; j + 1 < cols; ++j) out[j] = in[j] / den;
  }
};

// contract(A, prefix(B⊗C)) or its suffix form, one fused scan: out_i = A_iᵀ S_i,
// S_i the running sum of B_j C_jᵀ, starting from and leaving `sums` (a x b).
template <>
struct lower<op::contract_rows> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& a, matrix<T> const& b, matrix<T> const& c, T* sums,
                  T* scratch) {
    kernels::scan_contract(a, b, c, out, sums, fused_scan_parts<N>::reverse, scratch);
  }
};

// Memory a program reuses from call to call (a recurrent step's, so that a
// step allocates nothing): per slice, the buffers of one run, handed out
// again in the same order the next time (a plan's runs ask in the same order).
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

  void begin(std::size_t slices) {
    if (arenas_.size() < slices) arenas_.resize(slices);
    for (auto& a : arenas_) a.next = 0;
  }
  T* take(std::size_t slice, std::size_t n) {
    auto& a = arenas_[slice];
    if (a.next == a.bufs.size())
      a.bufs.emplace_back(n);
    else if (a.bufs[a.next].size() < n)
      a.bufs[a.next] = buffer<T>(n);
    return a.bufs[a.next++].get();
  }

 private:
  struct arena {
    std::vector<buffer<T>> bufs;
    std::size_t next = 0;
  };
  std::vector<arena> arenas_;
};

// ---- backward ops ----
template <class Map>
struct lower<op::phi_vjp<Map>> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& g) {
    kernels::feature_map_vjp<Map>(x, g, out);
  }
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w, matrix<T> const& g) {
    kernels::feature_map_vjp<Map, false>(x, w, g, out);
  }
};
template <class Map>
struct lower<op::phi_param_vjp<Map>> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& x, matrix<T> const& w, matrix<T> const& g) {
    kernels::feature_map_vjp<Map, true>(x, w, g, out);
  }
};
template <>
struct lower<op::normalize_vjp> {
  template <class N, class T>
  static void run(N const& n, matrix<T>& out, matrix<T> const& s, matrix<T> const& g) {
    kernels::normalize_vjp(s, g, out, static_cast<T>(n.op.eps));
  }
};
template <>
struct lower<op::row_divide_vjp> {
  template <class N, class T>
  static void run(N const& n, matrix<T>& out, matrix<T> const& y, matrix<T> const& g) {
    kernels::row_divide_vjp(y, g, out, static_cast<T>(n.op.eps));
  }
};
template <>
struct lower<op::hadamard> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& a, matrix<T> const& b) {
    kernels::zip(a, b, out, [](T x, T y) { return x * y; });
  }
};
template <>
struct lower<op::add> {
  template <class N, class T>
  static void run(N const&, matrix<T>& out, matrix<T> const& a, matrix<T> const& b) {
    kernels::zip(a, b, out, [](T x, T y) { return x + y; });
  }
};

// One long sequence with idle threads (a single slice, or slices run one at a
// time): its scans are split across the threads (kernels::scan_contract_split),
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
// costs more than the work (and oversubscribed machines make it worse).
inline constexpr std::size_t parallel_min_elements = std::size_t(1) << 15;
template <class Bound>
bool worth_threads(Bound const& in) {
  std::size_t elements = 0;
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
// Slice [b, h] of a bound input or an output as a matrix.
template <class V>
auto slice_of(V const& t, std::size_t b, std::size_t h) {
  using T = std::remove_const_t<typename V::element_type_>;
  auto const& s = t.strides();
  T const* base = t.data() + static_cast<index>(b) * s[0] + static_cast<index>(h) * s[1];
  return view<T>(base, static_cast<index>(t.shape()[2]), static_cast<index>(t.shape()[3]), s[2], s[3]);
}

// One select-free plan's schedule, run slice by slice into `outs` (one
// output tensor per schedule output).
template <class T, class Plan, class Bound, std::size_t Outputs>
class program {
  using S = schedule_of<Plan>;
  static constexpr std::size_t steps = S::size;

 public:
  program(Plan const& plan, Bound const& in, std::array<tensor_view<T>, Outputs> outs, state<T>* st,
          workspace<T>* ws)
      : plan_(plan), in_(in), outs_(outs), st_(st), ws_(ws) {
    static_assert(S::outputs::size == Outputs, "lina::cpu: one output tensor per output of the schedule");
    // Same-typed steps with values: shared when their values are equal (once per call).
    [&]<std::size_t... J>(std::index_sequence<J...>) {
      ((share_[J] = [&] {
         if constexpr (S::twin[J] != sched::none)
           return same_value(S::template node_at<S::twin[J]>(plan_), S::template node_at<J>(plan_));
         else
           return false;
       }()),
       ...);
    }(std::make_index_sequence<steps>{});
  }

  void run(std::size_t b, std::size_t h) const {
    std::array<matrix<T>, steps + 1> slot{};
    std::array<bool, Outputs> direct{};
    [&]<std::size_t... J>(std::index_sequence<J...>) { (step<J>(slot, direct, b, h), ...); }(
        std::make_index_sequence<steps>{});
    [&]<class... O>(lina::detail::type_list<O...>) {
      std::size_t k = 0;
      ((direct[k] ? void() : store(operand<O>(slot, b, h), outs_[k], b, h), ++k), ...);
    }(typename S::outputs{});
  }

 private:
  // An operand: a bound input's slice, an earlier result, or a view of either.
  template <class O>
  matrix<T> operand(std::array<matrix<T>, steps + 1> const& slot, std::size_t b, std::size_t h) const {
    if constexpr (requires { typename O::input; }) {
      return slice_of(in_.views[Bound::template input_index<typename O::input>()], b, h);
    } else if constexpr (requires { O::step; }) {
      return alias(slot[O::step]);
    } else if constexpr (std::is_same_v<O, sched::transposed_operand<typename O::of>>) {
      return operand<typename O::of>(slot, b, h).transposed();
    } else {
      matrix<T> m = operand<typename O::of>(slot, b, h);
      m.cols -= 1;
      return m;
    }
  }

  // Output k when it is step J's result and the first output that is, else Outputs.
  template <std::size_t J>
  static constexpr std::size_t output_of() {
    return []<class... O>(lina::detail::type_list<O...>) {
      constexpr std::array<bool, sizeof...(O) + 1> hit{std::is_same_v<O, sched::step_operand<J>>..., true};
      std::size_t k = 0;
      while (!hit[k]) ++k;
      return k;
    }(typename S::outputs{});
  }

  template <std::size_t J>
  void step(std::array<matrix<T>, steps + 1>& slot, std::array<bool, Outputs>& direct, std::size_t b,
            std::size_t h) const {
    using N = typename S::template node_type<J>;
    if constexpr (S::absorbed_by[J] != sched::none) {
      return;  // its rows are made inside its reader's pass (a fused group), which also releases
    } else if constexpr (S::twin[J] != sched::none) {
      if (share_[J]) {
        slot[J] = alias(slot[S::twin[J]]);
        release<J>(slot);
        return;
      }
    }
    N const& n = S::template node_at<J>(plan_);
    index rows = static_cast<index>(N::shape::rows::extent(in_.table));
    index cols = static_cast<index>(N::shape::cols::extent(in_.table));
    constexpr std::size_t k = output_of<J>();
    if constexpr (k < Outputs) {  // straight into the caller's output, when its rows are contiguous
      matrix<T> out = slice_of(outs_[k], b, h);
      if (out.cs == 1 || cols <= 1) {
        out.cs = 1;
        slot[J] = std::move(out);
        direct[k] = true;
      }
    }
    if (!direct_of<J, k>(direct)) slot[J] = fresh(rows, cols, b, h);
    [&]<class... O>(lina::detail::type_list<O...>) {
      if constexpr (S::template is_scan<J>) {
        matrix<T> bm = operand<lina::detail::type_at_t<1, typename S::template operands<J>>>(slot, b, h);
        matrix<T> cm = operand<lina::detail::type_at_t<2, typename S::template operands<J>>>(slot, b, h);
        scratch_buffer sums_buffer, scratch_space;
        T* sums;
        if (S::scan_index[J] != sched::none && st_) {
          sums = st_->at(S::scan_index[J], b, h);  // carried across evaluations
        } else {
          sums = scratch(sums_buffer, static_cast<std::size_t>(bm.cols * cm.cols), b, h);
          std::fill_n(sums, bm.cols * cm.cols, T(0));
        }
        matrix<T> am = operand<lina::detail::type_at_t<0, typename S::template operands<J>>>(slot, b, h);
        if (int parts = sequence_parts(bm.rows); parts > 1 && !ws_) {
          kernels::scan_contract_split(am, bm, cm, slot[J], sums, fused_scan_parts<N>::reverse, parts);
        } else {
          T* space = scratch(scratch_space, kernels::scan_scratch_size(bm, cm), b, h);
          lower<typename N::op_type>::run(n, slot[J], am, bm, cm, sums, space);
        }
      } else if constexpr (sched::row_wise<N>()) {
        rows_of_group<J>(slot, b, h);
      } else {
        lower<typename N::op_type>::run(n, slot[J], operand<O>(slot, b, h)...);
      }
    }(typename S::template operands<J>{});
    [&]<std::size_t... I>(std::index_sequence<I...>) { (release<S::chain_start[J] + I>(slot), ...); }(
        std::make_index_sequence<J - S::chain_start[J] + 1>{});
  }

  // A fused group of row-wise steps, chain_start[K] ... K: each row of the
  // group's source passes through every member, between two row buffers, and
  // lands in K's result.
  template <std::size_t K>
  void rows_of_group(std::array<matrix<T>, steps + 1>& slot, std::size_t b, std::size_t h) const {
    constexpr std::size_t first = S::chain_start[K];
    matrix<T> src = operand<lina::detail::type_at_t<0, typename S::template operands<first>>>(slot, b, h);
    index widest = src.cols;
    for_members<first, K>([&]<std::size_t M>() {
      widest = std::max(widest, static_cast<index>(S::template node_type<M>::shape::cols::extent(in_.table)));
    });
    scratch_buffer rowbuf;
    T* in = scratch(rowbuf, static_cast<std::size_t>(2 * widest), b, h);
    T* tmp = in + widest;
    matrix<T>& out = slot[K];
    for (index i = 0; i < src.rows; ++i) {
      for (index j = 0; j < src.cols; ++j) in[j] = src(i, j);
      T const* cur = in;
      index cols = src.cols;
      T* spare[2] = {tmp, in};
      int which = 0;
      for_members<first, K>([&]<std::size_t M>() {
        using MN = typename S::template node_type<M>;
        T* dst = M == K ? out.row_mut(i) : spare[which];
        row<typename MN::op_type>::run(S::template node_at<M>(plan_), i, cur, cols, dst);
        cur = dst;
        cols = static_cast<index>(MN::shape::cols::extent(in_.table));
        which ^= 1;
      });
    }
  }
  // f.template operator()<M>() for the members of the group from First to K, in order.
  template <std::size_t First, std::size_t K, class F>
  static void for_members(F&& f) {
    f.template operator()<First>();
    if constexpr (First != K) for_members<S::absorbed_by[First], K>(f);
  }

  // Memory for a step's result or a kernel's scratch: from the workspace when
  // the program has one (reused next call), else a counted buffer of its own.
  using scratch_buffer = buffer<T>;
  matrix<T> fresh(index rows, index cols, std::size_t b, std::size_t h) const {
    if (!ws_) return allocate<T>(rows, cols);
    return view<T>(ws_->take(b * in_.heads + h, static_cast<std::size_t>(rows * cols)), rows, cols, cols, 1);
  }
  T* scratch(scratch_buffer& own, std::size_t n, std::size_t b, std::size_t h) const {
    if (ws_) return ws_->take(b * in_.heads + h, n);
    own = buffer<T>(n);
    return own.get();
  }

  template <std::size_t J, std::size_t K>
  static bool direct_of(std::array<bool, Outputs> const& direct) {
    if constexpr (K < Outputs)
      return direct[K];
    else
      return false;
  }

  // Release every result whose last reader was step J.
  template <std::size_t J>
  static void release(std::array<matrix<T>, steps + 1>& slot) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((S::last_use[I] == J ? void(slot[I] = matrix<T>{}) : void()), ...);
    }(std::make_index_sequence<J + 1>{});
  }

  Plan const& plan_;
  Bound const& in_;
  std::array<tensor_view<T>, Outputs> outs_;
  state<T>* st_;
  workspace<T>* ws_;
  std::array<bool, steps + 1> share_{};
};

// Run a select-free plan over every (batch, head) slice.
template <class T, class Plan, class Bound, std::size_t Outputs>
void run_slices(Plan const& plan, Bound const& in, std::array<tensor_view<T>, Outputs> outs, state<T>* st = nullptr,
                workspace<T>* ws = nullptr) {
  if (ws) ws->begin(in.batch * in.heads);
  program<T, Plan, Bound, Outputs> prog(plan, in, outs, st, ws);
  long total = static_cast<long>(in.batch * in.heads);
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(in))
  for (long bh = 0; bh < total; ++bh)
    prog.run(static_cast<std::size_t>(bh) / in.heads, static_cast<std::size_t>(bh) % in.heads);
}

template <class T, class Plan, class Bound>
void evaluate_slices(Plan const& plan, Bound const& in, tensor_view<T> out) {
  with_resolved_plan(plan, in.table, [&](auto const& p) { run_slices<T>(p, in, std::array{out}); });
}
}  // namespace detail

// evaluate(plan, Q = q, K = k, V = v) -> [B, H, rows, cols] (an expression
// evaluates as written, which makes it the oracle of its compiled plans).
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  using T = typename decltype(in)::value_type;
  tensor<T> out(result_shape<Plan>(in));
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
