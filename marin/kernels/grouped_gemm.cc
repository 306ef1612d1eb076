// Grouped (batched) f32 GEMM for XLA:CPU, as an XLA FFI custom call.
//
//   out[g] = op(a[g]) @ op(b[g])    for g in [0, G);  op = identity or transpose (per operand)
//
// a's axis 1 is a per-group buffer of rows (an expert's capacity slots) of which only the first
// rows[g] are filled; the rest are zero padding. Only the filled rows are computed: for op(a) = a
// they are the output rows (the padding rows of out are zero-filled), for op(a) = a^T they are the
// contraction (the padding contributes nothing). So a capacity buffer costs what its tokens cost.
//
// Why: XLA:CPU lowers a batched dot to one multi-threaded GEMM per group, so every expert's
// [C, K] x [K, N] product is split across all cores and the cores meet at a barrier per expert.
// For MoE expert shapes (C ~ 500, K = N ~ 500) that runs at 70-90% of the dense GEMM rate (the
// weight-gradient form, contracting over C, is the slowest). Here
// the groups are split across threads instead, each thread running single-threaded OpenBLAS SGEMMs
// on whole experts: no barrier inside a product, and each GEMM keeps one core's caches.
//
// Built on first use by marin/kernels/cpu.py (g++ against jaxlib's FFI headers and the
// scipy-openblas32 wheel); that module documents the fallback when it cannot be built.

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Gemm {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const float* a;
  const float* b;
  const int32_t* rows;
  float* out;

  void run(int64_t g0, int64_t g1) const {
    const int64_t lda = std::max<int64_t>(1, trans_a ? m : k);
    const int64_t ldb = std::max<int64_t>(1, trans_b ? k : n);
    const int64_t buffer_rows = trans_a ? k : m;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t filled = std::clamp<int64_t>(rows[g], 0, buffer_rows);
      const int64_t mg = trans_a ? m : filled, kg = trans_a ? filled : k;
      float* c = out + g * m * n;
      if (mg > 0 && kg > 0) {
        scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                          trans_b ? CblasTrans : CblasNoTrans, mg, n, kg, 1.0f, a + g * m * k, lda,
                          b + g * k * n, ldb, 0.0f, c, std::max<int64_t>(1, n));
      }
      const int64_t done = kg > 0 ? mg : 0;  // output rows written by the GEMM
      std::fill(c + done * n, c + m * n, 0.0f);
    }
  }
};

ffi::Error GroupedGemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out,
                       bool trans_a, bool trans_b, int64_t threads) {
  // Our own threads split the groups; OpenBLAS itself stays single-threaded (this library copy is
  // used only here, so the setting touches nothing else in the process).
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { scipy_openblas_set_num_threads(1); });

  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || od.size() != 3) {
    return ffi::Error::InvalidArgument("grouped_gemm: operands must be rank 3 [groups, rows, cols]");
  }
  const int64_t groups = ad[0];
  const int64_t m = trans_a ? ad[2] : ad[1];
  const int64_t k = trans_a ? ad[1] : ad[2];
  const int64_t kb = trans_b ? bd[2] : bd[1];
  const int64_t n = trans_b ? bd[1] : bd[2];
  if (bd[0] != groups || od[0] != groups || kb != k || od[1] != m || od[2] != n ||
      rows.element_count() != static_cast<size_t>(groups)) {
    return ffi::Error::InvalidArgument("grouped_gemm: operand shapes do not match");
  }
  Gemm gemm{trans_a, trans_b, m, n, k, a.typed_data(), b.typed_data(), rows.typed_data(),
            out->typed_data()};
  if (groups == 0 || m == 0 || n == 0) return ffi::Error::Success();

  // Contiguous, near-equal runs of groups per thread; the calling thread takes the first run. A
  // thread is only worth starting (tens of microseconds) for at least kMinFlopsPerThread of work.
  constexpr double kMinFlopsPerThread = 16e6;
  double flops = 0;
  for (int64_t g = 0; g < groups; ++g) {
    flops += 2.0 * std::clamp<int64_t>(gemm.rows[g], 0, trans_a ? k : m) * (trans_a ? m : k) * n;
  }
  const int64_t by_work = static_cast<int64_t>(flops / kMinFlopsPerThread);
  const int64_t workers = std::max<int64_t>(1, std::min({threads, groups, by_work}));
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t w = 1; w < workers; ++w) {
    pool.emplace_back([&gemm, w, workers, groups] {
      gemm.run(groups * w / workers, groups * (w + 1) / workers);
    });
  }
  gemm.run(0, groups / workers);
  for (auto& t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarinGroupedGemm, GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Attr<int64_t>("threads"));
