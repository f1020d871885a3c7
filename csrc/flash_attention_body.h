// The compute of the flash attention kernels, written once over a small
// vector interface and compiled once per instruction set: flash_attention.cc
// includes this file inside a namespace per ISA (scalar, avx2, avx512) that
// first defines
//   JB_TGT                      the target attribute of that ISA's functions;
//   kW, Vf                      lanes and the vector type (float for scalar);
//   Zero, Set1, Load, Store, Add, Sub, Mul, MulSub (a * b - c, one rounding), AllLe (a <= b in
//   every lane), Div, Min, Max (maxps semantics:
//   the second operand when either is NaN), Abs, CopySign, Exp2, HSum, HMax,
//   KeepWhere (s where kW booleans are true, -inf elsewhere);
//   Gemm<ACC>(M, N, K, A, sam, sak, B, ldb, bps, C, ldc), the register-blocked
//   matmul over 16-column panels (see flash_attention.cc).
// Every loop over a score row steps kW lanes; rows are multiples of 16 long.

// tanh(x), from one Exp2 of -2|x| log2(e) <= 0: (1 - e) / (1 + e) with x's
// sign; absolute error ~1e-7, tanh(+-inf) = +-1, NaN stays NaN.
JB_TGT inline Vf Tanh(Vf x) {
  const Vf e = Exp2(Mul(Set1(-2.f * kLog2e), Abs(x)));
  const Vf one = Set1(1.f);
  return CopySign(Div(Sub(one, e), Add(one, e)), x);
}

// The soft cap on rows [0, R) of base-2 logits s (row stride ld, nc columns):
// s -> cap2 * tanh(s / cap2), the same map as cap * tanh(x / cap) on natural
// logits x = s ln 2.
JB_TGT inline void SoftCap(float cap2, int64_t R, int64_t nc, float* s, int64_t ld) {
  const Vf c = Set1(cap2), ic = Set1(1.f / cap2);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < nc; j += kW) Store(s + r * ld + j, Mul(c, Tanh(Mul(ic, Load(s + r * ld + j)))));
}

// The bias (in base-2 units) and the boolean mask on row t of head (b, n):
// columns [c0, c0 + nc) of the block, the real keys only (the padded ones are
// masked by MaskRow: t sees no key >= S).
JB_TGT inline void BiasMaskRow(const Problem& p, int64_t b, int64_t n, int64_t t, int64_t c0,
                               int64_t nc, float* s) {
  const int64_t cv = std::min(nc, p.S - c0);
  if (p.bias) {
    const int64_t bb = p.bias_B == 1 ? 0 : b, bn = p.bias_N == 1 ? 0 : n;
    const float* br = p.bias + ((bb * p.bias_N + bn) * p.T + t) * p.S + c0;
    // bias * log2(e), kept finite where the bias is: finfo(float32).min (the usual additive padding
    // mask) times log2(e) would be -inf, and a row of it would look fully masked where jax.nn and
    // torch give the mean of V. max(min(b, -FLT_MAX), x) and min(max(b, FLT_MAX), .) leave x alone
    // unless it overflowed past a finite b; an infinite b stays infinite, and a NaN x stays NaN (the
    // second operand is what maxps / minps return when either is NaN).
    const Vf l2e = Set1(kLog2e), lo = Set1(-FLT_MAX), hi = Set1(FLT_MAX);
    int64_t c = 0;
    for (; c + kW <= cv; c += kW) {
      const Vf bv = Load(br + c);
      const Vf b2 = Min(Max(bv, hi), Max(Min(bv, lo), Mul(l2e, bv)));
      Store(s + c, Add(Load(s + c), b2));
    }
    for (; c < cv; ++c) {
      const float b2 = kLog2e * br[c];
      s[c] += std::isfinite(br[c]) ? std::min(std::max(b2, -FLT_MAX), FLT_MAX) : b2;
    }
  }
  if (p.mask) {
    const int64_t mb = p.mask_B == 1 ? 0 : b, mn = p.mask_N == 1 ? 0 : n;
    const bool* mr = p.mask + ((mb * p.mask_N + mn) * p.T + t) * p.S + c0;
    int64_t c = 0;
    for (; c + kW <= cv; c += kW) Store(s + c, KeepWhere(mr + c, Load(s + c)));
    for (; c < cv; ++c) s[c] = mr[c] ? s[c] : -kInf;
  }
}

// The matmuls of the forward on float32 packs (PackKeys): q k^T from kt (16-key panels), p v
// from vp (16-feature panels). A task's rows are copied pre-scaled into qs. FwdTask is written
// over this interface (Queries, Scores, ScoresRow, AddValues; kKeys, the alignment of key blocks;
// post, the factor FwdTask's softmax applies to the scores, 1 where Scores gave base-2 logits;
// Row and Emit (or Emit2 where kEmitPairs), which keep the probabilities for AddValues; Exp, the
// softmax's 2^x), which the AMX bf16 forward (flash_attention.cc) implements on tiles.
struct F32Mats {
  static constexpr int64_t kKeys = 16;
  static constexpr bool kEmitPairs = false;  // Emit2 (two vectors at once) instead of Emit
  static constexpr float post = 1.f;
  const Problem& p;
  FwdScratch& sc;
  const float* ktb;
  const float* vpb;
  JB_TGT F32Mats(const FwdCtx& x, FwdScratch& s, int64_t b, int64_t kh)
      : p(x.p), sc(s), ktb(x.kt + (b * p.K + kh) * p.H * p.Sp),
        vpb(x.vp + (b * p.K + kh) * p.Sp * p.Hvp) {}
  // Rows [t0, t0 + R) of query head n of batch b, times scale * log2(e).
  JB_TGT void Queries(const FwdCtx& x, int64_t b, int64_t n, int64_t t0, int64_t R) {
    for (int64_t r = 0; r < R; ++r) {
      const float* src = x.q + ((b * p.T + t0 + r) * p.N + n) * p.H;
      for (int64_t d = 0; d < p.H; ++d) sc.qs[r * p.H + d] = src[d] * p.scale2;
    }
  }
  // s[r, 0:nc] = base-2 logits of rows [0, R) against keys [c0, c0 + nc).
  JB_TGT void Scores(int64_t R, int64_t c0, int64_t nc, float* s, int64_t ld) {
    Gemm<false>(R, nc, p.H, sc.qs.data(), p.H, 1, ktb + c0 * p.H, 16, 16 * p.H, s, ld);
  }
  // The same for row r alone, into sr.
  JB_TGT void ScoresRow(int64_t r, int64_t c0, int64_t nc, float* sr) {
    Gemm<false>(1, nc, p.H, sc.qs.data() + r * p.H, p.H, 1, ktb + c0 * p.H, 16, 16 * p.H, sr, nc);
  }
  JB_TGT static Vf Exp(Vf x) { return Exp2(x); }
  // Where row r's probabilities go (Row), and Emit of those of columns [c, c + kW) there: in
  // place of its scores.
  JB_TGT float* Row(int64_t, float* sr) { return sr; }
  JB_TGT static void Emit(float* pr, int64_t c, Vf e) { Store(pr + c, e); }
  // acc[r, 0:Hvp] += sum_c s[r, c] v[c0 + c], r < R.
  JB_TGT void AddValues(int64_t R, int64_t c0, int64_t nc, const float* s, int64_t ld, float* acc) {
    Gemm<true>(R, p.Hvp, nc, s, ld, 1, vpb + c0 * 16, 16, 16 * p.Sp, acc, p.Hvp);
  }
};

// One (batch, query head, query block) task. Tasks go head by head, so the
// threads sweep the same head's k / v at the same time (it stays in L3 at long
// lengths); within a head the heaviest blocks (the last ones under a causal
// mask) come first. With a bias / mask broadcast over the heads, query block
// by query block instead (heaviest first), all heads of a block together.
template <class Mats>
JB_TGT void FwdTask(const FwdCtx& x, FwdScratch& sc, int64_t task) {
  const Problem& p = x.p;
  const int64_t ldS = ScoreLd(p.bk);
  // A bias / mask shared by the heads: the heads of one query block run together instead, so
  // that its [bq, S] tile is read from memory once (k / v of every head then share the L3).
  const bool heads_inner = (p.bias && p.bias_N == 1) || (p.mask && p.mask_N == 1);
  const int64_t BN = p.B * p.N;
  const int64_t bn = heads_inner ? task % BN : task / x.nq;
  const int64_t i = x.nq - 1 - (heads_inner ? task / BN : task % x.nq);
  const int64_t b = bn / p.N, n = bn % p.N, kh = n / p.G;
  const int64_t t0 = i * p.bq, R = std::min(p.bq, p.T - t0);
  int64_t lo_all = p.S, hi_all = 0;
  for (int64_t r = 0; r < R; ++r) {
    RowRange(p, b, t0 + r, &sc.lo[r], &sc.hi[r]);
    if (sc.hi[r] > sc.lo[r]) {
      lo_all = std::min(lo_all, sc.lo[r]);
      hi_all = std::max(hi_all, sc.hi[r]);
    }
    sc.m[r] = -kInf;
    Store(sc.l.data() + r * kW, Zero());  // the row's sum of exponentials, kept in kW lanes
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + R * p.Hvp, 0.f);
  Mats mm(x, sc, b, kh);
  mm.Queries(x, b, n, t0, R);
  constexpr int64_t kA = Mats::kKeys;
  // The logits are s * post (post > 0): the max is taken of s, the exponents are s * post - m.
  const float post = mm.post;
  const Vf pv = Set1(post);
  for (int64_t c0 = lo_all / kA * kA; c0 < hi_all; c0 += p.bk) {
    const int64_t nc = std::min(p.bk, RoundUp(hi_all, kA) - c0);
    float* s = sc.s.data();
    mm.Scores(R, c0, nc, s, ldS);
    if (p.cap2 > 0.f) SoftCap(p.cap2, R, nc, s, ldS);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * ldS;
      if (p.bias || p.mask) BiasMaskRow(p, b, n, t0 + r, c0, nc, sr);
      if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
        MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, sr);
      if (sc.m[r] != -kInf) {
        // One pass against the running max: no rescaling of acc unless this block's max exceeds
        // it by more than 2^kSlack (then the row's scores are recomputed and rescaled as usual).
        // Exponents beyond kSlack (far from float overflow) are clamped or recomputed; lse =
        // m + log2(l) is unchanged.
        constexpr float kSlack = 64.f;
        const Vf mv = Set1(sc.m[r]);
        Vf mx = Set1(-kInf), sum = Zero();
        const auto pr = mm.Row(r, sr);
        if constexpr (Mats::kEmitPairs) {
          // Two vectors a step (nc is a multiple of kKeys), and no clamp: an exponent above kSlack
          // (an inf e included: Mats::Exp is defined for every input) only enters sum and the
          // probabilities, which the recompute below then replaces.
          for (int64_t c = 0; c < nc; c += 2 * kW) {
            const Vf s0 = Load(sr + c), s1 = Load(sr + c + kW);
            mx = Max(mx, Max(s0, s1));
            const Vf e0 = Mats::Exp(MulSub(s0, pv, mv)), e1 = Mats::Exp(MulSub(s1, pv, mv));
            Mats::Emit2(pr, c, e0, e1);
            sum = Add(sum, Add(e0, e1));
          }
        } else {
          for (int64_t c = 0; c < nc; c += kW) {
            const Vf sv = Load(sr + c);
            mx = Max(mx, sv);
            const Vf e = Mats::Exp(Min(Set1(kSlack), MulSub(sv, pv, mv)));
            Mats::Emit(pr, c, e);
            sum = Add(sum, e);
          }
        }
        // The exponents the loop computed, bounded through the largest: fl(mx * post - m) is
        // monotonic in mx. (Not mx * post <= m + kSlack: for |m| in [2^30, 2^31), a bias of -1e9
        // for one, m + kSlack rounds to m + 128 half the time, and 2^128 is inf.)
        if (AllLe(MulSub(mx, pv, mv), Set1(kSlack))) {
          float* lr = sc.l.data() + r * kW;
          Store(lr, Add(Load(lr), sum));
          continue;
        }
        mm.ScoresRow(r, c0, nc, sr);
        if (p.cap2 > 0.f) SoftCap(p.cap2, 1, nc, sr, ldS);
        if (p.bias || p.mask) BiasMaskRow(p, b, n, t0 + r, c0, nc, sr);
        if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
          MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, sr);
      }
      // Raw scores (post != 1) are scaled in place first, so that the row's largest exponent is
      // exactly 0: a fused s * post - m keeps the product's rounding error, which passes 64 for
      // logits past ~2^31 and makes 2^x inf. (The compiler may fuse a Mul and a Sub, hence the
      // pass through memory.)
      if (post != 1.f)
        for (int64_t c = 0; c < nc; c += kW) Store(sr + c, Mul(pv, Load(sr + c)));
      Vf mx = Set1(-kInf);
      for (int64_t c = 0; c < nc; c += kW) mx = Max(mx, Load(sr + c));
      const float m_new = std::max(sc.m[r], HMax(mx));
      const float m_use = m_new == -kInf ? 0.f : m_new;
      const Vf mv = Set1(m_use);
      Vf sum = Zero();
      const auto pr = mm.Row(r, sr);
      for (int64_t c = 0; c < nc; c += kW) {
        const Vf e = Mats::Exp(Sub(Load(sr + c), mv));
        Mats::Emit(pr, c, e);
        sum = Add(sum, e);
      }
      const float alpha = sc.m[r] == -kInf ? 0.f : std::exp2(sc.m[r] - m_use);
      float* lr = sc.l.data() + r * kW;
      Store(lr, Add(Mul(Set1(alpha), Load(lr)), sum));
      sc.m[r] = m_new;
      if (alpha != 1.f) {
        float* ar = sc.acc.data() + r * p.Hvp;
        const Vf av = Set1(alpha);
        for (int64_t d = 0; d < p.Hvp; d += kW) Store(ar + d, Mul(av, Load(ar + d)));
      }
    }
    mm.AddValues(R, c0, nc, s, ldS, sc.acc.data());
  }
  for (int64_t r = 0; r < R; ++r) {
    const float l = HSum(Load(sc.l.data() + r * kW));
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
  // Uninitialised: the packing writes every element (its zero padding included), and the pages
  // are first touched by the threads that pack them.
  const auto kt = jb::NewAligned<float>(p.B * p.K * p.H * p.Sp);
  const auto vp = jb::NewAligned<float>(p.B * p.K * p.Sp * p.Hvp);
  const int threads = ThreadsFor(2.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  ParallelTasks(p.B * p.K, threads, [&](int64_t bkh, int) {
    PackKeys(p, k, p.H, p.Hp, kt.get(), nullptr, bkh);
    PackKeys(p, v, p.Hv, p.Hvp, nullptr, vp.get(), bkh);
  });
  std::vector<FwdScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.qs.resize(p.bq * p.H);
    sc.s.resize(p.bq * ScoreLd(p.bk));
    sc.acc.resize(p.bq * p.Hvp);
    sc.m.resize(p.bq);
    sc.l.resize(p.bq * kW);
    sc.lo.resize(p.bq);
    sc.hi.resize(p.bq);
  }
  const FwdCtx x{p, q, kt.get(), vp.get(), out, lse, nq};
  ParallelTasks(p.B * p.N * nq, threads,
                [&](int64_t task, int id) { FwdTask<F32Mats>(x, scratch[id], task); });
}

// The backward's P = 2^(s - lse2) needs lse2 = m + log2(l) to hold log2(l), and a float holds it
// only to half an ulp of lse2: P's relative error grows with |lse2| (~1e-5 at 256), and a row of
// large logits loses l altogether (a padding bias of -1e9: lse2 ~ -1.44e9, whose ulp is 128, so P
// was 1 where it is 1/S, and the gradients of that row S times too large). Rows with |lse2| >= this
// (a tolerance choice) have (m, log2(l)) recomputed (ExactRowStats).
constexpr float kExactStatsFrom = 256.f;

// Rows [t0, t0 + R) of query head (b, n) (R <= bq): their base-2 max m and log2 of l = sum
// 2^(s - m) over the keys each sees, from the scores as BwdKeyBlock forms them (so that s - m is
// exact where a row is largest), into m[r] and lo2[r], in place of the lse2 in m[r] (and 0 in
// lo2[r]) where m + log2(l) agrees with that lse2 to 2^-20 of it. Elsewhere the row is left alone:
// a row that sees no key, and one whose lse2 covers keys this call does not see (a ring's
// backward passes each key shard the global lse), whose local statistics are not its softmax's.
// s: bq * bk floats of scratch.
JB_TGT void ExactRowStats(const Problem& p, const float* qs, const float* kt, int64_t b, int64_t n,
                          int64_t t0, int64_t R, float* s, float* m, float* lo2) {
  std::vector<int64_t> lo(R), hi(R);
  std::vector<float> mr(R, -kInf), l(R, 0.f);
  int64_t first = p.S, last = 0;
  for (int64_t r = 0; r < R; ++r) {
    RowRange(p, b, t0 + r, &lo[r], &hi[r]);
    if (hi[r] > lo[r]) first = std::min(first, lo[r]), last = std::max(last, hi[r]);
  }
  const float* ktb = kt + (b * p.K + n / p.G) * p.H * p.Sp;
  const float* qr = qs + ((b * p.N + n) * p.T + t0) * p.Hp;
  for (int64_t c0 = first / p.bk * p.bk; c0 < last; c0 += p.bk) {
    const int64_t nc = std::min(p.bk, p.Sp - c0);
    Gemm<false>(R, nc, p.H, qr, p.Hp, 1, ktb + c0 * p.H, 16, 16 * p.H, s, p.bk);
    if (p.cap2 > 0.f) SoftCap(p.cap2, R, nc, s, p.bk);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * p.bk;
      if (p.bias || p.mask) BiasMaskRow(p, b, n, t0 + r, c0, nc, sr);
      if (lo[r] > c0 || hi[r] < c0 + nc || p.q_seg) MaskRow(p, b, t0 + r, lo[r], hi[r], c0, nc, sr);
      Vf mx = Set1(-kInf);
      for (int64_t c = 0; c < nc; c += kW) mx = Max(mx, Load(sr + c));
      const float m_new = std::max(mr[r], HMax(mx));
      if (m_new == -kInf) continue;
      const Vf mv = Set1(m_new);
      Vf sum = Zero();
      for (int64_t c = 0; c < nc; c += kW) sum = Add(sum, Exp2(Sub(Load(sr + c), mv)));
      l[r] = (mr[r] == -kInf ? 0.f : l[r] * std::exp2(mr[r] - m_new)) + HSum(sum);
      mr[r] = m_new;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    if (!(l[r] > 0.f) || !std::isfinite(l[r])) continue;
    const float r2 = std::log2(l[r]);
    if (std::fabs(mr[r] + r2 - m[r]) <= std::fabs(m[r]) * 0x1p-20f) {
      m[r] = mr[r];
      lo2[r] = r2;
    }
  }
}

// Key block j of (batch b, kv head kh): dK / dV of its keys, dQ into dqb.
// delta = rowsum(dO * O) - dlse; lse of the forward (natural log).
JB_TGT void BwdKeyBlock(const BwdCtx& x, BwdScratch& sc, float* dqb, int64_t b, int64_t kh,
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
      const float* lo2 = x.lo2 + row0;
      const float* dl = x.dl + row0;
      float* pm = sc.pm.data();
      float* ds = sc.ds.data();
      Gemm<false>(R, nc, p.H, qs, p.Hp, 1, ktb, 16, 16 * p.H, pm, ldS);
      Gemm<false>(R, nc, p.Hv, dos, p.Hvp, 1, vtb, 16, 16 * p.Hv, ds, ldS);
      if (p.cap2 > 0.f) SoftCap(p.cap2, R, nc, pm, ldS);
      const Vf ic = Set1(p.cap2 > 0.f ? 1.f / p.cap2 : 0.f), one = Set1(1.f);
      for (int64_t r = 0; r < R; ++r) {
        float* pr = pm + r * ldS;
        float* dr = ds + r * ldS;
        if (p.cap2 > 0.f) {
          // The soft cap's derivative 1 - tanh^2 = 1 - (s / cap2)^2, from the capped logits
          // before the bias and the masks (clamped at 0 against rounding; a NaN stays NaN).
          for (int64_t c = 0; c < nc; c += kW) {
            const Vf t = Mul(Load(pr + c), ic);
            Store(sc.dcap.data() + c, Max(Zero(), Sub(one, Mul(t, t))));
          }
        }
        if (p.bias || p.mask) BiasMaskRow(p, b, n, t0 + r, c0, nc, pr);
        if (sc.lo[r] > c0 || sc.hi[r] < c0 + nc || p.q_seg)
          MaskRow(p, b, t0 + r, sc.lo[r], sc.hi[r], c0, nc, pr);
        float* db = p.dbias ? p.dbias + (((p.dbias_B == 1 ? 0 : b) * p.dbias_N +
                                          (p.dbias_N == 1 ? 0 : n)) * p.T + t0 + r) * p.S + c0
                            : nullptr;
        const Vf l2 = Set1(lse2[r]), r2 = Set1(lo2[r]);
        const Vf dlv = Set1(dl[r]);
        if (p.cap2 > 0.f) {
          // dS also carries the soft cap's derivative (dcap).
          for (int64_t c = 0; c < nc; c += kW) {
            const Vf d = Load(sc.dcap.data() + c);
            const Vf e = Exp2(Sub(Sub(Load(pr + c), l2), r2));
            const Vf g = Mul(e, Sub(Load(dr + c), dlv));
            Store(pr + c, e);
            if (db) Store(sc.gb.data() + c, g);  // the bias gradient: before the cap's factor
            Store(dr + c, Mul(g, d));
          }
        } else {
          for (int64_t c = 0; c < nc; c += kW) {
            const Vf e = Exp2(Sub(Sub(Load(pr + c), l2), r2));
            Store(pr + c, e);
            Store(dr + c, Mul(e, Sub(Load(dr + c), dlv)));
          }
        }
        if (db) {  // dbias += dS (the bias's gradient, before the cap's factor)
          const float* g = p.cap2 > 0.f ? sc.gb.data() : dr;
          int64_t c = 0;
          for (; c + kW <= cv; c += kW) Store(db + c, Add(Load(db + c), Load(g + c)));
          for (; c < cv; ++c) db[c] += g[c];
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
  // Uninitialised, as in Forward: the packing writes every element.
  const auto kt = jb::NewAligned<float>(p.B * p.K * p.H * p.Sp);
  const auto kp = jb::NewAligned<float>(p.B * p.K * p.Sp * p.Hp);
  const auto vt = jb::NewAligned<float>(p.B * p.K * p.Hv * p.Sp);
  const int threads = ThreadsFor(5.0 * p.B * p.N * p.T * p.S * (p.H + p.Hv));
  ParallelTasks(p.B * p.K, threads, [&](int64_t bkh, int) {
    PackKeys(p, k, p.H, p.Hp, kt.get(), kp.get(), bkh);
    PackKeys(p, v, p.Hv, p.Hvp, vt.get(), nullptr, bkh);
  });
  const int64_t heads = p.B * p.N;
  const auto qs = jb::NewAligned<float>(heads * p.T * p.Hp);
  const auto dos = jb::NewAligned<float>(heads * p.T * p.Hvp);
  const auto lse2 = jb::NewAligned<float>(heads * p.T), dl = jb::NewAligned<float>(heads * p.T);
  const auto lo2 = jb::NewAligned<float>(heads * p.T);
  ParallelTasks(heads, threads, [&](int64_t bn, int) {
    PackQueries(p, q, dout, lse, delta, qs.get(), dos.get(), lse2.get(), lo2.get(), dl.get(), bn);
  });
  {  // Runs of up to bq consecutive rows whose lse2 is too large (see kExactStatsFrom).
    std::vector<jb::AlignedVector<float>> rows(threads, jb::AlignedVector<float>(p.bq * p.bk));
    ParallelTasks(heads, threads, [&](int64_t bn, int id) {
      float* l2 = lse2.get() + bn * p.T;
      // Rows whose cotangent is 0 (dO and delta; a loss that ignores padded rows) are left alone:
      // their P only ever multiplies 0.
      const auto big = [&](int64_t t) {
        if (!std::isfinite(l2[t]) || std::fabs(l2[t]) < kExactStatsFrom) return false;
        const float* d = dos.get() + (bn * p.T + t) * p.Hvp;
        return dl[bn * p.T + t] != 0.f || std::any_of(d, d + p.Hv, [](float x) { return x != 0.f; });
      };
      for (int64_t t = 0; t < p.T; ++t) {
        if (!big(t)) continue;
        int64_t R = 1;
        while (R < p.bq && t + R < p.T && big(t + R)) ++R;
        ExactRowStats(p, qs.get(), kt.get(), bn / p.N, bn % p.N, t, R, rows[id].data(), l2 + t,
                      lo2.get() + bn * p.T + t);
        t += R - 1;
      }
    });
  }
  // Work goes by owners: sets of (batch, kv head) groups of which one task writes every dK / dV
  // row, dQ row and dbias entry (of a key block). Each group is its own owner, unless the bias's
  // gradient is summed over the batches and / or heads it broadcasts over: then the groups that
  // share dbias entries form one owner and add into them one after another, in a fixed order.
  const bool shared = p.dbias && p.dbias_B * p.dbias_N < p.B * p.N;
  const int64_t ob = shared ? p.dbias_B : p.B;             // owners along the batch
  const int64_t ok = shared && p.dbias_N == 1 ? 1 : p.K;  // owners along the kv heads
  const int64_t owners = ob * ok;
  const BwdCtx x{p, qs.get(), dos.get(), lse2.get(), lo2.get(), dl.get(), kt.get(), kp.get(),
                 vt.get(), dk, dv};
  const auto key_block = [&](BwdScratch& sc, float* dqb, int64_t o, int64_t j) {
    const int64_t b0 = ob == p.B ? o / ok : 0, b1 = ob == p.B ? b0 + 1 : p.B;
    const int64_t k0 = ok == p.K ? o % ok : 0, k1 = ok == p.K ? k0 + 1 : p.K;
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t kh = k0; kh < k1; ++kh) BwdKeyBlock(x, sc, dqb, b, kh, j);
  };
  // Whole owners per task own their dQ rows: one dQ buffer. With too few of
  // them to keep the threads busy, tasks are key blocks and every thread
  // accumulates dQ in a buffer of its own (summed at the end).
  const bool whole = threads == 1 || owners >= 4 * threads || owners % threads == 0;
  const int nbuf = whole ? 1 : threads;
  const int64_t qsize = p.B * p.T * p.N * p.Hp;
  const auto dqbuf = jb::NewAligned<float>(nbuf * qsize);
  ZeroOn(threads, dqbuf.get(), nbuf * qsize);
  std::vector<BwdScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.pm.resize(p.bq * p.bk);
    sc.ds.resize(p.bq * p.bk);
    sc.dka.resize(p.bk * p.Hp);
    sc.dva.resize(p.bk * p.Hvp);
    sc.gb.resize(p.bk);
    sc.dcap.resize(p.bk);
    sc.lo.resize(p.bq);
    sc.hi.resize(p.bq);
  }
  if (p.dbias) ZeroOn(threads, p.dbias, p.dbias_B * p.dbias_N * p.T * p.S);
  if (whole) {
    ParallelTasks(owners, threads, [&](int64_t task, int id) {
      for (int64_t j = 0; j < nk; ++j) key_block(scratch[id], dqbuf.get(), task, j);
    });
  } else {
    // Heaviest key blocks (the first ones under a causal mask) first. Static assignment: each
    // thread's dQ buffer always sums the same blocks in the same order, so dQ is reproducible.
    StaticTasks(owners * nk, threads, [&](int64_t task, int id) {
      key_block(scratch[id], dqbuf.get() + id * qsize, task % owners, task / owners);
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
