// Segmented multi-LoRA on the CPU (SGMV, after Punica and S-LoRA), an XLA FFI custom call.
//
// For the rows of x that share a slot, y = scaling[slot] * (x A[layer, slot]^T) B[layer, slot]^T,
// for up to a few modules that read the same x (q, k and v; gate and up). Rows are grouped by
// slot here, so each slot's A and B are read once per call, straight from the pool's buffers: no
// weight matrix is copied, sliced out, or gathered per token. Rows whose slot is negative (the
// base model) get zeros. A slot's work stops at its own rank (pool.rank, rounded up to 8 for the
// vector path; the pool keeps the rest zero), not at the pool's max_rank. Work items (slot,
// module, and a block of output columns when there are few slots) go to XLA's intra-op threads;
// the calling thread works too, then waits only for items another thread has taken (parallel.h).
//
// Operands: x f32 [rows, in], slots s32 [rows], scaling f32 [slots], rank s32 [slots], then an
// (A, B) pair per module, both f32 or both u16 (bfloat16 bits, widened exactly):
// A [layers, slots, max_rank, in], B [layers, slots, out, max_rank]. Results: f32 [rows, out], one
// per module. Attribute: layer. computed/kernels/__init__.py builds, loads and registers it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 bits -> float32, exact
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 load8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline float hsum(v8 v) {
  float s = 0.f;
  for (int c = 0; c < 8; ++c) s += v[c];
  return s;
}
// lane c of the result is the sum of v[c]'s lanes
inline v8 hsum8(const v8* v) {
#define LP_PAIRS(a, b) \
  (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define LP_QUADS(a, b) \
  (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
  const v8 b0 = LP_QUADS(LP_PAIRS(v[0], v[1]), LP_PAIRS(v[2], v[3]));
  const v8 b1 = LP_QUADS(LP_PAIRS(v[4], v[5]), LP_PAIRS(v[6], v[7]));
#undef LP_PAIRS
#undef LP_QUADS
  return __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

constexpr int kRowBlock = 4;     // rows that share each load of A in the shrink
constexpr int64_t kColumns = 512;  // output columns per work item, when items are few (see Sgmv)

// t[j][k] = sum_i x[rows[j]][i] * a[k][i] for k < rank; a's rows are `in` apart
template <typename T>
void shrink(const float* x, int64_t in, const int32_t* rows, int n, const T* a, int64_t rank, float* t) {
  const int64_t vec = in - in % 16;
  for (int j0 = 0; j0 < n; j0 += kRowBlock) {
    const int m = std::min(kRowBlock, n - j0);
    const float* xr[kRowBlock];
    for (int j = 0; j < m; ++j) xr[j] = x + static_cast<int64_t>(rows[j0 + j]) * in;
    for (int64_t k = 0; k < rank; ++k) {
      const T* ak = a + k * in;
      v8 acc[kRowBlock][2] = {};
      for (int64_t i = 0; i < vec; i += 16) {
        const v8 a0 = load8(ak + i), a1 = load8(ak + i + 8);
        for (int j = 0; j < m; ++j) {
          acc[j][0] += load8(xr[j] + i) * a0;
          acc[j][1] += load8(xr[j] + i + 8) * a1;
        }
      }
      for (int j = 0; j < m; ++j) {
        float s = hsum(acc[j][0] + acc[j][1]);
        for (int64_t i = vec; i < in; ++i) s += xr[j][i] * widen(ak[i]);
        t[(j0 + j) * rank + k] = s;
      }
    }
  }
}

// y[rows[j]][o] = scale * sum_k t[j][k] * b[o][k] for o in [o0, o1), k < rank; b's rows are
// `stride` apart. Eight columns at a time when rank is a multiple of 8.
template <typename T>
void expand(const float* t, int n, int64_t rank, const T* b, int64_t stride, int64_t o0, int64_t o1,
            float scale, const int32_t* rows, float* y, int64_t out) {
  int64_t o = o0;
  if (rank % 8 == 0) {
    for (; o + 8 <= o1; o += 8) {
      for (int j = 0; j < n; ++j) {
        const float* tj = t + j * rank;
        v8 p[8] = {};
        for (int64_t k = 0; k < rank; k += 8) {
          const v8 tv = load8(tj + k);
          for (int c = 0; c < 8; ++c) p[c] += load8(b + (o + c) * stride + k) * tv;
        }
        const v8 s = hsum8(p) * scale;
        std::memcpy(y + static_cast<int64_t>(rows[j]) * out + o, &s, sizeof s);
      }
    }
  }
  for (; o < o1; ++o)
    for (int j = 0; j < n; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < rank; ++k) s += t[j * rank + k] * widen(b[o * stride + k]);
      y[static_cast<int64_t>(rows[j]) * out + o] = s * scale;
    }
}

struct Module {
  const void* a;
  const void* b;
  bool bf16;
  int64_t out;
  float* y;
};

struct Item {
  int group, module;
  int64_t o0, o1;
};

struct Call {
  const float* x;
  int64_t in, max_rank, slots, layer;
  const int32_t* slot_of_row;
  const float* scaling;
  const int32_t* rank;
  std::vector<Module> modules;
  std::vector<int32_t> order;     // rows with a slot, grouped by slot
  std::vector<int> group_start;   // group g holds order[group_start[g], group_start[g + 1])
  std::vector<Item> items;

  template <typename T>
  void run(const Item& it) const {
    const int32_t* rows = order.data() + group_start[it.group];
    const int n = group_start[it.group + 1] - group_start[it.group];
    const int64_t slot = slot_of_row[rows[0]];
    const Module& m = modules[it.module];
    const int64_t used = std::min<int64_t>(rank[slot], max_rank);  // the slot's rank
    const int64_t r = max_rank % 8 == 0 ? (used + 7) / 8 * 8 : max_rank;
    const T* a = static_cast<const T*>(m.a) + (layer * slots + slot) * max_rank * in;
    const T* b = static_cast<const T*>(m.b) + (layer * slots + slot) * m.out * max_rank;
    thread_local std::vector<float> t;  // scratch, reused across items and calls
    t.resize(static_cast<size_t>(n) * std::max<int64_t>(r, 1));
    shrink(x, in, rows, n, a, r, t.data());
    expand(t.data(), n, r, b, max_rank, it.o0, it.o1, scaling[slot], rows, m.y, m.out);
  }

  void run(int64_t i) const {
    const Item& it = items[i];
    if (modules[it.module].bf16)
      run<uint16_t>(it);
    else
      run<float>(it);
  }
};

ffi::Error Sgmv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slot_of_row,
                ffi::Buffer<ffi::F32> scaling, ffi::Buffer<ffi::S32> rank, ffi::RemainingArgs pairs,
                ffi::RemainingRets outs, int64_t layer) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || slot_of_row.element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument("sgmv: x must be [rows, in] and slots [rows]");
  const int64_t n = xd[0];
  auto call = std::make_shared<Call>();
  call->x = x.typed_data();
  call->in = xd[1];
  call->slots = static_cast<int64_t>(scaling.element_count());
  call->layer = layer;
  call->slot_of_row = slot_of_row.typed_data();
  call->scaling = scaling.typed_data();
  call->rank = rank.typed_data();
  call->max_rank = -1;
  if (rank.element_count() != static_cast<size_t>(call->slots))
    return ffi::Error::InvalidArgument("sgmv: scaling and rank must both be [slots]");
  if (outs.size() == 0 || pairs.size() != 2 * outs.size())
    return ffi::Error::InvalidArgument("sgmv: one (A, B) pair per result");
  for (size_t i = 0; i < outs.size(); ++i) {
    auto a = pairs.get<ffi::AnyBuffer>(2 * i);
    auto b = pairs.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!a || !b || !y) return ffi::Error::InvalidArgument("sgmv: an operand or result could not be decoded");
    const auto ad = a->dimensions(), bd = b->dimensions(), yd = (*y)->dimensions();
    if (ad.size() != 4 || bd.size() != 4 || yd.size() != 2 || ad[0] != bd[0] || ad[1] != call->slots ||
        bd[1] != call->slots || ad[2] != bd[3] || ad[3] != call->in || yd[0] != n || yd[1] != bd[2])
      return ffi::Error::InvalidArgument(
          "sgmv: need A [layers, slots, rank, in], B [layers, slots, out, rank] and results [rows, out]");
    if (layer < 0 || layer >= ad[0]) return ffi::Error::InvalidArgument("sgmv: layer out of range");
    const auto type = a->element_type();
    if (type != b->element_type() || (type != ffi::F32 && type != ffi::U16))
      return ffi::Error::InvalidArgument("sgmv: A and B must both be float32, or both uint16 (bfloat16 bits)");
    if (call->max_rank >= 0 && call->max_rank != ad[2])
      return ffi::Error::InvalidArgument("sgmv: every module must have the same max_rank");
    call->max_rank = ad[2];
    call->modules.push_back({a->untyped_data(), b->untyped_data(), type == ffi::U16, bd[2], (*y)->typed_data()});
  }
  const int32_t* s = call->slot_of_row;
  for (int64_t r = 0; r < n; ++r) {
    if (s[r] >= 0 && s[r] < call->slots && call->rank[s[r]] > 0) {
      call->order.push_back(static_cast<int32_t>(r));
    } else {  // the base model, or an empty slot: no LoRA term
      for (const Module& m : call->modules) std::memset(m.y + r * m.out, 0, sizeof(float) * m.out);
    }
  }
  std::stable_sort(call->order.begin(), call->order.end(), [s](int32_t p, int32_t q) { return s[p] < s[q]; });
  for (size_t i = 0; i < call->order.size(); ++i)
    if (i == 0 || s[call->order[i]] != s[call->order[i - 1]]) call->group_start.push_back(static_cast<int>(i));
  call->group_start.push_back(static_cast<int>(call->order.size()));
  const int groups = static_cast<int>(call->group_start.size()) - 1;
  // An item recomputes its slot's shrink (x A^T) for its own columns, so a module is split into
  // column blocks only when the (slot, module) pairs are too few to keep every thread busy.
  const bool few = groups * static_cast<int64_t>(call->modules.size()) < 2 * std::max<int64_t>(pool.num_threads(), 1);
  const int64_t columns = few ? kColumns : INT64_MAX / 2;
  for (int g = 0; g < groups; ++g)
    for (int mi = 0; mi < static_cast<int>(call->modules.size()); ++mi)
      for (int64_t o = 0; o < call->modules[mi].out; o += columns)
        call->items.push_back({g, mi, o, std::min(o + columns, call->modules[mi].out)});

  loraplane::run_parallel<Call>(pool, call, static_cast<int64_t>(call->items.size()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraplaneSgmv, Sgmv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("layer"));
