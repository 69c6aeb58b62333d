// The algorithms the XLA FFI handler (_ffi.cc) runs, one per section, each on a Job: the call's
// buffer ``out`` (holding this rank's input at the start, the result at the end), its
// communicator, its tags and its deadline. Which one runs is the project's choice, made in Python
// when the call is traced (mpiallreduce/jax/primitive.py: the planner's ``auto``, mapped onto
// these). Every wait has the deadline; where it passes, the Outcome names the peer waited on.
// Each result is the same bits on every rank (each element reduced once, or in rank order).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "_ffi_waits.h"

namespace mpiallreduce_jax {

// What a communicator's calls reuse, call after call (grown, never shrunk: no allocation, no
// page touched for the first time, once the sizes settle); calls on one communicator are ordered.
struct Scratch {
  std::vector<char> incoming, message, timed;
  std::vector<std::vector<char>> from, tails;
  std::vector<size_t> lengths;  // (Arrive's: the bytes of each peer's header)
};

inline char *Room(std::vector<char> &buffer, size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

struct Job {
  MPI_Comm comm;
  int rank, size, tag;
  ffi::DataType type;
  MPI_Datatype datatype;
  int64_t op;
  size_t count, width;  // elements, bytes each
  char *out;
  double deadline;
  Scratch *scratch;
};

struct Outcome {
  Waited how = Waited::kDone;
  int error = MPI_SUCCESS;
  int late = -1;  // the peer waited on when the deadline passed (-1: MPI's collective, unknown)
};

// A given-up call's requests: cancelled, then waited for a second (a cancelled request completes);
// any still pending (a message already matched, a send under way) freed, and true returned: the
// caller keeps its buffers alive for good (Graveyard), since MPI may yet write them.
inline bool Leave(int count, MPI_Request *requests) {
  bool any = false;
  for (int i = 0; i < count; ++i) {
    if (requests[i] != MPI_REQUEST_NULL) {
      MPI_Cancel(&requests[i]);
      any = true;
    }
  }
  if (!any) return false;
  int error = MPI_SUCCESS;
  if (Wait(count, requests, Now() + 1.0, &error) == Waited::kDone) return false;
  for (int i = 0; i < count; ++i) {
    if (requests[i] != MPI_REQUEST_NULL) MPI_Request_free(&requests[i]);
  }
  return true;
}

// Buffers that MPI may still write (Leave returned true): never freed.
inline void Graveyard(std::vector<char> &&buffer) {
  static std::vector<std::vector<char>> *kept = new std::vector<std::vector<char>>();
  kept->push_back(std::move(buffer));
}

// One exchange with peers ``to`` (send) and ``from`` (receive), waited for.
inline Outcome Exchange(const Job &job, const void *send, size_t send_count, int to, void *receive,
                        size_t receive_count, int from) {
  Outcome outcome;
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  outcome.error = receive ? MPI_Irecv(receive, static_cast<int>(receive_count), job.datatype,
                                      from, job.tag, job.comm, &requests[0])
                          : MPI_SUCCESS;
  if (outcome.error == MPI_SUCCESS && send) {
    outcome.error = MPI_Isend(send, static_cast<int>(send_count), job.datatype, to, job.tag,
                              job.comm, &requests[1]);
  }
  if (outcome.error == MPI_SUCCESS) {
    outcome.how = Wait(2, requests, job.deadline, &outcome.error);
  } else {
    outcome.how = Waited::kError;
  }
  if (outcome.how != Waited::kDone) {
    outcome.late = receive ? from : to;
    Leave(2, requests);  // (the buffers: the job's and its algorithm's, kept by RunRing & co.)
  }
  return outcome;
}

// ---- mpi: MPI's own allreduce, in place ------------------------------------------------------
//     every rank --MPI_Allreduce(IN_PLACE)--> every rank    (untimed: the blocking call itself;
//                                                            timed: MPI_Iallreduce, waited for)
inline Outcome RunMpi(const Job &job) {
  Outcome outcome;
  MPI_Op op = job.op == kSum ? MPI_SUM : job.op == kMax ? MPI_MAX : MPI_MIN;
  if (job.deadline == kNever) {
    outcome.error = MPI_Allreduce(MPI_IN_PLACE, job.out, static_cast<int>(job.count),
                                  job.datatype, op, job.comm);
    outcome.how = outcome.error == MPI_SUCCESS ? Waited::kDone : Waited::kError;
    return outcome;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  outcome.error = MPI_Iallreduce(MPI_IN_PLACE, job.out, static_cast<int>(job.count), job.datatype,
                                 op, job.comm, &request);
  outcome.how = outcome.error == MPI_SUCCESS ? Wait(1, &request, job.deadline, &outcome.error)
                                             : Waited::kError;
  return outcome;  // (a late collective's request is left: MPI cannot cancel one)
}

// ---- reduce_bcast: a reduce to rank 0, then its broadcast -------------------------------------
//     step 1:  every rank --MPI_Reduce--> rank 0
//     step 2:  rank 0 --MPI_Bcast--> every rank
inline Outcome RunReduceBcast(const Job &job) {
  Outcome outcome;
  MPI_Op op = job.op == kSum ? MPI_SUM : job.op == kMax ? MPI_MAX : MPI_MIN;
  MPI_Request request = MPI_REQUEST_NULL;
  int count = static_cast<int>(job.count);
  outcome.error = MPI_Ireduce(job.rank == 0 ? MPI_IN_PLACE : job.out, job.out, count,
                              job.datatype, op, 0, job.comm, &request);
  if (outcome.error == MPI_SUCCESS) {
    outcome.how = Wait(1, &request, job.deadline, &outcome.error);
  }
  if (outcome.error == MPI_SUCCESS && outcome.how == Waited::kDone) {
    outcome.error = MPI_Ibcast(job.out, count, job.datatype, 0, job.comm, &request);
    if (outcome.error == MPI_SUCCESS) {
      outcome.how = Wait(1, &request, job.deadline, &outcome.error);
    }
  }
  if (outcome.error != MPI_SUCCESS) {
    outcome.how = Waited::kError;
  }
  return outcome;
}

// ---- ring: a reduce-scatter, then an allgather, around the ring ---------------------------------
//     segments 0..p-1 of the buffer; rank r sends to r+1 and receives from r-1, p-1 steps each:
//     reduce-scatter, step s:  send segment r-s, receive r-s-1 and reduce it into its own
//                              (after p-1 steps, rank r holds segment r+1 reduced by all)
//     allgather, step s:       send segment r+1-s, receive segment r-s into place
inline Outcome RunRing(const Job &job) {
  const int p = job.size, r = job.rank, left = (r - 1 + p) % p, right = (r + 1) % p;
  const size_t base = job.count / p, extra = job.count % p;
  auto start = [&](int i) { return i * base + std::min<size_t>(i, extra); };
  auto length = [&](int i) { return base + (static_cast<size_t>(i) < extra ? 1 : 0); };
  std::vector<char> &incoming = job.scratch->incoming;
  Room(incoming, (base + 1) * job.width);
  for (int s = 0; s < p - 1; ++s) {
    int sent = ((r - s) % p + p) % p, received = ((r - s - 1) % p + p) % p;
    Outcome outcome = Exchange(job, job.out + start(sent) * job.width, length(sent), right,
                               incoming.data(), length(received), left);
    if (outcome.how != Waited::kDone) {
      Graveyard(std::move(incoming));  // (a receive MPI may yet complete: kept)
      return outcome;
    }
    Combine(job.type, job.op, job.out + start(received) * job.width, incoming.data(),
            length(received));
  }
  for (int s = 0; s < p - 1; ++s) {
    int sent = ((r + 1 - s) % p + p) % p, received = ((r - s) % p + p) % p;
    Outcome outcome = Exchange(job, job.out + start(sent) * job.width, length(sent), right,
                               job.out + start(received) * job.width, length(received), left);
    if (outcome.how != Waited::kDone) {
      return outcome;
    }
  }
  return Outcome{};
}

// ---- recursive_doubling: whole buffers exchanged with partners 1, 2, 4, ... apart ---------------
//     p not a power of two (p = 2^k + m): ranks 0..2m-1 pair up first, the even one's buffer
//     going to the odd one, which goes on as one of the 2^k; at the end the odd one sends the
//     result back. Round j: rank (renumbered) n exchanges with n xor 2^j and reduces, the lower
//     rank's operand first on both sides: the same bits on both (a NaN's payload, a zero's sign).
inline Outcome RunRecursiveDoubling(const Job &job) {
  const int p = job.size, r = job.rank;
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  const int rem = p - pof2;
  std::vector<char> &incoming = job.scratch->incoming;
  Room(incoming, job.count * job.width);
  int renumbered;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      Outcome outcome = Exchange(job, job.out, job.count, r + 1, nullptr, 0, -1);
      if (outcome.how != Waited::kDone) {
        return outcome;
      }
      renumbered = -1;
    } else {
      Outcome outcome = Exchange(job, nullptr, 0, -1, incoming.data(), job.count, r - 1);
      if (outcome.how != Waited::kDone) {
        Graveyard(std::move(incoming));
        return outcome;
      }
      Combine(job.type, job.op, job.out, incoming.data(), job.count, kTheirsFirst);
      renumbered = r / 2;
    }
  } else {
    renumbered = r - rem;
  }
  if (renumbered >= 0) {
    for (int mask = 1; mask < pof2; mask <<= 1) {
      int other = renumbered ^ mask, peer = other < rem ? other * 2 + 1 : other + rem;
      Outcome outcome =
          Exchange(job, job.out, job.count, peer, incoming.data(), job.count, peer);
      if (outcome.how != Waited::kDone) {
        Graveyard(std::move(incoming));
        return outcome;
      }
      Combine(job.type, job.op, job.out, incoming.data(), job.count,
              peer < r ? kTheirsFirst : kMineFirst);
    }
  }
  if (r < 2 * rem) {
    return r % 2 ? Exchange(job, job.out, job.count, r - 1, nullptr, 0, -1)
                 : Exchange(job, nullptr, 0, -1, job.out, job.count, r + 1);
  }
  return Outcome{};
}

// ---- the arrival, and exchange: every rank's message to every peer --------------------------
//     rank r --[header: code, tail length, small input]--> every peer q   (tag)
//            --[tail: a larger input, if any]----------------> every peer q   (tag + 1)
//     one round, p - 1 messages each way (two where there is a tail). Every call starts so:
//     ``exchange`` carries its input (the reduction is then local), the other algorithms their
//     code alone. No receive is ever shorter than what comes (Open MPI writes a longer message
//     past a shorter receive's end): every header is at most kHeaderMost bytes, each received
//     into that much, posted ahead; a tail is received once its header has said its length.
//     So a peer whose call has another size or algorithm is a mismatch, never a hang; a peer
//     missing at the deadline is named (``late``).
//     exchange's reduction: every rank reduces the p inputs in rank order, the same bits everywhere.
constexpr size_t kHeaderMost = 4096;
constexpr size_t kNoTail = static_cast<size_t>(-1);

struct Arrived {
  int error = MPI_SUCCESS;
  std::vector<int> late;
  bool left = false;  // requests left with MPI: the caller keeps its message alive (Graveyard)
  int ahead = -1;     // a peer already past this call (the shared regions' numbers): out of step
};

// ``from[q]``: peer q's header, ``lengths[q]`` how many of its bytes came (``from[q]`` keeps
// kHeaderMost bytes: no clearing of it per call), ``tails[q]`` its tail; this rank's own are not
// copied there. ``header`` at most kHeaderMost bytes; ``tail_length_at``: where in a
// header the (int64) length of its tail is, kNoTail where messages have none.
inline Arrived Arrive(MPI_Comm comm, int rank, int size, int tag, const char *header,
                      size_t header_bytes, const char *tail, size_t tail_bytes,
                      size_t tail_length_at, double deadline,
                      std::vector<std::vector<char>> &from, std::vector<size_t> &lengths,
                      std::vector<std::vector<char>> *tails = nullptr) {
  Arrived arrived;
  if (from.size() != static_cast<size_t>(size)) from.resize(size);
  if (lengths.size() != static_cast<size_t>(size)) lengths.resize(size);
  if (tails && tails->size() != static_cast<size_t>(size)) tails->resize(size);
  const int slots = 2 * size;  // (requests: q's header at q, q's tail at size + q)
  MPI_Request sends_here[16], receives_here[16];  // (no allocation up to 8 ranks)
  std::vector<MPI_Request> sends_more, receives_more;
  MPI_Request *sends = sends_here, *receives = receives_here;
  if (size > 8) {
    sends_more.resize(slots), receives_more.resize(slots);
    sends = sends_more.data(), receives = receives_more.data();
  }
  std::fill(sends, sends + slots, MPI_REQUEST_NULL);
  std::fill(receives, receives + slots, MPI_REQUEST_NULL);
  char waiting_here[8];  // (by peer: 1, its header is awaited; 2, its tail; 0, neither)
  std::vector<char> waiting_more(size > 8 ? size : 0);
  char *waiting = size > 8 ? waiting_more.data() : waiting_here;
  std::fill(waiting, waiting + size, 0);
  int &error = arrived.error, pending = 0;
  for (int q = 0; q < size && error == MPI_SUCCESS; ++q) {
    if (q == rank) continue;
    if (from[q].size() < kHeaderMost) from[q].resize(kHeaderMost);
    error = MPI_Irecv(from[q].data(), static_cast<int>(kHeaderMost), MPI_BYTE, q, tag, comm,
                      &receives[q]);
    waiting[q] = 1, ++pending;
  }
  // (an untimed call's header goes by MPI_Send, as MPI's own small allreduce sends: no request to
  // make and complete. Every rank posts all its receives before its first send, so each send
  // finds its receive posted; a timed call's sends are nonblocking, bounded by the deadline)
  const bool blocking = deadline == kNever;
  for (int q = 0; q < size && error == MPI_SUCCESS; ++q) {
    if (q == rank) continue;
    error = blocking ? MPI_Send(header, static_cast<int>(header_bytes), MPI_BYTE, q, tag, comm)
                     : MPI_Isend(header, static_cast<int>(header_bytes), MPI_BYTE, q, tag, comm,
                                 &sends[q]);
    if (error == MPI_SUCCESS && tail_bytes) {
      error = MPI_Isend(tail, static_cast<int>(tail_bytes), MPI_BYTE, q, tag + 1, comm,
                        &sends[size + q]);
    }
  }
  // (peer q's message came, with ``status``: its header's length, and its tail awaited where it
  // has one)
  auto took = [&](int q, const MPI_Status &status) {
    int64_t theirs = 0;
    if (waiting[q] == 1) {  // (its header: its length, and the length of a tail to come)
      int length = 0;
      MPI_Get_count(&status, MPI_BYTE, &length);
      lengths[q] = static_cast<size_t>(length);
      if (tail_length_at != kNoTail && static_cast<size_t>(length) >= tail_length_at + 8) {
        std::memcpy(&theirs, from[q].data() + tail_length_at, 8);
      }
    }
    if (theirs > 0 && tails && theirs < (int64_t{1} << 31)) {
      (*tails)[q].resize(theirs);
      error = MPI_Irecv((*tails)[q].data(), static_cast<int>(theirs), MPI_BYTE, q, tag + 1,
                        comm, &receives[size + q]);
      waiting[q] = 2;
    } else {
      waiting[q] = 0, --pending;
    }
  };
  for (int tests = 0; error == MPI_SUCCESS && pending > 0; ++tests) {
    if (blocking) {  // (untimed: MPI's own wait, as for its own small allreduce)
      int index = MPI_UNDEFINED;
      MPI_Status status;
      error = MPI_Waitany(slots, receives, &index, &status);
      if (error != MPI_SUCCESS || index == MPI_UNDEFINED) break;
      took(index % size, status);
      continue;
    }
    for (int q = 0; q < size && error == MPI_SUCCESS; ++q) {
      if (!waiting[q]) continue;
      int done = 0;
      MPI_Status status;
      error = MPI_Test(&receives[waiting[q] == 1 ? q : size + q], &done, &status);
      if (error == MPI_SUCCESS && done) took(q, status);
    }
    if (pending > 0 && deadline != kNever && Now() > deadline) {
      for (int q = 0; q < size; ++q) {
        if (waiting[q]) arrived.late.push_back(q);
      }
      break;
    }
    if (tests > 64) sched_yield();
  }
  if (error == MPI_SUCCESS && arrived.late.empty()) {
    Wait(slots, sends, deadline, &error);  // (received everywhere: done, or soon)
  }
  arrived.left = Leave(slots, sends);
  if (Leave(slots, receives) || arrived.left) {
    arrived.left = true;
    for (auto &buffer : from) Graveyard(std::move(buffer));  // (moved: the same memory)
    if (tails) {
      for (auto &buffer : *tails) Graveyard(std::move(buffer));
    }
  }
  return arrived;
}

// exchange's result: ``out`` = the inputs in rank order (``input(q)``: rank q's; this rank's
// may be ``out`` itself, in place)
template <typename Input>
inline void ReduceInRankOrder(const Job &job, Input input) {
  const size_t block = job.count * job.width;
  const char *own = input(job.rank);
  if (job.size == 2) {  // (rank 0's operand first on both: the same bits)
    if (job.out != own) std::memcpy(job.out, own, block);
    Combine(job.type, job.op, job.out, input(1 - job.rank), job.count,
            job.rank == 0 ? kMineFirst : kTheirsFirst);
    return;
  }
  char *acc = job.out;
  if (own == job.out && job.rank != 0) {  // (the output holds this rank's input: reduce aside)
    acc = Room(job.scratch->incoming, block);
  }
  if (acc != input(0)) std::memcpy(acc, input(0), block);
  for (int q = 1; q < job.size; ++q) Combine(job.type, job.op, acc, input(q), job.count);
  if (acc != job.out) std::memcpy(job.out, acc, block);
}

}  // namespace mpiallreduce_jax
