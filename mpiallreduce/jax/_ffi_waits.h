// Waits with a deadline, and the elementwise reductions, for the XLA FFI handler (_ffi.cc) and its
// algorithms (_ffi_algorithms.h). Header-only: one translation unit, built by handler.py.
//
//     Wait(requests, deadline)   MPI_Testall until done, an MPI error, or the deadline (a peer
//                                late or gone: the caller names it); sched_yield between tests
//                                after the first 64, so ranks that outnumber the cores progress
//     Combine(type, op, acc, in, n)   acc[i] = acc[i] op in[i]   (op: sum, max, min)
#pragma once

#include <mpi.h>
#include <sched.h>
#include <time.h>

#include <complex>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace mpiallreduce_jax {

namespace ffi = xla::ffi;

constexpr double kNever = std::numeric_limits<double>::infinity();

inline double Now() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

inline double WallNow() {
  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

enum class Waited { kDone, kLate, kError };

// Until every request is done (kDone), one fails (kError, *error set), or the deadline passes
// (kLate: the requests still pending are the caller's to name and leave).
inline Waited Wait(int count, MPI_Request *requests, double deadline, int *error) {
  for (int tests = 0;; ++tests) {
    int done = 0;
    *error = MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (*error != MPI_SUCCESS) {
      return Waited::kError;
    }
    if (done) {
      return Waited::kDone;
    }
    if (deadline != kNever && Now() > deadline) {
      return Waited::kLate;
    }
    if (tests > 64) {
      sched_yield();
    }
  }
}

// The ops the Python side names (primitive.OPS)
enum Op : int64_t { kSum = 0, kMax = 1, kMin = 2 };

template <typename T>
void CombineAs(int64_t op, void *acc_bytes, const void *in_bytes, size_t n) {
  T *acc = static_cast<T *>(acc_bytes);
  const T *in = static_cast<const T *>(in_bytes);
  switch (op) {
    case kSum:
      for (size_t i = 0; i < n; ++i) acc[i] += in[i];
      return;
    case kMax:
      if constexpr (!std::is_same_v<T, std::complex<float>> &&
                    !std::is_same_v<T, std::complex<double>>) {
        // (a NaN wins from either side, as XLA's max: the same bits whichever rank reduces)
        for (size_t i = 0; i < n; ++i) acc[i] = in[i] > acc[i] || in[i] != in[i] ? in[i] : acc[i];
      }
      return;
    case kMin:
      if constexpr (!std::is_same_v<T, std::complex<float>> &&
                    !std::is_same_v<T, std::complex<double>>) {
        for (size_t i = 0; i < n; ++i) acc[i] = in[i] < acc[i] || in[i] != in[i] ? in[i] : acc[i];
      }
      return;
  }
}

// acc[i] = acc[i] op in[i] for n elements of ``type``; false for a type it does not take
inline bool Combine(ffi::DataType type, int64_t op, void *acc, const void *in, size_t n) {
  switch (type) {
    case ffi::DataType::S8: CombineAs<int8_t>(op, acc, in, n); return true;
    case ffi::DataType::S16: CombineAs<int16_t>(op, acc, in, n); return true;
    case ffi::DataType::S32: CombineAs<int32_t>(op, acc, in, n); return true;
    case ffi::DataType::S64: CombineAs<int64_t>(op, acc, in, n); return true;
    case ffi::DataType::U8: CombineAs<uint8_t>(op, acc, in, n); return true;
    case ffi::DataType::U16: CombineAs<uint16_t>(op, acc, in, n); return true;
    case ffi::DataType::U32: CombineAs<uint32_t>(op, acc, in, n); return true;
    case ffi::DataType::U64: CombineAs<uint64_t>(op, acc, in, n); return true;
    case ffi::DataType::F32: CombineAs<float>(op, acc, in, n); return true;
    case ffi::DataType::F64: CombineAs<double>(op, acc, in, n); return true;
    case ffi::DataType::C64: CombineAs<std::complex<float>>(op, acc, in, n); return true;
    case ffi::DataType::C128: CombineAs<std::complex<double>>(op, acc, in, n); return true;
    default: return false;
  }
}

}  // namespace mpiallreduce_jax
