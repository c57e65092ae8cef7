// Decode attention straight over a quantised pool's codes (confkv/kv/kernel.py builds and calls this).
//
// One work item is one (sequence, KV head): its GQA group of queries reads the sequence's blocks through the block
// table, every valid key row is dequantised on the fly into a small float buffer (never the whole gathered tensor),
// scored against the group's queries, the scores go through a softmax, and every valid value row is dequantised the
// same way and accumulated with its probability. Masked slots (a block's unfilled tail, padding blocks, keys outside
// a sliding window) are never read. Scales are folded where they are constant along the sum: an int8/fp8 key's scale
// multiplies its score, a value's scale its probability; int4 keys' per-channel grids are folded into the query once
// per block (q*s and the q.lo term), as are fp8 keys' block means (the q.mean term), int4 values' zero points are
// accumulated per group and added at the end.
//
// Row layouts (confkv/kv/quant.py; keys coded a block at a time: confkv/kv/block_keys.py):
//   int8 (keys and values), fp8 values: [D code bytes | float16 scale]; fp8 codes are e4m3fn.
//   fp8 keys: [D e4m3fn code bytes | float16 scale | ceil(D/bs) bytes], the block's mean (e4m3fn[D], per KV head)
//     spread over its bs rows in order (zeros after the D bytes).
//   int4 values: D/G groups of [G/2 bytes, two codes each, first in the low nibble | f16 scale | f16 zero point],
//     G = min(32, D).
//   int4 keys (per channel within a block): [D/2 bytes of codes | K/2 bytes | ceil((4D+K)/bs) bytes], the block's
//     grid (f16 scale[D] then f16 zero point[D], then its K outlier channels' indices, a byte each, per KV head)
//     spread over its bs rows in order (zeros after). An outlier channel's code among the D is the high nibble of
//     its 8-bit code and its scale 16 of its steps; the low nibbles are the K/2 bytes, in the indices' order, the
//     first in the low nibble; their term (q*s/16) . low is added to the score.
// int4 codes are read de-interleaved (the low nibbles of a run of bytes are the even channels, the high ones the odd
// channels), so the query (keys) and the accumulator (values) are kept in that order and re-interleaved at the end.
//
// Float window (confkv/kv/window.py): where a (sequence, block) has an exact float32 copy in the window's arena
// (arena[i, jb] >= 0), every valid row of that block is read from the copy instead of the codes, exactly the rows the
// torch path overwrites (FloatWindow.read_into with whole blocks): keys against the query in channel order, values
// into their own channel-order accumulator, added to the codes' one at the end.
#include <ATen/Parallel.h>
#include <algorithm>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define CONFKV_AVX2 1
#else
#define CONFKV_AVX2 0
#endif

namespace {

enum Format : int64_t { INT8 = 0, FP8 = 1, INT4 = 2 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// e4m3fn byte -> float16 bits of its value times 2^-8: the byte sign-extended to 16 bits, shifted up 7, the copy of
// the sign on bit 14 cleared (quant.py's e4m3_as_half, bit for bit).
inline uint16_t e4m3_half_bits(uint8_t code) {
  int16_t b = static_cast<int16_t>(static_cast<int8_t>(code));
  b = static_cast<int16_t>(b << 7);
  return static_cast<uint16_t>(b) & 0xBF80u;
}

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = c10::detail::fp16_ieee_to_fp32_value(e4m3_half_bits(uint8_t(i)));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// Codes of an int8/fp8 row -> D floats (fp8: times 2^-8, the 2^8 lives in the scale).
inline void codes8(const uint8_t* row, float* out, int64_t d, bool fp8) {
  int64_t c = 0;
#if CONFKV_AVX2
  for (; c + 8 <= d; c += 8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
    if (fp8) {
      __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(b), 7);
      w = _mm_and_si128(w, _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
      _mm256_storeu_ps(out + c, _mm256_cvtph_ps(w));
    } else {
      _mm256_storeu_ps(out + c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
  }
#endif
  if (fp8) {
    const float* t = fp8_table().v;
    for (; c < d; ++c) out[c] = t[row[c]];
  } else {
    for (; c < d; ++c) out[c] = static_cast<float>(static_cast<int8_t>(row[c]));
  }
}

// n packed bytes -> low nibbles to even[0..n), high nibbles to odd[0..n).
inline void nibbles(const uint8_t* p, int64_t n, float* even, float* odd) {
  int64_t c = 0;
#if CONFKV_AVX2
  const __m256i lo = _mm256_set1_epi32(0x0F);
  for (; c + 8 <= n; c += 8) {
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
    _mm256_storeu_ps(even + c, _mm256_cvtepi32_ps(_mm256_and_si256(w, lo)));
    _mm256_storeu_ps(odd + c, _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)));
  }
#endif
  for (; c < n; ++c) {
    even[c] = static_cast<float>(p[c] & 0x0F);
    odd[c] = static_cast<float>(p[c] >> 4);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t c = 0;
  float s = 0.f;
#if CONFKV_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; c + 16 <= n; c += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), acc1);
  }
  for (; c + 8 <= n; c += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc0);
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// y += w * x
inline void axpy(float w, const float* x, float* y, int64_t n) {
  int64_t c = 0;
#if CONFKV_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(y + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
#endif
  for (; c < n; ++c) y[c] += w * x[c];
}

#if CONFKV_AVX2
// e^x for x <= 0 (Cephes' single-precision polynomial; about 1 ulp); below -87 (and -inf) it is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}
#endif

// p[i] = e^(p[i] - m) in place; returns their sum.
inline float exp_shifted(float* p, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if CONFKV_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    sum += p[i];
  }
  return sum;
}

}  // namespace

// k, v: one layer of the pool, [slots, kvh, k_row] and [slots, kvh, v_row] bytes; blocks [n, mb] int64;
// valid [n, mb * bs] bool; q [n, kvh, g, D] float32 (contiguous); the float window's arena of this layer, wk and
// wv [arena_rows, kvh, D] float32, with arena [n, mb] int64 (each gathered block's arena block, -1: its codes), or
// an empty arena where the pool has no window. Returns the output [n, kvh, g, D] float32 and each query's
// log-sum-exp of its scaled scores [n, kvh, g] float32 (-inf where it has no key), what a recall scores host blocks
// against.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& k, const at::Tensor& v, const at::Tensor& blocks,
                            const at::Tensor& valid, const at::Tensor& q, double scaling, int64_t format,
                            int64_t block_size, int64_t outliers, const at::Tensor& wk, const at::Tensor& wv,
                            const at::Tensor& arena) {
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && blocks.is_contiguous() && valid.is_contiguous() &&
                  q.is_contiguous(),
              "decode kernel: inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && blocks.scalar_type() == at::kLong &&
                  valid.scalar_type() == at::kBool && k.scalar_type() == at::kByte,
              "decode kernel: unexpected dtypes");
  const int64_t n = q.size(0), kvh = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t mb = blocks.size(1), bs = block_size, k_row = k.size(2), v_row = v.size(2);
  const int64_t slots = k.size(0);
  TORCH_CHECK(valid.size(1) == mb * bs && k.size(1) == kvh && v.size(1) == kvh, "decode kernel: shapes disagree");
  const int64_t grp = d < 32 ? d : 32;  // int4 values' group
  const int64_t ko = outliers;  // int4 keys' outlier channels per block
  const int64_t ngrp = d / grp, grp_bytes = grp / 2 + 4, share = (4 * d + ko + bs - 1) / bs;
  const int64_t mean_share = (d + bs - 1) / bs;
  if (format == INT4) {
    TORCH_CHECK(d % 2 == 0 && d % grp == 0 && v_row == ngrp * grp_bytes && k_row == d / 2 + ko / 2 + share &&
                    (4 * d) % bs == 0 && ko % 2 == 0 && ko >= 0 && ko <= d && d <= 256,
                "decode kernel: not the int4 pool layout");
  } else if (format == FP8) {
    TORCH_CHECK(k_row == d + 2 + mean_share && v_row == d + 2,
                "decode kernel: not the fp8 pool layout");
  } else {
    TORCH_CHECK(k_row == d + 2 && v_row == d + 2, "decode kernel: not an int8 pool layout");
  }
  TORCH_CHECK(format == INT4 || ko == 0, "decode kernel: outlier channels are an int4 keys' layout");
  const bool fp8 = format == FP8;
  // fp8 codes come out as their value times 2^-8 (e4m3_half_bits), so their scales carry the 2^8
  const float code_unit = fp8 ? 256.0f : 1.0f;
  if (fp8) fp8_table();  // built once, before the threads read it
  auto out = at::empty({n, kvh, g, d}, q.options());
  auto lse = at::empty({n, kvh, g}, q.options());
  const uint8_t* kp = k.data_ptr<uint8_t>();
  const uint8_t* vp = v.data_ptr<uint8_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const bool* okp = valid.data_ptr<bool>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t keys = mb * bs;
  for (int64_t i = 0; i < n * mb; ++i) {
    TORCH_CHECK(bp[i] >= 0 && (bp[i] + 1) * bs <= slots, "decode kernel: block id out of the pool");
  }
  const bool windowed = arena.numel() > 0;
  const int64_t* ap = nullptr;
  const float* wkp = nullptr;
  const float* wvp = nullptr;
  if (windowed) {
    TORCH_CHECK(arena.is_contiguous() && arena.scalar_type() == at::kLong && arena.size(0) == n &&
                    arena.size(1) == mb,
                "decode kernel: the window's arena index must be [n, max_blocks] int64");
    TORCH_CHECK(wk.is_contiguous() && wv.is_contiguous() && wk.scalar_type() == at::kFloat &&
                    wv.scalar_type() == at::kFloat && wk.dim() == 3 && wk.sizes() == wv.sizes() &&
                    wk.size(1) == kvh && wk.size(2) == d,
                "decode kernel: the window's arena must be float32 [rows, kv_heads, head_dim]");
    ap = arena.data_ptr<int64_t>();
    wkp = wk.data_ptr<float>();
    wvp = wv.data_ptr<float>();
    const int64_t arena_rows = wk.size(0);
    for (int64_t i = 0; i < n * mb; ++i) {
      TORCH_CHECK(ap[i] < 0 || (ap[i] + 1) * bs <= arena_rows, "decode kernel: arena block out of the window");
    }
  }

  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * keys), qs(g * d), acc(g * d), row(d + ko), grid(2 * d), bias(g), lo_acc(g * ngrp);
    std::vector<float> inv(g);
    // the window's rows, in channel order: the scaled query (int4's qs is de-interleaved) and the values' sum
    std::vector<float> qn(windowed ? g * d : 0), wacc(windowed ? g * d : 0);
    std::vector<uint8_t> grid_bytes(std::max(bs * share, bs * mean_share));
    // int4 keys: each query times the block's scales [de-interleaved codes | outliers' low nibbles, even | odd], so
    // that a row's score is one dot over its D + K nibbles
    std::vector<float> qk(format == INT4 ? g * (d + ko) : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kvh, h = item % kvh;
      const float* qi = qp + item * g * d;
      const bool* ok = okp + i * keys;
      const int64_t* bi = bp + i * mb;
      // the queries, scaled; for int4 de-interleaved (even channels, then odd)
      for (int64_t j = 0; j < g; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          const int64_t to = format == INT4 ? (c % 2 ? d / 2 + c / 2 : c / 2) : c;
          qs[j * d + to] = qi[j * d + c] * static_cast<float>(scaling);
          if (windowed) qn[j * d + c] = qi[j * d + c] * static_cast<float>(scaling);
        }
      }
      const int64_t* ai = windowed ? ap + i * mb : nullptr;
      // keys: scores [g, keys], -inf where masked
      std::fill(scores.begin(), scores.end(), -std::numeric_limits<float>::infinity());
      for (int64_t jb = 0; jb < mb; ++jb) {
        const bool* okb = ok + jb * bs;
        bool any = false;
        for (int64_t t = 0; t < bs; ++t) any |= okb[t];
        if (!any) continue;
        if (windowed && ai[jb] >= 0) {  // the block's exact copy
          const int64_t wbase = ai[jb] * bs;
          for (int64_t t = 0; t < bs; ++t) {
            if (!okb[t]) continue;
            const float* r = wkp + ((wbase + t) * kvh + h) * d;
            for (int64_t j = 0; j < g; ++j) scores[j * keys + jb * bs + t] = dot(qn.data() + j * d, r, d);
          }
          continue;
        }
        const int64_t base = bi[jb] * bs;
        if (format == INT4) {
          // the block's grid for this head, gathered from its rows; folded into the query: (q*s) . n + q . lo
          for (int64_t t = 0; t < bs; ++t) {
            std::memcpy(grid_bytes.data() + t * share, kp + ((base + t) * kvh + h) * k_row + d / 2 + ko / 2, share);
          }
          for (int64_t c = 0; c < 2 * d; ++c) grid[c] = half_at(grid_bytes.data() + 2 * c);
          for (int64_t j = 0; j < g; ++j) {
            float b = 0.f;
            float* qsj = qk.data() + j * (d + ko);  // q * s for this block, de-interleaved like the codes
            for (int64_t c = 0; c < d; ++c) {
              const int64_t to = c % 2 ? d / 2 + c / 2 : c / 2;
              qsj[to] = qs[j * d + to] * grid[c];
              b += qs[j * d + to] * grid[d + c];
            }
            bias[j] = b;
            for (int64_t m = 0; m < ko; ++m) {
              const int64_t c = std::min<int64_t>(grid_bytes[4 * d + m], d - 1);  // a corrupt index reads in bounds
              const int64_t to = c % 2 ? d / 2 + c / 2 : c / 2;
              qsj[d + (m % 2 ? ko / 2 + m / 2 : m / 2)] = qs[j * d + to] * grid[c] * 0.0625f;
            }
          }
          for (int64_t t = 0; t < bs; ++t) {
            if (!okb[t]) continue;
            const uint8_t* r = kp + ((base + t) * kvh + h) * k_row;
            nibbles(r, d / 2, row.data(), row.data() + d / 2);
            if (ko) nibbles(r + d / 2, ko / 2, row.data() + d, row.data() + d + ko / 2);
            for (int64_t j = 0; j < g; ++j) {
              scores[j * keys + jb * bs + t] = dot(qk.data() + j * (d + ko), row.data(), d + ko) + bias[j];
            }
          }
        } else {
          if (fp8) {  // the block's mean key, gathered from its rows; its score term q . mean once per query
            for (int64_t t = 0; t < bs; ++t) {
              std::memcpy(grid_bytes.data() + t * mean_share, kp + ((base + t) * kvh + h) * k_row + d + 2, mean_share);
            }
            const float* t8 = fp8_table().v;  // e4m3 values times 2^-8
            for (int64_t c = 0; c < d; ++c) grid[c] = t8[grid_bytes[c]] * 256.0f;
            for (int64_t j = 0; j < g; ++j) bias[j] = dot(qs.data() + j * d, grid.data(), d);
          }
          for (int64_t t = 0; t < bs; ++t) {
            if (!okb[t]) continue;
            const uint8_t* r = kp + ((base + t) * kvh + h) * k_row;
            codes8(r, row.data(), d, fp8);
            const float s = half_at(r + d) * code_unit;
            for (int64_t j = 0; j < g; ++j) {
              scores[j * keys + jb * bs + t] = dot(qs.data() + j * d, row.data(), d) * s + (fp8 ? bias[j] : 0.f);
            }
          }
        }
      }
      // softmax: probabilities left unnormalised in scores, 1/sum applied to the output
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * keys;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < keys; ++t) m = sj[t] > m ? sj[t] : m;
        if (m == -std::numeric_limits<float>::infinity()) {  // no key at all: zeros, not NaN
          std::fill(sj, sj + keys, 0.f);
          inv[j] = 0.f;
          lp[item * g + j] = m;
          continue;
        }
        const float sum = exp_shifted(sj, keys, m);
        inv[j] = 1.0f / sum;
        lp[item * g + j] = m + std::log(sum);
      }
      // values
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(lo_acc.begin(), lo_acc.end(), 0.f);
      std::fill(wacc.begin(), wacc.end(), 0.f);
      for (int64_t jb = 0; jb < mb; ++jb) {
        const bool* okb = ok + jb * bs;
        if (windowed && ai[jb] >= 0) {  // the block's exact copy
          const int64_t wbase = ai[jb] * bs;
          for (int64_t t = 0; t < bs; ++t) {
            if (!okb[t]) continue;
            const float* r = wvp + ((wbase + t) * kvh + h) * d;
            for (int64_t j = 0; j < g; ++j) axpy(scores[j * keys + jb * bs + t], r, wacc.data() + j * d, d);
          }
          continue;
        }
        const int64_t base = bi[jb] * bs;
        for (int64_t t = 0; t < bs; ++t) {
          if (!okb[t]) continue;
          const uint8_t* r = vp + ((base + t) * kvh + h) * v_row;
          const int64_t slot = jb * bs + t;
          if (format == INT4) {
            for (int64_t gi = 0; gi < ngrp; ++gi) {
              const uint8_t* gr = r + gi * grp_bytes;
              float* rg = row.data() + gi * grp;
              nibbles(gr, grp / 2, rg, rg + grp / 2);
              const float s = half_at(gr + grp / 2), z = half_at(gr + grp / 2 + 2);
              for (int64_t j = 0; j < g; ++j) {
                const float p = scores[j * keys + slot];
                axpy(p * s, rg, acc.data() + j * d + gi * grp, grp);
                lo_acc[j * ngrp + gi] += p * z;
              }
            }
          } else {
            codes8(r, row.data(), d, fp8);
            const float s = half_at(r + d) * code_unit;
            for (int64_t j = 0; j < g; ++j) axpy(scores[j * keys + slot] * s, row.data(), acc.data() + j * d, d);
          }
        }
      }
      float* oi = op + item * g * d;
      for (int64_t j = 0; j < g; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          if (format == INT4) {  // group gi's codes are [even | odd] within the group
            const int64_t gi = c / grp, w = c % grp;
            const int64_t from = gi * grp + (w % 2 ? grp / 2 + w / 2 : w / 2);
            oi[j * d + c] = (acc[j * d + from] + lo_acc[j * ngrp + gi] + (windowed ? wacc[j * d + c] : 0.f)) * inv[j];
          } else {
            oi[j * d + c] = (acc[j * d + c] + (windowed ? wacc[j * d + c] : 0.f)) * inv[j];
          }
        }
      }
    }
  });
  return {out, lse};
}

// Whether this build took the AVX2/F16C/FMA loops (else plain C++ loops): reported by the Python side.
bool vectorised() { return CONFKV_AVX2; }
