// Autoregressive generation through a stack of L transformer layers with
// random weights, two ways:
//   - linear attention (elu+1, causal, normalised) in lina's recurrent mode:
//     each layer keeps a C x (M+1) state per head, so a token costs the same at
//     every position;
//   - softmax attention with a key-value cache (hand-written, max-subtracted):
//     a token at position t reads all t cached keys and values.
// Each layer: q, k, v projections, attention over H heads, output
// projection, residual, a two-layer ReLU feed-forward, residual, RMS scaling.
// The last layer's output, squashed by tanh, is the next token's input.
//
//   generate [--tokens 16384] [--layers 4] [--heads 4] [--head-dim 16]
//
// Prints per-token time at several positions and the total for the sequence.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <vector>

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto Dh = dim<"D">;
constexpr auto Q = input<"Q">(N, Dh);
constexpr auto K = input<"K">(N, Dh);
constexpr auto V = input<"V">(N, Dh);
constexpr auto attention = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

struct options {
  std::size_t tokens = 16384, layers = 4, heads = 4, head_dim = 16;
};

using vec = std::vector<float>;

// y = x W for W (rows x cols), row-major.
void matvec(vec const& x, vec const& w, std::size_t rows, std::size_t cols, vec& y) {
  y.assign(cols, 0.f);
  for (std::size_t i = 0; i < rows; ++i) {
    float xi = x[i];
    float const* wi = w.data() + i * cols;
    for (std::size_t j = 0; j < cols; ++j) y[j] += xi * wi[j];
  }
}

vec random_matrix(std::size_t rows, std::size_t cols, std::uint64_t seed) {
  auto t = tensor<float>::random({1, 1, rows, cols}, seed);
  vec w(t.data(), t.data() + t.size());
  float scale = std::sqrt(3.0f / static_cast<float>(rows));  // unit variance out of unit variance in
  for (auto& x : w) x *= scale;
  return w;
}

struct layer_weights {
  vec wq, wk, wv, wo, w1, w2;
};

// The two attention implementations behind one interface: attend(layer, q, k, v, out).
struct linear_attention {
  using rnn_type = decltype(cpu::recurrent<float>(compile(attention), 1, 1));
  std::vector<rnn_type> rnn;
  std::size_t heads, dh;
  linear_attention(std::size_t layers, std::size_t h, std::size_t d) : heads(h), dh(d) {
    for (std::size_t l = 0; l < layers; ++l) rnn.push_back(cpu::recurrent<float>(compile(attention), 1, h));
  }
  void attend(std::size_t l, vec const& q, vec const& k, vec const& v, vec& out) {
    // [1, H, 1, Dh] views of the projections (head-major, as the vectors are laid out)
    shape4 s{1, heads, 1, dh};
    tensor_view<float const> qv(q.data(), s), kv(k.data(), s), vv(v.data(), s);
    auto y = rnn[l].step(Q = qv, K = kv, V = vv);
    out.assign(y.data(), y.data() + y.size());
  }
};

struct softmax_attention {
  std::vector<vec> keys, values;  // per layer: [H][capacity][Dh]
  std::size_t heads, dh, capacity, length = 0;
  std::vector<float> scores;
  softmax_attention(std::size_t layers, std::size_t h, std::size_t d, std::size_t cap)
      : keys(layers, vec(h * cap * d)), values(layers, vec(h * cap * d)), heads(h), dh(d), capacity(cap),
        scores(cap) {}
  void attend(std::size_t l, vec const& q, vec const& k, vec const& v, vec& out) {
    std::size_t t = length;  // this token's position
    out.assign(heads * dh, 0.f);
    float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    for (std::size_t h = 0; h < heads; ++h) {
      float* kc = keys[l].data() + h * capacity * dh;
      float* vc = values[l].data() + h * capacity * dh;
      std::copy_n(k.data() + h * dh, dh, kc + t * dh);
      std::copy_n(v.data() + h * dh, dh, vc + t * dh);
      float const* qh = q.data() + h * dh;
      float top = -INFINITY;
      for (std::size_t j = 0; j <= t; ++j) {
        float s = 0;
        for (std::size_t c = 0; c < dh; ++c) s += qh[c] * kc[j * dh + c];
        scores[j] = s * scale;
        top = std::max(top, scores[j]);
      }
      float sum = 0;
      float* o = out.data() + h * dh;
      for (std::size_t j = 0; j <= t; ++j) {
        float w = std::exp(scores[j] - top);
        sum += w;
        for (std::size_t c = 0; c < dh; ++c) o[c] += w * vc[j * dh + c];
      }
      for (std::size_t c = 0; c < dh; ++c) o[c] /= sum;
    }
  }
  void advance() { ++length; }
};

template <class Attention>
std::vector<double> generate(Attention& attn, std::vector<layer_weights> const& w, options const& opt,
                             vec& last) {
  std::size_t f = opt.heads * opt.head_dim;
  vec x = random_matrix(1, f, 99), h, q, k, v, a, proj, hidden, ff;
  std::vector<double> per_token(opt.tokens);
  using clock = std::chrono::steady_clock;
  for (std::size_t t = 0; t < opt.tokens; ++t) {
    auto t0 = clock::now();
    h = x;
    for (std::size_t l = 0; l < w.size(); ++l) {
      matvec(h, w[l].wq, f, f, q);
      matvec(h, w[l].wk, f, f, k);
      matvec(h, w[l].wv, f, f, v);
      attn.attend(l, q, k, v, a);
      matvec(a, w[l].wo, f, f, proj);
      for (std::size_t i = 0; i < f; ++i) h[i] += proj[i];
      matvec(h, w[l].w1, f, 2 * f, hidden);
      for (auto& z : hidden) z = std::max(z, 0.f);
      matvec(hidden, w[l].w2, 2 * f, f, ff);
      float ms = 0;
      for (std::size_t i = 0; i < f; ++i) {
        h[i] += ff[i];
        ms += h[i] * h[i];
      }
      float inv = 1.0f / std::sqrt(ms / static_cast<float>(f) + 1e-6f);
      for (auto& z : h) z *= inv;
    }
    if constexpr (requires { attn.advance(); }) attn.advance();
    for (std::size_t i = 0; i < f; ++i) x[i] = std::tanh(h[i]);
    per_token[t] = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
  }
  last = h;
  return per_token;
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--tokens")) opt.tokens = v;
    else if (!std::strcmp(argv[i], "--layers")) opt.layers = v;
    else if (!std::strcmp(argv[i], "--heads")) opt.heads = v;
    else if (!std::strcmp(argv[i], "--head-dim")) opt.head_dim = v;
    else {
      fmt::print(stderr, "usage: generate [--tokens N] [--layers L] [--heads H] [--head-dim D]\n");
      return 2;
    }
  }
  std::size_t f = opt.heads * opt.head_dim;
  std::vector<layer_weights> w;
  for (std::size_t l = 0; l < opt.layers; ++l)
    w.push_back({random_matrix(f, f, 10 * l + 1), random_matrix(f, f, 10 * l + 2), random_matrix(f, f, 10 * l + 3),
                 random_matrix(f, f, 10 * l + 4), random_matrix(f, 2 * f, 10 * l + 5),
                 random_matrix(2 * f, f, 10 * l + 6)});
  fmt::print("generation: {} tokens, {} layers, {} heads x {} dims (model width {}), batch 1, float, 1 thread\n",
             opt.tokens, opt.layers, opt.heads, opt.head_dim, f);
  fmt::print("linear attention plan: {}\n\n", compile<order::linear>(attention));

  vec out_linear, out_softmax;
  linear_attention lin(opt.layers, opt.heads, opt.head_dim);
  auto t_lin = generate(lin, w, opt, out_linear);
  softmax_attention soft(opt.layers, opt.heads, opt.head_dim, opt.tokens);
  auto t_soft = generate(soft, w, opt, out_softmax);

  // Per-token time: the mean over the 32 tokens ending at each position.
  fmt::print("{:>9} {:>18} {:>18} {:>9}\n", "position", "linear µs/token", "softmax µs/token", "ratio");
  std::vector<std::size_t> positions;
  for (std::size_t p = 32; p <= opt.tokens; p *= 2) positions.push_back(p);
  if (opt.tokens >= 32 && positions.back() != opt.tokens) positions.push_back(opt.tokens);
  for (std::size_t p : positions) {
    double a = 0, b = 0;
    for (std::size_t t = p - 32; t < p; ++t) {
      a += t_lin[t];
      b += t_soft[t];
    }
    fmt::print("{:>9} {:>18.1f} {:>18.1f} {:>8.1f}x\n", p, a / 32, b / 32, b / a);
  }
  double total_lin = 0, total_soft = 0;
  for (double x : t_lin) total_lin += x;
  for (double x : t_soft) total_soft += x;
  fmt::print("whole sequence: linear {:.3f} s, softmax {:.3f} s: {:.1f}x faster\n", total_lin / 1e6, total_soft / 1e6,
             total_soft / total_lin);
}
