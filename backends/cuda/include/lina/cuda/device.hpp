// Running generated kernels on a GPU, through the CUDA runtime API: the cubin
// from NVRTC is loaded with cudaLibraryLoadData and launched with
// cudaLaunchKernel, so nothing links the driver library directly and the same
// binary runs — and reports "no device" — on machines without a GPU.
//
// Not exercised in CI (no GPU there): the device tests compare a launch with
// the host emulation where a device exists and report themselves skipped
// elsewhere.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "lina/cuda/program.hpp"

namespace lina::cuda {

// A CUDA runtime call failed, or a call needs a device and there is none:
// names the call (a runtime function, or lina's, e.g. "cuda::to_device") and
// the kernel (or "-" when none is involved).
class cuda_error : public std::runtime_error {
 public:
  cuda_error(std::string call, std::string kernel, std::string status);
  std::string const& call() const noexcept { return call_; }
  std::string const& kernel() const noexcept { return kernel_; }

 private:
  std::string call_, kernel_;
};

struct device_status {
  bool available = false;
  int count = 0;
  int device = -1;          // the current device
  std::string arch;         // its architecture, e.g. "sm_90"
  int sms = 0;              // its streaming multiprocessors
  std::string reason;       // why none is available (the runtime's error)
};
// Never throws: no driver or no device is a status, not an error.
device_status probe_device();

// The current device's status, or cuda_error(call, "-", "no CUDA device (…)")
// when there is none (or "device … is sm_75; …" when it is too old).
device_status require_device(std::string const& call);

// Launch p with these arguments (device pointers) on `stream` (a cudaStream_t;
// nullptr is the default stream). Compiles the kernel with NVRTC for the
// current device's architecture the first time (kept in memory per source and
// architecture), checks that every pointer is device memory, that a chained
// program's state in and out do not overlap and that the shared memory fits,
// all before the launch; throws cuda_error or std::invalid_argument, writing
// nothing, otherwise. Nothing is launched for no blocks, nor for n = 0 unless
// the program is chained (then the kernel copies state_in to state_out).
void launch(program const& p, forward_args const& args, void* stream = nullptr);

// The chunk-parallel form of a linear forward (split_programs_of): the
// partials launch, then the scan, on `stream`, over groups of `group_rows`
// rows (split_rows), the groups' sums in stream-ordered scratch memory
// (cudaMallocAsync, freed on the stream: nothing waits). args.extra[0] and
// args.group_rows are set here. Checks as launch() does.
void launch_split(split_programs const& sp, forward_args args, std::int64_t group_rows, void* stream = nullptr);

// A program's kernel compiled (NVRTC, through the on-disk cache) and loaded
// once for the current device, then launched any number of times with nothing
// on the host but launch()'s checks and the launch: no source emitted, no
// lookup, no allocation (cuda::recurrent's decode steps). Needs a device:
// cuda_error naming cuda::prepared_kernel otherwise; std::invalid_argument
// when the program's shared memory exceeds what the device allows.
class prepared_kernel {
 public:
  explicit prepared_kernel(program p);
  program const& prog() const noexcept { return p_; }
  // What launch(p, args, stream) checks and does, with the kernel at hand.
  void launch(forward_args const& args, void* stream = nullptr) const;

 private:
  program p_;
  void const* kernel_ = nullptr;  // cudaKernel_t
  int device_ = -1;
};

// Device memory: a buffer of bytes (what cuda::tensor and cuda::state hold).
class device_buffer {
 public:
  device_buffer() = default;
  // Allocates (cudaMalloc) when bytes > 0, after require_device(call).
  explicit device_buffer(std::size_t bytes, std::string const& call = "cudaMalloc");
  // Stream-ordered (cudaMallocAsync on `stream`, freed there by cudaFreeAsync):
  // scratch for launches queued on that stream, released after them without
  // the host waiting.
  device_buffer(std::size_t bytes, void* stream, std::string const& call);
  device_buffer(device_buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), stream_(o.stream_), ordered_(o.ordered_) {
    o.ptr_ = nullptr, o.bytes_ = 0;
  }
  device_buffer& operator=(device_buffer&& o) noexcept;
  device_buffer(device_buffer const&) = delete;
  device_buffer& operator=(device_buffer const&) = delete;
  ~device_buffer();
  void* get() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  void upload(void const* host, std::size_t bytes);
  void download(void* host, std::size_t bytes) const;

 private:
  void release() noexcept;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  void* stream_ = nullptr;  // stream-ordered buffers: where they are freed
  bool ordered_ = false;
};

// Wait for the device and report any asynchronous launch error.
void synchronize(std::string const& kernel = "-");

// Copies and fills on `stream` (a cudaStream_t; nullptr is the default
// stream), asynchronous with respect to the host; errors name `call`.
void copy_to_device(void* device, void const* host, std::size_t bytes, void* stream, std::string const& call);
void copy_to_host(void* host, void const* device, std::size_t bytes, void* stream, std::string const& call);
void copy_on_device(void* to, void const* from, std::size_t bytes, void* stream, std::string const& call);
void fill_zero(void* device, std::size_t bytes, void* stream, std::string const& call);
// `rows` runs of `width` bytes, `pitch` bytes apart, set to zero (cudaMemset2DAsync).
void fill_zero_rows(void* device, std::size_t pitch, std::size_t width, std::size_t rows, void* stream,
                    std::string const& call);
// Wait for everything queued on `stream`.
void synchronize_stream(void* stream, std::string const& call);

}  // namespace lina::cuda
