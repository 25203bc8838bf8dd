// Run-time compilation of generated kernels with NVRTC (the CUDA Toolkit's
// libnvrtc). NVRTC needs no GPU and no driver, so every generated kernel can
// be compiled, for every target architecture, on any machine with the toolkit.
#pragma once

#include <cstddef>
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
  bool embedded = false;        // linked into the program ahead of time (below; compile_cached)
};

// Compile a generated kernel source for one architecture: "sm_80", "sm_90"
// give a cubin (ptxas runs too), "compute_80", "compute_90" give PTX. The
// tile header is supplied from memory; toolkit headers are found under
// toolkit_include_dir(). Throws nvrtc_error when NVRTC fails.
compiled_kernel compile(std::string_view source, std::string_view kernel_name, std::string_view arch,
                        std::vector<std::string> const& extra_options = {});

// compile(), from the kernels embedded in the program (below) where one has
// this source, architecture and tile header (and no extra options), else
// through an on-disk cache of images keyed by the source, the tile
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
  int embedded = 0;  // found among the embedded kernels
};
cache_counts cache_statistics();

// Kernels compiled ahead of time and linked into the program: the source file
// that lina_cuda_embed_kernels (CMake; lina/cuda/embed.hpp) generates defines an
// array of these and registers it during static initialisation, so that a
// launch finds its kernel without NVRTC. An entry matches a compile_cached call
// whose source, kernel name and architecture equal its own, compiled against
// the same tile header (tiles_hash: tiles_header_hash()). The array must
// outlive every call (static data). Returns the number registered (n).
struct embedded_kernel {
  char const* kernel;
  char const* arch;
  char const* source;
  unsigned long long tiles_hash;
  char const* image;
  std::size_t image_size;
  char const* log;  // NVRTC's log of the compile (empty: clean)
};
std::size_t register_embedded_kernels(embedded_kernel const* kernels, std::size_t n);
std::size_t embedded_kernel_count();  // registered so far
unsigned long long tiles_header_hash();  // of the tile header this library gives NVRTC

// The folder of the toolkit's headers NVRTC is pointed at (-I): the environment's
// LINA_CUDA_INCLUDE_DIR when set, else the one this library was built against.
std::string toolkit_include_dir();

// NVRTC's version, e.g. "13.0".
std::string nvrtc_version();

}  // namespace lina::cuda
