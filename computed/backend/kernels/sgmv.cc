// Segmented multi-LoRA on the CPU (SGMV, after Punica and S-LoRA), an XLA FFI custom call.
//
// For the rows of x that share a slot, y = scaling[slot] * (x A[layer, slot]^T) B[layer, slot]^T,
// for up to a few modules that read the same x (q, k and v; gate and up). Rows are grouped by
// slot here, so each slot's A and B are read once per call, straight from the pool's buffers: no
// weight matrix is copied, sliced out, or gathered per token. Rows whose slot is negative (the
// base model) get zeros. A slot's work stops at its own rank (pool.rank, rounded up to 8 for the
// vector path; the pool keeps the rest zero), not at the pool's max_rank. The shrink x A^T runs
// in blocks of 4 rows by 4 ranks (AVX-512) or 2 (AVX2); the expand, for a slot with many rows (a
// prefill's), transposes each block of two vectors of B's columns once and runs the rows over it
// in blocks of 6, outer products into registers as the dense kernel's; with few (a decode step's),
// dot products over B in place. Work items are (slot, module)
// pairs, on XLA's intra-op threads; when the pairs are too few for the threads (one or two slots),
// a first phase computes each pair's shrink and the expand is split into blocks of output
// columns. The calling thread works too, then waits only for items another thread has taken
// (parallel.h).
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
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using loraplane::load;
using loraplane::v8;
using loraplane::widen;

using loraplane::fmadd;
using loraplane::kLanes;
using loraplane::Vec;
// shrink's ranks per block: 4 rows x 4 ranks = 16 accumulators of AVX-512's 32 registers; 4 x 2 = 8
// of AVX2's 16
constexpr int kRankBlock = kLanes == 16 ? 4 : 2;

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
inline float hsum(Vec v) {
  float s = 0.f;
  for (int c = 0; c < kLanes; ++c) s += v[c];
  return s;
}
inline Vec splat(float f) { return Vec{} + f; }

constexpr int kRowBlock = 4;       // rows that share each load of A in the shrink
constexpr int kExpandRows = 8;     // from this many rows, the expand transposes B's column blocks first
constexpr int kExpandBlock = 6;    // rows per block of the transposed expand: 6 x 2 accumulators
constexpr int kExpandCols = 2 * kLanes;  // columns per transposed block of B: two vectors
constexpr int64_t kColumns = 512;  // output columns per work item, when items are few (see Sgmv)

// t[j][k] for the M rows xr and the K ranks of a from k0: M x K accumulators of kLanes over `in`
template <int M, int K, typename T>
void shrink_block(const float* const* xr, int64_t in, const T* a, int64_t k0, int64_t rank, float* t, int j0) {
  const int64_t vec = in - in % kLanes;
  Vec acc[M][K] = {};
  for (int64_t i = 0; i < vec; i += kLanes) {
    Vec av[K];
    for (int q = 0; q < K; ++q) av[q] = load<Vec>(a + (k0 + q) * in + i);
    for (int j = 0; j < M; ++j) {
      const Vec xv = load<Vec>(xr[j] + i);
      for (int q = 0; q < K; ++q) acc[j][q] = fmadd(xv, av[q], acc[j][q]);
    }
  }
  for (int j = 0; j < M; ++j)
    for (int q = 0; q < K; ++q) {
      float s = hsum(acc[j][q]);
      for (int64_t i = vec; i < in; ++i) s += xr[j][i] * widen(a[(k0 + q) * in + i]);
      t[(j0 + j) * rank + k0 + q] = s;
    }
}

template <int M, typename T>
void shrink_rows(const float* const* xr, int64_t in, const T* a, int64_t rank, float* t, int j0) {
  int64_t k = 0;
  for (; k + kRankBlock <= rank; k += kRankBlock) shrink_block<M, kRankBlock>(xr, in, a, k, rank, t, j0);
  for (; k < rank; ++k) shrink_block<M, 1>(xr, in, a, k, rank, t, j0);
}

// t[j][k] = sum_i x[rows[j]][i] * a[k][i] for k < rank; a's rows are `in` apart. Blocks of 4 rows
// by kRankBlock ranks: each load of x serves those ranks, each load of A 4 rows.
template <typename T>
void shrink(const float* x, int64_t in, const int32_t* rows, int n, const T* a, int64_t rank, float* t) {
  for (int j0 = 0; j0 < n; j0 += kRowBlock) {
    const float* xr[kRowBlock];
    const int m = std::min(kRowBlock, n - j0);
    for (int j = 0; j < m; ++j) xr[j] = x + static_cast<int64_t>(rows[j0 + j]) * in;
    switch (m) {
      case 4: shrink_rows<4>(xr, in, a, rank, t, j0); break;
      case 3: shrink_rows<3>(xr, in, a, rank, t, j0); break;
      case 2: shrink_rows<2>(xr, in, a, rank, t, j0); break;
      default: shrink_rows<1>(xr, in, a, rank, t, j0); break;
    }
  }
}

// y[rows[j]][o .. o + kExpandCols) = scale * sum_k t[j][k] * bt[k][..] for the R rows from j0: per k, two
// vectors of bt times each row's t broadcast, into R x 2 accumulators (the dense kernel's outer product)
template <int R>
void expand_rows(const float* t, int j0, int64_t rank, const float* bt, float scale, const int32_t* rows, float* y,
                 int64_t out, int64_t o) {
  Vec acc[R][2] = {};
  for (int64_t k = 0; k < rank; ++k) {
    const Vec b0 = load<Vec>(bt + k * kExpandCols), b1 = load<Vec>(bt + k * kExpandCols + kLanes);
    for (int j = 0; j < R; ++j) {
      const Vec tk = splat(t[(j0 + j) * rank + k]);
      acc[j][0] = fmadd(tk, b0, acc[j][0]);
      acc[j][1] = fmadd(tk, b1, acc[j][1]);
    }
  }
  for (int j = 0; j < R; ++j) {
    float* yr = y + static_cast<int64_t>(rows[j0 + j]) * out + o;
    const Vec s0 = acc[j][0] * scale, s1 = acc[j][1] * scale;
    std::memcpy(yr, &s0, sizeof s0);
    std::memcpy(yr + kLanes, &s1, sizeof s1);
  }
}

// y[rows[j]][o] = scale * sum_k t[j][k] * b[o][k] for o in [o0, o1), k < rank; b's rows are
// `stride` apart. With many rows, each block of kExpandCols columns of B is transposed once
// ([rank][kExpandCols]) and the rows run in blocks of kExpandBlock over it; with few, eight columns at
// a time by dot products (when rank is a multiple of 8); any remaining column by a scalar sum.
template <typename T>
void expand(const float* t, int n, int64_t rank, const T* b, int64_t stride, int64_t o0, int64_t o1,
            float scale, const int32_t* rows, float* y, int64_t out) {
  int64_t o = o0;
  if (n >= kExpandRows) {
    thread_local std::vector<float> bt;  // scratch, reused across items and calls
    bt.resize(static_cast<size_t>(rank) * kExpandCols);
    for (; o + kExpandCols <= o1; o += kExpandCols) {
      for (int c = 0; c < kExpandCols; ++c)
        for (int64_t k = 0; k < rank; ++k) bt[k * kExpandCols + c] = widen(b[(o + c) * stride + k]);
      int j = 0;
      for (; j + kExpandBlock <= n; j += kExpandBlock)
        expand_rows<kExpandBlock>(t, j, rank, bt.data(), scale, rows, y, out, o);
      switch (n - j) {
        case 5: expand_rows<5>(t, j, rank, bt.data(), scale, rows, y, out, o); break;
        case 4: expand_rows<4>(t, j, rank, bt.data(), scale, rows, y, out, o); break;
        case 3: expand_rows<3>(t, j, rank, bt.data(), scale, rows, y, out, o); break;
        case 2: expand_rows<2>(t, j, rank, bt.data(), scale, rows, y, out, o); break;
        case 1: expand_rows<1>(t, j, rank, bt.data(), scale, rows, y, out, o); break;
        default: break;
      }
    }
  }
  if (rank % 8 == 0) {
    for (; o + 8 <= o1; o += 8) {
      for (int j = 0; j < n; ++j) {
        const float* tj = t + j * rank;
        v8 p[8] = {};
        for (int64_t k = 0; k < rank; k += 8) {
          const v8 tv = load<v8>(tj + k);
          for (int c = 0; c < 8; ++c) p[c] = fmadd(load<v8>(b + (o + c) * stride + k), tv, p[c]);
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
  // With column blocks, each (group, module)'s t is computed once, first, into `shared` at
  // shared_at[group * modules + module]; without, each item computes its own.
  std::vector<float> shared;
  std::vector<int64_t> shared_at;

  int rows_of(int group) const { return group_start[group + 1] - group_start[group]; }
  int64_t rank_of(int group) const {  // the group's slot's rank, rounded up to 8 for the vector paths
    const int64_t used = std::min<int64_t>(rank[slot_of_row[order[group_start[group]]]], max_rank);
    return max_rank % 8 == 0 ? (used + 7) / 8 * 8 : max_rank;
  }
  template <typename T>
  const T* a_of(int group, const Module& m) const {
    return static_cast<const T*>(m.a) + (layer * slots + slot_of_row[order[group_start[group]]]) * max_rank * in;
  }

  template <typename T>
  void shrink_of(int group, int module, float* t) const {
    shrink(x, in, order.data() + group_start[group], rows_of(group), a_of<T>(group, modules[module]),
           rank_of(group), t);
  }

  template <typename T>
  void run(const Item& it) const {
    const int32_t* rows = order.data() + group_start[it.group];
    const int n = rows_of(it.group);
    const int64_t slot = slot_of_row[rows[0]], r = rank_of(it.group);
    const Module& m = modules[it.module];
    const T* b = static_cast<const T*>(m.b) + (layer * slots + slot) * m.out * max_rank;
    const float* t;
    if (shared.empty()) {
      thread_local std::vector<float> own;  // scratch, reused across items and calls
      own.resize(static_cast<size_t>(n) * std::max<int64_t>(r, 1));
      shrink_of<T>(it.group, it.module, own.data());
      t = own.data();
    } else {
      t = shared.data() + shared_at[it.group * modules.size() + it.module];
    }
    expand(t, n, r, b, max_rank, it.o0, it.o1, scaling[slot], rows, m.y, m.out);
  }

  void run(int64_t i) const {
    const Item& it = items[i];
    if (modules[it.module].bf16)
      run<uint16_t>(it);
    else
      run<float>(it);
  }
};

// The first phase of a call with column blocks: t of (group, module) pair i.
struct Shrinks {
  std::shared_ptr<Call> call;

  void run(int64_t i) const {
    const int64_t n_modules = static_cast<int64_t>(call->modules.size());
    const int group = static_cast<int>(i / n_modules), module = static_cast<int>(i % n_modules);
    float* t = call->shared.data() + call->shared_at[i];
    if (call->modules[module].bf16)
      call->shrink_of<uint16_t>(group, module, t);
    else
      call->shrink_of<float>(group, module, t);
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
  // An item is a (slot, module) pair, shrink and expand. When those are too few to keep every
  // thread busy, modules are split into column blocks, after a first phase that computes each
  // pair's shrink (x A^T) once for all its blocks.
  const int64_t pairs_count = groups * static_cast<int64_t>(call->modules.size());
  const bool few = pairs_count < 2 * std::max<int64_t>(pool.num_threads(), 1);
  const int64_t columns = few ? kColumns : INT64_MAX / 2;
  for (int g = 0; g < groups; ++g)
    for (int mi = 0; mi < static_cast<int>(call->modules.size()); ++mi)
      for (int64_t o = 0; o < call->modules[mi].out; o += columns)
        call->items.push_back({g, mi, o, std::min(o + columns, call->modules[mi].out)});
  if (few && pairs_count > 0) {
    int64_t size = 0;
    for (int g = 0; g < groups; ++g)
      for (size_t mi = 0; mi < call->modules.size(); ++mi) {
        call->shared_at.push_back(size);
        size += call->rows_of(g) * std::max<int64_t>(call->rank_of(g), 1);
      }
    call->shared.resize(static_cast<size_t>(size));
    loraplane::run_parallel<Shrinks>(pool, std::make_shared<const Shrinks>(Shrinks{call}), pairs_count);
  }
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
