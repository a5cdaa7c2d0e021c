// The explicit attention path's training step as one CPU kernel: softmax(Q K^T * scale) V
// (Vaswani et al. 2017, eq. 1) and its backward, for short sequences (<= 128 tokens) and
// small heads (head_dim <= 64). Built and loaded by vit_mnist/speed/native.py.
//
// Why a kernel: at ViT-on-MNIST sizes (50 tokens, head_dim 16) PyTorch runs this as batched
// products of 50 x 16 matrices, a softmax and dtype casts, each its own pass over memory,
// plus copies of Q, K and V out of the qkv projection and of the heads back into one
// tensor. Here each (image, head) is done in one pass, reading Q, K, V straight from the
// qkv projection's output and writing the heads where W^O reads them.
//
// The same arithmetic as the explicit path (float32 accumulation; under bf16 autocast the
// same roundings to bfloat16: the scores, the weights, the output, dP, dS and the gradients),
// so results agree to float32 rounding, or to one bfloat16 step where a sum's order differs.
//
// Written with GCC/Clang vector extensions, L float lanes wide: 16 in a build for AVX-512,
// 8 in one for AVX2 (vit_mnist/speed/native.py builds for the instruction-set class PyTorch
// runs at). On a CPU with AVX512-BF16, bfloat16 inputs take forward_dp/backward_dp, whose
// products run on vdpbf16ps (two bf16 products per float32 lane per instruction).
// OpenMP splits the (image, head) pairs over threads; built with -fopenmp, the library
// shares the OpenMP runtime torch has already loaded (the same soname), so its threads are
// torch's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// L float lanes per vector: 16 where the build targets AVX-512, else 8 (AVX2's 256-bit
// registers). R_ROWS query rows at a time, the count that ran fastest at 50 tokens: with 8
// lanes a row's scores take twice the registers, and AVX2 has half as many (16, not 32).
#ifdef __AVX512F__
constexpr int L = 16, R_ROWS = 4;
#else
constexpr int L = 8, R_ROWS = 2;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef uint16_t vh __attribute__((vector_size(2 * L)));

// A broadcast, written as {f, f, ..., f}: `vf{} + f` would cost a scalar add first.
template <size_t... I> inline vf splat(float f, std::index_sequence<I...>) {
  return vf{((void)I, f)...};
}
inline vf splat(float f) { return splat(f, std::make_index_sequence<L>()); }
// {0, 1, ..., L - 1}.
template <size_t... I> constexpr vi iota(std::index_sequence<I...>) { return vi{int32_t(I)...}; }
constexpr vi iota() { return iota(std::make_index_sequence<L>()); }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Round every lane to bfloat16 (nearest even), kept as float. NaN lanes stay NaN.
inline vf round_bf16(vf x) {
#ifdef __AVX512BF16__
  // One instruction where the CPU has it; it also flushes denormals (below 1.2e-38) to 0.
  vh h = (vh)_mm512_cvtneps_pbh((__m512)x);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#else
  vu u = (vu)x;
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  vi nan = (u & 0x7fffffffu) > 0x7f800000u;
  return (vf)(nan ? (vi)((u | 0x00400000u) & 0xffff0000u) : (vi)r);
#endif
}
template <bool BF16> inline vf rnd(vf x) {
  if constexpr (BF16) return round_bf16(x); else return x;
}
// n (<= L) elements from p, the other lanes 0.
template <bool BF16> inline vf load(const void* p, int n) {
  if constexpr (BF16) {
    vh h = {};
    if (n == L) std::memcpy(&h, p, 2 * L); else std::memcpy(&h, p, 2 * n);
    return (vf)(__builtin_convertvector(h, vu) << 16);
  } else {
    vf x = {};
    if (n == L) std::memcpy(&x, p, 4 * L); else std::memcpy(&x, p, 4 * n);
    return x;
  }
}
// The first n lanes of x (already rounded for bf16) to p.
template <bool BF16> inline void store(void* p, vf x, int n) {
  if constexpr (BF16) {
    vh h = __builtin_convertvector(((vu)x) >> 16, vh);
    if (n == L) std::memcpy(p, &h, 2 * L); else std::memcpy(p, &h, 2 * n);
  } else {
    if (n == L) std::memcpy(p, &x, 4 * L); else std::memcpy(p, &x, 4 * n);
  }
}
template <bool BF16> constexpr int64_t esize() { return BF16 ? 2 : 4; }

// Tree reductions across the L lanes; the result in every lane.
inline vf swap(vf x, int k) {
  return __builtin_shuffle(x, iota() ^ k);
}
inline vf hmax(vf x) {
  if constexpr (L == 16) x = vmax(x, swap(x, 8));
  x = vmax(x, swap(x, 4));
  x = vmax(x, swap(x, 2));
  return vmax(x, swap(x, 1));
}
inline vf hsum(vf x) {
  if constexpr (L == 16) x += swap(x, 8);
  x += swap(x, 4);
  x += swap(x, 2);
  return x + swap(x, 1);
}

// exp(x) for lanes x <= 0: Cephes expf (Cody-Waite reduction, degree-6 polynomial, about
// 1 ulp). Lanes below -87.3 (-104 where AVX-512 scales by 2^n), -inf included, give 0.
inline vf exp_neg(vf x) {
#ifdef __AVX512F__
  // vscalefps multiplies by 2^n, underflowing to 0 itself, and vrndscaleps rounds n: six
  // fewer instructions than the portable version below. Lanes below -104 (-inf included)
  // round to 0; between -104 and -87.3 this gives exp's subnormal values.
  vf xc = vmax(x, splat(-104.0f));
  vf fn = (vf)_mm512_roundscale_ps((__m512)(xc * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT);
#else
  vi under = x < -87.3f;
  vf xc = vmax(x, splat(-87.3f));
  vf fn = __builtin_convertvector(__builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi), vf);
  // convert truncates toward 0; xc*log2e - 0.5 <= 0, so this rounds to nearest (ties down)
#endif
  vf r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * r * r + r + 1.0f;
#ifdef __AVX512F__
  return (vf)_mm512_scalef_ps((__m512)y, (__m512)fn);
#else
  vi n = __builtin_convertvector(fn, vi);
  vf pow2 = (vf)((n + 127) << 23);
  return (vf)(under ? vi{} : (vi)(y * pow2));
#endif
}

struct Src { const char* p; int64_t bs, ts; };  // element strides of batch and token
struct Dst { char* p; int64_t bs, ts; };

// One head's rows t0 .. t0+T-1 (d features each) -> T rows of DV vectors, zero-padded past d.
template <bool BF16, int DV>
inline void load_rows(vf* dst, const Src& s, int64_t b, int64_t c, int64_t t0, int64_t T,
                      int d) {
  for (int64_t t = 0; t < T; ++t) {
    const char* row = s.p + (b * s.bs + (t0 + t) * s.ts + c) * esize<BF16>();
    for (int cv = 0; cv < DV; ++cv)
      dst[t * DV + cv] = load<BF16>(row + L * cv * esize<BF16>(), std::clamp(d - L * cv, 0, L));
  }
}
// Rows (T, DV vectors) -> transposed: d rows of NB vectors, T padded with 0.
template <int NB, int DV>
inline void transpose(vf* dst, const vf* rows, int64_t T, int d) {
  float* out = reinterpret_cast<float*>(dst);
  std::memset(static_cast<void*>(out), 0, sizeof(vf) * NB * d);
  const float* in = reinterpret_cast<const float*>(rows);
  for (int64_t t = 0; t < T; ++t)
    for (int x = 0; x < d; ++x) out[x * NB * L + t] = in[t * DV * L + x];
}
template <bool BF16, int DV>
inline void store_row(const Dst& o, int64_t b, int64_t c, int64_t t, const vf* x, int d) {
  char* row = o.p + (b * o.bs + t * o.ts + c) * esize<BF16>();
  for (int cv = 0; cv < DV; ++cv)
    store<BF16>(row + L * cv * esize<BF16>(), rnd<BF16>(x[cv]), std::clamp(d - L * cv, 0, L));
}


// Rows i0 .. i0+R-1 of one head's forward; R rows at once so that their independent
// arithmetic hides each other's latencies and they share the loads of K and V.
template <bool BF16, int NB, int DV, int R>
inline void forward_rows(const Src& q, const Dst& out, char* weights, const vf* Kt,
                         const vf* V, int64_t b, int64_t c, int64_t bh, int64_t i0, int64_t Tq,
                         int64_t Tk, int d, float scale, bool causal) {
  alignas(64) vf qi[R][DV];
  load_rows<BF16, DV>(qi[0], q, b, c, i0, R, d);
  vf s[R][NB] = {};
  for (int x = 0; x < d; ++x)
    for (int r = 0; r < R; ++r) {
      vf qx = splat(reinterpret_cast<const float*>(qi[r])[x]);
      for (int jb = 0; jb < NB; ++jb) s[r][jb] += qx * Kt[x * NB + jb];
    }
  alignas(64) float P[R][NB * L];
  int64_t n[R];
  for (int r = 0; r < R; ++r) {
    n[r] = causal ? std::min(Tk, i0 + r + 1) : Tk;  // keys j >= n get weight 0
    vf m = splat(-INFINITY);
    for (int jb = 0; jb < NB; ++jb) {
      vi lane = iota() + jb * L;
      vf sj = rnd<BF16>(s[r][jb] * scale);
      s[r][jb] = (vf)(lane < int32_t(n[r]) ? (vi)sj : (vi)splat(-INFINITY));
      m = vmax(m, s[r][jb]);
    }
    m = hmax(m);
    vf sum = {};
    for (int jb = 0; jb < NB; ++jb) {
      s[r][jb] = exp_neg(s[r][jb] - m);
      sum += s[r][jb];
    }
    vf inv = 1.0f / hsum(sum);
    char* wrow = weights + (bh * Tq + i0 + r) * NB * L * esize<BF16>();
    for (int jb = 0; jb < NB; ++jb) {
      vf pj = rnd<BF16>(s[r][jb] * inv);
      reinterpret_cast<vf*>(P[r])[jb] = pj;
      store<BF16>(wrow + jb * L * esize<BF16>(), pj, L);
    }
  }
  int64_t nmax = n[R - 1];  // the weights past n[r] are 0
  // S interleaved sums over the keys, so that at least 8 chains of FMAs are in flight
  // (FMA latency 4 cycles, 2 per cycle); R * DV alone can be as few as 4.
  constexpr int S = R * DV >= 8 ? 1 : 2;
  vf o[S][R][DV] = {};
  int64_t j = 0;
  for (; j + S <= nmax; j += S)
    for (int u = 0; u < S; ++u)
      for (int cv = 0; cv < DV; ++cv) {
        vf vj = V[(j + u) * DV + cv];
        for (int r = 0; r < R; ++r) o[u][r][cv] += splat(P[r][j + u]) * vj;
      }
  for (; j < nmax; ++j)
    for (int cv = 0; cv < DV; ++cv) {
      vf vj = V[j * DV + cv];
      for (int r = 0; r < R; ++r) o[0][r][cv] += splat(P[r][j]) * vj;
    }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < S; ++u)
      for (int cv = 0; cv < DV; ++cv) o[0][r][cv] += o[u][r][cv];
    store_row<BF16, DV>(out, b, c, i0 + r, o[0][r], d);
  }
}

// weights: (B*H, Tq, NB*L) in the inputs' dtype, each row zero-padded past Tk.
template <bool BF16, int NB, int DV>
void forward(Src q, Src k, Src v, Dst out, char* weights, int64_t B, int64_t H, int64_t Tq,
             int64_t Tk, int d, float scale, bool causal, int threads) {
#pragma omp parallel num_threads(threads)
  {
    alignas(64) vf rows[128 * DV];
    alignas(64) vf Kt[64 * NB];
    alignas(64) vf V[128 * DV];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      load_rows<BF16, DV>(rows, k, b, c, 0, Tk, d);
      transpose<NB, DV>(Kt, rows, Tk, d);
      load_rows<BF16, DV>(V, v, b, c, 0, Tk, d);
      int64_t i = 0;
      for (; i + R_ROWS <= Tq; i += R_ROWS)
        forward_rows<BF16, NB, DV, R_ROWS>(q, out, weights, Kt, V, b, c, bh, i, Tq, Tk, d, scale, causal);
      for (; i < Tq; ++i)
        forward_rows<BF16, NB, DV, 1>(q, out, weights, Kt, V, b, c, bh, i, Tq, Tk, d, scale, causal);
    }
  }
}

template <bool BF16, int NB, int DV, int R>
inline void backward_rows(const Src& go, const Dst& gq, const char* weights, const vf* Q,
                          const vf* K, const vf* Vt, vf* dK, vf* dV, int64_t b, int64_t c,
                          int64_t bh, int64_t i0, int64_t Tq, int64_t Tk, int d, float scale) {
  alignas(64) float P[R][NB * L], dS[R][NB * L];
  alignas(64) vf doi[R][DV];
  load_rows<BF16, DV>(doi[0], go, b, c, i0, R, d);
  for (int r = 0; r < R; ++r) {
    const char* wrow = weights + (bh * Tq + i0 + r) * NB * L * esize<BF16>();
    for (int jb = 0; jb < NB; ++jb)
      reinterpret_cast<vf*>(P[r])[jb] = load<BF16>(wrow + jb * L * esize<BF16>(), L);
  }
  // dP[i, :] = dO[i] V^T
  vf dp[R][NB] = {};
  for (int x = 0; x < d; ++x)
    for (int r = 0; r < R; ++r) {
      vf ox = splat(reinterpret_cast<const float*>(doi[r])[x]);
      for (int jb = 0; jb < NB; ++jb) dp[r][jb] += ox * Vt[x * NB + jb];
    }
  // dS = P * (dP - rowsum(dP * P))
  for (int r = 0; r < R; ++r) {
    const vf* pv = reinterpret_cast<const vf*>(P[r]);
    vf dot = {};
    for (int jb = 0; jb < NB; ++jb) {
      dp[r][jb] = rnd<BF16>(dp[r][jb]);
      dot += dp[r][jb] * pv[jb];
    }
    dot = hsum(dot);
    for (int jb = 0; jb < NB; ++jb)
      reinterpret_cast<vf*>(dS[r])[jb] = rnd<BF16>(pv[jb] * (dp[r][jb] - dot));
  }
  // dV[j] += P[i, j] dO[i];  dQ[i] = scale dS[i, :] K;  dK[j] += dS[i, j] Q[i]
  vf dq[R][DV] = {};
  for (int64_t j = 0; j < Tk; ++j)
    for (int cv = 0; cv < DV; ++cv) {
      vf kj = K[j * DV + cv], dv = dV[j * DV + cv], dk = dK[j * DV + cv];
      for (int r = 0; r < R; ++r) {
        vf sj = splat(dS[r][j]);
        dv += splat(P[r][j]) * doi[r][cv];
        dq[r][cv] += sj * kj;
        dk += sj * Q[(i0 + r) * DV + cv];
      }
      dV[j * DV + cv] = dv;
      dK[j * DV + cv] = dk;
    }
  for (int r = 0; r < R; ++r) {
    for (int cv = 0; cv < DV; ++cv) dq[r][cv] *= scale;
    store_row<BF16, DV>(gq, b, c, i0 + r, dq[r], d);
  }
}

template <bool BF16, int NB, int DV>
void backward(Src q, Src k, Src v, const char* weights, Src go, Dst gq, Dst gk, Dst gv,
              int64_t B, int64_t H, int64_t Tq, int64_t Tk, int d, float scale, int threads) {
#pragma omp parallel num_threads(threads)
  {
    alignas(64) vf Q[128 * DV], K[128 * DV], rows[128 * DV], Vt[64 * NB], dK[128 * DV],
        dV[128 * DV];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      load_rows<BF16, DV>(Q, q, b, c, 0, Tq, d);
      load_rows<BF16, DV>(K, k, b, c, 0, Tk, d);
      load_rows<BF16, DV>(rows, v, b, c, 0, Tk, d);
      transpose<NB, DV>(Vt, rows, Tk, d);
      std::memset(static_cast<void*>(dK), 0, sizeof(vf) * Tk * DV);
      std::memset(static_cast<void*>(dV), 0, sizeof(vf) * Tk * DV);
      int64_t i = 0;
      for (; i + R_ROWS <= Tq; i += R_ROWS)
        backward_rows<BF16, NB, DV, R_ROWS>(go, gq, weights, Q, K, Vt, dK, dV, b, c, bh, i, Tq, Tk, d, scale);
      for (; i < Tq; ++i)
        backward_rows<BF16, NB, DV, 1>(go, gq, weights, Q, K, Vt, dK, dV, b, c, bh, i, Tq, Tk, d, scale);
      for (int64_t j = 0; j < Tk; ++j) {
        for (int cv = 0; cv < DV; ++cv) dK[j * DV + cv] *= scale;
        store_row<BF16, DV>(gk, b, c, j, &dK[j * DV], d);
        store_row<BF16, DV>(gv, b, c, j, &dV[j * DV], d);
      }
    }
  }
}

#ifdef __AVX512BF16__
// bfloat16 inputs on a CPU with AVX512-BF16: every product runs on vdpbf16ps, which
// multiplies pairs of bfloat16 exactly and adds both products into a float32 lane: twice
// the work of an FMA per instruction. Operands are laid out in pairs: (two features) for
// Q K^T and dO V^T, (two keys) for P V and dS K, (two queries) for P^T dO and dS^T Q. The
// same roundings to bfloat16 as forward<true>/backward<true> above; only the order in which
// float32 sums are taken differs (and, as vdpbf16ps does, bfloat16 denormals count as 0).
typedef uint16_t bf16;

inline __m512 dot2(__m512 acc, __m512i a, uint32_t pair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(int(pair)));
}
inline __m512 dot2(__m512 acc, const void* a, uint32_t pair) {
  return dot2(acc, _mm512_load_si512(a), pair);
}
inline uint32_t pair_at(const bf16* row, int m) {
  uint32_t p;
  std::memcpy(&p, row + 2 * m, 4);
  return p;
}
// 16 lanes of (a[i], b[i]) pairs: a in the low half, as vdpbf16ps pairs them with a pair
// of the other operand.
inline __m512i interleave(const bf16* a, const bf16* b) {
  __m512i lo = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)a));
  __m512i hi = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
inline __m256i to_bf16(vf x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }

// 16 bfloat16 of row t (features 16 cv ..), zero past d and for rows t >= T.
inline __m256i load16(const Src& s, int64_t b, int64_t c, int64_t t, int64_t T, int d, int cv) {
  const bf16* row = reinterpret_cast<const bf16*>(s.p) + b * s.bs + t * s.ts + c + 16 * cv;
  int n = t < T ? std::clamp(d - 16 * cv, 0, 16) : 0;
  return _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), row);
}
// Row t of a head -> 16 DV bfloat16 at dst, as load16.
template <int DV>
inline void row_bf16(bf16* dst, const Src& s, int64_t b, int64_t c, int64_t t, int64_t T, int d) {
  for (int cv = 0; cv < DV; ++cv)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 16 * cv), load16(s, b, c, t, T, d, cv));
}
// Keys in lanes, feature pairs in rows: dst[m][j] = (X[j, 2m], X[j, 2m+1]); 0 for j >= T.
// Per 16 keys and 16 features, a 16 x 8 transpose of 32-bit pairs in registers.
template <int NB, int DV>
inline void pairs_by_feature(uint32_t (*dst)[NB * 16], const Src& s, int64_t b, int64_t c,
                             int64_t T, int d) {
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int jb = 0; jb < NB; ++jb)
    for (int cv = 0; cv < DV; ++cv) {
      __m512i z[8], t[8], u[8];
      int64_t j0 = 16 * jb;
      for (int i = 0; i < 8; ++i)  // rows i and i + 8 side by side
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load16(s, b, c, j0 + i, T, d, cv)),
                                  load16(s, b, c, j0 + i + 8, T, d, cv), 1);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
      }
      // u[e] (e < 4) holds pairs e and e + 4 of rows 0-3, u[e + 4] those of rows 4-7
      // (and of rows 8-15 in the upper half).
      for (int e = 0; e < 4; ++e) {
        _mm512_store_si512(&dst[8 * cv + e][j0], _mm512_permutex2var_epi64(u[e], lo, u[e + 4]));
        _mm512_store_si512(&dst[8 * cv + e + 4][j0], _mm512_permutex2var_epi64(u[e], hi, u[e + 4]));
      }
    }
}
// Features in lanes, key pairs in rows: dst[m][cv] = (X[2m, f], X[2m+1, f]); X[T] = 0.
template <int DV>
inline void pairs_by_key(__m512i (*dst)[DV], const Src& s, int64_t b, int64_t c, int64_t T,
                         int d) {
  for (int64_t m = 0; 2 * m < T; ++m)
    for (int cv = 0; cv < DV; ++cv) {
      __m512i x = _mm512_cvtepu16_epi32(load16(s, b, c, 2 * m, T, d, cv));
      __m512i y = _mm512_cvtepu16_epi32(load16(s, b, c, 2 * m + 1, T, d, cv));
      dst[m][cv] = _mm512_or_si512(x, _mm512_slli_epi32(y, 16));
    }
}

// acc[r][jb] += rows[r] . X's column block jb, over M feature pairs: Q K^T and dO V^T, with
// X from pairs_by_feature (keys in lanes).
template <int R, int NB, int M, int DV>
inline void times_feature_pairs(vf (&acc)[R][NB], const uint32_t (*X)[NB * 16],
                                const bf16 (&rows)[R][16 * DV]) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      uint32_t pair = pair_at(rows[r], m);
      for (int jb = 0; jb < NB; ++jb)
        acc[r][jb] = (vf)dot2((__m512)acc[r][jb], &X[m][jb * 16], pair);
    }
}
// out[r] = sum over the first `pairs` key pairs m of rows[r]'s pair m times X[m]: P V and
// dS K, with X from pairs_by_key (features in lanes). S interleaved sums over the keys keep
// at least 8 chains of dependent vdpbf16ps in flight; R * DV alone can be as few as 4.
template <int R, int DV, int W>
inline void times_key_pairs(vf (&out)[R][DV], const __m512i (*X)[DV],
                            const bf16 (&rows)[R][W], int64_t pairs) {
  constexpr int S = R * DV >= 8 ? 1 : 2;
  vf acc[S][R][DV] = {};
  int64_t m = 0;
  for (; m + S <= pairs; m += S)
    for (int u = 0; u < S; ++u)
      for (int cv = 0; cv < DV; ++cv)
        for (int r = 0; r < R; ++r)
          acc[u][r][cv] = (vf)dot2((__m512)acc[u][r][cv], X[m + u][cv], pair_at(rows[r], m + u));
  for (; m < pairs; ++m)
    for (int cv = 0; cv < DV; ++cv)
      for (int r = 0; r < R; ++r)
        acc[0][r][cv] = (vf)dot2((__m512)acc[0][r][cv], X[m][cv], pair_at(rows[r], m));
  for (int r = 0; r < R; ++r)
    for (int cv = 0; cv < DV; ++cv) {
      out[r][cv] = acc[0][r][cv];
      for (int u = 1; u < S; ++u) out[r][cv] += acc[u][r][cv];
    }
}

template <int NB, int DV>
void forward_dp(Src q, Src k, Src v, Dst out, char* weights, int64_t B, int64_t H, int64_t Tq,
                int64_t Tk, int d, float scale, bool causal, int threads) {
  constexpr int W = NB * 16, M = 8 * DV, R = 4;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) uint32_t Kp[M][W];
    alignas(64) __m512i Vp[W / 2][DV];
    alignas(64) bf16 Qr[R][16 * DV], P[R][W];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      pairs_by_feature<NB, DV>(Kp, k, b, c, Tk, d);
      pairs_by_key<DV>(Vp, v, b, c, Tk, d);
      for (int64_t i0 = 0; i0 < Tq; i0 += R) {
        // Rows past Tq are zero queries: computed, never stored.
        for (int r = 0; r < R; ++r) row_bf16<DV>(Qr[r], q, b, c, i0 + r, Tq, d);
        vf s[R][NB] = {};
        times_feature_pairs<R, NB, M, DV>(s, Kp, Qr);
        // The softmax stage by stage for the R rows together, so that the rows' independent
        // chains (reductions, exp, the divide) overlap.
        int64_t n[R], nmax = 0;
        vf mx[R], sum[R] = {};
        for (int r = 0; r < R; ++r) {
          n[r] = causal ? std::min(Tk, i0 + r + 1) : Tk;  // keys j >= n get weight 0
          nmax = std::max(nmax, n[r]);
          mx[r] = splat(-INFINITY);
          for (int jb = 0; jb < NB; ++jb) {
            vi lane = iota() + jb * 16;  // L == 16 in this AVX-512 code
            vf sj = round_bf16(s[r][jb] * scale);
            s[r][jb] = (vf)(lane < int32_t(n[r]) ? (vi)sj : (vi)splat(-INFINITY));
            mx[r] = vmax(mx[r], s[r][jb]);
          }
        }
        for (int r = 0; r < R; ++r) mx[r] = hmax(mx[r]);
        for (int r = 0; r < R; ++r)
          for (int jb = 0; jb < NB; ++jb) {
            s[r][jb] = exp_neg(s[r][jb] - mx[r]);
            sum[r] += s[r][jb];
          }
        for (int r = 0; r < R; ++r) sum[r] = 1.0f / hsum(sum[r]);
        for (int r = 0; r < R; ++r) {
          for (int jb = 0; jb < NB; ++jb)
            _mm256_store_si256(reinterpret_cast<__m256i*>(&P[r][jb * 16]), to_bf16(s[r][jb] * sum[r]));
          if (i0 + r < Tq)
            std::memcpy(weights + (bh * Tq + i0 + r) * W * 2, P[r], W * 2);
        }
        vf o[R][DV];
        times_key_pairs<R, DV, W>(o, Vp, P, (nmax + 1) / 2);  // P is 0 past nmax, V's row Tk 0
        for (int r = 0; r < R && i0 + r < Tq; ++r) store_row<true, DV>(out, b, c, i0 + r, o[r], d);
      }
    }
  }
}

template <int NB, int DV>
void backward_dp(Src q, Src k, Src v, const char* weights, Src go, Dst gq, Dst gk, Dst gv,
                 int64_t B, int64_t H, int64_t Tq, int64_t Tk, int d, float scale, int threads) {
  constexpr int W = NB * 16, M = 8 * DV, R = 4;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) uint32_t Vp[M][W];
    alignas(64) __m512i Kp[W / 2][DV];
    alignas(64) vf dK[W][DV], dV[W][DV];
    alignas(64) bf16 Qr[R][16 * DV], dO[R][16 * DV], P[R][W], dS[R][W];
    alignas(64) uint32_t Pt[R / 2][W], dSt[R / 2][W];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      pairs_by_feature<NB, DV>(Vp, v, b, c, Tk, d);
      pairs_by_key<DV>(Kp, k, b, c, Tk, d);
      std::memset(static_cast<void*>(dK), 0, sizeof(dK));
      std::memset(static_cast<void*>(dV), 0, sizeof(dV));
      for (int64_t i0 = 0; i0 < Tq; i0 += R) {
        // Rows past Tq: zero P, dO and Q, so they add nothing to dK and dV.
        for (int r = 0; r < R; ++r) {
          row_bf16<DV>(Qr[r], q, b, c, i0 + r, Tq, d);
          row_bf16<DV>(dO[r], go, b, c, i0 + r, Tq, d);
          if (i0 + r < Tq)
            std::memcpy(P[r], weights + (bh * Tq + i0 + r) * W * 2, W * 2);
          else
            std::memset(P[r], 0, W * 2);
        }
        // dP[i, :] = dO[i] V^T
        vf dp[R][NB] = {};
        times_feature_pairs<R, NB, M, DV>(dp, Vp, dO);
        // dS = P * (dP - rowsum(dP * P))
        for (int r = 0; r < R; ++r) {
          vf pv[NB], dot = {};
          for (int jb = 0; jb < NB; ++jb) {
            pv[jb] = load<true>(&P[r][jb * 16], 16);
            dp[r][jb] = round_bf16(dp[r][jb]);
            dot += dp[r][jb] * pv[jb];
          }
          dot = hsum(dot);
          for (int jb = 0; jb < NB; ++jb)
            _mm256_store_si256(reinterpret_cast<__m256i*>(&dS[r][jb * 16]),
                               to_bf16(pv[jb] * (dp[r][jb] - dot)));
        }
        // dQ[i] = scale dS[i, :] K
        vf dq[R][DV];
        times_key_pairs<R, DV, W>(dq, Kp, dS, (Tk + 1) / 2);
        for (int r = 0; r < R && i0 + r < Tq; ++r) {
          for (int cv = 0; cv < DV; ++cv) dq[r][cv] *= scale;
          store_row<true, DV>(gq, b, c, i0 + r, dq[r], d);
        }
        // dV[j] += P[i, j] dO[i];  dK[j] += dS[i, j] Q[i]: pairs of queries
        __m512i dOp[R / 2][DV], Qp[R / 2][DV];
        for (int h = 0; h < R / 2; ++h) {
          for (int cv = 0; cv < DV; ++cv) {
            dOp[h][cv] = interleave(dO[2 * h] + 16 * cv, dO[2 * h + 1] + 16 * cv);
            Qp[h][cv] = interleave(Qr[2 * h] + 16 * cv, Qr[2 * h + 1] + 16 * cv);
          }
          for (int jb = 0; jb < NB; ++jb) {
            _mm512_store_si512(&Pt[h][jb * 16], interleave(&P[2 * h][jb * 16], &P[2 * h + 1][jb * 16]));
            _mm512_store_si512(&dSt[h][jb * 16],
                               interleave(&dS[2 * h][jb * 16], &dS[2 * h + 1][jb * 16]));
          }
        }
        for (int64_t j = 0; j < Tk; ++j)
          for (int cv = 0; cv < DV; ++cv) {
            __m512 dv = (__m512)dV[j][cv], dk = (__m512)dK[j][cv];
            for (int h = 0; h < R / 2; ++h) {
              dv = dot2(dv, dOp[h][cv], Pt[h][j]);
              dk = dot2(dk, Qp[h][cv], dSt[h][j]);
            }
            dV[j][cv] = (vf)dv;
            dK[j][cv] = (vf)dk;
          }
      }
      for (int64_t j = 0; j < Tk; ++j) {
        for (int cv = 0; cv < DV; ++cv) dK[j][cv] *= scale;
        store_row<true, DV>(gk, b, c, j, dK[j], d);
        store_row<true, DV>(gv, b, c, j, dV[j], d);
      }
    }
  }
}
#endif  // __AVX512BF16__

}  // namespace

// Built once per (NB, DV): NB L-lane blocks of keys (Tk <= L NB), DV of head features.
#ifndef ATTN_NB
#define ATTN_NB 4
#endif
#ifndef ATTN_DV
#define ATTN_DV 1
#endif

extern "C" {
int attn_lanes() { return L; }  // the build's vector width, in floats
int attn_blocks() { return ATTN_NB * 100 + ATTN_DV; }
void attn_forward(int bf16, const void* q, int64_t qbs, int64_t qts, const void* k, int64_t kbs,
                  int64_t kts, const void* v, int64_t vbs, int64_t vts, void* out, int64_t obs,
                  int64_t ots, void* weights, int64_t B, int64_t H, int64_t Tq, int64_t Tk,
                  int64_t d, float scale, int causal, int threads) {
#ifdef __AVX512BF16__
  auto f = bf16 ? forward_dp<ATTN_NB, ATTN_DV> : forward<false, ATTN_NB, ATTN_DV>;
#else
  auto f = bf16 ? forward<true, ATTN_NB, ATTN_DV> : forward<false, ATTN_NB, ATTN_DV>;
#endif
  f({(const char*)q, qbs, qts}, {(const char*)k, kbs, kts}, {(const char*)v, vbs, vts},
    {(char*)out, obs, ots}, (char*)weights, B, H, Tq, Tk, int(d), scale, causal, threads);
}
void attn_backward(int bf16, const void* q, int64_t qbs, int64_t qts, const void* k, int64_t kbs,
                   int64_t kts, const void* v, int64_t vbs, int64_t vts, const void* weights,
                   const void* go, int64_t gobs, int64_t gots, void* gq, int64_t gqbs,
                   int64_t gqts, void* gk, int64_t gkbs, int64_t gkts, void* gv, int64_t gvbs,
                   int64_t gvts, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t d,
                   float scale, int threads) {
#ifdef __AVX512BF16__
  auto f = bf16 ? backward_dp<ATTN_NB, ATTN_DV> : backward<false, ATTN_NB, ATTN_DV>;
#else
  auto f = bf16 ? backward<true, ATTN_NB, ATTN_DV> : backward<false, ATTN_NB, ATTN_DV>;
#endif
  f({(const char*)q, qbs, qts}, {(const char*)k, kbs, kts}, {(const char*)v, vbs, vts},
    (const char*)weights, {(const char*)go, gobs, gots}, {(char*)gq, gqbs, gqts},
    {(char*)gk, gkbs, gkts}, {(char*)gv, gvbs, gvts}, B, H, Tq, Tk, int(d), scale, threads);
}
}
