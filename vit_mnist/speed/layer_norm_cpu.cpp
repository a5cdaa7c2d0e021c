// A pre-norm block's residual add and the LayerNorm after it as one CPU pass each way:
//   s = x + branch,  y = (s - mean(s)) / sqrt(var(s) + eps) * gamma + beta
// (Ba et al. 2016, eq. 4, over the last dimension; var is the biased variance, as in
// torch.nn.LayerNorm), with y written as float32 or, under bf16 autocast, already rounded
// to bfloat16 for the Linear that reads it. Built and loaded by vit_mnist/speed/native.py.
//
// Why a kernel: at ViT-on-MNIST sizes (rows of 64 floats) PyTorch runs this as a cast of
// the branch to float32, the add, the LayerNorm and a cast of its output to bfloat16, each
// a pass over memory, and the backward as many again. Here each is one pass. At the
// default architecture this made a bf16 training step 1.09x to 1.14x faster in interleaved
// runs, an fp32 step 1.00x to 1.06x (README, Speed).
//
// The statistics are computed two-pass (mean, then the mean of squared deviations) in
// float32, where PyTorch uses Welford's update: results agree to float32 rounding, not bit
// for bit (a bfloat16 output can differ by one bfloat16 step where the float32 value sits
// on a rounding boundary).
//
// AVX-512 only (compiled with -march=native; add_norm_available() says whether this build
// has it). Rows of D floats, contiguous, with 16 * (LN_NV - 1) < D <= 16 * LN_NV: each build
// is for one LN_NV (-DLN_NV=4 for D = 64), so that the row stays in registers. OpenMP
// splits the rows over `threads` threads, torch's own (the same runtime, as for
// attention_cpu.cpp).

#include <cmath>
#include <cstdint>

#ifndef LN_NV
#error "build with -DLN_NV=<16-float vectors per row>"
#endif
// The 16-bit masked loads and stores need AVX512BW and AVX512VL besides AVX512F.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LN_AVX512 1
#include <immintrin.h>
#include <omp.h>
#endif

#if defined(LN_AVX512)
namespace {

inline __m512 load_bf16(__mmask16 m, const uint16_t* p) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  // One instruction where the CPU has it; it also flushes denormals (below 1.2e-38) to 0.
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

// Lane masks of the row's NV vectors: all 16 lanes but in the last, D % 16 of them.
template <int NV> struct Masks {
  __mmask16 m[NV];
  explicit Masks(int64_t D) {
    for (int v = 0; v < NV; ++v) {
      int64_t n = D - 16 * v;
      m[v] = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    }
  }
};

// R rows at a time, so that their reductions' latencies overlap.
template <int NV, int R, bool BRANCH_BF16, bool OUT_BF16>
inline void forward_rows(const Masks<NV>& mk, int64_t D, const float* x, const void* branch,
                         float* s, const float* gamma, const float* beta, void* y, float* mean,
                         float* rstd, float eps) {
  const float inv_d = 1.0f / (float)D;
  __m512 a[R][NV];
  float mu[R], rs[R];
  for (int r = 0; r < R; ++r) {
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      const int64_t o = r * D + 16 * v;
      a[r][v] = _mm512_maskz_loadu_ps(mk.m[v], x + o);
      if (branch != nullptr) {
        __m512 b = BRANCH_BF16 ? load_bf16(mk.m[v], (const uint16_t*)branch + o)
                               : _mm512_maskz_loadu_ps(mk.m[v], (const float*)branch + o);
        a[r][v] = _mm512_add_ps(a[r][v], b);
      }
      _mm512_mask_storeu_ps(s + o, mk.m[v], a[r][v]);
      sum = _mm512_add_ps(sum, a[r][v]);
    }
    mu[r] = _mm512_reduce_add_ps(sum) * inv_d;
  }
  for (int r = 0; r < R; ++r) {
    const __m512 m = _mm512_set1_ps(mu[r]);
    __m512 sq = _mm512_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      __m512 d = _mm512_maskz_sub_ps(mk.m[v], a[r][v], m);  // 0 in the lanes past D
      sq = _mm512_fmadd_ps(d, d, sq);
    }
    rs[r] = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) * inv_d + eps);
    mean[r] = mu[r];
    rstd[r] = rs[r];
  }
  for (int r = 0; r < R; ++r) {
    const __m512 m = _mm512_set1_ps(mu[r]), k = _mm512_set1_ps(rs[r]);
    for (int v = 0; v < NV; ++v) {
      const int64_t o = r * D + 16 * v;
      __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(a[r][v], m), k);
      __m512 out = _mm512_fmadd_ps(xhat, _mm512_maskz_loadu_ps(mk.m[v], gamma + 16 * v),
                                   _mm512_maskz_loadu_ps(mk.m[v], beta + 16 * v));
      if (OUT_BF16)
        _mm256_mask_storeu_epi16((uint16_t*)y + o, mk.m[v], to_bf16(out));
      else
        _mm512_mask_storeu_ps((float*)y + o, mk.m[v], out);
    }
  }
}

template <int NV, bool BRANCH_BF16, bool OUT_BF16>
void forward(int64_t rows, int64_t D, const float* x, const void* branch, float* s,
             const float* gamma, const float* beta, void* y, float* mean, float* rstd, float eps,
             int threads) {
  constexpr int R = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;  // R * NV <= 16 registers of rows
  const Masks<NV> mk(D);
  const int64_t ysize = OUT_BF16 ? 2 : 4, bsize = BRANCH_BF16 ? 2 : 4;
  const int64_t groups = (rows + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * R;
    const void* br = branch == nullptr ? nullptr : (const char*)branch + r0 * D * bsize;
    void* yr = (char*)y + r0 * D * ysize;
    if (r0 + R <= rows)
      forward_rows<NV, R, BRANCH_BF16, OUT_BF16>(mk, D, x + r0 * D, br, s + r0 * D, gamma, beta,
                                                 yr, mean + r0, rstd + r0, eps);
    else
      for (int64_t r = r0; r < rows; ++r)
        forward_rows<NV, 1, BRANCH_BF16, OUT_BF16>(
            mk, D, x + r * D,
            branch == nullptr ? nullptr : (const char*)branch + r * D * bsize, s + r * D, gamma,
            beta, (char*)y + r * D * ysize, mean + r, rstd + r, eps);
  }
}

// With g = dy * gamma and xhat = (s - mean) * rstd (Ba et al. 2016, differentiated):
//   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds_residual
//   dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy
// ds is also the branch's gradient (the add passes it through), written as bfloat16 when
// the branch was. Each thread sums dgamma and dbeta over its own rows in registers; the
// threads' sums are added in thread order afterwards, so the result does not depend on
// scheduling.
template <int NV, bool DY_BF16, bool BRANCH_BF16>
void backward(int64_t rows, int64_t D, const void* dy, const float* ds_residual, const float* s,
              const float* mean, const float* rstd, const float* gamma, float* ds, void* dbranch,
              float* dgamma, float* dbeta, float* partial, int threads) {
  const Masks<NV> mk(D);
  const float inv_d = 1.0f / (float)D;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
    __m512 dg[NV], db[NV];
    for (int v = 0; v < NV; ++v) dg[v] = db[v] = _mm512_setzero_ps();
    for (int64_t r = lo; r < hi; ++r) {
      const __m512 m = _mm512_set1_ps(mean[r]), k = _mm512_set1_ps(rstd[r]);
      __m512 xhat[NV], g[NV], sum_g = _mm512_setzero_ps(), sum_gx = _mm512_setzero_ps();
      for (int v = 0; v < NV; ++v) {
        const int64_t o = r * D + 16 * v;
        __m512 d = DY_BF16 ? load_bf16(mk.m[v], (const uint16_t*)dy + o)
                           : _mm512_maskz_loadu_ps(mk.m[v], (const float*)dy + o);
        xhat[v] = _mm512_mul_ps(_mm512_maskz_sub_ps(mk.m[v], _mm512_maskz_loadu_ps(mk.m[v], s + o), m), k);
        dg[v] = _mm512_fmadd_ps(d, xhat[v], dg[v]);
        db[v] = _mm512_add_ps(db[v], d);
        g[v] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(mk.m[v], gamma + 16 * v));
        sum_g = _mm512_add_ps(sum_g, g[v]);
        sum_gx = _mm512_fmadd_ps(g[v], xhat[v], sum_gx);
      }
      const __m512 mg = _mm512_set1_ps(_mm512_reduce_add_ps(sum_g) * inv_d);
      const __m512 mgx = _mm512_set1_ps(_mm512_reduce_add_ps(sum_gx) * inv_d);
      for (int v = 0; v < NV; ++v) {
        const int64_t o = r * D + 16 * v;
        __m512 d = _mm512_mul_ps(k, _mm512_fnmadd_ps(xhat[v], mgx, _mm512_sub_ps(g[v], mg)));
        if (ds_residual != nullptr)
          d = _mm512_add_ps(d, _mm512_maskz_loadu_ps(mk.m[v], ds_residual + o));
        _mm512_mask_storeu_ps(ds + o, mk.m[v], d);
        if (BRANCH_BF16) _mm256_mask_storeu_epi16((uint16_t*)dbranch + o, mk.m[v], to_bf16(d));
      }
    }
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(partial + (2 * t) * D + 16 * v, mk.m[v], dg[v]);
      _mm512_mask_storeu_ps(partial + (2 * t + 1) * D + 16 * v, mk.m[v], db[v]);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < D; ++i) {
      float a = 0.0f, b = 0.0f;
      for (int u = 0; u < nt; ++u) {
        a += partial[2 * u * D + i];
        b += partial[(2 * u + 1) * D + i];
      }
      dgamma[i] = a;
      dbeta[i] = b;
    }
  }
}

}  // namespace
#endif

extern "C" {

// 1 where this build has the kernels (the CPU has AVX-512 F, BW and VL), else 0 and they
// do nothing.
int add_norm_available() {
#if defined(LN_AVX512)
  return 1;
#else
  return 0;
#endif
}

// x (rows, D) float32, 16 * (LN_NV - 1) < D <= 16 * LN_NV (else nothing is written); branch (rows, D) float32, bfloat16 (branch_bf16) or null (s = x);
// gamma, beta (D) float32. Writes s (rows, D) float32, y (rows, D) float32 or bfloat16
// (out_bf16), mean and rstd (rows) float32.
void add_norm_forward(int branch_bf16, int out_bf16, int64_t rows, int64_t D, const float* x,
                      const void* branch, float* s, const float* gamma, const float* beta,
                      void* y, float* mean, float* rstd, float eps, int threads) {
#if defined(LN_AVX512)
  auto f = branch_bf16 ? (out_bf16 ? forward<LN_NV, true, true> : forward<LN_NV, true, false>)
                       : (out_bf16 ? forward<LN_NV, false, true> : forward<LN_NV, false, false>);
  if ((D + 15) / 16 == LN_NV) f(rows, D, x, branch, s, gamma, beta, y, mean, rstd, eps, threads);
#endif
}

// dy (rows, D) float32 or bfloat16 (dy_bf16): the gradient of y; ds_residual (rows, D)
// float32 or null: the gradient of s from its other uses. Writes ds (rows, D) float32, the
// gradient of x; dbranch (rows, D) bfloat16 when branch_bf16 (else the branch's gradient
// is ds); dgamma, dbeta (D) float32. partial: 2 * threads * D floats of scratch.
void add_norm_backward(int dy_bf16, int branch_bf16, int64_t rows, int64_t D, const void* dy,
                       const float* ds_residual, const float* s, const float* mean,
                       const float* rstd, const float* gamma, float* ds, void* dbranch,
                       float* dgamma, float* dbeta, float* partial, int threads) {
#if defined(LN_AVX512)
  auto f = dy_bf16 ? (branch_bf16 ? backward<LN_NV, true, true> : backward<LN_NV, true, false>)
                   : (branch_bf16 ? backward<LN_NV, false, true> : backward<LN_NV, false, false>);
  if ((D + 15) / 16 == LN_NV)
    f(rows, D, dy, ds_residual, s, mean, rstd, gamma, ds, dbranch, dgamma, dbeta, partial, threads);
#endif
}

}  // extern "C"
