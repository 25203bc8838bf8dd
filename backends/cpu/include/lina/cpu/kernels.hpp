// The CPU backend's loops: one function per plan operation, on per-(batch,
// head) matrices, each writing into a destination `out` the caller sized
// (rows contiguous: out.cs == 1, any row stride). Straightforward and correct
// first; the scan keeps its a x b state in cache and touches each row once.
#pragma once

#include <cmath>
#include <cstring>

#include "lina/cpu/matrix.hpp"
#include "lina/feature_maps.hpp"

namespace lina::cpu::kernels {

// A row-major copy unless the rows are already contiguous.
template <class T>
matrix<T> rows_contiguous(matrix<T>&& m) {
  if (m.cs == 1) return std::move(m);
  return writable(std::move(m));
}

// out = A B. B's rows are made contiguous, then four rows of C at a time
// accumulate a_ik * B_k (each B row loaded once per four C rows).
template <class T>
void gemm(matrix<T> const& a, matrix<T>&& b_in, matrix<T>& out) {
  matrix<T> b = rows_contiguous(std::move(b_in));
  index r = a.rows, k = a.cols, c = b.cols;
  if (r * c == 0) return;
  for (index i = 0; i < r; ++i) std::fill_n(out.row_mut(i), c, T(0));
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
}

// Row i of `out` = A_i^T S_i with S_i the running sum of B_j C_j^T over
// j <= i (forward) or j >= i (reverse). `state` (a x b, row-major) holds the
// sum on entry and on exit, so scans can be chained.
template <class T>
void scan_contract(matrix<T> const& a, matrix<T> const& b, matrix<T>&& c_in, matrix<T>& out, T* state,
                   bool reverse) {
  matrix<T> c = rows_contiguous(std::move(c_in));
  index n = b.rows, da = b.cols, db = c.cols;
  for (index t = 0; t < n; ++t) {
    index i = reverse ? n - 1 - t : t;
    T const* ci = c.data + i * c.rs;
    for (index p = 0; p < da; ++p) {
      T bp = b(i, p);
      T* s = state + p * db;
#pragma omp simd
      for (index q = 0; q < db; ++q) s[q] += bp * ci[q];
    }
    T* o = out.row_mut(i);
    for (index q = 0; q < db; ++q) o[q] = T(0);
    for (index p = 0; p < da; ++p) {
      T ap = a(i, p);
      T const* s = state + p * db;
#pragma omp simd
      for (index q = 0; q < db; ++q) o[q] += ap * s[q];
    }
  }
}

template <class Map, class T>
void feature_map(matrix<T> const& x, matrix<T>& out) {
  if constexpr (concepts::elementwise_map<Map>) {
    for (index i = 0; i < x.rows; ++i) {
      T* o = out.row_mut(i);
      for (index j = 0; j < x.cols; ++j) o[j] = Map::value(x(i, j));
    }
  } else {
    index d = x.cols;
    buffer<T> row(static_cast<std::size_t>(d));
    for (index i = 0; i < x.rows; ++i) {
      for (index j = 0; j < d; ++j) row.get()[j] = x(i, j);
      Map::apply(static_cast<T const*>(row.get()), static_cast<std::size_t>(d), out.row_mut(i));
    }
  }
}

// Rows copied to a contiguous buffer, for maps that read whole rows.
template <class T>
void copy_row(matrix<T> const& x, index i, T* to) {
  for (index j = 0; j < x.cols; ++j) to[j] = x(i, j);
}

// A parametric map: every row of x with the projection w (d x m).
template <class Map, class T>
void feature_map(matrix<T> const& x, matrix<T> const& w, matrix<T>& out) {
  std::size_t d = static_cast<std::size_t>(x.cols), m = static_cast<std::size_t>(w.cols);
  matrix<T> wc = writable(view(w.data, w.rows, w.cols, w.rs, w.cs));  // contiguous d x m
  buffer<T> row(d);
  for (index i = 0; i < x.rows; ++i) {
    copy_row(x, i, row.get());
    Map::apply(static_cast<T const*>(row.get()), d, wc.data, m, out.row_mut(i));
  }
}

template <class T>
void copy(matrix<T> const& x, matrix<T>& out) {
  for (index i = 0; i < x.rows; ++i) {
    T* o = out.row_mut(i);
    for (index j = 0; j < x.cols; ++j) o[j] = x(i, j);
  }
}

template <class T>
void causal_mask(matrix<T>& m) {
  for (index i = 0; i < m.rows; ++i)
    for (index j = i + 1; j < m.cols; ++j) m.at_mut(i, j) = T(0);
}

// out_ij = f(x_ij)
template <class T, class F>
void map(matrix<T> const& x, matrix<T>& out, F f) {
  for (index i = 0; i < x.rows; ++i) {
    T* o = out.row_mut(i);
    for (index j = 0; j < x.cols; ++j) o[j] = f(x(i, j));
  }
}

// out_ij = f(a_ij, b_ij)
template <class T, class F>
void zip(matrix<T> const& a, matrix<T> const& b, matrix<T>& out, F f) {
  for (index i = 0; i < a.rows; ++i) {
    T* o = out.row_mut(i);
    for (index j = 0; j < a.cols; ++j) o[j] = f(a(i, j), b(i, j));
  }
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
void append_ones(matrix<T> const& x, matrix<T>& out) {
  for (index i = 0; i < x.rows; ++i) {
    T* o = out.row_mut(i);
    for (index j = 0; j < x.cols; ++j) o[j] = x(i, j);
    o[x.cols] = T(1);
  }
}

// X[:, :-1] / (X[:, -1] + eps)
template <class T>
void row_divide(matrix<T> const& x, matrix<T>& out, T eps) {
  index m = x.cols - 1;
  for (index i = 0; i < x.rows; ++i) {
    T den = x(i, m) + eps;
    T* o = out.row_mut(i);
    for (index j = 0; j < m; ++j) o[j] = x(i, j) / den;
  }
}

// ---- backward ---------------------------------------------------------------

// J_φ(X_i)^T G_i for every row (φ'(X) ⊙ G for an element-wise map).
template <class Map, class T>
void feature_map_vjp(matrix<T> const& x, matrix<T> const& g, matrix<T>& out) {
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
}

// A parametric map's row-wise adjoints: dx (Param = false, d columns) or the
// h of ∂L/∂W = Σ_i x_i h_iᵀ (Param = true, m columns).
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

// The adjoint of normalize(S): G_ij / d_i - (sum_k G_ik S_ik) / d_i^2, d_i = sum_k S_ik + eps.
template <class T>
void normalize_vjp(matrix<T> const& s, matrix<T> const& g, matrix<T>& out, T eps) {
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
}

// The adjoint of row_divide(Y): G_e / d for the leading columns and
// -sum_e G_e Y_e / d^2 for the last, d = Y_last + eps.
template <class T>
void row_divide_vjp(matrix<T> const& y, matrix<T> const& g, matrix<T>& out, T eps) {
  index m = y.cols - 1;
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
}

}  // namespace lina::cpu::kernels
