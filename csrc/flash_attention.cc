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
// right), per-batch query / key lengths and per-position segment ids.
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
// Every matmul is one register-blocked AVX2 kernel, C[m, n] (+)= sum_k A[m, k]
// B[k, n], with A read through two strides (so A or A^T) and B row-major with
// rows of 16-float multiples (the packs below pad to that).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = std::numeric_limits<float>::infinity();

using jb::HasAvx2;
using jb::HSum;
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

#if JB_X86
// ------------------------------------------------------------------- GEMM

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
JB_AVX2 inline void Micro(int64_t K, const float* A, int64_t sam, int64_t sak,
                          const float* B, int64_t ldb, float* C, int64_t ldc) {
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

// C[M, N] (+)= A[M, K] B[K, N]; A[m, k] = A[m * sam + k * sak]; N % 16 == 0.
// B[k, n] = B[(n / 16) * bps + k * ldb + n % 16]: row-major B has bps = 16;
// a panel-packed one (16 columns at a time, see PackKeys) has ldb = 16 and
// bps = 16 * K, which keeps its loads contiguous (a row stride of a few KiB
// maps every row of a panel to the same L1 set).
template <bool ACC>
JB_AVX2 void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                  int64_t sak, const float* B, int64_t ldb, int64_t bps, float* C,
                  int64_t ldc) {
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

// ------------------------------------------------------------ vector math

// 2^x for x <= 0 (a softmax exponent), ~2 ulp; exactly 0 for x <= -127 (incl.
// -inf): the exponent field of 2^n is then 0, so the product is +0.
JB_AVX2 inline __m256 Exp2(__m256 x) {
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

JB_AVX2 inline float HMax(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif  // JB_X86

// ------------------------------------------------------------------ problem

struct Problem {
  int64_t B, T, S, N, K, G, H, Hv;
  int64_t Hp, Hvp, Sp;  // H, Hv, S rounded up to 16
  float scale2;         // softmax scale * log2(e)
  bool causal;
  int64_t off;
  bool window;
  int64_t left, right;
  const int32_t* q_len;   // [B] or null
  const int32_t* kv_len;  // [B] or null
  const int32_t* q_seg;   // [B, T] or null
  const int32_t* kv_seg;  // [B, S] or null
  int64_t bq, bk;         // tiles (bk % 16 == 0)
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

#if JB_X86
// Sets the logits of row t that it may not see to -inf: keys of block
// [c0, c0 + nc) outside [lo, hi), and keys of another segment.
JB_AVX2 inline void MaskRow(const Problem& p, int64_t b, int64_t t, int64_t lo, int64_t hi,
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

struct FwdScratch {
  std::vector<float> qs, s, acc, m, l;
  std::vector<int64_t> lo, hi;
};

struct FwdCtx {
  const Problem& p;
  const float *q, *kt, *vp;
  float *out, *lse;
  int64_t nq;
};

// One (batch, query head, query block) task. Tasks go head by head, so the
// threads sweep the same head's k / v at the same time (it stays in L3 at long
// lengths); within a head the heaviest blocks (the last ones under a causal
// mask) come first.
JB_AVX2 void FwdTask(const FwdCtx& x, FwdScratch& sc, int64_t task) {
  const Problem& p = x.p;
  const int64_t ldS = p.bk;
  const int64_t bn = task / x.nq, i = x.nq - 1 - task % x.nq;
  const int64_t b = bn / p.N, n = bn % p.N, kh = n / p.G;
  const int64_t t0 = i * p.bq, R = std::min(p.bq, p.T - t0);
  int64_t lo_all = p.S, hi_all = 0;
  for (int64_t r = 0; r < R; ++r) {
    RowRange(p, b, t0 + r, &sc.lo[r], &sc.hi[r]);
    if (sc.hi[r] > sc.lo[r]) {
      lo_all = std::min(lo_all, sc.lo[r]);
      hi_all = std::max(hi_all, sc.hi[r]);
    }
    const float* src = x.q + ((b * p.T + t0 + r) * p.N + n) * p.H;
    for (int64_t d = 0; d < p.H; ++d) sc.qs[r * p.H + d] = src[d] * p.scale2;
    sc.m[r] = -kInf;
    sc.l[r] = 0.f;
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + R * p.Hvp, 0.f);
  const float* ktb = x.kt + (b * p.K + kh) * p.H * p.Sp;
  const float* vpb = x.vp + (b * p.K + kh) * p.Sp * p.Hvp;  // panels of 16 features
  for (int64_t c0 = lo_all / 16 * 16; c0 < hi_all; c0 += p.bk) {
    const int64_t nc = std::min(p.bk, RoundUp(hi_all, 16) - c0);
    float* s = sc.s.data();
    Gemm<false>(R, nc, p.H, sc.qs.data(), p.H, 1, ktb + c0 * p.H, 16, 16 * p.H, s, ldS);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * ldS;
      if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
        MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, sr);
      if (sc.m[r] != -kInf) {
        // One pass against the running max: no rescaling of acc unless this block's max exceeds
        // it by more than 2^kSlack (then the row's scores are recomputed and rescaled as usual).
        // Exponents stay <= kSlack, far from float overflow; lse = m + log2(l) is unchanged.
        constexpr float kSlack = 64.f;
        const __m256 mv = _mm256_set1_ps(sc.m[r]);
        __m256 mx = _mm256_set1_ps(-kInf), sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c += 8) {
          const __m256 sv = _mm256_loadu_ps(sr + c);
          mx = _mm256_max_ps(mx, sv);
          const __m256 e = Exp2(_mm256_min_ps(_mm256_set1_ps(kSlack), _mm256_sub_ps(sv, mv)));
          _mm256_storeu_ps(sr + c, e);
          sum = _mm256_add_ps(sum, e);
        }
        if (HMax(mx) <= sc.m[r] + kSlack) {
          sc.l[r] += HSum(sum);
          continue;
        }
        Gemm<false>(1, nc, p.H, sc.qs.data() + r * p.H, p.H, 1, ktb + c0 * p.H, 16, 16 * p.H, sr,
                    ldS);
        if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
          MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, sr);
      }
      __m256 mx = _mm256_set1_ps(-kInf);
      for (int64_t c = 0; c < nc; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + c));
      const float m_new = std::max(sc.m[r], HMax(mx));
      const float m_use = m_new == -kInf ? 0.f : m_new;
      const __m256 mv = _mm256_set1_ps(m_use);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < nc; c += 8) {
        const __m256 e = Exp2(_mm256_sub_ps(_mm256_loadu_ps(sr + c), mv));
        _mm256_storeu_ps(sr + c, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float alpha = sc.m[r] == -kInf ? 0.f : std::exp2(sc.m[r] - m_use);
      sc.l[r] = alpha * sc.l[r] + HSum(sum);
      sc.m[r] = m_new;
      if (alpha != 1.f) {
        float* ar = sc.acc.data() + r * p.Hvp;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < p.Hvp; d += 8)
          _mm256_storeu_ps(ar + d, _mm256_mul_ps(av, _mm256_loadu_ps(ar + d)));
      }
    }
    Gemm<true>(R, p.Hvp, nc, s, ldS, 1, vpb + c0 * 16, 16, 16 * p.Sp, sc.acc.data(), p.Hvp);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float l = sc.l[r];
    float* dst = x.out + ((b * p.T + t0 + r) * p.N + n) * p.Hv;
    const float inv = l == 0.f ? 0.f : 1.f / l;
    const float* ar = sc.acc.data() + r * p.Hvp;
    for (int64_t d = 0; d < p.Hv; ++d) dst[d] = ar[d] * inv;
    x.lse[(b * p.N + n) * p.T + t0 + r] = l == 0.f ? -kInf : (sc.m[r] + std::log2(l)) * kLn2;
  }
}

void Forward(const Problem& p, const float* q, const float* k, const float* v, float* out,
             float* lse) {
  const int64_t nq = (p.T + p.bq - 1) / p.bq;
  std::vector<float> kt(p.B * p.K * p.H * p.Sp), vp(p.B * p.K * p.Sp * p.Hvp);
  const int threads = ThreadsFor(2.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  ParallelTasks(p.B * p.K, threads, [&](int64_t bkh, int) {
    PackKeys(p, k, p.H, p.Hp, kt.data(), nullptr, bkh);
    PackKeys(p, v, p.Hv, p.Hvp, nullptr, vp.data(), bkh);
  });
  std::vector<FwdScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.qs.resize(p.bq * p.H);
    sc.s.resize(p.bq * p.bk);
    sc.acc.resize(p.bq * p.Hvp);
    sc.m.resize(p.bq);
    sc.l.resize(p.bq);
    sc.lo.resize(p.bq);
    sc.hi.resize(p.bq);
  }
  const FwdCtx x{p, q, kt.data(), vp.data(), out, lse, nq};
  ParallelTasks(p.B * p.N * nq, threads,
                [&](int64_t task, int id) { FwdTask(x, scratch[id], task); });
}

// -------------------------------------------------------------- backward

struct BwdScratch {
  std::vector<float> pm, ds, dka, dva;
  std::vector<int64_t> lo, hi;
};

struct BwdCtx {
  const Problem& p;
  // Per query head bn = b * N + n, packed once: qs[bn][t][0:Hp] = q * scale * log2(e),
  // dos[bn][t][0:Hv] = dO (both zero padded), lse2[bn][t] = lse * log2(e) (+inf where the row
  // sees nothing, so that P = 0), dl[bn][t] = delta.
  const float *qs, *dos, *lse2, *dl, *kt, *kp, *vt;
  float *dk, *dv;
};

// Packs query head bn for the backward (see BwdCtx).
void PackQueries(const Problem& p, const float* q, const float* dout, const float* lse,
                 const float* delta, float* qs, float* dos, float* lse2, float* dl, int64_t bn) {
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
    dl[bn * p.T + t] = delta[bn * p.T + t];
  }
}

// Key block j of (batch b, kv head kh): dK / dV of its keys, dQ into dqb.
// delta = rowsum(dO * O) - dlse; lse of the forward (natural log).
JB_AVX2 void BwdKeyBlock(const BwdCtx& x, BwdScratch& sc, float* dqb, int64_t b, int64_t kh,
                         int64_t j) {
  const Problem& p = x.p;
  const int64_t ldS = p.bk;
  const int64_t c0 = j * p.bk;
  const int64_t nc = std::min(p.bk, p.Sp - c0);
  const int64_t cv = std::min(nc, p.S - c0);  // real keys in the block
  std::fill(sc.dka.begin(), sc.dka.begin() + nc * p.Hp, 0.f);
  std::fill(sc.dva.begin(), sc.dva.begin() + nc * p.Hvp, 0.f);
  int64_t tlo, thi;
  ColRange(p, b, c0, c0 + cv, &tlo, &thi);
  const float* ktb = x.kt + (b * p.K + kh) * p.H * p.Sp + c0 * p.H;
  const float* vtb = x.vt + (b * p.K + kh) * p.Hv * p.Sp + c0 * p.Hv;
  const float* kpb = x.kp + (b * p.K + kh) * p.Sp * p.Hp + c0 * 16;
  for (int64_t g = 0; g < p.G && thi > tlo; ++g) {
    const int64_t n = kh * p.G + g;
    for (int64_t t0 = tlo / p.bq * p.bq; t0 < thi; t0 += p.bq) {
      const int64_t R = std::min(p.bq, p.T - t0);
      for (int64_t r = 0; r < R; ++r) RowRange(p, b, t0 + r, &sc.lo[r], &sc.hi[r]);
      const int64_t row0 = (b * p.N + n) * p.T + t0;
      const float* qs = x.qs + row0 * p.Hp;
      const float* dos = x.dos + row0 * p.Hvp;
      const float* lse2 = x.lse2 + row0;
      const float* dl = x.dl + row0;
      float* pm = sc.pm.data();
      float* ds = sc.ds.data();
      Gemm<false>(R, nc, p.H, qs, p.Hp, 1, ktb, 16, 16 * p.H, pm, ldS);
      Gemm<false>(R, nc, p.Hv, dos, p.Hvp, 1, vtb, 16, 16 * p.Hv, ds, ldS);
      for (int64_t r = 0; r < R; ++r) {
        float* pr = pm + r * ldS;
        float* dr = ds + r * ldS;
        if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
          MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, pr);
        const __m256 l2 = _mm256_set1_ps(lse2[r]);
        const __m256 dlv = _mm256_set1_ps(dl[r]);
        for (int64_t c = 0; c < nc; c += 8) {
          const __m256 e = Exp2(_mm256_sub_ps(_mm256_loadu_ps(pr + c), l2));
          _mm256_storeu_ps(pr + c, e);
          _mm256_storeu_ps(dr + c, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(dr + c), dlv)));
        }
      }
      // dV += P^T dO, dK += dS^T (q * scale * log2 e), dQ += dS K.
      Gemm<true>(nc, p.Hvp, R, pm, 1, ldS, dos, p.Hvp, 16, sc.dva.data(), p.Hvp);
      Gemm<true>(nc, p.Hp, R, ds, 1, ldS, qs, p.Hp, 16, sc.dka.data(), p.Hp);
      Gemm<true>(R, p.Hp, nc, ds, ldS, 1, kpb, 16, 16 * p.Sp,
                 dqb + ((b * p.T + t0) * p.N + n) * p.Hp, p.N * p.Hp);
    }
  }
  for (int64_t c = 0; c < cv; ++c) {
    float* kd = x.dk + ((b * p.S + c0 + c) * p.K + kh) * p.H;
    float* vd = x.dv + ((b * p.S + c0 + c) * p.K + kh) * p.Hv;
    const float* ka = sc.dka.data() + c * p.Hp;
    const float* va = sc.dva.data() + c * p.Hvp;
    for (int64_t d = 0; d < p.H; ++d) kd[d] = ka[d] * kLn2;
    std::memcpy(vd, va, p.Hv * 4);
  }
}

void Backward(const Problem& p, const float* q, const float* k, const float* v,
              const float* dout, const float* lse, const float* delta, float* dq, float* dk,
              float* dv) {
  const int64_t nk = (p.S + p.bk - 1) / p.bk;
  std::vector<float> kt(p.B * p.K * p.H * p.Sp), kp(p.B * p.K * p.Sp * p.Hp),
      vt(p.B * p.K * p.Hv * p.Sp);
  const int threads = ThreadsFor(5.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  ParallelTasks(p.B * p.K, threads, [&](int64_t bkh, int) {
    PackKeys(p, k, p.H, p.Hp, kt.data(), kp.data(), bkh);
    PackKeys(p, v, p.Hv, p.Hvp, vt.data(), nullptr, bkh);
  });
  const int64_t heads = p.B * p.N;
  std::vector<float> qs(heads * p.T * p.Hp), dos(heads * p.T * p.Hvp), lse2(heads * p.T),
      dl(heads * p.T);
  ParallelTasks(heads, threads, [&](int64_t bn, int) {
    PackQueries(p, q, dout, lse, delta, qs.data(), dos.data(), lse2.data(), dl.data(), bn);
  });
  // Whole (batch, kv head) tasks own their dQ rows: one dQ buffer. With too
  // few of them to keep the threads busy, tasks are key blocks and every
  // thread accumulates dQ in a buffer of its own (summed at the end).
  const int64_t groups = p.B * p.K;
  const bool whole = threads == 1 || groups >= 4 * threads || groups % threads == 0;
  const int nbuf = whole ? 1 : threads;
  const int64_t qsize = p.B * p.T * p.N * p.Hp;
  std::vector<float> dqbuf(nbuf * qsize, 0.f);
  std::vector<BwdScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.pm.resize(p.bq * p.bk);
    sc.ds.resize(p.bq * p.bk);
    sc.dka.resize(p.bk * p.Hp);
    sc.dva.resize(p.bk * p.Hvp);
    sc.lo.resize(p.bq);
    sc.hi.resize(p.bq);
  }
  const BwdCtx x{p, qs.data(), dos.data(), lse2.data(), dl.data(), kt.data(), kp.data(),
                 vt.data(), dk, dv};
  if (whole) {
    ParallelTasks(groups, threads, [&](int64_t task, int id) {
      for (int64_t j = 0; j < nk; ++j)
        BwdKeyBlock(x, scratch[id], dqbuf.data(), task / p.K, task % p.K, j);
    });
  } else {
    // Heaviest key blocks (the first ones under a causal mask) first. Static assignment: each
    // thread's dQ buffer always sums the same blocks in the same order, so dQ is reproducible.
    StaticTasks(groups * nk, threads, [&](int64_t task, int id) {
      const int64_t j = task / groups, bkh = task % groups;
      BwdKeyBlock(x, scratch[id], dqbuf.data() + id * qsize, bkh / p.K, bkh % p.K, j);
    });
  }
  // dq = scale * the sum of the buffers (dS is in natural-log units).
  const float sc = p.scale2 * kLn2;
  const int64_t rows = p.B * p.T * p.N;
  ParallelTasks(threads, threads, [&](int64_t part, int) {
    const int64_t r0 = rows * part / threads, r1 = rows * (part + 1) / threads;
    for (int64_t r = r0; r < r1; ++r) {
      float* dst = dq + r * p.H;
      for (int64_t d = 0; d < p.H; ++d) {
        float acc = 0.f;
        for (int i = 0; i < nbuf; ++i) acc += dqbuf[i * qsize + r * p.Hp + d];
        dst[d] = acc * sc;
      }
    }
  });
}
#endif  // JB_X86

// ------------------------------------------------------------ FFI handlers

ffi::Error MakeProblem(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
                       const ffi::Buffer<ffi::F32>& v, const ffi::Buffer<ffi::S32>& q_len,
                       const ffi::Buffer<ffi::S32>& kv_len, const ffi::Buffer<ffi::S32>& q_seg,
                       const ffi::Buffer<ffi::S32>& kv_seg, float scale, bool causal,
                       int64_t diag_offset, bool window, int64_t left, int64_t right,
                       bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                       int64_t block_k, Problem* p) {
#if !JB_X86
  return ffi::Error::Internal("flash attention: the C++ kernel needs x86-64 with AVX2");
#else
  if (!HasAvx2()) return ffi::Error::Internal("flash attention: this CPU has no AVX2 + FMA");
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
  p->causal = causal;
  p->off = diag_offset;
  p->window = window;
  p->left = left;
  p->right = right;
  p->q_len = has_q_len ? q_len.typed_data() : nullptr;
  p->kv_len = has_kv_len ? kv_len.typed_data() : nullptr;
  p->q_seg = has_seg ? q_seg.typed_data() : nullptr;
  p->kv_seg = has_seg ? kv_seg.typed_data() : nullptr;
  if ((has_q_len && q_len.element_count() != p->B) ||
      (has_kv_len && kv_len.element_count() != p->B) ||
      (has_seg && (q_seg.element_count() != p->B * p->T || kv_seg.element_count() != p->B * p->S)))
    return ffi::Error::InvalidArgument("flash attention: bad lengths / segment ids shapes");
  p->bq = block_q;
  p->bk = block_k;
  return ffi::Error::Success();
#endif
}

ffi::Error FwdImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, float scale,
                   bool causal, int64_t diag_offset, bool window, int64_t left, int64_t right,
                   bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                   int64_t block_k) {
  Problem p;
  ffi::Error e = MakeProblem(q, k, v, q_len, kv_len, q_seg, kv_seg, scale, causal, diag_offset,
                             window, left, right, has_q_len, has_kv_len, has_seg, block_q,
                             block_k, &p);
  if (e.failure()) return e;
#if JB_X86
  if (p.B * p.T * p.N == 0) return ffi::Error::Success();
  return jb::CatchErrors("flash attention", [&] {
    Forward(p, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
            lse->typed_data());
  });
#else
  return ffi::Error::Success();
#endif
}

ffi::Error BwdImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> lse,
                   ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> q_seg,
                   ffi::Buffer<ffi::S32> kv_seg, ffi::ResultBuffer<ffi::F32> dq,
                   ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                   bool causal, int64_t diag_offset, bool window, int64_t left, int64_t right,
                   bool has_q_len, bool has_kv_len, bool has_seg, int64_t block_q,
                   int64_t block_k) {
  Problem p;
  ffi::Error e = MakeProblem(q, k, v, q_len, kv_len, q_seg, kv_seg, scale, causal, diag_offset,
                             window, left, right, has_q_len, has_kv_len, has_seg, block_q,
                             block_k, &p);
  if (e.failure()) return e;
#if JB_X86
  std::memset(dq->typed_data(), 0, dq->element_count() * 4);
  std::memset(dk->typed_data(), 0, dk->element_count() * 4);
  std::memset(dv->typed_data(), 0, dv->element_count() * 4);
  if (p.B * p.T * p.N == 0 || p.S == 0) return ffi::Error::Success();
  return jb::CatchErrors("flash attention", [&] {
    Backward(p, q.typed_data(), k.typed_data(), v.typed_data(), dout.typed_data(),
             lse.typed_data(), delta.typed_data(), dq->typed_data(), dk->typed_data(),
             dv->typed_data());
  });
#else
  return ffi::Error::Success();
#endif
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
      .Attr<int64_t>("block_k")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbFlashFwdF32, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JB_FLASH_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbFlashBwdF32, BwdImpl,
                              ffi::Ffi::Bind()
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JB_FLASH_ATTRS);

// 1 when this build and CPU can run the kernels (x86-64 with AVX2 + FMA).
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
