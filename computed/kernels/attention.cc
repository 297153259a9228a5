// Decode attention over the KV cache in place, an XLA FFI custom call for the CPU.
//
// One query token per row. First this step's K and V of row b are written at position len[b] - 1 of
// the caches (which the results alias: updated in place), then
// out[b, h, g] = softmax(scale * q[b, h, g] . K[b, h, :, :len[b]]) V[b, h, :len[b]]
// for KV head h and its g query heads (grouped-query attention). Each row reads only its own
// len[b] positions of the cache, straight from the cache's buffer: no bucket of positions is
// sliced out (XLA copies every slice), and a short row costs what it holds, not what the longest
// row holds. Rows with len[b] <= 0 (inactive) get zeros. Work items (row, KV head) go to XLA's
// intra-op threads (parallel.h).
//
// Operands: q f32 [rows, kv, g, d]; the whole caches, K f32 [layers, rows, kv, d, max_len]
// (positions minor) and V f32 [layers, rows, kv, max_len, d]; len s32 [rows]; this step's K and V,
// f32 [rows, kv, d]. Results: f32 [rows, kv, g, d], then the caches. Attributes: layer, scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kHeads = 4;  // query heads whose scores share each load of K

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Attention {
  const float *q, *k_new, *v_new;
  float *k, *v;  // the caches, updated in place (the results alias the operands)
  const int32_t* len;
  float* out;
  int64_t rows, kv, g, d, max_len, layer;
  float scale;

  void run(int64_t item) const {
    const int64_t b = item / kv, h = item % kv;
    const float* qh = q + (b * kv + h) * g * d;
    float* oh = out + (b * kv + h) * g * d;
    const int64_t n = std::min<int64_t>(len[b], max_len);
    if (n <= 0) {
      std::memset(oh, 0, sizeof(float) * g * d);
      return;
    }
    float* kh = k + ((layer * rows + b) * kv + h) * d * max_len;  // [d, max_len]
    float* vh = v + ((layer * rows + b) * kv + h) * max_len * d;  // [max_len, d]
    // this step's K and V go to position n - 1 of the row, then the row attends to [0, n)
    const float* kn = k_new + (b * kv + h) * d;
    for (int64_t e = 0; e < d; ++e) kh[e * max_len + n - 1] = kn[e];
    std::memcpy(vh + (n - 1) * d, v_new + (b * kv + h) * d, sizeof(float) * d);
    // scores, sixteen positions (a cache line of K's row) at a time: K's rows are
    // positions-contiguous, each load of K serves every query head of the group, and the sums stay
    // in registers over d
    const int64_t padded = (n + 15) / 16 * 16;
    thread_local std::vector<float> s, inv;  // scratch, reused across items and calls
    s.assign(static_cast<size_t>(g * padded), 0.f);
    const int64_t blocks_end = padded <= max_len ? padded : n - n % 16;  // never read past the row
    int64_t l = 0;
    for (; l < blocks_end; l += 16) {
      for (int64_t j0 = 0; j0 < g; j0 += kHeads) {
        const int64_t m = std::min<int64_t>(kHeads, g - j0);
        v8 lo[kHeads] = {}, hi[kHeads] = {};
        for (int64_t e = 0; e < d; ++e) {
          const float* ke = kh + e * max_len + l;
          const v8 k0 = load8(ke), k1 = load8(ke + 8);
          for (int64_t j = 0; j < m; ++j) {
            const float qe = qh[(j0 + j) * d + e];
            lo[j] += qe * k0;
            hi[j] += qe * k1;
          }
        }
        for (int64_t j = 0; j < m; ++j) {
          std::memcpy(s.data() + (j0 + j) * padded + l, &lo[j], sizeof(v8));
          std::memcpy(s.data() + (j0 + j) * padded + l + 8, &hi[j], sizeof(v8));
        }
      }
    }
    for (; l < n; ++l)
      for (int64_t j = 0; j < g; ++j) {
        float acc = 0.f;
        for (int64_t e = 0; e < d; ++e) acc += qh[j * d + e] * kh[e * max_len + l];
        s[j * padded + l] = acc;
      }
    // softmax in float32, then the weighted sum of V's rows
    inv.resize(static_cast<size_t>(g));
    for (int64_t j = 0; j < g; ++j) {
      float* sj = s.data() + j * padded;
      float m = -INFINITY;
      for (int64_t l = 0; l < n; ++l) m = std::max(m, sj[l] * scale);
      float sum = 0.f;
      for (int64_t l = 0; l < n; ++l) {
        sj[l] = std::exp(sj[l] * scale - m);
        sum += sj[l];
      }
      inv[j] = 1.f / sum;
    }
    std::fill(oh, oh + g * d, 0.f);
    for (l = 0; l < n; ++l) {
      const float* vl = vh + l * d;
      for (int64_t j = 0; j < g; ++j) {
        const float p = s[j * padded + l];
        float* oj = oh + j * d;
        for (int64_t e = 0; e < d; ++e) oj[e] += p * vl[e];
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int64_t e = 0; e < d; ++e) oh[j * d + e] *= inv[j];
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_in,
                           ffi::Buffer<ffi::F32> v_in, ffi::Buffer<ffi::S32> len, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> k, ffi::Result<ffi::Buffer<ffi::F32>> v, int64_t layer,
                           float scale) {
  const auto qd = q.dimensions(), kd = k_in.dimensions(), vd = v_in.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5)
    return ffi::Error::InvalidArgument("attention: q [rows, kv, g, d], K [layers, rows, kv, d, max_len], "
                                       "V [layers, rows, kv, max_len, d]");
  const int64_t rows = qd[0], kv = qd[1], g = qd[2], d = qd[3], max_len = kd[4];
  if (kd[1] != rows || kd[2] != kv || kd[3] != d || vd[0] != kd[0] || vd[1] != rows || vd[2] != kv ||
      vd[3] != max_len || vd[4] != d || len.element_count() != static_cast<size_t>(rows) ||
      out->element_count() != q.element_count() || k_new.element_count() != static_cast<size_t>(rows * kv * d) ||
      v_new.element_count() != static_cast<size_t>(rows * kv * d) ||
      k->element_count() != k_in.element_count() || v->element_count() != v_in.element_count())
    return ffi::Error::InvalidArgument("attention: q, K, V, len, the new K and V and the results disagree in shape");
  if (layer < 0 || layer >= kd[0]) return ffi::Error::InvalidArgument("attention: layer out of range");
  // The caches' results alias their operands (input_output_aliases): XLA hands the same buffers.
  if (k->typed_data() != k_in.typed_data())
    std::memcpy(k->typed_data(), k_in.typed_data(), sizeof(float) * k_in.element_count());
  if (v->typed_data() != v_in.typed_data())
    std::memcpy(v->typed_data(), v_in.typed_data(), sizeof(float) * v_in.element_count());
  auto call = std::make_shared<Attention>(Attention{q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                                                    k->typed_data(), v->typed_data(), len.typed_data(),
                                                    out->typed_data(), rows, kv, g, d, max_len, layer, scale});
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
                                  .Attr<float>("scale"));
