// Byte copy for large buffers on the CPU (lazytrain.storage.fastcopy builds this on first use).
//
// On a CPU compute device a host-tier weight fetch is a memcpy by the cores that compute. Its
// destination is a streaming buffer last written a layer or more ago, no longer in cache, so
// ordinary stores first read every destination line (read-for-ownership): 3 bytes of memory
// traffic per byte copied. Non-temporal stores write whole lines without reading them (2 bytes per
// byte), split over the cores in 1 MiB pieces. Measured on the 2-core dev machine, against
// torch's copy_: 1.7x faster for 25.7 MB copies between out-of-cache buffers, 1.3x inside a
// training step (a 220M Llama's host-tier fetches: 45.5 -> 34.1 ms per step). L2 prefetches
// further ahead or none at all measured the same as the L1 prefetch kept below.

// Only the headers this file uses (ATen's tensor, parallel_for, torch's pybind casters), not
// <torch/extension.h> (the whole C++ frontend): a first-use build took 9-13 s instead of 24-28 s
// (2026-12-02, this 2-core machine).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LT_NT 1
#elif defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#define LT_NT 2
#else
#define LT_NT 0
#endif

namespace {

constexpr int64_t kPiece = 1 << 20;     // bytes per parallel work item
constexpr int64_t kPrefetch = 512;      // bytes ahead of the loads

// Copy [lo, hi): an unaligned head by memcpy, 256-byte steps of non-temporal stores to 64-byte
// aligned destinations, the tail by memcpy.
void copy_piece(uint8_t* d, const uint8_t* s, int64_t lo, int64_t hi) {
#if LT_NT
  const uintptr_t base = reinterpret_cast<uintptr_t>(d);
  int64_t i = static_cast<int64_t>(((base + lo + 63) & ~uintptr_t(63)) - base);
  if (i > hi) i = hi;
  std::memcpy(d + lo, s + lo, i - lo);
  for (; i + 256 <= hi; i += 256) {
    for (int k = 0; k < 4; ++k) _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetch + 64 * k), _MM_HINT_T0);
#if LT_NT == 1
    const __m512i x0 = _mm512_loadu_si512(s + i), x1 = _mm512_loadu_si512(s + i + 64);
    const __m512i x2 = _mm512_loadu_si512(s + i + 128), x3 = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), x0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), x1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), x2);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), x3);
#else
    for (int k = 0; k < 16; ++k) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16 * k), x);
    }
#endif
  }
  std::memcpy(d + i, s + i, hi - i);
  _mm_sfence();   // this thread's streaming stores are visible before the region ends
#else
  std::memcpy(d + lo, s + lo, hi - lo);
#endif
}

}  // namespace

// dst[:] = src[:] for two contiguous CPU uint8 tensors of the same size (non-overlapping).
void stream_copy(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "stream_copy: CPU tensors only");
  TORCH_CHECK(dst.scalar_type() == at::kByte && src.scalar_type() == at::kByte, "stream_copy: uint8 tensors");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "stream_copy: contiguous tensors");
  TORCH_CHECK(dst.numel() == src.numel(), "stream_copy: sizes differ (", dst.numel(), " vs ", src.numel(), ")");
  const int64_t n = src.numel();
  uint8_t* d = dst.data_ptr<uint8_t>();
  const uint8_t* s = src.data_ptr<uint8_t>();
  TORCH_CHECK(d + n <= s || s + n <= d, "stream_copy: buffers overlap");
  at::parallel_for(0, (n + kPiece - 1) / kPiece, 1, [&](int64_t b, int64_t e) {
    copy_piece(d, s, b * kPiece, std::min(n, e * kPiece));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while copying (as torch's own ops do): the copy runs on an I/O thread, and
  // holding it would stall the thread that launches the compute for the copy's whole length.
  m.def("stream_copy", &stream_copy, "copy between CPU byte buffers with non-temporal stores",
        py::call_guard<py::gil_scoped_release>());
}
