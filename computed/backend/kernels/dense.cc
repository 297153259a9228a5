// Dense products y = x W on AVX-512 or AVX2+FMA CPUs, an XLA FFI custom call, for float32 models and
// bfloat16 ones (W held as its bfloat16 bits, uint16; float32 sums).
//
// W is packed once, when the model loads (computed/model/params.py): [panels, in, kPanel], each panel
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
// A bfloat16 W (a bfloat16 model's) is packed in panels of the same form, its k in pairs: [panels,
// ceil(in / 2), P, 2] uint16 bits, the two consecutive k of each column side by side (zero past `in`),
// P = kPanelBf16 (`loraplane_dense_panel_bf16`). It multiplies x rounded to bfloat16 (a bfloat16 model's
// x already is: exact), as transformers' bfloat16 Linear does, with float32 sums:
// - with AVX512-BF16, by VDPBF16PS: x is transposed into bfloat16 bits, [in / 2][rows][2], so a
//   vector holds 16 rows' pair of k, and each column's pair of weights is one broadcast 32-bit
//   load; one instruction does 32 multiply-adds where an FMA does 16, over half the bytes;
// - on AVX2, vectorised over columns instead (columns_bf16, P = 16): per pair of k a load of 16
//   columns' pairs, a shift and an AND widen them exactly, for 6 rows' FMAs; about 1.02-1.13x
//   float32's rate on this machine's decode products (docs/kernels.md);
// - on AVX-512 without BF16, float32's loop with each weight widened as it is broadcast: a 32-bit
//   broadcast of the pair and a shift of its lower half into place (exact).
// Either way every product is exact in float32 and the sums are float32's, in k order but for the
// pair (VDPBF16PS adds k + 1 before k, and flushes denormals): results differ by float32 rounding.
//
// Operands: x f32 [rows, in], then one or more w, all f32 [panels, in, kPanel] or all u16 (bfloat16
// bits) [panels, ceil(in / 2), kPanelBf16, 2], reading x. Results: one y f32 [rows, out] per w, with
// panels = ceil(out / the panel's width).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LORAPLANE_DENSE 1
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LORAPLANE_DPBF16 1  // bfloat16 pairs multiplied by VDPBF16PS
#elif defined(LORAPLANE_DENSE) && !defined(__AVX512F__)
#define LORAPLANE_BF16_COLUMNS 1  // AVX2: bfloat16 panels of two vectors of columns (columns_bf16)
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
#if defined(LORAPLANE_BF16_COLUMNS)
constexpr int64_t kPanelBf16 = 2 * kLanes;  // a bfloat16 panel's columns: two vectors
constexpr int64_t kColumnRows = 6;          // rows at a time: 6 x 2 accumulators + 2 weights + a broadcast
#else
constexpr int64_t kPanelBf16 = kPanel;
#endif
template <typename T>  // output columns per panel of a weight of element type T (uint16: bfloat16 bits)
constexpr int64_t kPanelOf = std::is_same_v<T, float> ? kPanel : kPanelBf16;
constexpr int64_t kPrefetch = 4096;    // bytes ahead in a panel's stream
constexpr int64_t kPanelsPerItem = 4;  // panels per work item
constexpr int64_t kRowBlock = 256;     // rows per work item: a prefill's x, a block at a time, stays in cache

// x's element rounded to bfloat16 (to nearest, ties to even; NaN stays NaN): its bits, and its value
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_round(float f) { return loraplane::widen(bf16_bits(f)); }

#if defined(LORAPLANE_DENSE)
// The accumulators of one chunk and one panel, [kPanel][kLanes * V], into y[r][c] (r < rows, c < cols)
template <int V>
void store(Vec (&acc)[V][kPanel], float* y, int64_t ldy, int64_t rows, int64_t cols) {
  alignas(64) float t[kPanel][kLanes * V];
  for (int j = 0; j < kPanel; ++j)
    for (int v = 0; v < V; ++v) std::memcpy(t[j] + kLanes * v, &acc[v][j], sizeof(Vec));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = t[c][r];
}

// acc += the outer product of one k: the chunk's rows there, V vectors at xk, times the panel's kPanel
// weights, weight(j) broadcast to a vector
template <int V, typename Weight>
inline void outer(Vec (&acc)[V][kPanel], const float* xk, Weight weight) {
  Vec x[V];
  for (int v = 0; v < V; ++v) x[v] = loraplane::load<Vec>(xk + kLanes * v);
#pragma GCC unroll 12
  for (int j = 0; j < kPanel; ++j) {
    const Vec b = weight(j);
    for (int v = 0; v < V; ++v) acc[v][j] = fmadd(x[v], b, acc[v][j]);
  }
}

// acc += the outer products of n consecutive k: xt the chunk's rows at the first, [n][kLanes * V]; w the
// panel's float32 weights there, k's row of kPanel at w + k * kPanel; the stream prefetched ahead
// (never faults)
template <int V>
inline void accumulate(Vec (&acc)[V][kPanel], const float* xt, const float* w, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float* wk = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
    outer<V>(acc, xt + k * kLanes * V, [wk](int j) { return splat(wk[j]); });
  }
}
// y[r][c] (r < rows, c < cols) of one chunk and one panel; xt is the chunk, [in][kLanes * V]
template <int V>
void panel_product(const float* xt, const float* w, int64_t in, float* y, int64_t ldy, int64_t rows,
                   int64_t cols) {
  Vec acc[V][kPanel] = {};
  accumulate<V>(acc, xt, w, in);
  store<V>(acc, y, ldy, rows, cols);
}

#if defined(LORAPLANE_DPBF16)
// The same for a bfloat16 panel [in2][kPanel][2] and x's bfloat16 bits, the chunk [in2][kLanes * V][2]
template <int V>
void panel_product_bf16(const uint16_t* xt, const uint16_t* w, int64_t in2, float* y, int64_t ldy, int64_t rows,
                        int64_t cols) {
  Vec acc[V][kPanel] = {};
  for (int64_t k = 0; k < in2; ++k) {
    __m512bh x[V];
    for (int v = 0; v < V; ++v) x[v] = (__m512bh)_mm512_loadu_si512(xt + (k * V + v) * kLanes * 2);
    const uint16_t* wk = w + k * kPanel * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
#pragma GCC unroll 12
    for (int j = 0; j < kPanel; ++j) {
      int32_t pair;
      std::memcpy(&pair, wk + 2 * j, sizeof pair);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[v][j] = (Vec)_mm512_dpbf16_ps((__m512)acc[v][j], x[v], b);
    }
  }
  store<V>(acc, y, ldy, rows, cols);
}
#elif !defined(LORAPLANE_BF16_COLUMNS)
// A bfloat16 weight widened exactly as it is broadcast: the 32 bits at p, their lower half shifted up
inline Vec bf16_splat(const uint16_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return (Vec)((typename loraplane::Bits<Vec>::U)splat(f) << 16);
}

// y[r][c] of one chunk and a bfloat16 panel [in2][kPanel][2] (AVX-512 without BF16), each weight widened
// as it is broadcast, a shift per weight; xt as for float32 (x rounded to bfloat16). An odd k's weight is
// the lower half of the 32 bits one weight on, so every pair but the panel's last reads in place.
template <int V>
void panel_product_bf16(const float* xt, const uint16_t* w, int64_t in, float* y, int64_t ldy, int64_t rows,
                        int64_t cols) {
  Vec acc[V][kPanel] = {};
  constexpr int64_t kRow = kLanes * V;  // one k of the chunk
  const int64_t in2 = (in + 1) / 2;
  for (int64_t k2 = 0; k2 + 1 < in2; ++k2) {
    const uint16_t* wk = w + k2 * kPanel * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
    outer<V>(acc, xt + 2 * k2 * kRow, [wk](int j) { return bf16_splat(wk + 2 * j); });
    outer<V>(acc, xt + (2 * k2 + 1) * kRow, [wk](int j) { return bf16_splat(wk + 2 * j + 1); });
  }
  const uint16_t* wk = w + (in2 - 1) * kPanel * 2;  // the last pair (or the lone last k of an odd `in`)
  outer<V>(acc, xt + 2 * (in2 - 1) * kRow, [wk](int j) { return bf16_splat(wk + 2 * j); });
  if (in % 2 == 0) {
    outer<V>(acc, xt + (in - 1) * kRow, [wk](int j) { return splat(loraplane::widen(wk[2 * j + 1])); });
  }
  store<V>(acc, y, ldy, rows, cols);
}

#endif
#endif

#if defined(LORAPLANE_BF16_COLUMNS)
// AVX2's bfloat16 products, vectorised over columns: a panel [in2][16][2] holds, per pair of k, two vectors
// of eight columns' (k, k + 1) in 32-bit lanes; shifted left by 16 they are k's weights, masked to the
// upper half k + 1's, exactly: 4 vector operations per pair of k for 4 x R FMAs (the broadcast loop
// pays a shift per weight for 2 FMAs), the panel (32 KB at in 1024) in L1 for the chunk's 6-row blocks.
alignas(32) constexpr uint32_t kUpper[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                            0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};

// acc[r] += x[r] (broadcast) times one k's two vectors of weights; xk the chunk's rows at that k
template <int R>
inline void columns_k(Vec (&acc)[R][2], const float* xk, Vec lo, Vec hi) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const Vec x = splat(xk[r]);
    acc[r][0] = fmadd(x, lo, acc[r][0]);
    acc[r][1] = fmadd(x, hi, acc[r][1]);
  }
}

// y[r][c] (r < R, c < cols) for R rows of a chunk, xc at its first row ([in][width], x rounded to
// bfloat16), and a bfloat16 panel [in2][16][2] (zero past `in`)
template <int R>
void columns_bf16(const float* xc, int64_t width, const uint16_t* w, int64_t in, float* y, int64_t ldy,
                  int64_t cols) {
  typedef typename loraplane::Bits<Vec>::U U;
  Vec acc[R][2] = {};
  const auto even = [](const uint16_t* wk, Vec& lo, Vec& hi) {  // k = 2 k2: the lower halves, shifted up
    U a, b;
    std::memcpy(&a, wk, sizeof a);
    std::memcpy(&b, wk + kPanelBf16, sizeof b);
    lo = (Vec)(a << 16);
    hi = (Vec)(b << 16);
  };
  Vec lo, hi;
  for (int64_t k2 = 0; k2 < in / 2; ++k2) {
    const uint16_t* wk = w + k2 * 2 * kPanelBf16;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
    even(wk, lo, hi);
    columns_k<R>(acc, xc + 2 * k2 * width, lo, hi);
    std::memcpy(&lo, wk, sizeof lo);  // k + 1: the upper halves, masked
    std::memcpy(&hi, wk + kPanelBf16, sizeof hi);
    // the mask loaded afresh each time (volatile), into a register the next broadcast reuses: held in a
    // register of its own, AVX2's 16th, GCC spilled accumulators
    const __m256 upper = *reinterpret_cast<const volatile __m256*>(kUpper);
    lo = (Vec)_mm256_and_ps((__m256)lo, upper);
    hi = (Vec)_mm256_and_ps((__m256)hi, upper);
    columns_k<R>(acc, xc + (2 * k2 + 1) * width, lo, hi);
  }
  if (in % 2) {  // an odd `in`: the last pair's k + 1 is padding, and x has no row there
    even(w + in / 2 * 2 * kPanelBf16, lo, hi);
    columns_k<R>(acc, xc + (in - 1) * width, lo, hi);
  }
  alignas(32) float t[R][2 * kLanes];
  for (int r = 0; r < R; ++r) std::memcpy(t[r], acc[r], sizeof acc[r]);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = t[r][c];
}

// The same for `rows` (1 to kColumnRows) rows
inline void columns_bf16(const float* xc, int64_t width, const uint16_t* w, int64_t in, float* y, int64_t ldy,
                         int64_t rows, int64_t cols) {
  using Block = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
  static constexpr Block kBlocks[] = {columns_bf16<1>, columns_bf16<2>, columns_bf16<3>,
                                      columns_bf16<4>, columns_bf16<5>, columns_bf16<6>};
  kBlocks[rows - 1](xc, width, w, in, y, ldy, cols);
}
#endif

// How x is laid out for the products: as float32, rounded to bfloat16 (for bfloat16 weights, widened), or
// as bfloat16 bits in pairs of k (for bfloat16 weights, VDPBF16PS)
enum class XLayout { kFloat, kRounded, kPairs };

// x [rows, in] into chunks of kChunk rows, each [in][kChunk] (a last chunk of <= kLanes rows: [in][kLanes]);
// kPairs: [ceil(in / 2)][kChunk][2] bits (zero past `in`)
struct Transpose {
  const float* x;
  float* xt;
  int64_t rows, in;
  XLayout layout;

  void run(int64_t chunk) const {
    const int64_t r0 = chunk * kChunk, n = std::min(kChunk, rows - r0), width = n > kLanes ? kChunk : kLanes;
    if (layout == XLayout::kPairs) {
      uint16_t* c = reinterpret_cast<uint16_t*>(xt) + r0 * ((in + 1) / 2) * 2;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t k = 0; k < in; ++k) c[(k / 2 * width + r) * 2 + (k & 1)] = bf16_bits(x[(r0 + r) * in + k]);
      return;
    }
    float* c = xt + r0 * in;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t k = 0; k < in; ++k) {
        const float v = x[(r0 + r) * in + k];
        c[k * width + r] = layout == XLayout::kRounded ? bf16_round(v) : v;
      }
  }
};

// One product of a call: a packed weight (float32, or bfloat16 bits) and its result.
template <typename T>
struct Product {
  const T* w;
  float* y;
  int64_t out, panels;
};

template <typename T>
struct Dense {
  const float* xt;  // x transposed into chunks (Transpose)
  int64_t rows, in;
  std::vector<Product<T>> products;
  std::vector<std::pair<int32_t, int64_t>> groups;  // (product, first panel) of each group of panels

  int64_t items() const { return (rows + kRowBlock - 1) / kRowBlock * static_cast<int64_t>(groups.size()); }

  // items run row block by row block (the order threads claim them), each a group of one product's panels
  void run(int64_t item) const {
#if defined(LORAPLANE_DENSE)
    const int64_t n_groups = static_cast<int64_t>(groups.size());
    const int64_t block = item / n_groups;
    const Product<T>& pr = products[groups[item % n_groups].first];
    const int64_t first = groups[item % n_groups].second, last = std::min(pr.panels, first + kPanelsPerItem);
    const int64_t row_end = std::min(rows, (block + 1) * kRowBlock);
    const int64_t in2 = (in + 1) / 2;  // a bfloat16 panel's pairs of k
    constexpr int64_t P = kPanelOf<T>;
    for (int64_t p = first; p < last; ++p) {
      const int64_t cols = std::min(P, pr.out - p * P);
      for (int64_t r0 = block * kRowBlock; r0 < row_end; r0 += kChunk) {
        const int64_t n = std::min(kChunk, row_end - r0);
        float* yp = pr.y + r0 * pr.out + p * P;
        if constexpr (std::is_same_v<T, float>) {
          const float* wp = pr.w + p * in * kPanel;
          if (n > kLanes)
            panel_product<2>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
          else
            panel_product<1>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
        } else {
          const uint16_t* wp = pr.w + p * in2 * kPanelBf16 * 2;
#if defined(LORAPLANE_DPBF16)
          const uint16_t* xp = reinterpret_cast<const uint16_t*>(xt) + r0 * in2 * 2;
          if (n > kLanes)
            panel_product_bf16<2>(xp, wp, in2, yp, pr.out, n, cols);
          else
            panel_product_bf16<1>(xp, wp, in2, yp, pr.out, n, cols);
#elif defined(LORAPLANE_BF16_COLUMNS)
          const int64_t width = n > kLanes ? kChunk : kLanes;  // the chunk's stride per k
          for (int64_t r = 0; r < n; r += kColumnRows)
            columns_bf16(xt + r0 * in + r, width, wp, in, yp + r * pr.out, pr.out, std::min(kColumnRows, n - r), cols);
#else
          if (n > kLanes)
            panel_product_bf16<2>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
          else
            panel_product_bf16<1>(xt + r0 * in, wp, in, yp, pr.out, n, cols);
#endif
        }
      }
    }
#else
    (void)item;
#endif
  }
};

#if defined(LORAPLANE_DENSE)
// The products of one call, every weight of element type T: float32 [panels, in, kPanel] (FFI type F32),
// or bfloat16 bits [panels, ceil(in / 2), kPanel, 2] (U16).
template <typename T, ffi::DataType D>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::RemainingArgs& ws, ffi::RemainingRets& ys) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1], in2 = (in + 1) / 2;
  auto call = std::make_shared<Dense<T>>();
  call->rows = rows;
  call->in = in;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<D>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w || !y)
      return ffi::Error::InvalidArgument("dense: weights must be all float32 or all uint16 (bfloat16 bits), "
                                         "results float32");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    constexpr int64_t P = kPanelOf<T>;
    const bool ok = bf16 ? wd.size() == 4 && wd[1] == in2 && wd[2] == P && wd[3] == 2
                         : wd.size() == 3 && wd[1] == in && wd[2] == P;
    if (!ok || yd.size() != 2 || yd[0] != rows || wd[0] != (yd[1] + P - 1) / P)
      return ffi::Error::InvalidArgument("dense: need x [rows, in], w [ceil(out / panel), in, panel] float32 or "
                                         "[ceil(out / panel), ceil(in / 2), panel, 2] bfloat16 bits, y [rows, out]");
    call->products.push_back({reinterpret_cast<const T*>(w->untyped_data()), (*y)->typed_data(), yd[1], wd[0]});
    for (int64_t p = 0; p < wd[0]; p += kPanelsPerItem) call->groups.push_back({static_cast<int32_t>(i), p});
  }
  if (rows == 0 || call->groups.empty()) return ffi::Error::Success();
#if defined(LORAPLANE_DPBF16)
  const XLayout layout = bf16 ? XLayout::kPairs : XLayout::kFloat;
#else
  const XLayout layout = bf16 ? XLayout::kRounded : XLayout::kFloat;
#endif
  // x transposed into chunks (kPairs: half the floats' room holds the bits); reused by this thread's
  // later calls (helpers only read it)
  thread_local std::vector<float> scratch;
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  scratch.assign(static_cast<size_t>(chunks * kChunk * (layout == XLayout::kPairs ? in2 : in)), 0.f);
  auto transpose = std::make_shared<Transpose>(Transpose{x.typed_data(), scratch.data(), rows, in, layout});
  if (chunks == 1)
    transpose->run(0);  // a decode step's: not worth waking the threads for
  else
    loraplane::run_parallel<Transpose>(pool, transpose, chunks);
  call->xt = scratch.data();
  loraplane::run_parallel<Dense<T>>(pool, call, call->items());
  return ffi::Error::Success();
}
#endif

// y_i = x w_i for every packed weight w_i, one result each: products that read the same x (q, k and v;
// gate and up) share one call, one transpose of x and one wake-up of the threads.
ffi::Error DenseProducts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
#if !defined(LORAPLANE_DENSE)
  return ffi::Error::Internal("dense: built without AVX-512 or AVX2+FMA; the model should not have packed its weights");
#else
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("dense: x must be [rows, in]");
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("dense: one result per packed weight");
  if (ws.get<ffi::Buffer<ffi::U16>>(0)) return Run<uint16_t, ffi::U16>(pool, x, ws, ys);
  return Run<float, ffi::F32>(pool, x, ws, ys);
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

// Output columns per bfloat16 panel: 16 on AVX2 (columns_bf16), else as float32's; 0 without the kernel.
extern "C" int64_t loraplane_dense_panel_bf16() {
#if defined(LORAPLANE_DENSE)
  return kPanelBf16;
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
