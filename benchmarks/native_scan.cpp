// The native appends' NaN/Inf scan (quantize_core.h first_non_finite) timed alone, on one layer's
// one-token block of SmolLM2's shape (3 heads x 64 channels, float32): benchmarks/append.py builds
// and runs this, because inside the kernels the scan cannot be switched off to time the difference.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "quantize_core.h"

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 192, reps = 2000000;
  std::vector<float> x(static_cast<size_t>(n));
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(gen);
  int64_t found = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) {
    x[static_cast<size_t>(r % n)] += 1e-7f;  // a new block each call (nothing to hoist)
    found += kvq_core::first_non_finite(x.data(), n) >= 0;
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::printf("%.2f\n", ns);
  return found == 0 ? 0 : 1;  // every entry is finite: a hit is a bug
}
