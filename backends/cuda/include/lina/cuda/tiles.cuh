// lina's device tile operations: the CUDA half of the tile vocabulary whose
// host half is the emulation (backends/cuda/src/emulate.cpp). Generated
// kernels (emit.cpp) include this header; it is embedded in the library as a
// string and handed to NVRTC as "lina/tiles.cuh", so it includes nothing —
// no toolkit header, no standard library. The tests also compile it, with the
// kernels that include it, as host C++ (LINA_TILES_ON_HOST, tests/simt) and
// run them on the CPU against the emulation.
//
// Every operation is block-wide: all threads of the block call it with the
// same arguments, and it works on fp32 (or bf16) tiles in shared memory
// (row-major, rows × cols given as template arguments, rows P elements
// apart). An operation does not wait for the block: the generated kernel puts
// a __syncthreads() between two operations where the second reads or writes
// a tile (or global memory) the first wrote, or writes one the first read
// (emit.cpp, barriers) — so loads of different tiles, for one, run without
// one between them. The semantics are those listed in lina/cuda/program.hpp,
// element for element: inputs convert to fp32 exactly, outputs round to
// nearest even; products are one fmaf chain per element in increasing k
// (fma_f32) or tensor-core mma.sync on operands rounded to bf16 or tf32 as
// they are read from shared memory, accumulating in fp32 registers from zero
// (an accumulating product adds its sums to the tile after them).
//
// Element-wise operations give one element to one thread at a time; a
// product gives each warp 16-row stripes × a few 8-column tiles of the result.
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
  operand in[6];      // Q, K, V, [∂out (backward)], W (φ(Q)'s or both's), φ(K)'s own W
  operand out;
  operand state_in;   // chained kernels: the running sums they start from (fp32)
  operand state_out;  // chained kernels: where they leave them (fp32; never overlaps state_in)
  long long batch, heads, n;
  operand extra[10];  // backward kernels: ∂K, ∂V, scratch rows, ∂W…; split ones: the groups' sums (program::extras)
  long long group_rows;  // split kernels: rows per group
  long long n_keys;      // rows of K and V when they are not Q's (cross-attention); -1: n
  const long long* row_offsets;  // packed sequences: batch b's rows of batch row 0 (null: not packed)
};
static_assert(sizeof(operand) == 48 && sizeof(forward_args) == 19 * 48 + 48,
              "forward_args must keep the layout of lina::cuda::forward_args (program.hpp)");

// ---- where a lane's tensor-core operands live ----------------------------------------
// Plain arithmetic, so this part also compiles as host C++ on its own (without
// __CUDACC__ or LINA_TILES_ON_HOST the header stops after it):
// tests/test_cuda.cpp checks it against the PTX ISA's description of
// mma.m16n8k16 and ldmatrix.
#if defined(__CUDACC__)
#define LINA_TILE_FN __host__ __device__ __forceinline__ constexpr
#else
#define LINA_TILE_FN constexpr
#endif
// mma.sync.m16n8k16 (bf16), lane l = (g, q) = (l / 4, l % 4). A (16 × 16):
// register r holds the pair (row a_row, column a_k and a_k + 1); B (16 × 8):
// register r holds (row b_k and b_k + 1, column g); the accumulator's element
// r is (c_row, c_col) — rows g, g + 8 × columns 2q, 2q + 1. (m16n8k8, tf32: A
// rows g, g + 8 × columns q, q + 4; B rows q, q + 4 — one element per register;
// the same accumulator.)
struct mma16 {
  static LINA_TILE_FN int a_row(int lane, int r) { return (lane >> 2) + (r & 1) * 8; }
  static LINA_TILE_FN int a_k(int lane, int r) { return 2 * (lane & 3) + (r >> 1) * 8; }
  static LINA_TILE_FN int b_k(int lane, int r) { return 2 * (lane & 3) + r * 8; }
  static LINA_TILE_FN int b_col(int lane) { return lane >> 2; }
  static LINA_TILE_FN int c_row(int lane, int r) { return (lane >> 2) + (r >> 1) * 8; }
  static LINA_TILE_FN int c_col(int lane, int r) { return 2 * (lane & 3) + (r & 1); }
  // Fragments read element by element (a_elements, b_elements): lane l's
  // elements lie at one offset from the fragment's first element, plus one per
  // register; `outer` and `k` are the steps, in elements, along op(a)'s rows
  // (op(b)'s columns) and along k as stored. k16: the layout above (a
  // register's second element at + k); else m16n8k8's (one element).
  static LINA_TILE_FN int lane_offset(int lane, int outer, int k, bool k16) {
    return (lane >> 2) * outer + (k16 ? 2 * (lane & 3) : lane & 3) * k;
  }
  static LINA_TILE_FN int a_register_offset(int r, int outer, int k, bool k16) {
    return (r & 1) * 8 * outer + (r >> 1) * (k16 ? 8 : 4) * k;
  }
  static LINA_TILE_FN int b_register_offset(int r, int k, bool k16) { return r * (k16 ? 8 : 4) * k; }
  // ldmatrix.x4 (an A fragment) or .x2 (a B fragment, seen as op(b)ᵀ: 8 rows
  // × 16 k) loads 8 × 8 matrices of 16-bit elements whose 8 rows, 16 bytes
  // each, lanes 8m … 8m + 7 point at. For the fragments above matrix m holds
  // rows (m & 1)·8… and k (m >> 1)·8… of A, or k m·8… of op(b)ᵀ; stored with k
  // along its rows it is loaded with .trans. The offset of the element lane
  // l points at, for the fragment whose first element is the operand's (row
  // or column outer0, k0), stored with pitch P (k-major: k indexes the rows):
  static LINA_TILE_FN int ldmatrix_offset(int lane, bool x4, bool k_major, int P, int outer0, int k0) {
    const int m = x4 ? lane >> 3 : (lane >> 3) & 1, r = lane & 7;
    const int outer = outer0 + (x4 ? (m & 1) * 8 : 0), k = k0 + (x4 ? (m >> 1) * 8 : m * 8);
    return k_major ? (k + r) * P + outer : (outer + r) * P + k;
  }
};

#if defined(__CUDACC__) || defined(LINA_TILES_ON_HOST)

// ---- the PTX the tiles use --------------------------------------------------------------
// Every instruction written in inline PTX, named once here. Compiled as host
// C++ for tests/simt (LINA_TILES_ON_HOST), the header takes these from the
// host run instead — conversions by their rounding rules, mma and ldmatrix as
// whole-warp operations — and everything below it runs as written.
#if !defined(LINA_TILES_ON_HOST)
namespace ptx {
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {  // nearest even
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ unsigned short f32_to_f16(float x) {  // nearest even
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
// Two values rounded to nearest even, `lo` in the low half.
__device__ __forceinline__ unsigned f32x2_to_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned f32x2_to_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned f32_to_tf32(float x) {  // nearest, ties away from zero
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float ex2_approx(float x) {  // 2^x, subnormal results 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.L2 [%0];" : : "l"(p)); }
// d += a·b on the warp's fragments (lina::tile::mma16 has where each lane's live).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
  return a;
}
// ldmatrix of 16-bit elements in shared memory: four (two) 8 × 8 matrices
// whose rows lanes 8m … 8m + 7 point at (p: this lane's row).
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(p)));
}
}  // namespace ptx
#endif

// ---- element types ----------------------------------------------------------------
struct f32 {};
struct f16 {};
struct bf16 {};

// ---- product precisions (lina::cuda::precision) --------------------------------------
struct fma_f32 {};
struct mma_tf32 {};
struct mma_bf16 {};

template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ float load_element(f32, const void* p, long long i) {
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ float load_element(bf16, const void* p, long long i) {
  return __uint_as_float(static_cast<unsigned int>(static_cast<const unsigned short*>(p)[i]) << 16);
}
__device__ __forceinline__ float load_element(f16, const void* p, long long i) {
  return ptx::f16_to_f32(static_cast<const unsigned short*>(p)[i]);
}
__device__ __forceinline__ void store_element(f32, void* p, long long i, float x) { static_cast<float*>(p)[i] = x; }
__device__ __forceinline__ void store_element(bf16, void* p, long long i, float x) {
  static_cast<unsigned short*>(p)[i] = ptx::f32_to_bf16(x);
}
__device__ __forceinline__ void store_element(f16, void* p, long long i, float x) {
  static_cast<unsigned short*>(p)[i] = ptx::f32_to_f16(x);
}

// ---- feature maps -------------------------------------------------------------------
// apply(x) is φ(x), derivative(x) is φ′(x) (map_grad).
struct identity {
  __device__ static float apply(float x) { return x; }
  __device__ static float derivative(float) { return 1.0f; }
};
struct elu_plus_one {
  __device__ static float apply(float x) { return x > 0.0f ? x + 1.0f : expf(x); }
  __device__ static float derivative(float x) { return x > 0.0f ? 1.0f : expf(x); }  // NaN passes
};
struct relu {
  __device__ static float apply(float x) { return x < 0.0f ? 0.0f : x; }  // NaN passes
  __device__ static float derivative(float x) { return x > 0.0f ? 1.0f : 0.0f; }
};

// φ and φ′ as loads of 16-bit inputs apply them (load_map, map_grad): elu+1's exp as one
// ex2.approx of x·log₂e — a relative error of a few 2⁻²³ plus |x|·2⁻²⁴ from
// the product, far below the bf16 tile (2⁻⁸) or the tf32 products (2⁻¹¹) its
// result goes to, and 0 where e^x is below fp32's normal range (x < −87.3;
// .ftz: one instruction, not four) — in place of expf's ten instructions, for
// every element of φ(Q) and φ(K) and of their adjoints. fp32 inputs keep expf.
__device__ __forceinline__ float exp_approx(float x) { return ptx::ex2_approx(x * 1.44269504088896341f); }
template <class Map> struct map_16bit : Map {};
template <> struct map_16bit<elu_plus_one> {
  __device__ static float apply(float x) { return x > 0.0f ? x + 1.0f : exp_approx(x); }  // NaN passes
  __device__ static float derivative(float x) { return x > 0.0f ? 1.0f : exp_approx(x); }
};
// φ as loads of inputs of type E apply it.
template <class E, class Map> struct map_for : map_16bit<Map> {};
template <class Map> struct map_for<f32, Map> : Map {};

// A row map: Map::apply(x, d, feature) is feature f of the row x (d columns).
// poly2: [x_a² (a), (√2·x_a)·x_b (b > a)], the packing of lina::poly2.
struct poly2 {
  __device__ static float apply(const float* x, int d, int f) {
    int a = 0;
    while (f >= d - a) f -= d - a, ++a;  // row a of the packed upper triangle holds d - a features
    const float r2 = 1.41421356237309504880f;
    return f == 0 ? x[a] * x[a] : r2 * x[a] * x[a + f];
  }
  // ∂x_c = Σ_f g_f · ∂poly2(x)_f/∂x_c, one fmaf chain over the features f in
  // increasing order; x is a row of d elements of type E in memory (stride cs).
  template <class E>
  __device__ static float adjoint(const void* data, long long row, long long cs, const float* g, int d, int c) {
    const float r2 = 1.41421356237309504880f;
    float acc = 0.0f;
    for (int a = 0; a < c; ++a)  // features (a, c), a < c: (√2·x_a)·x_c
      acc = fmaf(g[a * d - a * (a - 1) / 2 + (c - a)], r2 * load_element(E{}, data, row + a * cs), acc);
    const int first = c * d - c * (c - 1) / 2;  // feature (c, c): x_c²
    acc = fmaf(g[first], 2.0f * load_element(E{}, data, row + c * cs), acc);
    for (int b = c + 1; b < d; ++b)  // features (c, b), b > c: (√2·x_c)·x_b
      acc = fmaf(g[first + (b - c)], r2 * load_element(E{}, data, row + b * cs), acc);
    return acc;
  }
};

// Parametric maps (map_param): φ from the row x (D columns) and z = x·W (F
// columns), with s = D^−¼, inv = 1/√F and h = |x|²·s²/2.
struct favor {  // F features: exp(s·z_j − h) / √F
  static constexpr int per_z = 1;
};
struct random_fourier {  // 2F features: [cos(s·z_j), sin(s·z_j)] / √F
  static constexpr int per_z = 2;
};

// ---- register elements ---------------------------------------------------------------
// A register is fp32 (float) or bf16 (its bit patterns): values written to a
// bf16 register round to nearest even (lina::cuda::tile_register::storage).
struct bf16_bits {
  unsigned short bits;
};
__device__ __forceinline__ float get(const float* t, int e) { return t[e]; }
__device__ __forceinline__ float get(const bf16_bits* t, int e) {
  return __uint_as_float(static_cast<unsigned int>(t[e].bits) << 16);
}
__device__ __forceinline__ void put(float* t, int e, float x) { t[e] = x; }
__device__ __forceinline__ void put(bf16_bits* t, int e, float x) { t[e].bits = ptx::f32_to_bf16(x); }

// ---- tile operations ----------------------------------------------------------------
template <int R, int C, int P, class S>
__device__ void zero(S* t) {
  for (int e = threadIdx.x; e < R * P; e += blockDim.x) put(t, e, 0.0f);
}

// t[i][j] = in(base + (r0+i)·row_stride + (c0+j)·col_stride) for i < rows,
// j < width, c0 + j < cols; 0 elsewhere.
// 16 bytes of input: 8 elements of a 16-bit type or 4 of fp32.
struct alignas(16) u32x4 {
  unsigned x[4];
};
struct alignas(16) f32x4 {
  float x[4];
};
template <class E> struct vector_of { static constexpr int n = 8; };
template <> struct vector_of<f32> { static constexpr int n = 4; };

__device__ __forceinline__ void unpack(f32, const u32x4& r, float* x) {
#pragma unroll
  for (int w = 0; w < 4; ++w) x[w] = __uint_as_float(r.x[w]);
}
__device__ __forceinline__ void unpack(bf16, const u32x4& r, float* x) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    x[2 * w] = __uint_as_float(r.x[w] << 16);
    x[2 * w + 1] = __uint_as_float(r.x[w] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack(f16, const u32x4& r, float* x) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    x[2 * w] = ptx::f16_to_f32(static_cast<unsigned short>(r.x[w] & 0xffffu));
    x[2 * w + 1] = ptx::f16_to_f32(static_cast<unsigned short>(r.x[w] >> 16));
  }
}

// Whether columns c0 … c0 + width of every row of x (elements of `bytes`
// bytes) are contiguous, inside the operand and start 16-byte aligned: the
// check load_map, map_grad and store make once per tile before their vector loops.
__device__ __forceinline__ bool rows_in_vectors(const operand& x, long long base, long long c0, long long width,
                                                int bytes) {
  return x.stride[3] == 1 && c0 + width <= x.cols && ((x.stride[2] * bytes) & 15) == 0 &&
         ((reinterpret_cast<unsigned long long>(x.data) + (base + c0) * bytes) & 15) == 0;
}

// One group's values x (8, or 4 for fp32) into the register at dst, column j:
// one 16-byte store where the group lies inside the register's C columns,
// element by element at its edge.
template <class E, int C, class S>
__device__ __forceinline__ void put_group(S* dst, int j, const float* x) {
  constexpr int VN = vector_of<E>::n;
  if constexpr (same<S, float>::value) {
    if (j + VN <= C) {
#pragma unroll
      for (int h = 0; h < VN / 4; ++h)
        *reinterpret_cast<f32x4*>(dst + 4 * h) = f32x4{{x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]}};
      return;
    }
  } else {
    if (VN == 8 && j + VN <= C) {  // 8 bf16 values, rounded in pairs, one 16-byte store
      u32x4 packed;
#pragma unroll
      for (int h = 0; h < 4; ++h) packed.x[h] = ptx::f32x2_to_bf16x2(x[2 * h], x[2 * h + 1]);
      *reinterpret_cast<u32x4*>(dst) = packed;
      return;
    }
  }
#pragma unroll
  for (int w = 0; w < VN; ++w)
    if (j + w < C) put(dst, w, x[w]);
}

// A group load_map's vector loops loaded (raw: zeros where nothing was read)
// into the tile: unpacked, its elements past the width read one by one where
// the width ends inside it, mapped on rows < rows, put at row i, column j.
// `row`: the input row's first element.
template <class E, class Map, int C, int P, class S>
__device__ __forceinline__ void map_group(S* t, const u32x4& raw, const char* row, int i, int j, int rows, int width) {
  constexpr int VN = vector_of<E>::n;
  float x[VN];
  unpack(E{}, raw, x);
  if (width % VN != 0 && i < rows && j < width && j + VN > width)  // the width ends in this group
#pragma unroll
    for (int w = 0; w < VN; ++w) x[w] = j + w < width ? load_element(E{}, row, j + w) : 0.0f;
  if (i < rows)
#pragma unroll
    for (int w = 0; w < VN; ++w) x[w] = map_for<E, Map>::apply(x[w]);
  put_group<E, C>(t + i * P + j, j, x);
}

// load followed by map t φ (element-wise), in one pass: the emitter fuses the
// pair; the result is the two instructions' (φ on rows < rows only). Threads:
// the block's (the emitter names it where it is not 256).
//
// Each thread takes groups of one 16-byte vector of a row (8 or 4 elements)
// and first issues the loads of up to U groups, then converts, maps and stores
// them: the loads are in flight together. A group is loaded as one vector
// where the row is contiguous, in range and 16-byte aligned; elsewhere
// (strided columns, the edges) element by element.
template <class E, class Map, int R, int C, int P, int Threads = 256, class S>
__device__ void load_map(S* t, const operand& in, long long base, long long r0, long long c0, int rows, int width) {
  constexpr int VN = vector_of<E>::n, CG = (C + VN - 1) / VN, G = R * CG, U = 4;
  constexpr int bytes = VN == 8 ? 2 : 4;
  const char* const data = static_cast<const char*>(in.data);
  const bool contiguous = in.stride[3] == 1;
  // The common case, checked once: rows of contiguous columns whose groups
  // all start 16-byte aligned, the width inside the operand — then a group is
  // one vector load when it is inside the chunk's rows and the width, zeros
  // outside, and element by element only where the width ends mid-group.
  if (rows_in_vectors(in, base, c0, width, bytes)) {
    const char* const first = data + (base + r0 * in.stride[2] + c0) * bytes;  // the chunk's first row
    const long long pitch = in.stride[2] * bytes;
    if constexpr (Threads % CG == 0) {
      // A thread keeps one column group, its rows `step` apart: one address,
      // advanced by a constant. (Finding each group's row, column and 64-bit
      // offset again, as below, made the loop 376 instructions per four
      // groups at D = 128 instead of 285; for widths whose groups do not
      // divide the block — [V|1] — advancing with a carry was barely shorter.
      // Chosen at compile time: both loops in one kernel took NVRTC half as
      // long again.)
      constexpr int step = Threads / CG;
      const int j = static_cast<int>(threadIdx.x % CG) * VN;
      const long long jump = step * pitch;
      const bool whole = j + VN <= width;
      const char* p = first + static_cast<int>(threadIdx.x / CG) * pitch + j * bytes;
      for (int i0 = static_cast<int>(threadIdx.x / CG); i0 < R; i0 += U * step, p += U * jump) {
        u32x4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          raw[u] = u32x4{{0u, 0u, 0u, 0u}};
          if (i0 + u * step < rows && whole) raw[u] = *reinterpret_cast<const u32x4*>(p + u * jump);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (i0 + u * step >= R) break;
          map_group<E, Map, C, P>(t, raw[u], p + u * jump - j * bytes, i0 + u * step, j, rows, width);
        }
      }
    } else {
      for (int g0 = threadIdx.x; g0 < G; g0 += U * static_cast<int>(blockDim.x)) {
        u32x4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int g = g0 + u * static_cast<int>(blockDim.x), i = g / CG, j = g % CG * VN;
          raw[u] = u32x4{{0u, 0u, 0u, 0u}};
          if (g < G && i < rows && j + VN <= width) raw[u] = *reinterpret_cast<const u32x4*>(first + i * pitch + j * bytes);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int g = g0 + u * static_cast<int>(blockDim.x), i = g / CG, j = g % CG * VN;
          if (g >= G) break;
          map_group<E, Map, C, P>(t, raw[u], first + i * pitch, i, j, rows, width);
        }
      }
    }
    return;
  }
  for (int g0 = threadIdx.x; g0 < G; g0 += U * static_cast<int>(blockDim.x)) {
    u32x4 raw[U];
    bool whole[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + u * static_cast<int>(blockDim.x), i = g / CG, j = g % CG * VN;
      const char* p = data + (base + (r0 + i) * in.stride[2] + c0 + j) * bytes;
      whole[u] = g < G && i < rows && contiguous && j + VN <= width && c0 + j + VN <= in.cols &&
                 (reinterpret_cast<unsigned long long>(p) & 15) == 0;
      if (whole[u]) raw[u] = *reinterpret_cast<const u32x4*>(p);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + u * static_cast<int>(blockDim.x), i = g / CG, j = g % CG * VN;
      if (g >= G) break;
      float x[VN];
      if (whole[u]) {
        unpack(E{}, raw[u], x);
      } else {
#pragma unroll
        for (int w = 0; w < VN; ++w)
          x[w] = i < rows && j + w < width && c0 + j + w < in.cols
                     ? load_element(E{}, in.data, base + (r0 + i) * in.stride[2] + (c0 + j + w) * in.stride[3])
                     : 0.0f;
      }
      if (i < rows)
#pragma unroll
        for (int w = 0; w < VN; ++w) x[w] = map_for<E, Map>::apply(x[w]);
      put_group<E, C>(t + i * P + j, j, x);
    }
  }
}

// t[i][j] = in(base + (r0+i)·row_stride + (c0+j)·col_stride) for i < rows,
// j < width, c0 + j < cols; 0 elsewhere.
template <class E, int R, int C, int P, int Threads = 256, class S>
__device__ void load(S* t, const operand& in, long long base, long long r0, long long c0, int rows, int width) {
  load_map<E, identity, R, C, P, Threads>(t, in, base, r0, c0, rows, width);
}

// A hint that changes no tile: rows r0 … r0 + rows − 1 of `in` (columns c0 …
// c0 + width − 1, as a load reads them) requested into L2, one 128-byte line
// per thread and step, so that the next chunk's loads find them there
// (`prefetch.L2`, a generic address; every line it names holds bytes those
// loads read). Rows whose columns are not contiguous are left alone.
template <class E>
__device__ void prefetch(const operand& in, long long base, long long r0, long long c0, int rows, int width) {
  if (rows <= 0 || in.stride[3] != 1 || c0 >= in.cols) return;
  constexpr int bytes = vector_of<E>::n == 8 ? 2 : 4;
  const long long row_bytes = (in.cols - c0 < width ? in.cols - c0 : width) * bytes;
  const int lines = static_cast<int>((row_bytes + 127) / 128) + 1;  // (a row that starts mid-line ends in one more)
  const char* const data = static_cast<const char*>(in.data);
  for (int e = threadIdx.x; e < rows * lines; e += blockDim.x) {
    const char* const row = data + (base + (r0 + e / lines) * in.stride[2] + c0) * bytes;
    const char* const at =
        reinterpret_cast<const char*>(reinterpret_cast<unsigned long long>(row) & ~127ull) + (e % lines) * 128;
    if (at < row + row_bytes) ptx::prefetch_l2(at);
  }
}

// t[i][j] += in(base + (r0+i)·row_stride + (c0+j)·col_stride) for i < rows,
// j < width, c0 + j < cols; t unchanged elsewhere (fp32 buffers: a split
// backward's sums of the earlier slices).
template <int R, int C, int P>
__device__ void load_add(float* t, const operand& in, long long base, long long r0, long long c0, int rows, int width) {
  const float* p = static_cast<const float*>(in.data);
  for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    if (j < width && c0 + j < in.cols) t[i * P + j] += p[base + (r0 + i) * in.stride[2] + (c0 + j) * in.stride[3]];
  }
}

template <class Map, int R, int C, int P, class S>
__device__ void map(S* t, int rows) {
  for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
    const int at = (e / C) * P + e % C;
    put(t, at, Map::apply(get(t, at)));
  }
}

// t (R × C) = Map(x) row by row for i < rows, 0 below; x is R × D (pitch PX).
template <class Map, int R, int C, int P, int D, int PX, class S>
__device__ void map_rows(S* t, const float* x, int rows) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, f = e % C;
    put(t, i * P + f, i < rows ? Map::apply(x + i * PX, D, f) : 0.0f);
  }
}

template <int R, int C, int P, class S>
__device__ void ones_column(S* t, int rows) {
  for (int i = threadIdx.x; i < rows; i += blockDim.x) put(t, i * P + C - 1, 1.0f);
}

// ---- tensor-core fragments (mma.sync, sm_80+; where each lane's live: mma16) --------
__device__ __forceinline__ unsigned pack(mma_bf16, float lo, float hi) { return ptx::f32x2_to_bf16x2(lo, hi); }
__device__ __forceinline__ unsigned pack(mma_tf32, float x) { return ptx::f32_to_tf32(x); }
__device__ __forceinline__ void mma(mma_bf16, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  ptx::mma_bf16(d, a, b);
}
__device__ __forceinline__ void mma(mma_tf32, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  ptx::mma_tf32(d, a, b);
}
template <class Prec> struct mma_k;
template <> struct mma_k<mma_bf16> { static constexpr int value = 16; };
template <> struct mma_k<mma_tf32> { static constexpr int value = 8; };

// ldmatrix on bf16 registers: the bits mma reads, so the same operands as
// reading each element and packing it again (a bf16 value packs to itself).
template <bool Trans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[4], const bf16_bits* p) {
  ptx::ldmatrix_x4<Trans>(r, p);
}
template <bool Trans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[2], const bf16_bits* p) {
  ptx::ldmatrix_x2<Trans>(r, p);
}

// op(a)(i, k) of an R × K operand stored with pitch P (K × R when T), 0 outside.
template <int R, int K, bool T, int P, class S>
__device__ __forceinline__ float operand_at(const S* a, int i, int k) {
  if ((R % 16 != 0 && i >= R) || (K % 16 != 0 && k >= K)) return 0.0f;
  return get(a, T ? k * P + i : i * P + k);
}

// A's fragment at (i0, k0) of op(a) and B's at (k0, column j0) of op(b),
// packed to Prec. A fragment whose elements all lie in the register (the k
// inside K; rows past R or columns past C, past the pitch too, only reach
// results that are not stored) is read as stored: with ldmatrix from bf16
// registers, else element by element from one address at constant offsets
// (written out: the compiler computed `(k0 + k) * P + j` again for each
// element, ~25 instructions per fp32 fragment where 6 do); only one at the
// edge of K, or past the stored rows (an untransposed A's R, a transposed
// B's C), tests each element (Checked).
template <class Prec, int R, int K, bool T, int P, bool Checked, class S>
__device__ __forceinline__ void a_elements(unsigned (&af)[4], const S* a, int i0, int k0, int lane) {
  constexpr bool k16 = mma_k<Prec>::value == 16;
  if constexpr (!Checked) {
    constexpr int di = T ? 1 : P, dk = T ? P : 1;  // steps along op(a)'s rows and k
    const S* const p = a + i0 * di + k0 * dk + mma16::lane_offset(lane, di, dk, k16);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = mma16::a_register_offset(r, di, dk, k16);
      if constexpr (k16)
        af[r] = pack(Prec{}, get(p, e), get(p, e + dk));
      else
        af[r] = pack(Prec{}, get(p, e));
    }
  } else if constexpr (k16) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + mma16::a_row(lane, r), k = k0 + mma16::a_k(lane, r);
      af[r] = pack(Prec{}, operand_at<R, K, T, P>(a, i, k), operand_at<R, K, T, P>(a, i, k + 1));
    }
  } else {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) af[r] = pack(Prec{}, operand_at<R, K, T, P>(a, i0 + g + (r & 1) * 8, k0 + q + (r >> 1) * 4));
  }
}
template <class Prec, int R, int K, bool T, int P, class S>
__device__ __forceinline__ void a_fragment(unsigned (&af)[4], const S* a, int i0, int k0, int lane) {
  constexpr int KS = mma_k<Prec>::value;
  // Every stripe's rows lie in the register: when T, rows past the pitch run
  // into the next k's (or the register's slack, lina::cuda::program::read_slack).
  constexpr bool rows_inside = T || R % 16 == 0;
  if ((K % KS == 0 || k0 + KS <= K) && (rows_inside || i0 + 16 <= R)) {
    if constexpr (KS == 16 && same<S, bf16_bits>::value)
      ldmatrix<T>(af, a + mma16::ldmatrix_offset(lane, true, T, P, i0, k0));
    else
      a_elements<Prec, R, K, T, P, false>(af, a, i0, k0, lane);
  } else {
    a_elements<Prec, R, K, T, P, true>(af, a, i0, k0, lane);
  }
}
// b is K × C (C × K when T); its fragment is read as op(b)ᵀ, C × K, whose row j is column j of op(b).
template <class Prec, int C, int K, bool T, int P, bool Checked, class S>
__device__ __forceinline__ void b_elements(unsigned (&bf)[2], const S* b, int j0, int k0, int lane) {
  constexpr bool k16 = mma_k<Prec>::value == 16;
  const int j = j0 + (lane >> 2);  // mma16::b_col
  if constexpr (!Checked) {
    constexpr int dj = T ? P : 1, dk = T ? 1 : P;  // op(b)(k, j) is b's (j, k) when T
    const S* const p = b + j0 * dj + k0 * dk + mma16::lane_offset(lane, dj, dk, k16);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int e = mma16::b_register_offset(r, dk, k16);
      if constexpr (k16)
        bf[r] = pack(Prec{}, get(p, e), get(p, e + dk));
      else
        bf[r] = pack(Prec{}, get(p, e));
    }
  } else if constexpr (k16) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int k = k0 + mma16::b_k(lane, r);
      bf[r] = pack(Prec{}, operand_at<C, K, !T, P>(b, j, k), operand_at<C, K, !T, P>(b, j, k + 1));
    }
  } else {
    const int q = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) bf[r] = pack(Prec{}, operand_at<C, K, !T, P>(b, j, k0 + q + r * 4));
  }
}
template <class Prec, int C, int K, bool T, int P, class S>
__device__ __forceinline__ void b_fragment(unsigned (&bf)[2], const S* b, int j0, int k0, int lane) {
  constexpr int KS = mma_k<Prec>::value;
  constexpr bool columns_inside = !T || C % 8 == 0;  // (as rows_inside)
  if ((K % KS == 0 || k0 + KS <= K) && (columns_inside || j0 + 8 <= C)) {
    if constexpr (KS == 16 && same<S, bf16_bits>::value)
      ldmatrix<!T>(bf, b + mma16::ldmatrix_offset(lane, false, !T, P, j0, k0));
    else
      b_elements<Prec, C, K, T, P, false>(bf, b, j0, k0, lane);
  } else {
    b_elements<Prec, C, K, T, P, true>(bf, b, j0, k0, lane);
  }
}

// The triangles of a masked product (lina::cuda::triangle), by 16-row
// stripes s = 16·⌊i/16⌋: with TriT, t's elements past the triangle (j ≥ s + 16
// lower, j < s upper) are 0, not computed; with TriA, the terms k past op(a)'s
// triangle are skipped. What a triangle keeps of the n columns (or k) of the
// stripe at row s, counted in units of u (a divisor of 8): [tri_first, tri_end).
// tri_causal (tri_anticausal) is tri_lower (tri_upper) with the mask that
// follows fused into the product's stores: t[i][j] = 0 for j > i (j < i) —
// one pass over the tile and a barrier fewer (the emitter fuses the pair).
constexpr int tri_none = 0, tri_lower = 1, tri_upper = 2, tri_causal = 3, tri_anticausal = 4;
template <int Tri>
__device__ __forceinline__ int tri_first(int s, int u) {
  return Tri == tri_upper || Tri == tri_anticausal ? s / u : 0;
}
template <int Tri>
__device__ __forceinline__ int tri_end(int s, int u, int n) {
  return (Tri == tri_lower || Tri == tri_causal) && (s + 16) / u < n ? (s + 16) / u : n;
}
// Does a fused mask zero element (i, j)?
template <int Tri>
__device__ __forceinline__ bool tri_masked(int i, int j) {
  return (Tri == tri_causal && j > i) || (Tri == tri_anticausal && j < i);
}

// fma_f32: one fmaf chain per element of t, in increasing k, from zero (Acc:
// added to t's element after it).
template <int R, int C, int K, bool TA, bool TB, bool Acc, int PT, int PA, int PB, int TriT, int TriA, class ST, class SA,
          class SB>
__device__ void fma_product(ST* t, const SA* a, const SB* b) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C, s = i / 16 * 16;
    if (j < tri_first<TriT>(s, 1) || j >= tri_end<TriT>(s, 1, C) || tri_masked<TriT>(i, j)) {
      put(t, i * PT + j, 0.0f);
      continue;
    }
    float acc = 0.0f;
    for (int k = tri_first<TriA>(s, 1); k < tri_end<TriA>(s, 1, K); ++k) {
      const float u = get(a, TA ? k * PA + i : i * PA + k);
      const float w = get(b, TB ? j * PB + k : k * PB + j);
      acc = fmaf(u, w, acc);
    }
    put(t, i * PT + j, Acc ? get(t, i * PT + j) + acc : acc);
  }
}

// The tensor-core products: each warp takes a stripe of 16 rows × NB tiles of
// 8 columns, loads its A fragment once per k step and reuses it across the NB
// tiles. NB balances the stripes over a block's W warps (fewest rounds × NB).
template <int MT, int NT, int W>
struct mma_split {
  __host__ __device__ static constexpr int cost(int nb) { return ((MT * ((NT + nb - 1) / nb) + W - 1) / W) * nb; }
  __host__ __device__ static constexpr int pick() {
    int best = 1;
    for (int nb = 2; nb <= (NT < 12 ? NT : 12); ++nb)
      if (cost(nb) <= cost(best)) best = nb;
    return best;
  }
  static constexpr int nb = pick();
};

// One 16-row stripe's NB tiles of 8 columns from n0 (those in [lo, hi)):
// acc += op(a)·op(b) over the k steps op(a)'s triangle TriA keeps. Full: all
// NB tiles are in [lo, hi) (the caller tested it once), so the k loop has no
// test per tile: one branch per tile split it into blocks the compiler
// recomputed each fragment's address in (~25 instructions per mma, ~8 without).
template <class Prec, int R, int C, int K, bool TA, bool TB, int PA, int PB, int TriA, bool Full, int NB, class SA, class SB>
__device__ __forceinline__ void mma_stripe(float (&acc)[NB][4], const SA* a, const SB* b, int i0, int n0, int lo, int hi,
                                           int lane) {
  constexpr int KS = mma_k<Prec>::value, NT = (C + 7) / 8, KT = (K + KS - 1) / KS;
  const int k_lo = tri_first<TriA>(i0, KS), k_hi = tri_end<TriA>(i0, KS, KT);
#pragma unroll 2
  for (int kt = Full || (n0 < hi && n0 + NB > lo) ? k_lo : k_hi; kt < k_hi; ++kt) {
    const int k0 = kt * KS;
    unsigned af[4];
    a_fragment<Prec, R, K, TA, PA>(af, a, i0, k0, lane);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (!Full && NT % NB != 0 && n0 + nb >= NT) break;
      if (!Full && (n0 + nb < lo || n0 + nb >= hi)) continue;
      unsigned bf[2];
      b_fragment<Prec, C, K, TB, PB>(bf, b, (n0 + nb) * 8, k0, lane);
      mma(Prec{}, acc[nb], af, bf);
    }
  }
}

// t = (Acc ? t : 0) + op(a)·op(b), the product summed in the registers from
// zero, then (with a2, b2: a second product of inner dimension K2 into the
// same tile) + op(a2)·op(b2) in the same registers: one pass over t where two
// products would store it and load it back (the emitter fuses such pairs into
// tl::product2; the second's terms join the first's sums, an order of
// summation the tensor cores' products are free to choose).
template <class Prec, int R, int C, int K, bool TA, bool TB, bool Acc, int PT, int PA, int PB, int TriT, int TriA, int W,
          int K2 = 0, bool TA2 = false, bool TB2 = false, int PA2 = 0, int PB2 = 0, int TriA2 = tri_none, class ST,
          class SA, class SB, class SA2 = SA, class SB2 = SB>
__device__ void mma_product(ST* t, const SA* a, const SB* b, const SA2* a2 = nullptr, const SB2* b2 = nullptr) {
  constexpr int MT = (R + 15) / 16, NT = (C + 7) / 8;
  constexpr int NB = mma_split<MT, NT, W>::nb, NG = (NT + NB - 1) / NB;
  const int lane = threadIdx.x & 31;
  for (int task = threadIdx.x >> 5; task < MT * NG; task += blockDim.x >> 5) {
    const int i0 = task / NG * 16, n0 = task % NG * NB;
    // The 8-column tiles [lo, hi) of this stripe inside t's triangle.
    const int lo = tri_first<TriT>(i0, 8), hi = tri_end<TriT>(i0, 8, NT);
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nb][r] = 0.0f;
    if (n0 >= lo && n0 + NB <= hi) {  // (hi ≤ NT)
      mma_stripe<Prec, R, C, K, TA, TB, PA, PB, TriA, true>(acc, a, b, i0, n0, lo, hi, lane);
      if constexpr (K2 > 0) mma_stripe<Prec, R, C, K2, TA2, TB2, PA2, PB2, TriA2, true>(acc, a2, b2, i0, n0, lo, hi, lane);
    } else {
      mma_stripe<Prec, R, C, K, TA, TB, PA, PB, TriA, false>(acc, a, b, i0, n0, lo, hi, lane);
      if constexpr (K2 > 0) mma_stripe<Prec, R, C, K2, TA2, TB2, PA2, PB2, TriA2, false>(acc, a2, b2, i0, n0, lo, hi, lane);
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = i0 + mma16::c_row(lane, r), j = (n0 + nb) * 8 + mma16::c_col(lane, r);
        if (i >= R || j >= C) continue;
        float x = acc[nb][r];  // (0 in the tiles outside [lo, hi))
        if constexpr (Acc)
          if (n0 + nb >= lo && n0 + nb < hi) x = get(t, i * PT + j) + x;
        put(t, i * PT + j, tri_masked<TriT>(i, j) ? 0.0f : x);
      }
  }
}

// t (R × C, pitch PT) = (Acc ? t : 0) + op(a)·op(b), the product summed from
// zero and then added (program.hpp: a carried sum in two levels), at precision Prec, inner
// dimension K; a is R × K (K × R when TA, pitch PA), b is K × C (C × K when
// TB, pitch PB); TriT, TriA: a masked product's triangles (tri_first); W: the
// block's warps (the kernel's threads / 32). t is neither a nor b.
template <class Prec, int R, int C, int K, bool TA, bool TB, bool Acc, int PT, int PA, int PB, int TriT = tri_none,
          int TriA = tri_none, int W = 8, class ST, class SA, class SB>
__device__ void product(ST* t, const SA* a, const SB* b) {
  if constexpr (same<Prec, fma_f32>::value)
    fma_product<R, C, K, TA, TB, Acc, PT, PA, PB, TriT, TriA>(t, a, b);
  else
    mma_product<Prec, R, C, K, TA, TB, Acc, PT, PA, PB, TriT, TriA, W>(t, a, b);
}

// t (fp32) = op(a)·op(b) + op(a2)·op(b2): product(t, a, b) then product with
// Acc (t, a2, b2), fused — the same sums in the same order (the first
// product's fp32 results are where the second starts), one pass over t for
// the tensor cores; fma_f32 runs the two (the second's chains start from the
// first's results either way). Neither product has a triangle of t.
template <class Prec, int R, int C, int PT, int K, bool TA, bool TB, int PA, int PB, int TriA, int K2, bool TA2, bool TB2,
          int PA2, int PB2, int TriA2, int W = 8, class SA, class SB, class SA2, class SB2>
__device__ void product2(float* t, const SA* a, const SB* b, const SA2* a2, const SB2* b2) {
  if constexpr (same<Prec, fma_f32>::value) {
    fma_product<R, C, K, TA, TB, false, PT, PA, PB, tri_none, TriA>(t, a, b);
    fma_product<R, C, K2, TA2, TB2, true, PT, PA2, PB2, tri_none, TriA2>(t, a2, b2);
  } else {
    mma_product<Prec, R, C, K, TA, TB, false, PT, PA, PB, tri_none, TriA, W, K2, TA2, TB2, PA2, PB2, TriA2>(t, a, b, a2, b2);
  }
}

template <int R, int C, int P, class S>
__device__ void mask_causal(S* t) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x)
    if (e % C > e / C) put(t, (e / C) * P + e % C, 0.0f);
}

// t[i][j] = 0 for j < i: the transposed mask of the backward's reverse pass.
template <int R, int C, int P, class S>
__device__ void mask_anticausal(S* t) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x)
    if (e % C < e / C) put(t, (e / C) * P + e % C, 0.0f);
}

// ---- a decayed scan (causal(S, decay{g})): the decay's powers g^k in a row
// register pw, filled once from the kernel's table (the emitter writes the
// values lina computed, so host and device weigh by the same floats).
template <int R, int C, int P>
__device__ void powers(float* pw, const float* values) {
  static_assert(R == 1, "lina::tile::powers: one row of powers");
  for (int k = threadIdx.x; k < C; k += blockDim.x) pw[k] = values[k];
}
// The masks, decayed: t[i][j] weighed by g^(i−j) where the causal one keeps
// it (j ≤ i), by g^(j−i) where the anticausal one does (j ≥ i); 0 elsewhere.
template <int R, int C, int P, class S>
__device__ void mask_causal(S* t, const float* pw) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    put(t, i * P + j, j > i ? 0.0f : get(t, i * P + j) * pw[i - j]);
  }
}
template <int R, int C, int P, class S>
__device__ void mask_anticausal(S* t, const float* pw) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    put(t, i * P + j, j < i ? 0.0f : get(t, i * P + j) * pw[j - i]);
  }
}
// Rows weighed by a power of the decay (program.hpp, decay_rows): row i < rows
// by g^(i+1) (Power 0: its weight of the state before the chunk) or
// g^(rows−1−i) (1: its weight at the chunk's last row); every row by g^rows
// (2: the state carried past the chunk).
template <int R, int C, int P, int Power, class S>
__device__ void decay_rows(S* t, const float* pw, int rows) {
  const int n = Power == 2 ? R : rows;
  for (int e = threadIdx.x; e < n * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    const float f = pw[Power == 0 ? i + 1 : Power == 1 ? rows - 1 - i : rows];
    put(t, i * P + j, get(t, i * P + j) * f);
  }
}

// Element-wise φ: t[i][j] *= φ′(in(r0 + i, j)) for i < rows (the input as
// stored, type E). Where the input's rows are contiguous and aligned (checked
// once, as load_map does), a thread takes a 16-byte group of a row: one load,
// and t's elements 4 at a time; else element by element.
template <class E, class Map, int R, int C, int P>
__device__ void map_grad(float* t, const operand& in, long long base, long long r0, int rows) {
  constexpr int VN = vector_of<E>::n, bytes = VN == 8 ? 2 : 4;
  const char* const data = static_cast<const char*>(in.data);
  if constexpr (C % VN == 0) {
    constexpr int CG = C / VN;
    if (rows_in_vectors(in, base, 0, C, bytes)) {
      const char* const first = data + (base + r0 * in.stride[2]) * bytes;  // the chunk's first row
      const long long pitch = in.stride[2] * bytes;
      for (int g = threadIdx.x; g < rows * CG; g += blockDim.x) {
        const int i = g / CG, j = g % CG * VN;
        float x[VN];
        unpack(E{}, *reinterpret_cast<const u32x4*>(first + i * pitch + j * bytes), x);
#pragma unroll
        for (int h = 0; h < VN / 4; ++h) {
          f32x4* const y = reinterpret_cast<f32x4*>(t + i * P + j + 4 * h);
          f32x4 z = *y;
#pragma unroll
          for (int w = 0; w < 4; ++w) z.x[w] = z.x[w] * map_for<E, Map>::derivative(x[4 * h + w]);
          *y = z;
        }
      }
      return;
    }
  }
  for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    const float x = load_element(E{}, in.data, base + (r0 + i) * in.stride[2] + j * in.stride[3]);
    t[i * P + j] = t[i * P + j] * map_for<E, Map>::derivative(x);
  }
}

// A row map's adjoint, out of place: t (R × D) from the features' adjoints a
// (R × C, pitch PA) at the rows of `in`; 0 for i ≥ rows.
template <class E, class Map, int R, int D, int P, int PA>
__device__ void map_grad_rows(float* t, const float* a, const operand& in, long long base, long long r0, int rows) {
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int i = e / D, c = e % D;
    t[i * P + c] = i < rows ? Map::template adjoint<E>(in.data, base + (r0 + i) * in.stride[2], in.stride[3], a + i * PA, D, c)
                            : 0.0f;
  }
}

// 1/d of rowdiv's row i, correctly rounded (as the CPU backend's rowdiv): d =
// den + eps, den the row's last column — or, with the shifts m of softmax
// rows (pitch PM), fmaf(eps, exp(−m_i), den).
template <int PM>
__device__ __forceinline__ float row_reciprocal(float den, float eps, const float* m, int i) {
  return __frcp_rn(m ? fmaf(eps, expf(-m[i * PM]), den) : den + eps);
}

// rowdiv's adjoint (program.hpp, rowdiv_grad): with o = [num | den] (W
// columns, pitch PO) and t = ∂out (the first W − 1 columns), r = 1/d, d =
// den + eps (softmax rows shifted by m, pitch PM: fmaf(eps, exp(−m), den)):
// s = Σ_j t_j·(num_j·r) as 8 fma chains over consecutive eighths of the
// columns, added pairwise; t_{W−1} = −s·r, t_j = t_j·r. Eight adjacent lanes
// share a row, each its eighth, and add their sums with shuffles (every lane
// of the eight gets the same bits: a + b = b + a); R·8 is a whole number of
// warps, which all take part in the shuffles (rows ≥ rows with nothing).
template <int R, int W, int PT, int PO, int PM = 1>
__device__ void rowdiv_grad(float* t, const float* o, float eps, int rows, const float* m = nullptr) {
  constexpr int S = 8, L = (W - 1 + S - 1) / S;
  static_assert(R * S % 32 == 0, "rowdiv_grad: rows of 8 lanes fill whole warps");
  for (int e = threadIdx.x; e < R * S; e += blockDim.x) {
    const int i = e / S, j0 = e % S * L, j1 = j0 + L < W - 1 ? j0 + L : W - 1;
    float r = 0.0f, s = 0.0f;
    if (i < rows) {
      r = row_reciprocal<PM>(o[i * PO + W - 1], eps, m, i);
      for (int j = j0; j < j1; ++j) s = fmaf(t[i * PT + j], __fmul_rn(o[i * PO + j], r), s);
    }
#pragma unroll
    for (int x = 1; x < S; x *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, x));
    if (i < rows) {
      for (int j = j0; j < j1; ++j) t[i * PT + j] = __fmul_rn(t[i * PT + j], r);
      if (e % S == 0) t[i * PT + W - 1] = __fmul_rn(-s, r);
    }
  }
}

// t[i][j] ·= 1 / d_i for j < C − 1, d_i = t[i][C−1] + eps — or, with the
// shifts m of softmax rows (R × 1, pitch PM), fmaf(eps, exp(−m[i]), t[i][C−1]):
// one correctly rounded reciprocal per row, as the CPU backend's rowdiv (the
// last column is read, never written). A thread takes 4 adjacent elements of a
// row (one 16-byte access where all 4 lie before the last column) and finds
// the row's reciprocal itself: no barrier between the two.
template <int R, int C, int P, int PM = 1>
__device__ void row_divide(float* t, float eps, const float* m = nullptr) {
  constexpr int V = (C + 2) / 4;  // groups of 4 of a row's C − 1 columns
  for (int e = threadIdx.x; e < R * V; e += blockDim.x) {
    const int i = e / V, j = e % V * 4;
    float* const row = t + i * P;
    const float r = row_reciprocal<PM>(row[C - 1], eps, m, i);
    if (j + 4 <= C - 1) {
      f32x4 x = *reinterpret_cast<const f32x4*>(row + j);
#pragma unroll
      for (int w = 0; w < 4; ++w) x.x[w] = __fmul_rn(x.x[w], r);
      *reinterpret_cast<f32x4*>(row + j) = x;
    } else {
      for (int w = j; w < C - 1; ++w) row[w] = __fmul_rn(row[w], r);
    }
  }
}

// t (R × C) ← φ(x; z) (program.hpp, map with a parametric map): rows i < rows
// from x (D columns, pitch PX) and z = x·W (F columns, pitch PZ); 0 below.
// Each thread takes one element and sums its row's |x|² itself (one fmaf
// chain in increasing column, as the emulation).
template <class Map, int R, int C, int P, int D, int PX, int F, int PZ, class S>
__device__ void map_param(S* t, const float* x, const float* z, float s, float inv, int rows) {
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    float y = 0.0f;
    if (i < rows) {
      float n = 0.0f;
      for (int c = 0; c < D; ++c) n = fmaf(x[i * PX + c], x[i * PX + c], n);
      const float h = n * (s * s / 2.0f);
      const float zj = z[i * PZ + (j < F ? j : j - F)];
      if (Map::per_z == 1)
        y = expf(fmaf(s, zj, -h)) * inv;
      else
        y = (j < F ? cosf(__fmul_rn(s, zj)) : sinf(__fmul_rn(s, zj))) * inv;
    }
    put(t, i * P + j, y);
  }
}

// The adjoint of map_param, in place (program.hpp, map_grad of a parametric
// map): t = z = x·W (R × F, pitch P) becomes ∂z from the features' adjoints a
// (pitch PA) and x (D columns, pitch PX); 0 for i ≥ rows. Each thread reads
// and writes its own element only. Rounded steps (no contraction), as the
// emulation writes them.
template <class Map, int R, int F, int P, int PA, int D, int PX>
__device__ void map_grad_param(float* t, const float* a, const float* x, float s, float inv, int rows) {
  for (int e = threadIdx.x; e < R * F; e += blockDim.x) {
    const int i = e / F, j = e % F;
    float y = 0.0f;
    if (i < rows) {
      const float zj = t[i * P + j];
      if (Map::per_z == 1) {
        float n = 0.0f;
        for (int c = 0; c < D; ++c) n = fmaf(x[i * PX + c], x[i * PX + c], n);
        const float phi = __fmul_rn(expf(fmaf(s, zj, -__fmul_rn(n, s * s / 2.0f))), inv);
        y = __fmul_rn(s, __fmul_rn(a[i * PA + j], phi));
      } else {
        const float u = __fmul_rn(s, zj);
        const float c = __fmul_rn(cosf(u), inv), sn = __fmul_rn(sinf(u), inv);
        y = __fmul_rn(s, __fsub_rn(__fmul_rn(a[i * PA + F + j], c), __fmul_rn(a[i * PA + j], sn)));
      }
    }
    t[i * P + j] = y;
  }
}

// ∂X rows of a parametric map (program.hpp, param_grad): t (R × D) = a·bᵀ
// with a = ∂z (R × F, pitch PA) and b = W (D × F, pitch PB), one fmaf chain
// in increasing f; favor also fmaf(−s·x, Σ_f a[i][f], ·) with x = in(r0 + i,
// c) (type E) — the norm |x|²'s share. 0 for i ≥ rows.
template <class E, class Map, int R, int D, int P, int F, int PA, int PB>
__device__ void param_grad(float* t, const float* a, const float* b, const operand& in, long long base, float s,
                           long long r0, int rows) {
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int i = e / D, c = e % D;
    float y = 0.0f;
    if (i < rows) {
      for (int f = 0; f < F; ++f) y = fmaf(a[i * PA + f], b[c * PB + f], y);
      if (Map::per_z == 1) {
        float sum = 0.0f;
        for (int f = 0; f < F; ++f) sum = __fadd_rn(sum, a[i * PA + f]);
        const float x = load_element(E{}, in.data, base + (r0 + i) * in.stride[2] + c * in.stride[3]);
        y = fmaf(-__fmul_rn(s, x), sum, y);
      }
    }
    t[i * P + c] = y;
  }
}

// exp_rows (program.hpp): the scores t (R × C) of queries q0 + i against keys
// k0 + j become exp(scale·t − shift); invalid ones (a query ≥ nq, a key ≥ nk;
// causal: key > query) 0; MaskScores: keys after the query count with score 0
// (exp(causal(S))). Shift 1, the running max: each row's m (R × 1, pitch PM,
// from 0) grows to its valid scaled scores and the row's W columns of o
// (pitch PO) are rescaled by exp(m_old − m_new); Shift 2: m is the forward's
// final shift, read; Shift 0: the shift is 0. G = Threads / R adjacent lanes
// share a row and reduce its max with warp shuffles.
// Decayed (causal(exp(S), decay{g})): each valid score's exponent is
// x = fma(scale, t, (query − key)·log_decay) — ALiBi's linear bias, g^(i−j) —
// and the max and exp run over x.
template <int R, int C, int P, int W, int PO, int PM, int Shift, bool Causal, bool MaskScores, int Threads,
          bool Decayed = false>
__device__ void exp_rows(float* t, float* o, float* m, float scale, long long q0, long long k0, long long nq,
                         long long nk, float log_decay = 0.0f) {
  constexpr int G = Threads / R;
  static_assert(G * R == Threads && G <= 32 && (G & (G - 1)) == 0, "exp_rows: a power-of-two group of lanes per row");
  const int i = threadIdx.x / G, lane = threadIdx.x % G;
  const long long query = q0 + i;
  // the valid keys of the row: k0 + j < end
  long long end = query < nq ? (Causal && query + 1 < nk ? query + 1 : nk) : k0;
  float* row = t + i * P;
  if (MaskScores)
    for (int j = lane; j < C; j += G)
      if (k0 + j > query) row[j] = 0.0f;
  if (Decayed)  // the exponents in place of the scores (the undecayed path keeps its fused fma below)
    for (int j = lane; j < C; j += G) {
      const long long key = k0 + j;
      const float bias = key == query ? 0.0f : __fmul_rn(static_cast<float>(query - key), log_decay);
      row[j] = fmaf(scale, row[j], bias);
    }
  const float factor = Decayed ? 1.0f : scale;
  float shift = 0.0f;
  if (Shift == 1) {
    const float old = m[i * PM];
    float grown = old;
    for (int j = lane; j < C; j += G)
      if (k0 + j < end) grown = fmaxf(grown, factor * row[j]);  // fmaxf skips a NaN
    for (int off = G / 2; off > 0; off /= 2) grown = fmaxf(grown, __shfl_xor_sync(0xffffffffu, grown, off, G));
    const float f = expf(old - grown);
    for (int j = lane; j < W; j += G) o[i * PO + j] = o[i * PO + j] * f;
    if (lane == 0) m[i * PM] = grown;
    shift = grown;
  } else if (Shift == 2) {
    shift = m[i * PM];
  }
  if (Decayed)
    for (int j = lane; j < C; j += G) row[j] = k0 + j < end ? expf(row[j] - shift) : 0.0f;
  else
    for (int j = lane; j < C; j += G) row[j] = k0 + j < end ? expf(fmaf(scale, row[j], -shift)) : 0.0f;
}

// exp_grad (program.hpp): with t = ∂E and e = E (R × C, pitches P, PE), the
// scores' adjoint t = scale·(e∘t) where exp_rows' score is valid (MaskScores:
// and the key is not after the query); 0 elsewhere.
template <int R, int C, int P, int PE, bool Causal, bool MaskScores>
__device__ void exp_grad(float* t, const float* e, float scale, long long q0, long long k0, long long nq,
                         long long nk) {
  for (int x = threadIdx.x; x < R * C; x += blockDim.x) {
    const int i = x / C, j = x % C;
    const long long query = q0 + i, key = k0 + j;
    const bool live = query < nq && key < nk && ((!Causal && !MaskScores) || key <= query);
    t[i * P + j] = live ? scale * (e[i * PE + j] * t[i * P + j]) : 0.0f;
  }
}

// square_rows (program.hpp): poly2 through its kernel — the scores t (R × C)
// of queries q0 + i against keys k0 + j become t², the invalid ones (as for
// exp_rows) 0.
template <int R, int C, int P, bool Causal>
__device__ void square_rows(float* t, long long q0, long long k0, long long nq, long long nk) {
  for (int x = threadIdx.x; x < R * C; x += blockDim.x) {
    const int i = x / C, j = x % C;
    const long long query = q0 + i, key = k0 + j;
    const float s = t[i * P + j];
    t[i * P + j] = query < nq && key < nk && (!Causal || key <= query) ? s * s : 0.0f;
  }
}

// square_grad (program.hpp): with t = ∂A and e the scores before squaring,
// t = 2·(e∘t) where valid, 0 elsewhere.
template <int R, int C, int P, int PE, bool Causal>
__device__ void square_grad(float* t, const float* e, long long q0, long long k0, long long nq, long long nk) {
  for (int x = threadIdx.x; x < R * C; x += blockDim.x) {
    const int i = x / C, j = x % C;
    const long long query = q0 + i, key = k0 + j;
    t[i * P + j] = query < nq && key < nk && (!Causal || key <= query) ? 2.0f * (e[i * PE + j] * t[i * P + j]) : 0.0f;
  }
}

// 16 bytes of output from VN values, each rounded to E (nearest even): the
// inverse of unpack (cvt.rn.*x2 puts its first operand in the upper half).
__device__ __forceinline__ void pack_vector(f32, const float* x, u32x4& r) {
#pragma unroll
  for (int w = 0; w < 4; ++w) r.x[w] = __float_as_uint(x[w]);
}
__device__ __forceinline__ void pack_vector(bf16, const float* x, u32x4& r) {
#pragma unroll
  for (int h = 0; h < 4; ++h) r.x[h] = ptx::f32x2_to_bf16x2(x[2 * h], x[2 * h + 1]);
}
__device__ __forceinline__ void pack_vector(f16, const float* x, u32x4& r) {
#pragma unroll
  for (int h = 0; h < 4; ++h) r.x[h] = ptx::f32x2_to_f16x2(x[2 * h], x[2 * h + 1]);
}

// out(r0 + i, c0 + j) = t[i][j] (Add: out += t, read in E: a gradient of an
// input the plan reads twice, whose other share this block stored before).
// Each thread takes 16 bytes of a row (VN elements): one vector store where
// they are contiguous, aligned and all inside the output, else element by
// element — the same values either way. Whether the output's rows are
// contiguous and aligned is checked once (as load_map does); then a group
// tests only whether it is whole.
template <class E, int R, int C, int P, bool Add = false, class S>
__device__ void store(const S* t, const operand& out, long long base, long long r0, long long c0, int rows,
                      int width) {
  constexpr int VN = vector_of<E>::n, CG = (C + VN - 1) / VN;
  constexpr int bytes = VN == 8 ? 2 : 4;
  void* const data = const_cast<void*>(out.data);
  const bool contiguous = out.stride[3] == 1;
  if (!Add && rows_in_vectors(out, base, c0, width, bytes)) {
    char* const first = static_cast<char*>(data) + (base + r0 * out.stride[2] + c0) * bytes;  // the chunk's first row
    const long long pitch = out.stride[2] * bytes;
    for (int g = threadIdx.x; g < rows * CG; g += blockDim.x) {
      const int i = g / CG, j = g % CG * VN;
      char* const row = first + i * pitch;
      if (j + VN <= C && j + VN <= width) {
        float x[VN];
        if constexpr (same<S, float>::value) {  // (t + i·P + j is 16-byte aligned: P and j are multiples of 4)
#pragma unroll
          for (int h = 0; h < VN / 4; ++h) {
            const f32x4 y = *reinterpret_cast<const f32x4*>(t + i * P + j + 4 * h);
#pragma unroll
            for (int w = 0; w < 4; ++w) x[4 * h + w] = y.x[w];
          }
        } else {
#pragma unroll
          for (int w = 0; w < VN; ++w) x[w] = get(t, i * P + j + w);
        }
        u32x4 r;
        pack_vector(E{}, x, r);
        *reinterpret_cast<u32x4*>(row + j * bytes) = r;
      } else {
#pragma unroll
        for (int w = 0; w < VN; ++w)
          if (j + w < C && j + w < width) store_element(E{}, row, j + w, get(t, i * P + j + w));
      }
    }
    return;
  }
  for (int g = threadIdx.x; g < rows * CG; g += blockDim.x) {
    const int i = g / CG, j = g % CG * VN;
    const long long row = base + (r0 + i) * out.stride[2];
    char* const p = static_cast<char*>(data) + (row + c0 + j) * bytes;
    if (!Add && contiguous && j + VN <= C && j + VN <= width && c0 + j + VN <= out.cols &&
        (reinterpret_cast<unsigned long long>(p) & 15) == 0) {
      float x[VN];
#pragma unroll
      for (int w = 0; w < VN; ++w) x[w] = get(t, i * P + j + w);
      u32x4 r;
      pack_vector(E{}, x, r);
      *reinterpret_cast<u32x4*>(p) = r;
      continue;
    }
#pragma unroll
    for (int w = 0; w < VN; ++w)
      if (j + w < C && j + w < width && c0 + j + w < out.cols) {
        const long long at = row + (c0 + j + w) * out.stride[3];
        const float x = get(t, i * P + j + w);
        store_element(E{}, data, at, Add ? load_element(E{}, data, at) + x : x);
      }
  }
}

// row_divide then store of the same tile, in one pass (the emitter fuses the
// pair that ends a forward chunk): a thread takes a 16-byte group of a row of
// the output (8 or 4 elements), divides it by the row's reciprocal (as
// row_divide), writes it back and stores it — the tile read once, not three
// times, and no barrier between. The tile and the memory afterwards are the
// pair's: every row divided, rows < rows stored; the last column read, never
// written (no thread writes what another reads).
template <class E, int R, int C, int P>
__device__ void row_divide_store(float* t, float eps, const operand& out, long long base, long long r0, long long c0,
                                 int rows, int width) {
  constexpr int VN = vector_of<E>::n, CG = (C + VN - 1) / VN, bytes = VN == 8 ? 2 : 4;
  char* const data = static_cast<char*>(const_cast<void*>(out.data));
  const bool vectors = rows_in_vectors(out, base, c0, width, bytes);
  for (int g = threadIdx.x; g < R * CG; g += blockDim.x) {
    const int i = g / CG, j = g % CG * VN;
    float* const row = t + i * P;
    const float r = row_reciprocal<1>(row[C - 1], eps, nullptr, i);
    float x[VN] = {};
#pragma unroll
    for (int h = 0; h < VN / 4; ++h) {
      const int c = j + 4 * h;  // (a multiple of 4, as P: 16-byte aligned)
      if (c >= C) break;        // (the next row's, which its thread is writing)
      const f32x4 y = *reinterpret_cast<const f32x4*>(row + c);
#pragma unroll
      for (int w = 0; w < 4; ++w) x[4 * h + w] = c + w < C - 1 ? __fmul_rn(y.x[w], r) : y.x[w];
      if (c + 4 <= C - 1) {
        *reinterpret_cast<f32x4*>(row + c) = f32x4{{x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]}};
      } else {
#pragma unroll
        for (int w = 0; w < 4; ++w)
          if (c + w < C - 1) row[c + w] = x[4 * h + w];
      }
    }
    if (i >= rows) continue;
    const long long at = base + (r0 + i) * out.stride[2];  // the output row's first element
    if (vectors && j + VN <= C && j + VN <= width) {
      u32x4 packed;
      pack_vector(E{}, x, packed);
      *reinterpret_cast<u32x4*>(data + (at + c0 + j) * bytes) = packed;
    } else {
#pragma unroll
      for (int w = 0; w < VN; ++w)
        if (j + w < C && j + w < width && c0 + j + w < out.cols)
          store_element(E{}, data, at + (c0 + j + w) * out.stride[3], x[w]);
    }
  }
}

// The state of a chained kernel: this block's part of the fp32 [C, W] running
// sums of one (batch, head). t[i][j] = s(i, c0 + j) for j < width and c0 + j
// < m_cols (m_cols = s.cols − 1 when Z, else s.cols); Z: t[i][C−1] = s(i,
// s.cols − 1), the normaliser column; 0 elsewhere.
//
// A warp takes a row at a time, its lanes adjacent columns (each load of the
// warp one 128-byte line of a dense state), U rows' loads issued before any
// is stored — a decoding step is little more than this load and the store
// back, so each element costs a load, a store and an add of addresses; the
// normaliser's column, one element a row, is a loop of its own.

// Which of a lane's L columns j = lane + 32·l of M (MC of them in the
// register) the state has.
template <int MC, int L>
__device__ __forceinline__ void state_columns(bool (&in)[L], long long c0, int width, long long m_cols) {
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const int j = static_cast<int>(threadIdx.x & 31) + 32 * l;
    in[l] = j < MC && j < width && c0 + j < m_cols;
  }
}
// The rows of load_state; Dense: the state's columns are adjacent (stride 1),
// so a lane's elements lie at constant offsets from its row's first.
template <int R, int P, int MC, int L, bool Dense>
__device__ __forceinline__ void load_state_rows(float* t, const float* first, long long rs, long long cs,
                                                const bool (&in)[L]) {
  constexpr int U = 2;  // rows in flight
  const int lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (int i0 = static_cast<int>(threadIdx.x >> 5); i0 < R; i0 += U * warps) {
    float x[U][L];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * warps;
      const float* const row = first + i * rs;
#pragma unroll
      for (int l = 0; l < L; ++l) {
        const int j = lane + 32 * l;
        x[u][l] = i < R && in[l] ? row[Dense ? j : j * cs] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int l = 0; l < L; ++l) {
        const int i = i0 + u * warps, j = lane + 32 * l;
        if (i < R && j < MC) t[i * P + j] = x[u][l];
      }
  }
}
template <int R, int C, int P, bool Z>
__device__ void load_state(float* t, const operand& s, long long base, long long c0, int width) {
  constexpr int MC = Z ? C - 1 : C, L = (MC + 31) / 32;  // columns of M; per lane and row
  const float* const data = static_cast<const float*>(s.data) + base;
  const long long rs = s.stride[2], cs = s.stride[3];
  bool in[L];
  state_columns<MC>(in, c0, width, Z ? s.cols - 1 : s.cols);
  if (cs == 1)
    load_state_rows<R, P, MC, L, true>(t, data + c0, rs, cs, in);
  else
    load_state_rows<R, P, MC, L, false>(t, data + c0 * cs, rs, cs, in);
  if constexpr (Z)
    for (int i = threadIdx.x; i < R; i += blockDim.x) t[i * P + C - 1] = data[i * rs + (s.cols - 1) * cs];
}

// The inverse of load_state (the same lanes per row); the normaliser column
// only from the block whose columns start at 0 (every block of the (batch,
// head) holds the same z), added to what is there with add_z (a backward
// split over M's columns: each slice after the first adds its share of ∂z).
template <int R, int P, int L, bool Dense>
__device__ __forceinline__ void store_state_rows(const float* t, float* first, long long rs, long long cs,
                                                 const bool (&in)[L]) {
  const int lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (int i = static_cast<int>(threadIdx.x >> 5); i < R; i += warps) {
    float* const row = first + i * rs;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int j = lane + 32 * l;
      if (in[l]) row[Dense ? j : j * cs] = t[i * P + j];
    }
  }
}
template <int R, int C, int P, bool Z>
__device__ void store_state(const float* t, const operand& s, long long base, long long c0, int width, bool add_z = false) {
  constexpr int MC = Z ? C - 1 : C, L = (MC + 31) / 32;
  float* const data = static_cast<float*>(const_cast<void*>(s.data)) + base;
  const long long rs = s.stride[2], cs = s.stride[3];
  bool in[L];
  state_columns<MC>(in, c0, width, Z ? s.cols - 1 : s.cols);
  if (cs == 1)
    store_state_rows<R, P, L, true>(t, data + c0, rs, cs, in);
  else
    store_state_rows<R, P, L, false>(t, data + c0 * cs, rs, cs, in);
  if constexpr (Z)
    if (c0 == 0)
      for (int i = threadIdx.x; i < R; i += blockDim.x) {
        float& z = data[i * rs + (s.cols - 1) * cs];
        z = add_z ? z + t[i * P + C - 1] : t[i * P + C - 1];
      }
}

// The chunk-parallel form's start of a group: t += the sums of groups first
// … end − 1 (each `rows_apart` elements after the previous, in increasing
// order: the groups before this one, or a reverse walk's after it), for the
// columns load_state reads.
template <int R, int C, int P, bool Z>
__device__ void add_partials(float* t, const operand& s, long long base, long long rows_apart, long long first,
                             long long end, long long c0, int width) {
  const float* data = static_cast<const float*>(s.data);
  const long long m_cols = Z ? s.cols - 1 : s.cols;
  constexpr int U = 4;  // elements per thread and step, each group's loads of them issued together
  for (int e0 = threadIdx.x; e0 < R * C; e0 += U * static_cast<int>(blockDim.x)) {
    long long col[U];
    float x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * static_cast<int>(blockDim.x), i = e / C, j = e % C;
      col[u] = -1;
      if (e < R * C) {
        if (Z && j == C - 1)
          col[u] = s.cols - 1;
        else if (j < width && c0 + j < m_cols)
          col[u] = c0 + j;
      }
      x[u] = col[u] < 0 ? 0.0f : t[i * P + j];
    }
    for (long long g = first; g < end; ++g)  // (in increasing order of the groups, as the emulation adds them)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int e = e0 + u * static_cast<int>(blockDim.x);
        if (col[u] >= 0) x[u] += data[base + g * rows_apart + (e / C) * s.stride[2] + col[u] * s.stride[3]];
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * static_cast<int>(blockDim.x);
      if (col[u] >= 0) t[(e / C) * P + e % C] = x[u];
    }
  }
}

// g^rows from a decayed program's powers register (T + 1 of them): pw[T] once per
// whole chunk, then pw[rows mod T], fp32 products in that order (the emulation's).
template <int T>
__device__ __forceinline__ float decay_over(const float* pw, long long rows) {
  float x = 1.0f;
  for (long long c = 0; c < rows / T; ++c) x = x * pw[T];
  return x * pw[rows % T];
}

// add_partials of a decayed scan (program.hpp): by Horner's rule, t = fma(t, w,
// sums) per group, w = g^(the group's rows) — in increasing order of the
// groups before this one, or (Later) from the last group, of last_rows rows,
// down to the one after it.
template <int R, int C, int P, bool Z, bool Later, int T>
__device__ void add_partials_decayed(float* t, const operand& s, long long base, long long rows_apart, long long first,
                                     long long end, long long c0, int width, const float* pw, long long group_rows,
                                     long long last_rows) {
  const float* data = static_cast<const float*>(s.data);
  const long long m_cols = Z ? s.cols - 1 : s.cols;
  const float full = decay_over<T>(pw, group_rows), last = decay_over<T>(pw, last_rows);
  for (int e = threadIdx.x; e < R * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    long long col = -1;
    if (Z && j == C - 1)
      col = s.cols - 1;
    else if (j < width && c0 + j < m_cols)
      col = c0 + j;
    if (col < 0) continue;
    float x = t[i * P + j];
    for (long long n = first; n < end; ++n) {
      const long long g = Later ? end - 1 - (n - first) : n;
      x = fmaf(x, Later && g == end - 1 ? last : full, data[base + g * rows_apart + i * s.stride[2] + col * s.stride[3]]);
    }
    t[i * P + j] = x;
  }
}

#endif  // __CUDACC__ || LINA_TILES_ON_HOST

}  // namespace tile
}  // namespace lina
