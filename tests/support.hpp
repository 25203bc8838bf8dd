// Helpers shared by the tests: random shapes, independent reference loops
// (written here, not with lina), and error bounds.
#pragma once

#include <doctest/doctest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <lina/errors.hpp>
#include <lina/tensor.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace test {

// CONTEXT(a, b, …): as CAPTURE(a); CAPTURE(b); … ("a, b, … := 1, 2, …"), but
// one object of one type, its text made at once. CAPTURE in a template (a
// generic lambda run for each plan and element type) makes a doctest type, and
// its functions, per capture and per instantiation: thousands in a test file,
// a good part of what its build spent. For per-trial values, not inner loops.
class context final : public doctest::detail::ContextScopeBase {
 public:
  template <class... V>
  explicit context(char const* names, V const&... values) : text_(std::string(names) + " := ") {
    bool first = true;
    ((text_ += (first ? "" : ", "), text_ += doctest::toString(values).c_str(), first = false), ...);
  }
  ~context() override {
    if (need_to_destroy) destroy();
  }
  void stringify(std::ostream* s) const override { *s << text_; }

 private:
  std::string text_;
};
#define TEST_CONTEXT_CAT2(a, b) a##b
#define TEST_CONTEXT_CAT(a, b) TEST_CONTEXT_CAT2(a, b)
#define CONTEXT(...) ::test::context TEST_CONTEXT_CAT(test_context_, __LINE__)(#__VA_ARGS__, __VA_ARGS__)

// CAPTURE(x) as doctest's (x's value at a failure, read then), but one type
// for every capture: doctest's makes a lambda type, and functions for it, per
// capture and per instantiation of the template it is in — 1,648 functions of
// test_cuda_backward.cpp's ~15,000 (2026-12-06). A temporary (CAPTURE(v.size()))
// is written at once, as it will be gone at a failure.
class capture final : public doctest::detail::ContextScopeBase {
 public:
  template <class V>
  capture(char const* name, V&& v) : name_(name) {
    if constexpr (std::is_lvalue_reference_v<V>) {
      value_ = &v;
      put_ = &put<std::remove_cvref_t<V>>;
    } else {
      text_ = doctest::toString(v).c_str();
    }
  }
  ~capture() override {
    if (need_to_destroy) destroy();
  }
  void stringify(std::ostream* s) const override {
    *s << name_ << " := ";
    if (put_)
      put_(*s, value_);
    else
      *s << text_;
  }

 private:
  template <class V>
  static void put(std::ostream& s, void const* v) {
    s << doctest::toString(*static_cast<V const*>(v));
  }
  char const* name_;
  void const* value_ = nullptr;
  void (*put_)(std::ostream&, void const*) = nullptr;
  std::string text_;
};
#undef CAPTURE
#define CAPTURE(x) ::test::capture TEST_CONTEXT_CAT(test_capture_, __COUNTER__)(#x, x)

// The user-defined map of docs/dsl.md, verbatim.
struct softplus {
  static constexpr std::string_view name = "softplus";
  template <class T> static T value(T x) { return std::log1p(std::exp(x)); }
  template <class T> static T derivative(T x) { return 1 / (1 + std::exp(-x)); }
  // for the CUDA backend's kernels (expressions in the float x)
  static constexpr std::string_view cuda_apply = "log1pf(expf(x))";
  static constexpr std::string_view cuda_derivative = "1.0f / (1.0f + expf(-x))";
};

// Small deterministic generator for shapes and seeds.
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    s += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::size_t in(std::size_t lo, std::size_t hi) { return lo + next() % (hi - lo + 1); }
};

// How many random trials a property draws: n, or n / LINA_TEST_TRIALS_DIVISOR
// (at least 2). The sanitized run (scripts/test-sanitized.sh) sets 3: it looks
// for memory errors and undefined behaviour in the same code on fewer shapes
// of the same distribution (the first draws), at -O0 under ASan, where the
// quadratic oracles of every draw cost ~30× their release time.
inline int trials(int n) {
  static int const divisor = [] {
    char const* e = std::getenv("LINA_TEST_TRIALS_DIVISOR");
    return e && std::atoi(e) > 0 ? std::atoi(e) : 1;
  }();
  return std::max(2, n / divisor);
}

// The lina::shape_error that f() throws (a failed check if it throws none).
template <class F>
lina::shape_error shape_error_of(F f) {
  try {
    f();
  } catch (lina::shape_error const& e) {
    return e;
  }
  FAIL("no lina::shape_error was thrown");
  return lina::shape_error("", "", 0, 0, "");
}

// f() throws a lina::shape_error naming this symbol and dimension with these
// extents (got, then the expected one).
template <class F>
void expect_shape_error(F f, std::string const& symbol, std::string const& dimension, std::size_t got, std::size_t want) {
  lina::shape_error const e = shape_error_of(f);
  CHECK(e.symbol() == symbol);
  CHECK(e.dimension() == dimension);
  CHECK(e.extent() == got);
  CHECK(e.expected_extent() == want);
}

// A sequence length in [1, 1000], mostly short so the quadratic oracles stay quick.
inline std::size_t length(rng& r) {
  switch (r.next() % 4) {
    case 0: return r.in(1, 8);
    case 1: return r.in(9, 100);
    case 2: return r.in(101, 400);
    default: return r.in(401, 1000);
  }
}

// Tokens [from, to) of a [B, H, N, *] tensor, as a view (a block of a sequence).
template <class T>
lina::tensor_view<T const> tokens(lina::tensor<T> const& t, std::size_t from, std::size_t to) {
  return t.rows(from, to - from);
}

// Σ_t x_t y_tᵀ over the rows of [B, H, N, ·] tensors, in double: [B, H, x's cols,
// y's cols] (the gradient of a chained block's first state, unnormalised identity map).
template <class T>
lina::tensor<double> outer_sums(lina::tensor<T> const& x, lina::tensor<T> const& y) {
  auto const& s = x.shape();
  std::size_t const m = y.shape()[3];
  lina::tensor<double> out({s[0], s[1], s[3], m});
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1]; ++h)
      for (std::size_t a = 0; a < s[3]; ++a)
        for (std::size_t c = 0; c < m; ++c) {
          double sum = 0;
          for (std::size_t t = 0; t < s[2]; ++t) sum += double(x(b, h, t, a)) * double(y(b, h, t, c));
          out(b, h, a, c) = sum;
        }
  return out;
}

template <class T>
double max_abs(lina::tensor<T> const& t) {
  double m = 0;
  for (std::size_t i = 0; i < t.size(); ++i) m = std::max(m, std::abs(static_cast<double>(t.data()[i])));
  return m;
}

// Rounding bound for results made of sums of `terms` products, compared
// with a double-precision reference of magnitude `scale`: a sum of n rounded
// terms of random sign errs by about sqrt(n) eps scale; the factor 2 covers
// the rounding of the reference's and the plan's own summation orders. (The
// tests print their largest error / bound, about 0.1 at these sizes.)
template <class T>
double rounding_bound(double terms, double scale) {
  return 2.0 * std::sqrt(std::max(terms, 1.0)) * std::numeric_limits<T>::epsilon() * std::max(scale, 1.0);
}

// Causal or full attention for one (b, h), in double, straight from the
// definition: out_i = sum_j s(i,j) v_j / (sum_j s(i,j) + eps) (or without the
// division), s(i,j) = phi(q_i) . phi(k_j), j <= i when causal.
template <class T, class Phi>
lina::tensor<double> reference_attention(lina::tensor<T> const& q, lina::tensor<T> const& k, lina::tensor<T> const& v,
                                         Phi phi, bool causal, bool normalized, double eps = 1e-6) {
  auto const& s = q.shape();
  std::size_t n = s[2], d = s[3], m = v.shape()[3];
  lina::tensor<double> out({s[0], s[1], n, m});
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1]; ++h)
      for (std::size_t i = 0; i < n; ++i) {
        std::vector<double> num(m, 0.0);
        double den = 0;
        for (std::size_t j = 0; j < (causal ? i + 1 : n); ++j) {
          double sim = 0;
          for (std::size_t c = 0; c < d; ++c) sim += phi(static_cast<double>(q(b, h, i, c))) * phi(static_cast<double>(k(b, h, j, c)));
          den += sim;
          for (std::size_t e = 0; e < m; ++e) num[e] += sim * static_cast<double>(v(b, h, j, e));
        }
        for (std::size_t e = 0; e < m; ++e) out(b, h, i, e) = normalized ? num[e] / (den + eps) : num[e];
      }
  return out;
}

template <class T>
lina::tensor<T> cast(lina::tensor<double> const& t) {
  lina::tensor<T> r(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) r.data()[i] = static_cast<T>(t.data()[i]);
  return r;
}


// Address space for views whose element offsets pass 2³¹ (int32 overflows
// there): `bytes` of virtual memory reserved, not committed — only the pages
// a test writes or reads are backed — so a batch can lie 2³¹ elements past
// the first without 8 GB of memory.
struct sparse_memory {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit sparse_memory(std::size_t n) : bytes(n) {
    data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data == MAP_FAILED) throw std::runtime_error("sparse_memory: mmap failed");
  }
  sparse_memory(sparse_memory const&) = delete;
  sparse_memory& operator=(sparse_memory const&) = delete;
  ~sparse_memory() { ::munmap(data, bytes); }
};
// Slot `slot` of four [B, H, N, cols] tensors that share one sparse block:
// batch b of every slot starts b·2³¹ + 2²⁰ elements in (past int32's range
// for b ≥ 1), the slots 2¹⁸ elements apart within a batch.
constexpr std::ptrdiff_t far_batch = (std::ptrdiff_t{1} << 31) + (1 << 20), far_slot = 1 << 18;
template <class T>
lina::tensor_view<T> far_view(void* block, int slot, lina::shape4 s) {
  return {static_cast<T*>(block) + slot * far_slot, s,
          {far_batch, static_cast<std::ptrdiff_t>(s[2] * s[3]), static_cast<std::ptrdiff_t>(s[3]), 1}};
}
template <class T>
std::size_t far_bytes(std::size_t batches) {
  return (static_cast<std::size_t>(far_batch) * (batches - 1) + 4 * far_slot) * sizeof(T);
}
template <class T, class U>
void copy_into(lina::tensor_view<T> to, lina::tensor<U> const& from) {
  auto const s = from.shape();
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1]; ++h)
      for (std::size_t r = 0; r < s[2]; ++r)
        for (std::size_t c = 0; c < s[3]; ++c) to(b, h, r, c) = static_cast<T>(from(b, h, r, c));
}

// Grouped-query attention's bindings: a [B, H, N, C] tensor of query heads
// (H = groups·g) seen as [B·groups, g, N, C]; `shared`: a [B, groups, N, C]
// tensor of K or V heads, each seen by its g query heads (a zero head stride).
template <class T>
lina::tensor_view<T const> grouped_heads(lina::tensor<T> const& x, std::size_t g, bool shared) {
  auto const s = x.shape();
  auto const st = x.strides();
  std::size_t const groups = shared ? s[1] : s[1] / g;
  return {x.data(),
          {s[0] * groups, g, s[2], s[3]},
          {shared ? st[1] : st[1] * static_cast<std::ptrdiff_t>(g), shared ? 0 : st[1], st[2], st[3]}};
}
// Gradients of grouped-query attention summed over each group of g query
// heads, in double and in the heads' order, → [B, groups, N, C] (the shared
// heads' gradients): from [B, groups·g, N, C], or (`grouped`) from the views'
// shape [B·groups, g, N, C].
template <class T>
lina::tensor<double> sum_groups(lina::tensor<T> const& x, std::size_t groups, std::size_t g, bool grouped) {
  auto const s = x.shape();
  std::size_t const b = grouped ? s[0] / groups : s[0];
  lina::tensor<double> r({b, groups, s[2], s[3]});
  for (std::size_t xb = 0; xb < b; ++xb)
    for (std::size_t j = 0; j < groups; ++j)
      for (std::size_t i = 0; i < s[2]; ++i)
        for (std::size_t c = 0; c < s[3]; ++c)
          for (std::size_t h = 0; h < g; ++h)
            r(xb, j, i, c) += grouped ? x(xb * groups + j, h, i, c) : x(xb, j * g + h, i, c);
  return r;
}
// x's heads, each repeated g times: [B, H, N, C] → [B, H·g, N, C].
template <class T>
lina::tensor<T> repeat_heads(lina::tensor<T> const& x, std::size_t g) {
  auto const s = x.shape();
  lina::tensor<T> r({s[0], s[1] * g, s[2], s[3]});
  for (std::size_t b = 0; b < s[0]; ++b)
    for (std::size_t h = 0; h < s[1] * g; ++h)
      for (std::size_t i = 0; i < s[2]; ++i)
        for (std::size_t c = 0; c < s[3]; ++c) r(b, h, i, c) = x(b, h / g, i, c);
  return r;
}

}  // namespace test
