// ks_check: the `ksctl check` sweep as a standalone program with no dependency
// beyond kernscope itself, so the GPU machine (no CLI11/PCRE2 there) can run it.
//   ks_check [cpu|cuda|all] [OP] [-v]
#include <cstdio>
#include <cstring>
#include <string>

int run_check(const std::string& backend, const std::string& op_filter, bool verbose);  // tools/check.cpp

int main(int argc, char** argv) {
  std::string backend = "all", op;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "ks_check [cpu|cuda|all] [OP] [-v]\n"
          "  Runs every variant x dtype x shape x layout of the operators against an FP64 reference\n"
          "  (the `ksctl check` sweep, without ksctl's dependencies). BACKEND defaults to all; OP\n"
          "  limits the sweep to one operator (see `ksctl ops`); -v prints every case.\n"
          "  Exit status: 0 when no case is incorrect, 1 when one is, 2 for bad arguments (an unknown\n"
          "  operator, or one without cases), 3 when cuda was asked for and the CUDA backend is not\n"
          "  available (nothing was checked).\n");
      return 0;
    }
    if (a == "-v" || a == "--verbose") {
      verbose = true;
    } else if (a == "cpu" || a == "cuda" || a == "all") {
      backend = a;
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "ks_check: unknown option '%s' (usage: ks_check [cpu|cuda|all] [OP] [-v])\n", a.c_str());
      return 2;
    } else if (!op.empty()) {  // (a second OP was read as the operator before: "unknown operator 'extra'")
      std::fprintf(stderr, "ks_check: one OP at most; got '%s' and '%s' (usage: ks_check [cpu|cuda|all] [OP] [-v])\n",
                   op.c_str(), a.c_str());
      return 2;
    } else {
      op = a;
    }
  }
  return run_check(backend, op, verbose);
}
