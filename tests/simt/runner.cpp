#include "runner.hpp"

#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "lina/cuda/emit.hpp"

namespace test::simt {
namespace cuda = lina::cuda;
namespace {

namespace fs = std::filesystem;

std::string read_file(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_file(fs::path const& p, std::string_view text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("simt: cannot write " + p.string());
}
std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

using launch_fn = int (*)(void const* args, long long blocks, int threads, long long shared_bytes, char* error,
                          int error_size);

// Whether this process runs with AddressSanitizer (LD_PRELOAD, as ctest
// starts the simt tests): then the kernels are built with it too.
bool with_asan() { return dlsym(RTLD_DEFAULT, "__asan_init") != nullptr; }

// -O0: a CI run compiles every kernel (an empty cache) and runs it once; at
// -O1 the compiles took twice as long and saved less than that in running.
std::string const flags = std::string("-std=c++20 -O0 -fPIC -fvisibility=hidden -ffp-contract=off -march=native -w") +
                          (with_asan() ? " -fsanitize=address -fno-omit-frame-pointer" : "");

// A folder made in a private work folder and renamed into place: another
// process may have made the same one first (then theirs is used).
void publish(fs::path const& work, fs::path const& to) {
  std::error_code e;
  fs::rename(work, to, e);
  if (e) fs::remove_all(work);
}
fs::path work_folder(fs::path const& final) {
  static std::atomic<int> counter{0};
  return fs::path(final.string() + fmt::format(".{}.{}", getpid(), counter++));
}
void compile(std::string const& what, std::string const& arguments, fs::path const& log) {
  std::string const command = fmt::format("'{}' {} {} > '{}' 2>&1", LINA_SIMT_CXX, flags, arguments, log.string());
  // The compiler runs without this process's LD_PRELOAD: preloading
  // AddressSanitizer into it too made a cold run of the simt tests a third slower.
  std::vector<char*> env;
  for (char** e = environ; *e; ++e)
    if (std::string_view(*e).substr(0, 11) != "LD_PRELOAD=") env.push_back(*e);
  env.push_back(nullptr);
  char const* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t child = 0;
  int status = 0;
  if (posix_spawn(&child, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), env.data()) != 0 ||
      waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error(fmt::format("simt: the host compile of {} failed:\n{}", what, read_file(log)));
}

// The cache folder in the build tree (made on first use).
fs::path const& cache() {
  static fs::path const folder = [] {
    fs::path f = LINA_SIMT_CACHE;
    fs::create_directories(f);
    return f;
  }();
  return folder;
}

// What every kernel includes first — this folder's host_cuda.hpp, then
// lina/tiles.cuh as NVRTC gets it — precompiled once per cache folder (most of
// a kernel's compile time was these headers). A kernel's own
// `#include "lina/tiles.cuh"` finds the same file (-I) and is skipped.
struct prelude {
  fs::path folder;
  std::string key;
};
prelude const& the_prelude() {
  static std::string const shim = read_file(LINA_SIMT_SHIM);
  static prelude const p = [&] {
    std::string const key = fmt::format("{}\n{}\n{}\n{}", LINA_SIMT_CXX, flags, shim, cuda::tiles_header());
    fs::path const folder = cache() / fmt::format("prelude-{:016x}", fnv1a(key));
    if (read_file(folder / "key") != key) {
      fs::path const work = work_folder(folder);
      fs::create_directories(work / "lina");
      write_file(work / cuda::tiles_header_name, cuda::tiles_header());
      write_file(work / "prelude.hpp", fmt::format("#include \"{}\"\n#include \"lina/tiles.cuh\"\n", LINA_SIMT_SHIM));
      compile("the prelude (host_cuda.hpp, tiles.cuh)",
              fmt::format("-I'{}' -x c++-header '{}' -o '{}'", work.string(), (work / "prelude.hpp").string(),
                          (work / "prelude.hpp.gch").string()),
              work / "log");
      write_file(work / "key", key);
      publish(work, folder);
    }
    return prelude{folder, key};
  }();
  return p;
}

// One kernel as the runner builds it. Kernels are compiled in units — one
// shared object for one kernel, or for every kernel a prepare run recorded —
// each kernel in a namespace of its own, its launch an extern "C" entry named
// by the hash of its key. The entry's folder in the cache holds the key and a
// link to its unit's shared object.
struct kernel {
  std::string name;    // the kernel's, for messages
  std::string key;     // the prelude's key and the emitted source: what the cache is keyed by
  fs::path folder;     // its folder in the cache
  std::string entry;   // lina_simt_launch_<hash>, the launch in the unit
  std::string source;  // its part of a unit's source
};

// The emitted source in a namespace of its own, and its launch. The kernel
// loses its C linkage there: two kernels of a unit may share a name (the same
// name with other constants) and would otherwise be one C function. Its
// `extern … shared[]` would declare the namespace's own array: the namespace
// declares it first as the shim's (by its symbol, a global variable's name).
kernel kernel_of(cuda::program const& p) {
  std::string emitted = cuda::emit(p);
  std::string const linkage = "extern \"C\" __global__";
  auto const at = emitted.find(linkage);
  if (at == std::string::npos || emitted.find(linkage, at + 1) != std::string::npos)
    throw std::runtime_error("simt: kernel " + p.kernel_name + ": its source should declare one kernel, 'extern \"C\" __global__'");
  std::string key = the_prelude().key + "\n" + emitted;
  std::uint64_t const hash = fnv1a(key);
  emitted.erase(at, linkage.size() - std::string_view("__global__").size());
  std::string const space = fmt::format("lina_simt_{:016x}", hash), entry = fmt::format("lina_simt_launch_{:016x}", hash);
  return kernel{p.kernel_name, std::move(key), cache() / fmt::format("{:016x}", hash), entry,
                fmt::format("namespace {0} {{\nextern unsigned char shared[] __asm__(\"shared\");\n{1}}}  // namespace {0}\n\n"
                            "extern \"C\" __attribute__((visibility(\"default\"))) int {2}(const void* args, long long blocks, "
                            "int threads, long long shared_bytes, char* error, int error_size) {{\n"
                            "  return lina_simt::run(blocks, threads, shared_bytes, [](void* a) {{ {0}::{3}(*static_cast<const "
                            "lina::tile::forward_args*>(a)); }}, const_cast<void*>(args), error, error_size);\n}}\n\n",
                            space, emitted, entry, p.kernel_name)};
}

// Compiles the kernels into one shared object (a unit) and gives each its
// folder in the cache. Most of a kernel's compile time is code for tiles.cuh's
// templates at its constants, which kernels share: one unit of the 190 kernels
// the simt tests launch compiled in 12 s; compiled one by one as the tests first
// launched them, they added 113 s to the tests' 27 s (2026-12-06, this machine).
void build(std::vector<kernel> const& kernels) {
  prelude const& pre = the_prelude();
  std::string source;
  for (kernel const& k : kernels) source += k.source;
  std::string const key = pre.key + "\n" + source;
  fs::path const unit = cache() / fmt::format("unit-{:016x}", fnv1a(key));
  if (read_file(unit / "key") != key) {
    fs::path const work = work_folder(unit);
    fs::create_directories(work);
    write_file(work / "unit.cu", source);
    compile(kernels.size() == 1 ? "kernel " + kernels[0].name : fmt::format("a unit of {} kernels", kernels.size()),
            fmt::format("-shared -include '{}' -I'{}' -x c++ '{}' -o '{}'", (pre.folder / "prelude.hpp").string(),
                        pre.folder.string(), (work / "unit.cu").string(), (work / "unit.so").string()),
            work / "log");
    write_file(work / "key", key);
    publish(work, unit);
  }
  for (kernel const& k : kernels) {
    if (read_file(k.folder / "key") == k.key) continue;
    fs::path const work = work_folder(k.folder);
    fs::create_directories(work);
    fs::create_symlink(fs::path("..") / unit.filename() / "unit.so", work / "kernel.so");
    write_file(work / "key", k.key);
    publish(work, k.folder);
  }
}

std::mutex mutex;  // (the cache, the loaded entries and the recorded kernels)

// The launch of p's kernel: from the cache folder, else compiled into it.
launch_fn load(cuda::program const& p) {
  static std::map<std::string, launch_fn> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  kernel const k = kernel_of(p);
  if (auto it = loaded.find(k.key); it != loaded.end()) return it->second;
  if (read_file(k.folder / "key") != k.key) build({k});
  fs::path const so = k.folder / "kernel.so";
  void* const library = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);  // (a unit's kernels share one handle)
  if (!library) throw std::runtime_error(fmt::format("simt: dlopen {}: {}", so.string(), dlerror()));
  auto const launch = reinterpret_cast<launch_fn>(dlsym(library, k.entry.c_str()));
  if (!launch) throw std::runtime_error(fmt::format("simt: {} has no {}", so.string(), k.entry));
  return loaded[k.key] = launch;
}

// A prepare run (LINA_SIMT_PREPARE set): the kernels not yet in the cache, in
// the order the tests first launch them. The launches do nothing: what the
// tests check in this run is not looked at, and the kernels a launch runs do
// not depend on what earlier ones computed (where a test throws on what it
// got, the kernels it would launch next are compiled when the test runs).
std::vector<kernel> recorded;
std::set<std::string> recorded_keys;

void record(cuda::program const& p) {
  std::lock_guard<std::mutex> lock(mutex);
  kernel k = kernel_of(p);
  if (read_file(k.folder / "key") != k.key && recorded_keys.insert(k.key).second) recorded.push_back(std::move(k));
}

// The prepare run's mark: this test binary (its kernels, tiles.cuh inside it)
// and this prelude had every kernel compiled.
fs::path prepared_mark() {
  return cache() / fmt::format("prepared-{:016x}", fnv1a(read_file("/proc/self/exe") + "\n" + the_prelude().key));
}

}  // namespace

void run(cuda::program const& p, cuda::forward_args const& args, std::int64_t blocks) {
  if (preparing()) return record(p);
  launch_fn const launch = load(p);
  char error[512] = {};
  if (launch(&args, blocks, p.tiles.threads, static_cast<long long>(p.shared_bytes()), error, sizeof error) != 0)
    throw std::runtime_error(fmt::format("simt: kernel {}: {}", p.kernel_name, error));
}

bool preparing() {
  static bool const yes = std::getenv("LINA_SIMT_PREPARE") != nullptr;
  return yes;
}

bool prepared() { return fs::exists(prepared_mark()); }

int compile_recorded() {
  try {
    if (!recorded.empty()) build(recorded);
    write_file(prepared_mark(), "");
  } catch (std::exception const& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  fmt::print("simt: {} kernel(s) compiled in one unit into {}\n", recorded.size(), cache().string());
  return 0;
}

}  // namespace test::simt
