// Helpers shared by the C++ CPU kernels of jbackends (flash_attention.cc,
// int4_matmul.cc): instruction-set detection, the thread pools, and the
// wrapping of C++ exceptions into XLA FFI errors. Header-only; every
// extension is one translation unit that includes it.
#ifndef JBACKENDS_CSRC_COMMON_H_
#define JBACKENDS_CSRC_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JB_X86 1
#else
#define JB_X86 0
#endif

#include "xla/ffi/api/ffi.h"

namespace jb {

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ------------------------------------------------------------ instruction sets

// AVX2 + FMA (the AVX2 code paths use both).
inline bool HasAvx2() {
#if JB_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

// AVX512F + AVX512BW + AVX512VL.
inline bool HasAvx512() {
#if JB_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return ok;
#else
  return false;
#endif
}

// HasAvx512() and AVX512-VNNI.
inline bool HasAvx512Vnni() {
#if JB_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return HasAvx512() && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

#if JB_X86
#define JB_AVX2 __attribute__((target("avx2,fma")))

// The sum of the 8 lanes.
JB_AVX2 inline float HSum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif  // JB_X86

// -------------------------------------------------------------------- threads

// std::thread::hardware_concurrency(), at least 1 and at most `cap`.
inline int HardwareThreads(unsigned cap) {
  const unsigned h = std::thread::hardware_concurrency();
  return h == 0 ? 1 : static_cast<int>(std::min(h, cap));
}

// The CPUs this process may run on (its affinity mask, Linux), at most `cap`;
// elsewhere HardwareThreads(cap).
inline int AffinityThreads(int cap) {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int c = CPU_COUNT(&set);
    if (c > 0) return std::min(c, cap);
  }
#endif
  return HardwareThreads(static_cast<unsigned>(cap));
}

// Runs worker(id) for id in [0, threads): id 0 on the calling thread, the
// others on threads of their own; returns when all have finished.
template <typename F>
void RunThreads(int threads, F&& worker) {
  if (threads <= 1) {
    worker(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker, i);
  worker(0);
  for (auto& th : pool) th.join();
}

// Runs f(task, thread) for task in [0, n) on `threads` threads, tasks handed
// out in order (callers put the heaviest first).
template <typename F>
void ParallelTasks(int64_t n, int threads, F&& f) {
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t t = 0; t < n; ++t) f(t, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  RunThreads(threads, [&](int id) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) f(t, id);
  });
}

// Runs f(task, thread) with task t on thread t % threads, each thread in task
// order: which thread accumulates which task never changes from run to run.
template <typename F>
void StaticTasks(int64_t n, int threads, F&& f) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  RunThreads(threads, [&](int id) {
    for (int64_t t = id; t < n; t += threads) f(t, id);
  });
}

// Runs f(lo, hi) over [0, n) split into at most `threads` contiguous ranges
// whose bounds are multiples of `align` (the last one ends at n); one thread
// (the caller, f(0, n)) when `threads` <= 1 or there is one block.
template <typename F>
void ParallelFor(int64_t n, int threads, int64_t align, F&& f) {
  int t = threads;
  const int64_t blocks = (n + align - 1) / align;
  if (t > blocks) t = static_cast<int>(std::max<int64_t>(blocks, 1));
  if (t <= 1) {
    f(int64_t{0}, n);
    return;
  }
  RunThreads(t, [&](int i) {
    const int64_t lo = std::min(n, (blocks * i / t) * align);
    const int64_t hi = std::min(n, (blocks * (i + 1) / t) * align);
    f(lo, hi);
  });
}

// ------------------------------------------------------------------ FFI errors

// Runs body() and returns Success, or the C++ exception it threw as an FFI
// error whose message starts with `what`: bad_alloc as RESOURCE_EXHAUSTED
// ("<what>: out of memory"), any other std::exception as INTERNAL.
template <typename F>
xla::ffi::Error CatchErrors(const char* what, F&& body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted,
                           std::string(what) + ": out of memory");
  } catch (const std::exception& ex) {
    return xla::ffi::Error::Internal(std::string(what) + ": " + ex.what());
  }
  return xla::ffi::Error::Success();
}

}  // namespace jb

#endif  // JBACKENDS_CSRC_COMMON_H_
