// Packed sequences of different lengths on the CPU (lina/sequences.hpp):
//
//   auto seqs = sequences::from_lengths({700, 12, 3000});     // or from_offsets (cu_seqlens)
//   auto y = cpu::evaluate(plan, seqs, Q = q, K = k, V = v);  // q: [1, H, 3712, D] -> y: [1, H, 3712, M]
//   cpu::state<float> st;                                     // one state row per sequence
//   auto y2 = cpu::evaluate(plan, st, seqs, Q = q, K = k, V = v);
//   auto g = cpu::gradient(plan, dout, seqs, Q = q, K = k, V = v);
//
// Each sequence runs the plan alone (its own length resolves the plan's
// selects), so the result is bit for bit that of evaluating it in a batch of
// one. Many sequences share the threads one sequence each, longest first; a
// few run one after another, each on every thread.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <numeric>
#include <type_traits>
#include <vector>

#include "lina/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/gradient.hpp"
#include "lina/cpu/recurrent.hpp"
#include "lina/cpu/state.hpp"
#include "lina/sequences.hpp"
#include "lina/state.hpp"

namespace lina::cpu {

namespace detail {
// f(s) for every sequence s: spread over the threads, whole sequences,
// longest first, when there are at least two per thread, enough work to pay
// for starting threads, and no sequence longer than a thread's share of the
// rows (else that one sequence would keep one thread busy while the others
// wait: 4 sequences of 1k-16k tokens ran 10 % slower than one after another);
// else in order, each call free to use the threads itself (over heads).
template <class Bound, class F>
void for_each_sequence(sequences const& seqs, Bound const& in, F const& f) {
  long const n = static_cast<long>(seqs.count());
#ifdef _OPENMP
  long const threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  std::size_t longest = 0;
  for (long s = 0; s < n; ++s) longest = std::max(longest, seqs.length(static_cast<std::size_t>(s)));
  if (threads > 1 && n >= 2 * threads && longest * static_cast<std::size_t>(threads) <= seqs.total() &&
      worth_threads(in, static_cast<state<typename Bound::value_type> const*>(nullptr))) {
    std::vector<std::size_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return seqs.length(a) > seqs.length(b); });
#pragma omp parallel for schedule(dynamic, 1)
    for (long i = 0; i < n; ++i) f(order[static_cast<std::size_t>(i)]);
    return;
  }
#else
  (void)in;
#endif
  for (long s = 0; s < n; ++s) f(static_cast<std::size_t>(s));
}
// Row s of a state of one row per sequence, as a state of one (`one`: sequence
// s's bindings of plan L), and back.
template <class T, class L, class Bound>
state<T> state_row(state<T> const& all, std::size_t s, L const& plan, Bound const& one) {
  state<T> mine;
  mine.prepare(plan, one);
  for (std::size_t k = 0; k < all.scans(); ++k) mine.copy_entry(k, 0, all, k, s);
  return mine;
}
template <class T>
void set_state_row(state<T>& all, std::size_t s, state<T> const& one) {
  for (std::size_t k = 0; k < all.scans(); ++k) all.copy_entry(k, s, one, k, 0);
}
}  // namespace detail

// evaluate_into(plan, out, seqs, bindings...): packed sequences into caller
// memory of any layout ([1, H, ΣN, M] or a [1, ΣN, H, M] view).
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, sequences const& seqs, B const&... bindings) {
  using N = packed_dim<Plan>;
  auto in = bind<Plan>(bindings...);
  check_packed<N>(in, seqs);
  check_result_shape<Plan>(out.shape(), in);
  detail::for_each_sequence(seqs, in, [&](std::size_t s) {
    evaluate_into(plan, out.rows(seqs.begin(s), seqs.length(s)),
                  sequence_binding<N, inputs_of<Plan>>(bindings, seqs, s)...);
  });
}

// evaluate(plan, seqs, bindings...) -> [1, H, ΣN, M]
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, sequences const& seqs, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  using T = typename decltype(in)::value_type;
  tensor<T> out(result_shape<Plan>(in), uninitialized);
  evaluate_into(plan, out.view(), seqs, bindings...);
  return out;
}

// evaluate_into(plan, out, st, seqs, bindings...): the causal plan over a
// block of tokens of every sequence, each starting from its running sums in
// `st` (one row per sequence: st[k] is [S, H, a, b]) and leaving them
// updated — chunked prefill of S sequences at once.
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, state<T>& st, sequences const& seqs, B const&... bindings) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  static_assert(check_stateful<L>() || true);
  using N = packed_dim<L>;
  auto in = bind<L>(bindings...);
  static_assert(std::is_same_v<typename decltype(in)::value_type, T>,
                "lina: the state's element type must be that of the bound tensors");
  check_packed<N>(in, seqs);
  check_result_shape<L>(out.shape(), in);
  st.prepare(linear, in, seqs.count(), "sequences (of packed sequences)");
  detail::for_each_sequence(seqs, in, [&](std::size_t s) {
    auto one = bind<L>(sequence_binding<N, inputs_of<L>>(bindings, seqs, s)...);
    state<T> mine = detail::state_row(st, s, linear, one);  // sequence s's rows of st, as a batch of one
    detail::evaluate_bound(linear, mine, one, out.rows(seqs.begin(s), seqs.length(s)));
    detail::set_state_row(st, s, mine);
  });
}

template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<T> evaluate(Plan const& plan, state<T>& st, sequences const& seqs, B const&... bindings) {
  auto linear = longest_branch(plan);
  auto in = bind<decltype(linear)>(bindings...);
  tensor<T> out(result_shape<decltype(linear)>(in), uninitialized);
  evaluate_into(plan, out.view(), st, seqs, bindings...);
  return out;
}

namespace detail {
// The backward of packed sequences into the caller's views `into`: the
// gradient of an input cut into sequences is cut the same way; one every
// sequence reads whole (a projection W) is the sum of the sequences' shares,
// added in sequence order (the same result whatever the threads).
// one(s, views, dout rows, sequence bindings...) differentiates sequence s.
template <class P, class T, class... In, class D, class One, class... B>
void packed_backward(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, sequences const& seqs,
                     One const& one, B const&... bindings) {
  using BP = std::remove_cvref_t<decltype(backward_of(plan))>;
  using Forward = typename BP::forward_type;
  using N = packed_dim<Forward>;
  auto in = bind_backward(backward_of(plan), dout, bindings...);
  check_packed<N>(in, seqs);
  (void)checked_gradient_views<BP>(in, into);
  constexpr std::size_t count = sizeof...(In);
  constexpr std::array<bool, count> cut{cut_input<N, In>...};
  bool const shared = std::find(cut.begin(), cut.end(), false) != cut.end();
  std::vector<std::array<tensor<T>, count>> shares(shared ? seqs.count() : 0);
  for_each_sequence(seqs, in, [&](std::size_t s) {
    auto mine = into;
    for (std::size_t i = 0; i < count; ++i) {
      if (cut[i]) {
        mine.all()[i] = into.all()[i].rows(seqs.begin(s), seqs.length(s));
      } else {
        shares[s][i] = tensor<T>(into.all()[i].shape(), uninitialized);
        mine.all()[i] = shares[s][i].view();
      }
    }
    one(s, mine, view_of(dout).rows(seqs.begin(s), seqs.length(s)),
        sequence_binding<N, inputs_of<Forward>>(bindings, seqs, s)...);
  });
  for (std::size_t i = 0; i < count; ++i) {
    if (cut[i]) continue;
    auto const& out = into.all()[i];
    for_each_index(out.shape(), [&](auto... x) {
      T sum = 0;
      for (auto const& share : shares) sum += share[i](x...);
      out(x...) = sum;
    });
  }
}
}  // namespace detail

// gradient_into(plan, into, dout, seqs, bindings...): the same into caller views.
template <class P, class T, class... In, class D, class... B>
  requires(is_binding<B> && ...)
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, sequences const& seqs,
                   B const&... bindings) {
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>,
                               gradients_of<tensor_view<T>, std::remove_cvref_t<decltype(backward_of(plan))>>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  detail::packed_backward(
      plan, into, dout, seqs,
      [&](std::size_t, auto& mine, auto const& d, auto const&... b) { gradient_into(plan, mine, d, b...); }, bindings...);
}

// gradient(plan, dout, seqs, bindings...): the backward of packed sequences
// (dout [1, H, ΣN, M]); gradients in the layout of their inputs.
template <class P, class D, class... B>
  requires(is_binding<B> && ...)
auto gradient(P const& plan, D const& dout, sequences const& seqs, B const&... bindings) {
  auto [g, into] = detail::new_gradients_into(plan, dout, bindings...);
  gradient_into(plan, into, dout, seqs, bindings...);
  return std::move(g);
}

// Packed sequences chained: gradient_into(plan, into, dout, initial, d_final,
// seqs, bindings...) -> ∂initial, states of one row per sequence (as
// evaluate(plan, st, seqs, …) leaves them; unsized: zeros), each sequence's
// block differentiated from its rows as it would be alone; gradient(plan,
// dout, initial, d_final, seqs, …) -> {gradients, ∂initial} into new tensors.
template <class P, class T, class... In, class D, class... B>
  requires(is_binding<B> && ...)
state<T> gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, state<T> const& initial,
                       state<T> const& d_final, sequences const& seqs, B const&... bindings) {
  auto const linear = longest_branch(plan);
  using L = std::remove_cvref_t<decltype(linear)>;
  using N = packed_dim<L>;
  auto in = bind<L>(bindings...);
  check_packed<N>(in, seqs);
  state<T> s0 = initial, ds1 = d_final, ds0(linear, seqs.count(), in.heads);
  for (state<T>* x : {&s0, &ds1, &ds0}) x->prepare(linear, in, seqs.count(), "sequences (of packed sequences)");
  detail::packed_backward(
      linear, into, dout, seqs,
      [&](std::size_t s, auto& mine, auto const& d, auto const&... b) {
        auto one = bind<L>(b...);
        state<T> const r = gradient_into(linear, mine, d, detail::state_row(s0, s, linear, one),
                                         detail::state_row(ds1, s, linear, one), b...);
        detail::set_state_row(ds0, s, r);
      },
      bindings...);
  return ds0;
}
template <class P, class D, class T, class... B>
  requires(is_binding<B> && ...)
auto gradient(P const& plan, D const& dout, state<T> const& initial, state<T> const& d_final, sequences const& seqs,
              B const&... bindings) {
  auto [g, into] = detail::new_gradients_into(longest_branch(plan), dout, bindings...);
  state<T> d_initial = gradient_into(plan, into, dout, initial, d_final, seqs, bindings...);
  return std::pair{std::move(g), std::move(d_initial)};
}

}  // namespace lina::cpu
