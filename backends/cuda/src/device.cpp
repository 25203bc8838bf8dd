// Launching generated kernels through the CUDA runtime (see device.hpp).
#include "lina/cuda/device.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "lina/cuda/emit.hpp"
#include "lina/cuda/nvrtc.hpp"

namespace lina::cuda {

static_assert(sizeof(operand) == 48 && sizeof(forward_args) == 19 * 48 + 48,
              "forward_args must keep the layout of lina::tile::forward_args (tiles.cuh)");

cuda_error::cuda_error(std::string call, std::string kernel, std::string status)
    : std::runtime_error(kernel.empty() || kernel == "-"
                             ? fmt::format("lina::cuda: {} failed: {}", call, status)
                             : fmt::format("lina::cuda: {} failed for kernel {}: {}", call, kernel, status)),
      call_(std::move(call)),
      kernel_(std::move(kernel)) {}

namespace {

void check(cudaError_t e, std::string const& call, std::string const& kernel) {
  if (e != cudaSuccess) throw cuda_error(call, kernel, fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e)));
}

struct loaded {
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
};

// Kernels loaded so far, per (device, architecture, kernel name): the programs
// loaded under that name, each with its kernel; never unloaded. A name is
// unique per specialisation, and a program changed after it was named is told
// apart by comparing the whole program, so a launch finds its kernel without
// emitting its source again (30–50 µs a launch on the 2-core development
// machine, 2026-12-04: about what a small kernel runs).
std::mutex cache_mutex;
std::map<std::tuple<int, std::string, std::string>, std::vector<std::pair<program, loaded>>>& cache() {
  static std::map<std::tuple<int, std::string, std::string>, std::vector<std::pair<program, loaded>>> c;
  return c;
}

void check_device_pointer(void const* p, char const* what, std::string const& kernel) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it
    throw std::invalid_argument(fmt::format("lina::cuda: {} of kernel {} is not a device pointer ({})", what, kernel,
                                            cudaGetErrorName(e)));
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    throw std::invalid_argument(
        fmt::format("lina::cuda: {} of kernel {} points to host memory; pass device memory", what, kernel));
}

}  // namespace

device_status probe_device() {
  device_status s;
  cudaError_t e = cudaGetDeviceCount(&s.count);
  if (e != cudaSuccess) {
    s.reason = fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
    cudaGetLastError();
    s.count = 0;
    return s;
  }
  if (s.count == 0) {
    s.reason = "no CUDA device";
    return s;
  }
  int major = 0, minor = 0;
  if (cudaGetDevice(&s.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, s.device) != cudaSuccess) {
    s.reason = "cannot query the current device";
    cudaGetLastError();
    return s;
  }
  s.arch = fmt::format("sm_{}{}", major, minor);
  if (cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, s.device) != cudaSuccess) {
    s.sms = 0;
    cudaGetLastError();
  }
  s.available = major >= 8;
  if (!s.available) s.reason = fmt::format("device {} is {}; the kernels need sm_80 or newer", s.device, s.arch);
  return s;
}

namespace {
std::string unavailable(device_status const& s) {
  return s.count == 0 ? fmt::format("no CUDA device ({})", s.reason) : s.reason;
}
}  // namespace

device_status require_device(std::string const& call) {
  device_status dev = probe_device();
  if (!dev.available) throw cuda_error(call, "-", unavailable(dev));
  return dev;
}

namespace {
// launch()'s checks before anything runs: false when there is nothing to launch.
bool check_launch(program const& p, forward_args const& args, std::int64_t& blocks) {
  std::string const& name = p.kernel_name;
  check_heads(p, args);
  blocks = blocks_of(p, args);
  if (blocks > 0x7fffffff) throw std::invalid_argument(fmt::format("lina::cuda: {} blocks is too many for kernel {}", blocks, name));
  if (blocks == 0 || (args.n == 0 && !p.spec.chained)) return false;
  if (args.n > 0) {  // (K and V, ∂K and ∂V hold no rows when a cross-attention has no keys)
    bool const keys = keys_of(args) > 0;
    for (std::size_t s = 0; s < p.inputs.size(); ++s)
      if (keys || (p.inputs[s].role != "k" && p.inputs[s].role != "v"))
        check_device_pointer(args.in[s].data, ("input " + p.inputs[s].name).c_str(), name);
    check_device_pointer(args.out.data, "the output", name);
    for (std::size_t e = 0; e < p.extras.size(); ++e)
      if (keys || !p.extras[e].keys) check_device_pointer(args.extra[e].data, ("buffer " + p.extras[e].name).c_str(), name);
  }
  if ((p.spec.causal || p.spec.mask_scores) && keys_of(args) != args.n)
    throw std::invalid_argument(fmt::format("lina::cuda: kernel {} is causal: K and V need as many rows as Q", name));
  if (args.row_offsets) {  // packed sequences: offsets the caller checked (cuda.hpp), in device memory
    if (!packable(p) || args.n_keys >= 0)
      throw std::invalid_argument(fmt::format("lina::cuda: kernel {} cannot run packed sequences in one launch", name));
    check_device_pointer(args.row_offsets, "the row offsets", name);
  }
  if (p.spec.chained) {
    check_device_pointer(args.state_in.data, "the state in", name);
    check_device_pointer(args.state_out.data, "the state out", name);
    if (overlap(args.state_in, args.state_out, args.batch, args.heads,
                static_cast<std::int64_t>(features(p.spec.map_q, p.spec.d, p.spec.f))))
      throw std::invalid_argument(fmt::format("lina::cuda: the state in and the state out of kernel {} overlap", name));
  }
  return true;
}

// The kernel of p on this device: compiled, loaded and given its shared memory
// the first time (kept per device, architecture and source; never unloaded).
loaded load_kernel(program const& p, device_status const& dev) {
  std::string const& name = p.kernel_name;
  std::size_t const smem = p.shared_bytes();
  int optin = 0;
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev.device), "cudaDeviceGetAttribute", name);
  if (smem > static_cast<std::size_t>(optin))
    throw std::invalid_argument(fmt::format("lina::cuda: kernel {} needs {} bytes of shared memory; device {} allows {}",
                                            name, smem, dev.device, optin));
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto& named = cache()[std::make_tuple(dev.device, dev.arch, name)];
  for (auto const& [q, k] : named)
    if (q == p) return k;
  loaded k;
  compiled_kernel c = compile_cached(emit(p), name, dev.arch);
  check(cudaLibraryLoadData(&k.library, c.image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
        "cudaLibraryLoadData", name);
  check(cudaLibraryGetKernel(&k.kernel, k.library, name.c_str()), "cudaLibraryGetKernel", name);
  check(cudaKernelSetAttributeForDevice(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem),
                                        dev.device),
        "cudaKernelSetAttributeForDevice", name);
  named.emplace_back(p, k);
  return k;
}

void launch_loaded(cudaKernel_t kernel, program const& p, forward_args const& args, std::int64_t blocks, void* stream) {
  forward_args a = args;
  void* params[] = {&a};
  check(cudaLaunchKernel(reinterpret_cast<void const*>(kernel), dim3(static_cast<unsigned>(blocks)),
                         dim3(static_cast<unsigned>(p.tiles.threads)), params, p.shared_bytes(),
                         static_cast<cudaStream_t>(stream)),
        "cudaLaunchKernel", p.kernel_name);
}
}  // namespace

void launch(program const& p, forward_args const& args, void* stream) {
  device_status dev = probe_device();
  if (!dev.available) throw cuda_error("launch", p.kernel_name, unavailable(dev));
  std::int64_t blocks = 0;
  if (!check_launch(p, args, blocks)) return;
  launch_loaded(load_kernel(p, dev).kernel, p, args, blocks, stream);
}

void launch_split(split_programs const& sp, forward_args args, std::int64_t group_rows, void* stream) {
  std::string const& name = sp.scan.kernel_name;
  device_status dev = probe_device();
  if (!dev.available) throw cuda_error("launch", name, unavailable(dev));
  if (group_rows <= 0 || group_rows % sp.scan.tiles.chunk != 0)
    throw std::invalid_argument(fmt::format("lina::cuda: kernel {} needs rows per group that are a positive multiple of {}",
                                            name, sp.scan.tiles.chunk));
  args.group_rows = group_rows;
  std::int64_t const groups = groups_of(sp.partials, args);  // (non-causal: of K's rows)
  std::int64_t const c = static_cast<std::int64_t>(features(sp.scan.spec.map_q, sp.scan.spec.d, sp.scan.spec.f));
  std::int64_t const w = static_cast<std::int64_t>(sp.scan.spec.m) + (sp.scan.spec.normalized ? 1 : 0);
  std::size_t const bytes = static_cast<std::size_t>(args.batch * args.heads * groups * c * w) * sizeof(float);
  if (bytes == 0) return;
  cudaStream_t const s = static_cast<cudaStream_t>(stream);
  void* partials = nullptr;
  check(cudaMallocAsync(&partials, bytes, s), "cudaMallocAsync", name);
  operand& o = args.extra[0];
  o.data = partials;
  o.stride[3] = 1, o.stride[2] = w, o.stride[1] = groups * c * w, o.stride[0] = args.heads * groups * c * w;
  o.cols = w;
  try {
    std::int64_t blocks = 0;
    if (check_launch(sp.partials, args, blocks)) launch_loaded(load_kernel(sp.partials, dev).kernel, sp.partials, args, blocks, stream);
    if (check_launch(sp.scan, args, blocks)) launch_loaded(load_kernel(sp.scan, dev).kernel, sp.scan, args, blocks, stream);
  } catch (...) {
    cudaFreeAsync(partials, s);
    throw;
  }
  check(cudaFreeAsync(partials, s), "cudaFreeAsync", name);
}

prepared_kernel::prepared_kernel(program p) : p_(std::move(p)) {
  device_status dev = require_device("cuda::prepared_kernel");
  kernel_ = reinterpret_cast<void const*>(load_kernel(p_, dev).kernel);
  device_ = dev.device;
}

void prepared_kernel::launch(forward_args const& args, void* stream) const {
  int current = -1;
  check(cudaGetDevice(&current), "cudaGetDevice", p_.kernel_name);
  if (current != device_)
    throw std::invalid_argument(fmt::format("lina::cuda: kernel {} was prepared for device {}; the current device is {}",
                                            p_.kernel_name, device_, current));
  std::int64_t blocks = 0;
  if (!check_launch(p_, args, blocks)) return;
  launch_loaded(reinterpret_cast<cudaKernel_t>(const_cast<void*>(kernel_)), p_, args, blocks, stream);
}

device_buffer::device_buffer(std::size_t bytes, std::string const& call) : bytes_(bytes) {
  if (bytes) {
    require_device(call);
    check(cudaMalloc(&ptr_, bytes), call == "cudaMalloc" ? call : "cudaMalloc in " + call, "-");
  }
}
device_buffer::device_buffer(std::size_t bytes, void* stream, std::string const& call)
    : bytes_(bytes), stream_(stream), ordered_(true) {
  if (bytes) {
    require_device(call);
    check(cudaMallocAsync(&ptr_, bytes, static_cast<cudaStream_t>(stream)), "cudaMallocAsync in " + call, "-");
  }
}
void device_buffer::release() noexcept {
  if (!ptr_) return;
  if (ordered_)
    cudaFreeAsync(ptr_, static_cast<cudaStream_t>(stream_));
  else
    cudaFree(ptr_);
  ptr_ = nullptr;
}
device_buffer& device_buffer::operator=(device_buffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = o.ptr_, bytes_ = o.bytes_, stream_ = o.stream_, ordered_ = o.ordered_;
    o.ptr_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}
device_buffer::~device_buffer() { release(); }
void device_buffer::upload(void const* host, std::size_t bytes) {
  if (bytes > bytes_) throw std::invalid_argument("lina::cuda::device_buffer::upload: more bytes than the buffer holds");
  if (bytes) check(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (to device)", "-");
}
void device_buffer::download(void* host, std::size_t bytes) const {
  if (bytes > bytes_) throw std::invalid_argument("lina::cuda::device_buffer::download: more bytes than the buffer holds");
  if (bytes) check(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (to host)", "-");
}

void synchronize(std::string const& kernel) { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kernel); }

namespace {
void copy(void* to, void const* from, std::size_t bytes, cudaMemcpyKind kind, void* stream, std::string const& call) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(to, from, bytes, kind, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync in " + call, "-");
}
}  // namespace

void copy_to_device(void* device, void const* host, std::size_t bytes, void* stream, std::string const& call) {
  copy(device, host, bytes, cudaMemcpyHostToDevice, stream, call);
}
void copy_to_host(void* host, void const* device, std::size_t bytes, void* stream, std::string const& call) {
  copy(host, device, bytes, cudaMemcpyDeviceToHost, stream, call);
}
void copy_on_device(void* to, void const* from, std::size_t bytes, void* stream, std::string const& call) {
  copy(to, from, bytes, cudaMemcpyDeviceToDevice, stream, call);
}
void fill_zero(void* device, std::size_t bytes, void* stream, std::string const& call) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(device, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync in " + call, "-");
}
void fill_zero_rows(void* device, std::size_t pitch, std::size_t width, std::size_t rows, void* stream,
                    std::string const& call) {
  if (width == 0 || rows == 0) return;
  check(cudaMemset2DAsync(device, pitch, 0, width, rows, static_cast<cudaStream_t>(stream)), "cudaMemset2DAsync in " + call,
        "-");
}
void synchronize_stream(void* stream, std::string const& call) {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize in " + call, "-");
}

}  // namespace lina::cuda
