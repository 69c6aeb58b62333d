// Waits with a deadline, and the elementwise reductions, for the XLA FFI handler (_ffi.cc) and its
// algorithms (_ffi_algorithms.h). Header-only: one translation unit, built by handler.py.
//
//     Wait(requests, deadline)   MPI_Testall until done, an MPI error, or the deadline (a peer
//                                late or gone: the caller names it); sched_yield between tests
//                                after the first 64, so ranks that outnumber the cores progress
//     Combine(type, op, acc, in, n, order)   acc[i] = acc[i] op in[i], or in[i] op acc[i]
//                                            (op: sum, max, min; the order fixes the bits)
#pragma once

#include <mpi.h>
#include <sched.h>
#include <time.h>

#include <complex>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace mpiallreduce_jax {

namespace ffi = xla::ffi;

constexpr double kNever = std::numeric_limits<double>::infinity();

inline double Now() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// (the flight recorder's times: the kernel's tick, a millisecond or so, read without a system
// call or a time-stamp counter: a few nanoseconds, where a call of 4 bytes takes 700)
inline double WallNow() {
  timespec now;
  clock_gettime(CLOCK_REALTIME_COARSE, &now);
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

// a op b, ``a`` the first operand: the order matters to the bits (a NaN's payload, which of
// two equal zeros); a NaN wins max and min from either side, as XLA's
template <typename T>
inline T Apply(int64_t op, T a, T b) {
  if constexpr (std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>) {
    return a + b;  // (complex: sums only; collectives.py refuses their max and min)
  } else {
    switch (op) {
      case kMax: return b > a || b != b ? b : a;
      case kMin: return b < a || b != b ? b : a;
      default:
        if constexpr (std::is_floating_point_v<T>) {
          T sum = a + b;  // (a NaN's payload: the first NaN operand's, whichever order the
          return sum != sum ? (a != a ? a : b != b ? b : sum) : sum;  // CPU adds them in)
        } else {
          return a + b;
        }
    }
  }
}

// Which operand comes first in Combine: this rank's (``acc``) or the incoming one
enum Order { kMineFirst, kTheirsFirst };

template <typename T>
void CombineAs(int64_t op, void *acc_bytes, const void *in_bytes, size_t n, Order order) {
  T *acc = static_cast<T *>(acc_bytes);
  const T *in = static_cast<const T *>(in_bytes);
  if (order == kMineFirst) {
    for (size_t i = 0; i < n; ++i) acc[i] = Apply(op, acc[i], in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] = Apply(op, in[i], acc[i]);
  }
}

// acc[i] = acc[i] op in[i] (kMineFirst) or in[i] op acc[i] (kTheirsFirst), n elements of
// ``type``; false for a type it does not take
inline bool Combine(ffi::DataType type, int64_t op, void *acc, const void *in, size_t n,
                    Order order = kMineFirst) {
  switch (type) {
    case ffi::DataType::S8: CombineAs<int8_t>(op, acc, in, n, order); return true;
    case ffi::DataType::S16: CombineAs<int16_t>(op, acc, in, n, order); return true;
    case ffi::DataType::S32: CombineAs<int32_t>(op, acc, in, n, order); return true;
    case ffi::DataType::S64: CombineAs<int64_t>(op, acc, in, n, order); return true;
    case ffi::DataType::U8: CombineAs<uint8_t>(op, acc, in, n, order); return true;
    case ffi::DataType::U16: CombineAs<uint16_t>(op, acc, in, n, order); return true;
    case ffi::DataType::U32: CombineAs<uint32_t>(op, acc, in, n, order); return true;
    case ffi::DataType::U64: CombineAs<uint64_t>(op, acc, in, n, order); return true;
    case ffi::DataType::F32: CombineAs<float>(op, acc, in, n, order); return true;
    case ffi::DataType::F64: CombineAs<double>(op, acc, in, n, order); return true;
    case ffi::DataType::C64: CombineAs<std::complex<float>>(op, acc, in, n, order); return true;
    case ffi::DataType::C128: CombineAs<std::complex<double>>(op, acc, in, n, order); return true;
    default: return false;
  }
}

}  // namespace mpiallreduce_jax
