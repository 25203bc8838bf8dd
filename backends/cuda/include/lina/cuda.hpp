// The CUDA backend's entry points for plans:
//
//   cuda::spec_of(plan)                 what the kernel computes, from the plan's type
//   cuda::program_of(plan, opts, D = d, M = m)   the tile program (lina/cuda/program.hpp)
//   cuda::source(plan, opts, D = d, M = m)       the generated CUDA source
//   cuda::kernels_of(plan, opts, D = d, M = m)   every kernel its launches may run (to
//                                                compile ahead of time: lina/cuda/embed.hpp)
//   cuda::emulate(plan, opts, Q = q, K = k, V = v)   the result through the host emulation
//   cuda::emulate_into(plan, opts, out, Q = q, …)    the same into a view of any layout
//   cuda::evaluate_into(plan, out, stream, Q = q, …)  a launch on the GPU, on device views
//   cuda::evaluate(plan, stream, Q = dq, …)          the same into a new cuda::tensor
//   cuda::tensor<T>, to_device(host), to_host(dev)   owning device tensors and copies
//   cuda::state                                      a causal plan's running sums between
//     emulate_into(plan, opts, out, st, Q = q, …)    evaluations (chaining blocks of a
//     evaluate_into(plan, out, st, stream, …)        sequence), in host or device memory
//   cuda::emulate_gradient(plan, opts, dout, Q = q, …), cuda::gradient(plan, dout, stream, …)
//     the generated backward's gradients (new tensors); gradient_into(plan, into, dout,
//     stream, …) into the caller's views (into = gradient_views<T>(plan))
//   cuda::recurrent                                  decoding: prompts and one-token steps
//   any of emulate, evaluate (with a state or not), gradient, gradient_into,
//     recurrent::prefill with a `sequences` before the bindings: packed sequences of different
//     lengths (lina/sequences.hpp); linear plans in one launch that reads the offsets
//
// This header includes the DSL (Hana); the emitter, the emulation and NVRTC
// live in translation units of their own that never see it.
//
// Plans lowered so far (Map ∈ {elu+1, relu, identity, poly2} or an element-wise
// map of the user's with CUDA formulas (detail::cuda_formulas), φ(·; W) ∈ {favor,
// random_fourier} with one W for both or one each, or no φ at all; each with
// or without the normaliser rowdiv(…[V|1])):
//   causal:      contract(φ(Q), prefix(φ(K)⊗V))  or  causal(φ(Q)·φ(K)ᵀ)·V, the mask decayed or not
//   non-causal:  φ(Q)·(φ(K)ᵀ·V)                  or  (φ(Q)·φ(K)ᵀ)·V
//   softmax:     causal(exp(s·(φ(Q)·φ(K)ᵀ)))·V   or  exp(s·(φ(Q)·φ(K)ᵀ))·V (s optional),
//                or exp(s·causal(φ(Q)·φ(K)ᵀ))·V (the mask before exp: masked keys weigh 1),
//                the causal mask after exp decayed or not (ALiBi's bias):
//                quadratic, a block per chunk of query rows (its backward: two launches)
// and a select between two of these that compute the same thing (what
// compile() leaves for a dynamic N): the chunked kernel is both orders at
// once — quadratic inside a chunk, linear across chunks — so the CPU's
// crossover does not apply to it. Non-causal plans may be cross-attentions
// (K and V over another sequence than Q: forward_args::n_keys, the same
// kernels). Q, K or V may be another such plan (stacked layers: one kernel
// per layer, lower first; chained and decoded through a state per layer).
// Anything else is a compile error that says so.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/bind.hpp"
#include "lina/cuda/device.hpp"
#include "lina/cuda/emit.hpp"
#include "lina/cuda/emulate.hpp"
#include "lina/cuda/numeric.hpp"
#include "lina/cuda/program.hpp"
#include "lina/feature_maps.hpp"
#include "lina/format.hpp"
#include "lina/gradient.hpp"
#include "lina/node.hpp"
#include "lina/sequences.hpp"
#include "lina/state.hpp"
#include "lina/tensor.hpp"

namespace lina::cuda {

// Element types of one generated kernel: inputs are given as float tensors
// and read as if stored in `in` (rounded to it, to nearest even); the result
// is rounded to `out` and handed back as float.
struct options {
  dtype in = dtype::f32;
  dtype out = dtype::f32;
  // 16-bit inputs multiply on the tensor cores (bf16 at bf16, f16 at tf32;
  // program.hpp's `precision`): operands rounded as they are read. true keeps
  // every product an exact fp32 FMA chain instead — slower, for checking.
  bool exact_products = false;
  // The emulation of the chunk-parallel form (split_programs_of): groups of
  // this many rows (a multiple of the chunk; 0: one pass) for linear plans,
  // causal (chained or not) or not; emulate_gradient: a linear backward's
  // (split_backward_programs_of), where the plan has one. 0: as tiles.groups
  // asks (0 there: one pass). Launches choose it from the device, or from
  // tiles.groups where that is set (split_rows).
  std::int64_t split_rows = 0;
  // The chunk (T = 16, 32, 64) and M tile of the kernels (tile_request in
  // lina/cuda/program.hpp; 0: lina chooses, choose_tiles): results differ
  // only in the order of sums; a request that does not fit shared memory
  // throws std::invalid_argument saying how many bytes it needs.
  tile_request tiles{};
};

namespace diagnose {
template <bool Supported>
struct cuda_plan {
  static_assert(Supported,
                "lina::cuda: this plan cannot be lowered to a CUDA kernel yet. Supported: causal "
                "contract(φ(Q), prefix(φ(K)⊗V)) or causal(φ(Q)·φ(K)ᵀ)·V, non-causal φ(Q)·(φ(K)ᵀ·V) or "
                "(φ(Q)·φ(K)ᵀ)·V, each optionally normalised as rowdiv(…[V|1]); φ ∈ {elu+1, relu, identity, "
                "poly2} or none, an element-wise map of yours that gives cuda_apply and cuda_derivative "
                "(docs/dsl.md), or φ(X; W) ∈ {favor, random_fourier} with one W for Q and K or one each; "
                "softmax [causal(]exp(s·[causal(]Q·Kᵀ[)])[)]·V, normalised or not; K and V over one sequence "
                "dimension (Q over another: non-causal only); a select only between two such forms of one attention; "
                "a decayed mask causal(S, decay{g}) outside exp (a decayed mask inside exp, exp(causal(S, decay{g})), "
                "runs on the CPU backend)");
  static constexpr bool ok = Supported;
};
}  // namespace diagnose

namespace detail {

// A user-defined element-wise map lowers when it says what it is in CUDA:
//   static constexpr std::string_view cuda_apply = "log1pf(expf(x))";          // φ(x)
//   static constexpr std::string_view cuda_derivative = "1.0f / (1.0f + expf(-x))";  // φ′(x)
// (expressions in the float x; the emulation calls value<float>, derivative<float>).
template <class Map>
concept cuda_formulas = concepts::elementwise_map<Map> && requires {
  { Map::cuda_apply } -> std::convertible_to<std::string_view>;
  { Map::cuda_derivative } -> std::convertible_to<std::string_view>;
};
template <class Map>
inline constexpr bool known_map = cuda_formulas<Map>;
template <>
inline constexpr bool known_map<lina::elu_plus_one> = true;
template <>
inline constexpr bool known_map<lina::relu> = true;
template <>
inline constexpr bool known_map<lina::identity> = true;
template <>
inline constexpr bool known_map<lina::poly2> = true;
// The parametric maps: φ(X; W), W an input of the plan (D × F).
template <class Map>
inline constexpr bool known_parametric_map =
    std::is_same_v<Map, lina::favor> || std::is_same_v<Map, lina::random_fourier>;
template <class Map>
constexpr feature_map map_of() {
  if constexpr (std::is_same_v<Map, lina::favor>)
    return feature_map::favor;
  else if constexpr (std::is_same_v<Map, lina::random_fourier>)
    return feature_map::random_fourier;
  else if constexpr (std::is_same_v<Map, lina::elu_plus_one>)
    return feature_map::elu_plus_one;
  else if constexpr (std::is_same_v<Map, lina::relu>)
    return feature_map::relu;
  else if constexpr (std::is_same_v<Map, lina::poly2>)
    return feature_map::poly2;
  else if constexpr (cuda_formulas<Map>)
    return feature_map::user0;  // (spec_of makes φ(K)'s user1 when it is another map than φ(Q)'s)
  else
    return feature_map::identity;
}
template <class Map>
user_map user_map_of() {
  if constexpr (cuda_formulas<Map>)
    return {std::string(Map::name), std::string(Map::cuda_apply), std::string(Map::cuda_derivative),
            +[](float x) -> float { return Map::value(x); }, +[](float x) -> float { return Map::derivative(x); }};
  else
    return {};
}

// Stacked layers: an operand that is itself a lowerable attention (a layer
// below) runs first, into an intermediate that the plan above reads as the
// input "@q", "@k" or "@v" (its slot); `sub` is that layer's plan, else void.
template <class N>
struct forward_plan;
template <class X>
inline constexpr bool is_input_node = false;
template <fixed_string Name, class R, class C>
inline constexpr bool is_input_node<node<op::input<Name, R, C>>> = true;
template <class X>
constexpr bool is_layer() {
  if constexpr (is_node<X> && !is_input_node<X>)
    return forward_plan<X>::ok;
  else
    return false;
}
template <char Slot>
inline constexpr fixed_string layer_name = "@q";
template <>
inline constexpr fixed_string layer_name<'k'> = "@k";
template <>
inline constexpr fixed_string layer_name<'v'> = "@v";
template <char Slot, class X>
using layer_input = op::input<layer_name<Slot>, op::rows_of<typename X::shape>, op::cols_of<typename X::shape>>;

// φ(X), φ(X; W) or X, for inputs X (and W: param, else void) or a layer X.
template <class N, char Slot = 'q'>
struct mapped_input {
  static constexpr bool ok = false;
  using map_type = void;  // the feature map's type (void: none)
  using param = void;
  using sub = void;
};
template <fixed_string Name, class R, class C, char Slot>
struct mapped_input<node<op::input<Name, R, C>>, Slot> {
  static constexpr bool ok = true;
  static constexpr feature_map map = feature_map::identity;
  using map_type = void;
  using input = op::input<Name, R, C>;
  using param = void;
  using sub = void;
};
template <class Map, fixed_string Name, class R, class C, char Slot>
struct mapped_input<node<op::phi<Map>, node<op::input<Name, R, C>>>, Slot> {
  static constexpr bool ok = known_map<Map>;
  static constexpr feature_map map = map_of<Map>();
  using map_type = Map;
  using input = op::input<Name, R, C>;
  using param = void;
  using sub = void;
};
template <class Map, fixed_string Name, class R, class C, fixed_string WName, class WR, class WC, char Slot>
struct mapped_input<node<op::phi<Map>, node<op::input<Name, R, C>>, node<op::input<WName, WR, WC>>>, Slot> {
  static constexpr bool ok = known_parametric_map<Map>;
  static constexpr feature_map map = map_of<Map>();
  using map_type = Map;
  using input = op::input<Name, R, C>;
  using param = op::input<WName, WR, WC>;
  using sub = void;
};
template <class Map, class X, char Slot>
  requires(is_layer<X>())
struct mapped_input<node<op::phi<Map>, X>, Slot> {
  static constexpr bool ok = known_map<Map>;
  static constexpr feature_map map = map_of<Map>();
  using map_type = Map;
  using input = layer_input<Slot, X>;
  using param = void;
  using sub = X;
};
template <class Op, class... K, char Slot>
  requires(is_layer<node<Op, K...>>())
struct mapped_input<node<Op, K...>, Slot> {
  static constexpr bool ok = true;
  static constexpr feature_map map = feature_map::identity;
  using map_type = void;
  using input = layer_input<Slot, node<Op, K...>>;
  using param = void;
  using sub = node<Op, K...>;
};

// V or [V|1], for an input V or a layer.
template <class N>
struct value_input {
  static constexpr bool ok = false;
  using sub = void;
};
template <class N>
struct value_operand : mapped_input<N, 'v'> {
  static constexpr bool ok = mapped_input<N, 'v'>::ok && mapped_input<N, 'v'>::map == feature_map::identity &&
                             std::is_void_v<typename mapped_input<N, 'v'>::param>;
};
template <class Op, class... K>
  requires(!std::is_same_v<Op, op::append_ones>)
struct value_input<node<Op, K...>> : value_operand<node<Op, K...>> {
  static constexpr bool ones = false;
};
template <class X>
struct value_input<node<op::append_ones, X>> : value_operand<X> {
  static constexpr bool ones = true;
};

// The attention core below an optional rowdiv: (φQ, φK, V), causal or not,
// softmax (exp of the scores, scaled by scale(core)) or linear.
template <class A, class B, class C, bool Causal, bool Softmax = false>
struct core_parts {
  using q = mapped_input<A, 'q'>;
  using k = mapped_input<B, 'k'>;
  using v = value_input<C>;
  // the first layer below (Q's side, then K's, then V's), or void
  using layer = std::conditional_t<!std::is_void_v<typename q::sub>, q,
                                   std::conditional_t<!std::is_void_v<typename k::sub>, k, v>>;
  static constexpr bool stacked = !std::is_void_v<typename layer::sub>;
  static constexpr bool causal = Causal;
  static constexpr bool softmax = Softmax;
  static constexpr bool mask_scores = false;  // softmax_parts: exp(causal(S))
  static constexpr bool decayed = false;      // a decayed mask or scan (causal(S, decay{g})): decay(core) is its op's decay
  template <class N>
  static constexpr op::no_decay decay(N const&) {
    return {};
  }
  static constexpr bool parametric = !std::is_void_v<typename q::param>;  // favor, random_fourier: W
  // φ(K) reads a W of its own (input slot 4), not φ(Q)'s
  static constexpr bool own_k_w = !std::is_void_v<typename k::param> && !std::is_same_v<typename q::param, typename k::param>;
  template <class N>
  static constexpr double scale(N const&) {
    return 1;
  }
  static constexpr bool ok = [] {
    if constexpr (q::ok && k::ok && v::ok) {
      using QI = typename q::input;
      using KI = typename k::input;
      using VI = typename v::input;
      // K and V over one sequence; Q over it too, or — non-causal: cross-attention — another;
      // a parametric map's W shared by φ(Q) and φ(K), or one each for the same map
      return (std::is_same_v<typename q::param, typename k::param> || (parametric && own_k_w && q::map == k::map)) &&
             (!Causal || std::is_same_v<typename QI::rows, typename KI::rows>) &&
             std::is_same_v<typename KI::rows, typename VI::rows> && std::is_same_v<typename QI::cols, typename KI::cols>;
    } else {
      return false;
    }
  }();
};

template <class N>
struct core {
  static constexpr bool ok = false;
  static constexpr bool softmax = false;
  static constexpr bool parametric = false;
  static constexpr bool own_k_w = false;
  static constexpr bool stacked = false;
};
// contract(φQ, prefix(φK⊗V)), the scan decayed or not
template <class A, class B, class C, class D>
struct core<node<op::contract_rows, A, node<op::prefix_scan_t<D>, node<op::outer_rows, B, C>>>>
    : core_parts<A, B, C, true> {
  static constexpr bool decayed = !std::is_same_v<D, op::no_decay>;
  static constexpr D decay(node<op::contract_rows, A, node<op::prefix_scan_t<D>, node<op::outer_rows, B, C>>> const& n) {
    return decay_of(kid<1>(n).op);
  }
};
// causal(φQ·φKᵀ)·V, the mask decayed or not
template <class A, class B, class C, class D>
struct core<node<op::product, node<op::causal_t<D>, node<op::product, A, node<op::transpose, B>>>, C>>
    : core_parts<A, B, C, true> {
  static constexpr bool decayed = !std::is_same_v<D, op::no_decay>;
  static constexpr D decay(node<op::product, node<op::causal_t<D>, node<op::product, A, node<op::transpose, B>>>, C> const& n) {
    return decay_of(kid<0>(n).op);
  }
};
// φQ·(φKᵀ·V)
template <class A, class B, class C>
struct core<node<op::product, A, node<op::product, node<op::transpose, B>, C>>> : core_parts<A, B, C, false> {};
// (φQ·φKᵀ)·V
template <class A, class B, class C>
struct core<node<op::product, node<op::product, A, node<op::transpose, B>>, C>> : core_parts<A, B, C, false> {};

// The softmax similarity's argument: φQ·φKᵀ, scaled or not (scales multiply).
template <class N>
struct scores {
  static constexpr bool ok = false;
  using q = void;
  using k = void;
};
template <class A, class B>
struct scores<node<op::product, A, node<op::transpose, B>>> {
  static constexpr bool ok = true;
  static constexpr bool masked = false;
  using q = A;
  using k = B;
  template <class N>
  static constexpr double scale(N const&) {
    return 1;
  }
};
template <class X>
struct scores<node<op::scale, X>> : scores<X> {
  static constexpr double scale(node<op::scale, X> const& n) { return n.op.factor * scores<X>::scale(kid<0>(n)); }
};
// causal(S) inside exp: the mask before exp (a masked score is 0, its key weighs exp(0) = 1)
template <class X>
struct scores<node<op::causal, X>> : scores<X> {
  static constexpr bool masked = true;
  static constexpr double scale(node<op::causal, X> const& n) { return scores<X>::scale(kid<0>(n)); }
};
template <class S, class C, bool Causal>
struct softmax_parts : core_parts<typename scores<S>::q, typename scores<S>::k, C, Causal, true> {
  static constexpr bool ok = scores<S>::ok && core_parts<typename scores<S>::q, typename scores<S>::k, C, Causal, true>::ok;
  static constexpr bool mask_scores = scores<S>::masked;
};
// exp(S)·V
template <class S, class C>
struct core<node<op::product, node<op::exp, S>, C>> : softmax_parts<S, C, false> {
  static constexpr double scale(node<op::product, node<op::exp, S>, C> const& n) {
    return scores<S>::scale(kid<0>(kid<0>(n)));
  }
};
// causal(exp(S))·V, the mask decayed or not (ALiBi's bias: exp(S_ij)·g^(i−j))
template <class S, class C, class D>
struct core<node<op::product, node<op::causal_t<D>, node<op::exp, S>>, C>> : softmax_parts<S, C, true> {
  static constexpr bool decayed = !std::is_same_v<D, op::no_decay>;
  static constexpr double scale(node<op::product, node<op::causal_t<D>, node<op::exp, S>>, C> const& n) {
    return scores<S>::scale(kid<0>(kid<0>(kid<0>(n))));
  }
  static constexpr D decay(node<op::product, node<op::causal_t<D>, node<op::exp, S>>, C> const& n) {
    return decay_of(kid<0>(n).op);
  }
};

template <class X, class Y>
constexpr bool same_attention() {
  if constexpr (X::ok && Y::ok)
    return X::causal == Y::causal && X::softmax == Y::softmax && X::mask_scores == Y::mask_scores &&
           X::decayed == Y::decayed &&
           X::q::map == Y::q::map && X::k::map == Y::k::map && X::v::ones == Y::v::ones &&
           std::is_same_v<typename X::q::map_type, typename Y::q::map_type> &&
           std::is_same_v<typename X::k::map_type, typename Y::k::map_type> &&
           std::is_same_v<typename X::q::input, typename Y::q::input> &&
           std::is_same_v<typename X::q::param, typename Y::q::param> &&
           std::is_same_v<typename X::k::param, typename Y::k::param> &&
           std::is_same_v<typename X::q::sub, typename Y::q::sub> && std::is_same_v<typename X::k::sub, typename Y::k::sub> &&
           std::is_same_v<typename X::v::sub, typename Y::v::sub> &&
           std::is_same_v<typename X::k::input, typename Y::k::input> &&
           std::is_same_v<typename X::v::input, typename Y::v::input>;
  else
    return false;
}
template <class Key, std::size_t T, class S, class L>
struct core<node<op::select<Key, T>, S, L>> : core<L> {
  static constexpr bool ok = same_attention<core<S>, core<L>>();
  // (both forms are of one attention, compile()'s: one decay)
  static constexpr auto decay(node<op::select<Key, T>, S, L> const& n) { return core<L>::decay(kid<1>(n)); }
};

// The whole plan: rowdiv(core with [V|1]) or a core with plain V.
template <class N>
struct forward_plan : core<N> {
  static constexpr bool normalized = false;
  static constexpr bool ok = [] {
    if constexpr (core<N>::ok)
      return !core<N>::v::ones;
    else
      return false;
  }();
  static constexpr double eps(N const&) { return 0; }
  static constexpr double scores_scale(N const& n) { return core<N>::scale(n); }
  static constexpr auto mask_decay(N const& n) { return core<N>::decay(n); }
};
template <class X>
struct forward_plan<node<op::row_divide, X>> : core<X> {
  static constexpr bool normalized = true;
  static constexpr bool ok = [] {
    if constexpr (core<X>::ok)
      return core<X>::v::ones;
    else
      return false;
  }();
  static constexpr double eps(node<op::row_divide, X> const& n) { return n.op.eps; }
  static constexpr double scores_scale(node<op::row_divide, X> const& n) { return core<X>::scale(kid<0>(n)); }
  static constexpr auto mask_decay(node<op::row_divide, X> const& n) { return core<X>::decay(kid<0>(n)); }
};

template <class Dim, class... E>
std::size_t extent_from(char const* what, E const&... e) {
  if constexpr (Dim::is_static) {
    return Dim::static_extent;
  } else {
    std::size_t r = 0;
    bool found = false;
    (
        [&] {
          if constexpr (std::is_same_v<E, extent_binding<Dim>>) {
            r = e.extent;
            found = true;
          }
        }(),
        ...);
    if (!found)
      throw std::invalid_argument(std::string("lina::cuda: give the extent of dimension ") + Dim::label() + " (" +
                                  what + "), e.g. " + Dim::label() + " = 64");
    return r;
  }
}

}  // namespace detail

// Can this plan be lowered (the condition of the static_assert in spec_of)?
template <class Plan>
inline constexpr bool lowerable = detail::forward_plan<std::remove_cvref_t<Plan>>::ok;

// What the kernel of `plan` computes; D and M are left 0 where dynamic.
template <class Plan>
attention_spec spec_of(Plan const& plan, options opt = {}) {
  using F = detail::forward_plan<Plan>;
  static_assert(diagnose::cuda_plan<F::ok>::ok || true);  // one error: the message above
  attention_spec s;
  if constexpr (F::ok) {
    using QI = typename F::q::input;
    using KI = typename F::k::input;
    using VI = typename F::v::input;
    s.causal = F::causal;
    s.normalized = F::normalized;
    s.softmax = F::softmax;
    if constexpr (F::softmax) s.scale = F::scores_scale(plan);
    s.mask_scores = F::mask_scores && !F::causal;
    s.map_q = F::q::map;
    s.map_k = F::k::map;
    s.user[0] = detail::user_map_of<typename F::q::map_type>();  // user-defined maps: φ(Q)'s user0, φ(K)'s too if the same
    if constexpr (F::k::map == feature_map::user0 && !std::is_same_v<typename F::q::map_type, typename F::k::map_type>) {
      s.map_k = feature_map::user1;
      s.user[1] = detail::user_map_of<typename F::k::map_type>();
    }
    s.eps = F::eps(plan);
    auto const d = F::mask_decay(plan);
    if constexpr (requires { d.decays; }) {  // a decay per head (one value throughout: the scalar's kernels)
      bool const one = std::all_of(d.decays->begin(), d.decays->end(), [&](double g) { return g == d.decays->front(); });
      if (one) s.decay = d.decays->front();
      if (!one) s.head_decays = *d.decays;
    } else {
      s.decay = d.decay;
    }
    s.d = QI::cols::is_static ? QI::cols::static_extent : 0;
    s.m = VI::cols::is_static ? VI::cols::static_extent : 0;
    if constexpr (!std::is_void_v<typename F::q::param>) {
      using WI = typename F::q::param;
      s.f = WI::cols::is_static ? WI::cols::static_extent : 0;
      s.w_name = std::string(WI::name.view());
    }
    if constexpr (F::own_k_w) s.w_k_name = std::string(F::k::param::name.view());
    s.q_name = std::string(QI::name.view());
    s.k_name = std::string(KI::name.view());
    s.v_name = std::string(VI::name.view());
  }
  s.in = opt.in;
  s.out = opt.out;
  s.exact_products = opt.exact_products;
  s.tiles = opt.tiles;
  s.description = to_string(plan);
  return s;
}

namespace detail {
// The spec of `plan` at these extents (D = d, M = m, F = f where dynamic).
template <class Plan, class... E>
attention_spec spec_at(Plan const& plan, options opt, E const&... extents) {
  attention_spec s = spec_of(plan, opt);
  if constexpr (detail::forward_plan<Plan>::ok) {
    using QI = typename detail::forward_plan<Plan>::q::input;
    using VI = typename detail::forward_plan<Plan>::v::input;
    s.d = detail::extent_from<typename QI::cols>("columns of Q and K", extents...);
    s.m = detail::extent_from<typename VI::cols>("columns of V", extents...);
    if constexpr (!std::is_void_v<typename detail::forward_plan<Plan>::q::param>)
      s.f = detail::extent_from<typename detail::forward_plan<Plan>::q::param::cols>("columns of W: random features",
                                                                                    extents...);
  }
  return s;
}
}  // namespace detail

// The tile program of `plan` at these extents (D = d, M = m where dynamic).
template <class Plan, class... E>
program program_of(Plan const& plan, options opt, E const&... extents) {
  return program_of(detail::spec_at(plan, opt, extents...));
}

// Every kernel that evaluate, evaluate_into (with a state or without), gradient
// and recurrent may launch for `plan` at these extents, whatever B, H, N and the
// device (lina/cuda/program.hpp, kernels_of): the list a program compiles ahead
// of time (lina_cuda_embed_kernels, docs/cuda.md). opt's dtypes and tile
// request as the launches will be given them. One layer: a stacked plan's
// layers are listed one by one.
template <class Plan, class... E>
std::vector<program> kernels_of(Plan const& plan, options opt, E const&... extents) {
  if constexpr (detail::forward_plan<Plan>::stacked) {
    static_assert(!detail::forward_plan<Plan>::stacked,
                  "lina::cuda::kernels_of: a stacked plan runs one kernel per layer; list each layer's attention "
                  "(compile(layer)) with its own extents");
    return {};
  } else {
    return kernels_of(detail::spec_at(plan, opt, extents...));
  }
}

// The generated CUDA source of `plan` at these extents.
template <class Plan, class... E>
std::string source(Plan const& plan, options opt, E const&... extents) {
  return emit(program_of(plan, opt, extents...));
}

// ---- device memory -------------------------------------------------------------------------
// 16-bit element types of device memory, as bit patterns.
struct bf16 {
  std::uint16_t bits;
};
struct f16 {
  std::uint16_t bits;
};
template <class E>
inline constexpr dtype dtype_of = std::is_same_v<std::remove_const_t<E>, bf16>  ? dtype::bf16
                                  : std::is_same_v<std::remove_const_t<E>, f16> ? dtype::f16
                                                                                : dtype::f32;
template <class E>
inline constexpr bool device_element =
    std::is_same_v<std::remove_const_t<E>, float> || std::is_same_v<std::remove_const_t<E>, bf16> ||
    std::is_same_v<std::remove_const_t<E>, f16>;

// A strided [B, H, rows, cols] view of device memory (E: float, f16, bf16,
// const or not). Binds like a host view: Q = device_view<bf16 const>(…).
template <class E>
class device_view {
  static_assert(device_element<E>, "lina::cuda::device_view: elements are float, cuda::f16 or cuda::bf16");

 public:
  using element_type_ = E;
  device_view() = default;
  device_view(E* data, shape4 shape, strides4 strides) : data_(data), shape_(shape), strides_(strides) {}
  device_view(E* data, shape4 shape) : device_view(data, shape, tensor_view<E>::contiguous_strides(shape)) {}
  E* data() const noexcept { return data_; }
  shape4 const& shape() const noexcept { return shape_; }
  strides4 const& strides() const noexcept { return strides_; }
  // Rows [first, first + count) of every (batch, head), as tensor_view::rows.
  device_view rows(std::size_t first, std::size_t count) const { return lina::detail::row_block(*this, first, count); }
  operator device_view<E const>() const
    requires(!std::is_const_v<E>)
  {
    return {data_, shape_, strides_};
  }

 private:
  E* data_ = nullptr;
  shape4 shape_{0, 0, 0, 0};
  strides4 strides_{0, 0, 0, 0};
};
template <class E>
device_view<E> view_of(device_view<E> const& v) {
  return v;
}
template <class V>
inline constexpr bool is_device_view = false;
template <class E>
inline constexpr bool is_device_view<device_view<E>> = true;

// cuda::tensor<T>: an owning dense [B, H, N, D] tensor in device memory (T:
// float, cuda::bf16 or cuda::f16). Move-only; freed when it dies. Binds like
// a host tensor: Q = dq. Made by to_device, by evaluate, or empty here and
// written by evaluate_into. Allocating needs a device: without one the
// constructor throws cuda_error naming the call ("no CUDA device (…)"); a
// tensor of no elements allocates nothing.
template <class T>
class tensor {
  static_assert(device_element<T> && !std::is_const_v<T>,
                "lina::cuda::tensor<T>: T is float, cuda::bf16 or cuda::f16");

 public:
  using element_type = T;
  tensor() = default;
  explicit tensor(shape4 shape, std::string const& call = "cuda::tensor")
      : shape_(shape), buffer_(count(shape) * sizeof(T), call) {}

  shape4 const& shape() const noexcept { return shape_; }
  strides4 strides() const noexcept { return tensor_view<T>::contiguous_strides(shape_); }
  std::size_t size() const noexcept { return count(shape_); }
  std::size_t bytes() const noexcept { return size() * sizeof(T); }
  T* data() noexcept { return static_cast<T*>(buffer_.get()); }
  T const* data() const noexcept { return static_cast<T const*>(buffer_.get()); }
  device_view<T> view() noexcept { return {data(), shape_}; }
  device_view<T const> view() const noexcept { return {data(), shape_}; }
  device_view<T> rows(std::size_t first, std::size_t count) { return view().rows(first, count); }
  device_view<T const> rows(std::size_t first, std::size_t count) const { return view().rows(first, count); }

 private:
  static std::size_t count(shape4 const& s) { return s[0] * s[1] * s[2] * s[3]; }
  shape4 shape_{0, 0, 0, 0};
  device_buffer buffer_;
};
template <class T>
device_view<T const> view_of(tensor<T> const& t) {
  return t.view();
}

// Copy a host tensor (any layout) to a new device tensor of element type T,
// rounding to it (nearest even) for bf16 and f16: to_device<cuda::bf16>(q).
// Returns once the copy is done (`stream` is synchronised).
template <class T = float>
tensor<T> to_device(tensor_view<float const> host, void* stream = nullptr) {
  static_assert(device_element<T> && !std::is_const_v<T>, "lina::cuda::to_device<T>: T is float, cuda::bf16 or cuda::f16");
  char const* call = "cuda::to_device";
  require_device(call);
  shape4 const s = host.shape();
  using E = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;
  std::vector<E> staging(s[0] * s[1] * s[2] * s[3]);
  std::size_t x = 0;  // (dense: the last index fastest, as for_each_index goes)
  for_each_index(s, [&](auto... i) {
    float const v = host(i...);
    if constexpr (std::is_same_v<T, bf16>)
      staging[x++] = bf16_bits(v);
    else if constexpr (std::is_same_v<T, f16>)
      staging[x++] = f16_bits(v);
    else
      staging[x++] = v;
  });
  tensor<T> d(s, call);
  copy_to_device(d.data(), staging.data(), d.bytes(), stream, call);
  synchronize_stream(stream, call);
  return d;
}

// Copy a device tensor back to a new host float tensor [B, H, N, D] (16-bit
// elements widened exactly). Returns once the copy is done.
template <class T>
lina::tensor<float> to_host(tensor<T> const& d, void* stream = nullptr) {
  char const* call = "cuda::to_host";
  require_device(call);
  using E = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;
  std::vector<E> staging(d.size());
  copy_to_host(staging.data(), d.data(), d.bytes(), stream, call);
  synchronize_stream(stream, call);
  lina::tensor<float> r(d.shape());
  for (std::size_t i = 0; i < staging.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      r.data()[i] = from_bf16_bits(staging[i]);
    else if constexpr (std::is_same_v<T, f16>)
      r.data()[i] = from_f16_bits(staging[i]);
    else
      r.data()[i] = staging[i];
  }
  return r;
}

// ---- state: chaining causal evaluations --------------------------------------------------------
// Where a state's running sums live.
enum class memory : std::uint8_t { host, device };

// cuda::state: the running sums of a causal plan between evaluations, so that
// consecutive blocks of a sequence give what one evaluation of all of them
// gives (as cpu::state does on the CPU). fp32, [B, H, C, W] per the plan's
// scan — C features, W = M + 1 with the normaliser z in the last column when
// normalised, else M — the meaning lina/state.hpp gives every backend: the
// same numbers as a cpu::state<float> of the same plan. It remembers its plan
// (its linear form: compile(e) and compile<order::linear>(e) share states),
// batch and heads; the other extents are fixed by its first evaluation, which
// sizes it and zeroes it. A state of another plan is a state_error, another
// batch, head count or D or M a shape_error, all before any launch.
//
// The sums live in host memory (memory::host: for emulate_into, the host
// emulation) or device memory (memory::device, the default: for
// evaluate_into), chosen when it is made; to_host / to_device copy a state
// between the two. Move-only. A chained kernel reads the sums from one buffer
// and writes them to a second (a block may store its final z while another
// block of the same (batch, head) has still to load the initial one); the
// state then points at the buffer written, so it holds twice its sums.
class state : public state_info {
 public:
  explicit state(memory where = memory::device) : where_(where) {}
  template <class Plan>
    requires is_node<Plan>
  state(Plan const& plan, std::size_t batch, std::size_t heads, memory where = memory::device)
      : state_info(longest_branch(plan), batch, heads), where_(where) {}
  state(state&&) noexcept = default;
  state& operator=(state&&) noexcept = default;
  state(state const&) = delete;
  state& operator=(state const&) = delete;
  ~state() = default;

  memory where() const noexcept { return where_; }
  // [B, H, C, W] once sized, [B, H, 0, 0] before.
  shape4 shape() const {
    return {batch(), heads(), sized() ? scan(0).a : 0, sized() ? scan(0).b : 0};
  }
  std::size_t size() const {
    shape4 s = shape();
    return s[0] * s[1] * s[2] * s[3];
  }

  // A stacked plan's state (evaluate and emulate with a state): one state per
  // layer, in the order the layers run, the lowest first — layer k's sums are
  // scan k of the CPU's state of the same stack when its layers form a chain.
  // Empty for a single layer's state.
  std::size_t layers() const noexcept { return layers_.size(); }
  state& layer(std::size_t k) { return layers_.at(k); }
  state const& layer(std::size_t k) const { return layers_.at(k); }

  // A host state's sums, [B, H, C, W] (write to them to start from given sums).
  tensor_view<float> sums() {
    if (!layers_.empty())
      throw std::invalid_argument("lina::cuda::state::sums: this is a stacked plan's state, one state per layer: "
                                  "read layer(k).sums()");
    if (where_ != memory::host)
      throw std::invalid_argument(
          "lina::cuda::state::sums: the state is in device memory; copy it to the host with cuda::to_host");
    return {host_[current_].data(), shape()};
  }
  tensor_view<float const> sums() const { return const_cast<state*>(this)->sums(); }
  // The current sums' first element, in host or device memory as where() says.
  float const* data() const noexcept {
    return where_ == memory::host ? host_[current_].data() : static_cast<float const*>(device_[current_].get());
  }

  // Zero the sums (a device state's on `stream`), as if no token had been seen.
  void reset(void* stream = nullptr) {
    for (state& l : layers_) l.reset(stream);
    if (!sized()) return;
    if (where_ == memory::host)
      std::fill(host_[current_].begin(), host_[current_].end(), 0.0f);
    else
      fill_zero(device_[current_].get(), size() * sizeof(float), stream, "cuda::state::reset");
  }

  // A copy in host or device memory (what to_host and to_device do).
  state copy_to(memory where, void* stream, std::string const& call) const {
    if (where == memory::device || where_ == memory::device) require_device(call);
    state r(where);
    static_cast<state_info&>(r) = *this;
    for (state const& l : layers_) r.layers_.push_back(l.copy_to(where, stream, call));
    std::size_t const n = size(), bytes = n * sizeof(float);
    if (!sized()) return r;
    if (where == memory::host) {
      r.host_[0].resize(n);
      r.host_[1].resize(n);
      if (where_ == memory::host) {
        r.host_[0] = host_[current_];
      } else {
        copy_to_host(r.host_[0].data(), device_[current_].get(), bytes, stream, call);
        synchronize_stream(stream, call);
      }
    } else {
      r.device_[0] = device_buffer(bytes, call);
      r.device_[1] = device_buffer(bytes, call);
      if (where_ == memory::host) {
        copy_to_device(r.device_[0].get(), host_[current_].data(), bytes, stream, call);
        synchronize_stream(stream, call);
      } else {
        copy_on_device(r.device_[0].get(), device_[current_].get(), bytes, stream, call);
      }
    }
    return r;
  }

  // For the entry points below: check this state against an evaluation of the
  // linear plan L (state_info::prepare: its plan, batch, heads, and the extents
  // its first evaluation fixed) and size it at the first — zeroed, a device
  // state on `stream`. Nothing changes when a check or an allocation throws.
  template <class L, class Bound>
  void prepare(L const& linear, Bound const& in, void* stream, std::string const& call) {
    prepare(linear, in, stream, call, in.batch, "B (batch)");
  }
  // The same for `count` rows named `count_label` in errors (packed
  // sequences: one row per sequence, lina/sequences.hpp).
  template <class L, class Bound>
  void prepare(L const& linear, Bound const& in, void* stream, std::string const& call, std::size_t count,
               char const* count_label) {
    if (sized()) {  // checks only (and no copy: a decode step allocates nothing)
      state_info::prepare(linear, in, count, count_label);
      return;
    }
    state_info info = *this;
    if (info.prepare(linear, in, count, count_label)) {
      std::size_t const n = count * in.heads * info.scan(0).a * info.scan(0).b;
      if (where_ == memory::host) {
        std::vector<float> a(n, 0.0f), b(n, 0.0f);
        host_[0] = std::move(a);
        host_[1] = std::move(b);
      } else {
        device_buffer a(n * sizeof(float), call), b(n * sizeof(float), call);
        fill_zero(a.get(), n * sizeof(float), stream, call);
        device_[0] = std::move(a);
        device_[1] = std::move(b);
      }
      current_ = 0;
    }
    static_cast<state_info&>(*this) = std::move(info);
  }
  // The sums a kernel reads (state_in) and the buffer it writes (state_out),
  // from batch row `first` on (a packed sequence's launch, a batch of one,
  // reads and writes its own row); once every row is written, flip() makes
  // the written buffer current.
  operand kernel_in(std::size_t first = 0) const { return operand_of_buffer(current_, first); }
  operand kernel_out(std::size_t first = 0) const { return operand_of_buffer(current_ ^ 1, first); }
  void flip() noexcept { current_ ^= 1; }

  // For a stacked plan's entry points (the linear stack L, `count` layers):
  // give an unbound state the stack and a state per layer, or check that it
  // has them; the layers' own checks come as each runs. run(layers) runs the
  // stack on them; should it throw, every layer is as it was before (a layer
  // that ran flips back: its kernel wrote the other buffer), and a state bound
  // by this call is unbound again.
  template <class L, class Run>
  void run_stacked(L const& linear, std::size_t batch, std::size_t heads, std::size_t count, Run const& run) {
    bool const fresh = unbound();
    if (fresh) {
      static_cast<state_info&>(*this) = state_info(linear, batch, heads);
      layers_.clear();
      for (std::size_t k = 0; k < count; ++k) layers_.emplace_back(where_);
    } else if (!belongs_to(typeid(L)) || layers_.size() != count) {
      throw state_error("this state belongs to the plan " + plan() + ", not to " + to_string(linear));
    }
    std::vector<int> before;  // each layer's buffer, -1 where it was not sized yet
    for (state const& l : layers_) before.push_back(l.sized() ? l.current_ : -1);
    try {
      run(layers_.data());
    } catch (...) {
      for (std::size_t k = 0; k < layers_.size(); ++k)
        if (before[k] < 0)
          layers_[k] = state(where_);
        else
          layers_[k].current_ = before[k];
      if (fresh) *this = state(where_);
      throw;
    }
  }

 private:
  operand operand_of_buffer(int k, std::size_t first) const {
    operand o;
    float const* base = where_ == memory::host ? host_[k].data() : static_cast<float const*>(device_[k].get());
    strides4 const st = tensor_view<float>::contiguous_strides(shape());
    o.data = base + first * static_cast<std::size_t>(st[0]);
    for (int i = 0; i < 4; ++i) o.stride[i] = st[static_cast<std::size_t>(i)];
    o.cols = static_cast<std::int64_t>(shape()[3]);
    return o;
  }

  memory where_ = memory::device;
  int current_ = 0;
  std::vector<float> host_[2];
  device_buffer device_[2];
  std::vector<state> layers_;  // a stacked plan's: one per layer
};

// Copies of a state in host and device memory (same plan, batch, heads and
// sums). Either needs a device when one end is device memory; they return
// once the copy is done, except device to device (queued on `stream`).
inline state to_host(state const& s, void* stream = nullptr) { return s.copy_to(memory::host, stream, "cuda::to_host"); }
inline state to_device(state const& s, void* stream = nullptr) {
  return s.copy_to(memory::device, stream, "cuda::to_device");
}

namespace detail {
// A state where `call` needs it: host memory for the emulation, device memory for a launch.
inline void require_state_in(state const& st, memory where, char const* call) {
  if (st.where() == where) return;
  if (where == memory::host)
    throw std::invalid_argument(std::string("lina::") + call +
                                ": the state is in device memory, and the emulation runs on the host: make it with "
                                "cuda::memory::host, or copy it with cuda::to_host");
  throw std::invalid_argument(std::string("lina::") + call +
                              ": the state is in host memory, and a kernel reads device memory: make it with "
                              "cuda::memory::device (the default), or copy it with cuda::to_device");
}
}  // namespace detail

namespace diagnose {
template <bool Device>
struct device_bindings {
  static_assert(Device,
                "lina::cuda::evaluate: bind device memory (cuda::tensor, cuda::device_view); copy host tensors to "
                "the device with cuda::to_device, or run the host emulation with cuda::emulate");
  static constexpr bool ok = Device;
};
}  // namespace diagnose

// ---- the host emulation ---------------------------------------------------------------------
namespace detail {
// A float view as the kernel's operand: in place for fp32, else a dense copy
// rounded to the 16-bit type (kept alive in `store`).
inline operand operand_of(tensor_view<float const> const& v, dtype t, std::vector<std::uint16_t>& store) {
  operand o;
  o.cols = static_cast<std::int64_t>(v.shape()[3]);
  if (t == dtype::f32) {
    o.data = v.data();
    for (int i = 0; i < 4; ++i) o.stride[i] = v.strides()[static_cast<std::size_t>(i)];
    return o;
  }
  auto const& s = v.shape();
  store.resize(s[0] * s[1] * s[2] * s[3]);
  std::size_t x = 0;  // (dense, as for_each_index goes)
  for_each_index(s, [&](auto... i) { store[x++] = t == dtype::bf16 ? bf16_bits(v(i...)) : f16_bits(v(i...)); });
  auto dense = tensor_view<float const>::contiguous_strides(s);
  o.data = store.data();
  for (int i = 0; i < 4; ++i) o.stride[i] = dense[static_cast<std::size_t>(i)];
  return o;
}

// A dense row-major [B, H, N, cols] operand over `data` (strides in elements).
inline operand dense_operand(void const* data, shape4 const& s) {
  operand o;
  o.data = data;
  auto const st = tensor_view<float>::contiguous_strides(s);
  for (int i = 0; i < 4; ++i) o.stride[i] = static_cast<std::int64_t>(st[static_cast<std::size_t>(i)]);
  o.cols = static_cast<std::int64_t>(s[3]);
  return o;
}
// The options of a launch on device memory: the operands' element types (T
// in, O out) and the caller's schedule.
template <class T, class O>
options device_options(tile_request tiles) {
  return {.in = dtype_of<std::remove_const_t<T>>, .out = dtype_of<std::remove_const_t<O>>, .tiles = tiles};
}
// The spec of plan at the bound extents and element types.
template <class Plan, class Bound>
attention_spec bound_spec(Plan const& plan, options opt, Bound const& in) {
  using F = forward_plan<Plan>;
  attention_spec s = spec_of(plan, opt);
  if constexpr (F::ok) {
    s.d = static_cast<std::size_t>(F::q::input::cols::extent(in.table));
    s.m = static_cast<std::size_t>(F::v::input::cols::extent(in.table));
    if constexpr (!std::is_void_v<typename F::q::param>)
      s.f = static_cast<std::size_t>(F::q::param::cols::extent(in.table));
  }
  return s;
}

// What a launch runs with beyond its plan and operands: the state it chains
// (its batch rows from `row` on; the caller flips it once every row is
// written), whether it is a decoding step (cuda::recurrent: the step-sized
// kernel, T = 16), and packed sequences it runs all at once (the operands
// bound as one batch row; a packable program: one block per sequence, head
// and M tile, and the state's row s is sequence s's).
struct run_with {
  state const* st = nullptr;
  std::size_t row = 0;
  bool step = false;
  sequences const* packed = nullptr;
};
// The packed sequences' part of a launch's arguments (row_offsets: the caller's).
inline void pack(forward_args& a, sequences const& seqs, std::int64_t const* row_offsets) {
  a.batch = static_cast<std::int64_t>(seqs.count());
  a.n_keys = -1;  // (K and V are cut as Q is)
  a.row_offsets = row_offsets;
}
// The offsets of packed sequences as a kernel reads them (size_t and int64_t: one size).
inline std::int64_t const* offsets_of(sequences const& seqs) {
  static_assert(sizeof(std::size_t) == sizeof(std::int64_t));
  return reinterpret_cast<std::int64_t const*>(seqs.offsets().data());
}

// Packed sequences' offsets in device memory, for launches on `stream` (and
// freed in stream order after them).
inline device_buffer device_offsets(sequences const& seqs, void* stream, char const* call) {
  std::size_t const bytes = seqs.offsets().size() * sizeof(std::int64_t);
  device_buffer offsets(bytes, stream, call);
  copy_to_device(offsets.get(), offsets_of(seqs), bytes, stream, call);
  return offsets;
}

// The emulated kernel of `plan` (checked: lowerable) on bound host inputs,
// into `out` (its shape already checked), run as `w` says.
template <class Plan, class Bound>
void emulate_bound(Plan const& plan, options opt, tensor_view<float> out, Bound const& in, run_with w = {}) {
  static_assert(std::is_same_v<typename Bound::value_type, float>,
                "lina::cuda::emulate: bind float tensors (the kernels read fp32, fp16 or bf16; see options)");
  using F = forward_plan<Plan>;
  if constexpr (F::ok) {
    shape4 const want = out.shape();
    attention_spec s = bound_spec(plan, opt, in);
    s.chained = w.st != nullptr;
    s.step = w.step;
    program p = program_of(s);
    std::vector<std::uint16_t> stores[max_inputs];
    forward_args a;
    a.in[0] = operand_of(in.views[Bound::template input_index<typename F::q::input>()], opt.in, stores[0]);
    a.in[1] = operand_of(in.views[Bound::template input_index<typename F::k::input>()], opt.in, stores[1]);
    a.in[2] = operand_of(in.views[Bound::template input_index<typename F::v::input>()], opt.in, stores[2]);
    if constexpr (!std::is_void_v<typename F::q::param>)  // W
      a.in[3] = operand_of(in.views[Bound::template input_index<typename F::q::param>()], opt.in, stores[3]);
    if constexpr (F::own_k_w)  // φ(K)'s W
      a.in[4] = operand_of(in.views[Bound::template input_index<typename F::k::param>()], opt.in, stores[4]);
    a.batch = static_cast<std::int64_t>(in.batch);
    a.heads = static_cast<std::int64_t>(in.heads);
    a.n = static_cast<std::int64_t>(F::q::input::rows::extent(in.table));
    a.n_keys = static_cast<std::int64_t>(F::k::input::rows::extent(in.table));
    std::vector<std::uint16_t> result;
    auto const dense = tensor_view<float>::contiguous_strides(want);
    if (opt.out == dtype::f32) {
      a.out.data = out.data();
      for (int i = 0; i < 4; ++i) a.out.stride[i] = out.strides()[static_cast<std::size_t>(i)];
    } else {
      result.resize(want[0] * want[1] * want[2] * want[3]);
      a.out.data = result.data();
      for (int i = 0; i < 4; ++i) a.out.stride[i] = dense[static_cast<std::size_t>(i)];
    }
    a.out.cols = static_cast<std::int64_t>(s.m);
    if (w.st) {
      a.state_in = w.st->kernel_in(w.row);
      a.state_out = w.st->kernel_out(w.row);
    }
    if (w.packed) pack(a, *w.packed, offsets_of(*w.packed));
    // The chunk-parallel form: partials, then the scan (N = 0 has no group to
    // store a state; without keys there are no sums to split). Groups of
    // options::split_rows rows, else as the schedule asks (tile_request::groups).
    std::int64_t const rows =
        opt.split_rows > 0 ? opt.split_rows : split_rows(opt.tiles, blocks_of(p, a), a.n, p.tiles.chunk, 0);
    if (rows > 0 && a.n > 0 && keys_of(a) > 0 && splits(s) && !w.step && !w.packed) {
      split_programs const sp = split_programs_of(s);
      a.group_rows = rows;
      std::int64_t const groups = groups_of(sp.partials, a);
      std::int64_t const c = static_cast<std::int64_t>(features(s.map_q, s.d, s.f)), w = static_cast<std::int64_t>(s.m) + s.normalized;
      std::vector<float> partials(static_cast<std::size_t>(a.batch * a.heads * groups * c * w));
      a.extra[0] = dense_operand(partials.data(), {in.batch, in.heads, static_cast<std::size_t>(groups * c),
                                                   static_cast<std::size_t>(w)});
      emulate(sp.partials, a);
      emulate(sp.scan, a);
    } else {
      emulate(p, a);
    }
    if (opt.out != dtype::f32) {
      std::size_t x = 0;  // (the dense buffer: the last index fastest, as for_each_index goes)
      for_each_index(want, [&](auto... i) {
        out(i...) = opt.out == dtype::bf16 ? from_bf16_bits(result[x]) : from_f16_bits(result[x]);
        ++x;
      });
    }
  }
}

// ---- stacked layers: one kernel per layer ----
// Does N contain the subtree type S?
template <class S, class N>
constexpr bool contains_subtree() {
  if constexpr (std::is_same_v<S, N>)
    return true;
  else
    return []<std::size_t... K>(std::index_sequence<K...>) {
      return (contains_subtree<S, std::remove_cvref_t<decltype(kid<K>(std::declval<N const&>()))>>() || ...);
    }(std::make_index_sequence<N::arity>{});
}
// The first subtree of type S in n (its values: eps, scale factors).
template <class S, class N>
constexpr S const& subtree(N const& n) {
  if constexpr (std::is_same_v<S, N>) {
    return n;
  } else {
    constexpr std::size_t k = []<std::size_t... K>(std::index_sequence<K...>) {
      std::size_t r = 0;
      ((contains_subtree<S, std::remove_cvref_t<decltype(kid<K>(std::declval<N const&>()))>>() && r == 0 ? (r = K + 1) : 0), ...);
      return r - 1;
    }(std::make_index_sequence<N::arity>{});
    return subtree<S>(kid<k>(n));
  }
}
// n with every subtree of type S replaced by `by`.
template <class S, class By, class N>
constexpr auto replace_subtree(N const& n, By const& by) {
  if constexpr (std::is_same_v<S, N>)
    return by;
  else if constexpr (N::arity == 0)
    return n;
  else
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return make_node(n.op, replace_subtree<S>(kid<K>(n), by)...);
    }(std::make_index_sequence<N::arity>{});
}
// f(the bindings of Plan's inputs among b...): a layer binds only its own.
template <class Plan, class F, class... B>
decltype(auto) with_inputs_of(F&& f, B const&... b) {
  using inputs = inputs_of<Plan>;
  auto kept = std::tuple_cat([&] {
    if constexpr (lina::detail::names_an_input<B::name, inputs>::value)
      return std::tuple<B const&>(b);
    else
      return std::tuple<>();
  }()...);
  return std::apply(std::forward<F>(f), kept);
}
// A stacked plan, one layer at a time: run(layer, its bindings...) evaluates
// the first layer below `plan` into an intermediate, then next(the plan with
// that layer replaced by its input symbol, its bindings: symbol = result and
// those of bindings... it still reads).
template <class Plan, class Run, class Next, class... B>
void through_layers(Plan const& plan, Run&& run, Next&& next, B const&... bindings) {
  using layer = typename forward_plan<Plan>::layer;
  using Sub = typename layer::sub;
  auto const& sub = subtree<Sub>(plan);
  auto mid = with_inputs_of<Sub>([&](auto const&... b) { return run(sub, b...); }, bindings...);
  constexpr auto symbol = node<typename layer::input>{};
  auto const rest = replace_subtree<Sub>(plan, symbol);
  auto const result = symbol = mid;
  with_inputs_of<std::remove_cvref_t<decltype(rest)>>([&](auto const&... b) { next(rest, b...); }, bindings..., result);
}
// A stacked plan's first layer (through_layers runs it first), and the plan
// through_layers runs after it: that layer replaced by its input symbol.
template <class Plan>
using first_layer = typename forward_plan<Plan>::layer::sub;
template <class Plan>
using rest_of = std::remove_cvref_t<decltype(replace_subtree<first_layer<Plan>>(
    std::declval<Plan const&>(), node<typename forward_plan<Plan>::layer::input>{}))>;
// The layers of a (select-free) plan, as through_layers runs them: 1 unless stacked.
template <class Plan>
constexpr std::size_t layer_count() {
  if constexpr (!forward_plan<Plan>::stacked)
    return 1;
  else
    return layer_count<first_layer<Plan>>() + layer_count<rest_of<Plan>>();
}
// Can a state chain the linear form L? A plan without a running state is
// diagnosed as on the CPU (lina/state.hpp), one the backend cannot lower by
// the message of spec_of; a stack's layers each as a plan alone.
template <class L>
constexpr bool chainable() {
  if constexpr (forward_plan<L>::stacked) {
    return chainable<first_layer<L>>() && chainable<rest_of<L>>();
  } else {
    constexpr bool stateful = check_stateful<L>();
    if constexpr (stateful)
      return diagnose::cuda_plan<forward_plan<L>::ok>::ok;
    else
      return false;
  }
}
// A stack chained through one state per layer (layers[0] the lowest's, in
// through_layers' order): each layer by one(layer, its state, out, its
// bindings...), its result in alloc(layer, its bindings...) (a tensor) below
// the top, which writes `out`.
template <class Plan, class Alloc, class One, class Out, class... B>
void run_stack(Plan const& plan, state* layers, Alloc const& alloc, One const& one, Out out, B const&... bindings) {
  if constexpr (!forward_plan<Plan>::stacked) {
    one(plan, *layers, out, bindings...);
  } else {
    constexpr std::size_t below = layer_count<first_layer<Plan>>();
    through_layers(
        plan,
        [&](auto const& sub, auto const&... b) {
          auto mid = alloc(sub, b...);
          run_stack(sub, layers, alloc, one, mid.view(), b...);
          return mid;
        },
        [&](auto const& rest, auto const&... b) { run_stack(rest, layers + below, alloc, one, out, b...); }, bindings...);
  }
}
// A layer's result below the top of a chained stack: a host tensor for the
// emulation, a device tensor of the inputs' type T on the GPU.
struct host_rows {
  template <class P, class... B>
  lina::tensor<float> operator()(P const&, B const&... b) const {
    return lina::tensor<float>(result_shape<P>(bind<P>(b...)));
  }
};
template <class T>
struct device_rows {
  template <class P, class... B>
  tensor<T> operator()(P const&, B const&... b) const {
    return tensor<T>(result_shape<P>(bind<P>(b...)), "cuda::evaluate_into");
  }
};
// The stack (linear, stacked) chained through st for `count` state rows (the
// batch, or the packed sequences): run_stacked's checks and undo around run_stack.
template <class L, class Alloc, class One, class Out, class... B>
void chain_stack(state& st, L const& linear, std::size_t count, std::size_t heads, Alloc const& alloc, One const& one,
                 Out out, B const&... bindings) {
  st.run_stacked(linear, count, heads, layer_count<L>(),
                 [&](state* layers) { run_stack(linear, layers, alloc, one, out, bindings...); });
}
// An output that may share memory with an input, or that reaches one of its
// elements twice, is refused before anything runs: the kernel's blocks read
// inputs while others write the output, in no order (cpu::evaluate_into
// computes the first case through a copy instead; on the device that would
// be an allocation and a copy the caller can make). `what` names the output.
template <class Out, class Bound>
void refuse_shared_memory(Out const& out, Bound const& in, std::string const& what, char const* call) {
  if (lina::detail::overlaps_itself(out))
    throw alias_error(std::string(call) + ": " + what + " " + lina::detail::layout_text(out) +
                      " reaches some of its elements twice: give each element memory of its own");
  auto one = [&]<class In>() {
    if (lina::detail::may_share_memory(out, in.views[Bound::template input_index<In>()]))
      throw alias_error(std::string(call) + ": " + what + " may share memory with input " +
                        std::string(In::name.view()) + ", which its kernel reads while it writes: give " + what +
                        " memory of its own");
  };
  [&]<class... In>(lina::detail::type_list<In...>) { (one.template operator()<In>(), ...); }(typename Bound::inputs{});
}
}  // namespace detail

// Evaluate `plan` through the host emulation of its generated kernel into
// `out` (any strided layout, e.g. a [B,N,H,M] view):
// emulate_into(plan, {.in = dtype::bf16, .out = dtype::bf16}, out, Q = q, K = k, V = v).
// Bound tensors are float (any strided layout), read as if stored in opt.in;
// the result is rounded to opt.out. An fp32 output is written by the
// emulated kernel through out's strides; a 16-bit one goes through a dense
// buffer of bit patterns, as a caller without 16-bit host types would.
// A stacked plan (a layer's operand is another layer's attention) runs one
// kernel per layer, the lower layer first, its result rounded to opt.out and
// read by the next as opt.in.
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_into(Plan const& plan, options opt, tensor_view<float> out, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  check_result_shape<Plan>(out.shape(), in);
  detail::refuse_shared_memory(out, in, "the output", "cuda::emulate_into");
  if constexpr (detail::forward_plan<Plan>::stacked)
    detail::through_layers(
        plan, [&](auto const& layer, auto const&... b) { return emulate(layer, opt, b...); },
        [&](auto const& rest, auto const&... b) { emulate_into(rest, opt, out, b...); }, bindings...);
  else
    detail::emulate_bound(plan, opt, out, in);
}

// The same, chained: the kernel's scan starts from the sums in `st` (a host
// state, cuda::memory::host) and leaves them updated, so consecutive blocks of
// tokens give what one evaluation of all of them gives. Only causal plans
// carry a state (a non-causal one is a compile error, as on the CPU); the
// plan runs as its linear form (every select at its long-sequence branch).
// A stacked plan chains each layer through a state of its own (state::layer).
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_into(Plan const& plan, options opt, tensor_view<float> out, state& st, B const&... bindings) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  auto in = bind<L>(bindings...);
  check_result_shape<L>(out.shape(), in);
  detail::refuse_shared_memory(out, in, "the output", "cuda::emulate_into");
  detail::require_state_in(st, memory::host, "cuda::emulate_into");
  if constexpr (detail::forward_plan<L>::stacked) {
    auto one = [&](auto const& layer, state& s, tensor_view<float> o, auto const&... b) { emulate_into(layer, opt, o, s, b...); };
    detail::chain_stack(st, linear, in.batch, in.heads, detail::host_rows{}, one, out, bindings...);
  } else if constexpr (detail::chainable<L>()) {
    st.prepare(linear, in, nullptr, "cuda::emulate_into");
    detail::emulate_bound(linear, opt, out, in, {.st = &st});
    st.flip();
  }
}

// The same into a new float tensor [B, H, N, M].
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
lina::tensor<float> emulate(Plan const& plan, options opt, B const&... bindings) {
  auto in = bind<Plan>(bindings...);  // (checked again by emulate_into; this sizes the result)
  lina::tensor<float> out(result_shape<Plan>(in));
  emulate_into(plan, opt, out.view(), bindings...);
  return out;
}
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
lina::tensor<float> emulate(Plan const& plan, B const&... bindings) {
  return emulate(plan, options{}, bindings...);
}
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
lina::tensor<float> emulate(Plan const& plan, options opt, state& st, B const&... bindings) {
  auto in = bind<decltype(longest_branch(plan))>(bindings...);
  lina::tensor<float> out(result_shape<decltype(longest_branch(plan))>(in));
  emulate_into(plan, opt, out.view(), st, bindings...);
  return out;
}

// ---- on the GPU -------------------------------------------------------------------------------
namespace detail {
template <class View>
operand device_operand(View const& v) {
  operand o;
  o.data = v.data();
  for (int i = 0; i < 4; ++i) o.stride[i] = v.strides()[static_cast<std::size_t>(i)];
  o.cols = static_cast<std::int64_t>(v.shape()[3]);
  return o;
}

// to += from on `stream` (add_program's kernel): the gradient of an input that
// two layers of a stack share, or a packed sequence's gradient put in place.
template <class T>
void add_into(device_view<T> to, device_view<T const> from, void* stream) {
  shape4 const sh = to.shape();
  forward_args a;
  a.in[0] = device_operand(from);
  a.out = device_operand(to);
  a.batch = static_cast<std::int64_t>(sh[0]), a.heads = static_cast<std::int64_t>(sh[1]);
  a.n = static_cast<std::int64_t>(sh[2]);
  if (sh[3] > 0) launch(add_program(dtype_of<T>, sh[3]), a, stream);
}
template <class T>
void add_into(tensor<T>& to, tensor<T> const& from, void* stream) {
  add_into(to.view(), from.view(), stream);
}
// to += from as add_into's kernel computes it (the elements as type t reads them,
// the sums rounded to t), emulated on host floats.
inline void emulate_add(lina::tensor_view<float> to, lina::tensor_view<float const> from, dtype t) {
  shape4 const sh = to.shape();
  if (sh[0] * sh[1] * sh[2] * sh[3] == 0) return;
  forward_args a;
  a.batch = static_cast<std::int64_t>(sh[0]), a.heads = static_cast<std::int64_t>(sh[1]);
  a.n = static_cast<std::int64_t>(sh[2]);
  std::vector<std::uint16_t> x, sum;  // (16-bit: both as the kernel reads them, dense)
  a.in[0] = operand_of(from, t, x);
  a.out = operand_of(to, t, sum);
  emulate(add_program(t, sh[3]), a);
  if (t == dtype::f32) return;
  std::size_t i = 0;
  for_each_index(sh, [&](auto... j) { to(j...) = t == dtype::bf16 ? from_bf16_bits(sum[i]) : from_f16_bits(sum[i]), ++i; });
}

// The launch of `plan`'s kernel on bound device inputs into `out` (shape
// checked), chained through `st` when given (checked and sized).
// The kernel arguments of a lowerable plan F on bound device inputs, into `out`.
// W (and φ(K)'s own) go to w_slot (and the next): 3 in a forward, 4 in a backward.
template <class F, class O, class Bound>
forward_args device_args(device_view<O> out, Bound const& in, int w_slot = 3) {
  forward_args a;
  a.in[0] = device_operand(in.views[Bound::template input_index<typename F::q::input>()]);
  a.in[1] = device_operand(in.views[Bound::template input_index<typename F::k::input>()]);
  a.in[2] = device_operand(in.views[Bound::template input_index<typename F::v::input>()]);
  if constexpr (!std::is_void_v<typename F::q::param>)  // W
    a.in[w_slot] = device_operand(in.views[Bound::template input_index<typename F::q::param>()]);
  if constexpr (F::own_k_w)  // φ(K)'s W
    a.in[w_slot + 1] = device_operand(in.views[Bound::template input_index<typename F::k::param>()]);
  a.out = device_operand(out);
  a.batch = static_cast<std::int64_t>(in.batch);
  a.heads = static_cast<std::int64_t>(in.heads);
  a.n = static_cast<std::int64_t>(F::q::input::rows::extent(in.table));
  a.n_keys = static_cast<std::int64_t>(F::k::input::rows::extent(in.table));
  return a;
}

// The kernel of `plan` launched on bound device inputs into `out`, run as `w`
// says (a step is cuda::recurrent's own launch).
template <class Plan, class O, class Bound>
void launch_bound(Plan const& plan, device_view<O> out, Bound const& in, void* stream, tile_request tiles,
                  char const* call, run_with w = {}) {
  static_assert(diagnose::device_bindings<is_device_view<typename Bound::view_type>>::ok || true);
  using F = forward_plan<Plan>;
  using T = typename Bound::value_type;
  if constexpr (F::ok && is_device_view<typename Bound::view_type>) {
    attention_spec s = bound_spec(plan, device_options<T, O>(tiles), in);
    s.chained = w.st != nullptr;
    forward_args a = device_args<F>(out, in);
    program const p = program_of(s);
    device_status const dev = require_device(call);
    if (w.st) {
      a.state_in = w.st->kernel_in(w.row);
      a.state_out = w.st->kernel_out(w.row);
    }
    if (w.packed) {
      device_buffer const offsets = device_offsets(*w.packed, stream, call);
      pack(a, *w.packed, static_cast<std::int64_t const*>(offsets.get()));
      launch(p, a, stream);
      return;
    }
    std::int64_t const rows = splits(s) && keys_of(a) > 0 ? split_rows(tiles, blocks_of(p, a), a.n, p.tiles.chunk, dev.sms) : 0;
    if (rows > 0)  // too few (batch, head, M tile) blocks for the device: split N too
      launch_split(split_programs_of(s), a, rows, stream);
    else
      launch(p, a, stream);
  }
}
}  // namespace detail

// Evaluate `plan` on the GPU into `out` (device memory of any layout), on
// `stream` (a cudaStream_t, nullptr for the default stream). Asynchronous
// like any launch; errors found before the launch (shapes, host pointers, no
// device: cuda_error naming cuda::evaluate_into) throw without writing to `out`.
// Every form below also takes a schedule of the caller's after the stream
// (`evaluate_into(plan, out, stream, cuda::tile_request{32, 128}, Q = …)`:
// options::tiles, checked as there); without one, lina's choice.
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, void* stream, tile_request tiles, B const&... bindings) {
  static_assert(!std::is_const_v<O>, "lina::cuda::evaluate_into: the output view must be writable");
  check_tile_request(tiles);
  auto in = bind<Plan>(bindings...);
  check_result_shape<Plan>(out.shape(), in);
  detail::refuse_shared_memory(out, in, "the output", "cuda::evaluate_into");
  if constexpr (detail::forward_plan<Plan>::stacked) {  // one launch per layer; the intermediates die with the call
    using T = std::remove_const_t<typename decltype(in)::value_type>;
    detail::through_layers(
        plan, [&](auto const& layer, auto const&... b) { return evaluate<T>(layer, stream, tiles, b...); },
        [&](auto const& rest, auto const&... b) { evaluate_into(rest, out, stream, tiles, b...); }, bindings...);
    synchronize_stream(stream, "cuda::evaluate_into");
  } else {
    detail::launch_bound(plan, out, in, stream, tiles, "cuda::evaluate_into");
  }
}
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, void* stream, B const&... bindings) {
  evaluate_into(plan, out, stream, tile_request{}, bindings...);
}

// The same, chained through a device state (memory::device): the kernel loads
// st's sums, scans from them and leaves them updated; later launches on the
// same stream see them. The state is checked (plan, batch, heads, extents)
// and sized at its first use before anything is launched.
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, state& st, void* stream, tile_request tiles, B const&... bindings) {
  static_assert(!std::is_const_v<O>, "lina::cuda::evaluate_into: the output view must be writable");
  check_tile_request(tiles);
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  auto in = bind<L>(bindings...);
  check_result_shape<L>(out.shape(), in);
  detail::refuse_shared_memory(out, in, "the output", "cuda::evaluate_into");
  detail::require_state_in(st, memory::device, "cuda::evaluate_into");
  if constexpr (detail::forward_plan<L>::stacked) {  // a state per layer; the intermediates die with the call
    using T = std::remove_const_t<typename decltype(in)::value_type>;
    auto one = [&](auto const& layer, state& s, auto o, auto const&... b) { evaluate_into(layer, o, s, stream, tiles, b...); };
    detail::chain_stack(st, linear, in.batch, in.heads, detail::device_rows<T>{}, one, out, bindings...);
    synchronize_stream(stream, "cuda::evaluate_into");
  } else if constexpr (detail::chainable<L>()) {
    st.prepare(linear, in, stream, "cuda::evaluate_into");
    detail::launch_bound(linear, out, in, stream, tiles, "cuda::evaluate_into", {.st = &st});
    st.flip();
  }
}
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, state& st, void* stream, B const&... bindings) {
  evaluate_into(plan, out, st, stream, tile_request{}, bindings...);
}

namespace detail {
// A new device tensor for the result of plan P on these device bindings, of
// element type Out (void: the inputs'). Needs a device.
template <class Out, class P, class... B>
auto new_result(B const&... bindings) {
  auto in = bind<P>(bindings...);
  static_assert(diagnose::device_bindings<is_device_view<typename decltype(in)::view_type>>::ok || true);
  using O = std::conditional_t<std::is_void_v<Out>, typename decltype(in)::value_type, Out>;
  require_device("cuda::evaluate");
  return tensor<O>(result_shape<P>(in), "cuda::evaluate");
}
}  // namespace detail

// evaluate(plan, stream, Q = dq, K = dk, V = dv): a new device tensor [B, H,
// N, M] of element type Out (by default that of the inputs), written by a
// launch on `stream` (asynchronous; to_host on the same stream waits for it).
// Needs a device: without one, cuda_error naming cuda::evaluate.
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, void* stream, tile_request tiles, B const&... bindings) {
  check_tile_request(tiles);
  auto out = detail::new_result<Out, Plan>(bindings...);
  evaluate_into(plan, out.view(), stream, tiles, bindings...);
  return out;
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, void* stream, B const&... bindings) {
  return evaluate<Out>(plan, stream, tile_request{}, bindings...);
}
// The same, chained through a device state.
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, state& st, void* stream, tile_request tiles, B const&... bindings) {
  check_tile_request(tiles);
  auto out = detail::new_result<Out, decltype(longest_branch(plan))>(bindings...);
  evaluate_into(plan, out.view(), st, stream, tiles, bindings...);
  return out;
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, state& st, void* stream, B const&... bindings) {
  return evaluate<Out>(plan, st, stream, tile_request{}, bindings...);
}

// ---- packed sequences (lina/sequences.hpp) -----------------------------------------------
// emulate_into(plan, opts, out, seqs, Q = q, …), emulate(plan, opts, seqs, …), and on
// the device evaluate_into(plan, out, stream, [tiles,] seqs, …), evaluate(plan,
// stream, [tiles,] seqs, …): sequences of different lengths laid end to end in
// one batch row ([1, H, ΣN, D]), each evaluated as it would be alone in a batch
// of one. Where the plan's program is packable (one block per sequence, head and
// M tile: linear plans whose K and V are cut as Q is) and the pack has the
// blocks to fill the device, one launch runs them all: its kernel reads the
// offsets (forward_args::row_offsets), as flash-linear-attention's cu_seqlens
// kernels do. Otherwise (quadratic plans, cross-attention, stacks, a few long
// sequences that would leave SMs idle) each sequence is launched alone, a long
// one split along N.
// Chained through a state (emulate_into(plan, opts, out, st, seqs, …),
// evaluate_into(plan, out, st, stream, [tiles,] seqs, …)): the state holds one
// row per sequence ([S, H, C, W]: chunked prefill of S sequences of different
// lengths, as cpu::evaluate_into with a state and sequences); each sequence
// reads and writes its row, and the state flips once after all.
namespace detail {
// The checks of a packed evaluation into `out`; the bound inputs.
template <class Plan, class Out, class... B>
auto check_sequences(Out const& out, char const* call, sequences const& seqs, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  check_packed<packed_dim<Plan>>(in, seqs);
  check_result_shape<Plan>(out.shape(), in);
  refuse_shared_memory(out, in, "the output", call);
  return in;
}
// each(s, out rows of s, bindings of s...) for every sequence s, in order.
template <class Plan, class Out, class Each, class... B>
void for_sequences(Out const& out, sequences const& seqs, Each const& each, B const&... bindings) {
  for (std::size_t s = 0; s < seqs.count(); ++s)
    each(s, out.rows(seqs.begin(s), seqs.length(s)),
         sequence_binding<packed_dim<Plan>, inputs_of<Plan>>(bindings, seqs, s)...);
}
// Does one launch serve the pack? Its programs must be packable, and the pack
// must not be a few long sequences that, launched alone, would split along N
// for an idle device's sake (sms; 0: the emulation, which splits only as the
// options ask). Chained: a state's launch; backward: the gradient's programs.
template <class Plan, class Bound>
bool one_launch(Plan const& plan, options opt, Bound const& in, sequences const& seqs, bool chained, int sms,
                bool backward = false) {
  using F = forward_plan<Plan>;
  if constexpr (!F::ok || F::stacked) {
    return false;
  } else if constexpr (!std::is_same_v<typename F::k::input::rows, typename F::q::input::rows>) {
    return false;  // (cross-attention: every sequence reads all of K and V)
  } else {
    attention_spec s = bound_spec(plan, opt, in);
    s.chained = chained;
    std::vector<program> const ps = backward ? backward_programs_of(s) : std::vector<program>{program_of(s)};
    std::size_t longest = 0;
    for (std::size_t k = 0; k < seqs.count(); ++k) longest = std::max(longest, seqs.length(k));
    program const& p = ps.front();
    std::int64_t const blocks = static_cast<std::int64_t>(seqs.count() * in.heads) * p.m_tiles;
    return std::all_of(ps.begin(), ps.end(), [](program const& x) { return packable(x); }) &&
           (!splits(s) || (opt.split_rows == 0 &&
                           split_rows(opt.tiles, blocks, static_cast<std::int64_t>(longest), p.tiles.chunk, sms) == 0));
  }
}
// A chained packed evaluation (L: the linear form, chainable): the state
// checked and sized for one row per sequence, then run(out rows, bound inputs,
// run_with) once for the pack (one_launch) or once per sequence on its row.
template <class L, class Out, class Packs, class Run, class... B>
void chained_sequences(L const& linear, Out const& out, state& st, sequences const& seqs, void* stream, char const* call,
                       Packs const& packs, Run const& run, B const&... bindings) {
  auto in = check_sequences<L>(out, call, seqs, bindings...);
  st.prepare(linear, in, stream, call, seqs.count(), "sequences (of packed sequences)");
  if (packs(in))
    run(out, in, run_with{.st = &st, .packed = &seqs});
  else
    for_sequences<L>(
        out, seqs, [&](std::size_t s, auto const& rows, auto const&... b) { run(rows, bind<L>(b...), run_with{.st = &st, .row = s}); },
        bindings...);
  st.flip();
}
}  // namespace detail

template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_into(Plan const& plan, options opt, tensor_view<float> out, sequences const& seqs, B const&... bindings) {
  auto in = detail::check_sequences<Plan>(out, "cuda::emulate_into", seqs, bindings...);
  if (detail::one_launch(plan, opt, in, seqs, false, 0)) {
    detail::emulate_bound(plan, opt, out, in, {.packed = &seqs});
    return;
  }
  detail::for_sequences<Plan>(
      out, seqs, [&](std::size_t, tensor_view<float> rows, auto const&... b) { emulate_into(plan, opt, rows, b...); },
      bindings...);
}
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
lina::tensor<float> emulate(Plan const& plan, options opt, sequences const& seqs, B const&... bindings) {
  lina::tensor<float> out(result_shape<Plan>(bind<Plan>(bindings...)));
  emulate_into(plan, opt, out.view(), seqs, bindings...);
  return out;
}
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, void* stream, tile_request tiles, sequences const& seqs,
                   B const&... bindings) {
  static_assert(!std::is_const_v<O>, "lina::cuda::evaluate_into: the output view must be writable");
  check_tile_request(tiles);
  auto in = detail::check_sequences<Plan>(out, "cuda::evaluate_into", seqs, bindings...);
  using T = std::remove_const_t<typename decltype(in)::value_type>;
  int const sms = require_device("cuda::evaluate_into").sms;
  if (detail::one_launch(plan, detail::device_options<T, O>(tiles), in, seqs, false, sms)) {
    detail::launch_bound(plan, out, in, stream, tiles, "cuda::evaluate_into", {.packed = &seqs});
    return;
  }
  detail::for_sequences<Plan>(
      out, seqs, [&](std::size_t, device_view<O> rows, auto const&... b) { evaluate_into(plan, rows, stream, tiles, b...); },
      bindings...);
}
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, void* stream, sequences const& seqs, B const&... bindings) {
  evaluate_into(plan, out, stream, tile_request{}, seqs, bindings...);
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, void* stream, tile_request tiles, sequences const& seqs, B const&... bindings) {
  check_tile_request(tiles);
  auto out = detail::new_result<Out, Plan>(bindings...);
  evaluate_into(plan, out.view(), stream, tiles, seqs, bindings...);
  return out;
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, void* stream, sequences const& seqs, B const&... bindings) {
  return evaluate<Out>(plan, stream, tile_request{}, seqs, bindings...);
}

// Chained: a host state through the emulation ...
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_into(Plan const& plan, options opt, tensor_view<float> out, state& st, sequences const& seqs,
                  B const&... bindings) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  detail::require_state_in(st, memory::host, "cuda::emulate_into");
  if constexpr (detail::forward_plan<L>::stacked) {  // layer by layer over the whole pack, a state row per sequence
    auto in = detail::check_sequences<L>(out, "cuda::emulate_into", seqs, bindings...);
    auto one = [&](auto const& layer, state& s, tensor_view<float> o, auto const&... b) {
      emulate_into(layer, opt, o, s, seqs, b...);
    };
    detail::chain_stack(st, linear, seqs.count(), in.heads, detail::host_rows{}, one, out, bindings...);
  } else if constexpr (detail::chainable<L>()) {
    detail::chained_sequences(
        linear, out, st, seqs, nullptr, "cuda::emulate_into",
        [&](auto const& in) { return detail::one_launch(linear, opt, in, seqs, true, 0); },
        [&](tensor_view<float> rows, auto const& in, detail::run_with w) { detail::emulate_bound(linear, opt, rows, in, w); },
        bindings...);
  }
}
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
lina::tensor<float> emulate(Plan const& plan, options opt, state& st, sequences const& seqs, B const&... bindings) {
  using L = decltype(longest_branch(plan));
  lina::tensor<float> out(result_shape<L>(bind<L>(bindings...)));
  emulate_into(plan, opt, out.view(), st, seqs, bindings...);
  return out;
}
// ... and a device state on the GPU.
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, state& st, void* stream, tile_request tiles,
                   sequences const& seqs, B const&... bindings) {
  static_assert(!std::is_const_v<O>, "lina::cuda::evaluate_into: the output view must be writable");
  check_tile_request(tiles);
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  detail::require_state_in(st, memory::device, "cuda::evaluate_into");
  if constexpr (detail::forward_plan<L>::stacked) {  // layer by layer over the whole pack, a state row per sequence
    auto in = detail::check_sequences<L>(out, "cuda::evaluate_into", seqs, bindings...);
    using T = std::remove_const_t<typename decltype(in)::value_type>;
    auto one = [&](auto const& layer, state& s, auto o, auto const&... b) {
      evaluate_into(layer, o, s, stream, tiles, seqs, b...);
    };
    detail::chain_stack(st, linear, seqs.count(), in.heads, detail::device_rows<T>{}, one, out, bindings...);
    synchronize_stream(stream, "cuda::evaluate_into");
  } else if constexpr (detail::chainable<L>()) {
    int const sms = require_device("cuda::evaluate_into").sms;
    detail::chained_sequences(
        linear, out, st, seqs, stream, "cuda::evaluate_into",
        [&](auto const& in) {
          using T = std::remove_const_t<typename std::remove_cvref_t<decltype(in)>::value_type>;
          return detail::one_launch(linear, detail::device_options<T, O>(tiles), in, seqs, true, sms);
        },
        [&](device_view<O> rows, auto const& in, detail::run_with w) {
          detail::launch_bound(linear, rows, in, stream, tiles, "cuda::evaluate_into", w);
        },
        bindings...);
  }
}
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, state& st, void* stream, sequences const& seqs,
                   B const&... bindings) {
  evaluate_into(plan, out, st, stream, tile_request{}, seqs, bindings...);
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, state& st, void* stream, tile_request tiles, sequences const& seqs, B const&... bindings) {
  check_tile_request(tiles);
  auto out = detail::new_result<Out, decltype(longest_branch(plan))>(bindings...);
  evaluate_into(plan, out.view(), st, stream, tiles, seqs, bindings...);
  return out;
}
template <class Out = void, class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, state& st, void* stream, sequences const& seqs, B const&... bindings) {
  return evaluate<Out>(plan, st, stream, tile_request{}, seqs, bindings...);
}

// ---- gradients: the backward kernels ------------------------------------------------------
// cuda::emulate_gradient(plan, opts, dout, Q = q, K = k, V = v) and, on the
// device, cuda::gradient(plan, dout, stream, Q = dq, K = dk, V = dv): the
// gradients of a lowerable plan's inputs, g[Q], g[K], g[V], as
// cpu::gradient(plan, dout, …) gives them — computed by the generated backward
// kernel (lina/cuda/program.hpp, backward_programs_of): for a causal linear
// plan one forward pass (the rows again, rowdiv's adjoint, ∂Q from the prefix
// sums) and one reverse pass (∂K, ∂V from the suffix sums), one block per
// (batch, head) — on a device with more SMs than those blocks, three launches
// over groups of rows instead (split_backward_programs_of; the emulation:
// options::split_rows); for softmax two quadratic launches (∂Q per chunk of query
// rows, then ∂K, ∂V per chunk of key rows); memory beyond inputs and
// gradients: the fp32 adjoint rows of a normalised plan, N × (M+1) per
// (batch, head) (softmax: and each row's shift, N × 1). dout must have the shape of the plan's result
// (shape_error "dout" otherwise, before anything runs). Inputs and dout are read
// as opts.in (the emulation) or have the device views' element type (one type
// for all four); the gradients are rounded to opts.out (emulation: returned as
// float) or have the inputs' element type (device: cuda::tensor<T>, dense
// [B, H, N, ·]). A chained form takes the block's initial state and the
// gradient of the state it left, and also returns the gradient of the first.
// The device form is asynchronous on `stream` (its scratch is stream-ordered)
// but for the chained and stacked forms, which wait for it (their state copies
// and intermediates die with the call).
// A linear state too large for one block (D = M = 256) is split over launches
// by slices of M's columns (backward_programs_of).
namespace detail {
template <class Op, class Tensor, class... In>
Tensor& gradient_slot(gradients<Tensor, In...>& g) {
  return g.all()[lina::detail::index_of_v<Op, lina::detail::type_list<In...>>];
}
template <class Op, class Tensor, class... In>
Tensor const& gradient_slot(gradients<Tensor, In...> const& g) {
  return g.all()[lina::detail::index_of_v<Op, lina::detail::type_list<In...>>];
}

template <class Plan, class Bound>
void check_dout(shape4 const& got, Bound const& in) {
  shape4 const want = result_shape<Plan>(in);
  static constexpr char const* names[] = {"B (batch)", "H (heads)", "rows", "cols"};
  for (int d = 0; d < 4; ++d)
    if (got[d] != want[d]) throw shape_error("dout", names[d], got[d], want[d], "of the plan's result");
}

}  // namespace detail

namespace detail {
// A chained backward's states (program.hpp, backward_program_of): the sums
// the block started from, the gradient of those it left, and where the
// gradient of the first goes. A stack's: a state of each per layer, the
// lowest first (as through_layers runs them), from() on its upper part.
struct chain_states {
  state const* initial = nullptr;
  state const* d_final = nullptr;
  state* d_initial = nullptr;
  chain_states from(std::size_t first) const { return {initial + first, d_final + first, d_initial + first}; }
};
// st prepared with a row per batch row, or per sequence when packed.
template <class L, class Bound>
void prepare_rows(state& st, L const& linear, Bound const& in, void* stream, char const* call, sequences const* packed) {
  if (packed)
    st.prepare(linear, in, stream, call, packed->count(), "sequences (of packed sequences)");
  else
    st.prepare(linear, in, stream, call);
}
// A copy of a chain state, checked against the plan and sized (zeros) if
// unsized: a row per batch row, or per sequence when packed.
template <class L, class Bound>
state chain_operand(state const& x, L const& linear, Bound const& in, memory where, void* stream, char const* call,
                    sequences const* packed) {
  if (x.where() != where)
    throw std::invalid_argument(std::string("lina::cuda: ") + call + ": the states of a chained gradient must be in " +
                                (where == memory::host ? "host memory (cuda::memory::host)" : "device memory"));
  state c = x.copy_to(where, stream, call);
  prepare_rows(c, linear, in, stream, call, packed);
  return c;
}

// A chained gradient of the linear plan L: impl(the chain states). A stack's
// `initial` and `d_final` are stack states (a layer each, as its chained
// forward leaves them; unbound: zeros in every layer), and `d_initial` is
// given a layer each (state::run_stacked: unbound again should impl throw).
// A state of another plan is a state_error before anything runs.
template <class L, class Impl>
auto chain_layers(L const& linear, state const& initial, state const& d_final, state& d_initial, std::size_t rows,
                  std::size_t heads, Impl const& impl) {
  if constexpr (!forward_plan<L>::stacked) {
    chain_states const c{&initial, &d_final, &d_initial};
    return impl(&c);
  } else {
    constexpr std::size_t count = layer_count<L>();
    std::vector<state> zeros[2];
    auto layers_of = [&](state const& s, std::vector<state>& none) -> state const* {
      if (s.unbound()) {
        for (std::size_t k = 0; k < count; ++k) none.emplace_back(s.where());
        return none.data();
      }
      if (!s.belongs_to(typeid(L)) || s.layers() != count)
        throw state_error("this state belongs to the plan " + s.plan() + ", not to the stack " + to_string(linear));
      return &s.layer(0);
    };
    state const* const from = layers_of(initial, zeros[0]);
    state const* const back = layers_of(d_final, zeros[1]);
    decltype(impl(static_cast<chain_states const*>(nullptr))) g;
    d_initial.run_stacked(linear, rows, heads, count, [&](state* layers) {
      chain_states const c{from, back, layers};
      g = impl(&c);
    });
    return g;
  }
}

// A layer's gradients into g (stacked plans: each input of the stack is an
// input of the layer below, of the rest above it, or of both — then its
// gradient is the sum of the two, add(to, from)).
template <class I, class G>
inline constexpr bool has_gradient = false;
template <class I, class T, class... In>
inline constexpr bool has_gradient<I, gradients<T, In...>> = (std::is_same_v<I, In> || ...);
template <class T, class... In, class A, class B, class Add>
void gather_gradients(gradients<T, In...>& g, A& a, B& b, Add&& add) {
  (
      [&] {
        T& out = g.all()[lina::detail::index_of_v<In, lina::detail::type_list<In...>>];
        if constexpr (has_gradient<In, A>) out = std::move(gradient_slot<In>(a));
        if constexpr (has_gradient<In, A> && has_gradient<In, B>)
          add(out, gradient_slot<In>(b));
        else if constexpr (has_gradient<In, B>)
          out = std::move(gradient_slot<In>(b));
      }(),
      ...);
}

// The chain rule through a stacked plan, a layer at a time: run(layer, its
// bindings) evaluates the layer below into an intermediate; grad(plan, dout,
// first, bindings) differentiates the rest above on it, then the layer on the
// gradient of its result (first: the part's lowest layer among the plan's, as
// through_layers counts them — where a chained gradient finds its states);
// the two gradients' inputs fill g (add: an input both read).
template <class Plan, class G, class Dout, class Run, class Grad, class Add, class... B>
void layers_backward(Plan const& plan, G& g, Dout const& dout, Run&& run, Grad&& grad, Add&& add, B const&... bindings) {
  using layer = typename forward_plan<Plan>::layer;
  using Sub = typename layer::sub;
  auto const& sub = subtree<Sub>(plan);
  constexpr auto symbol = node<typename layer::input>{};
  auto const rest = replace_subtree<Sub>(plan, symbol);
  auto mid = with_inputs_of<Sub>([&](auto const&... b) { return run(sub, b...); }, bindings...);
  auto const result = symbol = mid;
  auto g_rest = with_inputs_of<std::remove_cvref_t<decltype(rest)>>(
      [&](auto const&... b) { return grad(rest, dout, layer_count<Sub>(), b...); }, bindings..., result);
  auto g_sub = with_inputs_of<Sub>(
      [&](auto const&... b) { return grad(sub, gradient_slot<typename layer::input>(g_rest), std::size_t{0}, b...); },
      bindings...);
  gather_gradients(g, g_rest, g_sub, add);
}

// A chained block's forward through the stack `sub` (its lowest layers),
// from copies of their states `initial` (one per layer, in through_layers'
// order): the intermediate a chained backward reads, the states left as they
// were. one(layer, its state, out, bindings...) evaluates a layer chained, as
// the chained forward does; alloc makes the result.
template <class Sub, class Alloc, class One, class... B>
auto chained_layers(Sub const& sub, state const* initial, memory where, void* stream, char const* call, Alloc const& alloc,
                    One const& one, B const&... bindings) {
  std::vector<state> copies;
  for (std::size_t k = 0; k < layer_count<Sub>(); ++k) copies.push_back(initial[k].copy_to(where, stream, call));
  auto mid = alloc(sub, bindings...);
  run_stack(sub, copies.data(), alloc, one, mid.view(), bindings...);
  if (where == memory::device) synchronize_stream(stream, call);  // the copies die here
  return mid;
}

// (Chain: chain_states for the chained form, else void. packed: sequences of
// the operands' one batch row, all in one launch: one_launch said so.)
template <class Plan, class Dout, class Chain, class... B>
auto emulate_gradient_impl(Plan const& plan, options opt, Dout const& dout, Chain const* chain, sequences const* packed,
                           B const&... bindings) {
  constexpr bool chained = std::is_same_v<Chain, chain_states>;
  using F = detail::forward_plan<Plan>;
  static_assert(diagnose::cuda_plan<F::ok>::ok || true);
  gradients_for<lina::tensor<float>, Plan> g;
  if constexpr (F::ok && F::stacked) {  // (chained: each layer from its own states, the forward's from copies)
    layers_backward(
        plan, g, dout,
        [&](auto const& layer, auto const&... b) {
          if constexpr (chained) {
            auto one = [&](auto const& l, state& s, tensor_view<float> o, auto const&... lb) {
              if (packed)
                emulate_into(l, opt, o, s, *packed, lb...);
              else
                emulate_into(l, opt, o, s, lb...);
            };
            return chained_layers(layer, chain->initial, memory::host, nullptr, "cuda::emulate_gradient", host_rows{}, one,
                                  b...);
          } else {
            return emulate(layer, opt, b...);
          }
        },
        [&](auto const& p, auto const& d, std::size_t first, auto const&... b) {
          if constexpr (chained) {
            chain_states const c = chain->from(first);
            return emulate_gradient_impl(p, opt, d, &c, packed, b...);
          } else {
            return emulate_gradient_impl(p, opt, d, static_cast<void const*>(nullptr), nullptr, b...);
          }
        },
        [&](lina::tensor<float>& to, lina::tensor<float> const& from) { detail::emulate_add(to.view(), from.view(), opt.out); },
        bindings...);
  } else if constexpr (F::ok && !F::stacked) {
    auto in = bind<Plan>(bindings...);
    static_assert(std::is_same_v<typename decltype(in)::value_type, float>,
                  "lina::cuda::emulate_gradient: bind float tensors (read as opts.in)");
    tensor_view<float const> const dv = view_of(dout);
    if (packed) check_packed<packed_dim<Plan>>(in, *packed);  // (sequences: one batch row, cut as they say)
    detail::check_dout<Plan>(dv.shape(), in);
    using Bound = decltype(in);
    attention_spec s = detail::bound_spec(plan, opt, in);
    s.chained = chained;
    std::int64_t const n_rows = static_cast<std::int64_t>(F::q::input::rows::extent(in.table));
    std::int64_t const n_keys = static_cast<std::int64_t>(F::k::input::rows::extent(in.table));
    std::vector<program> ps = backward_programs_of(s);  // one launch, or softmax's two or three
    // The chunk-parallel form where asked for (options::split_rows, else the
    // schedule's groups) and the plan has one (linear; no rows or keys: no group).
    std::int64_t const rows = packed             ? 0
                              : opt.split_rows > 0 ? opt.split_rows
                              : ps.size() == 1   ? split_rows(opt.tiles, 0, n_rows, ps.front().tiles.chunk, 0)
                                                 : 0;
    if (rows > 0 && n_rows > 0 && n_keys > 0)
      if (std::vector<program> sp = split_backward_programs_of(s); !sp.empty()) ps = std::move(sp);
    program const& p = ps.front();
    std::vector<std::uint16_t> stores[max_inputs];
    forward_args a;
    a.in[0] = detail::operand_of(in.views[Bound::template input_index<typename F::q::input>()], opt.in, stores[0]);
    a.in[1] = detail::operand_of(in.views[Bound::template input_index<typename F::k::input>()], opt.in, stores[1]);
    a.in[2] = detail::operand_of(in.views[Bound::template input_index<typename F::v::input>()], opt.in, stores[2]);
    a.in[3] = detail::operand_of(dv, opt.in, stores[3]);
    if constexpr (F::parametric)  // W (and φ(K)'s own) after ∂out
      a.in[4] = detail::operand_of(in.views[Bound::template input_index<typename F::q::param>()], opt.in, stores[4]);
    if constexpr (F::own_k_w)
      a.in[5] = detail::operand_of(in.views[Bound::template input_index<typename F::k::param>()], opt.in, stores[5]);
    a.batch = static_cast<std::int64_t>(in.batch);
    a.heads = static_cast<std::int64_t>(in.heads);
    a.n = n_rows;
    a.n_keys = n_keys;
    if (p.split) a.group_rows = rows;
    std::size_t const n = static_cast<std::size_t>(a.n), nk = static_cast<std::size_t>(a.n_keys);
    shape4 const sq{in.batch, in.heads, n, s.d}, sk{in.batch, in.heads, nk, s.d}, sv{in.batch, in.heads, nk, s.m};
    if (packed) pack(a, *packed, offsets_of(*packed));
    lina::tensor<float>& gq = detail::gradient_slot<typename F::q::input>(g);
    lina::tensor<float>& gk = detail::gradient_slot<typename F::k::input>(g);
    lina::tensor<float>& gv = detail::gradient_slot<typename F::v::input>(g);
    gq = lina::tensor<float>(sq), gk = lina::tensor<float>(sk), gv = lina::tensor<float>(sv);
    // 16-bit gradients, widened below: one buffer per gradient (an input the
    // plan reads twice has one, which the kernel's shares add into).
    std::vector<std::pair<lina::tensor<float>*, std::vector<std::uint16_t>>> bits;
    auto sink = [&](lina::tensor<float>& t) {
      if (opt.out == dtype::f32) return detail::dense_operand(t.data(), t.shape());
      auto at = std::find_if(bits.begin(), bits.end(), [&](auto const& x) { return x.first == &t; });
      if (at == bits.end()) at = bits.insert(bits.end(), {&t, std::vector<std::uint16_t>(t.size())});
      return detail::dense_operand(at->second.data(), t.shape());
    };
    a.out = sink(gq);
    a.extra[0] = sink(gk);
    a.extra[1] = sink(gv);
    // Buffers not by rows (∂W, its sums) have a batch row per sequence when packed.
    std::size_t const each = packed ? packed->count() : in.batch;
    std::vector<std::vector<float>> scratch;  // the programs' own fp32 rows (extra_buffer::cols)
    for (std::size_t e = 0; e < p.extras.size(); ++e)
      if (std::size_t const cols = p.extras[e].cols) {
        std::size_t const rows = static_cast<std::size_t>(scratch_rows(p.extras[e], a));
        std::size_t const b = by_rows(p.extras[e]) ? in.batch : each;
        a.extra[e] = detail::dense_operand(scratch.emplace_back(b * in.heads * rows * cols).data(), {b, in.heads, rows, cols});
      }
    // ∂W (and ∂W2) per (batch, head), where the program put them; packed, per
    // (sequence, head), summed below in sequence order, as each sequence's own.
    lina::tensor<float> per_sequence[2];
    auto w_gradient = [&](lina::tensor<float>& gw, std::string const& name, lina::tensor<float>& shares) {
      gw = lina::tensor<float>({in.batch, in.heads, s.d, s.f});
      if (packed) shares = lina::tensor<float>({each, in.heads, s.d, s.f});
      a.extra[extra_named(p, "∂" + name)] = sink(packed ? shares : gw);
    };
    if constexpr (F::parametric) w_gradient(detail::gradient_slot<typename F::q::param>(g), s.w_name, per_sequence[0]);
    if constexpr (F::own_k_w) w_gradient(detail::gradient_slot<typename F::k::param>(g), s.w_k_name, per_sequence[1]);
    state s0, d_final;
    if constexpr (chained) {  // S0 in, ∂(state out) in its extra buffer, ∂S0 out
      char const* call = "cuda::emulate_gradient";
      s0 = chain_operand(*chain->initial, plan, in, memory::host, nullptr, call, packed);
      d_final = chain_operand(*chain->d_final, plan, in, memory::host, nullptr, call, packed);
      state& r = *chain->d_initial;
      r = state(plan, each, in.heads, memory::host);
      prepare_rows(r, plan, in, nullptr, call, packed);
      a.state_in = s0.kernel_in();
      a.state_out = r.kernel_out();
      a.extra[extra_named(p, "∂state out")] = d_final.kernel_in();
    }
    for (program const& x : ps) emulate(x, arguments_for(x, a));
    if constexpr (chained) chain->d_initial->flip();
    for (auto const& [t, b] : bits)
      for (std::size_t i = 0; i < t->size(); ++i)
        t->data()[i] = opt.out == dtype::bf16 ? from_bf16_bits(b[i]) : from_f16_bits(b[i]);
    auto sum_shares = [&](lina::tensor<float>& gw, lina::tensor<float> const& shares) {  // (gw: zeros)
      std::size_t const one = gw.size();  // (in.batch is 1 when packed)
      for (std::size_t q = 0; q < each; ++q)
        detail::emulate_add(gw.view(), lina::tensor_view<float const>(shares.data() + q * one, gw.shape()), opt.out);
    };
    if constexpr (F::parametric)
      if (packed) sum_shares(detail::gradient_slot<typename F::q::param>(g), per_sequence[0]);
    if constexpr (F::own_k_w)
      if (packed) sum_shares(detail::gradient_slot<typename F::k::param>(g), per_sequence[1]);
  }
  return g;
}
}  // namespace detail

template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto emulate_gradient(Plan const& plan, options opt, Dout const& dout, B const&... bindings) {
  return detail::emulate_gradient_impl(plan, opt, dout, static_cast<void const*>(nullptr), nullptr, bindings...);
}

// The chained form, for one block of a sequence evaluated through a state:
// `initial` holds the sums the block started from (a host cuda::state of the
// plan; copy it before the forward evaluation moves it on — unsized: zeros,
// the first block), `d_final` the gradient of the sums it left (the next
// block's ∂initial; unsized: zeros, the last block). Returns the inputs'
// gradients and, as a new host state, the gradient of `initial`: blocks are
// differentiated last first, each handing its ∂initial to the one before.
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto emulate_gradient(Plan const& plan, options opt, Dout const& dout, state const& initial, state const& d_final,
                      B const&... bindings) {
  auto linear = longest_branch(plan);
  static_assert(detail::chainable<decltype(linear)>() || true);
  auto const in = bind<decltype(linear)>(bindings...);
  state d_initial(memory::host);
  auto g = detail::chain_layers(linear, initial, d_final, d_initial, in.batch, in.heads, [&](detail::chain_states const* c) {
    return detail::emulate_gradient_impl(linear, opt, dout, c, nullptr, bindings...);
  });
  return std::pair{std::move(g), std::move(d_initial)};
}
// Packed sequences chained: states of a row per sequence ([S, H, C, W], as a
// packed chained evaluation leaves them), the pack in one launch per backward
// program (a chainable plan's backward is packable: ∂ of the state, like the
// state, takes the sequence's batch row), whatever the options' split.
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto emulate_gradient(Plan const& plan, options opt, Dout const& dout, state const& initial, state const& d_final,
                      sequences const& seqs, B const&... bindings) {
  auto linear = longest_branch(plan);
  static_assert(detail::chainable<decltype(linear)>() || true);
  auto const in = bind<decltype(linear)>(bindings...);
  state d_initial(memory::host);
  auto g = detail::chain_layers(linear, initial, d_final, d_initial, seqs.count(), in.heads, [&](detail::chain_states const* c) {
    return detail::emulate_gradient_impl(linear, opt, dout, c, &seqs, bindings...);
  });
  return std::pair{std::move(g), std::move(d_initial)};
}

namespace detail {
// The caller's view for the gradient of In (gradient_into), checked against
// the shape the backward writes: a shape_error naming ∂In, the dimension and
// both extents; its columns must be adjacent (the zeros of a launch without
// rows are written row by row).
template <class In, class G>
auto caller_view(G& into, shape4 const& want) {
  auto v = gradient_slot<In>(into);
  std::string const name = "∂" + std::string(In::name.view());
  static constexpr char const* dims[4] = {"B (batch)", "H (heads)", "rows", "cols"};
  for (std::size_t d = 0; d < 4; ++d)
    if (v.shape()[d] != want[d])
      throw shape_error(name, dims[d], v.shape()[d], want[d], "of input " + std::string(In::name.view()));
  if (v.strides()[3] != 1 && want[3] > 1)
    throw std::invalid_argument("lina::cuda::gradient_into: the view for " + name +
                                " must have adjacent columns (column stride 1), not " + std::to_string(v.strides()[3]));
  return v;
}
// A device view of adjacent columns set to zero on `stream`.
template <class T>
void zero_view(device_view<T> v, void* stream, char const* call) {
  shape4 const sh = v.shape();
  if (v.strides() == tensor_view<T>::contiguous_strides(sh)) {
    fill_zero(v.data(), sh[0] * sh[1] * sh[2] * sh[3] * sizeof(T), stream, call);
    return;
  }
  for (std::size_t b = 0; b < sh[0]; ++b)
    for (std::size_t h = 0; h < sh[1]; ++h)
      fill_zero_rows(v.data() + static_cast<std::ptrdiff_t>(b) * v.strides()[0] + static_cast<std::ptrdiff_t>(h) * v.strides()[1],
                     static_cast<std::size_t>(v.strides()[2]) * sizeof(T), sh[3] * sizeof(T), sh[2], stream, call);
}

// Every view of `into` checked against its input's bound shape (a gradient
// has its input's shape), before anything is written.
template <class G, class... In, class Bound>
void check_into(gradients<G, In...>& into, Bound const& in) {
  ((void)caller_view<In>(into, in.views[Bound::template input_index<In>()].shape()), ...);
}
// The caller's gradient views refused (alias_error) where one may share memory
// with an input, with dout or with another gradient's view, as
// refuse_shared_memory refuses an output.
template <class G, class... In, class Bound, class Dout>
void refuse_shared_gradients(gradients<G, In...>& into, Bound const& in, Dout const& dout, char const* call) {
  std::array<std::string, sizeof...(In)> const names{std::string(In::name.view())...};
  for (std::size_t i = 0; i < names.size(); ++i) {
    std::string const what = "the view of ∂" + names[i];
    refuse_shared_memory(into.all()[i], in, what, call);
    auto refuse = [&](std::string const& other) {
      throw alias_error(std::string(call) + ": " + what + " may share memory with " + other +
                        ": give each gradient memory of its own");
    };
    if (lina::detail::may_share_memory(into.all()[i], view_of(dout))) refuse("dout");
    for (std::size_t j = 0; j < i; ++j)
      if (lina::detail::may_share_memory(into.all()[i], into.all()[j])) refuse("the view of ∂" + names[j]);
  }
}
// The same for the emulation's gradient_into ([seqs,] bindings...), which
// refuses what a launch would, though it copies results made elsewhere.
template <class Plan, class G, class... In, class Dout, class... B>
void refuse_shared_gradients(gradients<G, In...>& into, Dout const& dout, B const&... bindings) {
  auto const in = bind<Plan>(bindings...);
  check_into(into, in);
  refuse_shared_gradients(into, in, dout, "cuda::emulate_gradient_into");
}
template <class Plan, class G, class... In, class Dout, class... B>
void refuse_shared_gradients(gradients<G, In...>& into, Dout const& dout, sequences const&, B const&... bindings) {
  refuse_shared_gradients<Plan>(into, dout, bindings...);
}
// The emulation's gradients g copied into the caller's views, every view
// checked first.
template <class... In, class G>
void copy_gradients(gradients<tensor_view<float>, In...>& into, G const& g) {
  ((void)caller_view<In>(into, gradient_slot<In>(g).shape()), ...);
  auto copy = [](tensor_view<float> to, lina::tensor<float> const& from) {
    for_each_index(to.shape(), [&](auto... x) { to(x...) = from(x...); });
  };
  (copy(gradient_slot<In>(into), gradient_slot<In>(g)), ...);
}

// Packed sequences differentiated one by one into the caller's views: the
// gradient of an input cut into sequences is written straight into its rows;
// one every sequence reads whole (W; K and V of a cross-attention) is zeroed,
// then each sequence's share — written into share(shape), one buffer per such
// input, reused by every sequence — is added in sequence order, as the
// one-launch backward and cpu::gradient_into sum them.
// grad_into(views, dout rows, sequence bindings...) differentiates one sequence.
template <class Plan, class View, class... In, class Dout, class GradInto, class Share, class Zero, class Add, class... B>
void packed_into(gradients<View, In...>& into, Dout const& dout, sequences const& seqs, GradInto const& grad_into,
                 Share const& share, Zero const& zero, Add const& add, B const&... bindings) {
  using N = packed_dim<Plan>;
  constexpr bool cut[] = {cut_input<N, In>...};
  auto mine = into;
  for (std::size_t i = 0; i < sizeof...(In); ++i)
    if (!cut[i]) mine.all()[i] = share(into.all()[i].shape()), zero(into.all()[i]);
  for (std::size_t s = 0; s < seqs.count(); ++s) {
    for (std::size_t i = 0; i < sizeof...(In); ++i)
      if (cut[i]) mine.all()[i] = into.all()[i].rows(seqs.begin(s), seqs.length(s));
    grad_into(mine, view_of(dout).rows(seqs.begin(s), seqs.length(s)),
              sequence_binding<N, inputs_of<Plan>>(bindings, seqs, s)...);
    for (std::size_t i = 0; i < sizeof...(In); ++i)
      if (!cut[i]) add(into.all()[i], mine.all()[i]);
  }
}

// (Into: the caller's views, gradients<device_view<T>, …> — gradient_into —, else void.)
template <class Plan, class Dout, class Chain, class Into, class... B>
auto gradient_impl(Plan const& plan, Dout const& dout, void* stream, tile_request tiles, Chain const* chain,
                   sequences const* packed, Into* into, B const&... bindings) {
  check_tile_request(tiles);
  constexpr bool chained = std::is_same_v<Chain, chain_states>;
  using F = detail::forward_plan<Plan>;
  static_assert(diagnose::cuda_plan<F::ok>::ok || true);
  auto in = bind<Plan>(bindings...);
  using Bound = decltype(in);
  static_assert(diagnose::device_bindings<is_device_view<typename Bound::view_type>>::ok || true);
  using T = std::remove_const_t<typename Bound::value_type>;
  gradients_for<tensor<T>, Plan> g;
  if constexpr (F::ok && F::stacked && is_device_view<typename Bound::view_type>) {  // (chained: as emulate_gradient)
    layers_backward(
        plan, g, dout,
        [&](auto const& layer, auto const&... b) {
          if constexpr (chained) {
            auto one = [&](auto const& l, state& s, auto o, auto const&... lb) {
              if (packed)
                evaluate_into(l, o, s, stream, tiles, *packed, lb...);
              else
                evaluate_into(l, o, s, stream, tiles, lb...);
            };
            return chained_layers(layer, chain->initial, memory::device, stream, "cuda::gradient", device_rows<T>{}, one, b...);
          } else {
            return evaluate<T>(layer, stream, tiles, b...);
          }
        },
        [&](auto const& p, auto const& d, std::size_t first, auto const&... b) {
          if constexpr (chained) {
            chain_states const c = chain->from(first);
            return gradient_impl(p, d, stream, tiles, &c, packed, static_cast<void*>(nullptr), b...);
          } else {
            return gradient_impl(p, d, stream, tiles, static_cast<void const*>(nullptr), nullptr, static_cast<void*>(nullptr),
                                 b...);
          }
        },
        [&](tensor<T>& to, tensor<T> const& from) { add_into(to, from, stream); },
        bindings...);
    synchronize_stream(stream, "cuda::gradient");  // the intermediates die with this call
  } else if constexpr (F::ok && !F::stacked &&
                       is_device_view<typename Bound::view_type>) {
    char const* call = std::is_void_v<Into> ? "cuda::gradient" : "cuda::gradient_into";
    static_assert(std::is_void_v<Into> || std::is_same_v<Into, gradients_for<device_view<T>, Plan>>,
                  "lina::cuda::gradient_into: the gradient views must have the inputs' element type");
    auto const dv = view_of(dout);
    static_assert(std::is_same_v<std::remove_const_t<typename decltype(dv)::element_type_>, T>,
                  "lina::cuda::gradient: dout must have the inputs' element type");
    if (packed) check_packed<packed_dim<Plan>>(in, *packed);  // (sequences: one batch row, cut as they say)
    detail::check_dout<Plan>(dv.shape(), in);
    attention_spec s = detail::bound_spec(plan, device_options<T, T>(tiles), in);
    s.chained = chained;
    std::vector<program> ps = backward_programs_of(s);  // one launch, or softmax's two or three
    device_status const dev = require_device(call);
    forward_args a = detail::device_args<F>(device_view<T>{}, in, 4);  // W after ∂out
    a.in[3] = detail::device_operand(dv);
    // Too few (batch, head) blocks for the device: the chunk-parallel form, where the plan has one.
    if (std::int64_t const rows = ps.size() == 1 && !packed && a.n > 0 && keys_of(a) > 0
                                      ? split_rows(tiles, blocks_of(ps.front(), a), a.n, ps.front().tiles.chunk, dev.sms)
                                      : 0)
      if (std::vector<program> sp = split_backward_programs_of(s); !sp.empty()) ps = std::move(sp), a.group_rows = rows;
    program const& p = ps.front();
    std::size_t const n = static_cast<std::size_t>(a.n), nk = static_cast<std::size_t>(a.n_keys);
    device_buffer offsets;
    if (packed) offsets = device_offsets(*packed, stream, call), pack(a, *packed, static_cast<std::int64_t const*>(offsets.get()));
    // Where the gradients go: the caller's views (gradient_into, checked), else
    // new tensors of g (all made before any view is taken: an input the plan
    // reads twice has one gradient, which the kernel's shares add into).
    constexpr bool caller_views = !std::is_void_v<Into>;
    shape4 const sq{in.batch, in.heads, n, s.d}, sk{in.batch, in.heads, nk, s.d}, sv{in.batch, in.heads, nk, s.m},
        sw{in.batch, in.heads, s.d, s.f};
    device_view<T> vq, vk, vv, vw[2];
    if constexpr (caller_views) {
      vq = caller_view<typename F::q::input>(*into, sq);
      vk = caller_view<typename F::k::input>(*into, sk);
      vv = caller_view<typename F::v::input>(*into, sv);
      if constexpr (F::parametric) vw[0] = caller_view<typename F::q::param>(*into, sw);
      if constexpr (F::own_k_w) vw[1] = caller_view<typename F::k::param>(*into, sw);
      refuse_shared_gradients(*into, in, dout, call);
    } else {
      tensor<T>& gq = detail::gradient_slot<typename F::q::input>(g);
      tensor<T>& gk = detail::gradient_slot<typename F::k::input>(g);
      tensor<T>& gv = detail::gradient_slot<typename F::v::input>(g);
      gq = tensor<T>(sq, call), gk = tensor<T>(sk, call), gv = tensor<T>(sv, call);
      vq = gq.view(), vk = gk.view(), vv = gv.view();
      if constexpr (F::parametric) {
        tensor<T>& gw = detail::gradient_slot<typename F::q::param>(g);
        gw = tensor<T>(sw, call), vw[0] = gw.view();
      }
      if constexpr (F::own_k_w) {
        tensor<T>& gw2 = detail::gradient_slot<typename F::k::param>(g);
        gw2 = tensor<T>(sw, call), vw[1] = gw2.view();
      }
    }
    a.out = detail::device_operand(vq);
    a.extra[0] = detail::device_operand(vk);
    a.extra[1] = detail::device_operand(vv);
    // The programs' own fp32 rows (extra_buffer::cols: the adjoint rows, softmax's
    // shifts and ∂φ rows): stream-ordered, freed on the stream after the launches.
    // Buffers not by rows (∂W, its sums) have a batch row per sequence when packed.
    std::size_t const each = packed ? packed->count() : in.batch;
    std::vector<device_buffer> scratch;
    for (std::size_t e = 0; e < p.extras.size(); ++e)
      if (std::size_t const cols = p.extras[e].cols) {
        shape4 const sh{by_rows(p.extras[e]) ? in.batch : each, in.heads,
                        static_cast<std::size_t>(scratch_rows(p.extras[e], a)), cols};
        scratch.emplace_back(sh[0] * sh[1] * sh[2] * sh[3] * sizeof(float), stream, call);
        a.extra[e] = detail::dense_operand(scratch.back().get(), sh);
      }
    // ∂W (and ∂W2) per (batch, head), where the program put them; packed, per
    // (sequence, head), added below in sequence order as each sequence's own are.
    tensor<T> per_sequence[2];
    auto w_gradient = [&](int i, std::string const& name) {
      if (packed) per_sequence[i] = tensor<T>({each, in.heads, s.d, s.f}, call);
      a.extra[extra_named(p, "∂" + name)] = detail::device_operand(packed ? per_sequence[i].view() : vw[i]);
    };
    if constexpr (F::parametric) w_gradient(0, s.w_name);
    if constexpr (F::own_k_w) w_gradient(1, s.w_k_name);
    state s0, d_final;
    if constexpr (chained) {  // S0 in, ∂(state out) in its extra buffer, ∂S0 out
      s0 = chain_operand(*chain->initial, plan, in, memory::device, stream, call, packed);
      d_final = chain_operand(*chain->d_final, plan, in, memory::device, stream, call, packed);
      state& r = *chain->d_initial;
      r = state(plan, each, in.heads, memory::device);
      prepare_rows(r, plan, in, stream, call, packed);
      a.state_in = s0.kernel_in();
      a.state_out = r.kernel_out();
      a.extra[extra_named(p, "∂state out")] = d_final.kernel_in();
    }
    if (n == 0 && !chained) {  // no query rows: no block runs (launch), and ∂K, ∂V, ∂W are zeros
      auto zero = [&](device_view<T> v) { zero_view(v, stream, call); };
      zero(vk), zero(vv);
      if constexpr (F::parametric) zero(vw[0]);
      if constexpr (F::own_k_w) zero(vw[1]);
    }
    for (program const& x : ps) launch(x, arguments_for(x, a), stream);  // in order on the stream: softmax's later ones read the first's scratch
    auto add_shares = [&](device_view<T> gw, tensor<T> const& shares) {
      zero_view(gw, stream, call);
      std::size_t const one = sw[0] * sw[1] * sw[2] * sw[3];  // (in.batch is 1 when packed)
      for (std::size_t q = 0; q < each; ++q) add_into(gw, device_view<T const>{shares.data() + q * one, sw}, stream);
    };
    if constexpr (F::parametric)
      if (packed && n > 0) {  // (no rows: no launch, the zeros above)
        add_shares(vw[0], per_sequence[0]);
        if constexpr (F::own_k_w) add_shares(vw[1], per_sequence[1]);
        synchronize_stream(stream, call);  // the shares die with this call
      }
    if constexpr (chained) chain->d_initial->flip();
    if (chained) synchronize_stream(stream, call);  // the state copies die with this call
  }
  return g;
}
}  // namespace detail

// (With a schedule of the caller's after the stream, as evaluate_into takes one:
// its chunk is the backward's.)
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, void* stream, tile_request tiles, B const&... bindings) {
  return detail::gradient_impl(plan, dout, stream, tiles, static_cast<void const*>(nullptr), nullptr,
                               static_cast<void*>(nullptr), bindings...);
}
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, void* stream, B const&... bindings) {
  return gradient(plan, dout, stream, tile_request{}, bindings...);
}

// Gradients into the caller's memory, as cpu::gradient_into: views of any
// layout whose columns are adjacent, one per input, set before the call —
//   auto into = cuda::gradient_views<cuda::bf16>(plan);
//   into[Q] = dq.view(); into[K] = dk.view(); into[V] = dv.view();
//   cuda::gradient_into(plan, into, ddout, stream, [tiles,] Q = q, K = k, V = v);
// — so that a training loop reuses its buffers: cuda::gradient's new tensors
// cost a cudaMalloc each, and freeing them a cudaFree, which waits for the
// whole device. Nothing is allocated but the backward's fp32 scratch rows
// (stream-ordered). A view of another shape than its input's (or one not set)
// is a lina::shape_error naming ∂ of the input, before anything runs.
// emulate_gradient_into (host views, emulate_gradient_views) checks the same
// and writes the emulation's gradients. Plans as cuda::gradient takes them,
// but not stacked (its layers' shares are summed in new tensors: use
// cuda::gradient); packed sequences and the chained forms (returning
// ∂initial): below.
template <class T, class Plan>
auto gradient_views(Plan const&) {
  return gradients_for<device_view<T>, Plan>{};
}
template <class Plan>
auto emulate_gradient_views(Plan const&) {
  return gradients_for<tensor_view<float>, Plan>{};
}
namespace diagnose {
template <bool Unstacked>
struct gradient_into_plan {
  static_assert(Unstacked,
                "lina::cuda::gradient_into: a stacked plan's gradients are the sums of its layers' shares, made in new "
                "tensors: call cuda::gradient (emulate_gradient) for it");
  static constexpr bool ok = Unstacked;
};
}  // namespace diagnose
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, void* stream,
                   tile_request tiles, B const&... bindings) {
  static_assert(std::is_same_v<gradients<device_view<T>, In...>, gradients_for<device_view<T>, Plan>>,
                "lina::cuda::gradient_into: `into` must be cuda::gradient_views<T>(plan) of this plan");
  if constexpr (diagnose::gradient_into_plan<!detail::forward_plan<Plan>::stacked>::ok)
    (void)detail::gradient_impl(plan, dout, stream, tiles, static_cast<void const*>(nullptr), nullptr, &into, bindings...);
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, void* stream,
                   B const&... bindings) {
  gradient_into(plan, into, dout, stream, tile_request{}, bindings...);
}
template <class Plan, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_gradient_into(Plan const& plan, options opt, gradients<tensor_view<float>, In...>& into, Dout const& dout,
                           B const&... bindings) {
  static_assert(std::is_same_v<gradients<tensor_view<float>, In...>, gradients_for<tensor_view<float>, Plan>>,
                "lina::cuda::emulate_gradient_into: `into` must be cuda::emulate_gradient_views(plan) of this plan");
  if constexpr (diagnose::gradient_into_plan<!detail::forward_plan<Plan>::stacked>::ok) {
    detail::refuse_shared_gradients<Plan>(into, dout, bindings...);
    detail::copy_gradients(into, emulate_gradient(plan, opt, dout, bindings...));
  }
}

// ---- packed sequences' gradients ----
// emulate_gradient(plan, opts, dout, seqs, Q = q, …) and gradient(plan, dout,
// stream, [tiles,] seqs, Q = dq, …): each sequence's gradients in place. Where
// one launch serves the pack (one_launch: backward programs whose buffers are
// all by rows — a linear plan without W — and no sequence long enough to want
// splitting), its backward launches run once for all sequences, each block
// on its sequence's rows; otherwise each sequence's own (a batch of one), an
// input cut into sequences getting its rows, one every sequence reads whole
// (W, or K and V of a cross-attention) the sum of the sequences' shares, in
// sequence order.
namespace detail {
template <class Plan, class Tensor, class... In, class Dout, class Grad, class Add, class... B>
void packed_gradients(gradients<Tensor, In...>& g, Dout const& dout, sequences const& seqs, Grad const& grad,
                      Add const& add, B const&... bindings) {
  using N = packed_dim<Plan>;
  for (std::size_t s = 0; s < seqs.count(); ++s) {
    auto gs = grad(view_of(dout).rows(seqs.begin(s), seqs.length(s)),
                   sequence_binding<N, inputs_of<Plan>>(bindings, seqs, s)...);
    std::size_t i = 0;
    ((add(cut_input<N, In> ? g.all()[i].view().rows(seqs.begin(s), seqs.length(s))
                           : g.all()[i].view(),
          std::as_const(gs.all()[i]).view()),
      ++i),
     ...);
  }
}
// g's tensors, each shaped like its input: make(shape).
template <class Plan, class Tensor, class... In, class Bound, class Make>
void shaped_gradients(gradients<Tensor, In...>& g, Bound const& in, Make const& make) {
  std::size_t i = 0;
  ((g.all()[i++] = make(in.views[Bound::template input_index<In>()].shape())), ...);
}
}  // namespace detail

// Packed sequences' gradients into the caller's views (as gradient_into, the
// pack as gradient takes it): the backward's launches once for the pack where
// one launch serves it, else sequence by sequence, each writing its rows of
// the views (a sum over sequences, as ∂W, through one buffer per such input:
// not a tensor per sequence). Every view is checked before anything runs.
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, void* stream,
                   tile_request tiles, sequences const& seqs, B const&... bindings) {
  static_assert(std::is_same_v<gradients<device_view<T>, In...>, gradients_for<device_view<T>, Plan>>,
                "lina::cuda::gradient_into: `into` must be cuda::gradient_views<T>(plan) of this plan");
  if constexpr (diagnose::gradient_into_plan<!detail::forward_plan<Plan>::stacked>::ok) {
    check_tile_request(tiles);
    auto in = bind<Plan>(bindings...);
    static_assert(diagnose::device_bindings<is_device_view<typename decltype(in)::view_type>>::ok || true);
    check_packed<packed_dim<Plan>>(in, seqs);
    detail::check_dout<Plan>(view_of(dout).shape(), in);
    detail::check_into(into, in);
    char const* call = "cuda::gradient_into";
    detail::refuse_shared_gradients(into, in, dout, call);
    int const sms = require_device(call).sms;
    if (detail::one_launch(plan, detail::device_options<T, T>(tiles), in, seqs, false, sms, true)) {
      detail::gradient_impl(plan, dout, stream, tiles, static_cast<void const*>(nullptr), &seqs, &into, bindings...);
      return;
    }
    std::vector<tensor<T>> shares;  // (one per input read whole; its adds are queued before the next sequence writes it)
    detail::packed_into<Plan>(
        into, dout, seqs,
        [&](auto& mine, auto const& d, auto const&... b) {
          detail::gradient_impl(plan, d, stream, tiles, static_cast<void const*>(nullptr), nullptr, &mine, b...);
        },
        [&](shape4 sh) { return shares.emplace_back(sh, call).view(); },
        [&](device_view<T> v) { detail::zero_view(v, stream, call); },
        [&](device_view<T> to, device_view<T> from) { detail::add_into(to, device_view<T const>(from), stream); },
        bindings...);
    if (!shares.empty()) synchronize_stream(stream, call);  // the shares die with this call
  }
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, void* stream,
                   sequences const& seqs, B const&... bindings) {
  gradient_into(plan, into, dout, stream, tile_request{}, seqs, bindings...);
}
// The same through the emulation, into host views.
template <class Plan, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_gradient_into(Plan const& plan, options opt, gradients<tensor_view<float>, In...>& into, Dout const& dout,
                           sequences const& seqs, B const&... bindings) {
  static_assert(std::is_same_v<gradients<tensor_view<float>, In...>, gradients_for<tensor_view<float>, Plan>>,
                "lina::cuda::emulate_gradient_into: `into` must be cuda::emulate_gradient_views(plan) of this plan");
  if constexpr (diagnose::gradient_into_plan<!detail::forward_plan<Plan>::stacked>::ok) {
    auto in = bind<Plan>(bindings...);
    check_packed<packed_dim<Plan>>(in, seqs);
    detail::check_dout<Plan>(view_of(dout).shape(), in);
    detail::check_into(into, in);
    detail::refuse_shared_gradients(into, in, dout, "cuda::emulate_gradient_into");
    if (detail::one_launch(plan, opt, in, seqs, false, 0, true)) {
      detail::copy_gradients(into, detail::emulate_gradient_impl(plan, opt, dout, static_cast<void const*>(nullptr),
                                                                 &seqs, bindings...));
      return;
    }
    std::vector<lina::tensor<float>> shares;
    detail::packed_into<Plan>(
        into, dout, seqs,
        [&](auto& mine, auto const& d, auto const&... b) { emulate_gradient_into(plan, opt, mine, d, b...); },
        [&](shape4 sh) { return shares.emplace_back(sh).view(); },
        [](tensor_view<float> v) { for_each_index(v.shape(), [&](auto... x) { v(x...) = 0; }); },
        [](tensor_view<float> to, tensor_view<float> from) {
          for_each_index(to.shape(), [&](auto... x) { to(x...) += from(x...); });
        },
        bindings...);
  }
}

template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto emulate_gradient(Plan const& plan, options opt, Dout const& dout, sequences const& seqs, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  check_packed<packed_dim<Plan>>(in, seqs);
  detail::check_dout<Plan>(view_of(dout).shape(), in);
  if (detail::one_launch(plan, opt, in, seqs, false, 0, true))
    return detail::emulate_gradient_impl(plan, opt, dout, static_cast<void const*>(nullptr), &seqs, bindings...);
  gradients_for<lina::tensor<float>, Plan> g;
  detail::shaped_gradients<Plan>(g, in, [](shape4 sh) { return lina::tensor<float>(sh); });  // (zeros)
  detail::packed_gradients<Plan>(
      g, dout, seqs, [&](auto const& d, auto const&... b) { return emulate_gradient(plan, opt, d, b...); },
      [](tensor_view<float> to, tensor_view<float const> from) {
        for_each_index(to.shape(), [&](auto... x) { to(x...) += from(x...); });
      },
      bindings...);
  return g;
}

template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, void* stream, tile_request tiles, sequences const& seqs,
              B const&... bindings) {
  check_tile_request(tiles);
  auto in = bind<Plan>(bindings...);
  static_assert(diagnose::device_bindings<is_device_view<typename decltype(in)::view_type>>::ok || true);
  using T = std::remove_const_t<typename decltype(in)::value_type>;
  check_packed<packed_dim<Plan>>(in, seqs);
  detail::check_dout<Plan>(view_of(dout).shape(), in);
  char const* call = "cuda::gradient";
  int const sms = require_device(call).sms;
  if (detail::one_launch(plan, detail::device_options<T, T>(tiles), in, seqs, false, sms, true))
    return detail::gradient_impl(plan, dout, stream, tiles, static_cast<void const*>(nullptr), &seqs,
                                 static_cast<void*>(nullptr), bindings...);
  gradients_for<tensor<T>, Plan> g;
  if constexpr (!detail::forward_plan<Plan>::stacked) {  // sequence by sequence into g: no tensors per sequence
    detail::shaped_gradients<Plan>(g, in, [&](shape4 sh) { return tensor<T>(sh, call); });  // (every element written)
    auto into = gradient_views<T>(plan);
    for (std::size_t i = 0; i < g.all().size(); ++i) into.all()[i] = g.all()[i].view();
    gradient_into(plan, into, dout, stream, tiles, seqs, bindings...);
  } else {  // (a stack: each sequence's layers through cuda::gradient, added into zeros)
    detail::shaped_gradients<Plan>(g, in, [&](shape4 sh) {
      tensor<T> t(sh, call);
      if (t.bytes() > 0) fill_zero(t.data(), t.bytes(), stream, call);
      return t;
    });
    detail::packed_gradients<Plan>(
        g, dout, seqs, [&](auto const& d, auto const&... b) { return gradient(plan, d, stream, tiles, b...); },
        [&](device_view<T> to, device_view<T const> from) { detail::add_into(to, from, stream); }, bindings...);
  }
  return g;
}
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, void* stream, sequences const& seqs, B const&... bindings) {
  return gradient(plan, dout, stream, tile_request{}, seqs, bindings...);
}
// The chained form on the device (device states; see emulate_gradient), packed
// or not; gradient_into's chained forms write the inputs' gradients into the
// caller's views and return ∂initial.
namespace detail {
template <class Plan, class Into, class Dout, class... B>
auto chained_gradient(Plan const& plan, Into* into, Dout const& dout, state const& initial, state const& d_final,
                      void* stream, tile_request tiles, sequences const* seqs, B const&... bindings) {
  auto linear = longest_branch(plan);
  static_assert(detail::chainable<decltype(linear)>() || true);
  if constexpr (!std::is_void_v<Into>)  // (gradient_into)
    static_assert(diagnose::gradient_into_plan<!forward_plan<decltype(linear)>::stacked>::ok || true);
  auto const in = bind<decltype(linear)>(bindings...);
  state d_initial(memory::device);
  auto g = detail::chain_layers(linear, initial, d_final, d_initial, seqs ? seqs->count() : in.batch, in.heads,
                                [&](detail::chain_states const* c) {
                                  return detail::gradient_impl(linear, dout, stream, tiles, c, seqs, into, bindings...);
                                });
  return std::pair{std::move(g), std::move(d_initial)};
}
}  // namespace detail
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, state const& initial, state const& d_final, void* stream,
              tile_request tiles, B const&... bindings) {
  return detail::chained_gradient(plan, static_cast<void*>(nullptr), dout, initial, d_final, stream, tiles, nullptr,
                                  bindings...);
}
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, state const& initial, state const& d_final, void* stream,
              B const&... bindings) {
  return gradient(plan, dout, initial, d_final, stream, tile_request{}, bindings...);
}
// Packed sequences chained, on the device (see emulate_gradient).
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, state const& initial, state const& d_final, void* stream,
              tile_request tiles, sequences const& seqs, B const&... bindings) {
  return detail::chained_gradient(plan, static_cast<void*>(nullptr), dout, initial, d_final, stream, tiles, &seqs,
                                  bindings...);
}
template <class Plan, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto gradient(Plan const& plan, Dout const& dout, state const& initial, state const& d_final, void* stream,
              sequences const& seqs, B const&... bindings) {
  return gradient(plan, dout, initial, d_final, stream, tile_request{}, seqs, bindings...);
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
state gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, state const& initial,
                    state const& d_final, void* stream, tile_request tiles, B const&... bindings) {
  static_assert(std::is_same_v<gradients<device_view<T>, In...>, gradients_for<device_view<T>, Plan>>,
                "lina::cuda::gradient_into: `into` must be cuda::gradient_views<T>(plan) of this plan");
  return detail::chained_gradient(plan, &into, dout, initial, d_final, stream, tiles, nullptr, bindings...).second;
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
state gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, state const& initial,
                    state const& d_final, void* stream, B const&... bindings) {
  return gradient_into(plan, into, dout, initial, d_final, stream, tile_request{}, bindings...);
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
state gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, state const& initial,
                    state const& d_final, void* stream, tile_request tiles, sequences const& seqs, B const&... bindings) {
  static_assert(std::is_same_v<gradients<device_view<T>, In...>, gradients_for<device_view<T>, Plan>>,
                "lina::cuda::gradient_into: `into` must be cuda::gradient_views<T>(plan) of this plan");
  return detail::chained_gradient(plan, &into, dout, initial, d_final, stream, tiles, &seqs, bindings...).second;
}
template <class Plan, class T, class... In, class Dout, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
state gradient_into(Plan const& plan, gradients<device_view<T>, In...>& into, Dout const& dout, state const& initial,
                    state const& d_final, void* stream, sequences const& seqs, B const&... bindings) {
  return gradient_into(plan, into, dout, initial, d_final, stream, tile_request{}, seqs, bindings...);
}
// The chained forms through the emulation, into host views (`rest`: [seqs,] bindings).
template <class Plan, class... In, class Dout, class... Rest>
  requires is_node<Plan>
state emulate_gradient_into(Plan const& plan, options opt, gradients<tensor_view<float>, In...>& into, Dout const& dout,
                            state const& initial, state const& d_final, Rest const&... rest) {
  static_assert(std::is_same_v<gradients<tensor_view<float>, In...>, gradients_for<tensor_view<float>, Plan>>,
                "lina::cuda::emulate_gradient_into: `into` must be cuda::emulate_gradient_views(plan) of this plan");
  static_assert(diagnose::gradient_into_plan<!detail::forward_plan<decltype(longest_branch(plan))>::stacked>::ok || true);
  detail::refuse_shared_gradients<decltype(longest_branch(plan))>(into, dout, rest...);
  auto [g, d_initial] = emulate_gradient(plan, opt, dout, initial, d_final, rest...);
  detail::copy_gradients(into, g);
  return std::move(d_initial);
}

// ---- recurrent mode: decoding one token at a time -----------------------------------------
// A causal plan run token by token on this backend (cpu::recurrent's
// counterpart): the paper's RNN, at constant cost per token.
//
//   auto rnn = cuda::recurrent(plan, B, H, {cuda::dtype::bf16, cuda::dtype::bf16});  // device state
//   rnn.prefill_into(out, stream, Q = q, K = k, V = v);     // a prompt of any length
//   rnn.step_into(out1, stream, Q = q1, K = k1, V = v1);    // one token per sequence: [B, H, 1, ·]
//
// Both continue one cuda::state, so any mix of prompts and steps gives what
// one evaluation of all the tokens gives. The B sequences may stand at
// different positions: the running sums do not depend on the position. A
// prompt runs the chunked kernel (T = 64 where it fits), a step the
// step-sized one (T = 16: one row is read, so the shorter chunk frees shared
// memory for more blocks per SM), both generated from the plan; every (batch,
// head, M tile) is a block of one launch.
//
// In device memory (the default) the views bound must hold the element types
// the options name (else std::invalid_argument before any launch); the step
// kernel is compiled and loaded at the first step (prepared_kernel), so after
// it a step emits, compiles and allocates nothing on the host: it checks the
// shapes and the pointers and launches. The state keeps its sums in two
// buffers and each step reads one and writes the other (cuda::state): the
// same bytes as an update in place, which the blocks of one (batch, head)
// cannot do safely when M spans several tiles (they share z).
// In host memory (memory::host) both run through the host emulation of the
// same kernels, on float tensors read as the options' input type.
template <class L>
class rnn {
 public:
  rnn(L plan, std::size_t batch, std::size_t heads, options opt, memory where)
      : plan_(plan), opt_(opt), state_(plan_, batch, heads, where) {}

  // One token per sequence, every input [B, H, 1, ·], into out [B, H, 1, M]:
  // on the device (device views, on `stream`) ...
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void step_into(device_view<O> out, void* stream, B const&... bindings) {
    run_on_device(out, stream, true, nullptr, "cuda::recurrent::step_into", bindings...);
  }
  // ... or through the host emulation (float tensors; a host state).
  template <class... B>
    requires(is_binding<B> && ...)
  void step_into(tensor_view<float> out, B const&... bindings) {
    run_on_host(out, true, nullptr, "cuda::recurrent::step_into", bindings...);
  }
  // The same into a new tensor: on the device a cuda::tensor of the inputs'
  // element type (so the options' output type must be it, else the check of
  // step_into throws), on the host a float tensor.
  template <class... B>
    requires(is_binding<B> && ...)
  auto step(void* stream, B const&... bindings) {
    auto in = bind<L>(bindings...);
    tensor<typename decltype(in)::value_type> out(result_shape<L>(in), "cuda::recurrent::step");
    step_into(out.view(), stream, bindings...);
    return out;
  }
  template <class... B>
    requires(is_binding<B> && ...)
  lina::tensor<float> step(B const&... bindings) {
    auto in = bind<L>(bindings...);
    lina::tensor<float> out(result_shape<L>(in));
    step_into(out.view(), bindings...);
    return out;
  }

  // A block of tokens of any length (a prompt), into out [B, H, N, M].
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void prefill_into(device_view<O> out, void* stream, B const&... bindings) {
    run_on_device(out, stream, false, nullptr, "cuda::recurrent::prefill_into", bindings...);
  }
  template <class... B>
    requires(is_binding<B> && ...)
  void prefill_into(tensor_view<float> out, B const&... bindings) {
    run_on_host(out, false, nullptr, "cuda::recurrent::prefill_into", bindings...);
  }
  // Prompts of different lengths packed end to end (lina/sequences.hpp): one
  // per sequence of the batch, each into its own row of the state (inputs
  // [1, H, ΣN, ·], out [1, H, ΣN, M]); then steps continue every sequence
  // from its own position.
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void prefill_into(device_view<O> out, void* stream, sequences const& seqs, B const&... bindings) {
    run_on_device(out, stream, false, &seqs, "cuda::recurrent::prefill_into", bindings...);
  }
  template <class... B>
    requires(is_binding<B> && ...)
  void prefill_into(tensor_view<float> out, sequences const& seqs, B const&... bindings) {
    run_on_host(out, false, &seqs, "cuda::recurrent::prefill_into", bindings...);
  }

  // Zero the running sums (on `stream` for a device state), as if no token had been seen.
  void reset(void* stream = nullptr) { state_.reset(stream); }
  lina::cuda::state const& state() const noexcept { return state_; }
  lina::cuda::state& state() noexcept { return state_; }
  // Restore a saved state (cuda::to_device / to_host of another one): it must
  // come from this plan, batch and heads (state_error, shape_error otherwise).
  void set_state(lina::cuda::state s) {
    s.check_replaces(state_);
    if (s.where() != state_.where())
      throw std::invalid_argument(
          "lina::cuda::recurrent::set_state: the state is in the other memory; copy it with cuda::to_device or "
          "cuda::to_host");
    state_ = std::move(s);
  }
  L const& plan() const noexcept { return plan_; }
  options const& element_types() const noexcept { return opt_; }

 private:
  using F = detail::forward_plan<L>;

  template <class Bound>
  static void check_one_token(Bound const& in) {
    using seq = scanned_dim<L>;
    constexpr std::size_t k = Bound::table_type::template index_of<seq>();
    if (in.table.value[k] != 1)
      throw shape_error(in.table.bound_by[k], seq::label(), in.table.value[k], 1, "(a step takes one token)");
  }

  // A step or a prompt (seqs: packed prompts, one per state row).
  template <class... B>
  void run_on_host(tensor_view<float> out, bool step, sequences const* seqs, char const* call, B const&... bindings) {
    auto in = bind<L>(bindings...);
    check_result_shape<L>(out.shape(), in);
    detail::refuse_shared_memory(out, in, "the output", call);
    if (step) check_one_token(in);
    if (state_.where() != memory::host)
      throw std::invalid_argument(std::string("lina::") + call +
                                  ": the state is in device memory; bind device views and give a stream, or make the "
                                  "recurrent with cuda::memory::host");
    if (seqs) {
      detail::chained_sequences(
          plan_, out, state_, *seqs, nullptr, call,
          [&](auto const& one) { return detail::one_launch(plan_, opt_, one, *seqs, true, 0); },
          [&](tensor_view<float> rows, auto const& one, detail::run_with w) { detail::emulate_bound(plan_, opt_, rows, one, w); },
          bindings...);
      return;
    }
    state_.prepare(plan_, in, nullptr, call);
    detail::emulate_bound(plan_, opt_, out, in, {.st = &state_, .step = step});
    state_.flip();
  }

  template <class O, class... B>
  void run_on_device(device_view<O> out, void* stream, bool step, sequences const* seqs, char const* call,
                     B const&... bindings) {
    static_assert(!std::is_const_v<O>, "lina::cuda::recurrent: the output view must be writable");
    auto in = bind<L>(bindings...);
    using Bound = decltype(in);
    static_assert(diagnose::device_bindings<is_device_view<typename Bound::view_type>>::ok || true);
    if constexpr (is_device_view<typename Bound::view_type>) {
      check_result_shape<L>(out.shape(), in);
      detail::refuse_shared_memory(out, in, "the output", call);
      if (step) check_one_token(in);
      if (state_.where() != memory::device)
        throw std::invalid_argument(std::string("lina::") + call +
                                    ": the state is in host memory; bind float host tensors (the emulation), or make "
                                    "the recurrent with cuda::memory::device");
      using T = typename Bound::value_type;
      if (dtype_of<T> != opt_.in || dtype_of<O> != opt_.out)
        throw std::invalid_argument(std::string("lina::") + call + ": the inputs are " +
                                    std::string(name_of(dtype_of<T>)) + " and the output " +
                                    std::string(name_of(dtype_of<O>)) + "; this recurrent was made for " +
                                    std::string(name_of(opt_.in)) + " inputs and a " + std::string(name_of(opt_.out)) +
                                    " output");
      int const sms = require_device(call).sms;
      if (seqs) {
        detail::chained_sequences(
            plan_, out, state_, *seqs, stream, call,
            [&](auto const& one) { return detail::one_launch(plan_, opt_, one, *seqs, true, sms); },
            [&](device_view<O> rows, auto const& one, detail::run_with w) {
              detail::launch_bound(plan_, rows, one, stream, opt_.tiles, call, w);
            },
            bindings...);
        return;
      }
      state_.prepare(plan_, in, stream, call);
      forward_args a = detail::device_args<F>(out, in);
      a.state_in = state_.kernel_in();
      a.state_out = state_.kernel_out();
      if (!step) {
        attention_spec s = detail::bound_spec(plan_, opt_, in);
        s.chained = true;
        launch(program_of(s), a, stream);
      } else {
        std::size_t const d = static_cast<std::size_t>(F::q::input::cols::extent(in.table));
        std::size_t const m = static_cast<std::size_t>(F::v::input::cols::extent(in.table));
        if (!kernel_ || kernel_->prog().spec.d != d || kernel_->prog().spec.m != m) {  // the first step
          attention_spec s = detail::bound_spec(plan_, opt_, in);
          s.chained = true;
          s.step = true;
          kernel_.emplace(program_of(s));
        }
        kernel_->launch(a, stream);
      }
      state_.flip();
    }
  }

  L plan_;
  options opt_;
  lina::cuda::state state_;
  std::optional<prepared_kernel> kernel_;
};

// A stack run token by token (recurrent of a stacked plan): a recurrent per
// layer, run in through_layers' order, the lowest first — each step launches
// each layer's step kernel in turn, a prompt each layer's chunked one. A lower
// layer's rows are kept in the inputs' type (options {in, in}: as a stacked
// evaluate stores its intermediates), the top writes opt.out. A step's
// intermediate rows live in a buffer made at the first step (after it a step
// allocates nothing); a prompt's, for the call.
template <class L>
class stack_rnn {
  using layer = typename detail::forward_plan<L>::layer;
  using Sub = detail::first_layer<L>;
  using Rest = detail::rest_of<L>;
  template <class P>
  using part = std::conditional_t<detail::forward_plan<P>::stacked, stack_rnn<P>, rnn<P>>;
  static constexpr std::size_t below_layers = detail::layer_count<Sub>();

 public:
  stack_rnn(L plan, std::size_t batch, std::size_t heads, options opt, memory where)
      : plan_(plan),
        below_(detail::subtree<Sub>(plan), batch, heads, options{opt.in, opt.in, opt.exact_products, opt.split_rows, opt.tiles},
               where),
        rest_(detail::replace_subtree<Sub>(plan, node<typename layer::input>{}), batch, heads, opt, where) {}

  // One token per sequence ([B, H, 1, ·]) on the device or through the emulation, as rnn's.
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void step_into(device_view<O> out, void* stream, B const&... bindings) {
    using T = element_of<B...>;
    layer_by_layer(
        out,
        [&](shape4 sh) {
          std::size_t const bytes = sh[0] * sh[1] * sh[2] * sh[3] * sizeof(T);
          if (!step_rows_ || step_bytes_ != bytes) step_rows_.emplace(bytes, "cuda::recurrent::step_into"), step_bytes_ = bytes;
          return device_view<T>(static_cast<T*>(step_rows_->get()), sh);
        },
        [&](auto rows, auto const&... b) { below_.step_into(rows, stream, b...); },
        [&](auto const&... b) { rest_.step_into(out, stream, b...); }, bindings...);
  }
  template <class... B>
    requires(is_binding<B> && ...)
  void step_into(tensor_view<float> out, B const&... bindings) {
    layer_by_layer(
        out,
        [&](shape4 sh) {
          if (host_rows_.shape() != sh) host_rows_ = lina::tensor<float>(sh);
          return host_rows_.view();
        },
        [&](auto rows, auto const&... b) { below_.step_into(rows, b...); },
        [&](auto const&... b) { rest_.step_into(out, b...); }, bindings...);
  }
  template <class... B>
    requires(is_binding<B> && ...)
  auto step(void* stream, B const&... bindings) {
    tensor<element_of<B...>> out(result_shape<L>(bind<L>(bindings...)), "cuda::recurrent::step");
    step_into(out.view(), stream, bindings...);
    return out;
  }
  template <class... B>
    requires(is_binding<B> && ...)
  lina::tensor<float> step(B const&... bindings) {
    lina::tensor<float> out(result_shape<L>(bind<L>(bindings...)));
    step_into(out.view(), bindings...);
    return out;
  }

  // A prompt of any length ([B, H, N, ·]); its intermediate rows are made for the call.
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void prefill_into(device_view<O> out, void* stream, B const&... bindings) {
    std::optional<tensor<element_of<B...>>> held;
    layer_by_layer(
        out, [&](shape4 sh) { return held.emplace(sh, "cuda::recurrent::prefill_into").view(); },
        [&](auto rows, auto const&... b) { below_.prefill_into(rows, stream, b...); },
        [&](auto const&... b) { rest_.prefill_into(out, stream, b...); }, bindings...);
    synchronize_stream(stream, "cuda::recurrent::prefill_into");  // (the intermediates die with the call)
  }
  template <class... B>
    requires(is_binding<B> && ...)
  void prefill_into(tensor_view<float> out, B const&... bindings) {
    std::optional<lina::tensor<float>> held;
    layer_by_layer(
        out, [&](shape4 sh) { return held.emplace(sh).view(); },
        [&](auto rows, auto const&... b) { below_.prefill_into(rows, b...); },
        [&](auto const&... b) { rest_.prefill_into(out, b...); }, bindings...);
  }
  // Prompts of different lengths packed end to end, one per sequence (rnn's
  // prefill_into with sequences), layer by layer over the whole pack.
  template <class O, class... B>
    requires(is_binding<B> && ...)
  void prefill_into(device_view<O> out, void* stream, sequences const& seqs, B const&... bindings) {
    std::optional<tensor<element_of<B...>>> held;
    layer_by_layer(
        out, [&](shape4 sh) { return held.emplace(sh, "cuda::recurrent::prefill_into").view(); },
        [&](auto rows, auto const&... b) { below_.prefill_into(rows, stream, seqs, b...); },
        [&](auto const&... b) { rest_.prefill_into(out, stream, seqs, b...); }, bindings...);
    synchronize_stream(stream, "cuda::recurrent::prefill_into");
  }
  template <class... B>
    requires(is_binding<B> && ...)
  void prefill_into(tensor_view<float> out, sequences const& seqs, B const&... bindings) {
    std::optional<lina::tensor<float>> held;
    layer_by_layer(
        out, [&](shape4 sh) { return held.emplace(sh).view(); },
        [&](auto rows, auto const&... b) { below_.prefill_into(rows, seqs, b...); },
        [&](auto const&... b) { rest_.prefill_into(out, seqs, b...); }, bindings...);
  }

  // Zero every layer's sums.
  void reset(void* stream = nullptr) {
    below_.reset(stream);
    rest_.reset(stream);
  }
  // Layer k's state (k = 0: the lowest), as state::layer(k) of a chained stack.
  lina::cuda::state const& state(std::size_t k) const {
    if (k >= detail::layer_count<L>())
      throw std::out_of_range("lina::cuda::recurrent::state: the stack has " + std::to_string(detail::layer_count<L>()) +
                              " layers, not " + std::to_string(k + 1));
    return k < below_layers ? layer_state(below_, k) : layer_state(rest_, k - below_layers);
  }
  // Restore a stack's state — a chained evaluation's (a prompt prefilled in
  // parallel by evaluate with a cuda::state) or a copy of one: layer k from
  // s.layer(k). Every layer is checked (plan, batch, heads, memory) before any
  // changes: state_error, shape_error or std::invalid_argument as rnn's.
  void set_state(lina::cuda::state s) {
    std::size_t const n = detail::layer_count<L>();
    if (!s.belongs_to(typeid(L)) || s.layers() != n)
      throw state_error("this state belongs to " + (s.unbound() ? std::string("no plan yet") : "the plan " + s.plan()) +
                        ", not to the stack " + to_string(plan_));
    for (std::size_t k = 0; k < n; ++k) {
      s.layer(k).check_replaces(state(k));
      if (s.layer(k).where() != state(k).where())
        throw std::invalid_argument(
            "lina::cuda::recurrent::set_state: the state is in the other memory; copy it with cuda::to_device or "
            "cuda::to_host");
    }
    adopt(s, 0);
  }
  L const& plan() const noexcept { return plan_; }

 private:
  template <class>
  friend class stack_rnn;
  // Each layer's recurrent takes its state from s.layer(first + its index), checked.
  void adopt(lina::cuda::state& s, std::size_t first) {
    take(below_, s, first);
    take(rest_, s, first + below_layers);
  }
  template <class P>
  static void take(P& p, lina::cuda::state& s, std::size_t first) {
    if constexpr (detail::forward_plan<std::remove_cvref_t<decltype(p.plan())>>::stacked)
      p.adopt(s, first);
    else
      p.set_state(std::move(s.layer(first)));
  }

  template <class... B>
  using element_of = std::remove_const_t<typename decltype(bind<L>(std::declval<B const&>()...))::value_type>;

  // The stack on these bindings into out: the layer below writes rows(its
  // result's shape) by below(those rows, its bindings...), read by the rest
  // as its input; above(its bindings...) writes out.
  template <class Out, class Rows, class Below, class Above, class... B>
  void layer_by_layer(Out const& out, Rows&& rows, Below const& below, Above const& above, B const&... bindings) {
    check_result_shape<L>(out.shape(), bind<L>(bindings...));
    detail::through_layers(
        plan_,
        [&](auto const& sub, auto const&... b) {
          using P = std::remove_cvref_t<decltype(sub)>;
          auto mid = rows(result_shape<P>(bind<P>(b...)));
          below(mid, b...);
          return read_only(mid);
        },
        [&](auto const&, auto const&... b) { above(b...); }, bindings...);
  }
  template <class E>
  static device_view<E const> read_only(device_view<E> v) { return v; }
  static tensor_view<float const> read_only(tensor_view<float> v) { return v; }

  template <class P>
  static lina::cuda::state const& layer_state(P const& p, std::size_t k) {
    if constexpr (requires { p.state(k); })
      return p.state(k);
    else
      return p.state();
  }

  L plan_;
  part<Sub> below_;
  part<Rest> rest_;
  std::optional<device_buffer> step_rows_;  // a step's intermediate rows, kept
  std::size_t step_bytes_ = 0;
  lina::tensor<float> host_rows_;
};

// recurrent(plan, B, H, options, memory): the plan's linear form as an RNN
// over B × H sequences, from zero sums; its state in device memory (launches)
// or host memory (the emulation). A plan without a running state (non-causal,
// quadratic) is the compile error it is on the CPU. A stacked plan runs a
// recurrent per layer (stack_rnn above).
template <class Plan>
  requires is_node<Plan>
auto recurrent(Plan const& plan, std::size_t batch, std::size_t heads, options opt = {},
               memory where = memory::device) {
  auto linear = longest_branch(plan);
  using L = decltype(linear);
  static_assert(detail::chainable<L>() || true);
  if constexpr (detail::forward_plan<L>::stacked)
    return stack_rnn<L>(linear, batch, heads, opt, where);
  else
    return rnn<L>(linear, batch, heads, opt, where);
}

}  // namespace lina::cuda
