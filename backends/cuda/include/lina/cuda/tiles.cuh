// lina's device tile operations: the CUDA half of the tile vocabulary whose
// host half is the emulation (backends/cuda/src/emulate.cpp). Generated
// kernels (emit.cpp) include this header; it is embedded in the library as a
// string and handed to NVRTC as "lina/tiles.cuh", so it includes nothing —
// no toolkit header, no standard library.
//
// Every operation is block-wide: all threads of the block call it with the
// same arguments, it works on fp32 tiles in shared memory (row-major, rows ×
// cols given as template arguments) and ends with __syncthreads(). The
// semantics are those listed in lina/cuda/program.hpp, element for element:
// products are one fmaf chain per element in increasing k, inputs convert to
// fp32 exactly, outputs round to nearest even.
//
// This first version is plain FMA loops over shared memory, one element per
// thread at a time: correct first; tensor cores (mma) come next.
#pragma once

namespace lina {
namespace tile {

// The argument block of every forward kernel (lina::cuda::forward_args on the host).
struct operand {
  const void* data;       // element (0, 0, 0, 0)
  long long stride[4];    // in elements: batch, head, row, col
  long long cols;
};
struct forward_args {
  operand in[4];
  operand out;
  operand state_in;   // chained kernels: the running sums they start from (fp32)
  operand state_out;  // chained kernels: where they leave them (fp32; never overlaps state_in)
  long long batch, heads, n;
};

// ---- element types ----------------------------------------------------------------
struct f32 {};
struct f16 {};
struct bf16 {};

__device__ __forceinline__ float load_element(f32, const void* p, long long i) {
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ float load_element(bf16, const void* p, long long i) {
  return __uint_as_float(static_cast<unsigned int>(static_cast<const unsigned short*>(p)[i]) << 16);
}
__device__ __forceinline__ float load_element(f16, const void* p, long long i) {
  unsigned short h = static_cast<const unsigned short*>(p)[i];
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ void store_element(f32, void* p, long long i, float x) { static_cast<float*>(p)[i] = x; }
__device__ __forceinline__ void store_element(bf16, void* p, long long i, float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  static_cast<unsigned short*>(p)[i] = h;
}
__device__ __forceinline__ void store_element(f16, void* p, long long i, float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  static_cast<unsigned short*>(p)[i] = h;
}

// ---- feature maps -------------------------------------------------------------------
struct identity {
  __device__ static float apply(float x) { return x; }
};
struct elu_plus_one {
  __device__ static float apply(float x) { return x > 0.0f ? x + 1.0f : expf(x); }
};
struct relu {
  __device__ static float apply(float x) { return x < 0.0f ? 0.0f : x; }  // NaN passes
};

// A row map: Map::apply(x, d, feature) is feature f of the row x (d columns).
// poly2: [x_a² (a), (√2·x_a)·x_b (b > a)], the packing of lina::poly2.
struct poly2 {
  __device__ static float apply(const float* x, int d, int f) {
    int a = 0;
    while (f >= d - a) f -= d - a, ++a;  // row a of the packed upper triangle holds d - a features
    const float r2 = 1.41421356237309504880f;
    return f == 0 ? x[a] * x[a] : r2 * x[a] * x[a + f];
  }
};

// ---- tile operations ----------------------------------------------------------------
template <int R, int C>
__device__ void zero(float* t) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) t[e] = 0.0f;
  __syncthreads();
}

// t[i][j] = in(base + (r0+i)·row_stride + (c0+j)·col_stride) for i < rows,
// j < width, c0 + j < cols; 0 elsewhere.
template <class E, int R, int C>
__device__ void load(float* t, const operand& in, long long base, long long r0, long long c0, int rows, int width) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    float x = 0.0f;
    if (i < rows && j < width && c0 + j < in.cols)
      x = load_element(E{}, in.data, base + (r0 + i) * in.stride[2] + (c0 + j) * in.stride[3]);
    t[e] = x;
  }
  __syncthreads();
}

template <class Map, int R, int C>
__device__ void map(float* t, int rows) {
  for (int e = threadIdx.x; e < rows * C; e += blockDim.x) t[e] = Map::apply(t[e]);
  __syncthreads();
}

// t (R × C) = Map(x) row by row for i < rows, 0 below; x is R × D.
template <class Map, int R, int C, int D>
__device__ void map_rows(float* t, const float* x, int rows) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, f = e % C;
    t[e] = i < rows ? Map::apply(x + i * D, D, f) : 0.0f;
  }
  __syncthreads();
}

template <int R, int C>
__device__ void ones_column(float* t, int rows) {
  for (int i = threadIdx.x; i < rows; i += blockDim.x) t[i * C + C - 1] = 1.0f;
  __syncthreads();
}

// t (R × C) = (Acc ? t : 0) + op(a)·op(b), inner dimension K; a is R × K
// (K × R when TA), b is K × C (C × K when TB). t is neither a nor b.
template <int R, int C, int K, bool TA, bool TB, bool Acc>
__device__ void product(float* t, const float* a, const float* b) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    float acc = Acc ? t[e] : 0.0f;
    for (int k = 0; k < K; ++k) {
      const float u = TA ? a[k * R + i] : a[i * K + k];
      const float w = TB ? b[j * K + k] : b[k * C + j];
      acc = fmaf(u, w, acc);
    }
    t[e] = acc;
  }
  __syncthreads();
}

template <int R, int C>
__device__ void mask_causal(float* t) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x)
    if (e % C > e / C) t[e] = 0.0f;
  __syncthreads();
}

// t[i][j] /= t[i][C-1] + eps for j < C - 1 (the last column is read, never written).
template <int R, int C>
__device__ void row_divide(float* t, float eps) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    if (j < C - 1) t[e] = t[e] / (t[i * C + C - 1] + eps);
  }
  __syncthreads();
}

template <class E, int R, int C>
__device__ void store(const float* t, const operand& out, long long base, long long r0, long long c0, int rows,
                      int width) {
  void* data = const_cast<void*>(out.data);
  for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    if (j < width && c0 + j < out.cols)
      store_element(E{}, data, base + (r0 + i) * out.stride[2] + (c0 + j) * out.stride[3], t[e]);
  }
  __syncthreads();
}

// The state of a chained kernel: this block's part of the fp32 [C, W] running
// sums of one (batch, head). t[i][j] = s(i, c0 + j) for j < width and c0 + j
// < m_cols (m_cols = s.cols − 1 when Z, else s.cols); Z: t[i][C−1] = s(i,
// s.cols − 1), the normaliser column; 0 elsewhere.
template <int R, int C, bool Z>
__device__ void load_state(float* t, const operand& s, long long base, long long c0, int width) {
  const float* data = static_cast<const float*>(s.data);
  const long long m_cols = Z ? s.cols - 1 : s.cols;
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    float x = 0.0f;
    if (Z && j == C - 1)
      x = data[base + i * s.stride[2] + (s.cols - 1) * s.stride[3]];
    else if (j < width && c0 + j < m_cols)
      x = data[base + i * s.stride[2] + (c0 + j) * s.stride[3]];
    t[e] = x;
  }
  __syncthreads();
}

// The inverse of load_state; the normaliser column only from the block whose
// columns start at 0 (every block of the (batch, head) holds the same z).
template <int R, int C, bool Z>
__device__ void store_state(const float* t, const operand& s, long long base, long long c0, int width) {
  float* data = static_cast<float*>(const_cast<void*>(s.data));
  const long long m_cols = Z ? s.cols - 1 : s.cols;
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    if (Z && j == C - 1) {
      if (c0 == 0) data[base + i * s.stride[2] + (s.cols - 1) * s.stride[3]] = t[e];
    } else if (j < width && c0 + j < m_cols) {
      data[base + i * s.stride[2] + (c0 + j) * s.stride[3]] = t[e];
    }
  }
  __syncthreads();
}

}  // namespace tile
}  // namespace lina
