// Work sharing for Kestrel's CPU kernels, free of any instruction set (both builds, through
// kernel.h). Part of each kernel's build key (kestrel/ops/build.py follows the includes).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kestrel_parallel {

// f(begin, end) over runs of items 0 .. n - 1, one run per thread, the runs of about equal total
// cost (cost(i) >= 1), where at::parallel_for would make them of equal count. A decode batch comes
// longest context first, so equal counts hand one thread the long half.
template <typename Cost, typename F>
void parallel_for_by_cost(int64_t n, const Cost& cost, const F& f) {
  if (n <= 0) return;
  std::vector<int64_t> cum(n + 1, 0);  // strictly rising
  for (int64_t i = 0; i < n; ++i) cum[i + 1] = cum[i] + std::max<int64_t>(1, cost(i));
  const int64_t total = cum[n], nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  // Item i goes to the thread t with total * t / nthreads <= cum[i] < total * (t + 1) / nthreads.
  const auto first_at = [&](int64_t c) { return std::lower_bound(cum.begin(), cum.end() - 1, c) - cum.begin(); };
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t begin = first_at(total * t / nthreads), end = first_at(total * (t + 1) / nthreads);
      if (begin < end) f(begin, end);
    }
  });
}

}  // namespace kestrel_parallel
