// lina: linear attention as C++ expressions, reordered at compile time.
// This header is the whole DSL; backends are separate (lina/cpu.hpp).
#pragma once

#include "lina/compile.hpp"
#include "lina/cost.hpp"
#include "lina/dims.hpp"
#include "lina/errors.hpp"
#include "lina/expr.hpp"
#include "lina/feature_maps.hpp"
#include "lina/format.hpp"
#include "lina/gradient.hpp"
#include "lina/node.hpp"
#include "lina/random_features.hpp"
#include "lina/rewrite.hpp"
#include "lina/saved.hpp"
#include "lina/tensor.hpp"
