// The emitter: a tile program → one specialised CUDA C++ kernel source.
// Extents, tile sizes, dtypes, the feature maps and eps are baked in as
// constants; the source includes "lina/tiles.cuh" (tiles_header()), the
// device half of the tile vocabulary.
#pragma once

#include <string>
#include <string_view>

#include "lina/cuda/program.hpp"

namespace lina::cuda {

// The kernel source of p: `extern "C" __global__ void <p.kernel_name>(lina::tile::forward_args)`,
// launched with blocks_of(p, args) blocks of p.tiles.threads threads and
// p.shared_bytes() bytes of dynamic shared memory.
std::string emit(program const& p);

// The device tile header, embedded in the library, and the name kernels include it by.
std::string_view tiles_header();
inline constexpr std::string_view tiles_header_name = "lina/tiles.cuh";

}  // namespace lina::cuda
