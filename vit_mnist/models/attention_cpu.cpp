// The explicit attention path's training step as one CPU kernel: softmax(Q K^T * scale) V
// (Vaswani et al. 2017, eq. 1) and its backward, for short sequences (<= 128 tokens) and
// small heads (head_dim <= 64). Built and loaded by vit_mnist/models/native.py.
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
// Written with GCC/Clang vector extensions (16 float lanes), compiled with -march=native.
// OpenMP splits the (image, head) pairs over threads; built with -fopenmp, the library
// shares the OpenMP runtime torch has already loaded (the same soname), so its threads are
// torch's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

// A broadcast; `v16{} + f` would cost a scalar add before it.
inline v16 splat(float f) { return v16{f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

// Round every lane to bfloat16 (nearest even), kept as float. NaN lanes stay NaN.
inline v16 round_bf16(v16 x) {
  u16v u = (u16v)x;
  u16v r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  i16v nan = (u & 0x7fffffffu) > 0x7f800000u;
  return (v16)(nan ? (i16v)((u | 0x00400000u) & 0xffff0000u) : (i16v)r);
}
template <bool BF16> inline v16 rnd(v16 x) {
  if constexpr (BF16) return round_bf16(x); else return x;
}
// n (<= 16) elements from p, the other lanes 0.
template <bool BF16> inline v16 load(const void* p, int n) {
  if constexpr (BF16) {
    h16v h = {};
    if (n == 16) std::memcpy(&h, p, 32); else std::memcpy(&h, p, 2 * n);
    return (v16)(__builtin_convertvector(h, u16v) << 16);
  } else {
    v16 x = {};
    if (n == 16) std::memcpy(&x, p, 64); else std::memcpy(&x, p, 4 * n);
    return x;
  }
}
// The first n lanes of x (already rounded for bf16) to p.
template <bool BF16> inline void store(void* p, v16 x, int n) {
  if constexpr (BF16) {
    h16v h = __builtin_convertvector(((u16v)x) >> 16, h16v);
    if (n == 16) std::memcpy(p, &h, 32); else std::memcpy(p, &h, 2 * n);
  } else {
    if (n == 16) std::memcpy(p, &x, 64); else std::memcpy(p, &x, 4 * n);
  }
}
template <bool BF16> constexpr int64_t esize() { return BF16 ? 2 : 4; }

// Tree reductions across the 16 lanes; the result in every lane.
inline v16 swap(v16 x, int k) {
  i16v idx = i16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} ^ k;
  return __builtin_shuffle(x, idx);
}
inline v16 hmax(v16 x) {
  x = vmax(x, swap(x, 8));
  x = vmax(x, swap(x, 4));
  x = vmax(x, swap(x, 2));
  return vmax(x, swap(x, 1));
}
inline v16 hsum(v16 x) {
  x += swap(x, 8);
  x += swap(x, 4);
  x += swap(x, 2);
  return x + swap(x, 1);
}

// exp(x) for lanes x <= 0: Cephes expf (Cody-Waite reduction, degree-6 polynomial, about
// 1 ulp). Lanes below -87.3, -inf included, give 0.
inline v16 exp_neg(v16 x) {
  i16v under = x < -87.3f;
  v16 xc = vmax(x, splat(-87.3f));
  v16 fn = __builtin_convertvector(__builtin_convertvector(xc * 1.44269504088896341f - 0.5f, i16v), v16);
  // convert truncates toward 0; xc*log2e - 0.5 <= 0, so this rounds to nearest (ties down)
  v16 r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  v16 y = p * r * r + r + 1.0f;
  i16v n = __builtin_convertvector(fn, i16v);
  v16 pow2 = (v16)((n + 127) << 23);
  return (v16)(under ? i16v{} : (i16v)(y * pow2));
}

struct Src { const char* p; int64_t bs, ts; };  // element strides of batch and token
struct Dst { char* p; int64_t bs, ts; };

// One head's rows t0 .. t0+T-1 (d features each) -> T rows of DV vectors, zero-padded past d.
template <bool BF16, int DV>
inline void load_rows(v16* dst, const Src& s, int64_t b, int64_t c, int64_t t0, int64_t T,
                      int d) {
  for (int64_t t = 0; t < T; ++t) {
    const char* row = s.p + (b * s.bs + (t0 + t) * s.ts + c) * esize<BF16>();
    for (int cv = 0; cv < DV; ++cv)
      dst[t * DV + cv] = load<BF16>(row + 16 * cv * esize<BF16>(), std::clamp(d - 16 * cv, 0, 16));
  }
}
// Rows (T, DV vectors) -> transposed: d rows of NB vectors, T padded with 0.
template <int NB, int DV>
inline void transpose(v16* dst, const v16* rows, int64_t T, int d) {
  float* out = reinterpret_cast<float*>(dst);
  std::memset(static_cast<void*>(out), 0, sizeof(v16) * NB * d);
  const float* in = reinterpret_cast<const float*>(rows);
  for (int64_t t = 0; t < T; ++t)
    for (int x = 0; x < d; ++x) out[x * NB * 16 + t] = in[t * DV * 16 + x];
}
template <bool BF16, int DV>
inline void store_row(const Dst& o, int64_t b, int64_t c, int64_t t, const v16* x, int d) {
  char* row = o.p + (b * o.bs + t * o.ts + c) * esize<BF16>();
  for (int cv = 0; cv < DV; ++cv)
    store<BF16>(row + 16 * cv * esize<BF16>(), rnd<BF16>(x[cv]), std::clamp(d - 16 * cv, 0, 16));
}


// Rows i0 .. i0+R-1 of one head's forward; R rows at once so that their independent
// arithmetic hides each other's latencies and they share the loads of K and V.
template <bool BF16, int NB, int DV, int R>
inline void forward_rows(const Src& q, const Dst& out, char* weights, const v16* Kt,
                         const v16* V, int64_t b, int64_t c, int64_t bh, int64_t i0, int64_t Tq,
                         int64_t Tk, int d, float scale, bool causal) {
  alignas(64) v16 qi[R][DV];
  load_rows<BF16, DV>(qi[0], q, b, c, i0, R, d);
  v16 s[R][NB] = {};
  for (int x = 0; x < d; ++x)
    for (int r = 0; r < R; ++r) {
      v16 qx = splat(reinterpret_cast<const float*>(qi[r])[x]);
      for (int jb = 0; jb < NB; ++jb) s[r][jb] += qx * Kt[x * NB + jb];
    }
  alignas(64) float P[R][NB * 16];
  int64_t n[R];
  for (int r = 0; r < R; ++r) {
    n[r] = causal ? std::min(Tk, i0 + r + 1) : Tk;  // keys j >= n get weight 0
    v16 m = splat(-INFINITY);
    for (int jb = 0; jb < NB; ++jb) {
      i16v lane = i16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + jb * 16;
      v16 sj = rnd<BF16>(s[r][jb] * scale);
      s[r][jb] = (v16)(lane < int32_t(n[r]) ? (i16v)sj : (i16v)splat(-INFINITY));
      m = vmax(m, s[r][jb]);
    }
    m = hmax(m);
    v16 sum = {};
    for (int jb = 0; jb < NB; ++jb) {
      s[r][jb] = exp_neg(s[r][jb] - m);
      sum += s[r][jb];
    }
    v16 inv = 1.0f / hsum(sum);
    char* wrow = weights + (bh * Tq + i0 + r) * NB * 16 * esize<BF16>();
    for (int jb = 0; jb < NB; ++jb) {
      v16 pj = rnd<BF16>(s[r][jb] * inv);
      reinterpret_cast<v16*>(P[r])[jb] = pj;
      store<BF16>(wrow + jb * 16 * esize<BF16>(), pj, 16);
    }
  }
  int64_t nmax = n[R - 1];  // the weights past n[r] are 0
  v16 o[R][DV] = {};
  for (int64_t j = 0; j < nmax; ++j)
    for (int cv = 0; cv < DV; ++cv) {
      v16 vj = V[j * DV + cv];
      for (int r = 0; r < R; ++r) o[r][cv] += splat(P[r][j]) * vj;
    }
  for (int r = 0; r < R; ++r) store_row<BF16, DV>(out, b, c, i0 + r, o[r], d);
}

// weights: (B*H, Tq, NB*16) in the inputs' dtype, each row zero-padded past Tk.
template <bool BF16, int NB, int DV>
void forward(Src q, Src k, Src v, Dst out, char* weights, int64_t B, int64_t H, int64_t Tq,
             int64_t Tk, int d, float scale, bool causal, int threads) {
#pragma omp parallel num_threads(threads)
  {
    alignas(64) v16 rows[128 * DV];
    alignas(64) v16 Kt[64 * NB];
    alignas(64) v16 V[128 * DV];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      load_rows<BF16, DV>(rows, k, b, c, 0, Tk, d);
      transpose<NB, DV>(Kt, rows, Tk, d);
      load_rows<BF16, DV>(V, v, b, c, 0, Tk, d);
      int64_t i = 0;
      for (; i + 4 <= Tq; i += 4)
        forward_rows<BF16, NB, DV, 4>(q, out, weights, Kt, V, b, c, bh, i, Tq, Tk, d, scale, causal);
      for (; i < Tq; ++i)
        forward_rows<BF16, NB, DV, 1>(q, out, weights, Kt, V, b, c, bh, i, Tq, Tk, d, scale, causal);
    }
  }
}

template <bool BF16, int NB, int DV, int R>
inline void backward_rows(const Src& go, const Dst& gq, const char* weights, const v16* Q,
                          const v16* K, const v16* Vt, v16* dK, v16* dV, int64_t b, int64_t c,
                          int64_t bh, int64_t i0, int64_t Tq, int64_t Tk, int d, float scale) {
  alignas(64) float P[R][NB * 16], dS[R][NB * 16];
  alignas(64) v16 doi[R][DV];
  load_rows<BF16, DV>(doi[0], go, b, c, i0, R, d);
  for (int r = 0; r < R; ++r) {
    const char* wrow = weights + (bh * Tq + i0 + r) * NB * 16 * esize<BF16>();
    for (int jb = 0; jb < NB; ++jb)
      reinterpret_cast<v16*>(P[r])[jb] = load<BF16>(wrow + jb * 16 * esize<BF16>(), 16);
  }
  // dP[i, :] = dO[i] V^T
  v16 dp[R][NB] = {};
  for (int x = 0; x < d; ++x)
    for (int r = 0; r < R; ++r) {
      v16 ox = splat(reinterpret_cast<const float*>(doi[r])[x]);
      for (int jb = 0; jb < NB; ++jb) dp[r][jb] += ox * Vt[x * NB + jb];
    }
  // dS = P * (dP - rowsum(dP * P))
  for (int r = 0; r < R; ++r) {
    const v16* pv = reinterpret_cast<const v16*>(P[r]);
    v16 dot = {};
    for (int jb = 0; jb < NB; ++jb) {
      dp[r][jb] = rnd<BF16>(dp[r][jb]);
      dot += dp[r][jb] * pv[jb];
    }
    dot = hsum(dot);
    for (int jb = 0; jb < NB; ++jb)
      reinterpret_cast<v16*>(dS[r])[jb] = rnd<BF16>(pv[jb] * (dp[r][jb] - dot));
  }
  // dV[j] += P[i, j] dO[i];  dQ[i] = scale dS[i, :] K;  dK[j] += dS[i, j] Q[i]
  v16 dq[R][DV] = {};
  for (int64_t j = 0; j < Tk; ++j)
    for (int cv = 0; cv < DV; ++cv) {
      v16 kj = K[j * DV + cv], dv = dV[j * DV + cv], dk = dK[j * DV + cv];
      for (int r = 0; r < R; ++r) {
        v16 sj = splat(dS[r][j]);
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
    alignas(64) v16 Q[128 * DV], K[128 * DV], rows[128 * DV], Vt[64 * NB], dK[128 * DV],
        dV[128 * DV];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t b = bh / H, c = (bh % H) * d;
      load_rows<BF16, DV>(Q, q, b, c, 0, Tq, d);
      load_rows<BF16, DV>(K, k, b, c, 0, Tk, d);
      load_rows<BF16, DV>(rows, v, b, c, 0, Tk, d);
      transpose<NB, DV>(Vt, rows, Tk, d);
      std::memset(static_cast<void*>(dK), 0, sizeof(v16) * Tk * DV);
      std::memset(static_cast<void*>(dV), 0, sizeof(v16) * Tk * DV);
      int64_t i = 0;
      for (; i + 4 <= Tq; i += 4)
        backward_rows<BF16, NB, DV, 4>(go, gq, weights, Q, K, Vt, dK, dV, b, c, bh, i, Tq, Tk, d, scale);
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

}  // namespace

// Built once per (NB, DV): NB 16-lane blocks of keys (Tk <= 16 NB), DV of head features.
#ifndef ATTN_NB
#define ATTN_NB 4
#endif
#ifndef ATTN_DV
#define ATTN_DV 1
#endif

extern "C" {
int attn_blocks() { return ATTN_NB * 100 + ATTN_DV; }
void attn_forward(int bf16, const void* q, int64_t qbs, int64_t qts, const void* k, int64_t kbs,
                  int64_t kts, const void* v, int64_t vbs, int64_t vts, void* out, int64_t obs,
                  int64_t ots, void* weights, int64_t B, int64_t H, int64_t Tq, int64_t Tk,
                  int64_t d, float scale, int causal, int threads) {
  auto f = bf16 ? forward<true, ATTN_NB, ATTN_DV> : forward<false, ATTN_NB, ATTN_DV>;
  f({(const char*)q, qbs, qts}, {(const char*)k, kbs, kts}, {(const char*)v, vbs, vts},
    {(char*)out, obs, ots}, (char*)weights, B, H, Tq, Tk, int(d), scale, causal, threads);
}
void attn_backward(int bf16, const void* q, int64_t qbs, int64_t qts, const void* k, int64_t kbs,
                   int64_t kts, const void* v, int64_t vbs, int64_t vts, const void* weights,
                   const void* go, int64_t gobs, int64_t gots, void* gq, int64_t gqbs,
                   int64_t gqts, void* gk, int64_t gkbs, int64_t gkts, void* gv, int64_t gvbs,
                   int64_t gvts, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t d,
                   float scale, int threads) {
  auto f = bf16 ? backward<true, ATTN_NB, ATTN_DV> : backward<false, ATTN_NB, ATTN_DV>;
  f({(const char*)q, qbs, qts}, {(const char*)k, kbs, kts}, {(const char*)v, vbs, vts},
    (const char*)weights, {(const char*)go, gobs, gots}, {(char*)gq, gqbs, gqts},
    {(char*)gk, gkbs, gkts}, {(char*)gv, gvbs, gvts}, B, H, Tq, Tk, int(d), scale, threads);
}
}
