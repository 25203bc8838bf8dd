// The tile program: ONE description of a generated kernel, read by two
// implementations — the emitter (emit.hpp), which writes it as CUDA source
// calling the device tile header (tiles.cuh), and the host emulation
// (emulate.hpp), which executes it on the CPU with the same semantics.
//
// Plain C++ (no Hana, no lina core headers): nvcc and NVRTC never see the DSL.
//
// A program runs once per CTA ("block"). Block x works on one (batch, head)
// slice and one tile of the output's columns (m_tile = x % m_tiles) — or, in a
// split program (the chunk-parallel form), on one group of rows too: x =
// (slice · m_tiles + m_tile) · groups + group, groups = ⌈n / group_rows⌉, and
// its passes walk rows [group · group_rows, min(n, (group + 1) · group_rows))
// (a key-major split program: of K's and V's rows, n_keys for n):
//
//   prologue                      once
//   for each pass:                every pass walks the chunks of the sequence,
//     before                      once, before its chunks
//     for r0 = 0, T, 2T, … < n:   rows [r0, r0 + rows), rows = min(T, n - r0)
//       body                      in order (a reverse pass: the same chunks,
//                                 last first — a suffix scan)
//   epilogue                      once
//
// A pass marked `keys` walks the rows of K and V instead, n_keys of them
// (forward_args::n_keys; cross-attention, where K and V run over another
// sequence than Q — non-causal only; −1, the default, means n).
//
// A quadratic program (softmax: exp has no finite feature map, so there is no
// running state to scan) has one block per (batch, head, M tile, chunk of
// query rows): x = (slice · m_tiles + m_tile) · q_chunks + qc, q_chunks =
// ⌈n / T⌉. Its prologue and epilogue — and what runs before a pass — work on
// the block's query rows [q0, q0 + q_rows), q0 = qc · T, and its passes walk
// the key chunks [0, n_keys) — causal: [0, q0 + q_rows), up to and including
// the diagonal chunk. A key-major quadratic program (softmax's backward for
// ∂K and ∂V) swaps the roles: a block per chunk of key rows [k0, k0 + k_rows),
// ⌈n_keys / T⌉ of them, whose passes walk the query chunks [0, n) — causal:
// [k0, n), from the diagonal chunk on.
//
// Registers are tiles (rows × cols) in shared memory, rows `pitch` elements
// apart (pitch_of: padded so that a warp's column reads hit distinct banks),
// of fp32 — or of bf16 for the tiles of bf16 programs that only tensor-core
// products read (see tile_register::storage); they persist across
// chunks and passes (the state is just a tile that no pass zeroes). Every
// instruction is block-wide and completes before the next starts (on the
// device: the emitter puts a barrier wherever the next one touches what an
// earlier one since the last barrier wrote, or writes what it read).
//
// Semantics (the emulation in emulate.cpp is the executable definition; the
// device side in tiles.cuh must agree, element for element):
//   zero t                 t = 0
//   load t ← in[s]         t[i][j] = in[s](r0 + i, c0 + j) converted from the
//                          input dtype to fp32 (exact) for i < rows and
//                          j < width with c0 + j < cols(in[s]); 0 elsewhere
//                          (including j ≥ width). c0 = 0, or m_tile · tile_m
//                          when the load is `by_m_tile`. 64-bit offsets. A
//                          `whole` load (W, in a prologue) has r0 = 0, rows = t.rows.
//                          accumulate (fp32 buffers into fp32 registers: a split
//                          backward's sums): t[i][j] += the element where it is
//                          read; t unchanged elsewhere.
//   map t, φ               t[i][j] = φ(t[i][j]) for i < rows (rows ≥ rows stay 0)
//   map t ← x, poly2       t[i][·] = poly2(x[i][·]) for i < rows, 0 for i ≥ rows:
//                          x_a² at a(2D−a+1)/2, (√2·x_a)·x_b after it for b > a,
//                          √2 rounded to fp32 (a row map, out of place)
//   map t ← x, z, favor    (parametric maps; z = x·W, F columns, b = z) for i < rows,
//                          with s = D^−¼ (the instruction's scale) and inv = 1/√F
//                          rounded to fp32 and n =
//                          Σ_c x[i][c]² one fma chain in increasing c: favor:
//                          t[i][j] = exp(fma(s, z[i][j], −n·(s·s/2)))·inv;
//                          random_fourier: t[i][j] = cos(s·z[i][j])·inv, t[i][F+j]
//                          = sin(s·z[i][j])·inv; 0 for i ≥ rows
//   ones_column t          t[i][cols-1] = 1 for i < rows
//   product t, a, b, p     t = op(a)·op(b) with op = identity or transpose per
//                          operand, at precision p; accumulate: t = t + op(a)·op(b),
//                          the product summed from zero, then added (a sum
//                          carried over chunks — a state, ∂W, a softmax's rows —
//                          grows by a chunk's sum at a time, not a row's: in
//                          fp32 over 2²⁰ rows 1.7e-6 from fp64 instead of 5.6e-5).
//                          fma_f32: each element one fp32 fused multiply-add
//                          chain in increasing k (exact operands);
//                          mma_bf16 / mma_tf32: every operand element first
//                          rounded to bf16 (nearest even) / tf32 (10 stored
//                          bits, nearest, ties away: cvt.rna), products exact,
//                          sums in fp32 in an order the tensor cores choose
//                          (the emulation: increasing k). By 16-row stripes,
//                          with s = 16·⌊i/16⌋: tri_t lower (upper): t[i][j] = 0
//                          for j ≥ s + 16 (j < s), not computed — the tiles a
//                          causal (anticausal) mask right after zeroes whole;
//                          tri_a lower (upper): the terms k ≥ s + 16 (k < s) of
//                          row i are skipped — the zero tiles of a masked op(a),
//                          so a NaN or ∞ of b there does not reach row i
//   mask_causal t          t[i][j] = 0 for j > i; decayed (b ≥ 0, the powers
//                          register): t[i][j] = t[i][j] · b[0][i − j] for j ≤ i
//   row_divide t, eps      t[i][j] = t[i][j] · (1/d) for j < cols-1, d = t[i][cols-1]
//                          + eps, 1/d rounded to fp32 (one reciprocal a row, as the
//                          CPU backend's rowdiv). With a register m (b ≥ 0: softmax
//                          rows shifted by their max), d = fma(eps, exp(−m[i][0]),
//                          t[i][cols-1]):
//                          exp(x)/(Σexp(x) + eps) = exp(x−m)/(Σexp(x−m) + eps·e^−m)
//   exp_rows t, o, m       (quadratic programs) the scores t (T × T: query rows ×
//                          keys) become exp(scale·t − shift). Row i is query
//                          qi, column j key kj: qi = q0 + i, kj = r0 + j (the
//                          pass's key chunk), or in a key-major program qi = r0 +
//                          i (the pass's query chunk), kj = k0 + j. (i, j) is
//                          valid when qi < n, kj < n_keys and, causal, kj ≤ qi;
//                          mask_scores: a key after the row (kj > qi) is valid,
//                          its score 0. Running shift (a ≥ 0, b ≥ 0: normalised
//                          forwards): m' = max(m[i][0], scale·t[i][j] over valid
//                          j) (a NaN score is skipped by the max and stays NaN),
//                          o[i][·] ·= exp(m[i][0] − m'), m[i][0] = m'; m starts
//                          at 0, so e^−m ≤ 1 and eps·e^−m never overflows. Fixed
//                          shift (a = −1, b ≥ 0: backward kernels, the forward's
//                          final m): m' = m[i][0]. Unshifted (b = −1): m' = 0 (the
//                          unnormalised rows are exp(x) as written). Then
//                          t[i][j] = exp(scale·t[i][j] − m') if valid, else 0.
//                          Decayed (log_decay ≠ 0: causal(exp(S), decay{g}),
//                          ALiBi's linear bias): every valid score is
//                          x = fma(scale, t[i][j], b), b = fp32(qi − kj) ·
//                          log_decay (0 on the diagonal), so that exp(x − m')
//                          is g^(qi−kj)·exp(scale·t − m'); the max runs over x
//   exp_grad t, e          (quadratic programs) the adjoint of exp_rows with the
//                          shift held: with t = ∂E and e = E, t[i][j] = scale ·
//                          (e[i][j]·t[i][j]) where (i, j) is valid and, with
//                          mask_scores, kj ≤ qi (a masked score is a constant);
//                          0 elsewhere
//   store t → out          out(r0 + i, c0 + j) = round(t[i][j]) for i < rows,
//                          j < width, c0 + j < cols(out) (c0 as for load);
//                          round: fp32 → output dtype, to nearest even. With a slot
//                          s ≥ 0 it writes extra[s] instead, in that buffer's dtype.
//                          accumulate: out(…) = round(out(…) + t[i][j]), out read in
//                          its dtype (a backward's gradient of an input the plan
//                          reads twice: the other share was stored before)
//                          A `whole` store (∂W, in an epilogue) has r0 = 0, rows = t.rows.
//   square_rows t          (quadratic programs: poly2 through its kernel, φ(q)·φ(k) =
//                          (q·k)²) t[i][j] = t[i][j]·t[i][j] where (i, j) is valid
//                          (as for exp_rows), else 0
//   square_grad t, e       the adjoint of square_rows: with t = ∂A and e the scores
//                          before squaring, t[i][j] = 2·(e[i][j]·t[i][j]) where
//                          valid, else 0
//   prefetch in[s]         no effect on any register: the next chunk's rows of
//                          in[s] (those of the load of the same slot, columns
//                          and `by_m_tile`) are requested into L2, so that its
//                          loads wait less (spec.tiles.prefetch; a hint alone).
//   load from slot s ≥ max_inputs reads extra[s − max_inputs] in its dtype.
//   load_state t           (from extra[slot] instead of state_in when slot ≥ 0)
//                          t[i][j] = state_in(i, c0 + j) for i < t.rows, j < width,
//                          c0 + j < m_cols, with c0 = m_tile · tile_m and m_cols =
//                          cols(state) − 1 when `z_column`, else cols(state);
//                          z_column: t[i][t.cols − 1] = state_in(i, cols(state) − 1),
//                          the normaliser z; 0 elsewhere. fp32, exact.
//   mask_anticausal t      t[i][j] = 0 for j < i (the transposed mask: backward passes);
//                          decayed (b ≥ 0): t[i][j] = t[i][j] · b[0][j − i] for j ≥ i
//   powers t               t[0][k] = g^k for k < t.cols, g = the spec's decay: computed
//                          in double, rounded to fp32, 0 below fp32's smallest normal
//                          (decay_powers: the same table on both sides)
//   decay_rows t, b, p     a decayed scan's weights (b: the powers register):
//                          t[i][j] = t[i][j] · b[0][e] for i < rows, with e = i + 1
//                          (p = row_plus_one: a row's weight of the state before the
//                          chunk), rows − 1 − i (to_chunk_end: a row's weight at the
//                          chunk's last row); p = chunk: every row of t, e = rows (the
//                          state carried past the whole chunk)
//   map_grad t, φ, in[s]   element-wise φ: t[i][j] = t[i][j] · φ′(x) with x = in[s](r0 + i, j)
//                          (read as for load) for i < rows, j < t.cols; φ′ of elu+1 is
//                          1 for x > 0, else exp(x); of relu 1 for x > 0, else 0; of
//                          identity 1. Row map (poly2), out of place from register a
//                          (T × C): t[i][c] = Σ_f a[i][f] · ∂poly2(x)_f/∂x_c, one fp32
//                          fma chain per element over the features f in increasing order
//                          (x_a² gives 2·x_a; (√2·x_a)·x_b gives √2·x_b to a and (√2·x_a)
//                          to b); 0 for i ≥ rows. Parametric map (favor, rff; slot −1),
//                          in place on t = z = x·W (T × F) with a = ∂φ (T × C) and b = x,
//                          s = the instruction's scale, inv = 1/√F and n = Σ_c x[i][c]²
//                          as in map: t[i][j] = ∂z, for favor s·(a[i][j]·φ) with φ =
//                          exp(fma(s, z, −n·(s·s/2)))·inv, for rff s·(a[i][F+j]·(cos(s·z)
//                          ·inv) − a[i][j]·(sin(s·z)·inv)); 0 for i ≥ rows
//   param_grad t ← a, b, in[s]  (parametric maps) ∂X rows from ∂z = a (T × F) and W = b
//                          (D × F): t[i][c] = Σ_f a[i][f]·b[c][f] (one fp32 fma chain,
//                          increasing f); favor adds the norm's share: t[i][c] =
//                          fma(−s·x, Σ_f a[i][f], t[i][c]) with x = in[s](r0 + i, c) and
//                          the sum in increasing f; 0 for i ≥ rows
//   rowdiv_grad t, o, eps  the adjoint of row_divide: per row i < rows, with
//                          d = o[i][W−1] + eps (W = o.cols, o holds the unnormalised
//                          [num | den]; with a register m (b ≥ 0: softmax rows
//                          shifted by m) d = fma(eps, exp(−m[i][0]), o[i][W−1]),
//                          row_divide's divisor), r = 1/d rounded to fp32 and
//                          s = Σ_{j<W−1} t[i][j] · (o[i][j] · r) as 8 fp32 fma chains
//                          in increasing j over consecutive runs of ⌈(W−1)/8⌉ columns,
//                          s_0 … s_7, added pairwise ((s_0 + s_1) + (s_2 + s_3)) +
//                          ((s_4 + s_5) + (s_6 + s_7)): t[i][W−1] = −s · r, then
//                          t[i][j] = t[i][j] · r for j < W−1; rows ≥ rows stay as they are
//   store_partial t        (a split program) extra[s](group·C + i, c0 + j) = t[i][j]
//                          (s: the slot, C: t's rows) for the columns store_state
//                          writes, the z column from m_tile 0 alone: this group's
//                          sums; `causal` (a prefix's sums), not by the last group
//                          (nobody reads them) — `later` (a suffix's sums), not by the
//                          first; a block that stores nothing else then does nothing
//   add_partials t         (a split scan) t[i][j] += extra[s](g·C + i, c0 + j) for
//                          g = 0 … group − 1 in increasing g when `causal` (`later`:
//                          g = group + 1 … groups − 1, the groups after it), else
//                          every group of the rows the buffer was summed over (K's
//                          or Q's: extra_buffer::keys), g < ⌈rows / group_rows⌉ —
//                          also in a program that is not split — for the columns
//                          load_state reads (z column included). Decayed (b ≥ 0, the
//                          powers register; causal): by Horner's rule, each group's
//                          sums s added as t = fma(t, w, s) (w = g^(the group's rows),
//                          built in fp32 as pw[T] once per whole chunk, then ·pw[rows
//                          mod T]): `causal` in increasing g (full groups), `later` in
//                          decreasing g from the last, whose rows are n − (groups−1)·
//                          group_rows — the state a group starts from, the gradient of
//                          the state a reverse walk starts from
//   store_state t          state_out(i, c0 + j) = t[i][j] for the same (i, j); the z
//                          column (z_column) only from the block with m_tile = 0 —
//                          every block of a (batch, head) holds the same z. In a
//                          split program only the last group's blocks store (their
//                          sums cover every row; `later`, a reverse walk's sums: the
//                          first group's). state_in
//                          and state_out must not overlap: while one block stores
//                          its final z, another may not have loaded the initial one.
//
// The state of a (batch, head) is C × (M+1) fp32 when normalised — [s | z], s =
// Σ φ(k_j) v_jᵀ and z = Σ φ(k_j) in the last column — and C × M otherwise: the
// running sums of the plan's prefix scan, as lina/state.hpp defines them for
// every backend (row-major; the state operand's strides say where).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lina::cuda {

// Element types of inputs and outputs; accumulation and state are always fp32.
enum class dtype : std::uint8_t { f32, f16, bf16 };

// Feature maps a program can apply: element-wise (C = D features), or poly2,
// the exact degree-2 polynomial kernel packed as [x_i² (i), √2 x_i x_j (i < j)]
// (C = D(D+1)/2, lina::poly2's order).
// favor and random_fourier are parametric: φ(x) reads x·W, W (D × F) an
// input of the plan (lina::favor, lina::random_fourier): C = F or 2F.
// user0, user1: element-wise maps defined outside lina (attention_spec::user).
enum class feature_map : std::uint8_t { identity, elu_plus_one, relu, poly2, favor, random_fourier, user0, user1 };
inline bool user_defined(feature_map m) { return m == feature_map::user0 || m == feature_map::user1; }
// What a kernel needs of an element-wise map defined outside lina (docs/dsl.md):
// its formulas as CUDA expressions in the float x (the generated kernel's φ(x)
// and φ′(x)), and the same in fp32 on the host (the map's value<float> and
// derivative<float>), which the emulation calls.
struct user_map {
  std::string name, cuda_apply, cuda_derivative;
  float (*apply)(float) = nullptr;
  float (*derivative)(float) = nullptr;
  bool operator==(user_map const&) const = default;
};
// Features of a row of D columns (F: columns of W, for the parametric maps): C.
std::size_t features(feature_map m, std::size_t d, std::size_t f = 0);
inline bool parametric(feature_map m) { return m == feature_map::favor || m == feature_map::random_fourier; }

std::string_view name_of(dtype t);
std::string_view name_of(feature_map m);
std::size_t size_of(dtype t);

// What a caller fixes of a kernel's tiles (attention_spec::tiles,
// options::tiles); 0 leaves the choice to choose_tiles. chunk: rows per chunk,
// T ∈ {16, 32, 64} (every program: forward, backward, softmax's); tile_m:
// columns of M per block of a forward (the backward holds every column; a
// decoding step always takes T = 16); prefetch: each chunk first requests the
// next chunk's input rows into L2 (opcode::prefetch); threads: per block, 128,
// 256 or 512 (0: 256) — the tensor-core products spread their 16-row stripes
// over that many warps (every other instruction strides by the block's
// threads); groups: how many groups of rows along N a launch of a linear plan
// splits each (batch, head) into — its chunk-parallel form, split_rows below:
// 0 lets lina choose from the device (only where the blocks leave SMs idle), 1
// never splits, G ≥ 2 splits into G (at most one per chunk; ignored where the
// plan has no such form: softmax, a decoding step, a non-causal FAVOR+ or
// random-feature backward). The schedule changes how a kernel walks its tiles,
// not what it computes: results differ only in the order of sums (prefetching
// changes nothing at all).
struct tile_request {
  int chunk = 0;
  int tile_m = 0;
  bool prefetch = false;
  int threads = 0;
  int groups = 0;
  bool operator==(tile_request const&) const = default;
};
// std::invalid_argument unless t is a schedule at all (chunk 0, 16, 32 or 64;
// tile_m ≥ 0; threads 0, 128, 256 or 512; groups ≥ 0); whether it fits a spec
// is choose_tiles' to say.
void check_tile_request(tile_request const& t);

// What program_of needs to know about a forward attention plan. Filled from a
// plan's type by lina::cuda::spec_of (lina/cuda.hpp) and the run-time extents.
struct attention_spec {
  bool causal = true;       // contract(φQ, prefix(φK⊗·)) rather than φQ·(φKᵀ·)
  bool normalized = true;   // rowdiv(… [V|1]) rather than … V
  feature_map map_q = feature_map::identity, map_k = feature_map::identity;
  double eps = 1e-6;        // of rowdiv
  std::size_t d = 0, m = 0; // columns of Q and K (D), of V and the output (M)
  std::size_t f = 0;        // parametric maps: columns of W (random features), read from input slot 3
  dtype in = dtype::f32, out = dtype::f32;
  bool chained = false;     // causal only: the scan starts from state_in and leaves its sums in state_out
  double decay = 1;         // causal only: key j weighs decay^(i−j) in row i (causal(S, decay{g})); 1: plain
  std::vector<double> head_decays;  // a decay per head instead (causal(S, head_decays{…}): head h's in row h
                            // of the kernel's tables), or empty; spec_of keeps a list of one value as `decay`
  bool step = false;        // sized for a token or a few per launch (cuda::recurrent): the short chunk, T = 16
  bool exact_products = false;  // fp32 FMA products even for 16-bit inputs (else precision_for(in))
  bool softmax = false;     // exp(scale·φQ·φKᵀ) (causal: masked after exp), then ·V: quadratic, no state
  double scale = 1;         // softmax only: the factor of the scores inside exp
  bool mask_scores = false; // non-causal softmax only: exp(causal(S)), the mask before exp — a score past
                            // the diagonal is 0, so its key weighs exp(0) = 1 (the plan as written)
  std::string q_name = "Q", k_name = "K", v_name = "V", w_name = "W";  // the plan's input symbols
  std::string w_k_name;     // φ(K)'s own W (input slot 4; same map, same F), or empty: φ(K) reads φ(Q)'s
  user_map user[2];         // feature_map::user0 and user1
  tile_request tiles{};     // the caller's choice of chunk and M tile, if any
  std::string description;  // the plan as the user's program printed it (messages)
  bool operator==(attention_spec const&) const = default;
};

// The user_map of feature_map::user0 or user1.
inline user_map const& user_of(attention_spec const& s, feature_map m) { return s.user[m == feature_map::user1 ? 1 : 0]; }

// Chunk and tile sizes, chosen so that every tile of the program fits in
// shared memory (see choose_tiles).
struct tile_config {
  int chunk = 64;    // T: rows per chunk
  int tile_m = 64;   // columns of V (and of the output) per block
  int threads = 256; // per block
  bool operator==(tile_config const&) const = default;
};

// The most dynamic shared memory a block may use: sm_80 allows 163 KiB per
// block (sm_90: 227 KiB); 160 KiB fits both targets.
inline constexpr std::size_t shared_memory_budget = 160 * 1024;
// What an sm_90 SM holds for all its blocks: 228 KiB of shared memory, of which
// each resident block also takes 1 KiB for itself (what decides how many blocks
// share an SM, with their registers).
inline constexpr std::size_t sm90_shared_bytes_per_sm = 228 * 1024, shared_bytes_reserved_per_block = 1024;

// T = 64 when the tiles fit, else 32, then 16 (always 16 for a step spec: a
// decode step reads one row, and a short chunk leaves more shared memory to
// other blocks); the M tile is min(M, 64) (or smaller when needed). What
// s.tiles requests is kept (an M tile past M is M). Throws
// std::invalid_argument when nothing fits, or the request is not a schedule.
tile_config choose_tiles(attention_spec const& s);

// How a product multiplies (see the semantics above). 16-bit programs use the
// tensor cores: bf16 programs at bf16, f16 programs at tf32 — its 10 stored
// bits are fp16's, and its fp32 range keeps the state and the chunk's scores,
// sums that can pass 65504, from overflowing as fp16 operands would.
enum class precision : std::uint8_t { fma_f32, mma_tf32, mma_bf16 };
std::string_view name_of(precision p);
precision precision_for(dtype in);
// The precision of a spec's products: precision_for(in), or fma_f32 when exact_products.
precision precision_of(attention_spec const& s);
// The precision's rounding of one operand element (the emulation's and the tests').
float round_operand(precision p, float x);

// Elements between the starts of two rows of a register of `cols` columns of
// `bytes`-byte elements: 16-byte rows whose length in 4-byte words is 4 mod 8,
// so that the 8 rows × 4 column pairs a tensor-core fragment reads fall in 32
// different banks.
int pitch_of(int cols, int bytes = 4);

struct tile_register {
  std::string name;  // a C identifier, used in the generated source
  int rows = 0, cols = 0;
  std::string comment;  // what it holds, e.g. "φ(Q) chunk (T, D)"
  // The element type in shared memory: f32, or bf16 — then every value written
  // to the register is rounded to bf16 (nearest even). The layouts make bf16
  // the registers that nothing but mma_bf16 products read (other instructions
  // only write them), which round their operands to bf16 anyway: the results
  // do not change, the tiles take half the bytes (program.cpp, narrow_registers).
  dtype storage = dtype::f32;
  int bytes() const { return storage == dtype::f32 ? 4 : 2; }
  int pitch() const { return pitch_of(cols, bytes()); }
  bool operator==(tile_register const&) const = default;
};

// Which triangle of a T × T tile a masked product keeps (instruction::tri_t, tri_a):
// lower, j ≤ i (a causal mask); upper, j ≥ i (the anticausal mask of reverse walks).
enum class triangle : std::uint8_t { none, lower, upper };

enum class opcode : std::uint8_t {
  zero, load, map, ones_column, product, mask_causal, row_divide, store, load_state, store_state,
  mask_anticausal, map_grad, rowdiv_grad, store_partial, add_partials, exp_rows, param_grad, exp_grad, square_rows,
  square_grad, prefetch, powers, decay_rows
};
// The power of the decay a decay_rows instruction weighs row i by (see above).
enum class decay_power : std::uint8_t { row_plus_one, to_chunk_end, chunk };
// Has the spec a decay per head (causal(S, head_decays{…}))?
inline bool per_head(attention_spec const& s) { return !s.head_decays.empty(); }
// Is the spec's mask decayed (causal(S, decay{g}), g < 1, or a decay per head)?
inline bool decayed(attention_spec const& s) { return s.decay != 1 || per_head(s); }
// Head h's decay (std::out_of_range past the list of a decay per head).
inline double decay_of_head(attention_spec const& s, std::int64_t h) {
  return per_head(s) ? s.head_decays.at(static_cast<std::size_t>(h)) : s.decay;
}
// The powers register's values g^0 … g^(count−1), g = head h's decay (opcode::powers).
std::vector<float> decay_powers(attention_spec const& s, int count, std::int64_t head = 0);
// A decayed softmax's exp_rows bias per step of distance in head h: ln g rounded
// to fp32 (−FLT_MAX for g = 0, so that every earlier key weighs exactly 0); 0 undecayed.
float log_decay(attention_spec const& s, std::int64_t head = 0);
std::string_view name_of(opcode o);

struct instruction {
  opcode op;
  int dst = -1;                 // the register written (read too, by in-place ops)
  int a = -1, b = -1;           // product operands; map, map_grad: the source of a row map (else -1);
                                // rowdiv_grad: a = o, b = m (-1: no shift); row_divide: b = m (-1: no shift);
                                // exp_rows: a = o (-1: the shift m is fixed), b = m (-1: unshifted); exp_grad: a = E;
                                // decay_rows and a decayed mask: b = the powers register (-1: a plain mask)
  bool transpose_a = false, transpose_b = false, accumulate = false;  // product; store: add to what is there;
                                // store_state: the z column is added to what is there (a slice of M's columns after the first)
  int slot = -1;                // load, map_grad: input slot (≥ max_inputs: an extra buffer); store: -1 out, else extra[slot];
                                // store_partial, add_partials: extra[slot], the groups' sums
  int width = 0;                // load/store/load_state/store_state: columns read or written (≤ the register's)
  bool by_m_tile = false;       // load/store: columns start at m_tile · tile_m (load_state/store_state: always)
  bool z_column = false;        // load_state/store_state: the register's last column ↔ the state's last (z)
  bool whole = false;           // load, store: rows 0 … t.rows of the operand (W, ∂W), not the chunk's
  feature_map map = feature_map::identity;  // map
  float eps = 0;                // row_divide
  float scale = 1;              // exp_rows, exp_grad; map with a parametric map: s = D^−¼
  bool causal = false;          // exp_rows, exp_grad, square_rows, square_grad: mask keys after the query row;
                                // store_partial, add_partials: a prefix's sums (the groups before)
  bool mask_scores = false;     // exp_rows, exp_grad: the scores of keys after the query row are 0 (exp(causal(S)))
  bool decayed = false;         // exp_rows: a decayed softmax's, each exponent + (i − j)·log_decay(spec, head)
  bool later = false;           // store_partial, add_partials, store_state in a split program: the sums of the
                                // groups after this block's (a reverse walk's suffix), not before it
  precision prec = precision::fma_f32;  // product
  triangle tri_t = triangle::none;      // product: t's tiles past the triangle a mask keeps are 0, not computed
  triangle tri_a = triangle::none;      // product: op(a) is a masked triangle; the terms of its zero tiles are skipped
  decay_power power = decay_power::row_plus_one;  // decay_rows (b: the powers register; masks: decayed by b when b ≥ 0)

  bool operator==(instruction const&) const = default;
};

struct input_slot {
  std::string name;  // the plan's input symbol, e.g. "Q"
  std::string role;  // "q", "k" or "v"
  bool operator==(input_slot const&) const = default;
};

// A pass: its instructions (the body, run per chunk), what runs once before
// its chunks, and the direction it walks them. It is the vector of its body,
// so that code reading bodies reads a pass as it reads any instruction list.
struct pass : std::vector<instruction> {
  pass() = default;
  pass(std::vector<instruction> body, bool rev = false, std::vector<instruction> first = {})
      : std::vector<instruction>(std::move(body)), reverse(rev), before(std::move(first)) {}
  bool reverse = false;              // last chunk first
  bool keys = false;                 // walks the rows of K and V (n_keys), not Q's
  std::vector<instruction> before;   // zero: run once before the chunks
  bool operator==(pass const&) const = default;
};

// A buffer beyond the inputs and the output (forward_args::extra): a backward
// kernel's further gradients and its scratch rows.
struct extra_buffer {
  std::string name;   // e.g. "∂K", "scratch"
  dtype type = dtype::f32;
  std::string comment;
  bool keys = false;  // rows of K and V (∂K, ∂V), not Q's
  std::size_t cols = 0;  // > 0: scratch the caller allocates, fp32 [B, H, rows, cols] (rows: N, or N_keys
                         // when `keys`), which only the programs of one backward read; 0: a gradient,
                         // state or sums the caller binds by name
  std::size_t rows = 0;  // scratch of fixed rows (a split backward's sums of ∂W: D), not N or N_keys
  bool sums_over_m = false;  // a sum over M's columns (∂K, ∂W): a backward split over M sums its slices' shares
  bool per_group = false;    // scratch of `rows` rows per group of a split launch: fp32 [B, H, groups·rows, cols]

  bool operator==(extra_buffer const&) const = default;
};

struct program {
  std::string kernel_name;   // a C identifier, unique per specialisation
  std::string description;   // what the kernel computes, and plan_text(spec)
  attention_spec spec;
  tile_config tiles;
  int m_tiles = 1;           // blocks per (batch, head): ceil(M / tile_m)
  std::vector<input_slot> inputs;
  std::vector<tile_register> registers;
  std::vector<instruction> prologue;                // zero or load_state, before the passes
  std::vector<pass> passes;
  std::vector<instruction> epilogue;                // store_state, after the passes
  std::vector<extra_buffer> extras;                 // forward_args::extra[i], in order
  std::string out_name = "out";                     // what `out` holds (a backward kernel: ∂Q)
  bool split = false;                               // blocks per group of rows too (forward_args::group_rows)
  bool quadratic = false;                           // blocks per chunk of query rows too (see the top)
  bool key_major = false;                           // quadratic: blocks per chunk of key rows, passes over queries;
                                                    // split: groups of K's rows (n_keys)
  std::size_t v_offset = 0;                         // a backward split over M: this launch's first column of V,
                                                    // ∂out and ∂V (arguments_for)

  // Registers lie one after another in shared memory (rows × pitch elements,
  // then read_slack bytes), each starting at a multiple of 16 bytes (ready for
  // vector accesses). A tensor-core fragment at a tile's edge reads whole
  // 8-column (16-row) tiles as stored, past the last column into the next row
  // and past the last row into the slack — elements that only reach results
  // no one stores (tiles.cuh, b_fragment), with no test per element; the
  // slack, never written, keeps those reads inside the register.
  static constexpr std::size_t register_alignment = 16;  // bytes
  static constexpr std::size_t read_slack = 64;          // bytes: 15 fp32 elements, and alignment
  std::size_t offset_of(int r) const;  // in bytes
  std::size_t shared_bytes() const;    // all registers, with their alignment
  bool operator==(program const&) const = default;
};

// f(i) for every instruction of p, in the order a block runs them: the
// prologue, each pass's `before` and body, the epilogue.
template <class F>
void for_each_instruction(program const& p, F&& f) {
  for (instruction const& i : p.prologue) f(i);
  for (pass const& x : p.passes) {
    for (instruction const& i : x.before) f(i);
    for (instruction const& i : x) f(i);
  }
  for (instruction const& i : p.epilogue) f(i);
}

// The tile program of a forward attention (causal: one pass, the chunked scan;
// non-causal: a pass accumulating the state, then a pass producing rows). A
// chained spec loads the state instead of zeroing it and stores it at the end;
// only a causal spec can be chained (std::invalid_argument otherwise: every
// row of a non-causal attention reads the whole sequence, so there is no
// running state to carry — as on the CPU, lina/state.hpp).
// The index of a program's extra buffer by its name (e.g. "∂W"); std::logic_error if it has none.
inline std::size_t extra_named(program const& p, std::string const& name) {
  for (std::size_t e = 0; e < p.extras.size(); ++e)
    if (p.extras[e].name == name) return e;
  throw std::logic_error("lina::cuda: program " + p.kernel_name + " has no buffer " + name);
}

program program_of(attention_spec const& s);

// A softmax spec's program is quadratic: per block, the query rows are loaded
// once (prologue) and each key chunk adds exp(scale·q·kᵀ − shift)·[V|1] to
// the rows, rescaled as the running max grows (exp_rows); the epilogue
// divides and stores them.

// The tile program of the backward of a forward attention: ∂Q, ∂K, ∂V from
// Q, K, V and ∂out (input slots 0–3, all of dtype `in`; the gradients are
// written in dtype `out`: ∂Q to out, ∂K to extra[0], ∂V to extra[1]; a
// normalised plan also writes and reads fp32 scratch rows, extra[2], [B, H, N,
// M+1]: the adjoint of its unnormalised rows). A chained causal spec starts
// the forward walk from state_in (the block's initial state S0), the reverse
// walk from the next extra buffer (the gradient of the state the block leaves,
// fp32 [B, H, C, W]; zeros at the sequence's end), and stores the gradient of
// S0 to state_out: blocks of a sequence differentiate last first, each handing
// its ∂S0 to the block before. One block per (batch, head)
// holds every column. Causal: a forward pass that recomputes the rows, takes
// rowdiv's adjoint and gives ∂Q from the prefix sums S = Σ φ(k)[v|1]ᵀ, then a
// reverse pass that gives ∂K and ∂V from the suffix sums R = Σ φ(q)ĝᵀ — no
// state is stored per chunk. Non-causal: four streaming passes (S; the rows,
// their adjoint and ∂Q; R; ∂K and ∂V); not chained (std::invalid_argument).
program backward_program_of(attention_spec const& s);

// The backward of any spec the backward kernels take, as the launches it
// needs, in order, on ONE forward_args (the same slots and extra buffers):
// a linear spec's one program (backward_program_of); a softmax spec's two
// quadratic programs over the same extras (∂K, ∂V, and for a normalised plan
// the fp32 scratch rows ĝ [B, H, N, M+1] and each row's shift m [B, H, N, 1]):
//   1. a block per chunk of query rows: the forward's rows again (a pass over
//      the keys: o and the running max m), then rowdiv's adjoint ĝ (stored
//      with m) and a second pass over the keys with m fixed: ∂S = scale·E∘
//      (ĝ·[V|1]ᵀ), ∂φ(Q) = Σ ∂S·φ(K) → ∂Q (out);
//   2. key-major, a block per chunk of key rows walking the query chunks (ĝ
//      and m from the scratch): ∂[V|1] = Σ Eᵀ·ĝ, ∂φ(K) = Σ ∂Sᵀ·φ(Q) → ∂K, ∂V.
// No atomics: every gradient row is summed by one block. With favor or random
// Fourier features inside exp, ∂W sums over every row of Q and K, which
// blocks of either launch only see a chunk of: those launches store ∂φ(Q) and
// ∂φ(K) (fp32 scratch [B, H, N, C], [B, H, N_keys, C]) instead, and a third
// program, a block per (batch, head) walking Q's rows then K's, turns them
// into ∂Q, ∂K and ∂W (∂W2) as the linear backward does.
// A plan that reads one input twice (K as V, Q as K: the spec's names say
// so) gets one gradient for it: the buffers of the shares are the same
// memory, and every store of a share after the first-stored one adds to what
// is there (store with accumulate) — the order is the programs': ∂Q, then
// ∂V, then ∂K, each row's shares stored by one block or by launches in order.
// A linear spec whose C × (M+1) state does not fit one block (D = M = 256) is
// split over M's columns: one launch per slice of M' = ⌈M / P⌉ columns (the
// fewest slices that fit), each the backward program of an M' spec run on its
// columns of V, ∂out and ∂V (program::v_offset; arguments_for shifts them).
// Everything after the rows is linear in ĝ, and rowdiv's adjoint on a slice's
// columns gives that slice's share of the normaliser's (−Σ ∂out·num / d² over
// its columns): each slice computes its shares of ∂Q, ∂K and ∂W, and the
// slices before the last store theirs to fp32 sums (extra buffers "∂Q sums",
// "∂K sums", "∂W sums": the first writes, later ones add), and the last adds
// the sums to its shares (load with accumulate) and stores the gradients,
// rounded once. Chained, each slice reads and writes its columns of the
// states and the z column; ∂(the state out)'s z starts the first slice's
// reverse walk only, and the later slices add their shares of ∂S0's z.
// An input read twice (K as V, Q as K) is tied over all the launches: the
// slices' ∂V columns each written, the ∂Q and ∂K shares stored (the second
// added) by the last — Q read as V: the last slice adds its ∂Q share to the
// sums too, and its last pass adds them to each chunk's rows after storing
// their ∂V columns. Launches run in order on one stream: no atomics.
std::vector<program> backward_programs_of(attention_spec const& s);

// The chunk-parallel form of a linear forward (splitting N when B·H·m_tiles
// blocks cannot fill the device): two launches over groups of group_rows rows
// (a multiple of the chunk). `partials` sums φ(K)ᵀ[V|1] over each group into
// extra[0] (fp32 [B, H, groups·C, W]); causal, `scan` starts each group from
// the sums of the groups before it (add_partials; chained: added to the state
// in) and runs the chunked scan over its rows; chained, the last group stores
// the state out. Non-causal, the partials' groups are of K's rows (key-major)
// and `scan` starts every group of Q's rows from all of them, then computes
// its rows. Same tiles as program_of(s); the results equal it up to the order
// of the state's sums.
// Decayed (causal(S, decay{g})): each group's sums are its state at its last
// row, started from 0, and a group starts from the earlier ones' by Horner's
// rule (add_partials) — S0·w^G + Σ_g' w^(G−1−g')·P_g', w = g^group_rows.
struct split_programs {
  program partials, scan;
};
// Does a launch of the spec's forward have a chunk-parallel form to choose?
// (A linear spec.)
bool splits(attention_spec const& s);
split_programs split_programs_of(attention_spec const& s);

// The chunk-parallel form of a linear backward (splitting N when the B·H
// blocks of backward_programs_of cannot fill the device): three launches over
// groups of group_rows rows, on ONE forward_args with the backward's buffers
// and two more, fp32 [B, H, groups·C, W] (extra_buffer::per_group; groups of
// K's rows, then of Q's). Causal:
//   1. `sums` — each group's Σ φ(K)ᵀ[V|1] (store_partial to "partials");
//   2. `adjoint sums` — each group's Σ φ(Q)ᵀĝ (to "∂ partials"): a normalised
//      plan first recomputes the group's rows from S0 + the groups before it,
//      takes rowdiv's adjoint ĝ and keeps it in the scratch rows;
//   3. `walks` — each group runs the one-pass backward on its rows: the forward
//      walk from S0 + the groups before it (ĝ read from the scratch rows), the
//      reverse walk from ∂(the state out) + the groups after it (add_partials,
//      later); chained, the first group stores ∂S0.
// Non-causal: 1. each group of K's rows its sums (key-major); 2. each group
// of Q's rows, from all of them, its rows, ĝ, ∂Q and Σ φ(Q)ᵀĝ; 3. each group
// of K's rows, from all of those, ∂K and ∂V (key-major). A plan with a
// parametric map (FAVOR+, random features) sums ∂W over every row: causal, its
// walks store each group's share ("∂W partials", fp32 [B, H, groups·D, F]);
// non-causal, launch 2 stores φ(Q)'s share per group of Q's rows and launch 3
// φ(K)'s per group of K's rows ("∂W (K's rows) partials", or ∂W2's for a W of
// φ(K)'s own); a fourth launch, a block per (batch, head), adds them in a
// fixed order (the groups', Q's before K's). Every gradient row is summed by
// one block; launches in order on one stream. Returns no programs where the
// backward has no such form: softmax or step specs, poly2 through its kernel
// and specs split over M's columns. Decayed, the adjoint sums are a reverse
// walk's (the gradient of the state before the group) and the walks add the
// later groups' by Horner's rule from the last (add_partials). The results equal backward_programs_of(s)'s
// up to the order of the state's sums.
std::vector<program> split_backward_programs_of(attention_spec const& s);

// out += in[0], both [B, H, n, cols] of element type t (the gradient of an
// input that two layers of a stacked plan share is the sum of the layers'):
// one block per (batch, head) walks the rows, a load and an adding store per
// chunk. std::invalid_argument for cols = 0.
program add_program(dtype t, std::size_t cols);

// Rows per group for a split launch: 0 (do not split) when `blocks` blocks of
// the unsplit program already give every one of `sms` SMs one or when the
// sequence has fewer than 4 chunks; else a multiple of the chunk that makes
// about two blocks per SM, at least 2 chunks per group.
std::int64_t split_rows(std::int64_t blocks, std::int64_t n, int chunk, int sms);
// The same under a caller's schedule: t.groups = 0 is the choice above (sms =
// 0, the emulation: no split), 1 none, G ≥ 2 groups of ⌈chunks / G⌉ whole
// chunks (so at most G of them; 0 where that makes one group).
std::int64_t split_rows(tile_request const& t, std::int64_t blocks, std::int64_t n, int chunk, int sms);

// Every kernel a launch of the spec's attention may run at its D, M (and F),
// whatever B, H, N and the device: the forward (one pass, and its
// chunk-parallel form where the plan has one), the backward (one pass or
// softmax's launches, the split form), and for a causal linear plan the same
// chained (with a state) and the decoding step. Each once, in that order; a
// variant the plan has not (a launch of it would throw before running) is left
// out. What lina_cuda_embed_kernels compiles ahead of time (docs/cuda.md);
// the caller's tile request (s.tiles) and dtypes as given, s.chained and
// s.step ignored.
std::vector<program> kernels_of(attention_spec s);

// The linear plan a spec computes, in lina's notation, written from the spec
// alone: every plan with this spec (either order, a select between them) gets
// the same text, so the same kernel source and one cache entry.
std::string plan_text(attention_spec const& s);

// A readable listing of the program (for docs, messages and debugging).
std::string listing(program const& p);

// ---- the kernel's argument block ---------------------------------------------
// Laid out exactly as lina::tile::forward_args in tiles.cuh (checked by the
// emulation test), so one struct feeds both cudaLaunchKernel and the emulation.
struct operand {
  void const* data = nullptr;  // element (0, 0, 0, 0)
  std::int64_t stride[4] = {0, 0, 0, 0};  // in elements: batch, head, row, col
  std::int64_t cols = 0;
};
// Input slots: Q, K, V (0–2), in a backward kernel ∂out (3), then W (φ(Q)'s,
// or the one W of both) and φ(K)'s own W. Extra buffers: a backward's further
// gradients (∂K, ∂V, ∂W, ∂W2), its scratch rows and ∂state, a split's partial sums.
inline constexpr int max_inputs = 6, max_extras = 10;
struct forward_args {
  operand in[max_inputs];
  operand out;        // data points to writable memory
  operand state_in;   // chained programs: fp32 [B, H, C, W], read by load_state
  operand state_out;  // chained programs: fp32 [B, H, C, W], written by store_state; must not overlap state_in
  std::int64_t batch = 0, heads = 0, n = 0;
  operand extra[max_extras];  // program::extras: further outputs and scratch (backward kernels)
  std::int64_t group_rows = 0;  // split programs: rows per group (a multiple of the chunk)
  std::int64_t n_keys = -1;     // rows of K and V when they are not Q's (cross-attention); −1: n
  // Packed sequences (one launch for all, packable programs): batch b is
  // sequence b, rows [row_offsets[b], row_offsets[b + 1]) of the operands'
  // one batch row (n: their total); the state keeps one batch row per sequence.
  // Memory the kernel reads (device memory on a GPU); null: not packed.
  std::int64_t const* row_offsets = nullptr;
};
// The rows of K and V.
inline std::int64_t keys_of(forward_args const& a) { return a.n_keys < 0 ? a.n : a.n_keys; }
// Is a buffer laid out by the rows of N (of N_keys: keys), as ∂K, ∂V and a
// backward's scratch rows are? Else, outside a split's sums (per group), it is
// one per batch row and head: ∂W, the gradient of a state.
inline bool by_rows(extra_buffer const& e) { return !e.per_group && e.rows == 0 && (e.keys || e.cols > 0); }
// Can one launch of p run packed sequences (forward_args::row_offsets)? A
// program of one block per (sequence, head, M tile) walking its rows — not
// one that splits rows among blocks (split, quadratic, or sums per group).
// Packed, its buffers by rows start at the sequence's first row of the one
// batch row, and the others (∂W, a state's gradient) take batch row b for
// sequence b, as the state does: the caller sums a pack's ∂W over its sequences.
inline bool packable(program const& p) {
  return !p.split && !p.quadratic &&
         std::none_of(p.extras.begin(), p.extras.end(), [](extra_buffer const& e) { return e.per_group; });
}

// Do the elements of two fp32 [batch, heads, rows, cols] operands overlap?
// (From their strides, which must be non-negative.)
bool overlap(operand const& x, operand const& y, std::int64_t batch, std::int64_t heads, std::int64_t rows);

// The arguments a launch of p reads: a slice of M's columns (v_offset > 0)
// sees V, ∂out and ∂V from its first column on, and so (chained) the states
// S0, ∂S0 and ∂(the state out), whose z column stays their last.
inline forward_args arguments_for(program const& p, forward_args a) {
  if (p.v_offset == 0) return a;
  auto shift = [&](operand& o, dtype t) {
    std::int64_t const c0 = std::min(static_cast<std::int64_t>(p.v_offset), o.cols);
    if (o.data) o.data = static_cast<char const*>(o.data) + c0 * o.stride[3] * static_cast<std::int64_t>(size_of(t));
    o.cols -= c0;
  };
  shift(a.in[2], p.spec.in);
  shift(a.in[3], p.spec.in);
  shift(a.extra[1], p.extras.at(1).type);
  if (p.spec.chained) {
    shift(a.state_in, dtype::f32);
    shift(a.state_out, dtype::f32);
    shift(a.extra[extra_named(p, "∂state out")], dtype::f32);
  }
  return a;
}

// The rows of a program's scratch buffer (extra_buffer::cols > 0) on these
// arguments: fp32 [B, H, rows, cols].
inline std::int64_t scratch_rows(extra_buffer const& e, forward_args const& a) {
  std::int64_t const side = e.keys ? keys_of(a) : a.n;  // (per group: the groups of K's or of Q's rows)
  std::int64_t const rows = e.rows ? static_cast<std::int64_t>(e.rows) : side;
  if (!e.per_group) return rows;
  return a.group_rows > 0 ? rows * ((side + a.group_rows - 1) / a.group_rows) : 0;
}

// Blocks to launch for a program on these arguments.
inline std::int64_t groups_of(program const& p, forward_args const& a) {
  std::int64_t const n = p.key_major ? keys_of(a) : a.n;  // the rows blocks divide
  if (p.quadratic) return (n + p.tiles.chunk - 1) / p.tiles.chunk;  // chunks of rows
  return !p.split ? 1 : a.group_rows <= 0 ? 0 : (n + a.group_rows - 1) / a.group_rows;
}
inline std::int64_t blocks_of(program const& p, forward_args const& a) {
  return a.batch * a.heads * p.m_tiles * groups_of(p, a);
}
// A kernel with a decay per head runs launches of as many heads: else a
// lina::shape_error ("decay per head", H, the list's length and the heads),
// which launch() and emulate() throw before anything runs.
void check_heads(program const& p, forward_args const& a);

}  // namespace lina::cuda
