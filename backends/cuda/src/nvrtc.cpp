// NVRTC calls (see nvrtc.hpp). Every failing call becomes an nvrtc_error that
// names the call and the kernel and carries the program log.
#include "lina/cuda/nvrtc.hpp"

#include <fmt/format.h>

#include <atomic>
#include <nvrtc.h>

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <unistd.h>

#include "lina/cuda/emit.hpp"

#ifndef LINA_CUDA_INCLUDE_DIR
#define LINA_CUDA_INCLUDE_DIR "/usr/local/cuda/include"
#endif

namespace lina::cuda {

nvrtc_error::nvrtc_error(std::string call, std::string kernel, std::string status, std::string log)
    : std::runtime_error(fmt::format("lina::cuda: {} failed for kernel {}: {}{}{}", call, kernel, status,
                                     log.empty() ? "" : "\n", log)),
      call_(std::move(call)),
      kernel_(std::move(kernel)),
      log_(std::move(log)) {}

std::string toolkit_include_dir() {
  if (char const* e = std::getenv("LINA_CUDA_INCLUDE_DIR"); e && *e) return e;
  return LINA_CUDA_INCLUDE_DIR;
}

std::string nvrtc_version() {
  int major = 0, minor = 0;
  if (nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) throw nvrtc_error("nvrtcVersion", "-", "failed", "");
  return fmt::format("{}.{}", major, minor);
}

namespace {

struct program_deleter {
  void operator()(nvrtcProgram p) const noexcept { nvrtcDestroyProgram(&p); }
};
using program_handle = std::unique_ptr<std::remove_pointer_t<nvrtcProgram>, program_deleter>;

std::string log_of(nvrtcProgram p) {
  std::size_t size = 0;
  if (nvrtcGetProgramLogSize(p, &size) != NVRTC_SUCCESS || size <= 1) return {};
  std::string log(size, '\0');
  if (nvrtcGetProgramLog(p, log.data()) != NVRTC_SUCCESS) return {};
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  return log;
}

// NVRTC's options for a compile: the architecture, the language, the toolkit's headers, the caller's.
std::vector<std::string> options_for(std::string_view arch, std::vector<std::string> const& extra_options) {
  std::vector<std::string> o = {fmt::format("--gpu-architecture={}", arch), "--std=c++17", "-I" + toolkit_include_dir()};
  o.insert(o.end(), extra_options.begin(), extra_options.end());
  return o;
}

}  // namespace

compiled_kernel compile(std::string_view source, std::string_view kernel_name, std::string_view arch,
                        std::vector<std::string> const& extra_options) {
  std::string const kernel(kernel_name);
  auto check = [&](nvrtcResult r, char const* call, nvrtcProgram p) {
    if (r != NVRTC_SUCCESS) throw nvrtc_error(call, kernel, nvrtcGetErrorString(r), p ? log_of(p) : std::string());
  };
  bool const cubin = arch.starts_with("sm_");
  if (!cubin && !arch.starts_with("compute_"))
    throw nvrtc_error("compile", kernel, fmt::format("unknown architecture {} (use sm_XY or compute_XY)", arch), "");

  std::string const src(source);
  std::string const header(tiles_header());
  char const* headers[] = {header.c_str()};
  std::string const header_name(tiles_header_name);
  char const* header_names[] = {header_name.c_str()};
  nvrtcProgram raw = nullptr;
  std::string const file = kernel + ".cu";
  check(nvrtcCreateProgram(&raw, src.c_str(), file.c_str(), 1, headers, header_names), "nvrtcCreateProgram", nullptr);
  program_handle prog(raw);

  compiled_kernel out;
  out.kernel = kernel;
  out.arch = std::string(arch);
  out.options = options_for(arch, extra_options);
  std::vector<char const*> opts;
  for (auto const& o : out.options) opts.push_back(o.c_str());

  nvrtcResult r = nvrtcCompileProgram(raw, static_cast<int>(opts.size()), opts.data());
  out.log = log_of(raw);
  if (r != NVRTC_SUCCESS) throw nvrtc_error("nvrtcCompileProgram", kernel, nvrtcGetErrorString(r), out.log);

  std::size_t size = 0;
  if (cubin) {
    check(nvrtcGetCUBINSize(raw, &size), "nvrtcGetCUBINSize", raw);
    out.image.resize(size);
    check(nvrtcGetCUBIN(raw, out.image.data()), "nvrtcGetCUBIN", raw);
  } else {
    check(nvrtcGetPTXSize(raw, &size), "nvrtcGetPTXSize", raw);
    out.image.resize(size);
    check(nvrtcGetPTX(raw, out.image.data()), "nvrtcGetPTX", raw);
  }
  return out;
}

std::string cache_directory() {
  if (char const* e = std::getenv("LINA_CUDA_CACHE"); e && *e) return std::string(e) == "off" ? std::string() : e;
  if (char const* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/lina";
  if (char const* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/lina";
  return {};
}

namespace {
std::atomic<int> cache_hits{0}, cache_compiled{0}, cache_embedded{0};

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The embedded kernels: registered during static initialisation (of any
// translation unit, so a function-local registry), read under the same lock.
struct embedded_registry {
  std::mutex lock;
  std::vector<embedded_kernel const*> kernels;
};
embedded_registry& embedded() {
  static embedded_registry r;
  return r;
}

std::optional<compiled_kernel> find_embedded(std::string_view source, std::string_view kernel_name, std::string_view arch) {
  embedded_registry& r = embedded();
  std::lock_guard<std::mutex> guard(r.lock);
  if (r.kernels.empty()) return std::nullopt;
  unsigned long long const tiles = tiles_header_hash();
  for (embedded_kernel const* e : r.kernels)
    if (e->tiles_hash == tiles && kernel_name == e->kernel && arch == e->arch && source == e->source) {
      compiled_kernel out;
      out.kernel = std::string(kernel_name);
      out.arch = std::string(arch);
      out.options = options_for(arch, {});
      out.log = e->log;
      out.image.assign(e->image, e->image + e->image_size);
      out.embedded = true;
      return out;
    }
  return std::nullopt;
}
}  // namespace

cache_counts cache_statistics() { return {cache_hits.load(), cache_compiled.load(), cache_embedded.load()}; }

unsigned long long tiles_header_hash() {
  static unsigned long long const h = fnv1a(tiles_header());
  return h;
}

std::size_t register_embedded_kernels(embedded_kernel const* kernels, std::size_t n) {
  embedded_registry& r = embedded();
  std::lock_guard<std::mutex> guard(r.lock);
  for (std::size_t i = 0; i < n; ++i) r.kernels.push_back(kernels + i);
  return n;
}

std::size_t embedded_kernel_count() {
  embedded_registry& r = embedded();
  std::lock_guard<std::mutex> guard(r.lock);
  return r.kernels.size();
}

compiled_kernel compile_cached(std::string_view source, std::string_view kernel_name, std::string_view arch,
                               std::vector<std::string> const& extra_options) {
  return compile_cached_in(cache_directory(), source, kernel_name, arch, extra_options);
}

compiled_kernel compile_cached_in(std::string const& dir, std::string_view source, std::string_view kernel_name,
                                  std::string_view arch, std::vector<std::string> const& extra_options) {
  if (extra_options.empty())
    if (std::optional<compiled_kernel> e = find_embedded(source, kernel_name, arch)) {
      ++cache_embedded;
      return std::move(*e);
    }
  if (dir.empty()) {
    ++cache_compiled;
    return compile(source, kernel_name, arch, extra_options);
  }
  // The key: everything that changes the image.
  std::string key = fmt::format("lina-kernel-cache 2\nnvrtc {}\narch {}\ninclude {}\n", nvrtc_version(), arch,
                                toolkit_include_dir());
  for (auto const& o : extra_options) key += "option " + o + "\n";
  key += fmt::format("header {}\n", tiles_header().size());
  key += tiles_header();
  key += fmt::format("\nsource {}\n", source.size());
  key += source;
  namespace fs = std::filesystem;
  fs::path const file = fs::path(dir) / fmt::format("{}-{}-{:016x}.bin", kernel_name, arch, fnv1a(key));
  // After the key: "log <bytes>\n", NVRTC's log (a kernel read back says what
  // its compile said: a warning is not lost on the second run), the image.
  {
    std::ifstream in(file, std::ios::binary);
    if (in) {
      std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      // "log <bytes>\n" read by hand: the log itself may start with white space.
      std::size_t const eol = data.find('\n', key.size());
      std::size_t log_size = 0;
      if (data.size() > key.size() && data.compare(0, key.size(), key) == 0 && eol != std::string::npos &&
          eol > key.size() + 4 && data.compare(key.size(), 4, "log ") == 0 &&
          std::from_chars(data.data() + key.size() + 4, data.data() + eol, log_size).ptr == data.data() + eol &&
          data.size() - (eol + 1) > log_size) {
        auto const log = data.begin() + static_cast<std::ptrdiff_t>(eol + 1);
        compiled_kernel out;
        out.kernel = std::string(kernel_name);
        out.arch = std::string(arch);
        out.options = options_for(arch, extra_options);
        out.log.assign(log, log + static_cast<std::ptrdiff_t>(log_size));
        out.image.assign(log + static_cast<std::ptrdiff_t>(log_size), data.end());
        out.from_cache = true;
        ++cache_hits;
        return out;
      }
    }
  }
  compiled_kernel out = compile(source, kernel_name, arch, extra_options);
  ++cache_compiled;
  std::error_code ec;
  fs::create_directories(dir, ec);
  // A name of this process and call alone: processes sharing the folder (the
  // tests, run two at a time) never write one temporary file.
  static std::atomic<unsigned> calls{0};
  fs::path const tmp = file.string() + fmt::format(".{}.{}.tmp", static_cast<long>(::getpid()), calls++);
  {
    std::ofstream f(tmp, std::ios::binary);
    std::string const log = fmt::format("log {}\n", out.log.size()) + out.log;
    f.write(key.data(), static_cast<std::streamsize>(key.size()));
    f.write(log.data(), static_cast<std::streamsize>(log.size()));
    f.write(out.image.data(), static_cast<std::streamsize>(out.image.size()));
    if (!f) {
      f.close();
      fs::remove(tmp, ec);
      return out;
    }
  }
  fs::rename(tmp, file, ec);  // atomic: a concurrent reader sees the old file or the new one
  if (ec) fs::remove(tmp, ec);
  return out;
}

}  // namespace lina::cuda
