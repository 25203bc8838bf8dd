// Memory for lina's tensors and the CPU backend's buffers: arrays of 2 MiB or
// more start on a 2 MiB boundary and, on Linux, are marked for transparent
// huge pages (madvise MADV_HUGEPAGE, which the kernel's default "madvise"
// setting honours).
//
// Why: fresh memory is paid for at its first touch, one page fault per page.
// The gradients cpu::gradient returns at B·H = 8, N = 16384, D = 64 are three
// 32 MiB tensors that glibc maps afresh each call; on the 2-core AMD VM
// zero-filling three such arrays took 58 ms in 4 KiB pages and 11 ms in 2 MiB
// ones, against 86–100 ms for the backward's own work (docs/benchmarks.md).
// Huge pages also mean 512 times fewer pages for the scans' N-row operands
// (gradient_into, whose memory is all reused, took 82–83 ms with them at the
// shape above, 86–100 without).
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace lina::detail {

inline constexpr std::size_t huge_page = std::size_t{2} << 20;

// The alignment an array of `bytes` gets: `align` (a power of two), or a huge
// page's for large arrays where the system can back them with huge pages.
inline constexpr std::size_t alignment_for(std::size_t bytes, std::size_t align) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= huge_page) return huge_page;
#else
  (void)bytes;
#endif
  return align;
}

// ::operator new with that alignment, advised to use huge pages when large.
// The advice covers whole huge pages only (the tail past the last boundary
// keeps 4 KiB pages), so it never reaches memory that belongs to another
// allocation; a kernel that refuses it (THP off) leaves ordinary pages.
inline void* allocate_bytes(std::size_t bytes, std::size_t align) {
  std::size_t const a = alignment_for(bytes, align);
  void* p = ::operator new(bytes, std::align_val_t{a});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (a == huge_page) (void)::madvise(p, bytes / huge_page * huge_page, MADV_HUGEPAGE);
#endif
  return p;
}
inline void deallocate_bytes(void* p, std::size_t bytes, std::size_t align) noexcept {
  ::operator delete(p, std::align_val_t{alignment_for(bytes, align)});
}

// A standard allocator over allocate_bytes (lina::tensor's storage).
template <class T>
struct page_allocator {
  using value_type = T;
  page_allocator() = default;
  template <class U>
  constexpr page_allocator(page_allocator<U> const&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(allocate_bytes(n * sizeof(T), alignof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { deallocate_bytes(p, n * sizeof(T), alignof(T)); }
  // Default construction default-initialises (writes nothing to a float), so
  // that resize(n) leaves what lina::uninitialized promises; construction
  // from a value is as usual.
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  friend constexpr bool operator==(page_allocator const&, page_allocator<U> const&) noexcept {
    return true;
  }
};

}  // namespace lina::detail
