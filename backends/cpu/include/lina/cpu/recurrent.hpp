// Transformers are RNNs: the same causal expression, evaluated with state.
//
//   cpu::state<float> st;                              // empty: starts from zero sums
//   auto a = cpu::evaluate(plan, st, Q = q1, K = k1, V = v1);   // tokens [0, n1)
//   auto b = cpu::evaluate(plan, st, Q = q2, K = k2, V = v2);   // tokens [n1, N): continues
//   cpu::evaluate_into(plan, out_view, st, Q = …);             // the same into caller memory
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
#include <utility>

#include "lina/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/state.hpp"
#include "lina/node.hpp"
#include "lina/state.hpp"

namespace lina::cpu {

namespace detail {
// The stateful evaluation of the linear form L, its inputs already bound.
template <class L, class T, class Bound>
void evaluate_bound(L const& linear, state<T>& st, Bound const& in, tensor_view<T> out, workspace<T>* ws = nullptr) {
  static_assert(std::is_same_v<typename Bound::value_type, T>,
                "lina: the state's element type must be that of the bound tensors");
  st.prepare(linear, in);
  run_slices<T>(linear, in, std::array{out}, &st, ws);
}
}  // namespace detail

// evaluate_into(plan, out, st, bindings...): the causal plan over a block of
// tokens, starting from the running sums in `st` and leaving them updated, so
// that consecutive blocks give the same result as one evaluation of all of
// them; into caller memory of any layout (a block's rows of a [B, N, H, M]
// output, say). A wrong output shape throws shape_error, a state of another
// plan or batch state_error, before the state or `out` is touched.
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, state<T>& st, B const&... bindings) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  static_assert(check_stateful<L>() || true);
  auto in = bind<L>(bindings...);
  check_result_shape<L>(out.shape(), in);
  detail::evaluate_bound(linear, st, in, out);
}

// evaluate(plan, st, bindings...): the same into a new [B, H, rows, cols] tensor.
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<T> evaluate(Plan const& plan, state<T>& st, B const&... bindings) {
  using L = decltype(longest_branch(plan));
  tensor<T> out(result_shape<L>(bind<L>(bindings...)), uninitialized);
  evaluate_into(plan, out.view(), st, bindings...);
  return out;
}

// A causal plan run token by token, holding its state.
template <class T, class L>
class rnn {
 public:
  rnn(L plan, std::size_t batch, std::size_t heads) : plan_(plan), state_(plan_, batch, heads) {}

  // One token: every input [B, H, 1, *]; returns [B, H, 1, cols].
  template <class... B>
    requires(is_binding<B> && ...)
  tensor<T> step(B const&... bindings) {
    auto in = bind_token(bindings...);
    tensor<T> out(result_shape<L>(in), uninitialized);
    detail::evaluate_bound(plan_, state_, in, out.view(), &workspace_);
    return out;
  }
  // One token into the caller's [B, H, 1, cols] output. After the first step
  // nothing is allocated: the state is updated in place and the temporaries
  // come from this rnn's workspace (but once, at the first float step past
  // 4096 tokens: the state's pending sums, cpu/state.hpp).
  template <class... B>
    requires(is_binding<B> && ...)
  void step_into(tensor_view<T> out, B const&... bindings) {
    auto in = bind_token(bindings...);
    check_result_shape<L>(out.shape(), in);
    detail::evaluate_bound(plan_, state_, in, out, &workspace_);
  }

  void reset() { state_.reset(); }
  cpu::state<T> const& state() const noexcept { return state_; }
  cpu::state<T>& state() noexcept { return state_; }
  // Restore a saved state; it must come from this plan and shape.
  void set_state(cpu::state<T> s) {
    s.check_replaces(state_);
    state_ = std::move(s);
  }
  L const& plan() const noexcept { return plan_; }

 private:
  template <class... B>
  auto bind_token(B const&... bindings) {
    using seq = scanned_dim<L>;
    auto in = bind<L>(bindings...);
    constexpr std::size_t k = decltype(in)::table_type::template index_of<seq>();
    if (in.table.value[k] != 1)
      throw shape_error(in.table.bound_by[k], seq::label(), in.table.value[k], 1, "(a step takes one token)");
    return in;
  }

  L plan_;
  cpu::state<T> state_;
  workspace<T> workspace_;
};

// recurrent<T>(plan, B, H): the plan's linear form as an RNN over B x H
// sequences, starting from zero sums.
template <class T = float, class Plan>
  requires is_node<Plan>
auto recurrent(Plan const& plan, std::size_t batch, std::size_t heads) {
  auto linear = longest_branch(plan);
  static_assert(check_stateful<decltype(linear)>() || true);
  return rnn<T, decltype(linear)>(linear, batch, heads);
}

}  // namespace lina::cpu
