// The CPU backend: lina::cpu::evaluate(plan_or_expression, Q = q, ...).
#pragma once

#include "lina/cpu/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/kernels.hpp"
#include "lina/cpu/matrix.hpp"
