// Grouped (per-expert) f32 kernels for XLA:CPU, as XLA FFI custom calls.
//
//   MarinGroupedGemm   out[g] = op(a[g]) @ op(b[g])    for g in [0, G);  op = identity or transpose
//   MarinSwigluFwd     per expert: g = x Wg, u = x Wu, y = (silu(g) * u) Wd
//   MarinSwigluBwd     per expert: the SwiGLU's backward with per-row combine weights (see below)
//
// Every operand's axis 1 is a per-expert buffer of rows (an expert's capacity slots) of which only
// the first rows[e] are filled; the rest are zero padding. Only the filled rows are computed, and the
// padding rows of every row-indexed output are zero-filled. So a capacity buffer costs what its
// tokens cost.
//
// Why: XLA:CPU lowers a batched dot to one multi-threaded GEMM per group, so every expert's
// [C, K] x [K, N] product is split across all cores and the cores meet at a barrier per expert.
// For MoE expert shapes (C ~ 500, K = N ~ 500) that runs at 70-90% of the dense GEMM rate (the
// weight-gradient form, contracting over C, is the slowest). Here the experts are split across
// threads instead, each thread running single-threaded OpenBLAS SGEMMs on whole experts: no barrier
// inside a product, and each GEMM keeps one core's caches. The SwiGLU kernels also do the
// elementwise work per expert while its rows are in cache, instead of full-array XLA passes.
//
// Built on first use by marin/kernels/cpu.py (against jaxlib's FFI headers and the scipy-openblas32
// wheel; compiled with -ffast-math for vectorised exp, linked without it so the process's
// floating-point mode is untouched); that module documents the fallback when it cannot be built.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
                    n, k, 1.0f, a, std::max<int64_t>(1, lda), b, std::max<int64_t>(1, ldb), beta, c,
                    std::max<int64_t>(1, ldc));
}

int64_t Filled(const int32_t* rows, int64_t e, int64_t buffer_rows) {
  return std::clamp<int64_t>(rows[e], 0, buffer_rows);
}

// Runs body(e0, e1) on contiguous, near-equal runs of groups, one per thread; the calling thread
// takes the first run. A thread is only worth starting (tens of microseconds) for at least
// kMinFlopsPerThread of work. OpenBLAS itself stays single-threaded: this library copy is used only
// here, so the setting touches nothing else in the process.
void ParallelOverGroups(int64_t groups, int64_t threads, double flops,
                        const std::function<void(int64_t, int64_t)>& body) {
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { scipy_openblas_set_num_threads(1); });
  constexpr double kMinFlopsPerThread = 16e6;
  const int64_t by_work = static_cast<int64_t>(flops / kMinFlopsPerThread);
  const int64_t workers = std::max<int64_t>(1, std::min({threads, groups, by_work}));
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t w = 1; w < workers; ++w) {
    pool.emplace_back([&body, w, workers, groups] {
      body(groups * w / workers, groups * (w + 1) / workers);
    });
  }
  body(0, groups / workers);
  for (auto& t : pool) t.join();
}

double FilledRows(const int32_t* rows, int64_t groups, int64_t buffer_rows) {
  double total = 0;
  for (int64_t e = 0; e < groups; ++e) total += Filled(rows, e, buffer_rows);
  return total;
}

ffi::Error CheckRank3(std::initializer_list<ffi::AnyBuffer::Dimensions> dims) {
  for (const auto& d : dims) {
    if (d.size() != 3) return ffi::Error::InvalidArgument("marin kernels: operands must be rank 3");
  }
  return ffi::Error::Success();
}

// ---- grouped GEMM --------------------------------------------------------------------------------
ffi::Error GroupedGemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out,
                       bool trans_a, bool trans_b, int64_t threads) {
  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (auto err = CheckRank3({ad, bd, od}); err.failure()) return err;
  const int64_t groups = ad[0];
  const int64_t m = trans_a ? ad[2] : ad[1];
  const int64_t k = trans_a ? ad[1] : ad[2];
  const int64_t kb = trans_b ? bd[2] : bd[1];
  const int64_t n = trans_b ? bd[1] : bd[2];
  if (bd[0] != groups || od[0] != groups || kb != k || od[1] != m || od[2] != n ||
      rows.element_count() != static_cast<size_t>(groups)) {
    return ffi::Error::InvalidArgument("grouped_gemm: operand shapes do not match");
  }
  if (groups == 0 || m == 0 || n == 0) return ffi::Error::Success();
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  const int32_t* pr = rows.typed_data();
  float* po = out->typed_data();
  const int64_t buffer_rows = trans_a ? k : m;  // a's axis 1
  const double flops = 2.0 * FilledRows(pr, groups, buffer_rows) * (trans_a ? m : k) * n;
  ParallelOverGroups(groups, threads, flops, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t filled = Filled(pr, e, buffer_rows);
      const int64_t mg = trans_a ? m : filled, kg = trans_a ? filled : k;
      float* c = po + e * m * n;
      if (mg > 0 && kg > 0) {
        Sgemm(trans_a, trans_b, mg, n, kg, pa + e * m * k, trans_a ? m : k, pb + e * k * n,
              trans_b ? k : n, 0.0f, c, n);
      }
      const int64_t done = kg > 0 ? mg : 0;  // output rows written by the GEMM
      std::fill(c + done * n, c + m * n, 0.0f);
    }
  });
  return ffi::Error::Success();
}

// ---- SwiGLU experts --------------------------------------------------------------------------------
inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Forward. x [E, C, D]; w_gate, w_up [E, D, F]; w_down [E, F, D]. Returns y [E, C, D] and the
// pre-activations g, u [E, C, F] (the backward's residuals).
ffi::Error SwigluFwd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_gate,
                     ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::F32> w_down,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                     ffi::ResultBuffer<ffi::F32> g_out, ffi::ResultBuffer<ffi::F32> u_out,
                     int64_t threads) {
  auto xd = x.dimensions(), wd = w_gate.dimensions();
  if (auto err = CheckRank3({xd, wd, w_up.dimensions(), w_down.dimensions()}); err.failure()) return err;
  const int64_t experts = xd[0], cap = xd[1], d = xd[2], f = wd[2];
  if (wd[0] != experts || wd[1] != d || rows.element_count() != static_cast<size_t>(experts)) {
    return ffi::Error::InvalidArgument("swiglu_fwd: operand shapes do not match");
  }
  const float *px = x.typed_data(), *pg = w_gate.typed_data(), *pu = w_up.typed_data(),
              *pd = w_down.typed_data();
  const int32_t* pr = rows.typed_data();
  float *py = y->typed_data(), *og = g_out->typed_data(), *ou = u_out->typed_data();
  const double flops = 6.0 * FilledRows(pr, experts, cap) * d * f;
  ParallelOverGroups(experts, threads, flops, [&](int64_t e0, int64_t e1) {
    std::vector<float> h(cap * f);
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t r = Filled(pr, e, cap);
      const float* xe = px + e * cap * d;
      float *ge = og + e * cap * f, *ue = ou + e * cap * f, *ye = py + e * cap * d;
      if (r > 0) {
        Sgemm(false, false, r, f, d, xe, d, pg + e * d * f, f, 0.0f, ge, f);
        Sgemm(false, false, r, f, d, xe, d, pu + e * d * f, f, 0.0f, ue, f);
        for (int64_t i = 0; i < r * f; ++i) h[i] = ge[i] * Sigmoid(ge[i]) * ue[i];
        Sgemm(false, false, r, d, f, h.data(), f, pd + e * f * d, d, 0.0f, ye, d);
      }
      std::fill(ge + r * f, ge + cap * f, 0.0f);
      std::fill(ue + r * f, ue + cap * f, 0.0f);
      std::fill(ye + r * d, ye + cap * d, 0.0f);
    }
  });
  return ffi::Error::Success();
}

// Backward of y_row = weight_row * SwiGLU(x_row) for every buffer row, given dy [E, C, D], the
// combine weight of each row wb [E, C] (1 for a plain SwiGLU) and the forward's g, u [E, C, F].
// Returns dx [E, C, D], d(weight) per row [E, C], and the weight gradients dWg, dWu [E, D, F] and
// dWd [E, F, D]. Per expert (r filled rows), all in the thread's cache-sized scratch:
//   dhu = dy Wd^T;  dweight = rowsum(dhu * h);  dh = weight * dhu;  du = dh * silu(g);
//   dg = dh * u * silu'(g);  dWd = (weight * h)^T dy;  dWg = x^T dg;  dWu = x^T du;
//   dx = dg Wg^T + du Wu^T.
ffi::Error SwigluBwd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> wb,
                     ffi::Buffer<ffi::F32> g_in, ffi::Buffer<ffi::F32> u_in,
                     ffi::Buffer<ffi::F32> w_gate, ffi::Buffer<ffi::F32> w_up,
                     ffi::Buffer<ffi::F32> w_down, ffi::Buffer<ffi::S32> rows,
                     ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dwb,
                     ffi::ResultBuffer<ffi::F32> dw_gate, ffi::ResultBuffer<ffi::F32> dw_up,
                     ffi::ResultBuffer<ffi::F32> dw_down, int64_t threads) {
  auto xd = x.dimensions(), wd = w_gate.dimensions();
  if (auto err = CheckRank3({xd, dy.dimensions(), g_in.dimensions(), wd}); err.failure()) return err;
  const int64_t experts = xd[0], cap = xd[1], d = xd[2], f = wd[2];
  if (wd[0] != experts || wd[1] != d || wb.element_count() != static_cast<size_t>(experts * cap) ||
      rows.element_count() != static_cast<size_t>(experts)) {
    return ffi::Error::InvalidArgument("swiglu_bwd: operand shapes do not match");
  }
  const float *px = x.typed_data(), *pdy = dy.typed_data(), *pwb = wb.typed_data(),
              *pgi = g_in.typed_data(), *pui = u_in.typed_data(), *pg = w_gate.typed_data(),
              *pu = w_up.typed_data(), *pd = w_down.typed_data();
  const int32_t* pr = rows.typed_data();
  float *pdx = dx->typed_data(), *pdwb = dwb->typed_data(), *pdwg = dw_gate->typed_data(),
        *pdwu = dw_up->typed_data(), *pdwd = dw_down->typed_data();
  const double flops = 12.0 * FilledRows(pr, experts, cap) * d * f;
  ParallelOverGroups(experts, threads, flops, [&](int64_t e0, int64_t e1) {
    std::vector<float> a(cap * f), dg(cap * f), du(cap * f);  // a: dhu, then weight * h
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t r = Filled(pr, e, cap);
      const float *xe = px + e * cap * d, *dye = pdy + e * cap * d, *we = pwb + e * cap,
                  *ge = pgi + e * cap * f, *ue = pui + e * cap * f;
      float *dxe = pdx + e * cap * d, *dwbe = pdwb + e * cap, *dwge = pdwg + e * d * f,
            *dwue = pdwu + e * d * f, *dwde = pdwd + e * f * d;
      if (r == 0) {
        std::fill(dwge, dwge + d * f, 0.0f);
        std::fill(dwue, dwue + d * f, 0.0f);
        std::fill(dwde, dwde + f * d, 0.0f);
      } else {
        Sgemm(false, true, r, f, d, dye, d, pd + e * f * d, d, 0.0f, a.data(), f);
        for (int64_t i = 0; i < r; ++i) {
          const float w = we[i];
          float* ai = a.data() + i * f;
          float* dgi = dg.data() + i * f;
          float* dui = du.data() + i * f;
          const float *gi = ge + i * f, *ui = ue + i * f;
          float dweight = 0.0f;
          for (int64_t j = 0; j < f; ++j) {
            const float s = Sigmoid(gi[j]), sg = gi[j] * s, h = sg * ui[j];
            const float dh = ai[j] * w;
            dweight += ai[j] * h;
            dui[j] = dh * sg;
            dgi[j] = dh * ui[j] * s * (1.0f + gi[j] * (1.0f - s));
            ai[j] = h * w;
          }
          dwbe[i] = dweight;
        }
        Sgemm(true, false, f, d, r, a.data(), f, dye, d, 0.0f, dwde, d);
        Sgemm(true, false, d, f, r, xe, d, dg.data(), f, 0.0f, dwge, f);
        Sgemm(true, false, d, f, r, xe, d, du.data(), f, 0.0f, dwue, f);
        Sgemm(false, true, r, d, f, dg.data(), f, pg + e * d * f, f, 0.0f, dxe, d);
        Sgemm(false, true, r, d, f, du.data(), f, pu + e * d * f, f, 1.0f, dxe, d);
      }
      std::fill(dxe + r * d, dxe + cap * d, 0.0f);
      std::fill(dwbe + r, dwbe + cap, 0.0f);
    }
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarinSwigluFwd, SwigluFwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_down
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // g
                                  .Ret<ffi::Buffer<ffi::F32>>()  // u
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarinSwigluBwd, SwigluBwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row weights
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_down
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d row weights
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_gate
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_up
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_down
                                  .Attr<int64_t>("threads"));
