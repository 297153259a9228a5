// Decode attention over the KV cache in place, an XLA FFI custom call for the CPU.
//
// One query token per row. First this step's K and V of row b are written at position len[b] - 1 of
// the caches (which the results alias: updated in place), then
// out[b, h, g] = softmax(cap(scale * q[b, h, g] . K[b, h, :, s:len[b]])) V[b, h, s:len[b]]
// for KV head h and its g query heads (grouped-query attention), from s = max(0, len[b] - window)
// with a sliding window (else 0), and cap(x) = softcap * tanh(x / softcap) with a softcap (else x):
// transformers' eager attention (computed/model/attention.py). Each row reads only its own
// positions [s, len[b]) of the cache, straight from the cache's buffer: no bucket of positions is
// sliced out (XLA copies every slice), a short row costs what it holds, not what the longest row
// holds, and a long row with a window what the window holds (blocks before s's are never read).
// Rows with len[b] <= 0 (inactive) get zeros. Work items (row, KV head) go to XLA's intra-op
// threads (parallel.h). Within an item, K streams block by block (each block's 16
// positions of every dimension lie together), the softmax's exp is vectorised, and V's rows
// stream once per pair of query heads into sums held in registers (docs/kernels.md).
//
// Operands: q f32 [rows, kv, g, d]; the whole caches, K f32 [layers, rows, kv, blocks, d, 16]
// (positions in blocks of 16, minor within a block; blocks * 16 >= max_len) and V f32
// [layers, rows, kv, max_len, d]; len s32 [rows]; this step's K and V,
// f32 [rows, kv, d]. Results: f32 [rows, kv, g, d], then the caches. Attributes: layer, scale,
// window (0: none) and softcap (0: none).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;  // positions per block of K (computed/model.py, KV_BLOCK)
constexpr int64_t kHeads = 4;   // query heads whose scores share each load of K

using loraplane::fmadd;
using loraplane::kLanes;
using loraplane::load;
using loraplane::v16;
using loraplane::Vec;
typedef int32_t v16i __attribute__((vector_size(64)));

// e^x for 16 lanes, to about 1 ulp: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so
// n ln 2 is exact enough), e^r by its Taylor series to r^7 (the next term is below 1e-8 of the
// result), times 2^n built in the exponent bits. x is clamped to [-87, 88]: e^-87 is ~1.6e-38, the
// smallest normal float, and a softmax weight that small adds nothing to a float32 sum.
inline v16 exp16(v16 x) {
  const v16 lo = x < -87.f ? v16{} - 87.f : x;
  x = lo > 88.f ? v16{} + 88.f : lo;
  const v16 biased = x * 1.44269504088896341f + 128.5f;  // > 0: truncation is floor
  const v16i n = __builtin_convertvector(biased, v16i) - 128;
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  v16 p = r * (1.f / 5040) + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh for 16 lanes, within about 2e-7 of float32's: x (1 + x^2 P(x^2)) by its Taylor series to x^11
// where |x| < 0.3 (the next term is below 3e-9 of the result), else 1 - 2 / (e^2x + 1), which there
// loses no more than a few ulp to cancellation; exp16's clamp makes it +-1 far out.
inline v16 tanh16(v16 x) {
  const v16 x2 = x * x;
  v16 p = x2 * (-1382.f / 155925) + 62.f / 2835;
  p = p * x2 - 17.f / 315;
  p = p * x2 + 2.f / 15;
  p = p * x2 - 1.f / 3;
  const v16 small = x + x * (x2 * p);
  const v16 large = 1.f - 2.f / (exp16(x + x) + 1.f);
  const v16 ax = x < 0.f ? -x : x;
  return ax < 0.3f ? small : large;
}

struct Attention {
  const float *q, *k_new, *v_new;
  float *k, *v;  // the caches, updated in place (the results alias the operands)
  const int32_t* len;
  float* out;
  int64_t rows, kv, g, d, max_len, blocks, layer;
  float scale;
  int64_t window;  // positions each row attends, its own last one counted (0: all of them)
  float softcap;   // scores become softcap * tanh(scores / softcap) (0: as they are)

  void run(int64_t item) const {
    const int64_t b = item / kv, h = item % kv;
    const float* qh = q + (b * kv + h) * g * d;
    float* oh = out + (b * kv + h) * g * d;
    const int64_t n = std::min<int64_t>(len[b], max_len);
    if (n <= 0) {
      std::memset(oh, 0, sizeof(float) * g * d);
      return;
    }
    float* kh = k + ((layer * rows + b) * kv + h) * blocks * d * kBlock;  // [blocks, d, 16]
    float* vh = v + ((layer * rows + b) * kv + h) * max_len * d;          // [max_len, d]
    // this step's K and V go to position n - 1 of the row (K's into one block), then the row
    // attends to [0, n)
    const float* kn = k_new + (b * kv + h) * d;
    float* kw = kh + (n - 1) / kBlock * d * kBlock + (n - 1) % kBlock;
    for (int64_t e = 0; e < d; ++e) kw[e * kBlock] = kn[e];
    std::memcpy(vh + (n - 1) * d, v_new + (b * kv + h) * d, sizeof(float) * d);
    // the row attends [start, n): with a window its last `window` positions, whose first block
    // begins at `base`; s holds the scores of positions [base, padded) (`span` of them)
    const int64_t start = window > 0 && n > window ? n - window : 0, base = start / kBlock * kBlock;
    // scores, a block of 16 positions at a time: the block's d rows of 16 lie together (4 KB at
    // d = 64), each load serves up to four query heads, and the sums stay in registers. Every
    // block is whole in the cache (max_len rounds up to blocks); positions before start (in its
    // block) and from n on get scores here that the softmax drops.
    const int64_t padded = (n + kBlock - 1) / kBlock * kBlock, span = padded - base;
    thread_local std::vector<float> s, inv;  // scratch, reused across items and calls
    s.resize(static_cast<size_t>(g * span));
    for (int64_t l = base; l < padded; l += kBlock) {
      const float* kb = kh + l / kBlock * d * kBlock;
      for (int64_t j0 = 0; j0 < g; j0 += kHeads) {
        const int64_t m = std::min<int64_t>(kHeads, g - j0);
        v16 acc[kHeads] = {};
        for (int64_t e = 0; e < d; ++e) {
          const v16 ke = load<v16>(kb + e * kBlock);
          for (int64_t j = 0; j < m; ++j) acc[j] = fmadd(v16{} + qh[(j0 + j) * d + e], ke, acc[j]);
        }
        for (int64_t j = 0; j < m; ++j) std::memcpy(s.data() + (j0 + j) * span + l - base, &acc[j], sizeof(v16));
      }
    }
    // soft-capping, where the layer has it: the scores become softcap * tanh(scale * s / softcap), and
    // the softmax below takes them as they are (a scale of 1, exact)
    float sc = scale;
    if (softcap > 0.f) {
      const float cap = softcap, inv_cap = 1.f / softcap;
      for (int64_t i = 0; i < g * span; i += 16) {  // every head's scores, whole blocks
        v16 x;
        std::memcpy(&x, s.data() + i, sizeof x);
        x = cap * tanh16(x * scale * inv_cap);
        std::memcpy(s.data() + i, &x, sizeof x);
      }
      sc = 1.f;
    }
    // softmax in float32, then the weighted sum of V's rows; p = s + lead is position start's weight
    const int64_t lead = start - base, count = n - start;
    inv.resize(static_cast<size_t>(g));
    for (int64_t j = 0; j < g; ++j) {
      float* sj = s.data() + j * span;
      float m = -INFINITY;
      for (int64_t l = lead; l < n - base; ++l) m = std::max(m, sj[l] * sc);
      for (int64_t l = 0; l < span; l += 16) {  // s has room for whole blocks
        v16 x;
        std::memcpy(&x, sj + l, sizeof x);
        x = exp16(x * sc - m);
        std::memcpy(sj + l, &x, sizeof x);
      }
      std::fill(sj, sj + lead, 0.f);             // positions before the window weigh nothing,
      std::fill(sj + n - base, sj + span, 0.f);  // nor those past the row's length
      float sum = 0.f;
      for (int64_t l = lead; l < n - base; ++l) sum += sj[l];
      inv[j] = 1.f / sum;
    }
    const float* p = s.data() + lead;
    const float* vs = vh + start * d;  // V's row of position start
    // the weighted sum of V's rows: V's rows stream once per pair of query heads, into
    // accumulators that stay in registers (4 native vectors of dimensions at a time: 64 on AVX-512,
    // 32 on AVX2, 8 accumulators either way)
    if (d % kLanes == 0) {
      constexpr int64_t kDims = 4 * kLanes;
      for (int64_t e0 = 0; e0 < d; e0 += kDims)
        for (int64_t j0 = 0; j0 < g; j0 += 2) {
          const int heads = g - j0 >= 2 ? 2 : 1, vectors = static_cast<int>(std::min<int64_t>(4, (d - e0) / kLanes));
          const float* sj = p + j0 * span;
          float* oj = oh + j0 * d + e0;
          switch (heads * 4 + vectors - 1) {
            case 4 + 0: weighted<1, 1>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 4 + 1: weighted<1, 2>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 4 + 2: weighted<1, 3>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 4 + 3: weighted<1, 4>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 8 + 0: weighted<2, 1>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 8 + 1: weighted<2, 2>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            case 8 + 2: weighted<2, 3>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
            default: weighted<2, 4>(sj, span, vs + e0, d, count, inv.data() + j0, oj); break;
          }
        }
      return;
    }
    std::fill(oh, oh + g * d, 0.f);
    for (int64_t l = 0; l < count; ++l) {
      const float* vl = vs + l * d;
      for (int64_t j = 0; j < g; ++j) {
        const float w = p[j * span + l];
        float* oj = oh + j * d;
        for (int64_t e = 0; e < d; ++e) oj[e] += w * vl[e];
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int64_t e = 0; e < d; ++e) oh[j * d + e] *= inv[j];
  }

  // out[j][kLanes c + lane] = inv[j] * sum_l p[j][l] v[l][kLanes c + lane] for H heads (p's rows `stride`
  // apart, out's d apart) and C native vectors of dimensions; v's rows are d apart
  template <int H, int C>
  static void weighted(const float* p, int64_t stride, const float* v, int64_t d, int64_t n, const float* inv,
                       float* out) {
    Vec acc[H][C] = {};
    for (int64_t l = 0; l < n; ++l) {
      for (int c = 0; c < C; ++c) {
        const Vec vv = load<Vec>(v + l * d + kLanes * c);
        for (int j = 0; j < H; ++j) acc[j][c] = fmadd(Vec{} + p[j * stride + l], vv, acc[j][c]);
      }
    }
    for (int j = 0; j < H; ++j)
      for (int c = 0; c < C; ++c) {
        const Vec o = acc[j][c] * inv[j];
        std::memcpy(out + j * d + kLanes * c, &o, sizeof o);
      }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_in,
                           ffi::Buffer<ffi::F32> v_in, ffi::Buffer<ffi::S32> len, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> k, ffi::Result<ffi::Buffer<ffi::F32>> v, int64_t layer,
                           float scale, int64_t window, float softcap) {
  const auto qd = q.dimensions(), kd = k_in.dimensions(), vd = v_in.dimensions();
  if (qd.size() != 4 || kd.size() != 6 || vd.size() != 5)
    return ffi::Error::InvalidArgument("attention: q [rows, kv, g, d], K [layers, rows, kv, blocks, d, 16], "
                                       "V [layers, rows, kv, max_len, d]");
  const int64_t rows = qd[0], kv = qd[1], g = qd[2], d = qd[3], max_len = vd[3], blocks = kd[3];
  if (kd[1] != rows || kd[2] != kv || kd[4] != d || kd[5] != kBlock || blocks * kBlock < max_len ||
      vd[0] != kd[0] || vd[1] != rows || vd[2] != kv || vd[4] != d || len.element_count() != static_cast<size_t>(rows) ||
      out->element_count() != q.element_count() || k_new.element_count() != static_cast<size_t>(rows * kv * d) ||
      v_new.element_count() != static_cast<size_t>(rows * kv * d) ||
      k->element_count() != k_in.element_count() || v->element_count() != v_in.element_count())
    return ffi::Error::InvalidArgument("attention: q, K, V, len, the new K and V and the results disagree in shape");
  if (layer < 0 || layer >= kd[0]) return ffi::Error::InvalidArgument("attention: layer out of range");
  if (window < 0 || !(softcap >= 0.f))
    return ffi::Error::InvalidArgument("attention: window and softcap must be 0 (none) or positive");
  // The caches' results alias their operands (input_output_aliases): XLA hands the same buffers.
  if (k->typed_data() != k_in.typed_data())
    std::memcpy(k->typed_data(), k_in.typed_data(), sizeof(float) * k_in.element_count());
  if (v->typed_data() != v_in.typed_data())
    std::memcpy(v->typed_data(), v_in.typed_data(), sizeof(float) * v_in.element_count());
  auto call = std::make_shared<Attention>(Attention{q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                                                    k->typed_data(), v->typed_data(), len.typed_data(),
                                                    out->typed_data(), rows, kv, g, d, max_len, blocks, layer,
                                                    scale, window, softcap});
  loraplane::run_parallel<Attention>(pool, call, rows * kv);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraplaneDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));
