// `ksctl tune`: every variant of the ops that have more than one, timed at a grid of shapes
// on the present backends (tools/check.cpp measures, tools/tune.cpp writes the tables).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ks::tune {

// One variant at one shape: status "ok" (us = median microseconds per call), "skipped" (the
// variant's can_implement refused; why says why) or "incorrect" (its result failed the FP64
// check: such a variant is never put first).
struct Row {
  std::string backend, op, dtype, variant, shape, status, why;
  int64_t rows = 0, cols = 0;  // the routing key (docs/routing.md#shape-keys-rows-cols)
  double us = -1;
  double spread = 0;  // (slowest - fastest) / median of the samples: > 0.25 suggests a busy machine
};

using Progress = std::function<void(size_t done, size_t total, const std::string& what)>;

// backend: cpu, cuda or all (those present); op_filter: one op or empty for all tunable ones.
std::vector<Row> measure(const std::string& backend, const std::string& op_filter, int reps, const Progress& progress);

// The ops tune covers and the shape grid of each, for --help and the docs.
std::string grid_summary();

// Whether op names an operator of this build (one with a registered variant: ks::variants()),
// for the ksctl subcommands that take --op.
bool has_op(const std::string& op);

}  // namespace ks::tune
