#include "transfer/inproc/in_process_transport.h"

#include "transfer/transport_conformance.h"

namespace kvrelay::transfer {
namespace {

INSTANTIATE_TEST_SUITE_P(InProcess, TransportConformanceTest,
                         ::testing::Values(TransportFactory{
                             "inproc", {}, [] { return MakeInProcessTransport(); }}),
                         TransportFactoryName);

TEST(InProcessTransportTest, NamesAreUniqueAndAddressesResolve) {
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr a, MakeInProcessTransport({.name = "prefill-0"}));
  EXPECT_EQ(a->address(), "inproc:prefill-0");
  EXPECT_THAT(MakeInProcessTransport({.name = "prefill-0"}),
              testing::StatusIs(absl::StatusCode::kAlreadyExists));
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr b, MakeInProcessTransport());
  EXPECT_THAT(b->Connect("inproc:nobody", absl::Now() + absl::Seconds(1)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(a->Connect(a->address(), absl::Now() + absl::Seconds(1)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a->RegisterMemory(MemorySpan{&a, 8}, MemoryKind::kDevice),
              testing::StatusIs(absl::StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace kvrelay::transfer
