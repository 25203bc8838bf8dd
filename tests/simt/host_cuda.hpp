// CUDA's kernel-side vocabulary on the host, so that lina's generated kernels
// run on the CPU as written — tiles.cuh and all — not only as the program the
// interpreter (backends/cuda/src/emulate.cpp) reads. tests/simt/runner.cpp
// compiles a kernel's source as host C++ with this header force-included
// (LINA_TILES_ON_HOST: tiles.cuh takes its PTX from here) into a shared
// object, loads it and launches it over the grid.
//
// A block's threads are fibers on one OS thread, switched only where CUDA has
// threads wait for each other: __syncthreads() (the whole block) and the
// warp-wide instructions — shuffles, mma.sync, ldmatrix —, which execute once
// for all 32 lanes when the last lane reaches them, as a warp executes them
// together. What a device would hang or misbehave on is reported instead: a
// warp whose lanes wait at different instructions, a thread that exits while
// others wait at a barrier, an ldmatrix row outside the dynamic shared memory
// or not 16-byte aligned. Shared memory starts each block filled with NaN
// bits, so that an element read before it is written — or read past what a
// kernel stores — shows in its results.
#pragma once

#define LINA_TILES_ON_HOST 1

#include <math.h>
#include <string.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cstdint>
#include <cstdio>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#include <vector>

#define __global__ __attribute__((visibility("default")))
#define __device__
#define __constant__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

namespace lina_simt {

struct dim3_ {
  unsigned x, y, z;
};

enum class state : int { ready, at_barrier, at_warp, done };
enum class warp_op : int { shfl_xor, mma_bf16, mma_tf32, ldmatrix_x4, ldmatrix_x4_trans, ldmatrix_x2, ldmatrix_x2_trans };

// A lane's part in a warp-wide instruction: its operands, where its results go.
struct lane_call {
  warp_op op;
  int a, b;  // shfl_xor: lane mask, width
  const void* in0;
  const void* in1;
  void* inout;
};

// Where a suspended fiber (or the scheduler) resumes. On x86-64, its stack
// pointer, the callee-saved registers pushed below it: a switch is a dozen
// instructions (swapcontext also saves the signal mask — two system calls a
// switch, half the run time of these tests); elsewhere a ucontext.
#if defined(__x86_64__)
struct context {
  void* sp;
};
extern "C" void lina_simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl lina_simt_switch
  .hidden lina_simt_switch
  .type lina_simt_switch, @function
lina_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lina_simt_switch, .-lina_simt_switch
)");
inline void switch_to(context& from, context& to) { lina_simt_switch(&from.sp, to.sp); }
// A context that starts entry() (which never returns) on the stack [base, base + bytes).
inline void start(context& c, char* base, std::size_t bytes, void (*entry)(), context&) {
  auto* top = reinterpret_cast<void**>(reinterpret_cast<std::uintptr_t>(base + bytes) & ~std::uintptr_t{15});
  *--top = nullptr;                           // entry's return address: none (it must not return)
  *--top = reinterpret_cast<void*>(entry);    // where the switch's ret goes
  for (int r = 0; r < 6; ++r) *--top = nullptr;  // rbp, rbx, r12–r15
  c.sp = top;
}
#else
struct context {
  ucontext_t u;
};
inline void switch_to(context& from, context& to) { swapcontext(&from.u, &to.u); }
inline void start(context& c, char* base, std::size_t bytes, void (*entry)(), context& back) {
  getcontext(&c.u);
  c.u.uc_stack.ss_sp = base;
  c.u.uc_stack.ss_size = bytes;
  c.u.uc_link = &back.u;
  makecontext(&c.u, entry, 0);
}
#endif

struct fiber {
  context resume;
  state at;
  lane_call call;
};

constexpr std::size_t stack_bytes = 128 * 1024;
constexpr std::size_t max_shared = 232448;  // sm_90's most per block

struct launch {
  unsigned block = 0, blocks = 0, threads = 0, current = 0;
  std::size_t shared_bytes = 0;
  std::vector<fiber> fibers;
  std::vector<char> stacks;
  std::vector<int> arrived;  // per warp: lanes waiting at a warp-wide instruction
  context scheduler;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  char* error = nullptr;
  int error_size = 0;
  bool failed = false;
};
inline launch* running = nullptr;

inline void fail(launch& l, const char* what, unsigned detail) {
  if (!l.failed) std::snprintf(l.error, static_cast<std::size_t>(l.error_size), "block %u: %s %u", l.block, what, detail);
  l.failed = true;
}

inline void suspend(state s) {
  launch& l = *running;
  fiber& f = l.fibers[l.current];
  f.at = s;
  switch_to(f.resume, l.scheduler);
}

inline void warp_call(const lane_call& c) {
  running->fibers[running->current].call = c;
  suspend(state::at_warp);
}

inline void fiber_entry() {
  launch& l = *running;
  l.body(l.arg);
  l.fibers[l.current].at = state::done;
  switch_to(l.fibers[l.current].resume, l.scheduler);  // never resumed
}

}  // namespace lina_simt

// The dynamic shared memory (`extern __shared__ … shared[]` in every kernel).
__attribute__((aligned(16))) inline unsigned char shared[lina_simt::max_shared];

#define threadIdx (::lina_simt::dim3_{::lina_simt::running->current, 0u, 0u})
#define blockDim (::lina_simt::dim3_{::lina_simt::running->threads, 1u, 1u})
#define blockIdx (::lina_simt::dim3_{::lina_simt::running->block, 0u, 0u})
#define gridDim (::lina_simt::dim3_{::lina_simt::running->blocks, 1u, 1u})

inline void __syncthreads() { lina_simt::suspend(lina_simt::state::at_barrier); }
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
// Compiled with -ffp-contract=off: each of these rounds on its own.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = 32) {
  float r = 0.0f;
  lina_simt::warp_call({lina_simt::warp_op::shfl_xor, lane_mask, width, &v, nullptr, &r});
  return r;
}

// The conversions by their rules, written here rather than taken from
// lina/cuda/numeric.hpp (the interpreter's), as the fragment layouts below are.
namespace lina {
namespace tile {
namespace ptx {
inline float f16_to_f32(unsigned short h) { return static_cast<float>(__builtin_bit_cast(_Float16, h)); }
inline unsigned short f32_to_bf16(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);  // NaN stays (quiet) NaN
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline unsigned short f32_to_f16(float x) { return __builtin_bit_cast(unsigned short, static_cast<_Float16>(x)); }
inline unsigned f32x2_to_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(f32_to_bf16(lo)) | static_cast<unsigned>(f32_to_bf16(hi)) << 16;
}
inline unsigned f32x2_to_f16x2(float lo, float hi) {
  return static_cast<unsigned>(f32_to_f16(lo)) | static_cast<unsigned>(f32_to_f16(hi)) << 16;
}
inline unsigned f32_to_tf32(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fffffffu : u;  // NaN, ±inf
  return (u + 0x1000u) & 0xffffe000u;
}
inline float ex2_approx(float x) {
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.0f : y;  // .ftz
}
inline void prefetch_l2(const void*) {}
inline void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  lina_simt::warp_call({lina_simt::warp_op::mma_bf16, 0, 0, a, b, d});
}
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  lina_simt::warp_call({lina_simt::warp_op::mma_tf32, 0, 0, a, b, d});
}
template <bool Trans>
inline void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  lina_simt::warp_call({Trans ? lina_simt::warp_op::ldmatrix_x4_trans : lina_simt::warp_op::ldmatrix_x4, 0, 0, p, nullptr, r});
}
template <bool Trans>
inline void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  lina_simt::warp_call({Trans ? lina_simt::warp_op::ldmatrix_x2_trans : lina_simt::warp_op::ldmatrix_x2, 0, 0, p, nullptr, r});
}
}  // namespace ptx
}  // namespace tile
}  // namespace lina

namespace lina_simt {

inline float bf16_value(unsigned bits) { return __uint_as_float((bits & 0xffffu) << 16); }

// The PTX ISA's fragment layouts for mma.m16n8k16 (bf16) and m16n8k8 (tf32),
// lane l = (g, q) = (l / 4, l % 4) — written out here on their own, not taken
// from tiles.cuh's mma16, so that a slip there shows. d = c + a·b, one fp32
// fma chain per element in increasing k.
inline void mma(lane_call* const* calls, bool bf16) {
  float A[16][16] = {}, B[16][8] = {}, C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    const unsigned* a = static_cast<const unsigned*>(calls[l]->in0);
    const unsigned* b = static_cast<const unsigned*>(calls[l]->in1);
    const float* c = static_cast<const float*>(calls[l]->inout);
    for (int r = 0; r < 4; ++r) {
      if (bf16) {
        const int i = g + (r & 1) * 8, k = 2 * q + (r >> 1) * 8;
        A[i][k] = bf16_value(a[r]), A[i][k + 1] = bf16_value(a[r] >> 16);
      } else {
        A[g + (r & 1) * 8][q + (r >> 1) * 4] = __uint_as_float(a[r]);
      }
      C[g + (r >> 1) * 8][2 * q + (r & 1)] = c[r];
    }
    for (int r = 0; r < 2; ++r) {
      if (bf16) {
        const int k = 2 * q + r * 8;
        B[k][g] = bf16_value(b[r]), B[k + 1][g] = bf16_value(b[r] >> 16);
      } else {
        B[q + r * 4][g] = __uint_as_float(b[r]);
      }
    }
  }
  const int K = bf16 ? 16 : 8;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < K; ++k) C[i][j] = fmaf(A[i][k], B[k][j], C[i][j]);
  for (int l = 0; l < 32; ++l)
    for (int r = 0; r < 4; ++r)
      static_cast<float*>(calls[l]->inout)[r] = C[(l >> 2) + (r >> 1) * 8][2 * (l & 3) + (r & 1)];
}

// ldmatrix: matrix m's row r is at lane 8m + r's address (x2: lanes 0…15);
// lane l's register m holds row l / 4, columns 2(l % 4) and the next — of the
// matrix as stored, or (trans) of its transpose.
inline bool ldmatrix(launch& L, lane_call* const* calls, int matrices, bool trans) {
  const unsigned short* row[32];
  for (int l = 0; l < 8 * matrices; ++l) {
    const auto at = reinterpret_cast<std::uintptr_t>(calls[l]->in0), base = reinterpret_cast<std::uintptr_t>(shared);
    if (at % 16 != 0) return fail(L, "ldmatrix: a row address is not 16-byte aligned, lane", static_cast<unsigned>(l)), false;
    if (at < base || at + 16 > base + L.shared_bytes)
      return fail(L, "ldmatrix: a row outside the dynamic shared memory, lane", static_cast<unsigned>(l)), false;
    row[l] = static_cast<const unsigned short*>(calls[l]->in0);
  }
  unsigned out[32][4];
  for (int l = 0; l < 32; ++l)
    for (int m = 0; m < matrices; ++m) {
      const int i = l >> 2, j = 2 * (l & 3);
      const unsigned lo = trans ? row[8 * m + j][i] : row[8 * m + i][j];
      const unsigned hi = trans ? row[8 * m + j + 1][i] : row[8 * m + i][j + 1];
      out[l][m] = lo | hi << 16;
    }
  for (int l = 0; l < 32; ++l)
    for (int m = 0; m < matrices; ++m) static_cast<unsigned*>(calls[l]->inout)[m] = out[l][m];
  return true;
}

// The warp's 32 lanes wait at a warp-wide instruction: the same one, or fail.
inline bool complete_warp(launch& L, unsigned w) {
  lane_call* calls[32];
  for (unsigned l = 0; l < 32; ++l) {
    lane_call& c = L.fibers[32 * w + l].call;
    calls[l] = &c;
    if (c.op != calls[0]->op || c.a != calls[0]->a || c.b != calls[0]->b)
      return fail(L, "lanes of a warp wait at different warp-wide instructions, warp", w), false;
  }
  switch (calls[0]->op) {
    case warp_op::shfl_xor: {
      float out[32];
      const int mask = calls[0]->a, width = calls[0]->b;
      for (int l = 0; l < 32; ++l) {
        int from = l ^ mask;
        if (from / width != l / width) from = l;
        out[l] = *static_cast<const float*>(calls[from]->in0);
      }
      for (int l = 0; l < 32; ++l) *static_cast<float*>(calls[l]->inout) = out[l];
      break;
    }
    case warp_op::mma_bf16: mma(calls, true); break;
    case warp_op::mma_tf32: mma(calls, false); break;
    case warp_op::ldmatrix_x4: if (!ldmatrix(L, calls, 4, false)) return false; break;
    case warp_op::ldmatrix_x4_trans: if (!ldmatrix(L, calls, 4, true)) return false; break;
    case warp_op::ldmatrix_x2: if (!ldmatrix(L, calls, 2, false)) return false; break;
    case warp_op::ldmatrix_x2_trans: if (!ldmatrix(L, calls, 2, true)) return false; break;
  }
  for (unsigned l = 0; l < 32; ++l) L.fibers[32 * w + l].at = state::ready;
  L.arrived[w] = 0;
  return true;
}

// One block: every fiber runs until it waits; a warp-wide instruction
// completes when its last lane arrives, a barrier when every thread waits at
// it.
inline bool run_block(launch& L) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(shared, sizeof shared);
#endif
  memset(shared, 0xff, sizeof shared);  // NaN (fp32 and bf16) until written
#if defined(__SANITIZE_ADDRESS__)  // past the kernel's dynamic shared memory: an error to touch
  ASAN_POISON_MEMORY_REGION(shared + L.shared_bytes, sizeof shared - L.shared_bytes);
#endif
  for (unsigned t = 0; t < L.threads; ++t) {
    fiber& f = L.fibers[t];
    start(f.resume, L.stacks.data() + t * stack_bytes, stack_bytes, fiber_entry, L.scheduler);
    f.at = state::ready;
  }
  for (int& a : L.arrived) a = 0;
  for (unsigned pass = 0;; ++pass) {
    bool ran = false;
    for (unsigned x = 0; x < L.threads; ++x) {
      // Forward and backward in turn: a thread runs ahead of the others until
      // it waits, so a missing barrier shows as a read of what is not yet
      // written (NaN, or the last chunk's) or a write over what another
      // thread has still to read, whichever way round the two threads are.
      unsigned const t = pass % 2 == 0 ? x : L.threads - 1 - x;
      fiber& f = L.fibers[t];
      if (f.at != state::ready) continue;
      ran = true;
      L.current = t;
      switch_to(L.scheduler, f.resume);
      if (f.at == state::at_warp && ++L.arrived[t / 32] == 32 && !complete_warp(L, t / 32)) return false;
    }
    if (ran) continue;
    unsigned done = 0, barrier = 0;
    for (unsigned t = 0; t < L.threads; ++t) {
      if (L.fibers[t].at == state::done) ++done;
      if (L.fibers[t].at == state::at_barrier) ++barrier;
      if (L.fibers[t].at == state::at_warp)
        return fail(L, "a warp's lanes wait at a warp-wide instruction while another lane has not come, thread", t), false;
    }
    if (done == L.threads) return true;
    if (done > 0) return fail(L, "threads exited while others wait at __syncthreads(), waiting:", barrier), false;
    for (unsigned t = 0; t < L.threads; ++t) L.fibers[t].at = state::ready;
  }
}

// Launch `body(arg)` over `blocks` blocks of `threads` threads (a multiple of
// 32); 0 when every block ran to its end, else 1 with the reason in error.
inline int run(long long blocks, int threads, long long shared_bytes, void (*body)(void*), void* arg, char* error,
               int error_size) {
  static launch L;
  if (threads <= 0 || threads % 32 != 0 || threads > 1024 || shared_bytes < 0 ||
      static_cast<unsigned long long>(shared_bytes) > max_shared) {
    std::snprintf(error, static_cast<std::size_t>(error_size), "bad launch: %d threads, %lld bytes of shared memory", threads,
                  shared_bytes);
    return 1;
  }
  L.threads = static_cast<unsigned>(threads);
  L.blocks = static_cast<unsigned>(blocks);
  L.shared_bytes = static_cast<std::size_t>(shared_bytes);
  L.fibers.resize(L.threads);
  if (L.stacks.size() < L.threads * stack_bytes) L.stacks.resize(L.threads * stack_bytes);
  L.arrived.assign(L.threads / 32, 0);
  L.body = body, L.arg = arg, L.error = error, L.error_size = error_size, L.failed = false;
  running = &L;
  for (long long b = 0; b < blocks && !L.failed; ++b) {
    L.block = static_cast<unsigned>(b);
    run_block(L);
  }
  running = nullptr;
  return L.failed ? 1 : 0;
}

}  // namespace lina_simt
