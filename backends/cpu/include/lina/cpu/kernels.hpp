// The CPU backend's loops: one function per plan operation, on per-(batch,
// head) matrices. Straightforward and correct first; the scan keeps its
// a x b state in cache and touches each row once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

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

// C = A B. B's rows are made contiguous, then four rows of C at a time
// accumulate a_ik * B_k (each B row loaded once per four C rows).
template <class T>
matrix<T> gemm(matrix<T> const& a, matrix<T>&& b_in) {
  matrix<T> b = rows_contiguous(std::move(b_in));
  index r = a.rows, k = a.cols, c = b.cols;
  matrix<T> out = allocate<T>(r, c);
  if (r * c == 0) return out;
  std::memset(out.row_mut(0), 0, sizeof(T) * static_cast<std::size_t>(r * c));
  index i = 0;
  for (; i + 4 <= r; i += 4) {
    T* c0 = out.row_mut(i);
    T* c1 = out.row_mut(i + 1);
    T* c2 = out.row_mut(i + 2);
    T* c3 = out.row_mut(i + 3);
    for (index p = 0; p < k; ++p) {
      T a0 = a(i, p), a1 = a(i + 1, p), a2 = a(i + 2, p), a3 = a(i + 3, p);
      T const* bp = b.data + p * b.rs;
#pragma omp simd
      for (index j = 0; j < c; ++j) {
        T x = bp[j];
        c0[j] += a0 * x;
        c1[j] += a1 * x;
        c2[j] += a2 * x;
        c3[j] += a3 * x;
      }
    }
  }
  for (; i < r; ++i) {
    T* ci = out.row_mut(i);
    for (index p = 0; p < k; ++p) {
      T ai = a(i, p);
      T const* bp = b.data + p * b.rs;
#pragma omp simd
      for (index j = 0; j < c; ++j) ci[j] += ai * bp[j];
    }
  }
  return out;
}

namespace detail {

// The scan's register tile: P state rows x V vectors of state columns stay in
// registers while a chunk of rows streams past, with room left for one row
// of C, one of the output and two broadcasts.
template <class T>
struct scan_tile_shape {
  using vec = typename simd::vector_of<T>::type;
  static constexpr int lanes = simd::vector_of<T>::lanes;
  static constexpr int vectors = simd::registers >= 32 ? 2 : 2;
  static constexpr int rows = simd::registers >= 32 ? 6 : 4;
};

// One register tile of the scan over `n` packed rows: for each row i,
//   s[p][:] += b_i[p] c_i[:]     (the state after row i, p = 0..P-1)
//   o_i[:]  += a_i[p] s[p][:]    (p in order)
// `s` is the P x (V x lanes) tile of the state (row stride lds), `a`, `b` the
// packed rows' first of these P columns (row stride ldab), `c`, `o` their
// first of these columns (row stride ldco). Every element sees the same
// operations in the same order whatever n is, so a scan split into several
// calls gives the same bits as one call.
template <int P, int V, class Vec, class T>
inline void scan_tile(T* __restrict s, index lds, T const* __restrict a, T const* __restrict b, index ldab,
                      T const* __restrict c, T* __restrict o, index ldco, index n) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  Vec acc[P][V];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[p][v] = simd::load<Vec>(s + p * lds + v * L);
  for (index i = 0; i < n; ++i) {
    T const* ci = c + i * ldco;
    T* oi = o + i * ldco;
    T const* ai = a + i * ldab;
    T const* bi = b + i * ldab;
    Vec cv[V], ov[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      cv[v] = simd::load<Vec>(ci + v * L);
      ov[v] = simd::load<Vec>(oi + v * L);
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      Vec bp = simd::broadcast<Vec>(bi[p]), ap = simd::broadcast<Vec>(ai[p]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        acc[p][v] += bp * cv[v];
        ov[v] += ap * acc[p][v];
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) simd::store(oi + v * L, ov[v]);
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) simd::store(s + p * lds + v * L, acc[p][v]);
}

// All P-row tiles of one strip of W = V x lanes state columns, for a chunk of
// n packed rows. Tiles that reach past the state's da x db edge go through a
// zeroed P x W copy (the packed rows are zero there, so the copy stays zero).
template <int P, int V, class Vec, class T>
void scan_strip(T* state, index da, index db, index q0, T const* a, T const* b, index ldab, T const* c, T* o,
                index ldco, index n) {
  constexpr int W = V * static_cast<int>(sizeof(Vec) / sizeof(T));
  bool q_edge = q0 + W > db;
  for (index p0 = 0; p0 < ldab; p0 += P) {
    T* s = state + p0 * db + q0;
    if (!q_edge && p0 + P <= da) {
      scan_tile<P, V, Vec>(s, db, a + p0, b + p0, ldab, c + q0, o + q0, ldco, n);
      continue;
    }
    alignas(64) T tile[P * W] = {};
    index pn = std::min<index>(P, da - p0), qn = std::min<index>(W, db - q0);
    for (index p = 0; p < pn; ++p)
      for (index q = 0; q < qn; ++q) tile[p * W + q] = s[p * db + q];
    scan_tile<P, V, Vec>(tile, W, a + p0, b + p0, ldab, c + q0, o + q0, ldco, n);
    for (index p = 0; p < pn; ++p)
      for (index q = 0; q < qn; ++q) s[p * db + q] = tile[p * W + q];
  }
}

// Rows [t0, t0 + n) of the scan order (backwards when reversed) of x into
// `to`, each row `ld` wide with zeros past x's columns.
template <class T>
void pack_rows(matrix<T> const& x, index t0, index n, bool reverse, T* to, index ld) {
  index rows = x.rows;
  auto row_of = [&](index t) { return reverse ? rows - 1 - (t0 + t) : t0 + t; };
  if (x.cs == 1) {
    for (index t = 0; t < n; ++t) {
      T const* from = x.data + row_of(t) * x.rs;
      T* dst = to + t * ld;
      std::copy(from, from + x.cols, dst);
      std::fill(dst + x.cols, dst + ld, T(0));
    }
  } else {  // column by column: a transposed view reads along its rows
    for (index j = 0; j < x.cols; ++j)
      for (index t = 0; t < n; ++t) to[t * ld + j] = x.data[row_of(t) * x.rs + j * x.cs];
    for (index t = 0; t < n; ++t) std::fill(to + t * ld + x.cols, to + (t + 1) * ld, T(0));
  }
}

inline constexpr index round_up(index x, index m) { return (x + m - 1) / m * m; }

}  // namespace detail

// Rows per chunk of the scan (see scan_contract).
inline constexpr index scan_chunk_rows = 64;

// Row i of `out` = A_i^T S_i with S_i the running sum of B_j C_j^T over
// j <= i (forward) or j >= i (reverse). `state` (a x b, row-major) holds the
// sum on entry and on exit, so scans can be chained.
//
// The rows go in chunks: a chunk's rows of A, B and C are packed into small
// contiguous buffers (zero-padded to whole tiles), then every register tile
// of the state streams through the chunk (detail::scan_tile), so the state
// is loaded and stored once per chunk instead of once per row. Each state
// element still adds b_i c_i^T one row at a time and each output sums over
// the state's rows in order: the same operations whatever the chunking, so
// one call over N rows and N one-row calls agree bit for bit.
template <class T>
void scan_contract(matrix<T> const& a, matrix<T> const& b, matrix<T>&& c, matrix<T>& out, T* state, bool reverse) {
  using shape = detail::scan_tile_shape<T>;
  constexpr int P = shape::rows, L = shape::lanes, V = shape::vectors;
  index n = b.rows, da = b.cols, db = c.cols;
  if (n == 0 || db == 0) return;
  if (da == 0) {
    for (index i = 0; i < n; ++i) std::fill_n(out.row_mut(i), db, T(0));
    return;
  }
  index rows = std::min(scan_chunk_rows, n);
  index dap = detail::round_up(da, P), dbp = detail::round_up(db, L);
  index ab_size = detail::round_up(rows * dap, 16), co_size = detail::round_up(rows * dbp, 16);
  buffer<T> scratch(static_cast<std::size_t>(2 * ab_size + 2 * co_size));
  T* pa = scratch.get();
  T* pb = pa + ab_size;
  T* pc = pb + ab_size;
  T* po = pc + co_size;
  for (index t0 = 0; t0 < n; t0 += rows) {
    index m = std::min(rows, n - t0);
    detail::pack_rows(a, t0, m, reverse, pa, dap);
    detail::pack_rows(b, t0, m, reverse, pb, dap);
    detail::pack_rows(c, t0, m, reverse, pc, dbp);
    std::fill_n(po, m * dbp, T(0));
    using vec = typename shape::vec;
    index q0 = 0;
    for (; q0 + V * L <= dbp; q0 += V * L) detail::scan_strip<P, V, vec>(state, da, db, q0, pa, pb, dap, pc, po, dbp, m);
    for (; q0 < dbp; q0 += L) detail::scan_strip<P, 1, vec>(state, da, db, q0, pa, pb, dap, pc, po, dbp, m);
    for (index t = 0; t < m; ++t) {
      index i = reverse ? n - 1 - (t0 + t) : t0 + t;
      std::copy(po + t * dbp, po + t * dbp + db, out.row_mut(i));
    }
  }
}

template <class Map, class T>
matrix<T> feature_map(matrix<T> const& x) {
  if constexpr (concepts::elementwise_map<Map>) {
    matrix<T> out = allocate<T>(x.rows, x.cols);
    for (index i = 0; i < x.rows; ++i) {
      T* o = out.row_mut(i);
      for (index j = 0; j < x.cols; ++j) o[j] = Map::value(x(i, j));
    }
    return out;
  } else {
    index d = x.cols, cdim = static_cast<index>(Map::features(static_cast<std::size_t>(d)));
    matrix<T> out = allocate<T>(x.rows, cdim);
    buffer<T> row(static_cast<std::size_t>(d));
    for (index i = 0; i < x.rows; ++i) {
      for (index j = 0; j < d; ++j) row.get()[j] = x(i, j);
      Map::apply(static_cast<T const*>(row.get()), static_cast<std::size_t>(d), out.row_mut(i));
    }
    return out;
  }
}

// Rows copied to a contiguous buffer, for maps that read whole rows.
template <class T>
void copy_row(matrix<T> const& x, index i, T* to) {
  for (index j = 0; j < x.cols; ++j) to[j] = x(i, j);
}

// A parametric map: every row of x with the projection w (d x m).
template <class Map, class T>
matrix<T> feature_map(matrix<T> const& x, matrix<T> const& w) {
  std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
  matrix<T> wc = writable(view(w.data, w.rows, w.cols, w.rs, w.cs));  // contiguous d x m
  matrix<T> out = allocate<T>(x.rows, static_cast<index>(Map::features(m)));
  buffer<T> row(d);
  for (index i = 0; i < x.rows; ++i) {
    copy_row(x, i, row.get());
    Map::apply(static_cast<T const*>(row.get()), d, wc.data, m, out.row_mut(i));
  }
  return out;
}

template <class T>
void causal_mask(matrix<T>& m) {
  for (index i = 0; i < m.rows; ++i)
    for (index j = i + 1; j < m.cols; ++j) m.at_mut(i, j) = T(0);
}

template <class T, class F>
void apply_inplace(matrix<T>& m, F f) {
  for (index i = 0; i < m.rows; ++i)
    for (index j = 0; j < m.cols; ++j) m.at_mut(i, j) = f(m(i, j));
}

// a_ij = f(a_ij, b_ij), in place.
template <class T, class F>
void combine_inplace(matrix<T>& a, matrix<T> const& b, F f) {
  for (index i = 0; i < a.rows; ++i)
    for (index j = 0; j < a.cols; ++j) a.at_mut(i, j) = f(a(i, j), b(i, j));
}

// S_ij / (sum_k S_ik + eps), in place.
template <class T>
void normalize_rows(matrix<T>& m, T eps) {
  for (index i = 0; i < m.rows; ++i) {
    T sum = 0;
    for (index j = 0; j < m.cols; ++j) sum += m(i, j);
    T den = sum + eps;
    for (index j = 0; j < m.cols; ++j) m.at_mut(i, j) /= den;
  }
}

// [X | 1]
template <class T>
matrix<T> append_ones(matrix<T> const& x) {
  matrix<T> out = allocate<T>(x.rows, x.cols + 1);
  for (index i = 0; i < x.rows; ++i) {
    T* o = out.row_mut(i);
    for (index j = 0; j < x.cols; ++j) o[j] = x(i, j);
    o[x.cols] = T(1);
  }
  return out;
}

// X[:, :-1] / (X[:, -1] + eps)
template <class T>
matrix<T> row_divide(matrix<T> const& x, T eps) {
  index m = x.cols - 1;
  matrix<T> out = allocate<T>(x.rows, m);
  for (index i = 0; i < x.rows; ++i) {
    T den = x(i, m) + eps;
    T* o = out.row_mut(i);
    for (index j = 0; j < m; ++j) o[j] = x(i, j) / den;
  }
  return out;
}

// ---- backward ---------------------------------------------------------------

// J_φ(X_i)^T G_i for every row (φ'(X) ⊙ G for an element-wise map).
template <class Map, class T>
matrix<T> feature_map_vjp(matrix<T> const& x, matrix<T> const& g) {
  matrix<T> out = allocate<T>(x.rows, x.cols);
  if constexpr (concepts::elementwise_map<Map>) {
    for (index i = 0; i < x.rows; ++i) {
      T* o = out.row_mut(i);
      for (index j = 0; j < x.cols; ++j) o[j] = g(i, j) * Map::derivative(x(i, j));
    }
  } else {
    buffer<T> xr(static_cast<std::size_t>(x.cols)), gr(static_cast<std::size_t>(g.cols));
    for (index i = 0; i < x.rows; ++i) {
      for (index j = 0; j < x.cols; ++j) xr.get()[j] = x(i, j);
      for (index j = 0; j < g.cols; ++j) gr.get()[j] = g(i, j);
      Map::vjp(static_cast<T const*>(xr.get()), static_cast<std::size_t>(x.cols), static_cast<T const*>(gr.get()),
               out.row_mut(i));
    }
  }
  return out;
}

// A parametric map's row-wise adjoints: dx (Param = false, d columns) or the
// h of ∂L/∂W = Σ_i x_i h_iᵀ (Param = true, m columns).
template <class Map, bool Param, class T>
matrix<T> feature_map_vjp(matrix<T> const& x, matrix<T> const& w, matrix<T> const& g) {
  std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
  matrix<T> wc = writable(view(w.data, w.rows, w.cols, w.rs, w.cs));
  matrix<T> out = allocate<T>(x.rows, static_cast<index>(Param ? m : d));
  buffer<T> xr(d), gr(static_cast<std::size_t>(g.cols));
  for (index i = 0; i < x.rows; ++i) {
    copy_row(x, i, xr.get());
    copy_row(g, i, gr.get());
    if constexpr (Param)
      Map::param_vjp(static_cast<T const*>(xr.get()), d, wc.data, m, static_cast<T const*>(gr.get()), out.row_mut(i));
    else
      Map::vjp(static_cast<T const*>(xr.get()), d, wc.data, m, static_cast<T const*>(gr.get()), out.row_mut(i));
  }
  return out;
}

// The adjoint of normalize(S): G_ij / d_i - (sum_k G_ik S_ik) / d_i^2, d_i = sum_k S_ik + eps.
template <class T>
matrix<T> normalize_vjp(matrix<T> const& s, matrix<T> const& g, T eps) {
  matrix<T> out = allocate<T>(s.rows, s.cols);
  for (index i = 0; i < s.rows; ++i) {
    T sum = 0, dot = 0;
    for (index j = 0; j < s.cols; ++j) {
      sum += s(i, j);
      dot += g(i, j) * s(i, j);
    }
    T den = sum + eps;
    T* o = out.row_mut(i);
    for (index j = 0; j < s.cols; ++j) o[j] = g(i, j) / den - dot / (den * den);
  }
  return out;
}

// The adjoint of row_divide(Y): G_e / d for the leading columns and
// -sum_e G_e Y_e / d^2 for the last, d = Y_last + eps.
template <class T>
matrix<T> row_divide_vjp(matrix<T> const& y, matrix<T> const& g, T eps) {
  index m = y.cols - 1;
  matrix<T> out = allocate<T>(y.rows, y.cols);
  for (index i = 0; i < y.rows; ++i) {
    T den = y(i, m) + eps;
    T dot = 0;
    T* o = out.row_mut(i);
    for (index e = 0; e < m; ++e) {
      o[e] = g(i, e) / den;
      dot += g(i, e) * y(i, e);
    }
    o[m] = -dot / (den * den);
  }
  return out;
}

}  // namespace lina::cpu::kernels
