// Memory keys per reservation (issue 13), on real processes (`kvrelay up`: cache store, one
// prefill and two decode workers started with --memory-key-scope reservation, a gateway), over
// UCX tcp and over shared memory:
//  - disaggregated tokens equal co-located tokens (prefill writes only through the runs' keys
//    the Reserve response carried);
//  - the decode pool itself is in no peer's region list: nobody can address it;
//  - every per-reservation registration is gone once its request streamed, once it was
//    released, and once it expired (kvrelay:decode_reservation_memory_regions back to 0);
//  - a put through a released reservation's key is refused. tcp and shared memory (cma) apply
//    the bytes before anything checks a key, so what refuses it here is the decode worker's DONE
//    check (the region no longer exists: the put fails, nothing counts); on RDMA the NIC itself
//    would refuse the write (transfer/README.md, "Who may write").

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "transfer/ucx/ucx_transport.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kRequestTimeout = absl::Seconds(90);
constexpr char kRegions[] = "kvrelay:decode_reservation_memory_regions";
constexpr char kRegionsTotal[] = "kvrelay:decode_reservation_memory_regions_total";

GatewayRequest Request(std::vector<int32_t> tokens, int32_t max_tokens) {
  GatewayRequest r;
  r.generation.tokens = std::move(tokens);
  r.generation.max_tokens = max_tokens;
  r.tenant = "keys";
  return r;
}

double Regions(const ServiceInfo& decode) {
  absl::StatusOr<double> v = ScrapeMetric(decode.metrics_address, kRegions);
  return v.ok() ? *v : -1;
}

// Polls until `decode`'s live registrations are `want` (they are unmapped outside the worker's
// lock, right after the event that ended them).
bool RegionsBecome(const ServiceInfo& decode, double want) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up) {
    if (Regions(decode) == want) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

class MemoryKeysPerReservation : public ::testing::TestWithParam<std::string> {};

TEST_P(MemoryKeysPerReservation, TokensEqualColocatedAndKeysDieWithTheirReservation) {
  const std::string tls = GetParam() == "tcp" ? "tcp" : "posix,sysv,cma,self";
  testing::ScopedEnv ucx_tls("UCX_TLS", tls);  // the cluster's processes inherit it
  testing::TempDir dir;
  const std::string model_dir = dir.File("llama");
  KV_ASSERT_OK(WriteModel(model_dir, "llama"));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cli::ColocatedGenerator> reference,
                          cli::ColocatedGenerator::Load(model_dir));
  ClusterOptions options;
  options.model_dir = model_dir;
  options.prefill = 1;
  options.decode = 2;
  options.extra_args = {"--decode-args", "--memory-key-scope reservation --reservation-ttl 2s"};
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));
  EXPECT_THAT(cluster->Log(), HasSubstr("memory keys per reservation"));

  // 1. Disaggregated == co-located, every push through per-reservation keys.
  auto check_tokens = [&](int seed) {
    std::vector<GatewayRequest> requests;
    for (int i = 0; i < 8; ++i) requests.push_back(Request(RandomPrompt(20 + 17 * i, seed + i), 6));
    std::vector<absl::StatusOr<cli::GenerationResult>> results =
        GenerateConcurrently(cluster->gateway(), requests, kRequestTimeout);
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE(results[i].ok()) << "request " << i << ": " << results[i].status() << "\n"
                                   << cluster->Log();
      KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult expected,
                              reference->Generate(requests[i].generation));
      EXPECT_EQ(results[i]->tokens, expected.tokens) << "request " << i;
    }
  };
  check_tokens(100);
  double made = 0;
  for (int d = 0; d < 2; ++d) {
    KV_ASSERT_OK_AND_ASSIGN(ServiceInfo decode, cluster->Service(absl::StrCat("decode-", d)));
    EXPECT_TRUE(RegionsBecome(decode, 0)) << "decode-" << d << ": " << Regions(decode);
    KV_ASSERT_OK_AND_ASSIGN(double total, ScrapeMetric(decode.metrics_address, kRegionsTotal));
    made += total;
  }
  EXPECT_GE(made, 8);  // at least one run per request with pushed blocks

  // 2. A reservation of our own on decode-0: its runs carry keys; the pool is unreachable.
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo decode, cluster->Service("decode-0"));
  auto stub =
      v1::Decode::NewStub(grpc::CreateChannel(decode.address, grpc::InsecureChannelCredentials()));
  v1::DecodeStatusResponse status;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    ASSERT_TRUE(stub->Status(&context, v1::DecodeStatusRequest(), &status).ok());
  }
  auto reserve = [&](const std::string& id) -> absl::StatusOr<v1::ReserveResponse> {
    v1::ReserveRequest request;
    request.set_request_id(id);
    request.set_model(status.model());
    request.set_prompt_tokens(100);
    request.set_max_tokens(1);
    request.set_layout_fingerprint(status.layout_fingerprint());
    v1::ReserveResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = stub->Reserve(&context, request, &response);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return response;
  };
  KV_ASSERT_OK_AND_ASSIGN(v1::ReserveResponse own, reserve("keys-own"));
  int runs = 0;
  for (const v1::GroupTarget& g : own.groups()) {
    runs += g.runs_size();
    for (const v1::SlotRun& run : g.runs()) EXPECT_FALSE(run.memory_key().empty());
  }
  ASSERT_GT(runs, 0);
  EXPECT_EQ(Regions(decode), runs);

  KV_ASSERT_OK_AND_ASSIGN(transfer::TransportPtr writer, transfer::MakeUcxTransport());
  KV_ASSERT_OK_AND_ASSIGN(
      transfer::PeerId peer,
      writer->Connect(own.transport().address(), absl::Now() + absl::Seconds(10),
                      {.peer_key = own.data_plane_key()}));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<transfer::RemoteRegionInfo> published,
                          writer->RemoteRegions(peer));
  for (const v1::GroupTarget& g : own.groups()) {
    for (const transfer::RemoteRegionInfo& r : published) {
      EXPECT_NE(r.id, g.region_id()) << "the decode pool is published";
    }
  }
  const v1::GroupTarget& group = own.groups(0);
  ASSERT_GT(group.runs_size(), 0);
  KV_ASSERT_OK_AND_ASSIGN(transfer::RegionId run_region,
                          writer->ImportRegion(peer, group.runs(0).memory_key()));
  std::vector<uint8_t> bytes(group.block_bytes(), 0x5a);
  KV_ASSERT_OK_AND_ASSIGN(
      transfer::MemoryRegionPtr local,
      writer->RegisterMemory({bytes.data(), bytes.size()}, transfer::MemoryKind::kHost));
  auto put = [&](transfer::RegionId region) -> absl::Status {
    transfer::TransferBatch batch{.peer = peer,
                                  .direction = transfer::Direction::kPut,
                                  .tag = 1,
                                  .credential = own.reservation_token()};
    batch.blocks.push_back({.local = local.get(), .remote_region = region, .length = bytes.size()});
    KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, writer->Prepare(batch));
    KV_ASSIGN_OR_RETURN(transfer::TransferHandlePtr h,
                        writer->Post(plan, transfer::LayerRange::All()));
    return h->Wait(absl::Now() + absl::Seconds(20));
  };
  // The private pool's id is not addressable at all.
  EXPECT_THAT(put(group.region_id()), testing::StatusIs(absl::StatusCode::kNotFound));

  // 3. Released: its registrations go at once (no push was claimed), and a put through the
  //    released key is refused by the decode worker's data plane.
  {
    v1::ReleaseRequest release;
    release.set_request_id("keys-own");
    release.set_reservation_token(own.reservation_token());
    v1::ReleaseResponse ignored;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    ASSERT_TRUE(stub->Release(&context, release, &ignored).ok());
  }
  EXPECT_TRUE(RegionsBecome(decode, 0)) << Regions(decode);
  absl::Status late = put(run_region);
  EXPECT_FALSE(late.ok());
  EXPECT_THAT(late,
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no local region")));

  // 4. Expired: a reservation nobody uses is dropped after --reservation-ttl (at the next
  //    Reserve's sweep), and its registrations with it.
  KV_ASSERT_OK_AND_ASSIGN(v1::ReserveResponse lapsing, reserve("keys-lapsing"));
  int lapsing_runs = 0;
  for (const v1::GroupTarget& g : lapsing.groups()) lapsing_runs += g.runs_size();
  EXPECT_EQ(Regions(decode), lapsing_runs);
  absl::SleepFor(absl::Milliseconds(2500));
  KV_ASSERT_OK_AND_ASSIGN(v1::ReserveResponse sweeper, reserve("keys-sweeper"));
  int sweeper_runs = 0;
  for (const v1::GroupTarget& g : sweeper.groups()) sweeper_runs += g.runs_size();
  EXPECT_TRUE(RegionsBecome(decode, sweeper_runs)) << Regions(decode);

  // 5. The workers still serve the same tokens.
  check_tokens(200);
  local.reset();
  writer.reset();
  absl::StatusOr<int> code = cluster->Stop();
  EXPECT_TRUE(code.ok() && *code == 0) << cluster->Log();
}

INSTANTIATE_TEST_SUITE_P(Transports, MemoryKeysPerReservation, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace kvrelay::e2e
