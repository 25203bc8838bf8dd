#include "runner.hpp"

#include <dlfcn.h>
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

// The shared object of p's kernel: from the cache folder, else compiled into it.
launch_fn load(cuda::program const& p) {
  static std::mutex mutex;
  static std::map<std::string, launch_fn> loaded;
  std::string const source = cuda::emit(p) + entry_for(p.kernel_name);
  static std::string const shim = read_file(LINA_SIMT_SHIM);
  std::string const flags = "-std=c++20 -O1 -fPIC -shared -fvisibility=hidden -ffp-contract=off -march=native -w";
  std::string const key =
      fmt::format("{}\n{}\n{}\n{}\n{}", LINA_SIMT_CXX, flags, shim, cuda::tiles_header(), source);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded.find(key); it != loaded.end()) return it->second;

  fs::path const folder = LINA_SIMT_CACHE;
  fs::create_directories(folder);
  fs::path const so = folder / fmt::format("{:016x}.so", fnv1a(key));
  fs::path const keyfile = folder / fmt::format("{:016x}.key", fnv1a(key));
  if (!fs::exists(so) || read_file(keyfile) != key) {
    static std::atomic<int> counter{0};
    fs::path const work = folder / fmt::format("{:016x}.{}.{}", fnv1a(key), getpid(), counter++);
    fs::create_directories(work / "lina");
    write_file(work / cuda::tiles_header_name, cuda::tiles_header());
    write_file(work / "kernel.cu", source);
    std::string const command =
        fmt::format("'{}' {} -include '{}' -I'{}' -x c++ '{}' -o '{}' > '{}' 2>&1", LINA_SIMT_CXX, flags, LINA_SIMT_SHIM,
                    work.string(), (work / "kernel.cu").string(), (work / "kernel.so").string(), (work / "log").string());
    if (std::system(command.c_str()) != 0) {
      std::string const log = read_file(work / "log");
      throw std::runtime_error(fmt::format("simt: the host compile of kernel {} failed ({}):\n{}", p.kernel_name,
                                           (work / "kernel.cu").string(), log));
    }
    write_file(work / "key", key);
    fs::rename(work / "key", keyfile);  // (two processes may both compile it: either copy is the same)
    fs::rename(work / "kernel.so", so);
    fs::remove_all(work);
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
