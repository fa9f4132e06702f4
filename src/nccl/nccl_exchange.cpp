// NCCL as the transport of the exchanges in pagedattn/exchange.h (library pagedattn_nccl).
#include <cuda_runtime.h>
#include <nccl.h>

#include "pagedattn/error.h"
#include "pagedattn/nccl.h"

namespace pagedattn::nccl {

namespace {

void check(ncclResult_t result, ncclComm_t comm, const char* call) {
  if (result == ncclSuccess) return;
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  detail::fail<Error>(call, " failed: ", ncclGetErrorString(result),
                      last != nullptr && *last != '\0' ? " (" : "", last != nullptr ? last : "",
                      last != nullptr && *last != '\0' ? ")" : "");
}

// The exchange's all-gathers as one NCCL group (one launch for both buffers). Each is in place
// when the rank's data already is its slot (send == recv + rank * bytes, as NCCL defines it).
// Every rank skips the same empty gathers: bytes depends on the step's T only.
void all_gathers(ncclComm_t comm, const ExchangeGathers& gathers, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  check(ncclGroupStart(), comm, "ncclGroupStart");
  ncclResult_t first = ncclSuccess;
  for (const GatherBuffer& g : gathers) {
    if (g.bytes == 0 || first != ncclSuccess) continue;
    first = ncclAllGather(g.send, g.recv, g.bytes, ncclUint8, comm, s);
  }
  const ncclResult_t end = ncclGroupEnd();  // always closes the group, even after an error
  check(first, comm, "ncclAllGather");
  check(end, comm, "ncclGroupEnd");
}

}  // namespace

void check_comm(ncclComm* comm, int rank, int world, Device device) {
  if (comm == nullptr) detail::fail("nccl: comm is null");
  int count = 0, user_rank = 0, cu_device = 0;
  check(ncclCommCount(comm, &count), comm, "ncclCommCount");
  check(ncclCommUserRank(comm, &user_rank), comm, "ncclCommUserRank");
  check(ncclCommCuDevice(comm, &cu_device), comm, "ncclCommCuDevice");
  if (count != world || user_rank != rank) {
    detail::fail("nccl: the arguments say rank ", rank, " of world ", world,
                 "; the communicator has ", count, " ranks and this process is its rank ",
                 user_rank);
  }
  if (!device.is_cuda() || device.index != cu_device) {
    detail::fail("nccl: the tensors are on ", to_string(device),
                 "; the communicator's GPU is cuda:", cu_device);
  }
}

void dcp_exchange(ncclComm* comm, const Backend& backend, const DcpExchangeArgs& args) {
  check_comm(comm, args.rank, args.world, args.output.device);
  all_gathers(comm, dcp_exchange_begin(args), args.stream);
  dcp_exchange_end(backend, args);
}

void tp_exchange(ncclComm* comm, const TpExchangeArgs& args) {
  check_comm(comm, args.rank, args.world, args.output.device);
  all_gathers(comm, tp_exchange_begin(args), args.stream);
  tp_exchange_end(args);
}

int version() {
  int v = 0;
  check(ncclGetVersion(&v), nullptr, "ncclGetVersion");
  return v;
}

}  // namespace pagedattn::nccl
