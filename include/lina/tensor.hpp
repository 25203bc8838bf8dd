// Host tensors of rank 4, [B, H, rows, cols] by index (batch, head, row, col).
// tensor_view aliases caller memory with explicit strides (in elements), so the
// [B,H,N,D] and [B,N,H,D] layouts bind without copies; tensor<T> owns a dense
// buffer, contiguous [B,H,N,D] unless made `like` a view of another layout. Inputs bind to expression symbols by name:
// `Q = q` makes a binding<"Q", tensor_view<T const>>.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/detail/allocate.hpp"
#include "lina/fixed_string.hpp"

namespace lina {

using shape4 = std::array<std::size_t, 4>;
using strides4 = std::array<std::ptrdiff_t, 4>;

namespace detail {
// Rows [first, first + count) of every (batch, head) of a view with data(),
// shape(), strides() and the (data, shape, strides) constructor: tensor_view,
// cuda::device_view. Past the view's rows: std::out_of_range, no view made.
template <class View>
View row_block(View const& v, std::size_t first, std::size_t count) {
  std::size_t const n = v.shape()[2];
  if (first > n || count > n - first)
    throw std::out_of_range("lina: rows [" + std::to_string(first) + ", " + std::to_string(first) + " + " +
                            std::to_string(count) + ") of a view of " + std::to_string(n) + " rows");
  shape4 s = v.shape();
  s[2] = count;
  return View(v.data() + static_cast<std::ptrdiff_t>(first) * v.strides()[2], s, v.strides());
}
// The bytes a view reaches, as a base and up to four (extent, stride) pairs
// in bytes: strides made positive (the same addresses from the other end),
// dimensions of one element or of stride 0 (a broadcast) dropped.
struct memory_piece {
  std::uintptr_t base = 0;
  std::size_t element = 0;  // bytes
  int dims = 0;
  std::array<std::size_t, 4> extent{}, stride{};
  std::uintptr_t last() const {  // one past the last byte
    std::uintptr_t end = base + element;
    for (int d = 0; d < dims; ++d) end += (extent[d] - 1) * stride[d];
    return end;
  }
  template <class V>
  static memory_piece of(V const& v) {  // (element == 0: empty, or no memory)
    using E = std::remove_cv_t<std::remove_pointer_t<decltype(v.data())>>;
    memory_piece p;
    p.base = reinterpret_cast<std::uintptr_t>(v.data());
    for (int d = 0; d < 4; ++d)
      if (v.shape()[d] == 0) return {};
    if (!v.data()) return {};
    p.element = sizeof(E);
    for (int d = 0; d < 4; ++d) {
      std::ptrdiff_t const s = v.strides()[d] * static_cast<std::ptrdiff_t>(sizeof(E));
      if (v.shape()[d] == 1 || s == 0) continue;
      if (s < 0) p.base -= (v.shape()[d] - 1) * static_cast<std::size_t>(-s);  // (unsigned: wraps as the address would)
      p.extent[p.dims] = v.shape()[d];
      p.stride[p.dims++] = static_cast<std::size_t>(s < 0 ? -s : s);
    }
    return p;
  }
};
// Do two pieces reach a common byte? Where their spans meet, the piece whose
// outermost dimension (largest stride) holds slices that cannot meet each
// other is cut into them, and each slice that meets the other piece's span
// is asked again: exact for the layouts of strided tensors (heads or
// operands interleaved in one buffer share no element), up to `budget`
// slices compared; past it, or where no dimension can be cut, "may".
inline bool pieces_meet(memory_piece const& a, memory_piece const& b, std::size_t& budget) {
  if (!a.element || !b.element || a.last() <= b.base || b.last() <= a.base) return false;
  if (budget == 0) return true;
  --budget;
  auto cut = [](memory_piece const& p) {  // the dimension to cut p along, or -1
    int outer = -1;
    for (int d = 0; d < p.dims; ++d)
      if (p.extent[d] > 1 && (outer < 0 || p.stride[d] > p.stride[outer])) outer = d;
    if (outer < 0) return -1;
    memory_piece inner = p;
    inner.extent[outer] = 1;
    return inner.last() - inner.base <= p.stride[outer] ? outer : -1;  // its slices cannot meet
  };
  bool const a_wider = a.last() - a.base >= b.last() - b.base;
  memory_piece const& wide = a_wider ? a : b;
  memory_piece const& other = a_wider ? b : a;
  int d = cut(wide);
  memory_piece const& split = d >= 0 ? wide : other;
  memory_piece const& rest = d >= 0 ? other : wide;
  if (d < 0) d = cut(other);
  if (d < 0) return true;
  memory_piece slice = split;
  slice.extent[d] = 1;
  // only the slices k that reach into rest's span [r0, r1): base + k·stride < r1
  // and base + k·stride + width > r0
  std::uintptr_t const width = slice.last() - slice.base, stride = split.stride[d], r0 = rest.base, r1 = rest.last();
  std::size_t k = r0 >= split.base + width ? (r0 - split.base - width) / stride + 1 : 0;
  std::size_t const last = std::min<std::size_t>(split.extent[d] - 1, (r1 - 1 - split.base) / stride);
  for (; k <= last; ++k) {
    slice.base = split.base + k * stride;
    if (pieces_meet(slice, rest, budget)) return true;
  }
  return false;
}
// "(shape [2, 3, 10, 4], strides [120, 40, 4, 1])", for messages.
template <class V>
std::string layout_text(V const& v) {
  auto list = [](auto const& a) {
    std::string r = "[";
    for (std::size_t i = 0; i < a.size(); ++i) r += (i ? ", " : "") + std::to_string(a[i]);
    return r + "]";
  };
  return "(shape " + list(v.shape()) + ", strides " + list(v.strides()) + ")";
}
// Can two elements of one view be the same memory (a zero or an overlapping
// stride)? Its dimensions, outermost first, must each step past all that the
// dimensions inside it reach; a layout that interleaves them otherwise
// without overlap (rare) counts as overlapping too.
template <class V>
bool overlaps_itself(V const& v) {
  if (std::find(v.shape().begin(), v.shape().end(), std::size_t{0}) != v.shape().end()) return false;  // empty
  for (int d = 0; d < 4; ++d)
    if (v.shape()[d] > 1 && v.strides()[d] == 0) return true;  // (memory_piece drops these)
  memory_piece const p = memory_piece::of(v);
  for (int d = 0; d < p.dims; ++d) {
    std::size_t inner = p.element;  // bytes the dimensions inside d reach (of equal strides, the earlier)
    for (int e = 0; e < p.dims; ++e)
      if (p.stride[e] < p.stride[d] || (p.stride[e] == p.stride[d] && e < d)) inner += (p.extent[e] - 1) * p.stride[e];
    if (p.stride[d] < inner) return true;
  }
  return false;
}
// Can two views (tensor_view, cuda::device_view) reach a common byte? An
// empty view, or one without memory (null data), reaches none. (Exact for
// dimensions that nest, e.g. heads or operands interleaved in one buffer; a
// view whose dimensions overlap one another, or past 2^18 slices compared,
// counts as sharing.)
template <class V1, class V2>
bool may_share_memory(V1 const& a, V2 const& b) {
  std::size_t budget = std::size_t{1} << 18;
  return pieces_meet(memory_piece::of(a), memory_piece::of(b), budget);
}
}  // namespace detail

template <class T>
class tensor_view {
 public:
  using element_type_ = std::remove_const_t<T>;
  tensor_view() = default;
  tensor_view(T* data, shape4 shape, strides4 strides) : data_(data), shape_(shape), strides_(strides) {}
  // A contiguous [B,H,N,D] view.
  tensor_view(T* data, shape4 shape) : tensor_view(data, shape, contiguous_strides(shape)) {}

  T* data() const noexcept { return data_; }
  shape4 const& shape() const noexcept { return shape_; }
  strides4 const& strides() const noexcept { return strides_; }
  // Rows [first, first + count) of every (batch, head), in place: a block of a
  // sequence, as chained evaluation and recurrent steps take it
  // (std::out_of_range past the rows).
  tensor_view rows(std::size_t first, std::size_t count) const { return detail::row_block(*this, first, count); }
  T& operator()(std::size_t b, std::size_t h, std::size_t n, std::size_t d) const noexcept {
    return data_[static_cast<std::ptrdiff_t>(b) * strides_[0] + static_cast<std::ptrdiff_t>(h) * strides_[1] +
                 static_cast<std::ptrdiff_t>(n) * strides_[2] + static_cast<std::ptrdiff_t>(d) * strides_[3]];
  }
  operator tensor_view<T const>() const
    requires(!std::is_const_v<T>)
  {
    return {data_, shape_, strides_};
  }

  static strides4 contiguous_strides(shape4 s) {
    return {static_cast<std::ptrdiff_t>(s[1] * s[2] * s[3]), static_cast<std::ptrdiff_t>(s[2] * s[3]),
            static_cast<std::ptrdiff_t>(s[3]), 1};
  }

 private:
  T* data_ = nullptr;
  shape4 shape_{0, 0, 0, 0};
  strides4 strides_{0, 0, 0, 0};
};

// `tensor<T>(shape, lina::uninitialized)`: a tensor whose elements are not
// written before its first use, for results a call then overwrites whole
// (every evaluate and gradient that returns a new tensor: writing zeros first
// would cost a pass over memory as large as the result). Where
// LINA_POISON_UNINITIALIZED is defined (lina's tests define it) its elements
// start as quiet NaN, so that a result left partly unwritten shows.
struct uninitialized_t {
  explicit uninitialized_t() = default;
};
inline constexpr uninitialized_t uninitialized{};

template <class T>
class tensor {
  static_assert(std::is_floating_point_v<T>, "lina::tensor<T>: T must be float or double");

 public:
  tensor() = default;
  // A contiguous [B,H,N,D] tensor.
  explicit tensor(shape4 shape, T fill = T(0))
      : shape_(shape), strides_(tensor_view<T>::contiguous_strides(shape)), data_(count(shape), fill) {}
  tensor(shape4 shape, uninitialized_t) : shape_(shape), strides_(tensor_view<T>::contiguous_strides(shape)) {
    data_.resize(count(shape));  // page_allocator default-initialises: nothing written
    poison_fresh();
  }

  // A tensor with the shape of `v` whose memory is laid out in the same order
  // as v's (densely): a [B,N,H,D] view gives a [B,N,H,D] tensor.
  template <class U>
  static tensor like(tensor_view<U> const& v, T fill = T(0)) {
    tensor t = like(v, uninitialized);
    std::fill(t.data_.begin(), t.data_.end(), fill);
    return t;
  }
  // The same, its elements not written (lina::uninitialized).
  template <class U>
  static tensor like(tensor_view<U> const& v, uninitialized_t) {
    tensor t;
    t.shape_ = v.shape();
    t.data_.resize(count(v.shape()));
    t.poison_fresh();
    std::array<int, 4> dims{0, 1, 2, 3};  // innermost first after sorting
    std::stable_sort(dims.begin(), dims.end(), [&](int a, int b) {
      return std::abs(v.strides()[a]) < std::abs(v.strides()[b]) ||
             (std::abs(v.strides()[a]) == std::abs(v.strides()[b]) && a > b);
    });
    std::ptrdiff_t stride = 1;
    for (int d : dims) {
      t.strides_[d] = stride;
      stride *= static_cast<std::ptrdiff_t>(v.shape()[d]);
    }
    return t;
  }

  // Uniform in [-1, 1) from a fixed generator (splitmix64), identical on every
  // platform, so tests and examples are reproducible.
  static tensor random(shape4 shape, std::uint64_t seed) {
    tensor t(shape);
    std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    for (auto& x : t.data_) {
      std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      x = static_cast<T>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
    return t;
  }

  shape4 const& shape() const noexcept { return shape_; }
  strides4 const& strides() const noexcept { return strides_; }
  std::size_t size() const noexcept { return data_.size(); }
  T* data() noexcept { return data_.data(); }
  T const* data() const noexcept { return data_.data(); }
  T& operator()(std::size_t b, std::size_t h, std::size_t n, std::size_t d) noexcept { return data_[offset(b, h, n, d)]; }
  T const& operator()(std::size_t b, std::size_t h, std::size_t n, std::size_t d) const noexcept {
    return data_[offset(b, h, n, d)];
  }
  tensor_view<T> view() noexcept { return {data_.data(), shape_, strides_}; }
  tensor_view<T const> view() const noexcept { return {data_.data(), shape_, strides_}; }
  // Rows [first, first + count) of every (batch, head), as a view (tensor_view::rows).
  tensor_view<T> rows(std::size_t first, std::size_t count) { return view().rows(first, count); }
  tensor_view<T const> rows(std::size_t first, std::size_t count) const { return view().rows(first, count); }
  operator tensor_view<T>() noexcept { return view(); }
  operator tensor_view<T const>() const noexcept { return view(); }

 private:
  static std::size_t count(shape4 const& s) { return s[0] * s[1] * s[2] * s[3]; }
  void poison_fresh() {
#ifdef LINA_POISON_UNINITIALIZED
    std::fill(data_.begin(), data_.end(), std::numeric_limits<T>::quiet_NaN());
#endif
  }
  std::size_t offset(std::size_t b, std::size_t h, std::size_t n, std::size_t d) const noexcept {
    return static_cast<std::size_t>(static_cast<std::ptrdiff_t>(b) * strides_[0] + static_cast<std::ptrdiff_t>(h) * strides_[1] +
                                    static_cast<std::ptrdiff_t>(n) * strides_[2] + static_cast<std::ptrdiff_t>(d) * strides_[3]);
  }

  shape4 shape_{0, 0, 0, 0};
  strides4 strides_{0, 0, 0, 1};
  std::vector<T, detail::page_allocator<T>> data_;  // large ones on huge pages (detail/allocate.hpp)
};

template <class T>
tensor_view<T const> view_of(tensor<T> const& t) {
  return t.view();
}
template <class T>
tensor_view<T const> view_of(tensor_view<T> const& t) {
  return t;
}

// f(b, h, n, d) for every index of a [B, H, N, D] shape, the last fastest:
// element-wise work on views of any strides.
template <class F>
void for_each_index(shape4 const& s, F&& f) {
  for (std::size_t i = 0; i < s[0]; ++i)
    for (std::size_t j = 0; j < s[1]; ++j)
      for (std::size_t k = 0; k < s[2]; ++k)
        for (std::size_t l = 0; l < s[3]; ++l) f(i, j, k, l);
}

// Largest |a - b| over all elements of two tensors or views of equal shape;
// NaN if either holds a NaN (so a NaN is never hidden by a comparison).
template <class A, class B>
double max_abs_diff(A const& a, B const& b) {
  auto va = view_of(a);
  auto vb = view_of(b);
  if (va.shape() != vb.shape()) throw std::invalid_argument("lina::max_abs_diff: the shapes differ");
  double m = 0;
  bool nan = false;
  for_each_index(va.shape(), [&](auto... i) {
    double const d = std::abs(static_cast<double>(va(i...)) - static_cast<double>(vb(i...)));
    nan = nan || std::isnan(d);
    m = std::max(m, d);
  });
  return nan ? std::numeric_limits<double>::quiet_NaN() : m;
}

// `Q = q`: a tensor bound to the input symbol Q for one evaluation. View is
// what the backend reads: tensor_view<T const> for host memory; a backend
// with its own tensors (device memory) provides view_of(its tensor), found by
// argument-dependent lookup, returning a view type with the same interface
// (element_type_, data(), shape(), strides()). The DSL core never names it.
template <fixed_string Name, class View>
struct binding {
  static constexpr auto name = Name;
  using view_type = View;
  using value_type = std::remove_const_t<typename View::element_type_>;
  View view;
};

template <class B>
inline constexpr bool is_binding = false;
template <fixed_string Name, class View>
inline constexpr bool is_binding<binding<Name, View>> = true;

namespace concepts {
// Anything `Q = x` accepts: view_of(x) gives a rank-4 view.
template <class X>
concept bindable = requires(X const& x) {
  typename decltype(view_of(x))::element_type_;
  { view_of(x).shape() } -> std::convertible_to<shape4>;
};
}  // namespace concepts

template <fixed_string Name, class X>
  requires concepts::bindable<X>
constexpr auto make_binding(X const& x) {
  auto v = view_of(x);
  return binding<Name, decltype(v)>{v};
}

}  // namespace lina
