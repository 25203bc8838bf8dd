// The CUDA backend's entry points for plans:
//
//   cuda::spec_of(plan)                 what the kernel computes, from the plan's type
//   cuda::program_of(plan, opts, D = d, M = m)   the tile program (lina/cuda/program.hpp)
//   cuda::source(plan, opts, D = d, M = m)       the generated CUDA source
//   cuda::emulate(plan, opts, Q = q, K = k, V = v)   the result through the host emulation
//   cuda::emulate_into(plan, opts, out, Q = q, …)    the same into a view of any layout
//   cuda::evaluate_into(plan, out, stream, Q = q, …)  a launch on the GPU, on device views
//
// This header includes the DSL (Hana); the emitter, the emulation and NVRTC
// live in translation units of their own that never see it.
//
// Plans lowered so far (Map ∈ {elu+1, relu, identity, poly2}, or no φ at all; each
// with or without the normaliser rowdiv(…[V|1])):
//   causal:      contract(φ(Q), prefix(φ(K)⊗V))  or  causal(φ(Q)·φ(K)ᵀ)·V
//   non-causal:  φ(Q)·(φ(K)ᵀ·V)                  or  (φ(Q)·φ(K)ᵀ)·V
// and a select between two of these that compute the same thing (what
// compile() leaves for a dynamic N): the chunked kernel is both orders at
// once — quadratic inside a chunk, linear across chunks — so the CPU's
// crossover does not apply to it. Anything else is a compile error that says so.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "lina/bind.hpp"
#include "lina/cuda/device.hpp"
#include "lina/cuda/emit.hpp"
#include "lina/cuda/emulate.hpp"
#include "lina/cuda/numeric.hpp"
#include "lina/cuda/program.hpp"
#include "lina/feature_maps.hpp"
#include "lina/format.hpp"
#include "lina/node.hpp"
#include "lina/tensor.hpp"

namespace lina::cuda {

// Element types of one generated kernel: inputs are given as float tensors
// and read as if stored in `in` (rounded to it, to nearest even); the result
// is rounded to `out` and handed back as float.
struct options {
  dtype in = dtype::f32;
  dtype out = dtype::f32;
};

namespace diagnose {
template <bool Supported>
struct cuda_plan {
  static_assert(Supported,
                "lina::cuda: this plan cannot be lowered to a CUDA kernel yet. Supported: causal "
                "contract(φ(Q), prefix(φ(K)⊗V)) or causal(φ(Q)·φ(K)ᵀ)·V, non-causal φ(Q)·(φ(K)ᵀ·V) or "
                "(φ(Q)·φ(K)ᵀ)·V, each optionally normalised as rowdiv(…[V|1]); φ ∈ {elu+1, relu, identity, "
                "poly2} or none (favor, random Fourier features: not yet); Q, K, V over one sequence "
                "dimension (no cross-attention yet); a select only between two such forms of one attention");
  static constexpr bool ok = Supported;
};
}  // namespace diagnose

namespace detail {

template <class Map>
inline constexpr bool known_map = false;
template <>
inline constexpr bool known_map<lina::elu_plus_one> = true;
template <>
inline constexpr bool known_map<lina::relu> = true;
template <>
inline constexpr bool known_map<lina::identity> = true;
template <>
inline constexpr bool known_map<lina::poly2> = true;
template <class Map>
constexpr feature_map map_of() {
  if constexpr (std::is_same_v<Map, lina::elu_plus_one>)
    return feature_map::elu_plus_one;
  else if constexpr (std::is_same_v<Map, lina::relu>)
    return feature_map::relu;
  else if constexpr (std::is_same_v<Map, lina::poly2>)
    return feature_map::poly2;
  else
    return feature_map::identity;
}

// φ(X) or X, for an input X.
template <class N>
struct mapped_input {
  static constexpr bool ok = false;
};
template <fixed_string Name, class R, class C>
struct mapped_input<node<op::input<Name, R, C>>> {
  static constexpr bool ok = true;
  static constexpr feature_map map = feature_map::identity;
  using input = op::input<Name, R, C>;
};
template <class Map, fixed_string Name, class R, class C>
struct mapped_input<node<op::phi<Map>, node<op::input<Name, R, C>>>> {
  static constexpr bool ok = known_map<Map>;
  static constexpr feature_map map = map_of<Map>();
  using input = op::input<Name, R, C>;
};

// V or [V|1], for an input V.
template <class N>
struct value_input {
  static constexpr bool ok = false;
};
template <fixed_string Name, class R, class C>
struct value_input<node<op::input<Name, R, C>>> {
  static constexpr bool ok = true;
  static constexpr bool ones = false;
  using input = op::input<Name, R, C>;
};
template <fixed_string Name, class R, class C>
struct value_input<node<op::append_ones, node<op::input<Name, R, C>>>> {
  static constexpr bool ok = true;
  static constexpr bool ones = true;
  using input = op::input<Name, R, C>;
};

// The attention core below an optional rowdiv: (φQ, φK, V) and causal or not.
template <class A, class B, class C, bool Causal>
struct core_parts {
  using q = mapped_input<A>;
  using k = mapped_input<B>;
  using v = value_input<C>;
  static constexpr bool causal = Causal;
  static constexpr bool ok = [] {
    if constexpr (q::ok && k::ok && v::ok) {
      using QI = typename q::input;
      using KI = typename k::input;
      using VI = typename v::input;
      return std::is_same_v<typename QI::rows, typename KI::rows> &&
             std::is_same_v<typename KI::rows, typename VI::rows> && std::is_same_v<typename QI::cols, typename KI::cols>;
    } else {
      return false;
    }
  }();
};

template <class N>
struct core {
  static constexpr bool ok = false;
};
// contract(φQ, prefix(φK⊗V))
template <class A, class B, class C>
struct core<node<op::contract_rows, A, node<op::prefix_scan, node<op::outer_rows, B, C>>>> : core_parts<A, B, C, true> {};
// causal(φQ·φKᵀ)·V
template <class A, class B, class C>
struct core<node<op::product, node<op::causal, node<op::product, A, node<op::transpose, B>>>, C>>
    : core_parts<A, B, C, true> {};
// φQ·(φKᵀ·V)
template <class A, class B, class C>
struct core<node<op::product, A, node<op::product, node<op::transpose, B>, C>>> : core_parts<A, B, C, false> {};
// (φQ·φKᵀ)·V
template <class A, class B, class C>
struct core<node<op::product, node<op::product, A, node<op::transpose, B>>, C>> : core_parts<A, B, C, false> {};

template <class X, class Y>
constexpr bool same_attention() {
  if constexpr (X::ok && Y::ok)
    return X::causal == Y::causal && X::q::map == Y::q::map && X::k::map == Y::k::map && X::v::ones == Y::v::ones &&
           std::is_same_v<typename X::q::input, typename Y::q::input> &&
           std::is_same_v<typename X::k::input, typename Y::k::input> &&
           std::is_same_v<typename X::v::input, typename Y::v::input>;
  else
    return false;
}
template <class Key, std::size_t T, class S, class L>
struct core<node<op::select<Key, T>, S, L>> : core<L> {
  static constexpr bool ok = same_attention<core<S>, core<L>>();
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
    s.map_q = F::q::map;
    s.map_k = F::k::map;
    s.eps = F::eps(plan);
    s.d = QI::cols::is_static ? QI::cols::static_extent : 0;
    s.m = VI::cols::is_static ? VI::cols::static_extent : 0;
    s.q_name = std::string(QI::name.view());
    s.k_name = std::string(KI::name.view());
    s.v_name = std::string(VI::name.view());
  }
  s.in = opt.in;
  s.out = opt.out;
  s.description = to_string(plan);
  return s;
}

// The tile program of `plan` at these extents (D = d, M = m where dynamic).
template <class Plan, class... E>
program program_of(Plan const& plan, options opt, E const&... extents) {
  attention_spec s = spec_of(plan, opt);
  if constexpr (detail::forward_plan<Plan>::ok) {
    using QI = typename detail::forward_plan<Plan>::q::input;
    using VI = typename detail::forward_plan<Plan>::v::input;
    s.d = detail::extent_from<typename QI::cols>("columns of Q and K", extents...);
    s.m = detail::extent_from<typename VI::cols>("columns of V", extents...);
  }
  return program_of(s);
}

// The generated CUDA source of `plan` at these extents.
template <class Plan, class... E>
std::string source(Plan const& plan, options opt, E const&... extents) {
  return emit(program_of(plan, opt, extents...));
}

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
  std::size_t x = 0;
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1]; ++h)
      for (std::size_t n = 0; n < s[2]; ++n)
        for (std::size_t c = 0; c < s[3]; ++c) store[x++] = t == dtype::bf16 ? bf16_bits(v(b, h, n, c)) : f16_bits(v(b, h, n, c));
  auto dense = tensor_view<float const>::contiguous_strides(s);
  o.data = store.data();
  for (int i = 0; i < 4; ++i) o.stride[i] = dense[static_cast<std::size_t>(i)];
  return o;
}
}  // namespace detail

// Evaluate `plan` through the host emulation of its generated kernel into
// `out` (any strided layout, e.g. a [B,N,H,M] view):
// emulate_into(plan, {.in = dtype::bf16, .out = dtype::bf16}, out, Q = q, K = k, V = v).
// Bound tensors are float (any strided layout), read as if stored in opt.in;
// the result is rounded to opt.out. An fp32 output is written by the
// emulated kernel through out's strides; a 16-bit one goes through a dense
// buffer of bit patterns, as a caller without 16-bit host types would.
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void emulate_into(Plan const& plan, options opt, tensor_view<float> out, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  static_assert(std::is_same_v<typename decltype(in)::value_type, float>,
                "lina::cuda::emulate: bind float tensors (the kernels read fp32, fp16 or bf16; see options)");
  using F = detail::forward_plan<Plan>;
  attention_spec s = spec_of(plan, opt);
  shape4 const want = result_shape<Plan>(in);
  static constexpr char const* names[] = {"B (batch)", "H (heads)", "rows", "cols"};
  for (int d = 0; d < 4; ++d)
    if (out.shape()[d] != want[d]) throw shape_error("out", names[d], out.shape()[d], want[d], "of the plan's result");
  if constexpr (F::ok) {
    using Bound = decltype(in);
    s.d = static_cast<std::size_t>(F::q::input::cols::extent(in.table));
    s.m = static_cast<std::size_t>(F::v::input::cols::extent(in.table));
    program p = program_of(s);
    std::vector<std::uint16_t> stores[3];
    forward_args a;
    a.in[0] = detail::operand_of(in.views[Bound::template input_index<typename F::q::input>()], opt.in, stores[0]);
    a.in[1] = detail::operand_of(in.views[Bound::template input_index<typename F::k::input>()], opt.in, stores[1]);
    a.in[2] = detail::operand_of(in.views[Bound::template input_index<typename F::v::input>()], opt.in, stores[2]);
    a.batch = static_cast<std::int64_t>(in.batch);
    a.heads = static_cast<std::int64_t>(in.heads);
    a.n = static_cast<std::int64_t>(F::q::input::rows::extent(in.table));
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
    emulate(p, a);
    if (opt.out != dtype::f32) {
      std::size_t x = 0;
      for (std::size_t b = 0; b < want[0]; ++b)
        for (std::size_t h = 0; h < want[1]; ++h)
          for (std::size_t n = 0; n < want[2]; ++n)
            for (std::size_t c = 0; c < want[3]; ++c, ++x)
              out(b, h, n, c) = opt.out == dtype::bf16 ? from_bf16_bits(result[x]) : from_f16_bits(result[x]);
    }
  }
}

// The same into a new float tensor [B, H, N, M].
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<float> emulate(Plan const& plan, options opt, B const&... bindings) {
  auto in = bind<Plan>(bindings...);  // (checked again by emulate_into; this sizes the result)
  tensor<float> out(result_shape<Plan>(in));
  emulate_into(plan, opt, out.view(), bindings...);
  return out;
}
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
tensor<float> emulate(Plan const& plan, B const&... bindings) {
  return emulate(plan, options{}, bindings...);
}

// ---- device memory (a first sketch: no owning tensor, no state yet) -----------------------
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

// A strided [B, H, rows, cols] view of device memory (E: float, f16, bf16,
// const or not). Binds like a host view: Q = device_view<bf16 const>(…).
template <class E>
class device_view {
  static_assert(std::is_same_v<std::remove_const_t<E>, float> || std::is_same_v<std::remove_const_t<E>, bf16> ||
                    std::is_same_v<std::remove_const_t<E>, f16>,
                "lina::cuda::device_view: elements are float, cuda::f16 or cuda::bf16");

 public:
  using element_type_ = E;
  device_view() = default;
  device_view(E* data, shape4 shape, strides4 strides) : data_(data), shape_(shape), strides_(strides) {}
  device_view(E* data, shape4 shape) : device_view(data, shape, tensor_view<E>::contiguous_strides(shape)) {}
  E* data() const noexcept { return data_; }
  shape4 const& shape() const noexcept { return shape_; }
  strides4 const& strides() const noexcept { return strides_; }

 private:
  E* data_ = nullptr;
  shape4 shape_{0, 0, 0, 0};
  strides4 strides_{0, 0, 0, 0};
};
template <class E>
device_view<E> view_of(device_view<E> const& v) {
  return v;
}

namespace detail {
template <class View>
operand device_operand(View const& v) {
  operand o;
  o.data = v.data();
  for (int i = 0; i < 4; ++i) o.stride[i] = v.strides()[static_cast<std::size_t>(i)];
  o.cols = static_cast<std::int64_t>(v.shape()[3]);
  return o;
}
}  // namespace detail

// Evaluate `plan` on the GPU into `out` (device memory of any layout), on
// `stream` (a cudaStream_t, nullptr for the default stream). Asynchronous
// like any launch; errors found before the launch (shapes, host pointers, no
// device) throw without writing to `out`.
template <class Plan, class O, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, device_view<O> out, void* stream, B const&... bindings) {
  static_assert(!std::is_const_v<O>, "lina::cuda::evaluate_into: the output view must be writable");
  auto in = bind<Plan>(bindings...);
  using F = detail::forward_plan<Plan>;
  using T = typename decltype(in)::value_type;
  attention_spec s = spec_of(plan, options{dtype_of<T>, dtype_of<O>});
  if constexpr (F::ok) {
    using Bound = decltype(in);
    shape4 want = result_shape<Plan>(in);
    static constexpr char const* names[] = {"B (batch)", "H (heads)", "rows", "cols"};
    for (int d = 0; d < 4; ++d)
      if (out.shape()[d] != want[d]) throw shape_error("out", names[d], out.shape()[d], want[d], "of the plan's result");
    s.d = static_cast<std::size_t>(F::q::input::cols::extent(in.table));
    s.m = static_cast<std::size_t>(F::v::input::cols::extent(in.table));
    forward_args a;
    a.in[0] = detail::device_operand(in.views[Bound::template input_index<typename F::q::input>()]);
    a.in[1] = detail::device_operand(in.views[Bound::template input_index<typename F::k::input>()]);
    a.in[2] = detail::device_operand(in.views[Bound::template input_index<typename F::v::input>()]);
    a.out = detail::device_operand(out);
    a.batch = static_cast<std::int64_t>(in.batch);
    a.heads = static_cast<std::int64_t>(in.heads);
    a.n = static_cast<std::int64_t>(F::q::input::rows::extent(in.table));
    launch(program_of(s), a, stream);
  }
}

}  // namespace lina::cuda
