// Kernels compiled ahead of time (lina_cuda_embed_kernels): this binary embeds
// the kernels of tests/embed/plans.hpp for sm_90. Without a GPU: the embedded
// images are what compile_cached returns (no NVRTC), byte for byte NVRTC's;
// a kernel not embedded still compiles; the generator's file and errors; and cuda::kernels_of lists exactly the
// kernels the launches of a plan run — recorded through the emulation, which
// takes the same programs as a launch on every path.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <lina/cuda/embed.hpp>
#include <lina/cuda/emit.hpp>
#include <lina/cuda/emulate.hpp>
#include <lina/cuda/nvrtc.hpp>
#include <set>
#include <string>
#include <vector>

#include "embed/plans.hpp"
#include "support.hpp"

using namespace embed_test;

namespace {
std::set<std::string> sources_of(std::vector<cuda::program> const& ps) {
  std::set<std::string> out;
  for (auto const& p : ps) out.insert(cuda::emit(p));
  return out;
}

// A runner that notes each program's source, then runs it in the interpreter.
std::set<std::string>* ran = nullptr;
void record(cuda::program const& p, cuda::forward_args const& a, std::int64_t) {
  ran->insert(cuda::emit(p));
  cuda::set_kernel_runner(nullptr);
  cuda::emulate(p, a);
  cuda::set_kernel_runner(record);
}
struct recording {
  std::set<std::string> sources;
  recording() {
    ran = &sources;
    cuda::set_kernel_runner(record);
  }
  ~recording() {
    cuda::set_kernel_runner(nullptr);
    ran = nullptr;
  }
};
}  // namespace

TEST_CASE("embedded kernels: each listed kernel is found without NVRTC, NVRTC's image byte for byte") {
  std::vector<cuda::program> const list = kernels();
  std::set<std::string> const distinct = sources_of(list);
  CHECK(cuda::embedded_kernel_count() == distinct.size());  // one architecture: sm_90
  CHECK(list.size() == 4);  // (softmax's forward and its backward's two launches; the causal forward)
  cuda::cache_counts const before = cuda::cache_statistics();
  for (cuda::program const& p : list) {
    CAPTURE(p.kernel_name);
    cuda::compiled_kernel const k = cuda::compile_cached_in("", cuda::emit(p), p.kernel_name, "sm_90");
    CHECK(k.embedded);
    CHECK(k.log.empty());
    CHECK(k.image.size() > 4);
    CHECK(std::string(k.image.data(), 4) == "\x7f" "ELF");  // a cubin
  }
  cuda::cache_counts const after = cuda::cache_statistics();
  CHECK(after.compiled == before.compiled);
  CHECK(after.embedded - before.embedded == static_cast<int>(list.size()));
  // The image is NVRTC's: compiling the first kernel again gives the same bytes.
  cuda::program const& p = list.front();
  CHECK(cuda::compile(cuda::emit(p), p.kernel_name, "sm_90").image ==
        cuda::compile_cached_in("", cuda::emit(p), p.kernel_name, "sm_90").image);
}

TEST_CASE("embedded kernels: one not listed (another architecture, another D, other options) compiles") {
  cuda::program const p = cuda::program_of(causal_plan, bf16, D = d, M = m);
  CHECK(cuda::compile_cached_in("", cuda::emit(p), p.kernel_name, "sm_90").embedded);
  cuda::cache_counts const before = cuda::cache_statistics();
  cuda::compiled_kernel const other_arch = cuda::compile_cached_in("", cuda::emit(p), p.kernel_name, "sm_80");
  CHECK_FALSE(other_arch.embedded);
  CHECK(other_arch.arch == "sm_80");
  cuda::program const wider = cuda::program_of(causal_plan, bf16, D = 2 * d, M = m);
  CHECK_FALSE(cuda::compile_cached_in("", cuda::emit(wider), wider.kernel_name, "sm_90").embedded);
  CHECK_FALSE(cuda::compile_cached_in("", cuda::emit(p), p.kernel_name, "sm_90", {"-lineinfo"}).embedded);
  CHECK(cuda::cache_statistics().compiled - before.compiled == 3);
}

TEST_CASE("kernels_of lists exactly the kernels a plan's launches run: forward, split, chained, backward, steps") {
  std::size_t const b = 1, h = 2, n = 200;
  auto x = [&](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({b, h, n, cols}, seed); };
  auto const q = x(d, 1), k = x(d, 2), v = x(m, 3), dout = x(m, 4);
  cuda::options split = bf16;
  split.split_rows = 64;  // (a multiple of every program's chunk: 16, 32 or 64)
  std::size_t const cut = 70;
  auto first = [&](tensor<float> const& t) { return test::tokens(t, 0, cut); };
  auto second = [&](tensor<float> const& t) { return test::tokens(t, cut, n); };

  recording causal_runs;
  for (cuda::options const& o : {bf16, split}) {
    (void)cuda::emulate(causal_plan, o, Q = q, K = k, V = v);
    (void)cuda::emulate_gradient(causal_plan, o, dout, Q = q, K = k, V = v);
    // Chained: two blocks, then their gradients, last block first.
    cuda::state st(causal_plan, b, h, cuda::memory::host), none(cuda::memory::host);
    (void)cuda::emulate(causal_plan, o, st, Q = first(q), K = first(k), V = first(v));  // st: the sums after block 1
    auto g2 = cuda::emulate_gradient(causal_plan, o, second(dout), st, none, Q = second(q), K = second(k), V = second(v));
    (void)cuda::emulate_gradient(causal_plan, o, first(dout), none, g2.second, Q = first(q), K = first(k), V = first(v));
    (void)cuda::emulate(causal_plan, o, st, Q = second(q), K = second(k), V = second(v));
  }
  // Decoding: a prompt, then steps.
  auto rnn = cuda::recurrent(causal_plan, b, h, bf16, cuda::memory::host);
  tensor<float> prompt({b, h, cut, m});
  rnn.prefill_into(prompt.view(), Q = first(q), K = first(k), V = first(v));
  for (std::size_t t = cut; t < cut + 3; ++t)
    (void)rnn.step(Q = test::tokens(q, t, t + 1), K = test::tokens(k, t, t + 1), V = test::tokens(v, t, t + 1));
  CHECK(causal_runs.sources == sources_of(cuda::kernels_of(causal_plan, bf16, D = d, M = m)));

  recording softmax_runs;
  (void)cuda::emulate(softmax_plan, {}, Q = q, K = k, V = v);
  (void)cuda::emulate_gradient(softmax_plan, {}, dout, Q = q, K = k, V = v);
  CHECK(softmax_runs.sources == sources_of(cuda::kernels_of(softmax_plan, {}, D = d, M = m)));
}

TEST_CASE("embedding kernels: the written file, and errors that say what is wrong") {
  namespace fs = std::filesystem;
  setenv("LINA_CUDA_CACHE", LINA_TEST_NVRTC_CACHE, 0);  // (the suite's NVRTC cache, not the user's)
  fs::path const dir = fs::temp_directory_path() / ("lina-embed-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string const file = (dir / "kernels.cpp").string();
  std::vector<cuda::program> const one = {cuda::program_of(softmax_plan, {}, D = d, M = m)};
  // One kernel, listed twice, for two architectures: two images; their source and names in the file.
  CHECK(cuda::write_embedded_kernels(file, {one[0], one[0]}, {"sm_90", "sm_80"}) == 2);
  std::ifstream in(file);
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("register_embedded_kernels") != std::string::npos);
  CHECK(text.find("{\"" + one[0].kernel_name + "\", \"sm_80\", source1") != std::string::npos);
  // The same text again leaves the file alone (the application is not rebuilt for nothing).
  auto const stamp = fs::last_write_time(file);
  fs::last_write_time(file, stamp - std::chrono::hours(1));
  CHECK(cuda::write_embedded_kernels(file, one, {"sm_90", "sm_80"}) == 2);
  CHECK(fs::last_write_time(file) == stamp - std::chrono::hours(1));
  // Errors: no architecture, an unknown one, a generator's unknown argument, a folder that is not there.
  CHECK_THROWS_WITH_AS(cuda::write_embedded_kernels(file, one, {}), doctest::Contains("no architecture"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cuda::write_embedded_kernels(file, one, {"sm90"}), doctest::Contains("unknown architecture sm90"),
                       cuda::nvrtc_error);
  char arg0[] = "gen", bad[] = "--arches", out[] = "--out", nowhere[] = "/nonexistent-lina-dir/k.cpp", arch[] = "--arch",
       sm[] = "sm_90";
  char* unknown[] = {arg0, bad, sm};
  CHECK(cuda::embed_main(3, unknown, one) == 1);
  char* unwritable[] = {arg0, out, nowhere, arch, sm};
  CHECK_THROWS_WITH_AS(cuda::write_embedded_kernels(nowhere, one, {"sm_90"}), doctest::Contains("cannot write"),
                       std::runtime_error);
  CHECK(cuda::embed_main(5, unwritable, one) == 1);
  fs::remove_all(dir);
}
