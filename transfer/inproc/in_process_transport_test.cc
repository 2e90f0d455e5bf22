#include "transfer/inproc/in_process_transport.h"

#include "kv/pool/block_pool.h"
#include "transfer/region_memory_resource.h"
#include "transfer/testing/transport_conformance.h"

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

// A decode worker's block pool lives in transport memory; a prefill peer pushes into a slot.
TEST(InProcessTransportTest, BlockPoolOverTransportMemoryReceivesBlocks) {
  InboundQueue inbound;  // must outlive the transports that deliver into it
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr decode, MakeInProcessTransport());
  KV_ASSERT_OK_AND_ASSIGN(TransportPtr prefill, MakeInProcessTransport());
  RegionMemoryResource resource(decode.get());
  KV_ASSERT_OK_AND_ASSIGN(
      auto pool, kv::BlockPool::Create({.slot_bytes = 64 << 10, .num_slots = 16}, &resource));
  ASSERT_NE(resource.region(), nullptr);
  EXPECT_EQ(pool->base(), resource.region()->data());
  EXPECT_THAT(resource.Allocate(4096), testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  decode->SetInboundHandler(inbound.Handler());
  KV_ASSERT_OK_AND_ASSIGN(kv::SlotId slot, pool->Allocate());
  const uint64_t offset =
      static_cast<uint8_t*>(pool->SlotAddress(slot)) - resource.region()->data();

  TestBuffer src(64 << 10);
  src.Fill(3);
  KV_ASSERT_OK_AND_ASSIGN(MemoryRegionPtr src_region,
                          prefill->RegisterMemory(src.span(), MemoryKind::kHost));
  KV_ASSERT_OK_AND_ASSIGN(PeerId peer, prefill->Connect(decode->address(), absl::InfiniteFuture()));
  TransferBatch batch{.peer = peer, .direction = Direction::kPut, .tag = 77};
  batch.blocks.push_back({.local = src_region.get(),
                          .remote_region = resource.region()->id(),
                          .remote_offset = offset,
                          .length = 64 << 10});
  KV_ASSERT_OK_AND_ASSIGN(TransferPlan plan, prefill->Prepare(batch));
  KV_ASSERT_OK_AND_ASSIGN(TransferHandlePtr h, prefill->Post(plan, LayerRange::All()));
  KV_ASSERT_OK(h->Wait(absl::Now() + absl::Seconds(10)));
  KV_ASSERT_OK_AND_ASSIGN(InboundEvent ev, inbound.Next(absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(ev.tag, 77u);
  KV_EXPECT_OK(ev.status);
  EXPECT_EQ(std::memcmp(pool->SlotAddress(slot), src.data(), 64 << 10), 0);
  src_region.reset();
  pool.reset();
  EXPECT_EQ(resource.region(), nullptr);
}

}  // namespace
}  // namespace kvrelay::transfer
