// Dense products y = x W for float32 models on AVX-512 or AVX2+FMA CPUs, an XLA FFI custom call.
//
// W is packed once, when the model loads (computed/dense.py): [panels, in, kPanel], each panel
// kPanel consecutive output columns with its `in` rows stored one after another, zero-padded past
// the last column. A decode step's products have few rows (the batch) and large weights that are
// read once per step, so the kernel is built around streaming W exactly once, in the order it
// lies in memory, while the rows stay in cache:
// - x is transposed into chunks of two vectors of rows (or one for a short last chunk), [in][2 L]
//   (L lanes: 16 on AVX-512, 8 on AVX2), so each k holds the chunk's rows in two vectors;
// - for each panel, each chunk runs an outer product per k: the two row vectors times each of
//   the panel's kPanel weights, broadcast, into 2 x kPanel accumulators that stay in registers;
// - the panel stream is prefetched a few KB ahead (the hardware prefetcher alone left a third
//   of the rate on the table in a measurement on this machine).
// Work items are groups of panels, on XLA's intra-op threads (parallel.h). XLA's own dot packs W
// into blocks on every call and ran a decode step's products at about 133 GFLOP/s here, this at
// about 200 (docs/kernels.md). One source for both widths, blocked to each one's registers: AVX-512,
// 32 zmm: 2 x 12 accumulators; AVX2, 16 ymm: 2 x 6 (plus the two row vectors and a broadcast).
// Built without either, `loraplane_dense_panel` says 0 and the model keeps W unpacked for XLA.
//
// Operands: x f32 [rows, in], then one or more w f32 [panels, in, kPanel], all read x. Results: one
// y f32 [rows, out] per w, with panels = ceil(out / kPanel).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LORAPLANE_DENSE 1
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
typedef loraplane::v16 Vec;
constexpr int64_t kLanes = 16;
constexpr int64_t kPanel = 12;  // output columns per panel: 2 x 12 accumulators + 2 row vectors, of 32 registers
inline Vec fmadd(Vec a, Vec b, Vec c) { return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline Vec splat(float f) { return (Vec)_mm512_set1_ps(f); }
#elif defined(LORAPLANE_DENSE)
typedef loraplane::v8 Vec;
constexpr int64_t kLanes = 8;
constexpr int64_t kPanel = 6;  // 2 x 6 accumulators + 2 row vectors + a broadcast, of 16 registers
inline Vec fmadd(Vec a, Vec b, Vec c) { return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline Vec splat(float f) { return (Vec)_mm256_set1_ps(f); }
#else
constexpr int64_t kLanes = 16, kPanel = 12;  // unused: the kernel is not built
#endif
constexpr int64_t kChunk = 2 * kLanes;  // rows per chunk: two vectors
constexpr int64_t kPrefetch = 1024;   // floats (4 KB) ahead in a panel's stream
constexpr int64_t kPanelsPerItem = 4;  // panels per work item
constexpr int64_t kRowBlock = 256;     // rows per work item: a prefill's x, a block at a time, stays in cache

#if defined(LORAPLANE_DENSE)
// y[r][c] (r < rows, c < cols) of one chunk and one panel; xt is the chunk, [in][kLanes * V]
template <int V>
void panel_product(const float* xt, const float* w, int64_t in, float* y, int64_t ldy, int64_t rows,
                   int64_t cols) {
  Vec acc[V][kPanel];
  for (int v = 0; v < V; ++v)
    for (int j = 0; j < kPanel; ++j) acc[v][j] = Vec{};
  for (int64_t k = 0; k < in; ++k) {
    Vec x[V];
    for (int v = 0; v < V; ++v) x[v] = loraplane::load<Vec>(xt + k * kLanes * V + kLanes * v);
    const float* wk = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);  // never faults
#pragma GCC unroll 12
    for (int j = 0; j < kPanel; ++j) {
      const Vec b = splat(wk[j]);
      for (int v = 0; v < V; ++v) acc[v][j] = fmadd(x[v], b, acc[v][j]);
    }
  }
  alignas(64) float t[kPanel][kLanes * V];
  for (int j = 0; j < kPanel; ++j)
    for (int v = 0; v < V; ++v) std::memcpy(t[j] + kLanes * v, &acc[v][j], sizeof(Vec));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = t[c][r];
}
#endif

// x [rows, in] into chunks of kChunk rows, each [in][kChunk] (a last chunk of <= kLanes rows: [in][kLanes])
struct Transpose {
  const float* x;
  float* xt;
  int64_t rows, in;

  void run(int64_t chunk) const {
    const int64_t r0 = chunk * kChunk, n = std::min(kChunk, rows - r0), width = n > kLanes ? kChunk : kLanes;
    float* c = xt + r0 * in;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t k = 0; k < in; ++k) c[k * width + r] = x[(r0 + r) * in + k];
  }
};

// One product of a call: a packed weight and its result.
struct Product {
  const float* w;
  float* y;
  int64_t out, panels;
};

struct Dense {
  const float* xt;  // chunks of kChunk rows, each [in][kChunk] (a last chunk of <= kLanes rows: [in][kLanes])
  int64_t rows, in;
  std::vector<Product> products;
  std::vector<std::pair<int32_t, int64_t>> groups;  // (product, first panel) of each group of panels

  int64_t items() const { return (rows + kRowBlock - 1) / kRowBlock * static_cast<int64_t>(groups.size()); }

  // items run row block by row block (the order threads claim them), each a group of one product's panels
  void run(int64_t item) const {
#if defined(LORAPLANE_DENSE)
    const int64_t n_groups = static_cast<int64_t>(groups.size());
    const int64_t block = item / n_groups;
    const Product& pr = products[groups[item % n_groups].first];
    const int64_t first = groups[item % n_groups].second, last = std::min(pr.panels, first + kPanelsPerItem);
    const int64_t row_end = std::min(rows, (block + 1) * kRowBlock);
    for (int64_t p = first; p < last; ++p) {
      const float* wp = pr.w + p * in * kPanel;
      const int64_t cols = std::min(kPanel, pr.out - p * kPanel);
      for (int64_t r0 = block * kRowBlock; r0 < row_end; r0 += kChunk) {
        const int64_t n = std::min(kChunk, row_end - r0);
        float* yp = pr.y + r0 * pr.out + p * kPanel;
        if (n > kLanes)
          panel_product<2>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
        else
          panel_product<1>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
      }
    }
#else
    (void)item;
#endif
  }
};

// y_i = x w_i for every packed weight w_i, one result each: products that read the same x (q, k and v;
// gate and up) share one call, one transpose of x and one wake-up of the threads.
ffi::Error DenseProducts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
#if !defined(LORAPLANE_DENSE)
  return ffi::Error::Internal("dense: built without AVX-512 or AVX2+FMA; the model should not have packed its weights");
#else
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("dense: x must be [rows, in]");
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("dense: one result per packed weight");
  const int64_t rows = xd[0], in = xd[1];
  auto call = std::make_shared<Dense>();
  call->rows = rows;
  call->in = in;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w || !y) return ffi::Error::InvalidArgument("dense: weights and results must be float32");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 3 || yd.size() != 2 || wd[1] != in || wd[2] != kPanel || yd[0] != rows ||
        wd[0] != (yd[1] + kPanel - 1) / kPanel)
      return ffi::Error::InvalidArgument("dense: need x [rows, in], w [ceil(out / panel), in, panel], y [rows, out]");
    call->products.push_back({w->typed_data(), (*y)->typed_data(), yd[1], wd[0]});
    for (int64_t p = 0; p < wd[0]; p += kPanelsPerItem) call->groups.push_back({static_cast<int32_t>(i), p});
  }
  if (rows == 0 || call->groups.empty()) return ffi::Error::Success();
  // x transposed into chunks; reused by this thread's later calls (helpers only read it)
  thread_local std::vector<float> scratch;
  scratch.assign(static_cast<size_t>((rows + kChunk - 1) / kChunk * kChunk * in), 0.f);
  auto transpose = std::make_shared<Transpose>(Transpose{x.typed_data(), scratch.data(), rows, in});
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks == 1)
    transpose->run(0);  // a decode step's: not worth waking the threads for
  else
    loraplane::run_parallel<Transpose>(pool, transpose, chunks);
  call->xt = scratch.data();
  loraplane::run_parallel<Dense>(pool, call, call->items());
  return ffi::Error::Success();
#endif
}

}  // namespace

// Output columns per packed panel (12 on AVX-512, 6 on AVX2), or 0 where the kernel was built without either.
extern "C" int64_t loraplane_dense_panel() {
#if defined(LORAPLANE_DENSE)
  return kPanel;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraplaneDense, DenseProducts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
