// The arrival of a call through shared memory, for ranks on one node (mpiallreduce/jax/slots.py
// allocates the window and hands the handler each rank's region): the header that _ffi.cc's
// arrival sends in messages elsewhere (the call's code, and exchange's input where it fits),
// written in place of being sent; and shared_memory, the algorithm that reduces from the regions.
//
//     region of rank r   [ half 0 | half 1 ]          call k uses half k % 2
//     a half             [ k | length | pad to 64 B ][ header, kHeaderMost ][ data, capacity ]
//     rank r, call k     (shared_memory: its input into its half's data), its header, then k (a
//                        release store); for each peer q: wait until q's half k % 2 says k (an
//                        acquire load), then copy q's header out
//     shared_memory      every rank reduces the whole buffer from the ranks' data, in rank order
//                        (rank 0's operand first: the same bits on every rank, as exchange's)
//
// Two halves suffice: a rank writes call k + 2 into the half of call k only once it has read every
// peer's call k + 1, which each peer writes only once it has read call k. A call's number is the
// same on every rank (one count per communicator, every call counted), so a half that says k holds
// call k. The wait spins, then also yields the core (after 64 looks where the node's ranks
// outnumber its cores, else after 16384, tens of microseconds), and, in a timed call, names the
// peers still missing at the deadline.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "_ffi_algorithms.h"

namespace mpiallreduce_jax {

constexpr size_t kSlotLine = 64;  // a half's number and length: a cache line

// Each rank's region, by rank; empty where the communicator spans nodes (messages, then)
struct Slots {
  std::vector<char *> of;
  size_t capacity = 0;  // the data a half holds (slots.py: DATA_BYTES)
  // looks at the peers' halves before a wait also yields the core: few where the node's ranks
  // outnumber its cores (a peer may need this one to arrive), many where each has its own
  int spin_looks = 64;
  size_t Half() const { return kSlotLine + kHeaderMost + capacity; }
  // rank q's data for call ``number``
  char *Data(int q, int64_t number) const {
    return of[q] + static_cast<size_t>(number & 1) * Half() + kSlotLine + kHeaderMost;
  }
};

inline Arrived ArriveInSlots(const Slots &slots, int rank, int size, int64_t number,
                             const char *header, size_t header_bytes, double deadline,
                             std::vector<std::vector<char>> &from, std::vector<size_t> &lengths) {
  Arrived arrived;
  if (from.size() != static_cast<size_t>(size)) from.resize(size);
  if (lengths.size() != static_cast<size_t>(size)) lengths.resize(size);
  const size_t at = static_cast<size_t>(number & 1) * slots.Half();
  char *mine = slots.of[rank] + at;
  std::memcpy(mine + kSlotLine, header, header_bytes);
  reinterpret_cast<uint64_t *>(mine)[1] = header_bytes;
  __atomic_store_n(reinterpret_cast<int64_t *>(mine), number, __ATOMIC_RELEASE);
  char waiting_here[64];  // (by peer: its header awaited; no allocation up to 64 ranks)
  std::vector<char> waiting_more(size > 64 ? size : 0);
  char *waiting = size > 64 ? waiting_more.data() : waiting_here;
  std::fill(waiting, waiting + size, 1);
  waiting[rank] = 0;
  int pending = size - 1;
  for (int looks = 0; pending > 0; ++looks) {
    for (int q = 0; q < size; ++q) {
      if (!waiting[q]) continue;
      const char *theirs = slots.of[q] + at;
      const int64_t said =
          __atomic_load_n(reinterpret_cast<const int64_t *>(theirs), __ATOMIC_ACQUIRE);
      if (said > number) {  // (past this call: never where every call arrives here)
        arrived.ahead = q;
        return arrived;
      }
      if (said != number) continue;
      const size_t length =
          std::min<size_t>(reinterpret_cast<const uint64_t *>(theirs)[1], kHeaderMost);
      if (from[q].size() < kHeaderMost) from[q].resize(kHeaderMost);
      std::memcpy(from[q].data(), theirs + kSlotLine, length);
      lengths[q] = length;
      waiting[q] = 0, --pending;
    }
    if (pending == 0) break;
    if (looks > slots.spin_looks || (looks & 63) == 63) {
      if (deadline != kNever && Now() > deadline) {
        for (int q = 0; q < size; ++q) {
          if (waiting[q]) arrived.late.push_back(q);
        }
        break;
      }
      if (looks > slots.spin_looks) sched_yield();
    }
  }
  return arrived;
}

// ---- shared_memory: the reduction from the regions, once every rank has arrived -------------
//     before the arrival:  every rank --its input--> its half's data (a copy)
//     after it:            every rank reads every rank's data, reduces in rank order into out
// (no wait of its own: the arrival was the one; the halves alternate, so a rank's next input
// never lands on data a peer may still read)
inline void ReduceFromSlots(const Slots &slots, const Job &job, int64_t number) {
  ReduceInRankOrder(job, [&](int q) -> const char * { return slots.Data(q, number); });
}

}  // namespace mpiallreduce_jax
