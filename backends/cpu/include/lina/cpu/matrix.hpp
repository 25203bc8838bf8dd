// Per-(batch, head) matrices of the CPU backend: strided views of bound
// tensors, or owners of a counted buffer. Every temporary the backend makes
// goes through lina::cpu::buffer, so tests can assert how much a plan
// allocates (no N x N for a linear plan, nothing growing with N beyond
// O(N (C + M)) for its backward).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <new>
#include <utility>

#include "lina/detail/allocate.hpp"

// Where a build defines LINA_ASAN_WORKSPACES and compiles with AddressSanitizer
// (GCC says so with __SANITIZE_ADDRESS__, Clang with __has_feature), memory
// the backend keeps for reuse is marked unaddressable while no one may touch
// it (lina::cpu::detail::poison); lina's sanitized tests do. Asked for, not
// automatic: a program whose files are compiled some with ASan and some
// without could keep one file's take() and another's give() of the same
// template, and report its own buffers.
#if defined(LINA_ASAN_WORKSPACES) && defined(__SANITIZE_ADDRESS__)
#define LINA_ASAN 1
#elif defined(LINA_ASAN_WORKSPACES) && defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LINA_ASAN 1
#endif
#endif
#if defined(LINA_ASAN) && __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>
#else
#undef LINA_ASAN
#endif

namespace lina::cpu {

// Counters of the backend's temporaries, over all threads.
struct memory_counters {
  std::atomic<std::size_t> live{0};         // bytes allocated now
  std::atomic<std::size_t> peak{0};         // most bytes alive at once since reset()
  std::atomic<std::size_t> largest{0};      // largest single allocation since reset()
  std::atomic<std::size_t> allocations{0};  // number of allocations since reset()

  void reset() {
    peak = live.load();
    largest = 0;
    allocations = 0;
  }
};

inline memory_counters& memory() {
  static memory_counters m;
  return m;
}

namespace detail {
inline void raise_to(std::atomic<std::size_t>& a, std::size_t v) {
  std::size_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}
// [p, p + n) unaddressable (poison) or addressable again (unpoison) where
// LINA_ASAN is defined (above), so that a read or write of a reused buffer
// where it is free, or past what its taker asked for, is reported as one past
// a fresh allocation would be; nothing otherwise.
template <class T>
void poison([[maybe_unused]] T const* p, [[maybe_unused]] std::size_t n) {
#ifdef LINA_ASAN
  ASAN_POISON_MEMORY_REGION(p, n * sizeof(T));
#endif
}
template <class T>
void unpoison([[maybe_unused]] T const* p, [[maybe_unused]] std::size_t n) {
#ifdef LINA_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, n * sizeof(T));
#endif
}
}  // namespace detail

// A counted, 64-byte aligned array of T (2 MiB aligned on huge pages when large).
template <class T>
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    p_ = static_cast<T*>(lina::detail::allocate_bytes(n * sizeof(T), 64));  // large ones on huge pages
    auto& m = memory();
    std::size_t bytes = n * sizeof(T);
    detail::raise_to(m.peak, m.live.fetch_add(bytes) + bytes);
    detail::raise_to(m.largest, bytes);
    ++m.allocations;
  }
  buffer(buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  ~buffer() { release(); }

  T* get() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  void release() {
    if (!p_) return;
    memory().live -= n_ * sizeof(T);
    detail::unpoison(p_, n_);  // (a workspace's free buffer goes back to the allocator addressable)
    lina::detail::deallocate_bytes(p_, n_ * sizeof(T), 64);
    p_ = nullptr;
  }
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

using index = std::ptrdiff_t;

// rows x cols, element (i, j) at data[i * rs + j * cs]. A view when `owner`
// is empty (then never written), else the owner of its elements.
//
// Row and column exponents (null: none): element (i, j) stands for
// (i, j) · e^(row_exp[i] + col_exp[j]). Softmax rows are kept that way where
// their exp would overflow (evaluate.hpp, "Exponents"); the program resolves
// them before a kernel sees the matrix, which the kernels never read.
template <class T>
struct matrix {
  T const* data = nullptr;
  index rows = 0, cols = 0, rs = 0, cs = 1;
  buffer<T> owner;
  T const* row_exp = nullptr;
  T const* col_exp = nullptr;

  T const& operator()(index i, index j) const { return data[i * rs + j * cs]; }
  T* row_mut(index i) { return const_cast<T*>(data) + i * rs; }  // owners only
  T& at_mut(index i, index j) { return const_cast<T*>(data)[i * rs + j * cs]; }  // owners only
  bool owns() const { return static_cast<bool>(owner) || rows * cols == 0; }
  bool row_major() const { return cs == 1 && (rs == cols || rows <= 1); }

  matrix transposed() && {
    matrix t = std::move(*this);
    std::swap(t.rows, t.cols);
    std::swap(t.rs, t.cs);
    std::swap(t.row_exp, t.col_exp);
    return t;
  }
};

// A fresh row-major rows x cols matrix (uninitialised).
template <class T>
matrix<T> allocate(index rows, index cols) {
  matrix<T> m;
  m.owner = buffer<T>(static_cast<std::size_t>(rows * cols));
  m.data = m.owner.get();
  m.rows = rows;
  m.cols = cols;
  m.rs = cols;
  m.cs = 1;
  return m;
}

template <class T>
matrix<T> view(T const* data, index rows, index cols, index rs, index cs) {
  matrix<T> m;
  m.data = data;
  m.rows = rows;
  m.cols = cols;
  m.rs = rs;
  m.cs = cs;
  return m;
}

// A row-major copy the caller may write to (the matrix itself if it already is one).
template <class T>
matrix<T> writable(matrix<T>&& m) {
  if (m.owns() && m.row_major()) return std::move(m);
  matrix<T> c = allocate<T>(m.rows, m.cols);
  for (index i = 0; i < m.rows; ++i)
    for (index j = 0; j < m.cols; ++j) c.at_mut(i, j) = m(i, j);
  return c;
}

}  // namespace lina::cpu
