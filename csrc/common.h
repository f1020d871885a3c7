// Helpers shared by the C++ CPU kernels of jbackends (flash_attention.cc,
// int4_matmul.cc): instruction-set detection, the thread pools, and the
// wrapping of C++ exceptions into XLA FFI errors. Header-only; every
// extension is one translation unit that includes it.
#ifndef JBACKENDS_CSRC_COMMON_H_
#define JBACKENDS_CSRC_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JB_X86 1
#else
#define JB_X86 0
#endif

// AMX tiles: x86-64 Linux (the kernel grants the tile state per process) with a compiler whose
// assembler takes the AMX instructions (written as inline asm, no -m flags).
#if JB_X86 && defined(__linux__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#include <cpuid.h>
#define JB_AMX 1
#else
#define JB_AMX 0
#endif

#include "xla/ffi/api/ffi.h"

namespace jb {

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// n bfloat16 values (their bits) -> float32 at dst (exact: the bits are the float's upper half).
inline void WidenBf16(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

// n uninitialised T on a 64-byte boundary, so that 64-byte vector loads and
// stores of the buffers the kernels lay out in vectors split no cache line.
template <typename T>
struct AlignedDelete {
  void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], AlignedDelete<T>>;
template <typename T>
AlignedBuffer<T> NewAligned(int64_t n) {
  return AlignedBuffer<T>(static_cast<T*>(::operator new[](
      static_cast<size_t>(RoundUp(std::max<int64_t>(n, 1) * sizeof(T), 64)), std::align_val_t(64))));
}

// A std::vector whose data starts on a 64-byte boundary: value-initialised and
// resizable like any vector. The flash kernels' packed operands, dQ buffers
// and scratch tiles live in these: malloc gives 16-byte alignment (large blocks
// sit 16 bytes past a page), and AVX-512 loads and stores that straddle two
// cache lines cost the register-blocked GEMM ~10% of its rate (one Xeon core,
// 96x256x64: 116 against 103 GFLOP/s, medians of 10 interleaved runs).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

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

// An Intel CPU (kernel choices measured per vendor).
inline bool IsIntelCpu() {
#if JB_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return ok;
#else
  return false;
#endif
}

// HasAvx512() and AVX512-BF16 (vdpbf16ps).
inline bool HasAvx512Bf16() {
#if JB_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return HasAvx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

// HasAvx512Bf16(), AVX512-DQ, AMX-TILE and AMX-BF16, and the kernel's leave to use the tile
// state (asked for once per process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool HasAmxBf16() {
#if JB_AMX
  static const bool ok = [] {
    unsigned a, b, c, d;
    // AVX512-DQ: the AMX forward's exponential uses vreduceps.
    if (!HasAvx512Bf16() || !__builtin_cpu_supports("avx512dq") ||
        !__get_cpuid_count(7, 0, &a, &b, &c, &d))
      return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
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

// The pool state is private to each extension (an unnamed namespace: each
// extension is one translation unit). As `inline` variables GCC would make
// them unique symbols that the dynamic loader merges across the two
// extensions, so one library's switch would flip the other's.
namespace {

// Whether the kernels run their threads on XLA's intra-op pool (the default)
// or start threads of their own on every call (the fallback where a runtime
// has no pool; switchable for tests and benchmarks).
std::atomic<bool> g_use_xla_pool{true};
inline bool UseXlaPool() { return g_use_xla_pool.load(std::memory_order_relaxed); }
inline void SetUseXlaPool(bool on) { g_use_xla_pool.store(on, std::memory_order_relaxed); }

// The XLA intra-op thread pool of the FFI call running on this thread, or
// null (then RunThreads starts threads of its own). Set by PoolScope.
thread_local xla::ffi::ThreadPool* t_pool = nullptr;

// Makes `pool` (the handler's Ctx<ThreadPool>) the pool of this thread's
// RunThreads calls for its lifetime. A pool that reports no threads (no
// intra-op pool in this runtime) is not used, nor any while SetUseXlaPool(false).
class PoolScope {
 public:
  explicit PoolScope(xla::ffi::ThreadPool& pool) : prev_(t_pool) {
    if (UseXlaPool() && pool.num_threads() > 0) t_pool = &pool;
  }
  ~PoolScope() { t_pool = prev_; }
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  xla::ffi::ThreadPool* prev_;
};

}  // namespace

// Runs worker(id) for every id in [0, threads) and returns when all have
// finished. Inside an FFI call with a pool (PoolScope) the ids are claimed in
// order by the calling thread and by threads - 1 tasks scheduled on XLA's
// intra-op pool (no thread start-up, and no more threads than XLA's own; a
// task the pool starts late finds no id left, and the caller runs the ids
// nobody claimed, so a busy pool slows the call down but cannot block it).
// Without a pool, id 0 runs on the calling thread and the others on threads
// of their own. An exception thrown by a worker on another thread is
// rethrown on the calling thread.
template <typename F>
void RunThreads(int threads, F&& worker) {
  if (threads <= 1) {
    worker(0);
    return;
  }
  struct Shared {
    std::atomic<int> next{0};
    std::atomic<int> left{0};
    std::exception_ptr error;
    std::atomic<bool> failed{false};
    std::mutex mu;  // with `done`: the caller sleeps through a long wait
    std::condition_variable done;
  };
  auto shared = std::make_shared<Shared>();
  shared->left.store(threads, std::memory_order_relaxed);
  // `worker` is only reached through an id < threads, all of which are
  // claimed (and finished) before this function returns.
  auto claim = [shared, threads, w = &worker] {
    for (int id = shared->next.fetch_add(1, std::memory_order_relaxed); id < threads;
         id = shared->next.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*w)(id);
      } catch (...) {
        if (!shared->failed.exchange(true)) shared->error = std::current_exception();
      }
      if (shared->left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->done.notify_all();
      }
    }
  };
  if (xla::ffi::ThreadPool* xla_pool = t_pool) {
    try {
      for (int i = 1; i < threads; ++i) xla_pool->Schedule(decltype(claim)(claim));
    } catch (...) {
      // (out of memory) the ids no task claims are run by claim() below
    }
    claim();
    // The ids left are running on pool threads: spin a little (calls that
    // end together), then sleep until the last one finishes.
    for (int spins = 0; spins < 2048 && shared->left.load(std::memory_order_acquire) != 0; ++spins) {
#if JB_X86
      _mm_pause();
#endif
    }
    if (shared->left.load(std::memory_order_acquire) != 0) {
      std::unique_lock<std::mutex> lock(shared->mu);
      shared->done.wait(lock, [&] { return shared->left.load(std::memory_order_acquire) == 0; });
    }
  } else {
    std::vector<std::thread> pool;
    try {
      pool.reserve(threads - 1);
      for (int i = 1; i < threads; ++i) pool.emplace_back(claim);
    } catch (...) {
      // (no thread could start) the ids left are run by claim() below
    }
    claim();
    for (auto& th : pool) th.join();
  }
  if (shared->failed.load(std::memory_order_acquire)) std::rethrow_exception(shared->error);
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

// The XLA FFI API version the handlers were compiled against (major * 1000 + minor). The loader
// (pallas_kernels/ffi.py) compares it with the running jaxlib's before registering anything: an
// older jaxlib refuses newer handlers, and when its CPU backend has not started yet that refusal
// fails the backend's start, taking every CPU computation of the process with it.
extern "C" int JbFfiApiVersion() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }

#endif  // JBACKENDS_CSRC_COMMON_H_
