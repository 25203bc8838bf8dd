// out[j] = f(j) for 0 <= j < n, vectorised at -O2 as at -O3. GCC vectorises a
// loop of unknown length only where its cost model allows a scalar tail and a
// check for aliasing: -O3's does, -O2's "very cheap" one does not (GCC 12), and
// there the elementwise maps ran one element at a time — the CPU forward at a
// quarter of its -O3 speed (docs/benchmarks.md, "At -O2"). So the row goes in
// blocks of a fixed width, each made in a local array (nothing to alias) and
// copied out, and what is left one by one (GCC; Clang needs none of it). f(j) may
// read out[j] (and nothing else of out): a block reads its elements before it
// writes them.
#pragma once

#include <cstring>

namespace lina::detail {

template <class T, class I, class F>
inline void each_lane(T* out, I n, F&& f) {
#if defined(__clang__)
  // Clang vectorises the plain loop at -O2 (with its own tail and alias check), and
  // ran the forward ~9% slower through the blocks (Clang 14, 2026-12-05).
  for (I j = 0; j < n; ++j) out[j] = f(j);
#else
  constexpr I W = 64 / sizeof(T);  // a 512-bit vector, two 256-bit or four 128-bit ones
  I j = 0;
  for (; j + W <= n; j += W) {
    T block[W];
    // With OpenMP, the block is a SIMD loop outright: at -O3 GCC 12 turned
    // cheap selects in f (a derivative `x > 0 ? 1 : x`, relu's nested selects)
    // into branches, mispredicted on signed inputs, and a backward through them
    // ran 1.5-1.8x slower than at -O2 (docs/benchmarks.md); the lanes are
    // independent, as each_lane requires.
#if defined(_OPENMP)
#pragma omp simd
#endif
    for (I l = 0; l < W; ++l) block[l] = f(j + l);
    std::memcpy(out + j, block, sizeof block);
  }
  // The tail, fewer than W. Bounded by W in the loop itself: written `j < n` alone,
  // GCC 12 at -O3 warned (-Waggressive-loop-optimizations, "iteration 2^62 - 1
  // invokes undefined behavior") inside a three-layer stack's backward.
  for (I l = 0; l < W && j + l < n; ++l) out[j + l] = f(j + l);
#endif
}

}  // namespace lina::detail
