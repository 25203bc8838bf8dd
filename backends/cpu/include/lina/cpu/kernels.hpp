// The CPU backend's loops: one function per plan operation, on per-(batch,
// head) matrices, each writing into a destination `out` the caller sized
// (rows contiguous: out.cs == 1, any row stride). Straightforward and correct
// first, except the two hot loops, the scan (causal linear plans) and the
// product (non-causal and quadratic plans), which keep tiles of their results
// in registers; each has a plain loop beside it as its oracle.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "lina/cpu/matrix.hpp"
#include "lina/cpu/simd.hpp"
#include "lina/feature_maps.hpp"

namespace lina::cpu::kernels {

// A row-major copy unless the rows are already contiguous.
template <class T>
matrix<T> rows_contiguous(matrix<T>&& m) {
  if (m.cs == 1) return std::move(m);
  return writable(std::move(m));
}

namespace detail {

// The scan's register tile: `rows` state rows x `vectors` SIMD vectors of
// state columns stay in registers while a chunk of rows streams past, with
// room left for one row of C, one of the output and two broadcasts. Measured
// on AVX-512 (Zen 4, bench/scan_kernel): 8 x 2 vectors of 16 floats or 8
// doubles reaches 85-90% of the FMA peak on whole tiles; 4-6 rows or 3-4
// vectors are within a few percent, 12 rows spill. With SSE2 only (16
// registers, no FMA) 4 x 2 vectors is as fast as 3 x 3 or 2 x 4.
template <class T>
struct scan_tile_shape {
  using vec = typename simd::vector_of<T>::type;
  static constexpr int lanes = simd::vector_of<T>::lanes;
  static constexpr int vectors = 2;
  static constexpr int rows = simd::registers >= 32 ? 8 : 4;
};

// One register tile of the scan over `n` rows: for each row i,
//   s[p][:] += b_i[p] c_i[:]     (the state after row i, p = 0..P-1)
//   o_i[:]  += a_i[p] s[p][:]    (p in order)
// `s` is the P x (V x lanes) tile of the state (row stride lds), `a`, `b` the
// rows' first of these P columns (row strides lda, ldb), `c`, `o` the rows'
// first of these columns (row strides ldc, ldo); every stride is negative in a
// reverse scan.
// Every element sees the same operations in the same order whatever n is, so
// a scan split into several calls gives the same bits as one call. Out =
// false: the state only (the sums of scan_sums), `a` and `o` untouched.
//
// Sums = two_level: the registers hold the chunk's own sum from zero, the
// outputs read (that sum + the state in memory), and the chunk's sum is added
// to the state once at its end; long scans take this form (two_level_rows).
//
// Dual: a second output from the same state, contracted over its columns:
//   o2_i[p] += Σ_q s[p][q] x_i[q]
// (`d`: rows of x from the tile's first column, rows of o2 from its first
// row), for two scans whose states are transposes of each other (∂K's and
// ∂V's in a backward): one state update serves both.
enum class sums { one_level, two_level };
// A decayed scan (op::prefix_scan's decay g) multiplies its state by g once
// per row: a forward scan before the row's update (S = g S + b cᵀ, the product
// added by one explicit fused multiply-add onto the rounded g S, the same in
// the tile, one-row and column kernels, so steps and blocks give the same
// bits), a reverse scan after the row's outputs (docs/gradients.md). Decayed
// scans sum in one level.
enum class fade { none, before, after };
// One state vector x adding row b·c under F, and x leaving the row (decayed
// after it when F = after): the one place the kernels below spell a decay.
template <fade F, class Vec>
inline Vec fade_add(Vec x, Vec b, Vec c, Vec g) {
  if constexpr (F == fade::before)
    return simd::madd(b, c, x * g);
  else if constexpr (F == fade::after)
    return simd::madd(b, c, x);
  else
    return x + b * c;
}
template <fade F, class Vec>
inline Vec fade_out(Vec x, Vec g) {
  if constexpr (F == fade::after)
    return x * g;
  else
    return x;
}
template <class T>
struct second_output {
  T const* x = nullptr;
  index ldx = 0;
  T* o = nullptr;
  index ldo = 0;
  second_output at(index p0, index q0) const { return {x + q0, ldx, o + p0, ldo}; }
};
// (Always inlined into its strip: GCC does so alone at -O3, not at -O2, where the
// backward ran 5–20% slower for the call; compile times unchanged, -O2 and -Og.)
template <int P, int V, class Vec, bool Out = true, sums Sums = sums::one_level, bool Dual = false,
          fade F = fade::none, class T>
[[gnu::always_inline]] inline void scan_tile(T* __restrict s, index lds, T const* __restrict a, index lda,
                                             T const* __restrict b, index ldb, T const* __restrict c, index ldc,
                                             T* __restrict o, index ldo, index n, second_output<T> d = {}, T g = 1) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  constexpr bool two = Sums == sums::two_level;
  static_assert(Out || !Dual);
  static_assert(!two || F == fade::none);
  Vec const gv = simd::broadcast<Vec>(g);
  Vec acc[P][V];
  // In two levels every row's outputs add the state in memory to the chunk's
  // sums: the tile's state is first copied to one local block, read at constant
  // offsets from one address. (From s itself, P row pointers at a run-time
  // stride did not fit the general registers: GCC 12 moved them through vector
  // registers and the stack, and the kernel ran 1.1-1.45x slower.)
  alignas(64) T base[two ? P : 1][V * L];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      acc[p][v] = two ? Vec{} : simd::load<Vec>(s + p * lds + v * L);
      if constexpr (two) simd::store(&base[p][v * L], simd::load<Vec>(s + p * lds + v * L));
    }
  for (index i = 0; i < n; ++i) {
    T const* ci = c + i * ldc;
    T* oi = o + i * ldo;
    T const* ai = a + i * lda;
    T const* bi = b + i * ldb;
    Vec cv[V], ov[V], xv[Dual ? V : 1], u[Dual ? P : 1];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      cv[v] = simd::load<Vec>(ci + v * L);
      if constexpr (Out) ov[v] = simd::load<Vec>(oi + v * L);
      if constexpr (Dual) xv[v] = simd::load<Vec>(d.x + i * d.ldx + v * L);
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      Vec bp = simd::broadcast<Vec>(bi[p]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[p][v] = fade_add<F>(acc[p][v], bp, cv[v], gv);
      if constexpr (Out) {
        Vec ap = simd::broadcast<Vec>(ai[p]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          Vec sv = acc[p][v];
          if constexpr (two) sv += simd::load<Vec>(&base[p][v * L]);
          ov[v] += ap * sv;
          if constexpr (Dual) u[p] = v == 0 ? sv * xv[0] : u[p] + sv * xv[v];
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[p][v] = fade_out<F>(acc[p][v], gv);
    }
    if constexpr (Out) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) simd::store(oi + v * L, ov[v]);
    }
    if constexpr (Dual) simd::add_lane_sums<P>(u, d.o + i * d.ldo);
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      simd::store(s + p * lds + v * L, two ? simd::load<Vec>(s + p * lds + v * L) + acc[p][v] : acc[p][v]);
}

// The P-row tiles of the strip of state columns [q0, q0 + V x lanes) (within
// db), for a chunk of n rows. A tile that reaches past the state's last row
// goes through a zeroed copy (the packed rows are zero there, so it stays
// zero).
// (Dual: o2's rows are at least whole tiles wide; the zero rows add zeros.)
template <int P, int V, class Vec, bool Out, sums Sums, bool Dual, fade F, class T>
void scan_strip(T* state, index da, index db, index q0, T const* a, index lda, T const* b, index ldb, T const* c,
                index ldc, T* o, index ldo, index n, second_output<T> d, T g) {
  constexpr int W = V * static_cast<int>(sizeof(Vec) / sizeof(T));
  index p0 = 0;
  for (; p0 + P <= da; p0 += P)
    scan_tile<P, V, Vec, Out, Sums, Dual, F>(state + p0 * db + q0, db, a + p0, lda, b + p0, ldb, c + q0, ldc,
                                             o + q0, ldo, n, d.at(p0, q0), g);
  if (p0 == da) return;
  alignas(64) T tile[P * W] = {};
  for (index p = 0; p < da - p0; ++p) std::copy_n(state + (p0 + p) * db + q0, W, tile + p * W);
  scan_tile<P, V, Vec, Out, Sums, Dual, F>(tile, W, a + p0, lda, b + p0, ldb, c + q0, ldc, o + q0, ldo, n,
                                           d.at(p0, q0), g);
  for (index p = 0; p < da - p0; ++p) std::copy_n(tile + p * W, W, state + (p0 + p) * db + q0);
}

// State rows [p0, p0 + K x lanes) of one state column q, for the columns
// left over after whole-vector strips: here vectors run along the state's
// rows, and each output element adds its dot product with a_i as a sum of
// lanes. Rows of `a` and `b` are zero from da up to whole vectors (and o2's
// rows, Dual, at least that wide: the second output is a vector along them).
template <int K, class Vec, bool Out, sums Sums, bool Dual, fade F, class T>
inline void scan_column_block(T* state, index da, index db, index q, index p0, T const* __restrict a, index lda,
                              T const* __restrict b, index ldb, T const* __restrict c, index ldc, T* __restrict o,
                              index ldo, index n, second_output<T> d, T g) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  alignas(64) T col[K * L] = {};
  index pn = std::min<index>(K * L, da - p0);
  for (index p = 0; p < pn; ++p) col[p] = state[(p0 + p) * db + q];
  constexpr bool two = Sums == sums::two_level;
  static_assert(!two || F == fade::none);
  Vec const gv = simd::broadcast<Vec>(g);
  Vec s[K];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) s[k] = two ? Vec{} : simd::load<Vec>(col + k * L);
  for (index i = 0; i < n; ++i) {
    Vec cq = simd::broadcast<Vec>(c[i * ldc + q]);
    T const* ai = a + i * lda + p0;
    T const* bi = b + i * ldb + p0;
    Vec ov{};
    [[maybe_unused]] Vec xq{};
    if constexpr (Dual) xq = simd::broadcast<Vec>(d.x[i * d.ldx + q]);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      s[k] = fade_add<F>(s[k], simd::load<Vec>(bi + k * L), cq, gv);
      if constexpr (Out) {
        Vec sv = s[k];
        if constexpr (two) sv += simd::load<Vec>(col + k * L);
        ov += simd::load<Vec>(ai + k * L) * sv;
        if constexpr (Dual) {
          T* o2 = d.o + i * d.ldo + p0 + k * L;
          simd::store(o2, simd::load<Vec>(o2) + sv * xq);
        }
      }
      s[k] = fade_out<F>(s[k], gv);
    }
    if constexpr (Out) o[i * ldo + q] += simd::lane_sum<Vec, T>(ov);
  }
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) simd::store(col + k * L, two ? simd::load<Vec>(col + k * L) + s[k] : s[k]);
  for (index p = 0; p < pn; ++p) state[(p0 + p) * db + q] = col[p];
}

template <class Vec, bool Out, sums Sums, bool Dual, fade F, class T>
void scan_column(T* state, index da, index db, index q, T const* a, index lda, T const* b, index ldb, T const* c,
                 index ldc, T* o, index ldo, index n, second_output<T> d, T g) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  index p0 = 0;
  auto block = [&]<int K>() {
    scan_column_block<K, Vec, Out, Sums, Dual, F>(state, da, db, q, p0, a, lda, b, ldb, c, ldc, o, ldo, n, d, g);
    p0 += K * L;
  };
  while (p0 + 4 * L <= da) block.template operator()<4>();
  if (p0 + 2 * L <= da) block.template operator()<2>();
  while (p0 < da) block.template operator()<1>();
}

// One row (a recurrent step): state rows stream past once, each adding
// b[p] c to its first `vectors` whole vectors of columns, and the output's
// vectors (up to 4 in registers at a time) add a[p] times the updated row.
// Per element the same operations in the same order as scan_tile (p in
// order, one fused multiply-add each), so a step gives the bits of the same
// row inside a chunk; but the state is read and written in its own row order,
// not in 8-row tiles - 28% faster for a step at C = 64, M + 1 = 65 (measured:
// 3.06 -> 2.20 us for 8 heads, the state in L2).
// Two = true: a step in two levels (past two_level_rows, cpu::state's pending
// sums): `sums` are the pending sums (from zero since the last fold), the
// output reads base + sums, as a two-level tile's rows read theirs; the caller
// folds the pending sums into the state (`base`).
template <int W, class Vec, fade F, bool Two, class T>
inline void scan_one_row_block(T* __restrict sums, T const* __restrict base, index da, index db,
                               T const* __restrict a, T const* __restrict b, T const* __restrict c, T* __restrict o,
                               T g) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  Vec const gv = simd::broadcast<Vec>(g);
  Vec cv[W], ov[W];
#pragma GCC unroll 4
  for (int v = 0; v < W; ++v) {
    cv[v] = simd::load<Vec>(c + v * L);
    ov[v] = simd::load<Vec>(o + v * L);
  }
  for (index p = 0; p < da; ++p) {
    Vec bp = simd::broadcast<Vec>(b[p]), ap = simd::broadcast<Vec>(a[p]);
    T* sp = sums + p * db;
#pragma GCC unroll 4
    for (int v = 0; v < W; ++v) {
      Vec x = simd::load<Vec>(sp + v * L);
      x = fade_add<F>(x, bp, cv[v], gv);
      simd::store(sp + v * L, fade_out<F>(x, gv));
      if constexpr (Two)
        ov[v] += ap * (x + simd::load<Vec>(base + p * db + v * L));
      else
        ov[v] += ap * x;
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < W; ++v) simd::store(o + v * L, ov[v]);
}
template <class Vec, fade F = fade::none, bool Two = false, class T>
void scan_one_row(T* sums, index da, index db, index vectors, T const* a, T const* b, T const* c, T* o, T g = 1,
                  T const* base = nullptr) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  index v0 = 0;  // (each vector of columns is its own sums: splitting them changes no bits)
  auto block = [&]<int W>() {
    scan_one_row_block<W, Vec, F, Two>(sums + v0 * L, Two ? base + v0 * L : nullptr, da, db, a, b, c + v0 * L,
                                       o + v0 * L, g);
    v0 += W;
  };
  while (v0 + 4 <= vectors) block.template operator()<4>();
  if (v0 + 2 <= vectors) block.template operator()<2>();
  if (v0 < vectors) block.template operator()<1>();
}
// A step in two levels over every column: whole vectors as above, then the
// columns left one by one.
template <class Vec, class T>
void scan_one_row_two_level(T const* state, T* pending, index da, index db, T const* a, T const* b, T const* c, T* o) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  scan_one_row<Vec, fade::none, true>(pending, da, db, db / L, a, b, c, o, T(1), state);
  for (index q = db / L * L; q < db; ++q) {
    T out = o[q];
    for (index p = 0; p < da; ++p) {
      T const x = pending[p * db + q] + b[p] * c[q];
      pending[p * db + q] = x;
      out += a[p] * (x + state[p * db + q]);
    }
    o[q] = out;
  }
}

// Rows first, first + 1, ... (first, first - 1, ... when reversed) of x,
// n of them, into `to`, each row `ld` wide with zeros past x's columns.
template <class T>
void pack_rows(matrix<T> const& x, index first, index n, bool reverse, T* to, index ld) {
  index step = reverse ? -1 : 1;
  if (x.cs == 1) {
    for (index t = 0; t < n; ++t) {
      T const* from = x.data + (first + step * t) * x.rs;
      T* dst = to + t * ld;
      std::copy(from, from + x.cols, dst);
      std::fill(dst + x.cols, dst + ld, T(0));
    }
  } else {  // column by column: a transposed view reads along its rows
    for (index j = 0; j < x.cols; ++j)
      for (index t = 0; t < n; ++t) to[t * ld + j] = x.data[(first + step * t) * x.rs + j * x.cs];
    for (index t = 0; t < n; ++t) std::fill(to + t * ld + x.cols, to + (t + 1) * ld, T(0));
  }
}

inline constexpr index round_up(index x, index m) { return (x + m - 1) / m * m; }

}  // namespace detail

// Rows per chunk of the scan. Measured with bench/scan_kernel (N = 4096,
// da = 32/64/128, db = da + 1, float and double, AVX-512): 32 to 256 rows run
// within a few percent of each other, 16 is 5-10% slower (each chunk loads
// and stores every state tile once, and starts the left-over columns once).
// 64 keeps the packed rows small (2 x 64 x da elements: 64 KiB for da = 128
// in double, within L2) and the scratch of short sequences too.
inline constexpr index scan_chunk_rows = 64;

// Scans over more rows than this sum their state in two levels: each chunk's
// rows from zero, then the chunk's sum into the state (detail::sums). Added
// row by row, a running sum's rounding error grows like sqrt(n) eps relative
// to the sum (measured, bench/limits: 5.5e-5 for float at n = 2^20); in two
// levels like sqrt(chunk rows + n / chunk rows) eps. Below the threshold,
// sqrt(n) eps <= 2^-17 (7.6e-6) and the single level is faster (the extra
// add per state element and row: 1.1-1.3x, bench/scan_kernel --n 16384 at
// da = 64 and 128, float), so only float scans over more than 4096 rows take
// two levels; a double scan never does.
template <class T>
inline constexpr index two_level_rows = [] {
  constexpr double eps = std::numeric_limits<T>::epsilon(), rows = 0x1p-34 / (eps * eps);
  return rows < 0x1p40 ? static_cast<index>(rows) : std::numeric_limits<index>::max();
}();
// Do n rows added to sums that hold `before` rows already pass two_level_rows?
// (scan_rows's choice of level for a call; a step's, n = 1, for its pending sums)
template <class T>
constexpr bool past_one_level(index before, index n) {
  return n > two_level_rows<T> - std::min(before, two_level_rows<T>);
}

// Row i of `out` = A_i^T S_i with S_i the running sum of B_j C_j^T over
// j <= i (forward) or j >= i (reverse). `state` (a x b, row-major) holds the
// sum on entry and on exit, so scans can be chained.
//
// The rows go in chunks: a chunk's rows of A and B are packed into small
// contiguous buffers (zero-padded to whole tiles and vectors; rows already
// that wide and contiguous are read where they are, as C's rows are whenever
// contiguous), then every register tile of the state streams
// through the chunk (detail::scan_tile), so the state is loaded and stored
// once per chunk instead of once per row. Each state element still adds
// b_i c_i^T one row at a time and each output sums over the state's rows in a
// fixed order: the same operations whatever the chunking, so one call over N
// rows and N one-row calls (recurrent steps) agree bit for bit, up to
// two_level_rows rows per call; longer calls sum in two levels, which agree
// with steps to rounding. (A GEMM-shaped chunk, out = A_c S + mask(A_c B_c^T)
// C_c, would round differently for every chunk boundary, and so differently
// for steps and blocks.)
//
// The scan reads its operands through row sources and hands its output to a
// row sink, so that a backend can make operand rows as they are loaded and
// finish output rows as they leave (a fused group: φ(K) or [V|1] computed
// chunk by chunk, the normaliser's division applied to each finished chunk),
// and no N-row temporary exists. A matrix is the plain source and sink.
//
// A source has cols() and pack(first, n, reverse, to, ld, work): rows
// first, first +- 1, ... into `to`, `ld` wide, zero past cols(); in_place()
// is a pointer to row 0 with unit column stride (row stride stride()) when
// the rows can be read where they are, else nullptr. A sink has in_place()
// and stride() likewise, and take(first, n, reverse, rows, ld, work) for
// finished rows when it is not in place. work() is the scratch (elements)
// pack or take may use, given to each call from the scan's own scratch, so
// that threads scanning parts of one sequence never share it.
template <class T>
struct matrix_rows {
  matrix<T> const& m;
  index cols() const { return m.cols; }
  T const* in_place() const { return m.cs == 1 ? m.data : nullptr; }
  index stride() const { return m.rs; }
  std::size_t work() const { return 0; }
  void pack(index first, index n, bool reverse, T* to, index ld, T*) const {
    detail::pack_rows(m, first, n, reverse, to, ld);
  }
};
template <class T>
struct matrix_sink {  // rows contiguous (out.cs == 1), as every destination
  matrix<T>& m;
  T* in_place() const { return m.row_mut(0); }
  index stride() const { return m.rs; }
  std::size_t work() const { return 0; }
  void take(index, index, bool, T const*, index, T*) const {}
};

// A dual scan's second output (detail::second_output): rows of x (a source of
// c's width) and the sink of o2 (rows of b's width). no_second: a single scan.
struct no_second {
  std::size_t work() const { return 0; }
};
template <class X, class Out2>
struct second {
  X const& x;
  Out2 const& out;
  std::size_t work() const { return std::max(x.work(), out.work()); }
};

namespace detail {
template <class T>
struct scan_layout {  // the scratch of one scan over chunks of `rows` rows
  using shape = scan_tile_shape<T>;
  index rows, ldab, ldc, ab_size, c_size, o_size, x_size, o2_size, w_size;
  scan_layout(index n, index da, index db, bool pack_c, bool buffer_out, std::size_t work, bool pack_x = false,
              bool dual = false)
      : rows(std::min(scan_chunk_rows, n)),
        ldab(std::max(round_up(da, shape::rows), round_up(da, shape::lanes))),
        ldc(round_up(db, shape::lanes)),  // packed C and buffered output rows start on whole vectors
        ab_size(round_up(rows * ldab, 16)),
        c_size(pack_c ? rows * ldc : 0),
        o_size(buffer_out ? rows * ldc : 0),
        x_size(pack_x ? rows * ldc : 0),
        o2_size(dual ? rows * ldab : 0),  // whole tiles and vectors wide
        w_size(static_cast<index>(work)) {}
  std::size_t size() const {
    return static_cast<std::size_t>(2 * ab_size + c_size + o_size + x_size + o2_size + w_size);
  }
};
template <class... X>
std::size_t work_of(X const&... x) {
  return std::max({x.work()...});
}
template <class Second>
inline constexpr bool is_dual = !std::is_same_v<Second, no_second>;
template <class Second>
bool packs_x(Second const& sec) {
  if constexpr (is_dual<Second>)
    return !sec.x.in_place();
  else
    return false;
}
// n finished rows (row t at rows + t ld, `cols` wide) into a sink: in place, or taken.
template <class T, class Sink>
void hand_rows(Sink const& sink, index first, index n, bool reverse, T const* rows, index ld, index cols, T* work) {
  if (T* to = sink.in_place()) {
    index step = reverse ? -sink.stride() : sink.stride();
    for (index t = 0; t < n; ++t) std::copy_n(rows + t * ld, cols, to + (first * sink.stride() + t * step));
  } else {
    sink.take(first, n, reverse, rows, ld, work);
  }
}
}  // namespace detail

// The scratch scan_rows needs (elements), for callers that bring their own.
template <class T, class A, class B, class C, class Out, class Second = no_second>
std::size_t scan_scratch_size(index n, A const& a, B const& b, C const& c, Out const& out, Second const& sec = {}) {
  if (n == 0 || c.cols() == 0) return 0;
  return detail::scan_layout<T>(n, b.cols(), c.cols(), !c.in_place(), !out.in_place(),
                                detail::work_of(a, b, c, out, sec), detail::packs_x(sec), detail::is_dual<Second>)
      .size();
}
template <class T>
std::size_t scan_scratch_size(matrix<T> const& b, matrix<T> const& c) {  // into a matrix
  if (b.rows == 0 || b.cols == 0 || c.cols == 0) return 0;
  return detail::scan_layout<T>(b.rows, b.cols, c.cols, c.cs != 1, false, 0).size();
}

// Rows [lo, hi) of the scan (from hi - 1 down when reversed), sources a, b
// (da columns), c (db), into `out`, from and leaving `state`; scratch of
// scan_scratch_size(hi - lo, a, b, c, out) elements.
//
// With a second (x, out2), a dual scan: out2's row i = S_i x_i as well (S_i's
// columns contracted with x_i: b's width), from the same state updates.
// decay != 1: a decayed scan (fade). A scan that never decays passes no
// decay (unit_decay): the decayed kernels, half of the strip kernels, are then
// not instantiated, which a plan without a decay would otherwise compile for
// nothing (each scan's code, per plan and dtype, in every translation unit).
// `before`: how many rows `state` already sums (an earlier call's, chained):
// the call sums in two levels when those and its own are more than
// two_level_rows, as one call over them all would. A one-row call (a step)
// does so through `pending` sums the caller keeps (cpu::state): the row adds
// to them and its output reads state + pending; the caller folds them in.
struct unit_decay {};
template <bool Outputs = true, class T, class A, class B, class C, class Out, class Second = no_second,
          class Decay = unit_decay>
void scan_rows(A const& a, B const& b, C const& c, Out const& out, index lo, index hi, T* state, bool reverse,
               T* scratch, Second const& sec = {}, Decay const decay_or_unit = {}, index before = 0,
               T* pending = nullptr) {
  constexpr bool decays = !std::is_same_v<Decay, unit_decay>;
  T decay = 1;
  if constexpr (decays) decay = decay_or_unit;
  using shape = detail::scan_tile_shape<T>;
  using vec = typename shape::vec;
  constexpr int P = shape::rows, L = shape::lanes, V = shape::vectors;
  constexpr bool Dual = detail::is_dual<Second>;
  static_assert(Outputs || !Dual);
  index n = hi - lo, da = b.cols(), db = c.cols();
  if (n <= 0 || db == 0) return;
  T* out_rows = out.in_place();
  detail::scan_layout<T> lay(n, da, db, !c.in_place(), !out_rows, detail::work_of(a, b, c, out, sec),
                             detail::packs_x(sec), Dual);
  index ldab = lay.ldab;
  T* pa = scratch;
  T* pb = pa + lay.ab_size;
  T* pc = pb + lay.ab_size;
  T* pbuf = pc + lay.c_size;
  T* px = pbuf + lay.o_size;
  T* po2 = px + lay.x_size;
  T* work = po2 + lay.o2_size;
  // Rows `first`, first +- 1, ... of a source: where they are, or packed into
  // `to`, `ld` wide. Rows of A and B stay where they are only when they need
  // no zeros (da whole tiles and vectors: ldab == da); copying them was 12% of
  // a backward's time that reads them from materialised matrices (perf, one
  // thread, N = 4096, D = M = 64).
  bool const ab_padded = ldab != da;
  auto rows_of = [&](auto const& src, index first, index m, T* to, index ld,
                     bool padded = false) -> std::pair<T const*, index> {
    T const* in = src.in_place();
    if (in && !padded) return {in + first * src.stride(), reverse ? -src.stride() : src.stride()};
    src.pack(first, m, reverse, to, ld, work);
    return {to, ld};
  };
  for (index t0 = 0; t0 < n; t0 += lay.rows) {
    index m = std::min(lay.rows, n - t0);
    index first = reverse ? hi - 1 - t0 : lo + t0;  // the chunk's first row in scan order
    T* po = out_rows ? out_rows + first * out.stride() : pbuf;
    index ldo = out_rows ? (reverse ? -out.stride() : out.stride()) : lay.ldc;
    if constexpr (Outputs)
      for (index t = 0; t < m; ++t) std::fill_n(po + t * ldo, db, T(0));
    if constexpr (Dual) std::fill_n(po2, m * ldab, T(0));
    if (da > 0) {
      // (not structured bindings: the lambda below reads them, which C++20
      // allows but Clang before 16 refuses)
      auto const a_rows = Outputs ? rows_of(a, first, m, pa, ldab, ab_padded) : std::pair<T const*, index>{};
      auto const b_rows = rows_of(b, first, m, pb, ldab, ab_padded);
      auto const c_rows = rows_of(c, first, m, pc, lay.ldc);
      T const *const ra = a_rows.first, *const rb = b_rows.first, *const rc = c_rows.first;
      index const lda = a_rows.second, ldb = b_rows.second, ldc = c_rows.second;
      detail::second_output<T> d;
      if constexpr (Dual) {
        auto [px_rows, ldx] = rows_of(sec.x, first, m, px, lay.ldc);
        d = {px_rows, ldx, po2, ldab};
      }
      auto strips = [&]<detail::sums Sums, detail::fade F = detail::fade::none>() {
        index q0 = 0;
        if (Outputs && !Dual && m == 1 && pending && F == detail::fade::none) {  // a step in two levels: every column
          q0 = db;
          detail::scan_one_row_two_level<vec>(state, pending, da, db, ra, rb, rc, po);
        } else if (Outputs && !Dual && m == 1) {  // a step: whole vectors row by row
          q0 = db / L * L;
          detail::scan_one_row<vec, F>(state, da, db, db / L, ra, rb, rc, po, decay);
        }
        for (; q0 + V * L <= db; q0 += V * L)
          detail::scan_strip<P, V, vec, Outputs, Sums, Dual, F>(state, da, db, q0, ra, lda, rb, ldb, rc, ldc, po, ldo,
                                                                m, d, decay);
        for (; q0 + L <= db; q0 += L)
          detail::scan_strip<P, 1, vec, Outputs, Sums, Dual, F>(state, da, db, q0, ra, lda, rb, ldb, rc, ldc, po, ldo,
                                                                m, d, decay);
        for (; q0 < db; ++q0)
          detail::scan_column<vec, Outputs, Sums, Dual, F>(state, da, db, q0, ra, lda, rb, ldb, rc, ldc, po, ldo, m, d,
                                                           decay);
      };
      auto undecayed = [&] {
        if (n > 1 && past_one_level<T>(before, n))
          strips.template operator()<detail::sums::two_level>();
        else
          strips.template operator()<detail::sums::one_level>();
      };
      if constexpr (decays) {
        if (decay == T(1))
          undecayed();
        else if (reverse)
          strips.template operator()<detail::sums::one_level, detail::fade::after>();
        else
          strips.template operator()<detail::sums::one_level, detail::fade::before>();
      } else {
        undecayed();
      }
    }
    if (Outputs && !out_rows) out.take(first, m, reverse, po, lay.ldc, work);
    if constexpr (Dual) detail::hand_rows(sec.out, first, m, reverse, static_cast<T const*>(po2), ldab, da, work);
  }
}

// scan_rows over matrices, with caller-provided scratch of scan_scratch_size(b, c) elements.
template <class T>
void scan_contract(matrix<T> const& a, matrix<T> const& b, matrix<T> const& c, matrix<T>& out, T* state, bool reverse,
                   T* scratch) {
  scan_rows(matrix_rows<T>{a}, matrix_rows<T>{b}, matrix_rows<T>{c}, matrix_sink<T>{out}, 0, b.rows, state, reverse,
            scratch);
}
template <class T>
void scan_contract(matrix<T> const& a, matrix<T> const& b, matrix<T>&& c, matrix<T>& out, T* state, bool reverse) {
  buffer<T> scratch(scan_scratch_size(b, c));
  scan_contract(a, b, c, out, state, reverse, scratch.get());
}

// The scan as written, the fast path's oracle: for each row in scan order,
// S += b_i c_iᵀ, then out_i = a_iᵀ S (cpu::path::simple). With a decay g
// (op::prefix_scan): a forward scan first decays the state it holds
// (S = g S + b_i c_iᵀ), a reverse scan decays it after the row's output, so
// that the state it leaves is the gradient of the state a forward scan enters
// with. Each decay is one rounded multiply, so a scan cut into calls anywhere
// gives the same bits as one call.
template <class T>
void scan_simple(matrix<T> const& a, matrix<T> const& b, matrix<T> const& c, matrix<T>& out, T* state, bool reverse,
                 T decay = 1) {
  index n = b.rows, da = b.cols, db = c.cols;
  auto forget = [&] {
    if (decay != T(1))
      for (index e = 0; e < da * db; ++e) state[e] = decay * state[e];
  };
  for (index t = 0; t < n; ++t) {
    index i = reverse ? n - 1 - t : t;
    if (!reverse) forget();
    for (index p = 0; p < da; ++p)
      for (index q = 0; q < db; ++q) state[p * db + q] += b(i, p) * c(i, q);
    T* o = out.row_mut(i);
    for (index q = 0; q < db; ++q) {
      T sum = 0;
      for (index p = 0; p < da; ++p) sum += a(i, p) * state[p * db + q];
      o[q] = sum;
    }
    if (reverse) forget();
  }
}

// sums += Σ b_i c_iᵀ over rows [lo, hi): the scan's state update alone (no
// outputs, so no A and half the arithmetic), with the state in registers.
template <class T>
struct no_outputs {
  T* in_place() const { return nullptr; }
  index stride() const { return 0; }
  std::size_t work() const { return 0; }
  void take(index, index, bool, T const*, index, T*) const {}
};
template <class T, class B, class C>
void scan_sums(B const& b, C const& c, index lo, index hi, T* sums, T* scratch) {
  scan_rows<false>(b, b, c, no_outputs<T>{}, lo, hi, sums, false, scratch);
}
template <class T, class B, class C>
std::size_t scan_sums_scratch_size(index n, B const& b, C const& c) {
  return scan_scratch_size<T>(n, b, b, c, no_outputs<T>{});
}

// scan_rows with the sequence split into `parts`, one per thread, for one long
// sequence on a machine with idle cores. First the sums Σ b_i c_iᵀ of every
// part but the last are computed (each part's rows shared by all threads),
// which gives the state each part starts from; then every part runs the whole
// scan from its own start, in parallel - 5/4 of the work of one scan, in 5/8
// of its time on two threads, and the sources and sink see every row once in
// the second phase, as in one scan. The sums are associated differently from
// one sequential scan, so results agree to rounding, not bit for bit.
template <class T, class A, class B, class C, class Out, class Second = no_second>
void scan_rows_split(A const& a, B const& b, C const& c, Out const& out, index n, T* state, bool reverse,
                     int parts, Second const& sec = {}, index before = 0) {
  index da = b.cols(), db = c.cols();
  std::size_t ab = static_cast<std::size_t>(da * db);
  auto bound = [&](int p) { return static_cast<index>(static_cast<long long>(n) * p / parts); };
  // part p in scan order covers rows [lo, hi): forward from the top, reverse from the bottom
  auto range = [&](int p) {
    return reverse ? std::pair{n - bound(p + 1), n - bound(p)} : std::pair{bound(p), bound(p + 1)};
  };
  // phase 1: the sums of parts 0 .. parts-2, each cut into `parts` pieces
  int pieces = (parts - 1) * parts;
  buffer<T> sums(ab * static_cast<std::size_t>(pieces));
  std::fill_n(sums.get(), sums.size(), T(0));
#pragma omp parallel num_threads(parts)
  {
    buffer<T> scratch(scan_sums_scratch_size<T>(n / parts + 1, b, c));
#pragma omp for schedule(static)
    for (int k = 0; k < pieces; ++k) {
      auto [lo, hi] = range(k / parts);
      index len = hi - lo, j = k % parts;
      index from = lo + len * j / parts, to = lo + len * (j + 1) / parts;
      scan_sums(b, c, from, to, sums.get() + ab * static_cast<std::size_t>(k), scratch.get());
    }
  }
  // enter[p]: the state entering part p = the state + the sums of parts 0 .. p-1
  buffer<T> enter(ab * static_cast<std::size_t>(parts));
  auto at = [&](buffer<T>& x, int p) { return x.get() + ab * static_cast<std::size_t>(p); };
  std::copy_n(state, ab, at(enter, 0));
  for (int p = 1; p < parts; ++p) {
    std::copy_n(at(enter, p - 1), ab, at(enter, p));
    for (int j = 0; j < parts; ++j) {
      T const* piece = at(sums, (p - 1) * parts + j);
      for (std::size_t e = 0; e < ab; ++e) at(enter, p)[e] += piece[e];
    }
  }
  // phase 2: every part from its own start
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p) {
    auto [lo, hi] = range(p);
    buffer<T> scratch(scan_scratch_size<T>(hi - lo, a, b, c, out, sec));
    scan_rows(a, b, c, out, lo, hi, at(enter, p), reverse, scratch.get(), sec, unit_decay{}, before + bound(p));
  }
  std::copy_n(at(enter, parts - 1), ab, state);  // the state after the last part
}
template <class T>
void scan_contract_split(matrix<T> const& a, matrix<T> const& b, matrix<T> const& c, matrix<T>& out, T* state,
                         bool reverse, int parts) {
  scan_rows_split(matrix_rows<T>{a}, matrix_rows<T>{b}, matrix_rows<T>{c}, matrix_sink<T>{out}, b.rows, state,
                  reverse, parts);
}

// Where a product's zeros are known (a causal mask made them): which
// triangle of A may be non-zero (lower: A_ik = 0 for k > i + a_diagonal;
// upper: for k < i - a_diagonal), and whether only out's lower triangle
// (j <= i + out_diagonal) is wanted, the rest then being written as zeros.
// The diagonals' offsets are 0 for the square scores of a whole plan; the
// scores of a block of query rows from r0 against the keys up to its last
// row have theirs r0 columns right (cpu/row_blocks.hpp). gemm skips the
// terms and tiles that are zero or unwanted: about half of an N x N product.
enum class triangle { full, lower, upper };
struct product_zeros {
  triangle a = triangle::full;
  bool lower_out = false;
  index a_diagonal = 0, out_diagonal = 0;
  bool any() const { return a != triangle::full || lower_out; }
};

namespace detail {
// Rows [i0, i0 + R) x vectors [j0, j0 + V lanes) of out (+)= A B over terms
// [kb, kb + k), the tile in registers over the whole sum: per term p, V
// vectors of B's row p and R broadcasts of A's column p (A in any layout; B's
// rows contiguous, b at row kb).
// (Partial: a last vector of which only the first `valid` columns exist in
// out, stored through a copy; a compile-time choice, not a test per store.)
template <int R, int V, bool Partial, class Vec, class T>
inline void gemm_tile(matrix<T> const& a, index i0, index kb, T const* __restrict b, index ldb, index k,
                      T* __restrict out, index ldo, bool accumulate, index valid) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  Vec acc[R][V];
  T const* ar[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    ar[r] = a.data + (i0 + r) * a.rs + kb * a.cs;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = Vec{};
  }
  index cs = a.cs;
  for (index p = 0; p < k; ++p) {
    Vec bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) bv[v] = simd::load<Vec>(b + p * ldb + v * L);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      Vec x = simd::broadcast<Vec>(ar[r][p * cs]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = simd::madd(x, bv[v], acc[r][v]);  // fused as favor::apply's sums
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      T* o = out + r * ldo + v * L;
      if (!Partial || v + 1 < V) {
        simd::store(o, accumulate ? simd::load<Vec>(o) + acc[r][v] : acc[r][v]);
      } else {
        T t[L];
        simd::store(t, acc[r][v]);
        for (index j = 0; j < valid; ++j) o[j] = accumulate ? o[j] + t[j] : t[j];
      }
    }
}
// Rows [i0, i1) of the strip of V vectors from column j0: R-row tiles, then 4, 2, 1.
// (B's rows from column j0 at b, ldb apart; Partial and valid as for gemm_tile.) A tile
// of `rows` rows from row i sums the terms terms(i, rows) = [kb, ke) of A's
// columns (none: the tile is skipped).
template <int R, int V, bool Partial, class Vec, class T, class Terms>
void gemm_strip(matrix<T> const& a, index i0, index i1, T const* b, index ldb, T* out, index ldo, bool accumulate,
                Terms const& terms, index valid = static_cast<index>(sizeof(Vec) / sizeof(T))) {
  index i = i0;
  auto tiles = [&]<int Rows>() {
    for (; i + Rows <= i1; i += Rows) {
      auto const [kb, ke] = terms(i, index{Rows});
      if (kb < ke)
        gemm_tile<Rows, V, Partial, Vec>(a, i, kb, b + kb * ldb, ldb, ke - kb, out + i * ldo, ldo, accumulate, valid);
    }
  };
  tiles.template operator()<R>();
  if constexpr (R > 4) tiles.template operator()<4>();
  if constexpr (R > 2) tiles.template operator()<2>();
  tiles.template operator()<1>();
}
// Columns [0, cols) of out (+)= A B over terms [0, k), for A whose columns
// are contiguous (a.rs == 1: a transposed view, such as φ(K)ᵀ): vectors run
// down out's rows, each term one load of A's column and one broadcast of B's
// element. Every element is the chain of multiply-adds over the terms in
// order that a tile makes (gemm_tile), so the bits are a tile's.
template <class Vec, class T>
void gemm_columns(matrix<T> const& a, index i0, index i1, T const* b, index ldb, index cols, index k, T* out,
                  index ldo, bool accumulate) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  auto put = [&](index i, index j, T v) {
    T* o = out + i * ldo + j;
    *o = accumulate ? *o + v : v;
  };
  for (index j = 0; j < cols; ++j) {
    index i = i0;
    auto vectors = [&]<int X>() {  // X vectors of rows at a time
      for (; i + X * L <= i1; i += X * L) {
        Vec acc[X];
#pragma GCC unroll 4
        for (int x = 0; x < X; ++x) acc[x] = Vec{};
        T const* ap = a.data + i;
        for (index p = 0; p < k; ++p) {
          Vec bv = simd::broadcast<Vec>(b[p * ldb + j]);
#pragma GCC unroll 4
          for (int x = 0; x < X; ++x) acc[x] = simd::madd(simd::load<Vec>(ap + p * a.cs + x * L), bv, acc[x]);
        }
        alignas(64) T t[X * L];
#pragma GCC unroll 4
        for (int x = 0; x < X; ++x) simd::store(t + x * L, acc[x]);
        for (index r = 0; r < X * L; ++r) put(i + r, j, t[r]);
      }
    };
    vectors.template operator()<4>();
    vectors.template operator()<1>();
    for (; i < i1; ++i) {
      T s = 0;
      for (index p = 0; p < k; ++p) s = lina::detail::madd(a.data[i + p * a.cs], b[p * ldb + j], s);
      put(i, j, s);
    }
  }
}
}  // namespace detail

// out = A B, or out += A B (accumulate). B's rows are made contiguous; then
// register tiles of out (scan_tile_shape's rows x 2 vectors) each sum a block
// of k in registers, so out is written once per block and B's rows stream
// past (measured on the non-causal forward, mostly these products, B·H = 8,
// N = 4096, D = 64: 48 -> 104 GFLOP/s against four rows of out kept in
// memory). The columns left after whole vectors (the normaliser's one, say)
// go down out's rows where A is a transposed view (gemm_columns), else
// through a zero-padded copy of B's as a last, partial vector. Rows are
// split across idle threads when the product is large (a single long
// sequence), into parts of equal work. With known zeros (product_zeros) each
// tile sums only its terms that are not zero in A and skips itself when
// out's lower triangle is all that is wanted and the tile lies above it; out
// past the diagonal is then written as zeros.
template <class T>
void gemm(matrix<T> const& a, matrix<T>&& b_in, matrix<T>& out, bool accumulate = false, product_zeros zeros = {}) {
  using shape = detail::scan_tile_shape<T>;
  using vec = typename shape::vec;
  constexpr int R = shape::rows, L = shape::lanes, V = shape::vectors;
  matrix<T> b = rows_contiguous(std::move(b_in));
  index r = a.rows, k = a.cols, c = b.cols;
  if (r * c == 0) return;
  index whole = c / L * L;  // columns in whole vectors
  T* o0 = out.row_mut(0);
  // The terms [kb, ke) a tile of `rows` rows from row i sums, of the block [0, kn)
  // from term p0, when its strip starts at column j0 (none: kb >= ke).
  index const oa = zeros.a_diagonal, oo = zeros.out_diagonal;
  auto terms = [&zeros, oa, oo](index i, index rows, index p0, index kn, index j0) {
    index kb = 0, ke = kn;
    if (zeros.a == triangle::lower) ke = std::max(index{0}, std::min(kn, i + rows + oa - p0));
    if (zeros.a == triangle::upper) kb = std::max(index{0}, i - oa - p0);
    if (zeros.lower_out && j0 >= i + rows + oo) ke = kb;
    return std::pair{kb, ke};
  };
  // Rows [i0, i1) of out, k in blocks of `block` rows of B (which then stay in
  // L2 while every tile of the rows reads them; a long sum such as φ(K)ᵀ[V|1]
  // over N = 65536 rows otherwise streams B from memory once per tile).
  constexpr index block = 512;
  // Out is zeroed first when a tile may sum no term (k = 0, or a triangular A);
  // with only out's lower triangle wanted, what lies past it is zeroed after.
  bool const zero_first = !accumulate && (k == 0 || zeros.a != triangle::full);
  auto rows = [&](index i0, index i1) {
    if (zero_first)
      for (index i = i0; i < i1; ++i) std::fill_n(out.row_mut(i), c, T(0));
    for (index p0 = 0; p0 < k; p0 += block) {
      index kn = std::min(block, k - p0);
      bool acc = accumulate || zero_first || p0 > 0;
      matrix<T> ak = view<T>(a.data + p0 * a.cs, a.rows, kn, a.rs, a.cs);
      T const* bk = b.data + p0 * b.rs;
      index j0 = 0;
      auto strip_terms = [&](index i, index n) {
        return zeros.any() ? terms(i, n, p0, kn, j0) : std::pair{index{0}, kn};
      };
      for (; j0 + V * L <= whole; j0 += V * L)
        detail::gemm_strip<R, V, false, vec>(ak, i0, i1, bk + j0, b.rs, o0 + j0, out.rs, acc, strip_terms);
      for (; j0 < whole; j0 += L)
        detail::gemm_strip<R, 1, false, vec>(ak, i0, i1, bk + j0, b.rs, o0 + j0, out.rs, acc, strip_terms);
      if (whole == c) continue;
      // The columns left over (fewer than a vector: the normaliser's one, say).
      // Where A's columns are contiguous (φ(K)ᵀ[V|1]), by vectors down out's
      // rows; else B's through a zero-padded copy as a last, partial vector
      // of out (one multiply-add per broadcast of A: by operation count a
      // third more work for φ(K)ᵀ[V|1] at M = 64). Not with known zeros: a
      // vector of rows would read terms skipped for some of them (a NaN
      // there would reach rows the mask keeps it from).
      if (a.rs == 1 && !zeros.any()) {
        detail::gemm_columns<vec>(ak, i0, i1, bk + whole, b.rs, c - whole, kn, o0 + whole, out.rs, acc);
        continue;
      }
      alignas(64) T pad[block * L];
      for (index p = 0; p < kn; ++p) {
        T const* from = bk + p * b.rs;
        std::copy(from + whole, from + c, pad + p * L);
        std::fill(pad + p * L + (c - whole), pad + (p + 1) * L, T(0));
      }
      detail::gemm_strip<R, 1, true, vec>(ak, i0, i1, static_cast<T const*>(pad), index{L}, o0 + whole, out.rs, acc,
                                          strip_terms, c - whole);
    }
    if (zeros.lower_out)  // (zeroed first: tiles end at most R rows and a strip past the diagonal)
      for (index i = i0; i < i1; ++i)
        std::fill(out.row_mut(i) + std::clamp<index>(i + 1 + oo, 0, c),
                  out.row_mut(i) + (zero_first ? std::clamp<index>(i + R + V * L + oo, 0, c) : c), T(0));
  };
#ifdef _OPENMP
  // rows in blocks of whole tiles over idle threads, when there is work for them
  constexpr double parallel_min_products = 1 << 22;  // multiply-adds: ~0.1 ms on one core, 100x an OpenMP start
  bool small = double(r) * double(k) * double(c) < parallel_min_products;
  int threads = omp_in_parallel() || small ? 1 : omp_get_max_threads();
  if (threads > 1) {
    // Parts of equal work: a block of R rows from i costs its terms times its columns.
    index blocks = (r + R - 1) / R;
    std::vector<double> upto(static_cast<std::size_t>(blocks) + 1, 0.0);
    for (index x = 0; x < blocks; ++x) {
      auto [kb, ke] = zeros.a == triangle::full ? std::pair{index{0}, k} : terms(x * R, R, 0, k, 0);
      index cols = zeros.lower_out ? std::clamp<index>((x + 1) * R + oo, 0, c) : c;
      upto[x + 1] = upto[x] + double(std::max(index{0}, ke - kb)) * double(cols) + 1;
    }
    auto cut = [&](int t) {  // the first block of part t
      auto at = std::lower_bound(upto.begin(), upto.end(), upto.back() * t / threads);
      return std::min(r, static_cast<index>(at - upto.begin()) * R);
    };
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) rows(cut(t), cut(t + 1));
    return;
  }
#endif
  rows(0, r);
}

// The product as written, gemm's oracle (cpu::path::simple): each element
// one sum over k in order.
template <class T>
void gemm_simple(matrix<T> const& a, matrix<T> const& b, matrix<T>& out) {
  for (index i = 0; i < a.rows; ++i)
    for (index j = 0; j < b.cols; ++j) {
      T sum = 0;
      for (index p = 0; p < a.cols; ++p) sum += a(i, p) * b(p, j);
      out.row_mut(i)[j] = sum;
    }
}

// Rows copied to a contiguous buffer, for maps that read whole rows.
template <class T>
void copy_row(matrix<T> const& x, index i, T* to) {
  for (index j = 0; j < x.cols; ++j) to[j] = x(i, j);
}

// A parametric map: every row of x with the projection w (d x m). A map that
// is a projection and a function of the row (Map::finish) projects all rows
// as one product (gemm: the same sums in the same order as its apply), then
// finishes each row in place.
template <class Map, class T>
void feature_map(matrix<T> const& x, matrix<T> const& w, matrix<T>& out) {
  std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
  buffer<T> row(d);
  if constexpr (requires(T* p) { Map::finish(static_cast<T const*>(p), d, m, p); }) {
    if (x.rows == 0) return;
    matrix<T> z = view<T>(out.row_mut(0), x.rows, w.cols, out.rs, 1);  // out's first m columns
    gemm(x, view(w.data, w.rows, w.cols, w.rs, w.cs), z);
    for (index i = 0; i < x.rows; ++i) {
      copy_row(x, i, row.get());
      Map::finish(static_cast<T const*>(row.get()), d, m, out.row_mut(i));
    }
  } else {
    matrix<T> wc = writable(view(w.data, w.rows, w.cols, w.rs, w.cs));  // contiguous d x m
    for (index i = 0; i < x.rows; ++i) {
      copy_row(x, i, row.get());
      Map::apply(static_cast<T const*>(row.get()), d, wc.data, m, out.row_mut(i));
    }
  }
}

// ---- backward ---------------------------------------------------------------

// A parametric map differentiated from its features' values
// (concepts::value_differentiable): H = ∂L/∂Z row by row from φ and G, then
// ∂X = H·Wᵀ (+ the map's grad_x) as one product; by_rows (the simple path,
// the oracle) sums each element of H·Wᵀ as written instead. The forward
// made Φ already, so the backward makes no Z = X·W: at B·H = 8, N = 4096,
// D = m = 64 FAVOR+'s backward took 110 ms with a d x m loop of dot products
// per row, 39-41 ms with Z made again in each of its four adjoints, 28 ms so
// (docs/benchmarks.md).
template <class Map, class T>
void feature_map_grad_z(matrix<T> const& w, matrix<T> const& phi, matrix<T> const& g, matrix<T>& out) {
  std::size_t d = static_cast<std::size_t>(w.rows), m = static_cast<std::size_t>(w.cols);
  buffer<T> pr(static_cast<std::size_t>(phi.cols)), gr(static_cast<std::size_t>(g.cols));
  for (index i = 0; i < phi.rows; ++i) {
    copy_row(phi, i, pr.get());
    copy_row(g, i, gr.get());
    Map::grad_z(d, m, static_cast<T const*>(pr.get()), static_cast<T const*>(gr.get()), out.row_mut(i));
  }
}
template <class Map, class T>
void feature_map_dx(matrix<T> const& x, matrix<T> const& w, matrix<T> const& h, matrix<T>& out, bool by_rows) {
  if (x.rows == 0) return;
  matrix<T> wt = view(w.data, w.cols, w.rows, w.cs, w.rs);
  if (by_rows)
    gemm_simple(h, wt, out);
  else
    gemm(h, std::move(wt), out);
  if constexpr (requires(T const* c, T* p) { Map::grad_x(c, std::size_t{}, std::size_t{}, c, p); }) {
    std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
    buffer<T> xr(d), hr(m);
    for (index i = 0; i < x.rows; ++i) {
      copy_row(x, i, xr.get());
      copy_row(h, i, hr.get());
      Map::grad_x(static_cast<T const*>(xr.get()), d, m, static_cast<T const*>(hr.get()), out.row_mut(i));
    }
  }
}

// Any other parametric map's adjoints, row by row through its vjp (dx: Param
// = false, d columns) and param_vjp (the h of ∂L/∂W = Σ_i x_i h_iᵀ: Param =
// true, m columns): a d x m loop of dot products per row.
template <class Map, bool Param, class T>
void feature_map_vjp(matrix<T> const& x, matrix<T> const& w, matrix<T> const& g, matrix<T>& out) {
  std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
  matrix<T> wc = writable(view(w.data, w.rows, w.cols, w.rs, w.cs));
  buffer<T> xr(d), gr(static_cast<std::size_t>(g.cols));
  for (index i = 0; i < x.rows; ++i) {
    copy_row(x, i, xr.get());
    copy_row(g, i, gr.get());
    if constexpr (Param)
      Map::param_vjp(static_cast<T const*>(xr.get()), d, wc.data, m, static_cast<T const*>(gr.get()), out.row_mut(i));
    else
      Map::vjp(static_cast<T const*>(xr.get()), d, wc.data, m, static_cast<T const*>(gr.get()), out.row_mut(i));
  }
}

}  // namespace lina::cpu::kernels
