// Int4 matmul CPU kernels for jbackends, registered with XLA through the FFI.
//
// Weights are the packed layout of `pallas_kernels.int4_matmul.base`:
// uint8 [N, K/2], two nibbles per byte, the low nibble is the even k, the
// nibble stores q + 8 with q in -8..7; scales float32 [N, K/groupsize].
//
// Two handlers:
//   jb_int4_dyn_quant_matmul_f32: torch's `_dyn_quant_matmul_4bit` numerics
//     (PyTorch PR 134124 reference kernels, bit-exact): each input row is
//     quantized to int8 asymmetrically over all of K (KleidiAI qai8dx rule),
//     `(qa - zp) * q` is accumulated in int32 per group, groups are summed in
//     fp32 in order multiplied by the weight scale, then multiplied by 1/scale,
//     then the bias is added. No FMA contraction anywhere (-ffp-contract=off).
//   jb_int4_matmul_f32: weight-only (W4A32): out = x @ dequant(w).T in fp32,
//     summation order unspecified (float tolerance only).
//
// The integer dot uses u = q + 8 (0..15, unsigned) against the signed int8
// activations qa, so that one `vpdpbusd` (AVX512-VNNI) or `vpmaddubsw` +
// `vpmaddwd` (AVX512BW) step handles 64 bytes (32 bytes with AVX2
// `vpmaddubsw` + `vpmaddwd` on ymm registers); the zero-point terms are
// restored exactly per 32-k block:
//   sum (qa - zp) (u - 8) = sum qa u - zp sum u - 8 sum qa + 8 zp * 32.
// Low nibbles pair with the even-k activations and high nibbles with the odd
// ones, so the activations are de-interleaved once per row instead of
// shuffling the weights.
//
// Code paths, picked at run time (JbInt4SetIsa overrides): AVX512-VNNI,
// AVX512BW, AVX2 + FMA (CPUs without AVX-512), scalar.
#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jb::HasAvx2;
using jb::HasAvx512;
using jb::HasAvx512Vnni;
using jb::HSum;
using jb::RoundUp;

// ---------------------------------------------------------------- threading

// Threads for `work` (weight bytes x rows): one below ~256K, where the thread
// start-up dominates.
int NumThreads(int64_t work) {
  static const int hw = jb::HardwareThreads(64);
  if (work < (int64_t{1} << 18)) return 1;
  return hw;
}

// ------------------------------------------------------ activation quantizer

// One quantized input row: the de-interleaved int8 values, the per-32-block
// sums of qa, the zero point and the reciprocal scale. The arrays are
// zero-padded to whole AVX2 steps (kPadBytes bytes, kPadBytes / 16 blocks) so
// that the AVX2 path, which has no masked byte loads, reads them unmasked.
constexpr int64_t kPadBytes = 128;

struct QRow {
  std::vector<int8_t> even, odd;  // [K/2] each, padded to kPadBytes
  std::vector<int32_t> block_sum;  // [K/32], padded to kPadBytes / 16
  int32_t zp;
  float recip;
};

// KleidiAI qai8dx, exactly as torch's reference kernels write it. The range
// scan differs between torch's float32 kernel (std::max(x, acc): a NaN x
// replaces acc, the next element replaces the NaN) and its bfloat16 one
// (skip_nan: a NaN x leaves acc as it was).
void QuantizeRow(const float* x, int64_t K, bool channelwise, bool skip_nan, QRow* r) {
  float mx = -FLT_MAX, mn = FLT_MAX;
  for (int64_t k = 0; k < K; ++k) {
    if (skip_nan && std::isnan(x[k])) continue;
    mx = std::max(x[k], mx);
    mn = std::min(x[k], mn);
  }
  const float qmin = -128.f, qmax = 127.f;
  const float rmin = std::min(0.0f, mn);
  const float rmax = std::max(0.0f, mx);
  const float scale = rmin == rmax ? 1.f : (qmax - qmin) / (rmax - rmin);
  const float recip = scale ? 1.0f / scale : 0.0f;
  const float dmin = rmin * scale;
  const float dmax = rmax * scale;
  bool from_min;
  if (channelwise) {
    const float e_min = qmin + dmin;
    const float e_max = qmax + dmax;
    from_min = e_min + e_max > 0;
  } else {
    from_min = qmin + dmin + qmax + dmax > 0;
  }
  float zpf = from_min ? qmin - dmin : qmax - dmax;
  zpf = std::min(std::max(zpf, qmin), qmax);
  const int32_t zp = static_cast<int32_t>(std::lrintf(zpf));
  r->zp = zp;
  r->recip = recip;
  r->even.assign(RoundUp(K / 2, kPadBytes), 0);
  r->odd.assign(RoundUp(K / 2, kPadBytes), 0);
  r->block_sum.assign(RoundUp(K / 32, kPadBytes / 16), 0);
  for (int64_t k = 0; k < K; ++k) {
    int32_t v = static_cast<int32_t>(std::round(x[k] * scale)) + zp;
    v = std::max(std::min(v, 127), -128);
    if (k & 1)
      r->odd[k >> 1] = static_cast<int8_t>(v);
    else
      r->even[k >> 1] = static_cast<int8_t>(v);
    r->block_sum[k >> 5] += v;
  }
}

// ---------------------------------------------------------- 32-k block dots
//
// BlockDots(w, rows, nm, K, dots): for one weight row `w` ([K/2] bytes) and
// nm <= kRowBlock quantized rows, writes the exact int32
//   dots[j * kRowBlock + m] = sum_{k in 32-block j} (qa_k - zp_m) * q_k
// (block-major, so that the float tail runs with one SIMD lane per row m).

constexpr int kRowBlock = 16;  // input rows sharing one pass over a weight row

void BlockDotsScalar(const uint8_t* w, const QRow* const* rows, int nm,
                     int64_t K, int32_t* dots) {
  const int64_t nb = K / 32;
  for (int64_t j = 0; j < nb; ++j) {
    int32_t su = 0;
    const uint8_t* wb = w + j * 16;
    for (int i = 0; i < 16; ++i) su += (wb[i] & 15) + (wb[i] >> 4);
    for (int m = 0; m < nm; ++m) {
      const int8_t* e = rows[m]->even.data() + j * 16;
      const int8_t* o = rows[m]->odd.data() + j * 16;
      int32_t d = 0;
      for (int i = 0; i < 16; ++i) d += (wb[i] & 15) * e[i] + (wb[i] >> 4) * o[i];
      const int32_t zp = rows[m]->zp;
      dots[j * kRowBlock + m] = d - zp * su - 8 * rows[m]->block_sum[j] + 8 * zp * 32;
    }
  }
}

// out[m] = sum_{g} float(isum_g) * s[g], * recip[m] (+ bias), clamped: torch's
// float tail, in order, no FMA.
void TailScalar(const int32_t* dots, int64_t nb, int64_t per_group,
                bool channelwise, const float* s, const float* recip,
                const float* bias, int nm, float* out) {
  for (int m = 0; m < nm; ++m) {
    float acc;
    if (channelwise) {
      int32_t iacc = 0;
      for (int64_t j = 0; j < nb; ++j) iacc += dots[j * kRowBlock + m];
      acc = static_cast<float>(iacc) * s[0];
    } else {
      acc = 0.0f;
      for (int64_t g = 0; g < nb / per_group; ++g) {
        int32_t iacc = 0;
        for (int64_t j = 0; j < per_group; ++j)
          iacc += dots[(g * per_group + j) * kRowBlock + m];
        acc += static_cast<float>(iacc) * s[g];
      }
    }
    acc = acc * recip[m];
    if (bias) acc += *bias;
    acc = std::max(acc, -FLT_MAX);
    acc = std::min(acc, FLT_MAX);
    out[m] = acc;
  }
}

// TailScalar for a single row whose block sums are contiguous (dots[j]).
float TailOne(const int32_t* dots, int64_t nb, int64_t per_group,
              bool channelwise, const float* s, float recip, const float* bias) {
  float acc;
  if (channelwise) {
    int32_t iacc = 0;
    for (int64_t j = 0; j < nb; ++j) iacc += dots[j];
    acc = static_cast<float>(iacc) * s[0];
  } else {
    acc = 0.0f;
    for (int64_t g = 0; g < nb / per_group; ++g) {
      int32_t iacc = 0;
      for (int64_t j = 0; j < per_group; ++j) iacc += dots[g * per_group + j];
      acc += static_cast<float>(iacc) * s[g];
    }
  }
  acc = acc * recip;
  if (bias) acc += *bias;
  acc = std::max(acc, -FLT_MAX);
  return std::min(acc, FLT_MAX);
}

#if JB_X86
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline __m512i
DotVnni(__m512i acc, __m512i u, __m512i a) {
  return _mm512_dpbusd_epi32(acc, u, a);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i DotBw(
    __m512i acc, __m512i u, __m512i a) {
  const __m512i ones = _mm512_set1_epi16(1);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), ones));
}

// Four 16 x int32 vectors (four 64-byte chunks, each 128-bit lane one 32-k
// block) -> the 16 block sums in order.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i
ReduceBlocks(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  // r[4 l + i] = sum of lane l of vector i; we want [4 i + l].
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(idx, r);
}

// dst + q * kRowBlock <- column q of the 16 x 16 int32 matrix src (row m =
// src + 16 m), for q < nq: the rows-major block sums of 16 input rows become
// the block-major layout of the tail. The standard unpack / shuffle network.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void
StoreTransposed16(const int32_t* src, int32_t* dst, int nq) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
  for (int q = 0; q < nq; ++q) _mm512_storeu_si512(dst + q * kRowBlock, r[q]);
}

// The same body compiled twice: with and without AVX512-VNNI. 256 weight
// bytes (512 k, 16 blocks) per step; the tail is masked.
#define JB_DEFINE_BLOCK_DOTS(NAME, TARGET, DOT)                                 \
  __attribute__((target(TARGET))) void NAME(                                   \
      const uint8_t* w, const QRow* const* rows, int nm, int64_t K,            \
      int32_t* dots) {                                                         \
    const int64_t bytes = K / 2;                                               \
    const __m512i mask4 = _mm512_set1_epi8(0x0F);                              \
    const __m512i ones8 = _mm512_set1_epi8(1);                                 \
    const __m512i zero = _mm512_setzero_si512();                               \
    alignas(64) int32_t tmp[16 * 16] = {0}; /* rows m >= nm stay 0 */       \
    for (int64_t c = 0; c < bytes; c += 256) {                                 \
      __mmask64 lm[4];                                                         \
      __m512i lo[4], hi[4];                                                    \
      for (int i = 0; i < 4; ++i) {                                            \
        const int64_t left = bytes - c - 64 * i;                               \
        lm[i] = left >= 64 ? ~__mmask64{0}                                     \
                           : (left <= 0 ? __mmask64{0}                         \
                                        : ((__mmask64{1} << left) - 1));       \
        const __m512i wv = _mm512_maskz_loadu_epi8(lm[i], w + c + 64 * i);     \
        lo[i] = _mm512_and_si512(wv, mask4);                                   \
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask4);             \
      }                                                                        \
      const int64_t nq_left = (bytes - c) / 16;                                \
      const __mmask16 qm = nq_left >= 16                                       \
                               ? static_cast<__mmask16>(0xFFFF)                \
                               : static_cast<__mmask16>((1u << nq_left) - 1);  \
      /* sum of u per block: lo + hi <= 30 still fits a byte */             \
      const __m512i su = ReduceBlocks(                                         \
          DOT(zero, _mm512_add_epi8(lo[0], hi[0]), ones8),                     \
          DOT(zero, _mm512_add_epi8(lo[1], hi[1]), ones8),                     \
          DOT(zero, _mm512_add_epi8(lo[2], hi[2]), ones8),                     \
          DOT(zero, _mm512_add_epi8(lo[3], hi[3]), ones8));                    \
      const int64_t j0 = c / 16;                                               \
      for (int m = 0; m < nm; ++m) {                                           \
        const QRow* r = rows[m];                                               \
        const int8_t* e = r->even.data() + c;                                  \
        const int8_t* o = r->odd.data() + c;                                   \
        __m512i d[4];                                                          \
        for (int i = 0; i < 4; ++i) {                                          \
          const __m512i ae = _mm512_maskz_loadu_epi8(lm[i], e + 64 * i);       \
          const __m512i ao = _mm512_maskz_loadu_epi8(lm[i], o + 64 * i);       \
          d[i] = DOT(DOT(zero, lo[i], ae), hi[i], ao);                         \
        }                                                                      \
        const __m512i zp = _mm512_set1_epi32(r->zp);                           \
        __m512i v = ReduceBlocks(d[0], d[1], d[2], d[3]);                      \
        v = _mm512_sub_epi32(v, _mm512_mullo_epi32(zp, su));                   \
        const __m512i bs = _mm512_maskz_loadu_epi32(qm, r->block_sum.data() + j0); \
        v = _mm512_sub_epi32(v, _mm512_slli_epi32(bs, 3));                     \
        v = _mm512_add_epi32(v, _mm512_slli_epi32(zp, 8));                     \
        if (nm == 1) /* one row: block sums contiguous (see TailOne) */        \
          _mm512_mask_storeu_epi32(dots + j0, qm, v);                          \
        else                                                                   \
          _mm512_storeu_si512(tmp + 16 * m, v);                                \
      }                                                                        \
      if (nm > 1)                                                              \
        StoreTransposed16(tmp, dots + j0 * kRowBlock,                          \
                          static_cast<int>(std::min<int64_t>(16, nq_left)));   \
    }                                                                          \
  }

JB_DEFINE_BLOCK_DOTS(BlockDotsAvx512Vnni, "avx512f,avx512bw,avx512vl,avx512vnni", DotVnni)
JB_DEFINE_BLOCK_DOTS(BlockDotsAvx512Bw, "avx512f,avx512bw,avx512vl", DotBw)
#undef JB_DEFINE_BLOCK_DOTS

// TailScalar with one lane per row m (the same operations per lane).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void TailAvx512(
    const int32_t* dots, int64_t nb, int64_t per_group, bool channelwise,
    const float* s, const float* recip, const float* bias, int nm, float* out) {
  static_assert(kRowBlock == 16, "one zmm of rows");
  __m512 acc;
  if (channelwise) {
    __m512i iacc = _mm512_setzero_si512();
    for (int64_t j = 0; j < nb; ++j)
      iacc = _mm512_add_epi32(iacc, _mm512_loadu_si512(dots + j * kRowBlock));
    acc = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(s[0]));
  } else {
    acc = _mm512_setzero_ps();
    const int64_t G = nb / per_group;
    for (int64_t g = 0; g < G; ++g) {
      const int32_t* d = dots + g * per_group * kRowBlock;
      __m512i iacc = _mm512_loadu_si512(d);
      for (int64_t j = 1; j < per_group; ++j)
        iacc = _mm512_add_epi32(iacc, _mm512_loadu_si512(d + j * kRowBlock));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(s[g])));
    }
  }
  acc = _mm512_mul_ps(acc, _mm512_loadu_ps(recip));
  if (bias) acc = _mm512_add_ps(acc, _mm512_set1_ps(*bias));
  // std::max(acc, lo) / std::min(acc, hi) keep a NaN acc: max_ps/min_ps
  // return their second operand when either is NaN.
  acc = _mm512_max_ps(_mm512_set1_ps(-FLT_MAX), acc);
  acc = _mm512_min_ps(_mm512_set1_ps(FLT_MAX), acc);
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << nm) - 1), acc);
}

// ------------------------------------------------- AVX2 (no AVX-512) paths
//
// The AVX512BW algorithm on 256-bit registers: each 128-bit lane of a ymm
// holds one 32-k block (16 weight bytes), a step covers 128 weight bytes (four
// ymm, 8 blocks). AVX2 has no masked byte loads, so the last partial step
// reads the weight through a zero-padded copy and the activations from the
// zero padding of QRow (u = 0 and qa = 0 there; the blocks past K/32 are
// computed but never read).

// The block dot of the low and high nibbles at once: vpmaddubsw gives
// |u0 a0 + u1 a1| <= 2 * 15 * 128 = 3840 per int16, so the sum of the two
// products (<= 7680) cannot wrap and one vpmaddwd widens both.
__attribute__((target("avx2,fma"))) inline __m256i DotAvx2(__m256i lo, __m256i ae,
                                                           __m256i hi, __m256i ao) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  return _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(lo, ae), _mm256_maddubs_epi16(hi, ao)), ones16);
}

// Four 8 x int32 vectors (four 32-byte chunks, each 128-bit lane one 32-k
// block) -> the 8 block sums in order (the ReduceBlocks of the AVX2 path).
__attribute__((target("avx2,fma"))) inline __m256i ReduceBlocksAvx2(__m256i a, __m256i b,
                                                                    __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  const __m256i r = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  // r[4 l + i] = sum of lane l of vector i; block 2 i + l wants [2 i + l].
  return _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// dst + q * kRowBlock <- column q of the 8 x 8 int32 matrix src (row m =
// src + 8 m), for q < nq. The standard unpack / permute2x128 network.
__attribute__((target("avx2,fma"))) inline void StoreTransposed8(const int32_t* src,
                                                                 int32_t* dst, int nq) {
  __m256i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + 8 * i));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[h + c] = column c (low lane) and column c + 4 (high lane) of rows h..h+3
  for (int h = 0; h < 8; h += 4) {
    r[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    r[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    r[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    r[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x20);
    t[c + 4] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x31);
  }
  for (int q = 0; q < nq; ++q)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * kRowBlock), t[q]);
}

// BlockDots on AVX2. 128 weight bytes (256 k, 8 blocks) per step.
__attribute__((target("avx2,fma"))) void BlockDotsAvx2(const uint8_t* w,
                                                       const QRow* const* rows, int nm,
                                                       int64_t K, int32_t* dots) {
  const int64_t bytes = K / 2;
  const __m256i mask4 = _mm256_set1_epi8(0x0F);
  const __m256i ones8 = _mm256_set1_epi8(1);
  alignas(32) uint8_t wpad[kPadBytes];
  alignas(32) int32_t tmp[kRowBlock * 8] = {0};  // rows m >= nm stay 0
  for (int64_t c = 0; c < bytes; c += kPadBytes) {
    const uint8_t* wc = w + c;
    const int64_t left = bytes - c;
    if (left < kPadBytes) {  // the last partial step: zero-padded copy
      std::memset(wpad, 0, sizeof(wpad));
      std::memcpy(wpad, wc, static_cast<size_t>(left));
      wc = wpad;
    }
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * i));
      lo[i] = _mm256_and_si256(wv, mask4);
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask4);
    }
    const int nq = static_cast<int>(std::min<int64_t>(8, left / 16));
    // sum of u per block: lo + hi <= 30 still fits a byte
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i sb[4];
    for (int i = 0; i < 4; ++i)
      sb[i] = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_add_epi8(lo[i], hi[i]), ones8), ones16);
    const __m256i su = ReduceBlocksAvx2(sb[0], sb[1], sb[2], sb[3]);
    const int64_t j0 = c / 16;
    for (int m = 0; m < nm; ++m) {
      const QRow* r = rows[m];
      const int8_t* e = r->even.data() + c;  // in the kPadBytes padding
      const int8_t* o = r->odd.data() + c;
      __m256i d[4];
      for (int i = 0; i < 4; ++i)
        d[i] = DotAvx2(lo[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + 32 * i)),
                       hi[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 * i)));
      const __m256i zp = _mm256_set1_epi32(r->zp);
      __m256i v = ReduceBlocksAvx2(d[0], d[1], d[2], d[3]);
      v = _mm256_sub_epi32(v, _mm256_mullo_epi32(zp, su));
      const __m256i bs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r->block_sum.data() + j0));
      v = _mm256_sub_epi32(v, _mm256_slli_epi32(bs, 3));
      v = _mm256_add_epi32(v, _mm256_slli_epi32(zp, 8));
      // Full 8-block stores: `dots` has 16 blocks of slack past K/32.
      if (nm == 1)  // one row: block sums contiguous (see TailOne)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + j0), v);
      else
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * m), v);
    }
    if (nm > 1) {  // rows 0..7, then rows 8..15 when present
      StoreTransposed8(tmp, dots + j0 * kRowBlock, nq);
      if (nm > 8) StoreTransposed8(tmp + 64, dots + j0 * kRowBlock + 8, nq);
    }
  }
}

// TailScalar with one lane per row m, 8 rows per ymm (the same operations per
// lane; the fp32 group sum stays in order, mul and add are not fused).
__attribute__((target("avx2,fma"))) void TailAvx2(const int32_t* dots, int64_t nb,
                                                  int64_t per_group, bool channelwise,
                                                  const float* s, const float* recip,
                                                  const float* bias, int nm, float* out) {
  for (int h = 0; h < nm; h += 8) {
    const int32_t* dh = dots + h;
    __m256 acc;
    if (channelwise) {
      __m256i iacc = _mm256_setzero_si256();
      for (int64_t j = 0; j < nb; ++j)
        iacc = _mm256_add_epi32(
            iacc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + j * kRowBlock)));
      acc = _mm256_mul_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(s[0]));
    } else {
      acc = _mm256_setzero_ps();
      const int64_t G = nb / per_group;
      for (int64_t g = 0; g < G; ++g) {
        const int32_t* d = dh + g * per_group * kRowBlock;
        __m256i iacc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d));
        for (int64_t j = 1; j < per_group; ++j)
          iacc = _mm256_add_epi32(
              iacc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + j * kRowBlock)));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(s[g])));
      }
    }
    acc = _mm256_mul_ps(acc, _mm256_loadu_ps(recip + h));
    if (bias) acc = _mm256_add_ps(acc, _mm256_set1_ps(*bias));
    // NaN-preserving clamp, as in TailAvx512.
    acc = _mm256_max_ps(_mm256_set1_ps(-FLT_MAX), acc);
    acc = _mm256_min_ps(_mm256_set1_ps(FLT_MAX), acc);
    const int n = std::min(8, nm - h);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(out + h, lanes, acc);
  }
}
#endif

using BlockDotsFn = void (*)(const uint8_t*, const QRow* const*, int, int64_t,
                             int32_t*);
using TailFn = void (*)(const int32_t*, int64_t, int64_t, bool, const float*,
                        const float*, const float*, int, float*);

BlockDotsFn PickBlockDots() {
#if JB_X86
  if (HasAvx512()) {
    if (HasAvx512Vnni()) return &BlockDotsAvx512Vnni;
    return &BlockDotsAvx512Bw;
  }
  if (HasAvx2()) return &BlockDotsAvx2;
#endif
  return &BlockDotsScalar;
}

TailFn PickTail() {
#if JB_X86
  if (HasAvx512()) return &TailAvx512;
  if (HasAvx2()) return &TailAvx2;
#endif
  return &TailScalar;
}

std::atomic<BlockDotsFn> g_block_dots{PickBlockDots()};
std::atomic<TailFn> g_tail{PickTail()};

const char* BlockDotsName() {
  BlockDotsFn f = g_block_dots.load();
#if JB_X86
  if (f == &BlockDotsAvx512Vnni) return "avx512vnni";
  if (f == &BlockDotsAvx512Bw) return "avx512bw";
  if (f == &BlockDotsAvx2) return "avx2";
#endif
  (void)f;
  return "scalar";
}

// ------------------------------------------- group path (groupsize % 128 == 0)
//
// The block path above reduces every 32-k block and sums the blocks of a group
// in scalar code. When a group is whole 64-byte chunks (groupsize a multiple
// of 128) the integer dot of a group accumulates in one vector instead, with
// the zero point folded into the same dot:
//   sum (qa - zp) (u - 8) = sum qa u + (-zp) sum u + c_g,
//   c_g = -8 sum_{k in g} qa + 8 zp groupsize (per input row, computed once),
// where (-zp) sum u is one more u8 x s8 dot of (lo + hi) against -zp (split as
// 127 + 1 when zp = -128). 16 group vectors are reduced at once, and the float
// tail (products with the scales in one multiply, then the in-order fp32 sum)
// follows torch's order exactly. MR input rows share every weight load.

// The per-row constants of the group path.
struct GroupRow {
  const int8_t* even;
  const int8_t* odd;
  const int32_t* c;  // [G] c_g
  int8_t nz1, nz2;   // nz1 + nz2 = -zp, both int8
};

#if JB_X86
// Sixteen 16 x int32 vectors (src + 16 i) -> the 16 full sums in order.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i Reduce16(const int32_t* src) {
  __m512i r[4];
  for (int q = 0; q < 4; ++q) {
    const __m512i a = _mm512_load_si512(src + 64 * q);
    const __m512i b = _mm512_load_si512(src + 64 * q + 16);
    const __m512i c = _mm512_load_si512(src + 64 * q + 32);
    const __m512i d = _mm512_load_si512(src + 64 * q + 48);
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    // r[q][4 l + i] = sum of 128-bit lane l of vector 4 q + i
    r[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  }
  const __m512i u01 = _mm512_add_epi32(_mm512_shuffle_i32x4(r[0], r[1], 0x44),
                                       _mm512_shuffle_i32x4(r[0], r[1], 0xEE));
  const __m512i u23 = _mm512_add_epi32(_mm512_shuffle_i32x4(r[2], r[3], 0x44),
                                       _mm512_shuffle_i32x4(r[2], r[3], 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(u01, u23, 0x88), _mm512_shuffle_i32x4(u01, u23, 0xDD));
}

struct VnniDot {
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __m512i Dot3(
      __m512i acc, __m512i lo, __m512i ae, __m512i hi, __m512i ao, __m512i su, __m512i nz) {
    acc = _mm512_dpbusd_epi32(acc, lo, ae);
    acc = _mm512_dpbusd_epi32(acc, hi, ao);
    return _mm512_dpbusd_epi32(acc, su, nz);
  }
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __m512i Dot1(
      __m512i acc, __m512i su, __m512i nz) {
    return _mm512_dpbusd_epi32(acc, su, nz);
  }
};

// Without VNNI: |lo ae| + |hi ao| pairs <= 2 * 3840, |su nz| pairs <= 7680:
// the int16 sum of the three vpmaddubsw cannot wrap.
struct BwDot {
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512i Dot3(
      __m512i acc, __m512i lo, __m512i ae, __m512i hi, __m512i ao, __m512i su, __m512i nz) {
    const __m512i p = _mm512_add_epi16(
        _mm512_add_epi16(_mm512_maddubs_epi16(lo, ae), _mm512_maddubs_epi16(hi, ao)),
        _mm512_maddubs_epi16(su, nz));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
  }
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512i Dot1(
      __m512i acc, __m512i su, __m512i nz) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(su, nz), _mm512_set1_epi16(1)));
  }
};

// How far ahead of its loads the one-row kernels prefetch the weight stream
// (no fault past the end of the array): the hardware prefetchers alone left
// one core at ~14 GB/s of packed weight from L3 on a 2-core Emerald Rapids,
// 16-18 with 1-4 KiB (single-thread medians of interleaved runs, 4096 x 11008).
constexpr int64_t kPrefetchBytes = 2048;

// isum[m * Gp + g] = exact sum over group g of (qa - zp)(u - 8), for MR rows
// and one weight row w (K / 2 bytes). Gp = RoundUp(G, 16). One body, compiled
// for each target (the dot's instructions must not leak into the other).
#define JB_DEFINE_GROUP_SUMS(NAME, TARGET, D)                                        \
  template <int MR, bool kTwo>                                                       \
  __attribute__((target(TARGET))) void NAME(const uint8_t* w, const GroupRow* rows,  \
                                            int64_t K, int64_t groupsize,            \
                                            int32_t* isum) {                         \
    const int64_t cpg = groupsize / 128; /* 64-byte chunks per group */              \
    const int64_t G = K / groupsize;                                                 \
    const int64_t Gp = RoundUp(G, 16);                                               \
    const __m512i mask4 = _mm512_set1_epi8(0x0F);                                    \
    alignas(64) int32_t buf[MR][16 * 16];                                            \
    __m512i nz[MR], nz2[MR];                                                         \
    const int8_t* ev[MR];                                                            \
    const int8_t* od[MR];                                                            \
    for (int m = 0; m < MR; ++m) {                                                   \
      nz[m] = _mm512_set1_epi8(rows[m].nz1);                                         \
      nz2[m] = _mm512_set1_epi8(rows[m].nz2);                                        \
      ev[m] = rows[m].even;                                                          \
      od[m] = rows[m].odd;                                                           \
    }                                                                                \
    for (int64_t g0 = 0; g0 < G; g0 += 16) {                                         \
      const int ng = static_cast<int>(std::min<int64_t>(16, G - g0));                \
      for (int gi = 0; gi < 16; ++gi) {                                              \
        __m512i acc[MR];                                                             \
        for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_si512();                \
        const int64_t off0 = (g0 + gi) * cpg * 64;                                   \
        const int64_t off1 = gi < ng ? off0 + cpg * 64 : off0;                       \
        for (int64_t off = off0; off < off1; off += 64) {                            \
          _mm_prefetch(reinterpret_cast<const char*>(w + off + kPrefetchBytes),      \
                       _MM_HINT_T0);                                                 \
          const __m512i wv = _mm512_loadu_si512(w + off);                            \
          const __m512i lo = _mm512_and_si512(wv, mask4);                            \
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask4);      \
          const __m512i su = _mm512_add_epi8(lo, hi); /* <= 30 */                    \
          for (int m = 0; m < MR; ++m) {                                             \
            acc[m] = D::Dot3(acc[m], lo, _mm512_loadu_si512(ev[m] + off), hi,        \
                             _mm512_loadu_si512(od[m] + off), su, nz[m]);            \
            if (kTwo) acc[m] = D::Dot1(acc[m], su, nz2[m]);                          \
          }                                                                          \
        }                                                                            \
        for (int m = 0; m < MR; ++m) _mm512_store_si512(buf[m] + 16 * gi, acc[m]);   \
      }                                                                              \
      const __mmask16 gm = static_cast<__mmask16>((1u << ng) - 1);                   \
      for (int m = 0; m < MR; ++m)                                                   \
        _mm512_storeu_si512(isum + m * Gp + g0,                                      \
                            _mm512_add_epi32(Reduce16(buf[m]),                       \
                                             _mm512_maskz_loadu_epi32(gm, rows[m].c + g0))); \
    }                                                                                \
  }

JB_DEFINE_GROUP_SUMS(GroupSumsVnni, "avx512f,avx512bw,avx512vl,avx512vnni", VnniDot)
JB_DEFINE_GROUP_SUMS(GroupSumsBw, "avx512f,avx512bw,avx512vl", BwDot)
#undef JB_DEFINE_GROUP_SUMS

#endif  // JB_X86

// ------------------------------------- blocked group path (16 rows per vector)
//
// For many input rows the lanes run over rows instead of k: the activations
// are packed [k2 / 4][16 rows][4 bytes] per plane (even / odd k), a weight
// tile is unpacked once into bytes, and each u8 x s8 dot multiplies 4 bytes of
// one weight row (broadcast) by 4 k of 16 rows, so a group's integer sums of
// 16 rows land in one vector with no reduction, and torch's float tail (in
// order over the groups) runs with one lane per row. The zero-point term is
// exact int32: zp * sum_g u (sum_g u once per weight row and group).

#if JB_X86
struct VnniDot2 {
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __m512i Dot(
      __m512i acc, __m512i u, __m512i a) {
    return _mm512_dpbusd_epi32(acc, u, a);
  }
};
struct BwDot2 {
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512i Dot(
      __m512i acc, __m512i u, __m512i a) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), _mm512_set1_epi16(1)));
  }
};
#endif  // JB_X86

// One block of input rows for the blocked path.
struct RowBlock16 {
  const int8_t* a;     // [2][K / 8][16][4]: even plane then odd plane
  const int32_t* c;    // [G][16] c_g per row
  const int32_t* zp;   // [16]
  const float* recip;  // [16]
  int rows;            // valid rows (<= 16)
};

// out[m, n] for the NR weight rows of `ut` (unpacked: [NR][K] bytes, chunk c
// = 64 low-nibble bytes then 64 high-nibble bytes) and the MR row blocks.
#define JB_DEFINE_ROWS16(NAME, TARGET, D)                                                     \
  template <int NR, int MR>                                                                   \
  __attribute__((target(TARGET))) void NAME(                                                  \
      const uint8_t* ut, const int32_t* su, const RowBlock16* blk, int64_t K, int64_t groupsize, \
      const float* s, const float* bias, int64_t n0, float* out, int64_t N) {                 \
    const int64_t G = K / groupsize;                                                          \
    const int64_t cpg = groupsize / 128;                                                      \
    const int64_t plane = K / 2 * 16; /* bytes of one plane of a row block */                 \
    __m512 f[NR][MR];                                                                         \
    for (int n = 0; n < NR; ++n)                                                              \
      for (int r = 0; r < MR; ++r) f[n][r] = _mm512_setzero_ps();                             \
    for (int64_t g = 0; g < G; ++g) {                                                         \
      __m512i acc[NR][MR];                                                                    \
      for (int n = 0; n < NR; ++n)                                                            \
        for (int r = 0; r < MR; ++r) acc[n][r] = _mm512_setzero_si512();                      \
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {                                     \
        for (int h = 0; h < 2; ++h) { /* even plane (low nibbles), odd plane */               \
          for (int j = 0; j < 16; ++j) {                                                      \
            __m512i a[MR];                                                                    \
            for (int r = 0; r < MR; ++r)                                                      \
              a[r] = _mm512_loadu_si512(blk[r].a + h * plane + (c * 16 + j) * 64);           \
            for (int n = 0; n < NR; ++n) {                                                    \
              int32_t u4;                                                                     \
              std::memcpy(&u4, ut + n * K + c * 128 + h * 64 + 4 * j, 4);                     \
              const __m512i ub = _mm512_set1_epi32(u4);                                       \
              for (int r = 0; r < MR; ++r) acc[n][r] = D::Dot(acc[n][r], ub, a[r]);            \
            }                                                                                 \
          }                                                                                   \
        }                                                                                     \
      }                                                                                       \
      for (int r = 0; r < MR; ++r) {                                                          \
        const __m512i cg = _mm512_loadu_si512(blk[r].c + g * 16);                             \
        const __m512i zp = _mm512_loadu_si512(blk[r].zp);                                     \
        for (int n = 0; n < NR; ++n) {                                                        \
          const __m512i iv = _mm512_sub_epi32(_mm512_add_epi32(acc[n][r], cg),                \
                                              _mm512_mullo_epi32(zp, _mm512_set1_epi32(su[n * G + g]))); \
          const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(s[n * G + g])); \
          f[n][r] = G == 1 ? p : _mm512_add_ps(f[n][r], p);                                   \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
    alignas(64) float tmp[16];                                                                \
    for (int r = 0; r < MR; ++r) {                                                            \
      const __m512 rc = _mm512_loadu_ps(blk[r].recip);                                        \
      for (int n = 0; n < NR; ++n) {                                                          \
        __m512 v = _mm512_mul_ps(f[n][r], rc);                                                \
        if (bias) v = _mm512_add_ps(v, _mm512_set1_ps(bias[n]));                              \
        v = _mm512_max_ps(_mm512_set1_ps(-FLT_MAX), v);                                       \
        v = _mm512_min_ps(_mm512_set1_ps(FLT_MAX), v);                                        \
        _mm512_store_ps(tmp, v);                                                              \
        for (int i = 0; i < blk[r].rows; ++i) out[i * N + n0 + n + r * 16 * N] = tmp[i];      \
      }                                                                                       \
    }                                                                                         \
  }

#if JB_X86
JB_DEFINE_ROWS16(Rows16Vnni, "avx512f,avx512bw,avx512vl,avx512vnni", VnniDot2)
JB_DEFINE_ROWS16(Rows16Bw, "avx512f,avx512bw,avx512vl", BwDot2)
#endif
#undef JB_DEFINE_ROWS16

#if JB_X86
// Unpacks NR weight rows (K / 2 bytes each) into ut ([NR][K] bytes) and the
// per-group sums of u into su ([NR][G]).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void UnpackTile(const uint8_t* w, int nr,
                                                                     int64_t K, int64_t groupsize,
                                                                     uint8_t* ut, int32_t* su) {
  const int64_t G = K / groupsize;
  const int64_t cpg = groupsize / 128;
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  for (int n = 0; n < nr; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      __m512i sacc = _mm512_setzero_si512();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
        const __m512i wv = _mm512_loadu_si512(w + n * (K / 2) + c * 64);
        const __m512i lo = _mm512_and_si512(wv, mask4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask4);
        _mm512_storeu_si512(ut + n * K + c * 128, lo);
        _mm512_storeu_si512(ut + n * K + c * 128 + 64, hi);
        sacc = _mm512_add_epi64(sacc, _mm512_sad_epu8(_mm512_add_epi8(lo, hi), _mm512_setzero_si512()));
      }
      su[n * G + g] = static_cast<int32_t>(_mm512_reduce_add_epi64(sacc));
    }
  }
}
#endif  // JB_X86

using Rows16Fn = void (*)(const uint8_t*, const int32_t*, const RowBlock16*, int, int, int64_t,
                          int64_t, const float*, const float*, int64_t, float*, int64_t);

#if JB_X86
#define JB_ROWS16_N(NAME, IMPL)                                                                \
  void NAME(const uint8_t* ut, const int32_t* su, const RowBlock16* blk, int nr, int mr,       \
            int64_t K, int64_t gs, const float* s, const float* bias, int64_t n0, float* out,  \
            int64_t N) {                                                                       \
    switch (nr * 2 + mr - 1) { /* nr 1..4 (2 * nr + mr - 1: 2..9) */                         \
      case 2: return IMPL<1, 1>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 3: return IMPL<1, 2>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 4: return IMPL<2, 1>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 5: return IMPL<2, 2>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 6: return IMPL<3, 1>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 7: return IMPL<3, 2>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      case 8: return IMPL<4, 1>(ut, su, blk, K, gs, s, bias, n0, out, N);                      \
      default: return IMPL<4, 2>(ut, su, blk, K, gs, s, bias, n0, out, N);                     \
    }                                                                                          \
  }
JB_ROWS16_N(Rows16VnniN, Rows16Vnni)
JB_ROWS16_N(Rows16BwN, Rows16Bw)
#undef JB_ROWS16_N
#endif

// ---------------------------------------------------------------- dyn quant

// Group sums of nm <= kGroupRows rows (the group path); nullptr: no group path
// on this code path (scalar), the block path runs.
constexpr int kGroupRows = 4;
using GroupSumsFn = void (*)(const uint8_t*, const GroupRow*, int, int64_t, int64_t, int32_t*);

#if JB_X86
#define JB_GROUP_SUMS_N(NAME, IMPL)                                                      \
  void NAME(const uint8_t* w, const GroupRow* r, int nm, int64_t K, int64_t gs,          \
            int32_t* isum) {                                                             \
    bool two = false; /* a row with zp = -128 needs the second zero-point dot */         \
    for (int m = 0; m < nm; ++m) two |= r[m].nz2 != 0;                                   \
    switch (nm + (two ? 4 : 0)) {                                                        \
      case 1: return IMPL<1, false>(w, r, K, gs, isum);                                  \
      case 2: return IMPL<2, false>(w, r, K, gs, isum);                                  \
      case 3: return IMPL<3, false>(w, r, K, gs, isum);                                  \
      case 4: return IMPL<4, false>(w, r, K, gs, isum);                                  \
      case 5: return IMPL<1, true>(w, r, K, gs, isum);                                   \
      case 6: return IMPL<2, true>(w, r, K, gs, isum);                                   \
      case 7: return IMPL<3, true>(w, r, K, gs, isum);                                   \
      default: return IMPL<4, true>(w, r, K, gs, isum);                                  \
    }                                                                                    \
  }
JB_GROUP_SUMS_N(GroupSumsVnniN, GroupSumsVnni)
JB_GROUP_SUMS_N(GroupSumsBwN, GroupSumsBw)
#undef JB_GROUP_SUMS_N
#endif

GroupSumsFn PickGroupSums() {
#if JB_X86
  if (HasAvx512()) return HasAvx512Vnni() ? &GroupSumsVnniN : &GroupSumsBwN;
#endif
  return nullptr;
}

std::atomic<GroupSumsFn> g_group_sums{PickGroupSums()};

// Weight rows per tile: the tile (8 x K/2 bytes) stays in L1/L2 while every
// block of input rows passes over it, and each block of input rows stays in
// L1 across the tile.
constexpr int64_t kTileN = 8;

// Runs f(n0, n1, thread) over [0, N) in chunks of whole tiles handed out in
// order (about 8 chunks per thread, so that a thread slowed down by another
// process on its core leaves its share to the others).
template <typename F>
void ForTiles(int64_t N, int threads, F&& f) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  const int64_t per = std::max<int64_t>(1, tiles / (8 * static_cast<int64_t>(threads)));
  const int64_t chunks = (tiles + per - 1) / per;
  jb::ParallelTasks(chunks, threads, [&](int64_t t, int id) {
    f(std::min(N, t * per * kTileN), std::min(N, (t + 1) * per * kTileN), id);
  });
}

#if JB_X86
// out[i] = clamp((sum_g float(isum_g) * s_g, in order) * recip + bias[i]) for
// one input row and cnt <= 16 weight rows i: torch's tail (the products in one
// vector multiply, exactly rounded as the scalar ones; the sum in order, no
// FMA; channel-wise, the product alone, which keeps the sign of a zero). One
// lane per weight row: the products of 16 groups are transposed (lanes = n)
// and summed in order with the same operations per lane, so that the serial
// fp32 chain is shared by 16 outputs. isum: weight row i's G sums at isum + i
// * stride; s: row i's scales at s + i * G.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void GroupTail16(
    const int32_t* isum, int64_t stride, int64_t G, const float* s, int cnt, float recip,
    const float* bias, float* out) {
  alignas(64) float prod[16 * 16];
  alignas(64) int32_t tr[16 * kRowBlock];
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int ng = static_cast<int>(std::min<int64_t>(16, G - g0));
    const __mmask16 gm = static_cast<__mmask16>((1u << ng) - 1);
    for (int i = 0; i < 16; ++i) {
      const __m512 p = i < cnt ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(isum + i * stride + g0)),
                                               _mm512_maskz_loadu_ps(gm, s + i * G + g0))
                               : _mm512_setzero_ps();
      _mm512_store_ps(prod + 16 * i, p);
    }
    StoreTransposed16(reinterpret_cast<const int32_t*>(prod), tr, ng);
    for (int g = 0; g < ng; ++g) {
      const __m512 t = _mm512_castsi512_ps(_mm512_loadu_si512(tr + g * kRowBlock));
      acc = G == 1 ? t : _mm512_add_ps(acc, t);
    }
  }
  const __mmask16 nmask = static_cast<__mmask16>((1u << cnt) - 1);
  acc = _mm512_mul_ps(acc, _mm512_set1_ps(recip));
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(nmask, bias));
  acc = _mm512_max_ps(_mm512_set1_ps(-FLT_MAX), acc);
  acc = _mm512_min_ps(_mm512_set1_ps(FLT_MAX), acc);
  _mm512_mask_storeu_ps(out, nmask, acc);
}

void DynQuantGroups(const std::vector<QRow>& rows, const uint8_t* w, const float* scales,
                    const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                    int64_t groupsize, GroupSumsFn group_sums) {
  const int64_t G = K / groupsize;
  const int64_t Gp = RoundUp(G, 16);
  const int64_t per_group = groupsize / 32;
  std::vector<int32_t> consts(M * Gp, 0);
  std::vector<GroupRow> gr(M);
  for (int64_t m = 0; m < M; ++m) {
    const QRow& r = rows[m];
    for (int64_t g = 0; g < G; ++g) {
      int32_t sq = 0;
      for (int64_t j = 0; j < per_group; ++j) sq += r.block_sum[g * per_group + j];
      consts[m * Gp + g] = -8 * sq + 8 * r.zp * static_cast<int32_t>(groupsize);
    }
    const int nz = -r.zp;  // -127 .. 128
    gr[m] = {r.even.data(), r.odd.data(), consts.data() + m * Gp,
             static_cast<int8_t>(std::min(nz, 127)), static_cast<int8_t>(nz - std::min(nz, 127))};
  }
  const int threads = static_cast<int>(std::min<int64_t>(NumThreads(M * N * K / 2), (N + kTileN - 1) / kTileN));
  // Per thread: the sums of 16 weight rows x kGroupRows input rows, weight
  // row i's sums for input row m at (i * kGroupRows + m) * Gp.
  const int64_t stride = kGroupRows * Gp;
  std::vector<std::vector<int32_t>> scratch(std::max(threads, 1), std::vector<int32_t>(16 * stride));
  ForTiles(N, threads, [&](int64_t n0, int64_t n1, int id) {
    int32_t* isum = scratch[id].data();
    // 16 weight rows share each input row's tail (one lane each, the serial
    // in-order float sum of torch's tail run once per 16 outputs; the same
    // bits as one scalar chain per output, and measured no faster or slower).
    for (int64_t t0 = n0; t0 < n1; t0 += 16) {
      const int cnt = static_cast<int>(std::min<int64_t>(16, n1 - t0));
      for (int64_t m0 = 0; m0 < M; m0 += kGroupRows) {
        const int nm = static_cast<int>(std::min<int64_t>(kGroupRows, M - m0));
        for (int i = 0; i < cnt; ++i)
          group_sums(w + (t0 + i) * (K / 2), gr.data() + m0, nm, K, groupsize, isum + i * stride);
        for (int m = 0; m < nm; ++m)
          GroupTail16(isum + m * Gp, stride, G, scales + t0 * G, cnt, rows[m0 + m].recip,
                      bias ? bias + t0 : nullptr, out + (m0 + m) * N + t0);
      }
    }
  });
}
#endif  // JB_X86

Rows16Fn PickRows16() {
#if JB_X86
  if (HasAvx512()) return HasAvx512Vnni() ? &Rows16VnniN : &Rows16BwN;
#endif
  return nullptr;
}
std::atomic<Rows16Fn> g_rows16{PickRows16()};

// Rows from which the blocked group path (16 rows per vector) runs instead of
// the row path: the measured crossover (AVX-512 VNNI, K = 4096, N = 11008,
// groupsize 128, CPU time per call: row path 2.3 / 2.9 / 6.2 / 8.1 ms at
// 2 / 4 / 8 / 12 rows, blocked path 5.6 to 6.3 ms for 1 to 16 rows).
constexpr int64_t kRows16MinRows = 9;

#if JB_X86
void DynQuantRows16(const std::vector<QRow>& rows, const uint8_t* w, const float* scales,
                    const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                    int64_t groupsize, Rows16Fn fn) {
  const int64_t G = K / groupsize;
  const int64_t per_group = groupsize / 32;
  const int64_t Mb = (M + 15) / 16;
  const int64_t plane = K / 2 * 16;
  const jb::AlignedBuffer<int8_t> apack = jb::NewAligned<int8_t>(Mb * 2 * plane);
  std::fill(apack.get(), apack.get() + Mb * 2 * plane, int8_t{0});
  std::vector<int32_t> cpk(Mb * G * 16, 0), zpk(Mb * 16, 0);
  std::vector<float> rpk(Mb * 16, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const QRow& r = rows[m];
    const int64_t b = m / 16, i = m % 16;
    int8_t* ae = apack.get() + b * 2 * plane;
    int8_t* ao = ae + plane;
    for (int64_t j = 0; j < K / 2; ++j) {
      const int64_t idx = (j / 4) * 64 + i * 4 + j % 4;
      ae[idx] = r.even[j];
      ao[idx] = r.odd[j];
    }
    for (int64_t g = 0; g < G; ++g) {
      int32_t sq = 0;
      for (int64_t q = 0; q < per_group; ++q) sq += r.block_sum[g * per_group + q];
      cpk[(b * G + g) * 16 + i] = -8 * sq + 8 * r.zp * static_cast<int32_t>(groupsize);
    }
    zpk[b * 16 + i] = r.zp;
    rpk[b * 16 + i] = r.recip;
  }
  std::vector<RowBlock16> blk(Mb);
  for (int64_t b = 0; b < Mb; ++b)
    blk[b] = {apack.get() + b * 2 * plane, cpk.data() + b * G * 16, zpk.data() + b * 16,
              rpk.data() + b * 16, static_cast<int>(std::min<int64_t>(16, M - 16 * b))};
  const int threads =
      static_cast<int>(std::min<int64_t>(NumThreads(M * N * K / 2), (N + kTileN - 1) / kTileN));
  std::vector<jb::AlignedBuffer<uint8_t>> ut;
  for (int i = 0; i < std::max(threads, 1); ++i) ut.push_back(jb::NewAligned<uint8_t>(kTileN * K));
  std::vector<std::vector<int32_t>> su(std::max(threads, 1), std::vector<int32_t>(kTileN * G));
  ForTiles(N, threads, [&](int64_t n0, int64_t n1, int id) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
      const int nt = static_cast<int>(std::min<int64_t>(kTileN, n1 - t0));
      UnpackTile(w + t0 * (K / 2), nt, K, groupsize, ut[id].get(), su[id].data());
      for (int64_t b0 = 0; b0 < Mb; b0 += 2) {
        const int mr = static_cast<int>(std::min<int64_t>(2, Mb - b0));
        for (int q = 0; q < nt; q += 4) {
          const int nr = std::min(4, nt - q);
          fn(ut[id].get() + q * K, su[id].data() + q * G, blk.data() + b0, nr, mr, K, groupsize,
             scales + (t0 + q) * G, bias ? bias + t0 + q : nullptr, t0 + q, out + b0 * 16 * N, N);
        }
      }
    }
  });
}
#endif  // JB_X86

void DynQuantMatmul(const float* x, const uint8_t* w, const float* scales,
                    const float* bias, float* out, int64_t M, int64_t N,
                    int64_t K, int64_t groupsize, bool skip_nan) {
  if (M == 0 || N == 0) return;
  const bool channelwise = groupsize == K;
  const int64_t G = K / groupsize;
  const int64_t nb = K / 32;
  const int64_t per_group = groupsize / 32;
  std::vector<QRow> rows(M);
  for (int64_t m = 0; m < M; ++m) QuantizeRow(x + m * K, K, channelwise, skip_nan, &rows[m]);
#if JB_X86
  const GroupSumsFn group_sums = g_group_sums.load();
  // The group path folds -zp into int8 dots: a zero point outside -128..127
  // (a row with NaN or inf) takes the block path, whose int32 arithmetic wraps
  // as torch's does.
  const bool zp_in_range = std::all_of(rows.begin(), rows.end(),
                                       [](const QRow& r) { return r.zp >= -128 && r.zp <= 127; });
  const Rows16Fn rows16 = g_rows16.load();
  if (rows16 != nullptr && M >= kRows16MinRows && groupsize % 128 == 0 && zp_in_range) {
    DynQuantRows16(rows, w, scales, bias, out, M, N, K, groupsize, rows16);
    return;
  }
  if (group_sums != nullptr && groupsize % 128 == 0 && zp_in_range) {
    DynQuantGroups(rows, w, scales, bias, out, M, N, K, groupsize, group_sums);
    return;
  }
#endif
  const BlockDotsFn block_dots = g_block_dots.load();
  const TailFn tail = g_tail.load();
  jb::ParallelFor(N, NumThreads(M * N * K / 2), 16, [&](int64_t n0, int64_t n1) {
    std::vector<int32_t> dots((nb + 16) * kRowBlock);
    const QRow* rp[kRowBlock];
    float recip[kRowBlock], res[kRowBlock];
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int nm = static_cast<int>(std::min<int64_t>(kRowBlock, M - m0));
      for (int i = 0; i < kRowBlock; ++i) {
        rp[i] = i < nm ? &rows[m0 + i] : nullptr;
        recip[i] = i < nm ? rows[m0 + i].recip : 0.f;
      }
      const bool one = nm == 1 && block_dots != &BlockDotsScalar;
      for (int64_t n = n0; n < n1; ++n) {
        block_dots(w + n * (K / 2), rp, nm, K, dots.data());
        if (one) {
          out[m0 * N + n] = TailOne(dots.data(), nb, per_group, channelwise, scales + n * G,
                                    recip[0], bias ? bias + n : nullptr);
          continue;
        }
        tail(dots.data(), nb, per_group, channelwise, scales + n * G, recip,
             bias ? bias + n : nullptr, nm, res);
        for (int i = 0; i < nm; ++i) out[(m0 + i) * N + n] = res[i];
      }
    }
  });
}

// -------------------------------------------------------------- weight only

constexpr int kWoRowBlock = 8;  // rows sharing one unpacked weight row (L1)
constexpr int64_t kWoSliceBytes = 512;     // weight bytes per K slice (blocked path)
constexpr int64_t kWoRowPathBytes = 16384;  // activations of a row block that take the row path

#if JB_X86
// One weight row -> the dequantized (q * scale) float32 even-k and odd-k
// planes, in L1. 16 bytes are 32 consecutive k of a single group.
__attribute__((target("avx512f,avx512bw"))) void UnpackScaledRowAvx512(
    const uint8_t* w, int64_t K, int64_t groupsize, const float* s, float* ue,
    float* uo) {
  const int64_t bytes = K / 2;
  const __m512i eight = _mm512_set1_epi32(8);
  const __m512i fifteen = _mm512_set1_epi32(15);
  const int64_t gb = groupsize / 2;  // bytes per group, a multiple of 16
  for (int64_t c = 0, g = 0, next = gb; c < bytes; c += 16) {
    if (c == next) ++g, next += gb;  // no division per step
    const __m512 sv = _mm512_set1_ps(s[g]);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c)));
    const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(v, fifteen), eight);
    const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight);
    _mm512_storeu_ps(ue + c, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), sv));
    _mm512_storeu_ps(uo + c, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), sv));
  }
}

// out[r] = <x_r, w> for MB rows sharing each weight load; 4 FMA chains per row.
template <int MB>
__attribute__((target("avx512f,avx512bw"))) inline void DotRowsAvx512(
    const float* ue, const float* uo, const float* xe, const float* xo,
    int64_t half, float* out) {
  __m512 acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= half; i += 32) {
    const __m512 e0 = _mm512_loadu_ps(ue + i), o0 = _mm512_loadu_ps(uo + i);
    const __m512 e1 = _mm512_loadu_ps(ue + i + 16), o1 = _mm512_loadu_ps(uo + i + 16);
    for (int r = 0; r < MB; ++r) {
      const float* xer = xe + r * half;
      const float* xor_ = xo + r * half;
      acc[r][0] = _mm512_fmadd_ps(e0, _mm512_loadu_ps(xer + i), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(o0, _mm512_loadu_ps(xor_ + i), acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(e1, _mm512_loadu_ps(xer + i + 16), acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(o1, _mm512_loadu_ps(xor_ + i + 16), acc[r][3]);
    }
  }
  for (; i < half; i += 16) {  // half is a multiple of 16
    const __m512 e0 = _mm512_loadu_ps(ue + i), o0 = _mm512_loadu_ps(uo + i);
    for (int r = 0; r < MB; ++r) {
      acc[r][0] = _mm512_fmadd_ps(e0, _mm512_loadu_ps(xe + r * half + i), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(o0, _mm512_loadu_ps(xo + r * half + i), acc[r][1]);
    }
  }
  for (int r = 0; r < MB; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                _mm512_add_ps(acc[r][2], acc[r][3])));
}

// For each of nm rows m: out[m] = sum_k x[m, k] * q[k] * s[group(k)]. The row
// is dequantized once into L1 and shared by the nm rows (blocks of 4).
__attribute__((target("avx512f,avx512bw"))) void WeightOnlyRowAvx512(
    const uint8_t* w, const float* xe, const float* xo, int nm, int64_t K,
    int64_t groupsize, const float* s, float* ue, float* uo, float* out) {
  UnpackScaledRowAvx512(w, K, groupsize, s, ue, uo);
  const int64_t half = K / 2;
  int m = 0;
  for (; m + 4 <= nm; m += 4) DotRowsAvx512<4>(ue, uo, xe + m * half, xo + m * half, half, out + m);
  for (; m + 2 <= nm; m += 2) DotRowsAvx512<2>(ue, uo, xe + m * half, xo + m * half, half, out + m);
  for (; m < nm; ++m) DotRowsAvx512<1>(ue, uo, xe + m * half, xo + m * half, half, out + m);
}

// out[m] = sum_k x[m, k] q[k] s[group(k)] over the weight bytes [c0, c1) (k
// in [2 c0, 2 c1)) for MR <= 4 rows, the weights dequantized in registers:
// 16 bytes widen to 16 int32 lanes whose low 4 bits index a 16-float table of
// (q - 8) * s[g] (vpermps reads only those bits; the high nibbles after a
// shift), then one FMA per plane and row. Two 16-byte steps per iteration (4
// FMA chains per row) where the group allows.
template <int MR>
__attribute__((target("avx512f,avx512bw"))) void WoRowsAvx512(const uint8_t* w, const float* xe,
                                                              const float* xo, int64_t half,
                                                              int64_t c0, int64_t c1,
                                                              int64_t groupsize, const float* s,
                                                              float* out) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f,
                                      3.f, 4.f, 5.f, 6.f, 7.f);
  const int64_t gb = groupsize / 2;
  // A single row has 8 FMA chains (two steps per iteration): with 4, the
  // FMA latency bounded the decode loop.
  constexpr int kChains = MR == 1 ? 8 : 4;
  __m512 acc[MR][kChains];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < kChains; ++a) acc[m][a] = _mm512_setzero_ps();
  for (int64_t c = c0, g = c0 == 0 ? 0 : c0 / gb; c < c1; ++g) {  // one group (or its part in the slice)
    const __m512 ts = _mm512_mul_ps(table, _mm512_set1_ps(s[g]));
    const int64_t end = std::min(c1, (g + 1) * gb);
    if constexpr (MR == 1) {
      for (; c + 64 <= end; c += 64) {
        const float* e = xe + c;
        const float* o = xo + c;
        for (int h = 0; h < 2; ++h) {
          const __m512i v0 =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c + 32 * h)));
          const __m512i v1 =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c + 32 * h + 16)));
          acc[0][4 * h] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, ts), _mm512_loadu_ps(e + 32 * h), acc[0][4 * h]);
          acc[0][4 * h + 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), ts),
                                              _mm512_loadu_ps(o + 32 * h), acc[0][4 * h + 1]);
          acc[0][4 * h + 2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, ts), _mm512_loadu_ps(e + 32 * h + 16),
                                              acc[0][4 * h + 2]);
          acc[0][4 * h + 3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), ts),
                                              _mm512_loadu_ps(o + 32 * h + 16), acc[0][4 * h + 3]);
        }
      }
    }
    for (; c + 32 <= end; c += 32) {
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c)));
      const __m512i v1 =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c + 16)));
      const __m512 l0 = _mm512_permutexvar_ps(v0, ts);
      const __m512 h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), ts);
      const __m512 l1 = _mm512_permutexvar_ps(v1, ts);
      const __m512 h1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), ts);
      for (int m = 0; m < MR; ++m) {
        const float* e = xe + m * half + c;
        const float* o = xo + m * half + c;
        acc[m][0] = _mm512_fmadd_ps(l0, _mm512_loadu_ps(e), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(h0, _mm512_loadu_ps(o), acc[m][1]);
        acc[m][2] = _mm512_fmadd_ps(l1, _mm512_loadu_ps(e + 16), acc[m][2]);
        acc[m][3] = _mm512_fmadd_ps(h1, _mm512_loadu_ps(o + 16), acc[m][3]);
      }
    }
    for (; c < end; c += 16) {  // groupsize 32, 96, ...
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c)));
      const __m512 l0 = _mm512_permutexvar_ps(v0, ts);
      const __m512 h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), ts);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm512_fmadd_ps(l0, _mm512_loadu_ps(xe + m * half + c), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(h0, _mm512_loadu_ps(xo + m * half + c), acc[m][1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    __m512 t = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    if constexpr (kChains == 8)
      t = _mm512_add_ps(t, _mm512_add_ps(_mm512_add_ps(acc[m][4], acc[m][5]), _mm512_add_ps(acc[m][6], acc[m][7])));
    out[m] = _mm512_reduce_add_ps(t);
  }
}

void WoRowsAvx512N(const uint8_t* w, const float* xe, const float* xo, int64_t half, int nm,
                   int64_t c0, int64_t c1, int64_t groupsize, const float* s, float* out) {
  switch (nm) {
    case 1: return WoRowsAvx512<1>(w, xe, xo, half, c0, c1, groupsize, s, out);
    case 2: return WoRowsAvx512<2>(w, xe, xo, half, c0, c1, groupsize, s, out);
    case 3: return WoRowsAvx512<3>(w, xe, xo, half, c0, c1, groupsize, s, out);
    default: return WoRowsAvx512<4>(w, xe, xo, half, c0, c1, groupsize, s, out);
  }
}

// ------------------------ weight-only decode path (one row, AVX512-VNNI dots)
//
// For a single input row the float32 row kernel above spends three vector
// instructions on every 16 weights (widen, table permute, FMA) and runs at
// the shuffle port's rate. An integer dot (vpdpbusd) takes 64 weights, so the
// row is held as block fixed point instead: each 128-k chunk c is scaled by
// R / max_c (max_c = max |x| over the chunk, R = 127 * 65793, just under 2^23)
// and rounded to integers A, |A| <= R, kept as three signed bytes A = 65536 a2
// + 256 a1 + a0 (the bytes of A + 128 * 65793, each minus 128). A chunk's dot
// with the nibbles u = q + 8 is six vpdpbusd (low / high nibbles x three
// digits, Horner-combined by two 8-bit shifts; a lane sums 8 products, so it
// stays below 8 * 15 * 128 * 65793 < 2^31: exact), minus the lane's
// zero-point term 8 sum A (exact: sum (u - 8) A = sum q A, so nothing cancels
// in float), converted to float once, multiplied by max_c / R and then by
// s_g (in that order: the product stays normal where x w is). The only
// rounding before the float sums is that of x to 24 bits relative to its chunk's largest |x| (<= 2^-24 max_c
// per element, the order of float32's own rounding of that element): float
// tolerance, as the float32 kernel, on rows whose chunks are not dominated
// by a few large values (the spread test in MakeLimbRow). Measured on a
// 2-core Emerald Rapids (K = 4096, groupsize 128 and 256, weights in L2): 16-19 GB/s of packed
// weight per core against 12.6 for the float32 row kernel. A row with a
// non-finite value, a chunk whose largest |x| is nonzero and outside
// [2^-96, 2^96] (where max_c / R would leave float32's normal range), or a
// spread above kLimbSpread takes the float32 kernel instead.
constexpr int32_t kLimbR = 127 * 65793;
constexpr int32_t kLimbBias = 128 * 65793;
constexpr double kLimbSpread = 64.0;
constexpr int64_t kLimbZeroOffset = 384;  // per 128-k chunk: 3 digits x (even, odd) x 64 int8, then
constexpr int64_t kLimbChunkBytes = 448;  // the 16 int32 zero-point terms

// One input row as digits: d [chunks][a2, a1, a0][even, odd][64] int8, then
// the chunk's 16 zero-point terms int32 (lane j: 8 sum of A over k = 8j ..
// 8j + 7 of the chunk, the k its vpdpbusd lane j sums), and the
// dequantization scale max_c / R of every chunk.
struct LimbRow {
  jb::AlignedBuffer<int8_t> d;
  std::vector<float> scale;  // [chunks]
};

// Fills `r` for the row x (K = 128 * chunks floats). Returns false, with r
// unspecified, where the row must take the float32 kernel (a non-finite value,
// a chunk's largest |x| out of range, a spread above kLimbSpread).
__attribute__((target("avx512f,avx512bw"))) bool MakeLimbRow(const float* x, int64_t K, LimbRow* r) {
  const int64_t chunks = K / 128;
  r->d = jb::NewAligned<int8_t>(chunks * kLimbChunkBytes);
  r->scale.assign(chunks, 0.0f);
  const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_idx = _mm512_add_epi32(even_idx, _mm512_set1_epi32(1));
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  double peak = 0.0, rest = 0.0;  // sum_c 128 max_c; sum_c (sum_k |x_k| - max_c)
  for (int64_t c = 0; c < chunks; ++c) {
    const float* xc = x + 128 * c;
    // The largest |x| as the bits of non-negative floats (integer order =
    // float order, NaN above inf), so that NaN cannot hide from the max.
    __m512i mx = _mm512_setzero_si512();
    __m512 l1 = _mm512_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(xc + 16 * i), abs_mask);
      mx = _mm512_max_epu32(mx, a);
      l1 = _mm512_add_ps(l1, _mm512_castsi512_ps(a));
    }
    const uint32_t bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(mx));
    if (bits >= 0x7F800000u) return false;  // inf or NaN
    float m;
    std::memcpy(&m, &bits, sizeof m);
    if (m != 0.0f && (m < 0x1p-96f || m > 0x1p96f)) return false;
    peak += 128.0 * m;
    rest += static_cast<double>(_mm512_reduce_add_ps(l1)) - m;
    const __m512 mul = _mm512_set1_ps(m == 0.0f ? 0.0f : static_cast<float>(kLimbR / static_cast<double>(m)));
    r->scale[c] = static_cast<float>(static_cast<double>(m) / kLimbR);
    int8_t* dc = r->d.get() + c * kLimbChunkBytes;
    int32_t* zc = reinterpret_cast<int32_t*>(dc + kLimbZeroOffset);
    for (int h = 0; h < 4; ++h) {  // 32 k: 16 even, 16 odd
      const __m512 a = _mm512_loadu_ps(xc + 32 * h), b = _mm512_loadu_ps(xc + 32 * h + 16);
      __m512i asum = _mm512_setzero_si512();  // lane i: A at k = 32 h + 2 i and 32 h + 2 i + 1
      for (int plane = 0; plane < 2; ++plane) {
        const __m512 v = _mm512_permutex2var_ps(a, plane == 0 ? even_idx : odd_idx, b);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, mul));  // round to nearest even
        q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-kLimbR)), _mm512_set1_epi32(kLimbR));
        asum = _mm512_add_epi32(asum, q);
        const __m512i biased = _mm512_add_epi32(q, _mm512_set1_epi32(kLimbBias));  // in [0, 2^24)
        for (int l = 0; l < 3; ++l) {  // a2 first: the order the dot's Horner steps read
          const __m128i digit = _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srli_epi32(biased, 16 - 8 * l)), flip);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dc + 128 * l + 64 * plane + 16 * h), digit);
        }
      }
      alignas(64) int32_t t[16];
      _mm512_store_si512(t, asum);
      for (int j = 0; j < 4; ++j) zc[4 * h + j] = 8 * (t[4 * j] + t[4 * j + 1] + t[4 * j + 2] + t[4 * j + 3]);
    }
  }
  // A chunk's rounding error scales with its largest |x|: where a few large
  // values dominate their chunks (peak / rest above kLimbSpread; about 3.4
  // for Gaussian rows, 26 for a 4096-row with six 100x outlier channels),
  // the error relative to sum |x w| would exceed float32's by far.
  return peak <= kLimbSpread * rest;
}

// The 16 lanes of chunk c's exact integer dot sum_k A_k q_k (lanes summed
// later) for one weight row's 64 bytes wc and the chunk's digits dc.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i LimbChunkDot(const uint8_t* wc,
                                                                                   const int8_t* dc) {
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(wc);
  const __m512i lo = _mm512_and_si512(v, mask4);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask4);
  __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(dc));
  a = _mm512_dpbusd_epi32(a, hi, _mm512_load_si512(dc + 64));
  a = _mm512_slli_epi32(a, 8);
  a = _mm512_dpbusd_epi32(a, lo, _mm512_load_si512(dc + 128));
  a = _mm512_dpbusd_epi32(a, hi, _mm512_load_si512(dc + 192));
  a = _mm512_slli_epi32(a, 8);
  a = _mm512_dpbusd_epi32(a, lo, _mm512_load_si512(dc + 256));
  a = _mm512_dpbusd_epi32(a, hi, _mm512_load_si512(dc + 320));
  return _mm512_sub_epi32(a, _mm512_load_si512(dc + kLimbZeroOffset));
}

// Chunk c's (sum q A) * (max_c / R), 16 lanes: the s_g factor comes after.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512 LimbChunkScaled(const uint8_t* w,
                                                                                     const int8_t* d,
                                                                                     const float* sc, int64_t c) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(LimbChunkDot(w + 64 * c, d + kLimbChunkBytes * c)), _mm512_set1_ps(sc[c]));
}

// out = sum_k x_k q_k s_g(k) for one weight row w (K / 2 bytes, scales s) and
// the digits of r; gofc[c]: chunk c's group.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) float WoLimbRow(const uint8_t* w, const LimbRow& r,
                                                                       const int32_t* gofc, int64_t chunks,
                                                                       const float* s) {
  const int8_t* d = r.d.get();
  const float* sc = r.scale.data();
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {  // two chunks per step: independent dot chains
    _mm_prefetch(reinterpret_cast<const char*>(w + 64 * c + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 64 * c + 64 + kPrefetchBytes), _MM_HINT_T0);
    acc0 = _mm512_fmadd_ps(LimbChunkScaled(w, d, sc, c), _mm512_set1_ps(s[gofc[c]]), acc0);
    acc1 = _mm512_fmadd_ps(LimbChunkScaled(w, d, sc, c + 1), _mm512_set1_ps(s[gofc[c + 1]]), acc1);
  }
  if (c < chunks) acc0 = _mm512_fmadd_ps(LimbChunkScaled(w, d, sc, c), _mm512_set1_ps(s[gofc[c]]), acc0);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// bfloat16 activations (AVX512-BF16). A bf16 x times an integer q - 8 in
// [-8, 7] is exact in float32, so vdpbf16ps (two bf16 products added to each
// float32 lane) takes the weights as bf16 integers without a float dequant:
// 64 weight bytes (128 k) read as 32 words, whose four nibbles (k = 4w .. 4w +
// 3) index a 32-word table of bf16(q - 8) after shifts of 0, 4, 8 and 12 bits
// (vpermw reads the low 5 bits; the table repeats, so bit 4 does not matter):
// 4 permutes per 128 weights where the float32 path takes 12 shuffles. Lane i
// of the p-th product then pairs k = 8i + p with 8i + 4 + p, the order the
// activations are laid out in once per call (ArrangeBf16). Each chunk's two
// partial sums are scaled by the scales of their lanes' groups (a broadcast
// when the groupsize is a multiple of 128, else a permute of up to 5 scales)
// into float32 accumulators.
constexpr int64_t kChunk = 128;  // k per chunk (64 weight bytes): the bf16 row kernel, the f32 blocked path

// Chunk j's lane i -> its group minus the chunk's first group (clamped to the
// last group in the padding of the last chunk): groupsizes that are not
// multiples of kChunk.
std::vector<int32_t> ChunkGroupIndex(int64_t K, int64_t groupsize) {
  const int64_t chunks = (K + kChunk - 1) / kChunk, G = K / groupsize;
  std::vector<int32_t> idx(chunks * 16);
  for (int64_t j = 0; j < chunks; ++j)
    for (int i = 0; i < 16; ++i)
      idx[j * 16 + i] = static_cast<int32_t>(std::min(G - 1, (j * kChunk + 8 * i) / groupsize) -
                                             j * kChunk / groupsize);
  return idx;
}

// The scales of chunk j's 16 lanes from the chunk's first group's scale s_g0
// (gidx: ChunkGroupIndex; `groups` scales from s_g0 on exist, at most 5 read).
__attribute__((target("avx512f"))) inline __m512 LaneScales(const int32_t* gidx, int64_t j,
                                                            const float* s_g0, int64_t groups) {
  const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(5, groups)) - 1);
  return _mm512_permutexvar_ps(_mm512_loadu_si512(gidx + j * 16), _mm512_maskz_loadu_ps(live, s_g0));
}

// x [M, K] bf16 -> [M][K / 128][4][32] bf16: product p of a chunk reads k =
// 8i + p (word 2i) and 8i + 4 + p (word 2i + 1).
void ArrangeBf16(const uint16_t* x, int64_t M, int64_t K, uint16_t* xa) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / kChunk; ++j) {
      const uint16_t* src = x + m * K + j * kChunk;
      uint16_t* dst = xa + (m * K + j * kChunk);
      for (int p = 0; p < 4; ++p)
        for (int i = 0; i < 16; ++i) {
          dst[p * 32 + 2 * i] = src[8 * i + p];
          dst[p * 32 + 2 * i + 1] = src[8 * i + 4 + p];
        }
    }
}

// bf16(v - 8) for v = 0..15, twice.
alignas(64) constexpr uint16_t kBf16Nibbles[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// One chunk j of one weight row for MR rows: the two partial sums of row m,
// scaled, into acc[m][A] and acc[m][A + 1].
template <int MR, bool kWhole, int A>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void WoBf16Chunk(
    const uint8_t* w, const uint16_t* xa, int64_t K, int64_t j, const int32_t* cg, int64_t G,
    const float* s, const int32_t* gidx, __m512i table, __m512 (&acc)[MR][4]) {
  const __m512i v = _mm512_loadu_si512(w + j * (kChunk / 2));
  const __m512bh q0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
  const __m512bh q1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  const __m512bh q2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
  const __m512bh q3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
  const int64_t g0 = cg[j];
  __m512 sv;
  if constexpr (kWhole) {
    sv = _mm512_set1_ps(s[g0]);
  } else {
    sv = LaneScales(gidx, j, s + g0, G - g0);
  }
  for (int m = 0; m < MR; ++m) {
    const uint16_t* xm = xa + m * K + j * kChunk;
    __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(xm));
    __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), q2, (__m512bh)_mm512_loadu_si512(xm + 64));
    p0 = _mm512_dpbf16_ps(p0, q1, (__m512bh)_mm512_loadu_si512(xm + 32));
    p1 = _mm512_dpbf16_ps(p1, q3, (__m512bh)_mm512_loadu_si512(xm + 96));
    acc[m][A] = _mm512_fmadd_ps(p0, sv, acc[m][A]);
    acc[m][A + 1] = _mm512_fmadd_ps(p1, sv, acc[m][A + 1]);
  }
}

// out[m] = sum over chunks [j0, j1) of one weight row for MR <= 4 rows of
// arranged activations (xa: row m at xa + m * K). kWhole: the groupsize is a
// multiple of kChunk (one scale per chunk). Two chunks per step (4
// accumulators per row).
template <int MR, bool kWhole>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void WoBf16Rows(
    const uint8_t* w, const uint16_t* xa, int64_t K, int64_t j0, int64_t j1, const int32_t* cg,
    int64_t G, const float* s, const int32_t* gidx, float* out) {
  const __m512i table = _mm512_load_si512(kBf16Nibbles);
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_setzero_ps();
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2) {
    WoBf16Chunk<MR, kWhole, 0>(w, xa, K, j, cg, G, s, gidx, table, acc);
    WoBf16Chunk<MR, kWhole, 2>(w, xa, K, j + 1, cg, G, s, gidx, table, acc);
  }
  if (j < j1) WoBf16Chunk<MR, kWhole, 0>(w, xa, K, j, cg, G, s, gidx, table, acc);
  for (int m = 0; m < MR; ++m)
    out[m] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

using WoBf16Fn = void (*)(const uint8_t*, const uint16_t*, int64_t, int64_t, int64_t, const int32_t*,
                          int64_t, const float*, const int32_t*, float*);

WoBf16Fn PickWoBf16(int mr, bool whole) {
  static constexpr WoBf16Fn kWholeFns[4] = {&WoBf16Rows<1, true>, &WoBf16Rows<2, true>,
                                            &WoBf16Rows<3, true>, &WoBf16Rows<4, true>};
  static constexpr WoBf16Fn kSplitFns[4] = {&WoBf16Rows<1, false>, &WoBf16Rows<2, false>,
                                            &WoBf16Rows<3, false>, &WoBf16Rows<4, false>};
  return whole ? kWholeFns[mr - 1] : kSplitFns[mr - 1];
}

// The same on AVX2 + FMA: 8 bytes (16 k, within one group) per step.
__attribute__((target("avx2,fma"))) void UnpackScaledRowAvx2(const uint8_t* w, int64_t K,
                                                             int64_t groupsize, const float* s,
                                                             float* ue, float* uo) {
  const int64_t bytes = K / 2;
  const __m256i eight = _mm256_set1_epi32(8);
  const __m256i fifteen = _mm256_set1_epi32(15);
  const int64_t gb = groupsize / 2;  // bytes per group, a multiple of 16
  for (int64_t c = 0, g = 0, next = gb; c < bytes; c += 8) {
    if (c == next) ++g, next += gb;  // no division per step
    const __m256 sv = _mm256_set1_ps(s[g]);
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c)));
    const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(v, fifteen), eight);
    const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight);
    _mm256_storeu_ps(ue + c, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), sv));
    _mm256_storeu_ps(uo + c, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), sv));
  }
}

// out[r] = <x_r, w> for MB rows sharing each weight load, U ymm of each plane
// per step: 2 U FMA chains per row (MB * 2 U = 8 accumulators of 16 ymm).
template <int MB, int U>
__attribute__((target("avx2,fma"))) inline void DotRowsAvx2(const float* ue, const float* uo,
                                                            const float* xe, const float* xo,
                                                            int64_t half, float* out) {
  __m256 acc[MB][2 * U];
  for (int r = 0; r < MB; ++r)
    for (int a = 0; a < 2 * U; ++a) acc[r][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * U <= half; i += 8 * U) {
    __m256 e[U], o[U];
    for (int u = 0; u < U; ++u) {
      e[u] = _mm256_loadu_ps(ue + i + 8 * u);
      o[u] = _mm256_loadu_ps(uo + i + 8 * u);
    }
    for (int r = 0; r < MB; ++r)
      for (int u = 0; u < U; ++u) {
        acc[r][2 * u] = _mm256_fmadd_ps(e[u], _mm256_loadu_ps(xe + r * half + i + 8 * u), acc[r][2 * u]);
        acc[r][2 * u + 1] =
            _mm256_fmadd_ps(o[u], _mm256_loadu_ps(xo + r * half + i + 8 * u), acc[r][2 * u + 1]);
      }
  }
  for (; i < half; i += 8) {  // half is a multiple of 16
    const __m256 e0 = _mm256_loadu_ps(ue + i), o0 = _mm256_loadu_ps(uo + i);
    for (int r = 0; r < MB; ++r) {
      acc[r][0] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xe + r * half + i), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xo + r * half + i), acc[r][1]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    __m256 t = acc[r][0];
    for (int a = 1; a < 2 * U; ++a) t = _mm256_add_ps(t, acc[r][a]);
    out[r] = HSum(t);
  }
}

// A single row (decode): no L1 plane, the nibbles are converted in registers
// and the scale is applied once per group, out = sum_g s[g] * sum_{k in g}
// x[k] q[k]. 16 bytes (32 k) per step, four FMA chains.
__attribute__((target("avx2,fma"))) float WeightOnlyOneAvx2(const uint8_t* w, const float* xe,
                                                            const float* xo, int64_t K,
                                                            int64_t groupsize, const float* s) {
  const __m256i eight = _mm256_set1_epi32(8);
  const __m256i fifteen = _mm256_set1_epi32(15);
  const int64_t gbytes = groupsize / 2;  // a multiple of 16
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / groupsize; ++g) {
    __m256 d[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t c = g * gbytes; c < (g + 1) * gbytes; c += 16)
      for (int h = 0; h < 2; ++h) {
        const __m256i v =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c + 8 * h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, fifteen), eight));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight));
        d[2 * h] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + c + 8 * h), d[2 * h]);
        d[2 * h + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + c + 8 * h), d[2 * h + 1]);
      }
    const __m256 dg = _mm256_add_ps(_mm256_add_ps(d[0], d[1]), _mm256_add_ps(d[2], d[3]));
    acc = _mm256_fmadd_ps(dg, _mm256_set1_ps(s[g]), acc);
  }
  return HSum(acc);
}

__attribute__((target("avx2,fma"))) void WeightOnlyRowAvx2(
    const uint8_t* w, const float* xe, const float* xo, int nm, int64_t K,
    int64_t groupsize, const float* s, float* ue, float* uo, float* out) {
  if (nm == 1) {
    out[0] = WeightOnlyOneAvx2(w, xe, xo, K, groupsize, s);
    return;
  }
  UnpackScaledRowAvx2(w, K, groupsize, s, ue, uo);
  const int64_t half = K / 2;
  int m = 0;
  for (; m + 4 <= nm; m += 4) DotRowsAvx2<4, 1>(ue, uo, xe + m * half, xo + m * half, half, out + m);
  for (; m + 2 <= nm; m += 2) DotRowsAvx2<2, 2>(ue, uo, xe + m * half, xo + m * half, half, out + m);
  for (; m < nm; ++m) DotRowsAvx2<1, 4>(ue, uo, xe + m * half, xo + m * half, half, out + m);
}
#endif

void WeightOnlyRowScalar(const uint8_t* w, const float* xe, const float* xo,
                         int nm, int64_t K, int64_t groupsize, const float* s,
                         float* ue, float* uo, float* out) {
  for (int64_t c = 0; c < K / 2; ++c) {
    ue[c] = static_cast<float>((w[c] & 15) - 8);
    uo[c] = static_cast<float>((w[c] >> 4) - 8);
  }
  const int64_t half = groupsize / 2;
  for (int m = 0; m < nm; ++m) {
    const float* e = xe + m * (K / 2);
    const float* o = xo + m * (K / 2);
    float acc = 0.f;
    for (int64_t g = 0; g < K / groupsize; ++g) {
      float d = 0.f;
      for (int64_t i = g * half; i < (g + 1) * half; ++i) d += ue[i] * e[i] + uo[i] * o[i];
      acc += d * s[g];
    }
    out[m] = acc;
  }
}

using WoRowFn = void (*)(const uint8_t*, const float*, const float*, int,
                         int64_t, int64_t, const float*, float*, float*, float*);

WoRowFn PickWoRow() {
#if JB_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bw")) return &WeightOnlyRowAvx512;
  if (HasAvx2()) return &WeightOnlyRowAvx2;
#endif
  return &WeightOnlyRowScalar;
}

// JbInt4SetIsa switches the weight-only row kernel along with the dyn-quant
// one, so that the tests reach every path this CPU runs.
std::atomic<WoRowFn> g_wo_row{PickWoRow()};

#if JB_X86
// ------------------------- weight-only blocked path (16 rows per vector)
//
// The float GEMM form: the activations packed [plane][K / 2][16 rows], a tile
// of weight rows dequantized once into float32 planes ([n][even k, odd k]),
// and each FMA multiplies one broadcast weight by 16 rows.

// acc[n][r] (c: [NR][MR][16], loaded and stored back) += rows of the MR
// blocks (a: [K][16] each, from k0 to k1) x the NR dequantized weight rows of
// bt ([NR][K]: the even-k plane then the odd-k plane).
template <int NR, int MR>
__attribute__((target("avx512f,avx512bw"))) void WoRows16(const float* bt, const float* const* a,
                                                          int64_t ldb, int64_t k0, int64_t k1,
                                                          float* c) {
  if (k0 >= k1) return;
  __m512 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm512_loadu_ps(c + (n * MR + r) * 16);
  int64_t k = k0;
  do {  // at least once: a loop that may run zero times kept acc on the stack (GCC)
    __m512 av[MR];
    for (int r = 0; r < MR; ++r) av[r] = _mm512_loadu_ps(a[r] + k * 16);
    for (int n = 0; n < NR; ++n) {
      const __m512 b = _mm512_set1_ps(bt[n * ldb + k]);
      for (int r = 0; r < MR; ++r) acc[n][r] = _mm512_fmadd_ps(b, av[r], acc[n][r]);
    }
  } while (++k < k1);
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + (n * MR + r) * 16, acc[n][r]);
}

// WoRows16<NR, MR> for every shape the blocked path uses: MR <= 4 row blocks
// and NR <= WoQuad(MR) weight rows (at most 24 accumulators + MR activation
// vectors + 1 broadcast of the 32 zmm registers).
using WoRows16Fn = void (*)(const float*, const float* const*, int64_t, int64_t, int64_t, float*);

template <int MR, int... NR>
constexpr std::array<WoRows16Fn, sizeof...(NR)> WoRows16Column(std::integer_sequence<int, NR...>) {
  return {&WoRows16<NR + 1, MR>...};
}

void WoRows16N(const float* bt, const float* const* a, int nr, int mr, int64_t K, int64_t k0,
               int64_t k1, float* c) {
  static constexpr std::array<WoRows16Fn, 8> kOne = WoRows16Column<1>(std::make_integer_sequence<int, 8>());
  static constexpr std::array<WoRows16Fn, 8> kTwo = WoRows16Column<2>(std::make_integer_sequence<int, 8>());
  static constexpr std::array<WoRows16Fn, 8> kThree =
      WoRows16Column<3>(std::make_integer_sequence<int, 8>());
  static constexpr std::array<WoRows16Fn, 6> kFour = WoRows16Column<4>(std::make_integer_sequence<int, 6>());
  switch (mr) {
    case 1: return kOne[nr - 1](bt, a, K, k0, k1, c);
    case 2: return kTwo[nr - 1](bt, a, K, k0, k1, c);
    case 3: return kThree[nr - 1](bt, a, K, k0, k1, c);
    default: return kFour[nr - 1](bt, a, K, k0, k1, c);
  }
}

// Weight rows per call of WoRows16N for mr row blocks: 8 (8 to 24 FMA chains)
// up to three blocks, 6 with four (24 chains).
constexpr int WoQuad(int mr) { return mr <= 3 ? 8 : 6; }
// Row blocks (16 rows each) per register tile.
constexpr int64_t kWoBlocks = 4;

// Weight rows per tile of the blocked path: a chunk of the tile dequantized
// once (kWoTileN x kChunk x 4 = 24 KiB) and a register tile's row blocks
// (kWoBlocks x kChunk x 64 = 32 KiB) stay in L1/L2 while every weight row of
// the tile passes over them.
constexpr int64_t kWoTileN = 48;

// The weight bytes the next dequant step of a blocked path will read, fetched
// into L1 now: a tile's rows are `half` bytes apart, more streams than the
// hardware prefetcher follows, and the dequant loops stalled on those loads.
// Row `row` (bytes [0, half)) reads [c0, c1) now; next it reads [c1, 2 c1 -
// c0), or after its last slice (c1 == half) the first slice of the row nr
// rows on (the next tile). The address is formed as an integer: past the
// weight's end it is never dereferenced, and a prefetch does not fault.
inline void PrefetchNextSlice(const uint8_t* row, int64_t half, int nr, int64_t c0, int64_t c1) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(c1 < half ? c1 : nr * half);
  for (int64_t i = 0; i < c1 - c0; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// The blocked path's K order: K runs in chunks of kChunk (the last one
// zero-padded), and within a chunk position 16 p + i holds k = 8 i + p. The
// 64 weight bytes of a chunk are then 16 dwords whose nibble p is position
// 16 p + i, so a chunk dequantizes with one shift and one permute per 16
// weights (vpermps reads the low 4 bits of each lane: no mask, no widening).

// Chunk j of nr weight rows (row stride half bytes, scales s with row stride
// G) -> bt [nr][kChunk] float32 (q - 8) * s in the chunk order above. gidx:
// ChunkGroupIndex (only when the groupsize is not a multiple of kChunk).
__attribute__((target("avx512f,avx512bw"))) void DequantChunk(const uint8_t* w, int nr, int64_t K,
                                                              int64_t groupsize, const float* s,
                                                              const int32_t* gidx, int64_t j,
                                                              float* bt) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f,
                                      3.f, 4.f, 5.f, 6.f, 7.f);
  const int64_t half = K / 2, G = K / groupsize, g0 = j * kChunk / groupsize;
  const int64_t c0 = j * (kChunk / 2), c1 = std::min(half, c0 + kChunk / 2);
  // The padding of a last chunk reads zeros (q = -8, times the padded x = 0;
  // scales are finite). c1 - c0 is a multiple of 16 bytes: CheckShapes admits
  // groupsizes that are multiples of 32 only, and K is a multiple of them.
  const __mmask16 live = static_cast<__mmask16>(c1 - c0 == kChunk / 2 ? 0xFFFF : (1u << ((c1 - c0) / 4)) - 1);
  const bool whole = groupsize % kChunk == 0;
  for (int n = 0; n < nr; ++n) {
    const __m512i v = _mm512_maskz_loadu_epi32(live, w + n * half + c0);
    float* dst = bt + n * kChunk;
    if (whole) {
      const __m512 ts = _mm512_mul_ps(table, _mm512_set1_ps(s[n * G + g0]));
      for (int p = 0; p < 8; ++p)
        _mm512_storeu_ps(dst + 16 * p, _mm512_permutexvar_ps(p ? _mm512_srli_epi32(v, 4 * p) : v, ts));
    } else {
      const __m512 sv = LaneScales(gidx, j, s + n * G + g0, G - g0);
      for (int p = 0; p < 8; ++p)
        _mm512_storeu_ps(dst + 16 * p,
                         _mm512_mul_ps(_mm512_permutexvar_ps(p ? _mm512_srli_epi32(v, 4 * p) : v, table), sv));
    }
    PrefetchNextSlice(w + n * half, half, nr, c0, c1);
  }
}

// The accumulators of a tile of the blocked paths -> out rows (+ bias): the acc
// of (block group p, weight row q + j, block r) is at cacc + p * kWoBlocks *
// kWoTileN * 16 + q * kWoBlocks * 16 + (j * mr + r) * 16, q a multiple of
// quad(mr); written row by row (contiguous in out).
void StoreRows16Tile(const float* cacc, int (*quad)(int), int64_t Mb, int64_t M, int64_t N, int64_t t0,
                     int nt, const float* bias, float* out) {
  constexpr int64_t kGroupFloats = kWoTileN * kWoBlocks * 16;
  float b[kWoTileN];
  int32_t off[kWoTileN];  // weight row n's accumulators (no division per element)
  for (int n = 0; n < nt; ++n) b[n] = bias ? bias[t0 + n] : 0.0f;
  for (int64_t p = 0; p * kWoBlocks < Mb; ++p) {
    const int64_t b0 = kWoBlocks * p;
    const int mr = static_cast<int>(std::min<int64_t>(kWoBlocks, Mb - b0));
    const int qn = quad(mr);
    for (int q = 0; q < nt; q += qn)
      for (int j = 0; j < qn && q + j < nt; ++j) off[q + j] = static_cast<int32_t>((q * kWoBlocks + j * mr) * 16);
    for (int r = 0; r < mr; ++r)
      for (int64_t i = 0; i < 16 && (b0 + r) * 16 + i < M; ++i) {
        float* o = out + ((b0 + r) * 16 + i) * N + t0;
        const float* cp = cacc + p * kGroupFloats + r * 16 + i;
        for (int n = 0; n < nt; ++n) o[n] = cp[off[n]] + b[n];
      }
  }
}

// The tile loop of both blocked paths: threads over N in tiles of kWoTileN
// weight rows, per thread a dequant buffer (buf_elems of T) and a tile's
// accumulators ([block group][n][block][16]); slices(t0, nt, buf, cacc) adds
// the tile's K slices into cacc, then the tile is written out.
template <typename T, typename Slices>
void Rows16Tiles(int64_t M, int64_t N, int64_t K, int64_t buf_elems, int (*quad)(int), const float* bias,
                 float* out, Slices&& slices) {
  const int64_t Mb = (M + 15) / 16;
  const int threads =
      static_cast<int>(std::min<int64_t>(NumThreads(M * N * K), (N + kTileN - 1) / kTileN));
  const int64_t floats = (Mb + kWoBlocks - 1) / kWoBlocks * kWoTileN * kWoBlocks * 16;
  std::vector<jb::AlignedBuffer<T>> bt;
  std::vector<jb::AlignedBuffer<float>> acc;
  for (int i = 0; i < std::max(threads, 1); ++i) {
    bt.push_back(jb::NewAligned<T>(buf_elems));
    acc.push_back(jb::NewAligned<float>(floats));
  }
  ForTiles(N, threads, [&](int64_t n0, int64_t n1, int id) {
    float* cacc = acc[id].get();
    for (int64_t t0 = n0; t0 < n1; t0 += kWoTileN) {
      const int nt = static_cast<int>(std::min<int64_t>(kWoTileN, n1 - t0));
      std::fill(cacc, cacc + floats, 0.0f);
      slices(t0, nt, bt[id].get(), cacc);
      StoreRows16Tile(cacc, quad, Mb, M, N, t0, nt, bias, out);
    }
  });
}

// Every register tile of a slice: tile(b0, mr, q, nr, c) for the mr <= 4 row
// blocks from b0 and the nr <= quad(mr) weight rows from q, c their
// accumulators in the tile's layout (StoreRows16Tile).
template <typename F>
void ForRegisterTiles(int64_t Mb, int nt, int (*quad)(int), float* cacc, F&& tile) {
  for (int64_t p = 0; p * kWoBlocks < Mb; ++p) {
    const int64_t b0 = kWoBlocks * p;
    const int mr = static_cast<int>(std::min<int64_t>(kWoBlocks, Mb - b0));
    const int qn = quad(mr);
    for (int q = 0; q < nt; q += qn)
      tile(b0, mr, q, std::min(qn, nt - q), cacc + p * kWoTileN * kWoBlocks * 16 + q * kWoBlocks * 16);
  }
}

void WeightOnlyRows16(const float* x, const uint8_t* w, const float* scales, const float* bias,
                      float* out, int64_t M, int64_t N, int64_t K, int64_t groupsize) {
  const int64_t G = K / groupsize, Kp = jb::RoundUp(K, kChunk), chunks = Kp / kChunk;
  const int64_t Mb = (M + 15) / 16;
  // Packed by blocks on the kernel's threads in the chunk order of
  // DequantChunk ([Mb][Kp][16]), written in order, the rows past M and the k
  // past K zero.
  const jb::AlignedBuffer<float> xpk = jb::NewAligned<float>(Mb * Kp * 16);
  jb::ParallelFor(Mb, NumThreads(M * N * K), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bm = b0; bm < b1; ++bm) {
      const int rows = static_cast<int>(std::min<int64_t>(16, M - bm * 16));
      const float* xb = x + bm * 16 * K;
      float* a = xpk.get() + bm * Kp * 16;
      for (int64_t j = 0; j < chunks; ++j)
        for (int p = 0; p < 8; ++p)
          for (int i = 0; i < 16; ++i) {
            const int64_t k = j * kChunk + 8 * i + p;
            float* d = a + (j * kChunk + 16 * p + i) * 16;
            for (int r = 0; r < 16; ++r) d[r] = r < rows && k < K ? xb[r * K + k] : 0.0f;
          }
    }
  });
  const std::vector<int32_t> gidx =
      groupsize % kChunk == 0 ? std::vector<int32_t>() : ChunkGroupIndex(K, groupsize);
  // K in chunks, each chunk of the tile dequantized once and kept in L1/L2
  // while the row blocks pass over it.
  Rows16Tiles<float>(M, N, K, kWoTileN * kChunk, &WoQuad, bias, out,
                     [&](int64_t t0, int nt, float* b, float* cacc) {
    for (int64_t j = 0; j < chunks; ++j) {
      DequantChunk(w + t0 * (K / 2), nt, K, groupsize, scales + t0 * G, gidx.data(), j, b);
      const int64_t k0 = j * kChunk;
      ForRegisterTiles(Mb, nt, &WoQuad, cacc, [&](int64_t b0, int mr, int q, int nr, float* c) {
        const float* a[kWoBlocks];
        for (int r = 0; r < kWoBlocks; ++r) a[r] = xpk.get() + std::min(b0 + r, Mb - 1) * Kp * 16;
        WoRows16N(b - k0 + q * kChunk, a, nr, mr, kChunk, k0, k0 + kChunk, c);
      });
    }
  });
}

// ---------------- weight-only blocked path, bfloat16 activations (AVX512-BF16)
//
// WeightOnlyRows16 with vdpbf16ps: the activations packed [K / 2][16 rows] of
// bf16 pairs (x[2j], x[2j + 1]) (a 32-bit lane per row), weight byte j
// dequantized to the pair (bf16(lo - 8), bf16(hi - 8)) of exact integers, so
// one dot multiplies a broadcast weight pair by 16 rows (32 products, exact in
// float32). The scales cannot be folded into bf16 weights without rounding
// them, so K runs in slices within one group: the register tile sums a
// slice's dots from zero and adds them, times the group's scale, to the tile's
// float32 accumulators.

// Weight bytes [c0, c1) of nr rows (row stride half) -> bt [nr][c1 - c0] bf16
// pairs: 16 bytes widen to 16 lanes b; b | b << 12 puts the low nibble in the
// low word's index bits and the high nibble in the high word's (vpermw reads 5
// bits; kBf16Nibbles repeats, so the extra bit 4 of the low index is moot).
__attribute__((target("avx512f,avx512bw"))) void DequantPairs(const uint8_t* w, int nr, int64_t half,
                                                              int64_t c0, int64_t c1, uint32_t* bt) {
  const __m512i table = _mm512_load_si512(kBf16Nibbles);
  for (int n = 0; n < nr; ++n) {
    for (int64_t c = c0; c < c1; c += 16) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * half + c)));
      const __m512i idx = _mm512_or_si512(v, _mm512_slli_epi32(v, 12));
      _mm512_storeu_si512(bt + n * (c1 - c0) + (c - c0), _mm512_permutexvar_epi16(idx, table));
    }
    PrefetchNextSlice(w + n * half, half, nr, c0, c1);
  }
}

// c[n][r] (float32 [NR][MR][16]) += s[n * G] * sum over pairs [0, np) of the MR
// row blocks (a[r]: [np][16] bf16 pairs) x the NR weight rows of bt ([NR][ldb]
// pairs).
template <int NR, int MR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void WoRows16Bf16(
    const uint32_t* bt, const uint32_t* const* a, int64_t ldb, int64_t np, const float* s, int64_t G,
    float* c) {
  if (np <= 0) return;
  __m512 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm512_setzero_ps();
  int64_t j = 0;
  do {  // at least once (see WoRows16)
    __m512bh av[MR];
    for (int r = 0; r < MR; ++r) av[r] = (__m512bh)_mm512_loadu_si512(a[r] + j * 16);
    for (int n = 0; n < NR; ++n) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(bt[n * ldb + j]));
      for (int r = 0; r < MR; ++r) acc[n][r] = _mm512_dpbf16_ps(acc[n][r], b, av[r]);
    }
  } while (++j < np);
  for (int n = 0; n < NR; ++n) {
    const __m512 sv = _mm512_set1_ps(s[n * G]);
    for (int r = 0; r < MR; ++r) {
      float* cp = c + (n * MR + r) * 16;
      _mm512_storeu_ps(cp, _mm512_fmadd_ps(acc[n][r], sv, _mm512_loadu_ps(cp)));
    }
  }
}

using WoRows16Bf16Fn = void (*)(const uint32_t*, const uint32_t* const*, int64_t, int64_t, const float*,
                                int64_t, float*);

template <int MR, int... NR>
constexpr std::array<WoRows16Bf16Fn, sizeof...(NR)> WoRows16Bf16Column(std::integer_sequence<int, NR...>) {
  return {&WoRows16Bf16<NR + 1, MR>...};
}

void WoRows16Bf16N(const uint32_t* bt, const uint32_t* const* a, int nr, int mr, int64_t ldb, int64_t np,
                   const float* s, int64_t G, float* c) {
  static constexpr auto kOne = WoRows16Bf16Column<1>(std::make_integer_sequence<int, 16>());
  static constexpr auto kTwo = WoRows16Bf16Column<2>(std::make_integer_sequence<int, 12>());
  static constexpr auto kThree = WoRows16Bf16Column<3>(std::make_integer_sequence<int, 8>());
  static constexpr auto kFour = WoRows16Bf16Column<4>(std::make_integer_sequence<int, 6>());
  switch (mr) {
    case 1: return kOne[nr - 1](bt, a, ldb, np, s, G, c);
    case 2: return kTwo[nr - 1](bt, a, ldb, np, s, G, c);
    case 3: return kThree[nr - 1](bt, a, ldb, np, s, G, c);
    default: return kFour[nr - 1](bt, a, ldb, np, s, G, c);
  }
}

// Weight rows per call of WoRows16Bf16N for mr row blocks: 16 to 24
// accumulators (enough independent dot chains to cover vdpbf16ps's latency
// with a single row block).
constexpr int WoQuadBf16(int mr) { return mr == 1 ? 16 : mr == 2 ? 12 : mr == 3 ? 8 : 6; }

// Weight bytes per slice of the bf16 blocked path: 64 (128 k) when that
// divides the group, else the group's bytes up to 128, else 32 or 16.
int64_t Bf16SliceBytes(int64_t groupsize) {
  const int64_t gb = groupsize / 2;  // a multiple of 16
  if (gb % 64 == 0) return 64;
  if (gb <= 128) return gb;
  return gb % 32 == 0 ? 32 : 16;
}

// x [M, K] bf16 -> out [M, N] float32, the blocked form (AVX512-BF16).
void WeightOnlyRows16Bf16(const uint16_t* x, const uint8_t* w, const float* scales, const float* bias,
                          float* out, int64_t M, int64_t N, int64_t K, int64_t groupsize) {
  const int64_t G = K / groupsize, half = K / 2;
  const int64_t Mb = (M + 15) / 16;
  const jb::AlignedBuffer<uint32_t> xpk = jb::NewAligned<uint32_t>(Mb * half * 16);  // as in WeightOnlyRows16
  jb::ParallelFor(Mb, NumThreads(M * N * K), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bm = b0; bm < b1; ++bm) {
      const int rows = static_cast<int>(std::min<int64_t>(16, M - bm * 16));
      uint32_t* a = xpk.get() + bm * half * 16;
      const uint16_t* xb = x + bm * 16 * K;
      for (int64_t j = 0; j < half; ++j)
        for (int i = 0; i < 16; ++i)
          a[j * 16 + i] = i < rows ? static_cast<uint32_t>(xb[i * K + 2 * j]) |
                                         (static_cast<uint32_t>(xb[i * K + 2 * j + 1]) << 16)
                                   : 0u;
    }
  });
  const int64_t sb = Bf16SliceBytes(groupsize), gb = groupsize / 2;
  Rows16Tiles<uint32_t>(M, N, K, kWoTileN * sb, &WoQuadBf16, bias, out,
                        [&](int64_t t0, int nt, uint32_t* b, float* cacc) {
    for (int64_t c0 = 0; c0 < half; c0 += sb) {
      DequantPairs(w + t0 * half, nt, half, c0, c0 + sb, b);
      const float* sg = scales + t0 * G + c0 / gb;
      ForRegisterTiles(Mb, nt, &WoQuadBf16, cacc, [&](int64_t b0, int mr, int q, int nr, float* c) {
        const uint32_t* a[kWoBlocks];
        for (int r = 0; r < kWoBlocks; ++r) a[r] = xpk.get() + (std::min(b0 + r, Mb - 1) * half + c0) * 16;
        WoRows16Bf16N(b + q * sb, a, nr, mr, sb, sb, sg + q * G, G, c);
      });
    }
  });
}
#endif  // JB_X86

// The tile loop of both weight-only row paths: out = bias, then over tiles of
// 2 kTileN weight rows, slices [s0, s1) of K's `units` (so that a block of
// input rows stays in L1 while the tile passes over it) and blocks of up to 4
// input rows: rows(n, m0, nm, s0, s1, res) gives the partial sums res[i] of
// input row m0 + i and weight row n, added into out.
template <typename F>
void RowTiles(int64_t M, int64_t N, int64_t K, int64_t units, int64_t slice, const float* bias,
              float* out, F&& rows) {
  const int threads =
      static_cast<int>(std::min<int64_t>(NumThreads(M * N * K), (N + kTileN - 1) / kTileN));
  ForTiles(N, threads, [&](int64_t n0, int64_t n1, int) {
    float res[4];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) out[m * N + n] = bias ? bias[n] : 0.0f;
    for (int64_t t0 = n0; t0 < n1; t0 += 2 * kTileN) {
      const int64_t t1 = std::min(n1, t0 + 2 * kTileN);
      for (int64_t s0 = 0; s0 < units; s0 += slice) {
        const int64_t s1 = std::min(units, s0 + slice);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int nm = static_cast<int>(std::min<int64_t>(4, M - m0));
          for (int64_t n = t0; n < t1; ++n) {
            rows(n, m0, nm, s0, s1, res);
            for (int i = 0; i < nm; ++i) out[(m0 + i) * N + n] += res[i];
          }
        }
      }
    }
  });
}

// Rows from which the AVX-512 float32 weight-only kernel takes the blocked path: 16 as measured
// on the Zen 4 EPYC; 12 on Intel, whose row kernel slows sooner (Emerald Rapids, K = 4096,
// groupsize 128, fastest of 45 calls in 3 interleaved runs: at N = 4096 the blocked path took
// 3.6 ms at M = 12 and 15 against the row kernel's 3.8 and 4.7; at N = 11008 11.2 / 14.3 against
// 13.2 / 16.6; at M = 8 the row kernel was still ahead, 2.6 against 3.6).
int64_t WoRows16MinRows() {
  static const int64_t rows = jb::IsIntelCpu() ? 12 : 16;
  return rows;
}

// Whether M float32 rows take the integer-dot path (LimbRow; one row, on the
// AVX512-VNNI code path; MakeLimbRow may still hand the row back).
bool UseLimbs(int64_t M, int64_t groupsize) {
#if JB_X86
  return M == 1 && groupsize % 128 == 0 && g_wo_row.load() == &WeightOnlyRowAvx512 &&
         g_group_sums.load() == &GroupSumsVnniN;
#else
  (void)M, (void)groupsize;
  return false;
#endif
}

void WeightOnlyMatmul(const float* x, const uint8_t* w, const float* scales,
                      const float* bias, float* out, int64_t M, int64_t N,
                      int64_t K, int64_t groupsize) {
  if (M == 0 || N == 0) return;
  const int64_t G = K / groupsize;
#if JB_X86
  if (M >= WoRows16MinRows() && g_wo_row.load() == &WeightOnlyRowAvx512) {
    WeightOnlyRows16(x, w, scales, bias, out, M, N, K, groupsize);
    return;
  }
#endif
#if JB_X86
  // One row (decode) on AVX512-VNNI: the integer-dot path (LimbRow), unless
  // the row must take the float32 kernel.
  if (UseLimbs(M, groupsize)) {
    LimbRow r;
    if (MakeLimbRow(x, K, &r)) {
      const int64_t chunks = K / 128;
      std::vector<int32_t> gofc(chunks);
      for (int64_t c = 0; c < chunks; ++c) gofc[c] = static_cast<int32_t>(c / (groupsize / 128));
      const int threads = static_cast<int>(std::min<int64_t>(NumThreads(N * K), (N + kTileN - 1) / kTileN));
      ForTiles(N, threads, [&](int64_t n0, int64_t n1, int) {
        for (int64_t n = n0; n < n1; ++n) {
          const float v = WoLimbRow(w + n * (K / 2), r, gofc.data(), chunks, scales + n * G);
          out[n] = bias ? v + bias[n] : v;
        }
      });
      return;
    }
  }
#endif
  // De-interleave the activations once: even k pair with low nibbles.
  const jb::AlignedBuffer<float> xe = jb::NewAligned<float>(M * (K / 2)), xo = jb::NewAligned<float>(M * (K / 2));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K / 2; ++k) {
      xe[m * (K / 2) + k] = x[m * K + 2 * k];
      xo[m * (K / 2) + k] = x[m * K + 2 * k + 1];
    }
  const WoRowFn row_fn = g_wo_row.load();
#if JB_X86
  if (row_fn == &WeightOnlyRowAvx512) {
    // Weights dequantized in registers, tiles of weight rows shared by blocks of
    // 4 input rows. The row path runs over all of K when a block of input rows
    // fits in L1 (kWoRowPathBytes of float32: decode); above, the blocked path
    // splits K into slices of kWoSliceBytes weight bytes, so that a block of
    // input rows (4 x 2 x 4 KiB) stays in L1 while the tile passes over it; the
    // partial sums add up in `out`.
    const int64_t half = K / 2;
    const int64_t slice = std::min<int64_t>(M, 4) * K * 4 <= kWoRowPathBytes ? half : kWoSliceBytes;
    RowTiles(M, N, K, half, slice, bias, out,
             [&](int64_t n, int64_t m0, int nm, int64_t c0, int64_t c1, float* res) {
      WoRowsAvx512N(w + n * half, xe.get() + m0 * half, xo.get() + m0 * half, half, nm, c0, c1,
                    groupsize, scales + n * G, res);
    });
    return;
  }
#endif
  jb::ParallelFor(N, NumThreads(M * N * K), 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> ue(K / 2), uo(K / 2), res(kWoRowBlock);
    for (int64_t m0 = 0; m0 < M; m0 += kWoRowBlock) {
      const int nm = static_cast<int>(std::min<int64_t>(kWoRowBlock, M - m0));
      for (int64_t n = n0; n < n1; ++n) {
        row_fn(w + n * (K / 2), xe.get() + m0 * (K / 2), xo.get() + m0 * (K / 2),
               nm, K, groupsize, scales + n * G, ue.data(), uo.data(), res.data());
        for (int i = 0; i < nm; ++i)
          out[(m0 + i) * N + n] = bias ? res[i] + bias[n] : res[i];
      }
    }
  });
}

// Rows up to which bfloat16 activations take the AVX512-BF16 row kernel; from
// 16 the AVX512-BF16 blocked path (WeightOnlyRows16Bf16). Measured on a
// 2-core AVX-512 EPYC (K = 4096, N = 4096 / 11008, groupsize 128): even at 16
// rows, the blocked path 1.8x / 1.03x faster at 32.
constexpr int64_t kWoBf16MaxRows = 15;

// Which kernels bfloat16 activations take: 0 (auto) the AVX512-BF16 kernels
// where the CPU has AVX512-BF16, except on Intel, where they are widened to
// float32 (exactly) for the float32 kernels; 1 the AVX512-BF16 kernels
// wherever the CPU has them (tests reach them on Intel too). Measured on a
// 2-core Emerald Rapids in one interleaved run (K = 4096, N = 4096 / 11008,
// groupsize 128, medians of 3 rounds), the AVX512-BF16 kernels against
// widened float32: M = 1 0.55 / 1.14 against 0.39 / 0.73 ms (the integer
// dots), M = 16 5.2 / 11.8 against 3.8 / 10.0, M = 64 15.8 / 38.4 against
// 10.4 / 23.8 (1.2-1.6x; vdpbf16ps costs about two FMAs there), M = 4 to 15
// a tie within 10% either way; M = 256 (separate runs) 53.1 / 200.6 against
// 38.8 / 99.1. Above 512 rows widened calls follow the float32 row limit
// (XLA's GEMM; cpp.unsupported), faster there too (N = 4096: 244 against 263
// ms for the bf16 blocked kernel at 1024 rows, 335 against 547 at 2048).
// On a Zen 4 EPYC the AVX512-BF16 kernels
// were the fastest at every M measured, so AMD keeps them.
std::atomic<int> g_bf16_kernels{0};

bool WidenBf16ToFloat32() { return g_bf16_kernels.load() != 1 && jb::IsIntelCpu(); }

// Whether weight-only calls with bfloat16 activations of M rows and K take
// the AVX512-BF16 kernel.
bool UseBf16Dots(int64_t M, int64_t K) {
#if JB_X86
  return M <= kWoBf16MaxRows && K % kChunk == 0 && jb::HasAvx512Bf16() &&
         g_wo_row.load() == &WeightOnlyRowAvx512 && !WidenBf16ToFloat32();
#else
  (void)M, (void)K;
  return false;
#endif
}

// Whether bfloat16 activations of M rows (above UseBf16Dots) take the
// blocked AVX512-BF16 path.
bool UseBf16Blocked(int64_t M) {
#if JB_X86
  return M > kWoBf16MaxRows && jb::HasAvx512Bf16() && g_wo_row.load() == &WeightOnlyRowAvx512 &&
         !WidenBf16ToFloat32();
#else
  (void)M;
  return false;
#endif
}

// n bfloat16 values (their bits) -> float32 (exact).
std::vector<float> WidenBf16(const uint16_t* x, int64_t n) {
  std::vector<float> xf(n);
  jb::WidenBf16(x, n, xf.data());
  return xf;
}

// float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN):
// what XLA's convert does.
inline uint16_t RoundToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

void WeightOnlyMatmulBf16Into(const uint16_t* x, const uint8_t* w, const float* scales,
                              const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                              int64_t groupsize);

// WeightOnlyMatmul for bfloat16 x (the bits of [M, K] bf16), the result
// rounded to bfloat16 here (one XLA op instead of a custom call and a convert:
// the convert cost more than the kernel at M = 1).
void WeightOnlyMatmulBf16(const uint16_t* x, const uint8_t* w, const float* scales, const float* bias,
                          uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t groupsize) {
  if (M == 0 || N == 0) return;
  std::vector<float> acc(M * N);
  if (UseBf16Dots(M, K)) {
    WeightOnlyMatmulBf16Into(x, w, scales, bias, acc.data(), M, N, K, groupsize);
#if JB_X86
  } else if (UseBf16Blocked(M)) {
    WeightOnlyRows16Bf16(x, w, scales, bias, acc.data(), M, N, K, groupsize);
#endif
  } else {
    const std::vector<float> xf = WidenBf16(x, M * K);
    WeightOnlyMatmul(xf.data(), w, scales, bias, acc.data(), M, N, K, groupsize);
  }
  for (int64_t i = 0; i < M * N; ++i) out[i] = RoundToBf16(acc[i]);
}

// The AVX512-BF16 kernel over all rows (UseBf16Dots) into float32 out.
void WeightOnlyMatmulBf16Into(const uint16_t* x, const uint8_t* w, const float* scales,
                              const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                              int64_t groupsize) {
#if JB_X86
  const int64_t G = K / groupsize, half = K / 2, chunks = K / kChunk;
  const bool whole = groupsize % kChunk == 0;
  const jb::AlignedBuffer<uint16_t> xa = jb::NewAligned<uint16_t>(M * K);
  ArrangeBf16(x, M, K, xa.get());
  const std::vector<int32_t> gidx = whole ? std::vector<int32_t>() : ChunkGroupIndex(K, groupsize);
  std::vector<int32_t> cg(chunks);  // chunk -> its first group (no division per chunk)
  for (int64_t j = 0; j < chunks; ++j) cg[j] = static_cast<int32_t>(j * kChunk / groupsize);
  // K in slices whose activations (up to 4 rows) stay in L1 (kWoRowPathBytes)
  // while a tile of weight rows passes over them; partial sums add up in out.
  const int64_t slice = std::max<int64_t>(
      1, std::min<int64_t>(chunks, kWoRowPathBytes / (std::min<int64_t>(M, 4) * kChunk * 2)));
  RowTiles(M, N, K, chunks, slice, bias, out,
           [&](int64_t n, int64_t m0, int nm, int64_t j0, int64_t j1, float* res) {
    PickWoBf16(nm, whole)(w + n * half, xa.get() + m0 * K, K, j0, j1, cg.data(), G, scales + n * G,
                          gidx.data(), res);
  });
#endif
}

// ------------------------------------------------------------------ binding

template <typename XBuffer>
ffi::Error CheckShapes(const XBuffer& x,
                       const ffi::Buffer<ffi::U8>& w,
                       const ffi::Buffer<ffi::F32>& scales,
                       const ffi::Buffer<ffi::F32>& bias, int64_t groupsize,
                       int64_t* M, int64_t* N, int64_t* K) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scales.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("int4 matmul: bad ranks");
  *K = xd.back();
  *M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) *M *= xd[i];
  *N = wd[0];
  if (wd[1] * 2 != *K || groupsize <= 0 || groupsize % 32 != 0 ||
      *K % groupsize != 0 || sd[0] != *N || sd[1] != *K / groupsize ||
      bias.element_count() != static_cast<size_t>(*N))
    return ffi::Error::InvalidArgument("int4 matmul: inconsistent shapes");
  return ffi::Error::Success();
}

ffi::Error DynQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> bias,
                        ffi::ResultBuffer<ffi::F32> out, int64_t groupsize,
                        bool has_bias) {
  jb::PoolScope scope(pool);
  int64_t M, N, K;
  ffi::Error e = CheckShapes(x, w, scales, bias, groupsize, &M, &N, &K);
  if (e.failure()) return e;
  DynQuantMatmul(x.typed_data(), w.typed_data(), scales.typed_data(),
                 has_bias ? bias.typed_data() : nullptr, out->typed_data(), M, N,
                 K, groupsize, /*skip_nan=*/false);
  return ffi::Error::Success();
}

ffi::Error WeightOnlyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> bias,
                          ffi::ResultBuffer<ffi::F32> out, int64_t groupsize,
                          bool has_bias) {
  jb::PoolScope scope(pool);
  int64_t M, N, K;
  ffi::Error e = CheckShapes(x, w, scales, bias, groupsize, &M, &N, &K);
  if (e.failure()) return e;
  WeightOnlyMatmul(x.typed_data(), w.typed_data(), scales.typed_data(),
                   has_bias ? bias.typed_data() : nullptr, out->typed_data(), M,
                   N, K, groupsize);
  return ffi::Error::Success();
}

// Dyn-quant with bfloat16 x: x widened to float32 (exact), the float32 result
// truncated to bfloat16 (the low 16 bits dropped, torch's rule), here rather
// than in two more XLA ops (which cost as much as the kernel at M = 1).
ffi::Error DynQuantBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                            ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> bias,
                            ffi::ResultBuffer<ffi::BF16> out, int64_t groupsize, bool has_bias) {
  jb::PoolScope scope(pool);
  int64_t M, N, K;
  ffi::Error e = CheckShapes(x, w, scales, bias, groupsize, &M, &N, &K);
  if (e.failure()) return e;
  if (M == 0 || N == 0) return ffi::Error::Success();
  const std::vector<float> xf = WidenBf16(x.typed_data(), M * K);
  std::vector<float> acc(M * N);
  DynQuantMatmul(xf.data(), w.typed_data(), scales.typed_data(), has_bias ? bias.typed_data() : nullptr,
                 acc.data(), M, N, K, groupsize, /*skip_nan=*/true);
  uint16_t* o = out->typed_data();
  for (int64_t i = 0; i < M * N; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &acc[i], 4);
    o[i] = static_cast<uint16_t>(bits >> 16);
  }
  return ffi::Error::Success();
}

ffi::Error WeightOnlyBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                              ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> bias,
                              ffi::ResultBuffer<ffi::BF16> out, int64_t groupsize, bool has_bias) {
  jb::PoolScope scope(pool);
  int64_t M, N, K;
  ffi::Error e = CheckShapes(x, w, scales, bias, groupsize, &M, &N, &K);
  if (e.failure()) return e;
  WeightOnlyMatmulBf16(x.typed_data(), w.typed_data(), scales.typed_data(),
                       has_bias ? bias.typed_data() : nullptr, out->typed_data(), M, N, K, groupsize);
  return ffi::Error::Success();
}

}  // namespace

namespace {
// The binding of every int4 handler: x (T), packed weight, scales, bias ->
// out (T); attributes groupsize and has_bias.
template <ffi::DataType T>
auto Int4Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::U8>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<T>>()
      .template Attr<int64_t>("groupsize")
      .template Attr<bool>("has_bias");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbInt4DynQuantMatmulF32, DynQuantImpl, Int4Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbInt4MatmulF32, WeightOnlyImpl, Int4Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbInt4DynQuantMatmulBf16, DynQuantBf16Impl, Int4Binding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbInt4MatmulBf16, WeightOnlyBf16Impl, Int4Binding<ffi::BF16>());

// The path of weight-only calls with bfloat16 activations of `rows` rows and
// K = k here (this CPU, the selected code path, the shape): 1 the AVX512-BF16
// row kernel, 2 the AVX512-BF16 blocked path, 0 widened to float32.
extern "C" int JbInt4WeightOnlyBf16Path(int64_t rows, int64_t k) {
  if (UseBf16Dots(rows, k)) return 1;
  return UseBf16Blocked(rows) ? 2 : 0;
}

// 1: the kernels' threads run on XLA's intra-op pool (the default); 0: each
// call starts threads of its own (tests, benchmarks).
extern "C" void JbInt4SetXlaPool(int on) { jb::SetUseXlaPool(on != 0); }

// "auto": bfloat16 activations take the AVX512-BF16 kernels except on Intel
// (g_bf16_kernels); "always": wherever the CPU has AVX512-BF16 (tests).
// Returns 0, or -1 for an unknown name.
extern "C" int JbInt4SetBf16Kernels(const char* mode) {
  if (mode == nullptr) return -1;
  const std::string m(mode);
  if (m != "auto" && m != "always") return -1;
  g_bf16_kernels = m == "always" ? 1 : 0;
  return 0;
}

// The instruction set the dyn-quant kernel uses ("avx512vnni", "avx512bw",
// "avx2", "scalar").
extern "C" const char* JbInt4Isa() { return BlockDotsName(); }

// Selects the code path of both kernels (tests cover every path this CPU
// runs; the weight-only kernel has one AVX-512 path for both AVX-512 names).
// Returns 0 on success, -1 if the name is unknown or this CPU lacks it.
extern "C" int JbInt4SetIsa(const char* name) {
  const std::string n(name);
  if (n == "scalar") {
    g_block_dots = &BlockDotsScalar;
    g_tail = &TailScalar;
    g_group_sums = nullptr;
    g_rows16 = nullptr;
    g_wo_row = &WeightOnlyRowScalar;
    return 0;
  }
#if JB_X86
  if (HasAvx512() && (n == "avx512bw" || (n == "avx512vnni" && HasAvx512Vnni()))) {
    g_block_dots = n == "avx512bw" ? &BlockDotsAvx512Bw : &BlockDotsAvx512Vnni;
    g_tail = &TailAvx512;
    g_group_sums = n == "avx512bw" ? &GroupSumsBwN : &GroupSumsVnniN;
    g_rows16 = n == "avx512bw" ? &Rows16BwN : &Rows16VnniN;
    g_wo_row = &WeightOnlyRowAvx512;
    return 0;
  }
  if (HasAvx2() && n == "avx2") {
    g_block_dots = &BlockDotsAvx2;
    g_tail = &TailAvx2;
    g_group_sums = nullptr;
    g_rows16 = nullptr;
    g_wo_row = &WeightOnlyRowAvx2;
    return 0;
  }
#endif
  return -1;
}
