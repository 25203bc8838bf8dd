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

// The entry point appended to each kernel's source: the launch, by name.
std::string entry_for(std::string const& kernel) {
  return fmt::format(
      "\nextern \"C\" __attribute__((visibility(\"default\"))) int lina_simt_launch(const void* args, long long blocks, "
      "int threads, long long shared_bytes, char* error, int error_size) {{\n"
      "  return lina_simt::run(blocks, threads, shared_bytes, [](void* a) {{ {}(*static_cast<const "
      "lina::tile::forward_args*>(a)); }}, const_cast<void*>(args), error, error_size);\n}}\n",
      kernel);
}

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

// What every kernel includes first — this folder's host_cuda.hpp, then
// lina/tiles.cuh as NVRTC gets it — precompiled once per cache folder (most of
// a kernel's compile time was these headers). A kernel's own
// `#include "lina/tiles.cuh"` finds the same file (-I) and is skipped.
struct prelude {
  fs::path folder;
  std::string key;
};
prelude const& prelude_in(fs::path const& cache) {
  static std::string const shim = read_file(LINA_SIMT_SHIM);
  static prelude const p = [&] {
    std::string const key = fmt::format("{}\n{}\n{}\n{}", LINA_SIMT_CXX, flags, shim, cuda::tiles_header());
    fs::path const folder = cache / fmt::format("prelude-{:016x}", fnv1a(key));
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

// The shared object of p's kernel: from the cache folder, else compiled into it.
launch_fn load(cuda::program const& p) {
  static std::mutex mutex;
  static std::map<std::string, launch_fn> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  fs::path const cache = LINA_SIMT_CACHE;
  fs::create_directories(cache);
  prelude const& pre = prelude_in(cache);
  std::string const source = cuda::emit(p) + entry_for(p.kernel_name);
  std::string const key = pre.key + "\n" + source;
  if (auto it = loaded.find(key); it != loaded.end()) return it->second;

  fs::path const folder = cache / fmt::format("{:016x}", fnv1a(key)), so = folder / "kernel.so";
  if (read_file(folder / "key") != key) {
    fs::path const work = work_folder(folder);
    fs::create_directories(work);
    write_file(work / "kernel.cu", source);
    compile("kernel " + p.kernel_name,
            fmt::format("-shared -include '{}' -I'{}' -x c++ '{}' -o '{}'", (pre.folder / "prelude.hpp").string(),
                        pre.folder.string(), (work / "kernel.cu").string(), (work / "kernel.so").string()),
            work / "log");
    write_file(work / "key", key);
    publish(work, folder);
  }
  void* const library = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) throw std::runtime_error(fmt::format("simt: dlopen {}: {}", so.string(), dlerror()));
  auto const launch = reinterpret_cast<launch_fn>(dlsym(library, "lina_simt_launch"));
  if (!launch) throw std::runtime_error(fmt::format("simt: {} has no lina_simt_launch", so.string()));
  return loaded[key] = launch;
}

}  // namespace

void run(cuda::program const& p, cuda::forward_args const& args, std::int64_t blocks) {
  launch_fn const launch = load(p);
  char error[512] = {};
  if (launch(&args, blocks, p.tiles.threads, static_cast<long long>(p.shared_bytes()), error, sizeof error) != 0)
    throw std::runtime_error(fmt::format("simt: kernel {}: {}", p.kernel_name, error));
}

}  // namespace test::simt
