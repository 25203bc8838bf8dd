// The CPU backend: lina::cpu::evaluate(plan_or_expression, Q = q, ...) and
// lina::cpu::gradient(plan, dout, Q = q, ...).
#pragma once

#include "lina/cpu/cost_model.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/gradient.hpp"
#include "lina/cpu/kernels.hpp"
#include "lina/cpu/matrix.hpp"
#include "lina/cpu/packed.hpp"
#include "lina/cpu/path.hpp"
#include "lina/cpu/recurrent.hpp"
#include "lina/cpu/state.hpp"
#include "lina/cpu/tape.hpp"
