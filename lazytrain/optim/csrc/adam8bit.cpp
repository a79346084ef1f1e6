// Fused blockwise 8-bit AdamW step for the CPU (lazytrain.optim.kernel_cpp builds this on first use).
//
// One pass per block reads param (or fp32 master), grad and both 8-bit states, and writes them back:
// dequantise m,v (256-entry code tables, register permutes), AdamW update with the clip scale folded
// into the grad, keep the new m,v of the block in a thread-local buffer (L1/L2 resident), take their
// absmax, and requantise with integer work on the float bits (qmap.py's exponent maps; no search).
//
// Arithmetic order and rounding match kernel_torch.py exactly (no FMA contraction: the build passes
// -ffp-contract=off), so both paths give bit-identical results.

// Only the headers this file uses (ATen's tensor, parallel_for, torch's pybind casters), not
// <torch/extension.h> (the whole C++ frontend): a first-use build took 9-13 s instead of 24-28 s
// (2026-12-02, this 2-core machine).
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LT_AVX512 1
#else
#define LT_AVX512 0
#endif

namespace {

constexpr int kTable = 32;  // per-binade table entries (qmap.TABLE_SIZE)
// Software prefetch distance in elements (0: off); set_prefetch() tunes it. Hardware prefetchers
// stop at 4 KiB page boundaries, which costs a streaming kernel ~10% here.
int64_t kPrefetch = 256;

// One exponent map (qmap.ExpMap): per-binade shift / rounding bias / code bias, and code values.
struct Map {
  const float* code;     // [256]
  const int32_t* shift;  // [kTable]
  const int32_t* half;
  const int32_t* bias;
  int32_t exp_lo;
  int32_t top;
  int32_t min_code;  // 0 for m; 1 for v (zero-point exclusion, see qmap.py)
  bool is_signed;
};

struct Tables {
  Map m, v;
};

// Per-tensor constants, float32-rounded in Python so both kernels use the same values.
struct Hyper {
  float b1, omb1, b2, omb2, eps, decay, step_size, inv_bc2_sqrt;
};
constexpr int kHyper = 8;

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Same rounding as c10::BFloat16 (round to nearest even, NaN -> 0x7FC0).
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Same integer steps as qmap.quantize_normalized (int32 wrap-around and arithmetic shifts).
inline uint8_t quant(float x, const Map& q) {
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  const int32_t mag = bits & 0x7FFFFFFF;
  const int32_t t = std::min(std::max((mag >> 23) - q.exp_lo, 0), kTable - 1);
  const int32_t r = static_cast<int32_t>(static_cast<uint32_t>(mag) + static_cast<uint32_t>(q.half[t]));
  int32_t k = (r >> q.shift[t]) + q.bias[t];
  k = std::min(std::max(k, q.min_code), q.top);
  if (q.is_signed) k |= (bits >> 24) & 0x80;
  return static_cast<uint8_t>(k);
}

// 1 / absmax, or 0 for an all-zero block and for one whose absmax is so small (a denormal below
// 1 / FLT_MAX) that the reciprocal overflows: inf would turn its zeros into NaN (0 * inf) and their
// codes into whatever each kernel makes of a NaN. Same rule in kernel_torch._inv_or_zero.
inline float inv_or_zero(float absmax) {
  if (!(absmax > 0.0f)) return 0.0f;
  const float r = 1.0f / absmax;
  return std::isinf(r) ? 0.0f : r;
}

// One block, scalar. w: fp32 weights (master or the param itself); pbf: bf16 param or null.
template <typename G>
void block_scalar(float* w, uint16_t* pbf, const G* g, uint8_t* qm, uint8_t* qv, float* am,
                  float* av, int64_t n, const Hyper& h, float clip, const Tables& t, float* mbuf,
                  float* vbuf) {
  const float amb1 = *am * h.b1, avb2 = *av * h.b2;
  const float c1 = clip * h.omb1, c2 = (clip * clip) * h.omb2;
  float mx_m = 0.0f, mx_v = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float gi;
    if constexpr (std::is_same_v<G, float>) gi = g[i]; else gi = bf16_to_f32(g[i]);
    const float m = t.m.code[qm[i]] * amb1 + gi * c1;
    const float v = t.v.code[qv[i]] * avb2 + (gi * gi) * c2;
    float wi = w[i] * h.decay;
    float denom = std::sqrt(v) * h.inv_bc2_sqrt + h.eps;
    wi = wi - (m / denom) * h.step_size;
    w[i] = wi;
    if (pbf) pbf[i] = f32_to_bf16(wi);
    mbuf[i] = m;
    vbuf[i] = v;
    mx_m = std::max(mx_m, std::fabs(m));
    mx_v = std::max(mx_v, v);
  }
  const float im = inv_or_zero(mx_m), iv = inv_or_zero(mx_v);
  for (int64_t i = 0; i < n; ++i) {
    qm[i] = quant(mbuf[i] * im, t.m);
    qv[i] = quant(vbuf[i] * iv, t.v);
  }
  *am = mx_m;
  *av = mx_v;
}

#if LT_AVX512
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

inline __m512 load_grad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }
inline __m512 load_grad(const uint16_t* g, __mmask16 k) {
  __m256i h = _mm256_maskz_loadu_epi16(k, g);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(
      _mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// A map's tables held in registers for one block: 256 code values as 16 x 16 floats, and the
// three 32-entry per-binade tables as register pairs (two-source permutes, no gathers: gathers
// were the bottleneck, ~13 cycles per 16 lanes on this CPU).
struct VMap {
  __m512 code[16];
  __m512i shift[2], half[2], bias[2];
  __m512i exp_lo, top, min_code;
  bool is_signed;
  explicit VMap(const Map& q) {
    for (int j = 0; j < 16; ++j) code[j] = _mm512_loadu_ps(q.code + 16 * j);
    for (int j = 0; j < 2; ++j) {
      shift[j] = _mm512_loadu_si512(q.shift + 16 * j);
      half[j] = _mm512_loadu_si512(q.half + 16 * j);
      bias[j] = _mm512_loadu_si512(q.bias + 16 * j);
    }
    exp_lo = _mm512_set1_epi32(q.exp_lo);
    top = _mm512_set1_epi32(q.top);
    min_code = _mm512_set1_epi32(q.min_code);
    is_signed = q.is_signed;
  }
};

// code[c] for 16 code bytes (as int32 lanes): 8 two-register permutes, then select on bits 5..7.
inline __m512 dequant_v(__m512i c, const VMap& q) {
  const __m512 r0 = _mm512_permutex2var_ps(q.code[0], c, q.code[1]);
  const __m512 r1 = _mm512_permutex2var_ps(q.code[2], c, q.code[3]);
  const __m512 r2 = _mm512_permutex2var_ps(q.code[4], c, q.code[5]);
  const __m512 r3 = _mm512_permutex2var_ps(q.code[6], c, q.code[7]);
  const __m512 r4 = _mm512_permutex2var_ps(q.code[8], c, q.code[9]);
  const __m512 r5 = _mm512_permutex2var_ps(q.code[10], c, q.code[11]);
  const __m512 r6 = _mm512_permutex2var_ps(q.code[12], c, q.code[13]);
  const __m512 r7 = _mm512_permutex2var_ps(q.code[14], c, q.code[15]);
  const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
  const __m512 s0 = _mm512_mask_mov_ps(r0, b5, r1), s1 = _mm512_mask_mov_ps(r2, b5, r3);
  const __m512 s2 = _mm512_mask_mov_ps(r4, b5, r5), s3 = _mm512_mask_mov_ps(r6, b5, r7);
  const __m512 u0 = _mm512_mask_mov_ps(s0, b6, s1), u1 = _mm512_mask_mov_ps(s2, b6, s3);
  return _mm512_mask_mov_ps(u0, b7, u1);
}

inline __m512i quant_v(__m512 x, const VMap& q) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  __m512i t = _mm512_sub_epi32(_mm512_srli_epi32(mag, 23), q.exp_lo);
  t = _mm512_min_epi32(_mm512_max_epi32(t, _mm512_setzero_si512()), _mm512_set1_epi32(kTable - 1));
  const __m512i shift = _mm512_permutex2var_epi32(q.shift[0], t, q.shift[1]);
  const __m512i half = _mm512_permutex2var_epi32(q.half[0], t, q.half[1]);
  const __m512i bias = _mm512_permutex2var_epi32(q.bias[0], t, q.bias[1]);
  __m512i k = _mm512_add_epi32(_mm512_srav_epi32(_mm512_add_epi32(mag, half), shift), bias);
  k = _mm512_min_epi32(_mm512_max_epi32(k, q.min_code), q.top);
  if (q.is_signed)
    k = _mm512_or_si512(k, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
  return k;
}

// One block's constants in registers (block_scalar's folded constants): the old absmaxes times
// the betas, the clip scale folded into the gradient coefficients, and the other hyper-parameters.
struct VHyper {
  __m512 amb1, avb2, c1, c2, eps, decay, step, ibc2;
  bool no_decay;   // weight_decay 0: skip the multiply (~2% of the step)
  VHyper(const Hyper& h, float c, float absmax_m, float absmax_v)
      : amb1(_mm512_set1_ps(absmax_m * h.b1)), avb2(_mm512_set1_ps(absmax_v * h.b2)),
        c1(_mm512_set1_ps(c * h.omb1)), c2(_mm512_set1_ps((c * c) * h.omb2)),
        eps(_mm512_set1_ps(h.eps)), decay(_mm512_set1_ps(h.decay)), step(_mm512_set1_ps(h.step_size)),
        ibc2(_mm512_set1_ps(h.inv_bc2_sqrt)), no_decay(h.decay == 1.0f) {}
};

// The AdamW update of 16 elements (block_scalar's arithmetic, in the same order): from the
// gradient, the two dequantised code values and the weight, the new m and v (out) and weight.
inline __m512 adam16(const VHyper& p, __m512 g, __m512 code_m, __m512 code_v, __m512 w, __m512& m,
                     __m512& v) {
  m = _mm512_add_ps(_mm512_mul_ps(code_m, p.amb1), _mm512_mul_ps(g, p.c1));
  v = _mm512_add_ps(_mm512_mul_ps(code_v, p.avb2), _mm512_mul_ps(_mm512_mul_ps(g, g), p.c2));
  const __m512 wi = p.no_decay ? w : _mm512_mul_ps(w, p.decay);   // (w * 1.0f == w, bit for bit)
  const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), p.ibc2), p.eps);
  return _mm512_sub_ps(wi, _mm512_mul_ps(_mm512_div_ps(m, denom), p.step));
}

template <typename G>
void block_avx512(float* w, uint16_t* pbf, const G* g, uint8_t* qm, uint8_t* qv, float* am,
                  float* av, int64_t n, const Hyper& h, float clip, const Tables& t, float* mbuf,
                  float* vbuf) {
  const VHyper p(h, clip, *am, *av);
  const VMap qm_map(t.m), qv_map(t.v);
  __m512 mx_m = _mm512_setzero_ps(), mx_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512i cm = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, qm + i));
    const __m512i cv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, qv + i));
    __m512 m, v;
    const __m512 wi = adam16(p, load_grad(g + i, k), dequant_v(cm, qm_map), dequant_v(cv, qv_map),
                             _mm512_maskz_loadu_ps(k, w + i), m, v);
    _mm512_mask_storeu_ps(w + i, k, wi);
    if (pbf) _mm256_mask_storeu_epi16(pbf + i, k, to_bf16(wi));
    _mm512_mask_storeu_ps(mbuf + i, k, m);
    _mm512_mask_storeu_ps(vbuf + i, k, v);
    // (vmaxps returns its second operand when either is NaN: the running max second skips a NaN,
    // as std::max above and the torch kernels' NaN-to-0 do)
    mx_m = _mm512_mask_max_ps(mx_m, k, _mm512_abs_ps(m), mx_m);
    mx_v = _mm512_mask_max_ps(mx_v, k, v, mx_v);
  }
  const float amax_m = _mm512_reduce_max_ps(mx_m), amax_v = _mm512_reduce_max_ps(mx_v);
  const __m512 im = _mm512_set1_ps(inv_or_zero(amax_m)), iv = _mm512_set1_ps(inv_or_zero(amax_v));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 m = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, mbuf + i), im);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, vbuf + i), iv);
    _mm_mask_storeu_epi8(qm + i, k, _mm512_cvtepi32_epi8(quant_v(m, qm_map)));
    _mm_mask_storeu_epi8(qv + i, k, _mm512_cvtepi32_epi8(quant_v(v, qv_map)));
  }
  *am = amax_m;
  *av = amax_v;
}

#if defined(__AVX512VBMI__)
#define LT_VBMI 1
// VBMI kernel, 64 elements per iteration. Every code value is bf16-representable (at most 6
// mantissa bits, checked when the tables are built), so dequantising is two byte-table lookups
// (low and high byte of the bf16) with 2-source byte permutes, and quantising needs only the top
// 16 bits of the float: the rounding bias and shift of every binade are multiples of 2**16
// (shift >= 17), so (mag + half) >> shift == (mag16 + half16) >> (shift - 16) exactly, done on
// 32 16-bit lanes per instruction (see quant64). Same results as quant()/code[] above, bit for bit.

// quant64 carries codes offset by kOff (a multiple of 256, so the low byte is the code): its
// rounding add is one unsigned average with a non-negative per-binade table entry.
constexpr int32_t kOff = 0x2000;

struct BMap {
  __m512i lo[4], hi[4];          // byte planes of the bf16 code values, 64 entries per register
  __m512i s1, avg;               // 16-bit per-binade tables (32 entries): shift - 17, 2 * (bias + kOff)
  __m512i exp_lo;                // 16-bit broadcasts
  __m512i lo_clamp, hi_clamp;    // min_code + kOff, top + kOff
  bool is_signed;
  explicit BMap(const Map& q) {
    alignas(64) uint8_t lo_b[256], hi_b[256];
    for (int k = 0; k < 256; ++k) {
      uint32_t u;
      std::memcpy(&u, q.code + k, 4);
      TORCH_CHECK((u & 0xFFFFu) == 0, "code value ", k, " is not bf16-representable");
      lo_b[k] = static_cast<uint8_t>(u >> 16);
      hi_b[k] = static_cast<uint8_t>(u >> 24);
    }
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_loadu_si512(lo_b + 64 * j);
      hi[j] = _mm512_loadu_si512(hi_b + 64 * j);
    }
    alignas(64) uint16_t s1_t[32], avg_t[32];
    for (int t = 0; t < kTable; ++t) {
      TORCH_CHECK(q.shift[t] >= 17 && q.shift[t] <= 23 && q.half[t] == (1 << (q.shift[t] - 1)),
                  "exponent map entry ", t, " keeps more than 6 mantissa bits");
      const int32_t a = 2 * (q.bias[t] + kOff);
      TORCH_CHECK(a >= 0 && a <= 32767, "exponent map bias ", q.bias[t], " out of the 16-bit kernel's range");
      s1_t[t] = static_cast<uint16_t>(q.shift[t] - 17);   // (shift - 16) - 1
      avg_t[t] = static_cast<uint16_t>(a);
    }
    s1 = _mm512_loadu_si512(s1_t);
    avg = _mm512_loadu_si512(avg_t);
    exp_lo = _mm512_set1_epi16(static_cast<int16_t>(q.exp_lo));
    lo_clamp = _mm512_set1_epi16(static_cast<int16_t>(q.min_code + kOff));
    hi_clamp = _mm512_set1_epi16(static_cast<int16_t>(q.top + kOff));
    is_signed = q.is_signed;
  }
};

// Byte-permute indices: interleave (lo, hi) bytes into bf16 words ordered so that
// unpack{lo,hi}_epi16(0, W) yields elements in natural order (see dequant64).
struct Perm {
  __m512i w0, w1, hi16, pack;
  Perm() {
    alignas(64) uint8_t a[64], b[64];
    for (int lane = 0; lane < 4; ++lane)
      for (int i = 0; i < 4; ++i) {
        const int p_lo = 8 * lane + i, p_hi = 8 * lane + 4 + i;  // word positions
        const int e_lo = 4 * lane + i, e_hi = 16 + 4 * lane + i;  // elements they hold (W0)
        a[2 * p_lo] = e_lo, a[2 * p_lo + 1] = 64 + e_lo;
        a[2 * p_hi] = e_hi, a[2 * p_hi + 1] = 64 + e_hi;
        b[2 * p_lo] = 32 + e_lo, b[2 * p_lo + 1] = 64 + 32 + e_lo;
        b[2 * p_hi] = 32 + e_hi, b[2 * p_hi + 1] = 64 + 32 + e_hi;
      }
    w0 = _mm512_loadu_si512(a);
    w1 = _mm512_loadu_si512(b);
    alignas(64) int16_t h[32];
    for (int j = 0; j < 32; ++j) h[j] = static_cast<int16_t>(j < 16 ? 2 * j + 1 : 32 + 2 * (j - 16) + 1);
    hi16 = _mm512_loadu_si512(h);
    alignas(64) uint8_t pk[64];
    for (int j = 0; j < 64; ++j) pk[j] = static_cast<uint8_t>(2 * j);   // low bytes: 0..62 of a, 64..126 of b
    pack = _mm512_loadu_si512(pk);
  }
};

inline __m512i lut256(__m512i c, __mmask64 top_bit, const __m512i* t) {
  const __m512i a = _mm512_permutex2var_epi8(t[0], c, t[1]);
  const __m512i b = _mm512_permutex2var_epi8(t[2], c, t[3]);
  return _mm512_mask_blend_epi8(top_bit, a, b);
}

// 64 code bytes -> 4 x 16 floats (code values, not yet scaled by the absmax), natural order.
inline void dequant64(__m512i c, const BMap& q, const Perm& pm, __m512* out) {
  const __mmask64 tb = _mm512_movepi8_mask(c);
  const __m512i lo = lut256(c, tb, q.lo), hi = lut256(c, tb, q.hi);
  const __m512i w0 = _mm512_permutex2var_epi8(lo, pm.w0, hi);
  const __m512i w1 = _mm512_permutex2var_epi8(lo, pm.w1, hi);
  const __m512i z = _mm512_setzero_si512();
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w0));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w0));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w1));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w1));
}

// 64 normalised floats (x[0..3], 16 each, in order) -> 64 code bytes. On the top 16 bits (mag):
// (mag + half) >> s + bias == ((mag >> (s - 1)) + 1) >> 1 + bias, and with A = 2 * (bias + kOff)
// in [0, 32767] that is avg_epu16(mag >> (s - 1), A) - kOff (avg: (a + b + 1) >> 1, exact in 17
// bits, at most 32767: the signed clamps below see it right). The binade index keeps its upper
// clamp: a finite normalised value is at most 1 (+1 ulp) only when the block's absmax really is its
// largest magnitude (a NaN normalises to NaN, whose code is whatever the integer steps make of it).
inline __m512i quant64(const __m512* x, const BMap& q, const Perm& pm) {
  __m512i r[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i w = _mm512_permutex2var_epi16(_mm512_castps_si512(x[2 * h]), pm.hi16,
                                                _mm512_castps_si512(x[2 * h + 1]));
    const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
    // exponent field - exp_lo, in [0, 31]: a saturating subtract is the lower clamp
    const __m512i t = _mm512_min_epu16(_mm512_subs_epu16(_mm512_srli_epi16(mag, 7), q.exp_lo),
                                       _mm512_set1_epi16(kTable - 1));
    __m512i k = _mm512_avg_epu16(_mm512_srlv_epi16(mag, _mm512_permutexvar_epi16(t, q.s1)),
                                 _mm512_permutexvar_epi16(t, q.avg));
    k = _mm512_min_epi16(_mm512_max_epi16(k, q.lo_clamp), q.hi_clamp);
    if (q.is_signed)  // k | ((w >> 8) & 0x80): the sign into bit 7
      k = _mm512_ternarylogic_epi32(k, _mm512_srli_epi16(w, 8), _mm512_set1_epi16(0x80), 0xF8);
    r[h] = k;
  }
  return _mm512_permutex2var_epi8(r[0], pm.pack, r[1]);
}

template <typename G>
inline __m512 load_grad16(const G* g) {
  if constexpr (std::is_same_v<G, float>) return _mm512_loadu_ps(g);
  else return load_grad(g, static_cast<__mmask16>(0xFFFF));
}

// One block whose length is a multiple of 64 (the caller sends other blocks, i.e. a tensor's
// short last block, to block_avx512's masked loop).
template <typename G>
void block_vbmi(float* w, uint16_t* pbf, const G* g, uint8_t* qm, uint8_t* qv, float* am, float* av,
                int64_t n, const Hyper& h, float clip, const BMap& bm, const BMap& bv, const Perm& pm,
                float* mbuf, float* vbuf) {
  const VHyper p(h, clip, *am, *av);
  __m512 mx_m = _mm512_setzero_ps(), mx_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 64) {
    // Software prefetch PF elements ahead (may run past the block into the next one of the same
    // tensor: harmless hints). Hardware prefetchers stop at 4 KiB page boundaries.
    if (kPrefetch > 0) {
      const int64_t pf = i + kPrefetch;
      _mm_prefetch(reinterpret_cast<const char*>(qm + pf), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qv + pf), _MM_HINT_T0);
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + pf + 16 * j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g + pf + 16 * j * sizeof(float) / sizeof(G)), _MM_HINT_T0);
      }
    }
    __m512 cm[4], cv[4];
    dequant64(_mm512_loadu_si512(qm + i), bm, pm, cm);
    dequant64(_mm512_loadu_si512(qv + i), bv, pm, cv);
    for (int j = 0; j < 4; ++j) {
      const int64_t o = i + 16 * j;
      __m512 m, v;
      const __m512 wi = adam16(p, load_grad16(g + o), cm[j], cv[j], _mm512_loadu_ps(w + o), m, v);
      _mm512_storeu_ps(w + o, wi);
      if (pbf) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbf + o), to_bf16(wi));
      _mm512_store_ps(mbuf + o, m);
      _mm512_store_ps(vbuf + o, v);
      mx_m = _mm512_max_ps(_mm512_abs_ps(m), mx_m);   // (NaN skipped: see block_avx512)
      mx_v = _mm512_max_ps(v, mx_v);
    }
  }
  const float amax_m = _mm512_reduce_max_ps(mx_m), amax_v = _mm512_reduce_max_ps(mx_v);
  const __m512 im = _mm512_set1_ps(inv_or_zero(amax_m)), iv = _mm512_set1_ps(inv_or_zero(amax_v));
  for (int64_t i = 0; i < n; i += 64) {
    __m512 xm[4], xv[4];
    for (int j = 0; j < 4; ++j) {
      xm[j] = _mm512_mul_ps(_mm512_load_ps(mbuf + i + 16 * j), im);
      xv[j] = _mm512_mul_ps(_mm512_load_ps(vbuf + i + 16 * j), iv);
    }
    _mm512_storeu_si512(qm + i, quant64(xm, bm, pm));
    _mm512_storeu_si512(qv + i, quant64(xv, bv, pm));
  }
  *am = amax_m;
  *av = amax_v;
}
#else
#define LT_VBMI 0
#endif
#endif

Tables tables_from(const at::Tensor& code_s, const at::Tensor& code_u, const at::Tensor& qtab,
                   int64_t exp_lo_s, int64_t exp_lo_u) {
  TORCH_CHECK(code_s.numel() == 256 && code_u.numel() == 256, "code tables must have 256 entries");
  TORCH_CHECK(qtab.dim() == 2 && qtab.size(0) == 6 && qtab.size(1) == kTable &&
                  qtab.scalar_type() == at::kInt && qtab.is_contiguous(),
              "qtab must be int32 [6, 32] (shift, half, bias for m then v)");
  const int32_t* q = qtab.data_ptr<int32_t>();
  return Tables{Map{code_s.data_ptr<float>(), q, q + kTable, q + 2 * kTable,
                    static_cast<int32_t>(exp_lo_s), 127, 0, true},
                Map{code_u.data_ptr<float>(), q + 3 * kTable, q + 4 * kTable, q + 5 * kTable,
                    static_cast<int32_t>(exp_lo_u), 255, 1, false}};
}

}  // namespace

bool has_avx512() { return LT_AVX512; }
#ifndef LT_VBMI
#define LT_VBMI 0
#endif
bool has_vbmi() { return LT_VBMI; }
void set_prefetch(int64_t d) { kPrefetch = d; }

// Update a list of tensors in one parallel region over all their blocks.
// weights[i]: fp32 flat (the master when params[i] is bf16, else the param itself);
// params_bf16[i]: bf16 flat param to receive the rounded weights, or an empty tensor.
void adam8bit_step(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& params_bf16,
                   const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& qms,
                   const std::vector<at::Tensor>& qvs, const std::vector<at::Tensor>& ams,
                   const std::vector<at::Tensor>& avs, const at::Tensor& hyper, double clip,
                   int64_t block_size, const at::Tensor& code_s, const at::Tensor& code_u,
                   const at::Tensor& qtab, int64_t exp_lo_s, int64_t exp_lo_u, bool use_simd) {
  const Tables t = tables_from(code_s, code_u, qtab, exp_lo_s, exp_lo_u);
  const size_t nt = weights.size();
  TORCH_CHECK(hyper.dim() == 2 && hyper.size(1) == kHyper && static_cast<size_t>(hyper.size(0)) == nt,
              "hyper must be float32 [num_tensors, 8]");
  const float* hp = hyper.data_ptr<float>();
  std::vector<int64_t> first_block(nt + 1, 0);
  for (size_t i = 0; i < nt; ++i) {
    const int64_t n = weights[i].numel();
    TORCH_CHECK(grads[i].numel() == n && qms[i].numel() == n && qvs[i].numel() == n &&
                    (params_bf16[i].numel() == 0 || params_bf16[i].numel() == n),
                "tensor ", i, ": grad/state/param sizes differ from the weight");
    TORCH_CHECK(ams[i].numel() == (n + block_size - 1) / block_size, "tensor ", i, ": absmax size");
    first_block[i + 1] = first_block[i] + ams[i].numel();
  }
  const float fclip = static_cast<float>(clip);
#if LT_VBMI
  const BMap bm(t.m), bv(t.v);
  const Perm pm;
#endif
  // Raw pointers per tensor, taken once: data_ptr<T>() checks cost ~10% of the step when taken per block.
  struct Ptrs {
    float* w; uint16_t* pbf; const float* gf; const uint16_t* gh;
    uint8_t* qm; uint8_t* qv; float* am; float* av; int64_t n; Hyper h;
  };
  std::vector<Ptrs> ptrs(nt);
  for (size_t i = 0; i < nt; ++i) {
    Ptrs& q = ptrs[i];
    q.w = weights[i].data_ptr<float>();
    q.pbf = params_bf16[i].numel() ? reinterpret_cast<uint16_t*>(params_bf16[i].data_ptr<at::BFloat16>()) : nullptr;
    const bool bf = grads[i].scalar_type() == at::kBFloat16;
    q.gf = bf ? nullptr : grads[i].data_ptr<float>();
    q.gh = bf ? reinterpret_cast<const uint16_t*>(grads[i].data_ptr<at::BFloat16>()) : nullptr;
    q.qm = qms[i].data_ptr<uint8_t>();
    q.qv = qvs[i].data_ptr<uint8_t>();
    q.am = ams[i].data_ptr<float>();
    q.av = avs[i].data_ptr<float>();
    q.n = weights[i].numel();
    std::memcpy(&q.h, hp + i * kHyper, sizeof(Hyper));
  }
  at::parallel_for(0, first_block[nt], 1, [&](int64_t begin, int64_t end) {
    // Scratch for one block's new m and v (64-byte aligned for the aligned vector stores).
    std::vector<float> scratch(2 * block_size + 32);
    float* mbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    float* vbuf = mbuf + ((block_size + 15) / 16) * 16;
    size_t ti = std::upper_bound(first_block.begin(), first_block.end(), begin) - first_block.begin() - 1;
    for (int64_t blk = begin; blk < end; ++blk) {
      while (blk >= first_block[ti + 1]) ++ti;
      const Ptrs& q = ptrs[ti];
      const int64_t b = blk - first_block[ti];
      const int64_t off = b * block_size;
      const int64_t n = std::min(block_size, q.n - off);
      float* w = q.w + off;
      uint16_t* pbf = q.pbf ? q.pbf + off : nullptr;
      uint8_t* qm = q.qm + off;
      uint8_t* qv = q.qv + off;
      float* am = q.am + b;
      float* av = q.av + b;
      const Hyper& h = q.h;
#if LT_VBMI
      if (use_simd && n % 64 == 0) {
        if (q.gh) block_vbmi(w, pbf, q.gh + off, qm, qv, am, av, n, h, fclip, bm, bv, pm, mbuf, vbuf);
        else block_vbmi(w, pbf, q.gf + off, qm, qv, am, av, n, h, fclip, bm, bv, pm, mbuf, vbuf);
        continue;
      }
#endif
#if LT_AVX512
      if (use_simd) {
        if (q.gh) block_avx512(w, pbf, q.gh + off, qm, qv, am, av, n, h, fclip, t, mbuf, vbuf);
        else block_avx512(w, pbf, q.gf + off, qm, qv, am, av, n, h, fclip, t, mbuf, vbuf);
        continue;
      }
#endif
      if (q.gh) block_scalar(w, pbf, q.gh + off, qm, qv, am, av, n, h, fclip, t, mbuf, vbuf);
      else block_scalar(w, pbf, q.gf + off, qm, qv, am, av, n, h, fclip, t, mbuf, vbuf);
    }
  });
}

// fp32-state AdamW for the small tensors (same arithmetic as the 8-bit path, no quantisation).
void adam32_step(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& params_bf16,
                 const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& ms,
                 const std::vector<at::Tensor>& vs, const at::Tensor& hyper, double clip) {
  const size_t nt = weights.size();
  TORCH_CHECK(hyper.dim() == 2 && hyper.size(1) == kHyper && static_cast<size_t>(hyper.size(0)) == nt,
              "hyper must be float32 [num_tensors, 8]");
  TORCH_CHECK(params_bf16.size() == nt && grads.size() == nt && ms.size() == nt && vs.size() == nt,
              "adam32_step: list lengths differ");
  for (size_t i = 0; i < nt; ++i) {
    const int64_t n = weights[i].numel();
    TORCH_CHECK(grads[i].numel() == n && ms[i].numel() == n && vs[i].numel() == n &&
                    (params_bf16[i].numel() == 0 || params_bf16[i].numel() == n),
                "tensor ", i, ": grad/state/param sizes differ from the weight");
  }
  const float* hp = hyper.data_ptr<float>();
  const float fclip = static_cast<float>(clip);
  at::parallel_for(0, static_cast<int64_t>(weights.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t ti = begin; ti < end; ++ti) {
      Hyper h;
      std::memcpy(&h, hp + ti * kHyper, sizeof(Hyper));
      const int64_t n = weights[ti].numel();
      float* w = weights[ti].data_ptr<float>();
      float* m = ms[ti].data_ptr<float>();
      float* v = vs[ti].data_ptr<float>();
      uint16_t* pbf = params_bf16[ti].numel()
                          ? reinterpret_cast<uint16_t*>(params_bf16[ti].data_ptr<at::BFloat16>()) : nullptr;
      const bool bf16_grad = grads[ti].scalar_type() == at::kBFloat16;
      const float* gf = bf16_grad ? nullptr : grads[ti].data_ptr<float>();
      const uint16_t* gh = bf16_grad ? reinterpret_cast<const uint16_t*>(grads[ti].data_ptr<at::BFloat16>()) : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        const float gi = (gf ? gf[i] : bf16_to_f32(gh[i])) * fclip;
        const float mi = m[i] * h.b1 + gi * h.omb1;
        const float vi = v[i] * h.b2 + (gi * gi) * h.omb2;
        float wi = w[i] * h.decay;
        const float denom = std::sqrt(vi) * h.inv_bc2_sqrt + h.eps;
        wi = wi - (mi / denom) * h.step_size;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi;
        if (pbf) pbf[i] = f32_to_bf16(wi);
      }
    }
  });
}

#if LT_AVX512
// Sum of squares of one full chunk of K elements, read as kStreams interleaved sub-streams with two
// accumulators each, prefetching kAheadBytes ahead of each into L2. This pass is bound by how many
// cache-line misses one core keeps in flight. Measured on two machines (2 cores each, 51.4M fp32
// gradients): on an AMD EPYC 9004, two sub-streams with 4 KiB L2 prefetches were 0-7% faster than
// four without; on the Intel Xeon (AMX) these sessions have run on since 2026-12-01, four sub-streams
// with 8 KiB L2 prefetches read 25.5 GB/s against 22.1 for two with 4 KiB (8.06 vs 9.31 ms; ten
// variants, medians of 9, a scratch microbenchmark). In scripts/bench_optim.py on the Intel machine
// the clipped step's norm pass went 9.6 -> 9.1 ms with four sub-streams and 8.5 ms with the
// backward walk below (one run each, 2026-12-01: run-to-run noise is of that order).
constexpr int kStreams = 4;
constexpr int64_t kAheadBytes = 8192;
template <typename G, int64_t K>
inline float chunk_sq_sum(const G* g) {
  constexpr int64_t kPart = K / kStreams;
  constexpr int64_t kAhead = kAheadBytes / sizeof(G);
  __m512 a[kStreams], b[kStreams];
  for (int s = 0; s < kStreams; ++s) a[s] = b[s] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kPart; i += 32) {
    for (int s = 0; s < kStreams; ++s) {
      const G* p = g + s * kPart + i;
      // every 64-byte line once: 32 elements are two lines of fp32, one of bf16
      for (int64_t l = 0; l < 32 * static_cast<int64_t>(sizeof(G)); l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + kAhead) + l, _MM_HINT_T1);
      const __m512 x0 = load_grad(p, 0xFFFF), x1 = load_grad(p + 16, 0xFFFF);
      a[s] = _mm512_fmadd_ps(x0, x0, a[s]);
      b[s] = _mm512_fmadd_ps(x1, x1, b[s]);
    }
  }
  __m512 t = _mm512_setzero_ps();
  for (int s = 0; s < kStreams; ++s) t = _mm512_add_ps(t, _mm512_add_ps(a[s], b[s]));
  return _mm512_reduce_add_ps(t);
}

// A chunk's tail (or a short tensor): one masked stream.
template <typename G>
inline float tail_sq_sum(const G* g, int64_t n) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 x = load_grad(g + i, tail_mask(n - i));
    a = _mm512_fmadd_ps(x, x, a);
  }
  return _mm512_reduce_add_ps(a);
}
#endif

// Sum of squares of all grads in fp32 per 16K-element chunk, chunks summed in double: the result does
// not depend on the number of threads.
at::Tensor grad_sq_sum(const std::vector<at::Tensor>& grads) {
  constexpr int64_t kChunk = 1 << 14;
  std::vector<int64_t> first(grads.size() + 1, 0);
  for (size_t i = 0; i < grads.size(); ++i)
    first[i + 1] = first[i] + (grads[i].numel() + kChunk - 1) / kChunk;
  const int64_t nchunks = first.back();
  std::vector<double> part(nchunks, 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    // Each thread walks its range backwards: it ends on the range's first chunks, where the same
    // thread's update pass (the same halves of memory) starts, so those are still in its cache.
    // (Each chunk's sum is the same either way.)
    size_t ti = std::upper_bound(first.begin(), first.end(), end - 1) - first.begin() - 1;
    for (int64_t c = end - 1; c >= begin; --c) {
      while (c < first[ti]) --ti;
      const int64_t off = (c - first[ti]) * kChunk;
      const int64_t n = std::min(kChunk, grads[ti].numel() - off);
      const bool bf = grads[ti].scalar_type() == at::kBFloat16;
      float acc = 0.0f;
#if LT_AVX512
      if (bf) {
        const uint16_t* g = reinterpret_cast<const uint16_t*>(grads[ti].data_ptr<at::BFloat16>()) + off;
        acc = n == kChunk ? chunk_sq_sum<uint16_t, kChunk>(g) : tail_sq_sum(g, n);
      } else {
        const float* g = grads[ti].data_ptr<float>() + off;
        acc = n == kChunk ? chunk_sq_sum<float, kChunk>(g) : tail_sq_sum(g, n);
      }
#else
      // Without SIMD: 16 partial sums, like the vector path's lanes (one running fp32 sum over a
      // whole chunk loses ~1e-5 relative accuracy).
      float lanes[16] = {0.0f};
      if (bf) {
        const uint16_t* g = reinterpret_cast<const uint16_t*>(grads[ti].data_ptr<at::BFloat16>()) + off;
        for (int64_t i = 0; i < n; ++i) { const float x = bf16_to_f32(g[i]); lanes[i & 15] += x * x; }
      } else {
        const float* g = grads[ti].data_ptr<float>() + off;
        for (int64_t i = 0; i < n; ++i) lanes[i & 15] += g[i] * g[i];
      }
      for (float l : lanes) acc += l;
#endif
      part[c] = acc;
    }
  });
  double total = 0.0;
  for (double p : part) total += p;
  return at::scalar_tensor(static_cast<float>(total), at::kFloat);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute entry points release the GIL (as torch's own ops do; the arguments are converted
  // before and the result after, with it held): the streaming executor calls them on its optimizer
  // thread, and holding it would stall the thread that launches the device's kernels for a whole
  // layer's update (~6 ms per 12.6M-param block).
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("adam8bit_step", &adam8bit_step, "fused blockwise 8-bit AdamW step over a list of tensors", nogil);
  m.def("adam32_step", &adam32_step, "fp32-state AdamW step over a list of small tensors", nogil);
  m.def("grad_sq_sum", &grad_sq_sum, "fp32 sum of squared gradients (deterministic chunking)", nogil);
  m.def("has_avx512", &has_avx512, "whether the AVX-512 kernels were compiled in");
  m.def("set_prefetch", &set_prefetch, "software prefetch distance of the VBMI kernel, in elements (0: off)");
  m.def("has_vbmi", &has_vbmi, "whether the AVX-512 VBMI kernel (byte-table dequantisation) was compiled in");
}
