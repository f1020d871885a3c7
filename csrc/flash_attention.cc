// FlashAttention-2 CPU kernels (forward and backward) for jbackends,
// registered with XLA through the FFI. The CPU path of SDPBackend.FLASH when
// the extension is built and the CPU has AVX2 + FMA; the blockwise XLA
// implementation (pallas_kernels/attention/xla_flash.py) is the fallback and
// the numerical twin: same masks, same base-2 online softmax, same residuals.
//
// Layouts (all float32, row-major):
//   q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], N = K * G (GQA: query
//   head n reads key/value head n / G), out [B, T, N, Hv], lse [B, N, T]
//   (natural log; -inf for a row that sees no key), dq/dk/dv like q/k/v.
// Masks come from indices only: causal (key j visible from row i iff
// j <= i + diag_offset), a local window (i + off - left <= j <= i + off +
// right), per-batch query / key lengths and per-position segment ids. An
// optional logits soft cap (cap * tanh(logits / cap), after the scale), then an
// additive bias and a boolean mask ([1|B, 1|N, T, S]) apply before them; the
// backward can return dS as the bias gradient [B, N, T, S].
//
// Algorithm (Dao 2023, FlashAttention-2):
//   forward: one task per (batch, query head, block of query rows); an online
//     softmax over the key blocks the rows can see (causal / window / length
//     structure skips the rest). q is pre-scaled by scale * log2(e) so that
//     the softmax runs on exp2.
//   backward: one task per (batch, key/value head, block of keys) or per
//     (batch, key/value head) -- see Backward(); P is recomputed from the
//     saved lse, dK / dV accumulate per task, dQ in a buffer no other thread
//     writes.
// Every matmul is one register-blocked kernel, C[m, n] (+)= sum_k A[m, k]
// B[k, n], with A read through two strides (so A or A^T) and B in panels of 16
// columns (the packs below pad to that).
//
// Code paths, picked at run time (JbFlashSetIsa overrides, for tests): AVX-512
// (12 x 32 tiles, 16-lane softmax), AVX2 + FMA (6 x 16 tiles, 8 lanes), and
// plain C++. The tasks are written once (flash_attention_body.h) and compiled
// for each; the shared object still loads on a CPU without AVX-512 (per-function
// target attributes, no -m flags). bf16 q / k / v have a forward of their own
// (JbFlashFwdBf16): on AMX tiles where the CPU has AMX-BF16 (ForwardAmx; the
// AVX-512 path's softmax between the two tile matmuls), else widened to float32
// for the current path. The backward takes float32.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if JB_X86
#define JB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#endif

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = std::numeric_limits<float>::infinity();

using jb::HasAvx2;
using jb::ParallelTasks;
using jb::RoundUp;
using jb::StaticTasks;

// ---------------------------------------------------------------- threading

std::atomic<int> g_threads_override{0};

int HwThreads() {
  const int forced = g_threads_override.load(std::memory_order_relaxed);
  if (forced > 0) return forced;
  static const int n = jb::AffinityThreads(256);
  return n;
}

// Threads for `flops` of work: one below ~8 MFLOP (thread start-up dominates).
int ThreadsFor(double flops) { return flops < 8e6 ? 1 : HwThreads(); }

// Zeroes x[0, n) on `threads` threads (each touches its own pages first).
inline void ZeroOn(int threads, float* x, int64_t n) {
  jb::ParallelFor(n, threads, 16, [&](int64_t lo, int64_t hi) {
    std::memset(x + lo, 0, (hi - lo) * sizeof(float));
  });
}

// ------------------------------------------------------------------ problem

struct Problem {
  int64_t B, T, S, N, K, G, H, Hv;
  int64_t Hp, Hvp, Sp;  // H, Hv, S rounded up to 16
  float scale2;         // softmax scale * log2(e)
  float cap2;           // logits soft cap * log2(e) (0: none)
  bool causal;
  int64_t off;
  bool window;
  int64_t left, right;
  const int32_t* q_len;   // [B] or null
  const int32_t* kv_len;  // [B] or null
  const int32_t* q_seg;   // [B, T] or null
  const int32_t* kv_seg;  // [B, S] or null
  int64_t bq, bk;         // tiles (bk % 16 == 0)
  // Additive bias [Bb, Nb, T, S] (float32) and boolean mask [Bm, Nm, T, S] (true = attend), each
  // broadcast over the batch (Bb == 1) and / or the heads (Nb == 1); null when absent.
  const float* bias;
  int64_t bias_B, bias_N;
  const bool* mask;
  int64_t mask_B, mask_N;
  // Backward: dS (natural-log units) summed into [dbias_B, dbias_N, T, S], null when not wanted:
  // [B, N, T, S] (every head its own), or the bias's own [bias_B, bias_N, T, S] (the heads and
  // batches a broadcast bias shares summed in the kernel, each entry by one task in a fixed order).
  float* dbias;
  int64_t dbias_B, dbias_N;
};

// Keys [lo, hi) that query row t of batch b may see (structure and lengths);
// segment ids are checked per element.
inline void RowRange(const Problem& p, int64_t b, int64_t t, int64_t* lo, int64_t* hi) {
  int64_t l = 0, h = p.S;
  if (p.kv_len) h = std::min<int64_t>(h, std::max<int32_t>(p.kv_len[b], 0));
  if (p.q_len && t >= p.q_len[b]) h = 0;
  if (p.causal) h = std::min(h, t + p.off + 1);
  if (p.window) {
    l = std::max(l, t + p.off - p.left);
    h = std::min(h, t + p.off + p.right + 1);
  }
  l = std::max<int64_t>(l, 0);
  *lo = l;
  *hi = std::max(h, l);
}

// Query rows [lo, hi) that may see a key in [k0, k1) (structure and lengths).
inline void ColRange(const Problem& p, int64_t b, int64_t k0, int64_t k1, int64_t* lo,
                     int64_t* hi) {
  int64_t l = 0, h = p.T;
  if (p.q_len) h = std::min<int64_t>(h, std::max<int32_t>(p.q_len[b], 0));
  if (p.kv_len) k1 = std::min<int64_t>(k1, std::max<int32_t>(p.kv_len[b], 0));
  k1 = std::min(k1, p.S);
  if (k1 <= k0) h = 0;
  if (p.causal) l = std::max(l, k0 - p.off);
  if (p.window) {
    l = std::max(l, k0 - p.off - p.right);
    h = std::min(h, k1 - 1 - p.off + p.left + 1);
  }
  l = std::max<int64_t>(l, 0);
  *lo = l;
  *hi = std::max(h, l);
}

// Sets the logits of row t that it may not see to -inf: keys of block
// [c0, c0 + nc) outside [lo, hi), and keys of another segment.
inline void MaskRow(const Problem& p, int64_t b, int64_t t, int64_t lo, int64_t hi,
                            int64_t c0, int64_t nc, float* s) {
  const int64_t a = std::clamp<int64_t>(lo - c0, 0, nc);
  const int64_t z = std::clamp<int64_t>(hi - c0, a, nc);
  for (int64_t c = 0; c < a; ++c) s[c] = -kInf;
  for (int64_t c = z; c < nc; ++c) s[c] = -kInf;
  if (p.q_seg) {
    const int32_t seg = p.q_seg[b * p.T + t];
    const int32_t* ks = p.kv_seg + b * p.S + c0;
    for (int64_t c = a; c < z; ++c)
      if (ks[c] != seg) s[c] = -kInf;
  }
}

// ------------------------------------------------------------------ packing

// For key/value head bkh = b * K + kh of k [B, S, K, D]:
//   kt: k transposed in panels of 16 keys, kt[bkh][s / 16][d][s % 16]
//       (zeros past S), the B operand of q k^T;
//   kp: k in panels of 16 features, kp[bkh][d / 16][s][d % 16] (zero
//       padded to Dp features), the B operand of p v and dS k: a panel's rows
//       are one contiguous stream, which the prefetcher keeps up with.
void PackKeys(const Problem& p, const float* k, int64_t D, int64_t Dp, float* kt, float* kp,
              int64_t bkh) {
  const int64_t b = bkh / p.K, kh = bkh % p.K;
  if (kt) {
    float* dst = kt + bkh * D * p.Sp;
    std::memset(dst, 0, D * p.Sp * 4);
    for (int64_t s = 0; s < p.S; ++s) {
      const float* src = k + ((b * p.S + s) * p.K + kh) * D;
      float* panel = dst + (s / 16) * 16 * D + s % 16;
      for (int64_t d = 0; d < D; ++d) panel[d * 16] = src[d];
    }
  }
  if (kp) {
    float* dst = kp + bkh * p.Sp * Dp;
    std::memset(dst, 0, p.Sp * Dp * 4);
    for (int64_t s = 0; s < p.S; ++s) {
      const float* src = k + ((b * p.S + s) * p.K + kh) * D;
      for (int64_t d = 0; d < D; ++d) dst[(d / 16) * p.Sp * 16 + s * 16 + d % 16] = src[d];
    }
  }
}

// --------------------------------------------------------------- forward

// The row stride of the forward's score tile: a block's keys and 16 floats more, so that the
// rows of a 16-row matmul tile do not all fall in a few L1 sets (a power-of-two stride of 1 KiB
// maps 16 rows to 4 of the 64).
inline int64_t ScoreLd(int64_t bk) { return bk + 16; }

struct FwdScratch {
  jb::AlignedVector<float> qs, s, acc, m, l;
  jb::AlignedVector<uint16_t> qb, pb;  // the AMX forward's bf16 query rows and probabilities
  std::vector<int64_t> lo, hi;
};

struct FwdCtx {
  const Problem& p;
  const float *q, *kt, *vp;
  float *out, *lse;
  int64_t nq;
  // The AMX forward: bf16 q [B, T, N, H] and the tiles of k and v (PackTilesAmx).
  const uint16_t *qh = nullptr, *kb = nullptr, *vb = nullptr;
};

struct BwdScratch {
  jb::AlignedVector<float> pm, ds, dka, dva, gb, dcap;
  std::vector<int64_t> lo, hi;
};

struct BwdCtx {
  const Problem& p;
  // Per query head bn = b * N + n, packed once: qs[bn][t][0:Hp] = q * scale * log2(e),
  // dos[bn][t][0:Hv] = dO (both zero padded), lse2[bn][t] = lse * log2(e) (+inf where the row
  // sees nothing, so that P = 0), lo2[bn][t] = 0, dl[bn][t] = delta; P = 2^((s - lse2) - lo2).
  // Rows whose lse2 is too large for log2(l) to survive in it have (lse2, lo2) replaced by their
  // exact (m, log2(l)) (see ExactRowStats).
  const float *qs, *dos, *lse2, *lo2, *dl, *kt, *kp, *vt;
  float *dk, *dv;
};

// Packs query head bn for the backward (see BwdCtx).
void PackQueries(const Problem& p, const float* q, const float* dout, const float* lse,
                 const float* delta, float* qs, float* dos, float* lse2, float* lo2, float* dl,
                 int64_t bn) {
  const int64_t b = bn / p.N, n = bn % p.N;
  for (int64_t t = 0; t < p.T; ++t) {
    const float* qsrc = q + ((b * p.T + t) * p.N + n) * p.H;
    float* qd = qs + (bn * p.T + t) * p.Hp;
    for (int64_t d = 0; d < p.H; ++d) qd[d] = qsrc[d] * p.scale2;
    for (int64_t d = p.H; d < p.Hp; ++d) qd[d] = 0.f;
    float* dd = dos + (bn * p.T + t) * p.Hvp;
    std::memcpy(dd, dout + ((b * p.T + t) * p.N + n) * p.Hv, p.Hv * 4);
    for (int64_t d = p.Hv; d < p.Hvp; ++d) dd[d] = 0.f;
    const float L = lse[bn * p.T + t];
    lse2[bn * p.T + t] = L == -kInf ? kInf : L * kLog2e;
    lo2[bn * p.T + t] = 0.f;
    dl[bn * p.T + t] = delta[bn * p.T + t];
  }
}

// The bf16 forward of a path without bf16 tiles: q, k, v widened to float32 (exactly), then
// that path's float32 forward.
template <void (*Fwd)(const Problem&, const float*, const float*, const float*, float*, float*)>
void ForwardWidened(const Problem& p, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                    float* out, float* lse) {
  const int64_t nq = p.B * p.T * p.N * p.H, nk = p.B * p.S * p.K * p.H, nv = p.B * p.S * p.K * p.Hv;
  const auto qf = jb::NewAligned<float>(nq), kf = jb::NewAligned<float>(nk),
             vf = jb::NewAligned<float>(nv);
  const int threads = ThreadsFor(2.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  const auto widen = [&](const uint16_t* src, int64_t n, float* dst) {
    jb::ParallelFor(n, threads, 16, [&](int64_t lo, int64_t hi) { jb::WidenBf16(src + lo, hi - lo, dst + lo); });
  };
  widen(q, nq, qf.get());
  widen(k, nk, kf.get());
  widen(v, nv, vf.get());
  Fwd(p, qf.get(), kf.get(), vf.get(), out, lse);
}

// ------------------------------------------------------ per-ISA kernels
//
// Each namespace defines the vector interface and the matmul, then includes
// flash_attention_body.h (the tasks and the drivers) compiled for its ISA.
// Every matmul is C[m, n] (+)= sum_k A[m, k] B[k, n] with A read through two
// strides (so A or A^T) and B in 16-column panels:
//   B[k, n] = B[(n / 16) * bps + k * ldb + n % 16];
// row-major B has bps = 16; a panel-packed one (see PackKeys) has ldb = 16 and
// bps = 16 * K, which keeps its loads contiguous (a row stride of a few KiB
// maps every row of a panel to the same L1 set). N % 16 == 0.

// Plain C++ (any CPU; the reference the vector paths are tested against).
namespace scalar_isa {
#define JB_TGT
constexpr int64_t kW = 1;
using Vf = float;
inline Vf Zero() { return 0.f; }
inline Vf Set1(float x) { return x; }
inline Vf Load(const float* p) { return *p; }
inline void Store(float* p, Vf v) { *p = v; }
inline Vf Add(Vf a, Vf b) { return a + b; }
inline Vf Sub(Vf a, Vf b) { return a - b; }
inline Vf Mul(Vf a, Vf b) { return a * b; }
inline Vf MulSub(Vf a, Vf b, Vf c) { return a * b - c; }  // no FMA here: the product rounds first
inline bool AllLe(Vf a, Vf b) { return a <= b; }
inline Vf Max(Vf a, Vf b) { return a > b ? a : b; }  // maxps: b when either is NaN
inline Vf Min(Vf a, Vf b) { return a < b ? a : b; }
inline Vf Div(Vf a, Vf b) { return a / b; }
inline Vf Abs(Vf v) { return std::fabs(v); }
inline Vf CopySign(Vf mag, Vf sign) { return std::copysign(mag, sign); }
inline float HSum(Vf v) { return v; }
inline float HMax(Vf v) { return v; }
// s where the kW booleans at m are true, -inf elsewhere.
inline Vf KeepWhere(const bool* m, Vf s) { return *m ? s : -kInf; }
// The polynomial of the vector paths (see avx2_isa::Exp2).
inline Vf Exp2(Vf x) {
  if (x != x) return x;
  const float xc = Max(-127.0f, x);
  const float n = std::nearbyint(xc);
  const float f = xc - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float e;
  std::memcpy(&e, &bits, 4);
  return p * e;
}
template <bool ACC>
void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
          const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float* b = B + (n / 16) * bps + n % 16;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += A[m * sam + k * sak] * b[k * ldb];
      float* c = C + m * ldc + n;
      *c = ACC ? *c + acc : acc;
    }
}
#include "flash_attention_body.h"
#undef JB_TGT
}  // namespace scalar_isa

#if JB_X86
// AVX2 + FMA: 6 x 16 register tiles (12 ymm accumulators).
namespace avx2_isa {
#define JB_TGT JB_AVX2
constexpr int64_t kW = 8;
using Vf = __m256;
JB_TGT inline Vf Zero() { return _mm256_setzero_ps(); }
JB_TGT inline Vf Set1(float x) { return _mm256_set1_ps(x); }
JB_TGT inline Vf Load(const float* p) { return _mm256_loadu_ps(p); }
JB_TGT inline void Store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
JB_TGT inline Vf Add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
JB_TGT inline Vf Sub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
JB_TGT inline Vf Mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
JB_TGT inline Vf MulSub(Vf a, Vf b, Vf c) { return _mm256_fmsub_ps(a, b, c); }
JB_TGT inline bool AllLe(Vf a, Vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_LE_OQ)) == 0xff; }
JB_TGT inline Vf Max(Vf a, Vf b) { return _mm256_max_ps(a, b); }
JB_TGT inline Vf Min(Vf a, Vf b) { return _mm256_min_ps(a, b); }
JB_TGT inline Vf Div(Vf a, Vf b) { return _mm256_div_ps(a, b); }
JB_TGT inline Vf Abs(Vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
// |mag| with the sign of `sign` (mag >= 0).
JB_TGT inline Vf CopySign(Vf mag, Vf sign) {
  return _mm256_or_ps(mag, _mm256_and_ps(sign, _mm256_set1_ps(-0.f)));
}
JB_TGT inline float HSum(Vf v) { return jb::HSum(v); }
JB_TGT inline Vf KeepWhere(const bool* m, Vf s) {
  const __m256i mi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
  const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mi, _mm256_setzero_si256()));
  return _mm256_blendv_ps(s, _mm256_set1_ps(-kInf), drop);
}
JB_TGT inline float HMax(Vf v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// 2^x for x <= 0 (a softmax exponent), ~2 ulp; exactly 0 for x <= -127 (incl.
// -inf): the exponent field of 2^n is then 0, so the product is +0.
JB_TGT inline Vf Exp2(Vf x) {
  // max(-127, x) rather than max(x, -127): a NaN x stays NaN (maxps returns its second operand).
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);  // [-0.5, 0.5]
  // Minimax polynomial of 2^f on [-0.5, 0.5] (Cephes exp2f coefficients).
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// C[m, 0:16] (+)= sum_k A[m * sam + k * sak] * B[k * ldb + 0:16], m < MR.
// The accumulators are named registers: with arrays GCC spills them to the
// stack on every step.
#define JB_ROW_FMA(m)                                          \
  if (MR > m) {                                                \
    const __m256 am = _mm256_broadcast_ss(a + m * sam);        \
    c##m##0 = _mm256_fmadd_ps(am, b0, c##m##0);                \
    c##m##1 = _mm256_fmadd_ps(am, b1, c##m##1);                \
  }
#define JB_ROW_STORE(m)                                                   \
  if (MR > m) {                                                           \
    float* cm = C + m * ldc;                                              \
    if (ACC) {                                                            \
      c##m##0 = _mm256_add_ps(c##m##0, _mm256_loadu_ps(cm));              \
      c##m##1 = _mm256_add_ps(c##m##1, _mm256_loadu_ps(cm + 8));          \
    }                                                                     \
    _mm256_storeu_ps(cm, c##m##0);                                        \
    _mm256_storeu_ps(cm + 8, c##m##1);                                    \
  }
template <int MR, bool ACC>
JB_TGT inline void Micro(int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                         int64_t ldb, float* C, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
    const float* a = A + k * sak;
    JB_ROW_FMA(0) JB_ROW_FMA(1) JB_ROW_FMA(2) JB_ROW_FMA(3) JB_ROW_FMA(4) JB_ROW_FMA(5)
  }
  JB_ROW_STORE(0) JB_ROW_STORE(1) JB_ROW_STORE(2) JB_ROW_STORE(3) JB_ROW_STORE(4)
  JB_ROW_STORE(5)
}
#undef JB_ROW_FMA
#undef JB_ROW_STORE

template <bool ACC>
JB_TGT void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                 const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  if (K == 0) {
    if (!ACC)
      for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(float));
    return;
  }
  for (int64_t n = 0; n < N; n += 16) {
    const float* b = B + (n / 16) * bps;
    float* c = C + n;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6)
      Micro<6, ACC>(K, A + m * sam, sam, sak, b, ldb, c + m * ldc, ldc);
    const float* a = A + m * sam;
    c += m * ldc;
    switch (M - m) {
      case 5: Micro<5, ACC>(K, a, sam, sak, b, ldb, c, ldc); break;
      case 4: Micro<4, ACC>(K, a, sam, sak, b, ldb, c, ldc); break;
      case 3: Micro<3, ACC>(K, a, sam, sak, b, ldb, c, ldc); break;
      case 2: Micro<2, ACC>(K, a, sam, sak, b, ldb, c, ldc); break;
      case 1: Micro<1, ACC>(K, a, sam, sak, b, ldb, c, ldc); break;
      default: break;
    }
  }
}
#include "flash_attention_body.h"
#undef JB_TGT
}  // namespace avx2_isa

// AVX-512 (F, BW, VL): 12 x 32 register tiles (24 zmm accumulators over two
// 16-column panels at once), 16-lane softmax.
namespace avx512_isa {
#define JB_TGT JB_AVX512
constexpr int64_t kW = 16;
using Vf = __m512;
JB_TGT inline Vf Zero() { return _mm512_setzero_ps(); }
JB_TGT inline Vf Set1(float x) { return _mm512_set1_ps(x); }
JB_TGT inline Vf Load(const float* p) { return _mm512_loadu_ps(p); }
JB_TGT inline void Store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
JB_TGT inline Vf Add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
JB_TGT inline Vf Sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
JB_TGT inline Vf Mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
JB_TGT inline Vf MulSub(Vf a, Vf b, Vf c) { return _mm512_fmsub_ps(a, b, c); }
JB_TGT inline bool AllLe(Vf a, Vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ) == 0xffff; }
JB_TGT inline Vf Max(Vf a, Vf b) { return _mm512_max_ps(a, b); }
JB_TGT inline Vf Min(Vf a, Vf b) { return _mm512_min_ps(a, b); }
JB_TGT inline Vf Div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
JB_TGT inline Vf Abs(Vf v) { return _mm512_abs_ps(v); }
JB_TGT inline Vf CopySign(Vf mag, Vf sign) {
  const __m512i m = _mm512_set1_epi32(INT32_MIN);
  return _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(mag), _mm512_and_si512(_mm512_castps_si512(sign), m)));
}
JB_TGT inline Vf KeepWhere(const bool* m, Vf s) {
  const __mmask16 drop =
      _mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)), _mm_setzero_si128());
  return _mm512_mask_mov_ps(s, drop, _mm512_set1_ps(-kInf));
}
JB_TGT inline float HSum(Vf v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return jb::HSum(h);
}
JB_TGT inline float HMax(Vf v) {
  const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return avx2_isa::HMax(h);
}
// The AVX2 polynomial on 16 lanes, its power of two applied by vscalefps (one instruction for the
// AVX2 path's convert, add, shift and multiply): 2^x = 2^f * 2^n, n = round(x), f = x - n. Lanes
// with x < -125 (-inf included) are exactly 0 (a zeroing mask: no denormal ever leaves, which
// would cost microcode assists downstream; the AVX2 path gives 0 below -126.5); a NaN x compares
// unordered, keeps its lane and gives NaN.
JB_TGT inline __mmask16 Exp2Lanes(Vf x) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ); }
JB_TGT inline Vf Exp2(Vf x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(Exp2Lanes(x), p, n);
}

// 2^x for the bf16 forward (AmxMats), whose probabilities are rounded to bf16 (2^-9) for p v:
// relative error < 3e-6 (Exp2: ~1e-7), as torch's CPU flash kernel uses an exp of 20 ulp (2.4e-6).
// f = x - floor(x) in [0, 1) in one vreduceps, a degree-4 polynomial of 2^f (a near-minimax fit in
// relative error), and vscalefps, which multiplies by 2^floor(x) itself: three instructions fewer
// than Exp2's rounding, subtraction and two more FMAs. vreduceps is AVX512-DQ, which every CPU with
// AMX has but JB_TGT does not name, hence the inline asm (as for vcvtneps2bf16 below). Lanes with
// x < -125 are 0 (Exp2Lanes), NaN stays NaN and +inf gives +inf.
JB_TGT inline Vf Exp2Bf16(Vf x) {
  __m512 f;
  asm("vreduceps $9, %1, %0" : "=v"(f) : "v"(x));  // imm 9: round down, no precision exception
  __m512 p = _mm512_set1_ps(1.353416778e-02f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201146379e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.414427549e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038333e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000002623e+00f));
  return _mm512_maskz_scalef_ps(Exp2Lanes(x), p, x);
}

// C[m, 0:16 * NP] (+)= sum_k A[m * sam + k * sak] * B[k, 0:16 * NP], m < MR,
// B's second panel bps floats after the first.
#define JB_ROW_FMA(m)                                          \
  if (MR > m) {                                                \
    const __m512 am = _mm512_set1_ps(a[m * sam]);              \
    c##m##0 = _mm512_fmadd_ps(am, b0, c##m##0);                \
    if (NP > 1) c##m##1 = _mm512_fmadd_ps(am, b1, c##m##1);    \
  }
#define JB_ROW_STORE(m)                                                    \
  if (MR > m) {                                                            \
    float* cm = C + m * ldc;                                               \
    if (ACC) c##m##0 = _mm512_add_ps(c##m##0, _mm512_loadu_ps(cm));        \
    _mm512_storeu_ps(cm, c##m##0);                                         \
    if (NP > 1) {                                                          \
      if (ACC) c##m##1 = _mm512_add_ps(c##m##1, _mm512_loadu_ps(cm + 16)); \
      _mm512_storeu_ps(cm + 16, c##m##1);                                  \
    }                                                                      \
  }
template <int MR, int NP, bool ACC>
JB_TGT inline void Micro(int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                         int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00,
         c61 = c00, c70 = c00, c71 = c00, c80 = c00, c81 = c00, c90 = c00, c91 = c00,
         c100 = c00, c101 = c00, c110 = c00, c111 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(B + k * ldb);
    const __m512 b1 = NP > 1 ? _mm512_loadu_ps(B + bps + k * ldb) : b0;
    const float* a = A + k * sak;
    JB_ROW_FMA(0) JB_ROW_FMA(1) JB_ROW_FMA(2) JB_ROW_FMA(3) JB_ROW_FMA(4) JB_ROW_FMA(5)
    JB_ROW_FMA(6) JB_ROW_FMA(7) JB_ROW_FMA(8) JB_ROW_FMA(9) JB_ROW_FMA(10) JB_ROW_FMA(11)
  }
  JB_ROW_STORE(0) JB_ROW_STORE(1) JB_ROW_STORE(2) JB_ROW_STORE(3) JB_ROW_STORE(4)
  JB_ROW_STORE(5) JB_ROW_STORE(6) JB_ROW_STORE(7) JB_ROW_STORE(8) JB_ROW_STORE(9)
  JB_ROW_STORE(10) JB_ROW_STORE(11)
}
#undef JB_ROW_FMA
#undef JB_ROW_STORE

// Rows [0, M) in tiles of 12 (and one tail tile) for NP panels at B.
template <int NP, bool ACC>
JB_TGT inline void Panels(int64_t M, int64_t K, const float* A, int64_t sam, int64_t sak,
                          const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  constexpr int kMR = 12;
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    Micro<kMR, NP, ACC>(K, A + m * sam, sam, sak, B, ldb, bps, C + m * ldc, ldc);
  const float* a = A + m * sam;
  float* c = C + m * ldc;
  switch (M - m) {
#define JB_TAIL(r) \
  case r: Micro<r, NP, ACC>(K, a, sam, sak, B, ldb, bps, c, ldc); break;
    JB_TAIL(11) JB_TAIL(10) JB_TAIL(9) JB_TAIL(8) JB_TAIL(7) JB_TAIL(6) JB_TAIL(5) JB_TAIL(4)
    JB_TAIL(3) JB_TAIL(2) JB_TAIL(1)
#undef JB_TAIL
    default: break;
  }
}

template <bool ACC>
JB_TGT void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                 const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  if (K == 0) {
    if (!ACC)
      for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(float));
    return;
  }
  int64_t n = 0;
  for (; n + 32 <= N; n += 32)
    Panels<2, ACC>(M, K, A, sam, sak, B + (n / 16) * bps, ldb, bps, C + n, ldc);
  if (n < N) Panels<1, ACC>(M, K, A, sam, sak, B + (n / 16) * bps, ldb, bps, C + n, ldc);
}
#include "flash_attention_body.h"

#if JB_AMX
// ------------------------------------------------ AMX bf16 forward
//
// On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) the forward of bf16 inputs runs its two
// matmuls on tiles: q k^T and p v as bf16 products summed in float32 (tdpbf16ps), the softmax
// between them in float32 on AVX-512 exactly as above (FwdTask). p is rounded to bf16 for p v, as
// torch's and cuDNN's bf16 kernels do. Eight tiles of 16 rows x 64 bytes: four float32 16 x 16
// accumulators (a 32 x 32 block), two A tiles (32 rows of q or p), two B tiles (k or v, laid out
// by PackTilesAmx). Rows go in 32s and keys in 32s (the tasks' tiles are rounded up to them).
#define JB_AMX_TGT \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
// Inline asm (with the memory clobber the loads need: they read what plain stores just wrote).
#define JB_TLOAD(t, base, stride)                                         \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base),              \
               "r"(static_cast<int64_t>(stride)) : "memory")
#define JB_TSTORE(t, base, stride)                                        \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base),          \
               "r"(static_cast<int64_t>(stride)) : "memory")
#define JB_TZERO(t) asm volatile("tilezero %%tmm" #t ::)
// C += A B: tdpbf16ps (AT&T operand order: B, A, C).
#define JB_TDP(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// The tile shapes on this thread for the scope's life (ldtilecfg), released after (tilerelease:
// the thread's context switches stop saving the 8 KiB of tile data).
struct TileScope {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  TileScope() {
    Config c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
  }
  ~TileScope() { asm volatile("tilerelease" ::: "memory"); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// For key/value head bkh = b * K + kh, zero padded to Hq = H rounded up to 32 features and
// Sq = S rounded up to 32 keys:
//   kb: the B tiles of q k^T, one per 16 keys and 32 features, pairs of features interleaved:
//       kb[bkh][s / 16][d / 32][(d % 32) / 2][s % 16][d % 2];
//   vb: the B tiles of p v, one per 32 keys and 16 features, pairs of keys interleaved:
//       vb[bkh][s / 32][d / 16][(s % 32) / 2][d % 16][s % 2].
JB_TGT void PackTilesAmx(const Problem& p, const uint16_t* k, const uint16_t* v, int64_t Hq,
                         int64_t Sq, uint16_t* kb, uint16_t* vb, int64_t bkh) {
  const int64_t b = bkh / p.K, kh = bkh % p.K;
  // k: 32-bit feature pairs, each tile a 16 x 16 transpose of them (a lone last feature is paired
  // with a zero).
  uint32_t* kd = reinterpret_cast<uint32_t*>(kb + bkh * Sq * Hq);
  std::memset(kd, 0, Sq * Hq * 2);
  const int64_t pairs = p.H / 2;
  for (int64_t s = 0; s < p.S; ++s) {
    const uint16_t* src = k + ((b * p.S + s) * p.K + kh) * p.H;
    uint32_t* base = kd + (s / 16) * 8 * Hq + s % 16;
    for (int64_t dp = 0; dp < pairs; ++dp) {
      uint32_t pair;
      std::memcpy(&pair, src + 2 * dp, 4);
      base[(dp / 16) * 256 + (dp % 16) * 16] = pair;
    }
    if (p.H % 2) base[(pairs / 16) * 256 + (pairs % 16) * 16] = src[p.H - 1];
  }
  // v: rows s and s + 1 interleaved, 16 features at a time (the second row's in the high halves).
  uint16_t* vd = vb + bkh * Sq * p.Hvp;
  std::memset(vd, 0, Sq * p.Hvp * 2);
  for (int64_t s = 0; s < p.S; s += 2) {
    const uint16_t* r0 = v + ((b * p.S + s) * p.K + kh) * p.Hv;
    const uint16_t* r1 = s + 1 < p.S ? r0 + p.K * p.Hv : nullptr;
    uint16_t* base = vd + (s / 32) * 32 * p.Hvp + ((s % 32) / 2) * 32;
    for (int64_t f = 0; f < p.Hv; f += 16) {
      const __mmask16 m = p.Hv - f >= 16 ? 0xffff : static_cast<__mmask16>((1u << (p.Hv - f)) - 1);
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + f));
      const __m512i c = r1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1 + f))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(base + (f / 16) * 512, _mm512_or_si512(a, _mm512_slli_epi32(c, 16)));
    }
  }
}

// FwdTask's matmuls on tiles (see F32Mats for the interface). qb holds the task's rows in bf16
// ([32-rounded rows, Hq], zeros past R and H), pb the probabilities in bf16 ([rows, bk]).
//
// The scores stay raw q k^T (post = scale * log2(e): FwdTask's softmax scales them in its own
// passes), unless a soft cap, bias or mask must see the logits (then Scores scales them, post = 1).
struct AmxMats {
  static constexpr int64_t kKeys = 32;
  static constexpr bool kEmitPairs = true;  // Emit2; Exp (Exp2Bf16) is defined for every input
  const Problem& p;
  FwdScratch& sc;
  const int64_t Hq, Sq;
  const uint16_t* kb;
  const uint16_t* vb;
  const float post;
  JB_AMX_TGT AmxMats(const FwdCtx& x, FwdScratch& s, int64_t b, int64_t kh)
      : p(x.p), sc(s), Hq(RoundUp(p.H, 32)), Sq(RoundUp(p.S, 32)),
        kb(x.kb + (b * p.K + kh) * Sq * Hq), vb(x.vb + (b * p.K + kh) * Sq * p.Hvp),
        post(p.cap2 > 0.f || p.bias || p.mask || !(p.scale2 > 0.f) ? 1.f : p.scale2) {}

  JB_AMX_TGT void Queries(const FwdCtx& x, int64_t b, int64_t n, int64_t t0, int64_t R) {
    const int64_t Rp = RoundUp(R, 32);
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(sc.qb.data() + r * Hq, x.qh + ((b * p.T + t0 + r) * p.N + n) * p.H, p.H * 2);
      std::fill(sc.qb.data() + r * Hq + p.H, sc.qb.data() + (r + 1) * Hq, uint16_t{0});
    }
    std::fill(sc.qb.data() + R * Hq, sc.qb.data() + Rp * Hq, uint16_t{0});
    std::fill(sc.pb.data() + R * p.bk, sc.pb.data() + Rp * p.bk, uint16_t{0});
  }

  // q k^T of 32-row x 32-key blocks (rows past R are padding), times scale * log2(e) unless post
  // does it.
  JB_AMX_TGT void Scores(int64_t R, int64_t c0, int64_t nc, float* s, int64_t ld) {
    const int64_t Rp = RoundUp(R, 32), ldq = Hq * 2, lds = ld * 4;
    for (int64_t j = 0; j < nc; j += 32) {  // a block of keys stays in L1 for all the rows
      const uint16_t* k0 = kb + (c0 + j) * Hq;  // 16 keys take 16 * Hq elements
      const uint16_t* k1 = k0 + 16 * Hq;
      for (int64_t i = 0; i < Rp; i += 32) {
        const uint16_t* q0 = sc.qb.data() + i * Hq;
        const uint16_t* q1 = q0 + 16 * Hq;
        JB_TZERO(0);
        JB_TZERO(1);
        JB_TZERO(2);
        JB_TZERO(3);
        for (int64_t dc = 0; dc < Hq / 32; ++dc) {
          JB_TLOAD(4, q0 + dc * 32, ldq);
          JB_TLOAD(5, q1 + dc * 32, ldq);
          JB_TLOAD(6, k0 + dc * 512, 64);
          JB_TLOAD(7, k1 + dc * 512, 64);
          JB_TDP(0, 4, 6);
          JB_TDP(1, 4, 7);
          JB_TDP(2, 5, 6);
          JB_TDP(3, 5, 7);
        }
        float* c = s + i * ld + j;
        JB_TSTORE(0, c, lds);
        JB_TSTORE(1, c + 16, lds);
        JB_TSTORE(2, c + 16 * ld, lds);
        JB_TSTORE(3, c + 16 * ld + 16, lds);
      }
    }
    if (post != 1.f) return;
    const __m512 sc2 = _mm512_set1_ps(p.scale2);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < nc; c += 16)
        _mm512_storeu_ps(s + r * ld + c, _mm512_mul_ps(sc2, _mm512_loadu_ps(s + r * ld + c)));
  }

  // Row r alone on AVX512-BF16 (vdpbf16ps: the same bf16 products, float32 sums).
  JB_AMX_TGT void ScoresRow(int64_t r, int64_t c0, int64_t nc, float* sr) {
    const uint16_t* qr = sc.qb.data() + r * Hq;
    for (int64_t j = 0; j < nc; j += 16) {
      const uint16_t* panel = kb + (c0 + j) * Hq;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < Hq; d += 2) {
        uint32_t pair;
        std::memcpy(&pair, qr + d, 4);
        const __m512i kv = _mm512_loadu_si512(panel + (d / 32) * 512 + (d % 32) * 16);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                               (__m512bh)kv);
      }
      _mm512_storeu_ps(sr + j, post != 1.f ? acc : _mm512_mul_ps(_mm512_set1_ps(p.scale2), acc));
    }
  }

  JB_TGT static __m512 Exp(__m512 x) { return Exp2Bf16(x); }

  // The probabilities rounded to bf16 (to nearest even; vcvtneps2bf16 as inline asm, so that it
  // inlines into FwdTask, compiled for AVX-512 without the BF16 extension) into pb.
  JB_TGT uint16_t* Row(int64_t r, float*) { return sc.pb.data() + r * p.bk; }
  JB_TGT static void Emit(uint16_t* pr, int64_t c, __m512 e) {
    __m256i h;
    asm("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(e));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), h);
  }
  // Columns [c, c + 32) from e0 and e1 in one vcvtne2ps2bf16 (the same rounding; AT&T order: the
  // first source gives the low half).
  JB_TGT static void Emit2(uint16_t* pr, int64_t c, __m512 e0, __m512 e1) {
    __m512i h;
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(h) : "v"(e1), "v"(e0));
    _mm512_storeu_si512(pr + c, h);
  }

  // acc += p v (p from Emit, rows past R zero): 32 x 32 blocks of acc loaded into the four
  // accumulator tiles, summed over the block's keys, stored back.
  JB_AMX_TGT void AddValues(int64_t R, int64_t c0, int64_t nc, const float*, int64_t,
                            float* acc) {
    const int64_t Rp = RoundUp(R, 32), ldp = p.bk, Hvp = p.Hvp, lda = Hvp * 4;
    const uint16_t* pb = sc.pb.data();
    const uint16_t* vblk = vb + c0 * Hvp;  // 32 keys take 32 * Hvp elements
    for (int64_t i = 0; i < Rp; i += 32) {
      float* a0 = acc + i * Hvp;
      float* a1 = a0 + 16 * Hvp;
      const uint16_t* p0 = pb + i * ldp;
      const uint16_t* p1 = p0 + 16 * ldp;
      int64_t f = 0;
      for (; f + 32 <= Hvp; f += 32) {
        JB_TLOAD(0, a0 + f, lda);
        JB_TLOAD(1, a0 + f + 16, lda);
        JB_TLOAD(2, a1 + f, lda);
        JB_TLOAD(3, a1 + f + 16, lda);
        for (int64_t kc = 0; kc < nc / 32; ++kc) {
          const uint16_t* v0 = vblk + kc * 32 * Hvp + (f / 16) * 512;
          JB_TLOAD(4, p0 + kc * 32, ldp * 2);
          JB_TLOAD(5, p1 + kc * 32, ldp * 2);
          JB_TLOAD(6, v0, 64);
          JB_TLOAD(7, v0 + 512, 64);
          JB_TDP(0, 4, 6);
          JB_TDP(1, 4, 7);
          JB_TDP(2, 5, 6);
          JB_TDP(3, 5, 7);
        }
        JB_TSTORE(0, a0 + f, lda);
        JB_TSTORE(1, a0 + f + 16, lda);
        JB_TSTORE(2, a1 + f, lda);
        JB_TSTORE(3, a1 + f + 16, lda);
      }
      if (f < Hvp) {  // the last 16 features
        JB_TLOAD(0, a0 + f, lda);
        JB_TLOAD(2, a1 + f, lda);
        for (int64_t kc = 0; kc < nc / 32; ++kc) {
          JB_TLOAD(4, p0 + kc * 32, ldp * 2);
          JB_TLOAD(5, p1 + kc * 32, ldp * 2);
          JB_TLOAD(6, vblk + kc * 32 * Hvp + (f / 16) * 512, 64);
          JB_TDP(0, 4, 6);
          JB_TDP(2, 5, 6);
        }
        JB_TSTORE(0, a0 + f, lda);
        JB_TSTORE(2, a1 + f, lda);
      }
    }
  }
};

// The bf16 forward on tiles (the caller checked jb::HasAmxBf16()). Tiles rounded up to 32 rows
// and 32 keys.
void ForwardAmx(const Problem& p0, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                float* out, float* lse) {
  Problem p = p0;
  p.bq = RoundUp(p.bq, 32);
  p.bk = RoundUp(p.bk, 32);
  const int64_t nq = (p.T + p.bq - 1) / p.bq;
  const int64_t Hq = RoundUp(p.H, 32), Sq = RoundUp(p.S, 32);
  const auto kb = jb::NewAligned<uint16_t>(p.B * p.K * Sq * Hq);
  const auto vb = jb::NewAligned<uint16_t>(p.B * p.K * Sq * p.Hvp);
  const int threads = ThreadsFor(2.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  ParallelTasks(p.B * p.K, threads, [&](int64_t bkh, int) {
    PackTilesAmx(p, k, v, Hq, Sq, kb.get(), vb.get(), bkh);
  });
  std::vector<FwdScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.qb.resize(p.bq * Hq);
    sc.pb.resize(p.bq * p.bk);
    sc.s.resize(p.bq * ScoreLd(p.bk));
    sc.acc.resize(p.bq * p.Hvp);
    sc.m.resize(p.bq);
    sc.l.resize(p.bq * 16);
    sc.lo.resize(p.bq);
    sc.hi.resize(p.bq);
  }
  FwdCtx x{p, nullptr, nullptr, nullptr, out, lse, nq};
  x.qh = q;
  x.kb = kb.get();
  x.vb = vb.get();
  ParallelTasks(p.B * p.N * nq, threads, [&](int64_t task, int id) {
    TileScope tiles;
    FwdTask<AmxMats>(x, scratch[id], task);
  });
}
#undef JB_TLOAD
#undef JB_TSTORE
#undef JB_TZERO
#undef JB_TDP
#undef JB_AMX_TGT
#endif  // JB_AMX

std::atomic<bool> g_amx{true};  // JbFlashSetAmx

// Whether the bf16 forward of this path runs on AMX tiles.
bool UseAmx() { return JB_AMX && g_amx.load(std::memory_order_relaxed) && jb::HasAmxBf16(); }

void ForwardBf16(const Problem& p, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                 float* out, float* lse) {
#if JB_AMX
  if (UseAmx()) return ForwardAmx(p, q, k, v, out, lse);
#endif
  ForwardWidened<&Forward>(p, q, k, v, out, lse);
}
#undef JB_TGT
}  // namespace avx512_isa
#endif  // JB_X86

// ------------------------------------------------------------ dispatch

struct Isa {
  const char* name;
  decltype(&scalar_isa::Forward) forward;
  decltype(&scalar_isa::Backward) backward;
  decltype(&ForwardWidened<&scalar_isa::Forward>) forward_bf16;
};
constexpr Isa kScalar{"scalar", &scalar_isa::Forward, &scalar_isa::Backward,
                      &ForwardWidened<&scalar_isa::Forward>};
#if JB_X86
constexpr Isa kAvx2{"avx2", &avx2_isa::Forward, &avx2_isa::Backward,
                    &ForwardWidened<&avx2_isa::Forward>};
constexpr Isa kAvx512{"avx512", &avx512_isa::Forward, &avx512_isa::Backward,
                      &avx512_isa::ForwardBf16};
#endif

// The best path this CPU runs: AVX-512 > AVX2 > scalar.
const Isa* BestIsa() {
#if JB_X86
  if (jb::HasAvx512()) return &kAvx512;
  if (HasAvx2()) return &kAvx2;
#endif
  return &kScalar;
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa& CurrentIsa() {
  const Isa* isa = g_isa.load(std::memory_order_relaxed);
  return isa ? *isa : *BestIsa();
}

// ------------------------------------------------------------ FFI handlers

template <class In>  // ffi::Buffer<F32> or <BF16>: q, k, v
ffi::Error MakeProblem(const In& q, const In& k, const In& v, const ffi::Buffer<ffi::S32>& q_len,
                       const ffi::Buffer<ffi::S32>& kv_len, const ffi::Buffer<ffi::S32>& q_seg,
                       const ffi::Buffer<ffi::S32>& kv_seg, float scale, bool causal,
                       int64_t diag_offset, bool window, int64_t left, int64_t right,
                       bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                       int64_t block_k, float softcap, const ffi::Buffer<ffi::F32>& bias,
                       const ffi::Buffer<ffi::PRED>& mask, bool has_bias, bool has_mask,
                       Problem* p) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("flash attention: q, k, v must be rank 4 (B, T, N, H)");
  p->B = qd[0];
  p->T = qd[1];
  p->N = qd[2];
  p->H = qd[3];
  p->S = kd[1];
  p->K = kd[2];
  p->Hv = vd[3];
  if (kd[0] != p->B || vd[0] != p->B || kd[3] != p->H || vd[1] != p->S || vd[2] != p->K ||
      p->K == 0 || p->N % p->K)
    return ffi::Error::InvalidArgument("flash attention: inconsistent q / k / v shapes");
  if (block_q < 1 || block_k < 16 || block_k % 16)
    return ffi::Error::InvalidArgument("flash attention: block_q >= 1, block_k a multiple of 16");
  p->G = p->N / p->K;
  p->Hp = RoundUp(p->H, 16);
  p->Hvp = RoundUp(p->Hv, 16);
  p->Sp = RoundUp(p->S, 16);
  p->scale2 = scale * kLog2e;
  if (!(softcap >= 0.f) || std::isinf(softcap))
    return ffi::Error::InvalidArgument("flash attention: softcap must be finite and >= 0");
  p->cap2 = softcap * kLog2e;
  p->causal = causal;
  p->off = diag_offset;
  p->window = window;
  p->left = left;
  p->right = right;
  p->q_len = has_q_len ? q_len.typed_data() : nullptr;
  p->kv_len = has_kv_len ? kv_len.typed_data() : nullptr;
  p->q_seg = has_seg ? q_seg.typed_data() : nullptr;
  p->kv_seg = has_seg ? kv_seg.typed_data() : nullptr;
  const auto count = [](const auto& x) { return static_cast<int64_t>(x.element_count()); };
  if ((has_q_len && count(q_len) != p->B) || (has_kv_len && count(kv_len) != p->B) ||
      (has_seg && (count(q_seg) != p->B * p->T || count(kv_seg) != p->B * p->S)))
    return ffi::Error::InvalidArgument("flash attention: bad lengths / segment ids shapes");
  p->bq = block_q;
  p->bk = block_k;
  p->bias = nullptr;
  p->mask = nullptr;
  p->dbias = nullptr;
  p->dbias_B = p->dbias_N = 1;
  p->bias_B = p->bias_N = p->mask_B = p->mask_N = 1;
  auto dims_ok = [&](auto d, int64_t* Bx, int64_t* Nx) {
    if (d.size() != 4 || (d[0] != 1 && d[0] != p->B) || (d[1] != 1 && d[1] != p->N) ||
        d[2] != p->T || d[3] != p->S)
      return false;
    *Bx = d[0];
    *Nx = d[1];
    return true;
  };
  if (has_bias) {
    if (!dims_ok(bias.dimensions(), &p->bias_B, &p->bias_N))
      return ffi::Error::InvalidArgument("flash attention: bias must be [1|B, 1|N, T, S]");
    p->bias = bias.typed_data();
  }
  if (has_mask) {
    if (!dims_ok(mask.dimensions(), &p->mask_B, &p->mask_N))
      return ffi::Error::InvalidArgument("flash attention: mask must be [1|B, 1|N, T, S]");
    p->mask = mask.typed_data();
  }
  return ffi::Error::Success();
}

// The forward of float32 or bf16 q, k, v (float32 out and lse). bf16 runs on AMX tiles where the
// CPU has them (see ForwardAmx), else widened to float32 for the current path.
template <ffi::DataType DT>
ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                   ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, float scale,
                   bool causal, int64_t diag_offset, bool window, int64_t left, int64_t right,
                   bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                   int64_t block_k, float softcap, bool has_bias, bool has_mask,
                   bool need_dbias) {
  jb::PoolScope scope(pool);
  Problem p;
  ffi::Error e = MakeProblem(q, k, v, q_len, kv_len, q_seg, kv_seg, scale, causal, diag_offset,
                             window, left, right, has_q_len, has_kv_len, has_seg, block_q,
                             block_k, softcap, bias, mask, has_bias, has_mask, &p);
  if (e.failure()) return e;
  if (p.B * p.T * p.N == 0) return ffi::Error::Success();
  return jb::CatchErrors("flash attention", [&] {
    if constexpr (DT == ffi::DataType::BF16) {
      CurrentIsa().forward_bf16(p, static_cast<const uint16_t*>(q.untyped_data()),
                                static_cast<const uint16_t*>(k.untyped_data()),
                                static_cast<const uint16_t*>(v.untyped_data()), out->typed_data(),
                                lse->typed_data());
    } else {
      CurrentIsa().forward(p, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
                           lse->typed_data());
    }
  });
}

ffi::Error BwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> lse,
                   ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> q_seg,
                   ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::F32> bias,
                   ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> dq,
                   ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                   ffi::ResultBuffer<ffi::F32> dbias, float scale,
                   bool causal, int64_t diag_offset, bool window, int64_t left, int64_t right,
                   bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                   int64_t block_k, float softcap, bool has_bias, bool has_mask,
                   bool need_dbias) {
  jb::PoolScope scope(pool);
  Problem p;
  ffi::Error e = MakeProblem(q, k, v, q_len, kv_len, q_seg, kv_seg, scale, causal, diag_offset,
                             window, left, right, has_q_len, has_kv_len, has_seg, block_q,
                             block_k, softcap, bias, mask, has_bias, has_mask, &p);
  if (e.failure()) return e;
  std::memset(dq->typed_data(), 0, dq->element_count() * 4);
  std::memset(dk->typed_data(), 0, dk->element_count() * 4);
  std::memset(dv->typed_data(), 0, dv->element_count() * 4);
  if (need_dbias) {
    // dbias: [B, N, T, S], or the bias's [bias_B, bias_N, T, S] (summed over what it broadcasts).
    const size_t n = dbias->element_count(), ts = static_cast<size_t>(p.T * p.S);
    if (has_bias && n == static_cast<size_t>(p.B * p.N) * ts) {
      p.dbias_B = p.B;
      p.dbias_N = p.N;
    } else if (has_bias && n == static_cast<size_t>(p.bias_B * p.bias_N) * ts) {
      p.dbias_B = p.bias_B;
      p.dbias_N = p.bias_N;
    } else {
      return ffi::Error::InvalidArgument(
          "flash attention: dbias must be [B, N, T, S] or the bias's [1|B, 1|N, T, S]");
    }
    p.dbias = dbias->typed_data();  // zeroed by Backward's threads
  }
  if (p.B * p.T * p.N == 0 || p.S == 0) {
    if (p.dbias) std::memset(p.dbias, 0, dbias->element_count() * 4);
    return ffi::Error::Success();
  }
  return jb::CatchErrors("flash attention", [&] {
    CurrentIsa().backward(p, q.typed_data(), k.typed_data(), v.typed_data(), dout.typed_data(),
             lse.typed_data(), delta.typed_data(), dq->typed_data(), dk->typed_data(),
             dv->typed_data());
  });
}

}  // namespace

#define JB_FLASH_ATTRS                     \
  .Attr<float>("scale")                    \
      .Attr<bool>("causal")                \
      .Attr<int64_t>("diag_offset")        \
      .Attr<bool>("window")                \
      .Attr<int64_t>("left")               \
      .Attr<int64_t>("right")              \
      .Attr<bool>("has_q_len")             \
      .Attr<bool>("has_kv_len")            \
      .Attr<bool>("has_seg")               \
      .Attr<int64_t>("block_q")            \
      .Attr<int64_t>("block_k")            \
      .Attr<float>("softcap")              \
      .Attr<bool>("has_bias")              \
      .Attr<bool>("has_mask")              \
      .Attr<bool>("need_dbias")

#define JB_FLASH_FWD_BINDING(QKV)              \
  ffi::Ffi::Bind()                             \
      .Ctx<ffi::ThreadPool>()                  \
      .Arg<ffi::Buffer<QKV>>()                 \
      .Arg<ffi::Buffer<QKV>>()                 \
      .Arg<ffi::Buffer<QKV>>()                 \
      .Arg<ffi::Buffer<ffi::S32>>()            \
      .Arg<ffi::Buffer<ffi::S32>>()            \
      .Arg<ffi::Buffer<ffi::S32>>()            \
      .Arg<ffi::Buffer<ffi::S32>>()            \
      .Arg<ffi::Buffer<ffi::F32>>()            \
      .Arg<ffi::Buffer<ffi::PRED>>()           \
      .Ret<ffi::Buffer<ffi::F32>>()            \
      .Ret<ffi::Buffer<ffi::F32>>() JB_FLASH_ATTRS

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbFlashFwdF32, FwdImpl<ffi::DataType::F32>,
                              JB_FLASH_FWD_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbFlashFwdBf16, FwdImpl<ffi::DataType::BF16>,
                              JB_FLASH_FWD_BINDING(ffi::BF16));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbFlashBwdF32, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JB_FLASH_ATTRS);

// 1 when the kernels are offered on this CPU: x86-64 with AVX2 + FMA (without
// them the scalar path exists for tests, but the blockwise XLA code is faster).
extern "C" int JbFlashAvailable() {
#if JB_X86
  return HasAvx2() ? 1 : 0;
#else
  return 0;
#endif
}

// Threads a large call uses (the CPUs this process may run on, or the override).
extern "C" int JbFlashThreads() { return HwThreads(); }

// Overrides the thread count (tests, benchmarks); 0 restores the default.
extern "C" void JbFlashSetThreads(int n) { g_threads_override.store(n < 0 ? 0 : n); }

// 1: the kernels' threads run on XLA's intra-op pool (the default); 0: each
// call starts threads of its own (tests, benchmarks).
extern "C" void JbFlashSetXlaPool(int on) { jb::SetUseXlaPool(on != 0); }

// 1 when the bf16 forward runs on AMX tiles: this CPU has AMX-BF16 (and the kernel granted the
// tile state), the path is avx512, and JbFlashSetAmx has not turned them off.
extern "C" int JbFlashAmx() {
#if JB_X86
  return &CurrentIsa() == &kAvx512 && avx512_isa::UseAmx() ? 1 : 0;
#else
  return 0;
#endif
}

// 0 turns the AMX bf16 forward off (bf16 inputs are then widened to float32 for the avx512
// path: tests, benchmarks); 1 restores it where the CPU has it.
extern "C" void JbFlashSetAmx(int on) {
#if JB_X86
  avx512_isa::g_amx.store(on != 0);
#endif
}

// The code path the kernels use ("avx512", "avx2" or "scalar").
extern "C" const char* JbFlashIsa() { return CurrentIsa().name; }

// Selects the code path ("avx512", "avx2", "scalar"; "" restores the best this
// CPU runs). Tests cover every path this CPU runs. Returns 0 on success, -1 if
// the name is unknown or this CPU lacks it.
extern "C" int JbFlashSetIsa(const char* name) {
  const std::string n(name);
  const Isa* isa = nullptr;
  if (n.empty()) isa = BestIsa();
  if (n == "scalar") isa = &kScalar;
#if JB_X86
  if (n == "avx2" && HasAvx2()) isa = &kAvx2;
  if (n == "avx512" && jb::HasAvx512()) isa = &kAvx512;
#endif
  if (isa == nullptr) return -1;
  g_isa.store(isa);
  return 0;
}
