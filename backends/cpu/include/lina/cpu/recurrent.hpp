// Transformers are RNNs: the same causal expression, evaluated with state.
//
//   cpu::state<float> st;                              // empty: starts from zero sums
//   auto a = cpu::evaluate(plan, st, Q = q1, K = k1, V = v1);   // tokens [0, n1)
//   auto b = cpu::evaluate(plan, st, Q = q2, K = k2, V = v2);   // tokens [n1, N): continues
//
//   auto rnn = cpu::recurrent<float>(plan, B, H);     // or from a prefilled state
//   tensor<float> y = rnn.step(Q = q_t, K = k_t, V = v_t);      // one token: [B, H, 1, M]
//
// Both run the plan's linear form (every select at its long-sequence branch),
// whose prefix scans start from the state's running sums and leave them
// updated: s_i = s_{i-1} + φ(k_i) v_iᵀ, z_i = z_{i-1} + φ(k_i). A step costs
// O(C M) time and memory, whatever the position.
#pragma once

#include <cstddef>
#include <string>
#include <typeinfo>
#include <utility>

#include "lina/cpu/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/state.hpp"
#include "lina/format.hpp"
#include "lina/node.hpp"

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

namespace cpu {

namespace detail {
// The dimension a plan's first prefix scan runs over (the sequence length).
template <class L>
using scanned_dim = typename lina::detail::front_t<prefix_scans_of<L>>::shape::rows;

template <class L>
constexpr bool check_stateful() {
  constexpr bool scans = prefix_scans_of<L>::size > 0;
  constexpr bool square = [] {
    if constexpr (scans)
      return has_square<L, scanned_dim<L>>();
    else
      return false;
  }();
  return diagnose::stateful_plan<scans, contains_op<L, op::exp>(), square>::ok;
}

// Give an empty state its shape, or check that a state fits this evaluation.
template <class L, class T, class Bound>
void prepare_state(L const& plan, state<T>& st, Bound const& in) {
  using scans = prefix_scans_of<L>;
  if (st.unbound()) st = state<T>(typeid(L), to_string(plan), in.batch, in.heads, scans::size);
  if (!st.belongs_to(typeid(L)))
    throw state_error("this state belongs to the plan " + st.plan() + ", not to " + to_string(plan));
  std::string first(lina::detail::front_t<typename Bound::inputs>::name.view());
  if (in.batch != st.batch()) throw shape_error(first, "B (batch)", in.batch, st.batch(), "of the state");
  if (in.heads != st.heads()) throw shape_error(first, "H (heads)", in.heads, st.heads(), "of the state");

  // The scanned (sequence) dimension may change between evaluations; no other may.
  using seq = scanned_dim<L>;
  constexpr std::size_t seq_index = Bound::table_type::template index_of<seq>();
  auto& recorded = st.extents();
  if (!st.sized()) {
    recorded.assign(in.table.value.begin(), in.table.value.end());
    std::size_t k = 0;
    [&]<class... S>(lina::detail::type_list<S...>) {
      ((st.scan_data()[k].a = static_cast<std::size_t>(S::shape::a::extent(in.table)),
        st.scan_data()[k].b = static_cast<std::size_t>(S::shape::b::extent(in.table)),
        st.scan_data()[k].data.assign(in.batch * in.heads * st.scan_data()[k].a * st.scan_data()[k].b, T(0)), ++k),
       ...);
    }(scans{});
    return;
  }
  [&]<class... D>(lina::detail::type_list<D...>) {
    std::size_t i = 0;
    ((i != seq_index && in.table.value[i] != recorded[i]
          ? throw shape_error(in.table.bound_by[i].empty() ? first : in.table.bound_by[i], D::label(),
                              in.table.value[i], recorded[i], "of the state (fixed by its first evaluation)")
          : void(), ++i),
     ...);
  }(dims_of<L>{});
}
// The stateful evaluation of the linear form L, its inputs already bound.
template <class L, class T, class Bound>
tensor<T> evaluate_bound(L const& linear, state<T>& st, Bound const& in) {
  static_assert(std::is_same_v<typename Bound::value_type, T>,
                "lina: the state's element type must be that of the bound tensors");
  prepare_state(linear, st, in);
  tensor<T> out(result_shape<L>(in));
  evaluate_slices<T>(linear, in, out.view(), &st);
  return out;
}
}  // namespace detail

// evaluate(plan, st, bindings...): the causal plan over a block of tokens,
// starting from the running sums in `st` and leaving them updated, so that
// consecutive blocks give the same result as one evaluation of all of them.
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<T> evaluate(Plan const& plan, state<T>& st, B const&... bindings) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  static_assert(detail::check_stateful<L>() || true);
  return detail::evaluate_bound(linear, st, bind<L>(bindings...));
}

// A causal plan run token by token, holding its state.
template <class T, class L>
class rnn {
 public:
  rnn(L plan, std::size_t batch, std::size_t heads)
      : plan_(plan), state_(typeid(L), to_string(plan), batch, heads, prefix_scans_of<L>::size) {}

  // One token: every input [B, H, 1, *]; returns [B, H, 1, cols].
  template <class... B>
    requires(is_binding<B> && ...)
  tensor<T> step(B const&... bindings) {
    using seq = detail::scanned_dim<L>;
    auto in = bind<L>(bindings...);
    constexpr std::size_t k = decltype(in)::table_type::template index_of<seq>();
    if (in.table.value[k] != 1)
      throw shape_error(in.table.bound_by[k], seq::label(), in.table.value[k], 1, "(a step takes one token)");
    return detail::evaluate_bound(plan_, state_, in);
  }

  void reset() { state_.reset(); }
  cpu::state<T> const& state() const noexcept { return state_; }
  cpu::state<T>& state() noexcept { return state_; }
  // Restore a saved state; it must come from this plan and shape.
  void set_state(cpu::state<T> s) {
    if (!s.same_plan(state_))
      throw state_error("this state belongs to the plan " + s.plan() + ", not to " + state_.plan());
    if (s.batch() != state_.batch() || s.heads() != state_.heads())
      throw state_error("this state is for " + std::to_string(s.batch()) + " x " + std::to_string(s.heads()) +
                        " (batch x heads), not " + std::to_string(state_.batch()) + " x " +
                        std::to_string(state_.heads()));
    state_ = std::move(s);
  }
  L const& plan() const noexcept { return plan_; }

 private:
  L plan_;
  cpu::state<T> state_;
};

// recurrent<T>(plan, B, H): the plan's linear form as an RNN over B x H
// sequences, starting from zero sums.
template <class T = float, class Plan>
  requires is_node<Plan>
auto recurrent(Plan const& plan, std::size_t batch, std::size_t heads) {
  auto linear = longest_branch(plan);
  static_assert(detail::check_stateful<decltype(linear)>() || true);
  return rnn<T, decltype(linear)>(linear, batch, heads);
}

}  // namespace cpu
}  // namespace lina
