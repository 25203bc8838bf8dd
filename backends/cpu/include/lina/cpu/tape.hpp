// Training without recomputing the forward: cpu::tape.
//
//   cpu::tape<float> tp;
//   auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v);          // keeps what the backward reads
//   auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);      // reads it instead of recomputing
//
// The forward runs bundle(plan, plan, values…) of save_for_backward (one
// schedule: the output and the kept values, each written once); the backward
// runs the saved form of the derived plan with saved_i bound to the tape's
// tensor i. For the causal linear plan that is Y, N x (M+1) per slice (as
// much as the output), and the backward skips the recomputed forward scan.
// The gradients are those of cpu::gradient (the same operations on the same
// values). The tape keeps its tensors from call to call (a training loop
// reuses memory already faulted in) until clear(). A plan whose backward
// reads nothing worth keeping (softmax's values are N x N or made from exp)
// keeps nothing, and its forward and backward are cpu::evaluate's and
// cpu::gradient's: a block of query rows at a time, never N x N.
//
// Chained blocks take one tape per block, filled with the block's forward
// through its state and read by the block's backward:
//
//   auto out = cpu::evaluate(plan, st, tp[x], Q = q_x, …);            // block x, from st
//   auto [g, d_initial] = cpu::gradient(plan, tp[x], dout_x, begin[x], d_final, Q = q_x, …);
//
// The backward must be given the inputs its forward read: a tape does not
// hold them, and cannot tell a changed tensor from the one it saw. A tape of
// another plan (or of this plan at extents whose order differs), one no
// forward filled, or one filled through a state read by the stateless
// backward (or the other way round) is a lina::tape_error; one of other
// extents a lina::shape_error on its saved value.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/gradient.hpp"
#include "lina/cpu/recurrent.hpp"
#include "lina/cpu/state.hpp"
#include "lina/saved.hpp"

namespace lina::cpu {

namespace detail {
struct tape_access;
}

template <class T>
class tape {
 public:
  tape() = default;
  // Filled by a forward (and not cleared since).
  bool filled() const noexcept { return plan_type_ != nullptr; }
  // The values kept, each a [B, H, rows, cols] tensor (saved1 is value(0)).
  std::size_t size() const noexcept { return values_.size(); }
  tensor<T> const& value(std::size_t i) const { return values_.at(i); }
  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (auto const& v : values_) n += v.size() * sizeof(T);
    return n;
  }
  // The plan whose forward filled it, as text ("" when none did).
  std::string plan() const { return plan_ ? print_(plan_.get()) : std::string(); }
  // Forget the values and free their memory.
  void clear() {
    *this = tape{};
  }

 private:
  friend struct detail::tape_access;
  std::type_info const* plan_type_ = nullptr;  // the select-free plan that ran
  std::shared_ptr<void const> plan_;           // a copy of it: its values (eps, decays) must match too
  std::string (*print_)(void const*) = nullptr;  // to_string of that copy (for errors: not made each call)
  bool recompute_ = false;  // its saved form was not exact: nothing kept, the backward recomputes
  bool chained_ = false;    // filled through a state: its values are the block's from that state
  std::vector<tensor<T>> values_;
};

namespace detail {
struct tape_access {
  // The forward of select-free plan p into out, keeping its values in tp;
  // with a state st (p is then the linear form), from and into its sums.
  template <class T, class P, class Bound, class St = std::nullptr_t>
  static void forward(P const& p, Bound const& in, tensor_view<T> out, tape<T>& tp, St st = nullptr) {
    constexpr bool chained = std::is_same_v<St, state<T>*>;
    if constexpr (chained) st->prepare(p, in);  // (a state of another plan or shape throws here: nothing changed)
    auto const sv = save_for_backward(p);
    constexpr std::size_t k = std::remove_cvref_t<decltype(sv)>::size;
    tp.plan_type_ = nullptr;  // (filled again only once the run has finished)
    if (k == 0 || !sv.exact) {  // nothing kept: the plain forward (a softmax plan's in blocks of rows)
      tp.values_.clear();
      if constexpr (chained)
        run_slices<T>(p, in, std::array{out}, st);
      else
        evaluate_slices<T>(p, in, out);
    } else if constexpr (k > 0) {
      tp.values_.resize(k);
      std::array<tensor_view<T>, k + 1> outs{out};
      std::size_t i = 0;
      hana::for_each(sv.values, [&](auto const& x) {
        shape4 want = result_shape<std::remove_cvref_t<decltype(x)>>(in);
        if (tp.values_[i].shape() != want) tp.values_[i] = tensor<T>(want);
        outs[i + 1] = tp.values_[i].view();
        ++i;
      });
      auto const fb = hana::unpack(sv.values, [&](auto const&... x) { return make_node(op::bundle{}, p, p, x...); });
      if constexpr (chained)
        run_through_state<T>(p, fb, in, outs, *st);
      else
        run_slices<T>(fb, in, outs);
    }
    tp.plan_type_ = &typeid(P);
    tp.plan_ = std::make_shared<P const>(p);
    tp.print_ = [](void const* q) { return to_string(*static_cast<P const*>(q)); };
    tp.recompute_ = !sv.exact;
    tp.chained_ = chained;
  }

  // Where each of a list's types is in the list Of.
  template <class Of, class... S>
  static constexpr auto positions_in(lina::detail::type_list<S...>) {
    return std::array<std::size_t, sizeof...(S)>{lina::detail::index_of_v<S, Of>...};
  }

  // Run fb, the bundle of the linear form L and its kept values, from and into
  // L's state st. fb's scans are L's (a kept value's scan is a twin of one of
  // L's: the same node, summing the same rows), so each starts from the sums
  // of L's first scan of its type, and each of L's scans (twins in L too)
  // takes what fb's first scan of its type ends with.
  template <class T, class L, class FB, class Bound, std::size_t O>
  static void run_through_state(L const&, FB const& fb, Bound const& in, std::array<tensor_view<T>, O> const& outs,
                                state<T>& st) {
    using mine = state_scans<L>;
    constexpr auto of_mine = positions_in<mine>(state_scans<FB>{});
    static_assert(std::ranges::all_of(of_mine, [](std::size_t j) { return j < mine::size; }),
                  "lina::cpu::tape: a kept value's scan is none of the plan's");
    state<T> sums(fb, in.batch, in.heads);
    sums.prepare(fb, in);
    auto copy = [&](state<T> const& from, std::size_t f, state<T>& to, std::size_t t) {
      for (std::size_t b = 0; b < in.batch; ++b) to.copy_entry(t, b, from, f, b);
    };
    for (std::size_t k = 0; k < of_mine.size(); ++k) copy(st, of_mine[k], sums, k);
    run_slices<T>(fb, in, outs, &sums);
    constexpr auto first_of_type = positions_in<mine>(mine{});
    for (std::size_t j = 0; j < mine::size; ++j)
      copy(sums, static_cast<std::size_t>(std::ranges::find(of_mine, first_of_type[j]) - of_mine.begin()), st, j);
  }

  // The tape's checks before a backward of p reads it.
  template <class T, class P>
  static void check(P const& p, tape<T> const& tp, bool chained) {
    if (!tp.filled())
      throw tape_error("this tape holds no forward's values: run cpu::evaluate(plan, tape, …) first");
    if (*tp.plan_type_ != typeid(P) || !same_value(*static_cast<P const*>(tp.plan_.get()), p))
      throw tape_error("this tape holds the values of the plan " + tp.plan() + ", not of " + to_string(p) +
                       " (another plan, or this one at extents where it runs another order)");
    if (tp.chained_ != chained)
      throw tape_error(chained ? "this tape was filled without a state: differentiate it with cpu::gradient(plan, "
                                 "tape, dout, …), or fill it with cpu::evaluate(plan, state, tape, …)"
                               : "this tape was filled through a state: differentiate it with cpu::gradient(plan, "
                                 "tape, dout, initial, d_final, …), the block's backward");
    using SV = std::remove_cvref_t<decltype(save_for_backward(p))>;
    if (!tp.recompute_ && tp.values_.size() != SV::size)
      throw tape_error("this tape holds " + std::to_string(tp.values_.size()) + " values, the plan's backward reads " +
                       std::to_string(SV::size));
  }

  // f(backward plan, saved bindings…): p's saved backward reading tp's values,
  // or its derived backward where the tape kept nothing.
  template <class T, class P, class F>
  static decltype(auto) with_backward(P const& p, tape<T> const& tp, F&& f) {
    auto const sv = save_for_backward(p);
    using SV = std::remove_cvref_t<decltype(sv)>;
    if constexpr (!value_free<P>())  // (an exact saved form has nothing to recompute)
      if (tp.recompute_) return f(backward_of(p));
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
      return f(sv.backward, make_binding<lina::detail::saved_name<I + 1>()>(tp.values_[I])...);
    }(std::make_index_sequence<SV::size>{});
  }

  // bp's bundle bound to the inputs, dout and the saved values, and `into`
  // (views by the inputs of the whole plan) as bp's gradient views, checked.
  template <class T, class BP, class Into, class D, class... B>
  static auto bind_into(BP const& bp, Into& into, D const& dout, B const&... bindings) {
    auto in = bind_backward(bp, dout, bindings...);
    gradients_of<tensor_view<T>, BP> mine;  // into's views in the order of bp's inputs
    [&]<class Fw, class... E>(backward_plan<Fw, E...> const*) {
      std::size_t i = 0;
      ((mine.all()[i++] = into[node<typename E::input>{}]), ...);
    }(static_cast<BP const*>(nullptr));
    auto outs = checked_gradient_views<BP>(in, mine);
    return std::pair{std::move(in), outs};
  }

  // The backward of select-free plan p into `into` (views by the inputs of the
  // whole plan), reading tp's values.
  template <class T, class P, class Into, class D, class... B>
  static void backward(P const& p, Into& into, tape<T> const& tp, D const& dout, B const&... bindings) {
    check(p, tp, false);
    with_backward(p, tp, [&](auto const& bp, auto const&... saved) {
      auto [in, outs] = bind_into<T>(bp, into, dout, bindings..., saved...);
      if constexpr (sizeof...(saved) == 0)  // the derived backward (a softmax plan's in blocks of rows)
        run_backward<T>(bp, in, outs);
      else
        run_slices<T>(as_bundle(bp), in, outs);
    });
  }

  // The chained backward of the linear form L (cpu::gradient's with initial
  // and d_final), reading tp's values: -> ∂initial.
  template <class T, class L, class Into, class D, class... B>
  static state<T> backward(L const& linear, Into& into, tape<T> const& tp, D const& dout, state<T> const& initial,
                           state<T> const& d_final, B const&... bindings) {
    check(linear, tp, true);
    return with_backward(linear, tp, [&](auto const& bp, auto const&... saved) {
      auto [in, outs] = bind_into<T>(bp, into, dout, bindings..., saved...);
      // (the backward's scans read the forward as rewritten by its saved form, if any)
      using Kept = typename lina::detail::kept_of<L, std::remove_cvref_t<decltype(gradient(linear))>>::type;
      using R = std::conditional_t<sizeof...(saved) == 0, L, reading_saved<L, Kept>>;
      return chained_backward<T, R>(linear, bp, in, bind<L>(bindings...), outs, initial, d_final);
    });
  }
};
}  // namespace detail

// evaluate(plan, tape, Q = q, …) -> the output, keeping in `tape` what the
// backward reads (reusing its memory when the extents repeat).
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, tape<T>& tp, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  static_assert(std::is_same_v<typename decltype(in)::value_type, T>,
                "lina::cpu::evaluate (tape): the tape, the output and the inputs must have one element type");
  check_result_shape<Plan>(out.shape(), in);
  with_resolved_plan(plan, in.table, [&](auto const& p) { detail::tape_access::forward<T>(p, in, out, tp); });
}
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, tape<T>& tp, B const&... bindings) {
  tensor<T> out(result_shape<Plan>(bind<Plan>(bindings...)), uninitialized);
  evaluate_into(plan, out.view(), tp, bindings...);
  return out;
}

// gradient_into(plan, into, tape, dout, Q = q, …): cpu::gradient_into's
// gradients, from the values the tape's forward kept.
template <class P, class T, class... In, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, tape<T> const& tp, D const& dout,
                   B const&... bindings) {
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_for<tensor_view<T>, P>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(view_of(dout))::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views, the tape and dout must have one element type");
  auto in = bind<P>(bindings...);
  with_resolved_plan(plan, in.table, [&](auto const& p) { detail::tape_access::backward<T>(p, into, tp, dout, bindings...); });
}
// gradient(plan, tape, dout, Q = q, …) -> gradients: g[Q], g[K], …, each laid out like its input.
template <class P, class T, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
auto gradient(P const& plan, tape<T> const& tp, D const& dout, B const&... bindings) {
  auto in = bind<P>(bindings...);
  gradients_for<tensor<T>, P> g;
  gradients_for<tensor_view<T>, P> into;
  for (std::size_t i = 0; i < g.all().size(); ++i) {
    g.all()[i] = tensor<T>::like(in.views[i], uninitialized);
    into.all()[i] = g.all()[i].view();
  }
  gradient_into(plan, into, tp, dout, bindings...);
  return g;
}

// ---- chained blocks ----
// evaluate_into(plan, out, st, tape, Q = q, …): the block's output from and
// into the state st (recurrent.hpp's evaluate_into), keeping in `tape` what
// the block's backward reads.
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, state<T>& st, tape<T>& tp, B const&... bindings) {
  auto const linear = longest_branch(plan);
  using L = std::remove_cvref_t<decltype(linear)>;
  static_assert(check_stateful<L>() || true);
  auto in = bind<L>(bindings...);
  static_assert(std::is_same_v<typename decltype(in)::value_type, T>,
                "lina::cpu::evaluate (tape): the state, the tape, the output and the inputs must have one element type");
  check_result_shape<L>(out.shape(), in);
  detail::tape_access::forward<T>(linear, in, out, tp, &st);
}
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<T> evaluate(Plan const& plan, state<T>& st, tape<T>& tp, B const&... bindings) {
  using L = decltype(longest_branch(plan));
  tensor<T> out(result_shape<L>(bind<L>(bindings...)), uninitialized);
  evaluate_into(plan, out.view(), st, tp, bindings...);
  return out;
}

// gradient_into(plan, into, tape, dout, initial, d_final, Q = q, …) -> ∂initial:
// the block's gradients (gradient.hpp's chained gradient_into) from the values
// its forward kept.
template <class P, class T, class... In, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
state<T> gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, tape<T> const& tp, D const& dout,
                       state<T> const& initial, state<T> const& d_final, B const&... bindings) {
  auto const linear = longest_branch(plan);
  using L = std::remove_cvref_t<decltype(linear)>;
  static_assert(check_stateful<L>());
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_for<tensor_view<T>, L>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(view_of(dout))::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views, the tape and dout must have one element type");
  return detail::tape_access::backward<T>(linear, into, tp, dout, initial, d_final, bindings...);
}
template <class P, class T, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
auto gradient(P const& plan, tape<T> const& tp, D const& dout, state<T> const& initial, state<T> const& d_final,
              B const&... bindings) {
  auto [g, into] = detail::new_gradients_into(longest_branch(plan), dout, bindings...);
  state<T> d_initial = gradient_into(plan, into, tp, dout, initial, d_final, bindings...);
  return std::pair{std::move(g), std::move(d_initial)};
}

}  // namespace lina::cpu
