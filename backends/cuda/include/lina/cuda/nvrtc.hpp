// Run-time compilation of generated kernels with NVRTC (the CUDA Toolkit's
// libnvrtc). NVRTC needs no GPU and no driver, so every generated kernel can
// be compiled, for every target architecture, on any machine with the toolkit.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lina::cuda {

// An NVRTC call failed: names the call and the kernel, and carries the log.
class nvrtc_error : public std::runtime_error {
 public:
  nvrtc_error(std::string call, std::string kernel, std::string status, std::string log);
  std::string const& call() const noexcept { return call_; }
  std::string const& kernel() const noexcept { return kernel_; }
  std::string const& log() const noexcept { return log_; }

 private:
  std::string call_, kernel_, log_;
};

struct compiled_kernel {
  std::string kernel;           // the kernel's name
  std::string arch;             // "sm_90" (a cubin) or "compute_90" (PTX)
  std::vector<char> image;      // the cubin, or the PTX text (with its terminating 0)
  std::string log;              // NVRTC's log; empty for a clean compile
  std::vector<std::string> options;
  bool from_cache = false;      // read from the on-disk cache (compile_cached)
};

// Compile a generated kernel source for one architecture: "sm_80", "sm_90"
// give a cubin (ptxas runs too), "compute_80", "compute_90" give PTX. The
// tile header is supplied from memory; toolkit headers are found under
// toolkit_include_dir(). Throws nvrtc_error when NVRTC fails.
compiled_kernel compile(std::string_view source, std::string_view kernel_name, std::string_view arch,
                        std::vector<std::string> const& extra_options = {});

// compile(), through an on-disk cache of images keyed by the source, the tile
// header, the options, the architecture and NVRTC's version (a 64-bit hash in
// the file name, the full key checked inside the file). The folder is
// $LINA_CUDA_CACHE, else $XDG_CACHE_HOME/lina, else ~/.cache/lina;
// LINA_CUDA_CACHE=off turns the cache off. A cache that cannot be written is
// not an error: the kernel is compiled every time. A kernel read back carries
// the log its compile wrote.
compiled_kernel compile_cached(std::string_view source, std::string_view kernel_name, std::string_view arch,
                               std::vector<std::string> const& extra_options = {});
// The same with the folder given ("": no cache), whatever the environment says.
compiled_kernel compile_cached_in(std::string const& directory, std::string_view source, std::string_view kernel_name,
                                  std::string_view arch, std::vector<std::string> const& extra_options = {});
std::string cache_directory();  // "" when off

// compile_cached's calls in this process so far: read from the cache, or
// compiled (thread-safe). A benchmark prints it to show where its first
// launches' time went.
struct cache_counts {
  int hits = 0, compiled = 0;
};
cache_counts cache_statistics();

// The folder of the toolkit's headers NVRTC is pointed at (-I): the environment's
// LINA_CUDA_INCLUDE_DIR when set, else the one this library was built against.
std::string toolkit_include_dir();

// NVRTC's version, e.g. "13.0".
std::string nvrtc_version();

}  // namespace lina::cuda
