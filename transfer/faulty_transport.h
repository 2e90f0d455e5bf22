#pragma once

// FaultyTransport: a decorator around any Transport that injects faults into Post():
//   - drop:        the transfer never starts; its handle ends only by Cancel() or its deadline
//   - delay:       the transfer starts `delay` after Post()
//   - fail_after:  the first N posts go through; every later one fails with Unavailable
//   - corrupt:     put: one byte of each posted layer's first block is flipped on the wire
//                  (after its checksum was taken), so the receiver sees DataLoss;
//                  get: one byte of the first block is flipped after it arrived, so the
//                  expected checksum fails with DataLoss
// Everything else is forwarded unchanged. Faults can be changed at any time (thread-safe).
// The inner transport must outlive nothing else: the decorator owns it.

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/time/time.h"
#include "transfer/transport.h"

namespace kvrelay::transfer {

struct FaultSpec {
  bool drop = false;
  absl::Duration delay = absl::ZeroDuration();
  int64_t fail_after = -1;  // < 0: never
  bool corrupt = false;
  // Set: the faults above apply only to posts of this direction; others pass unchanged.
  std::optional<Direction> only = std::nullopt;
};

class FaultyTransport final : public Transport {
 public:
  explicit FaultyTransport(TransportPtr inner, FaultSpec spec = {});
  ~FaultyTransport() override;

  void SetFaults(FaultSpec spec);
  int64_t posts() const;  // Post() calls so far
  Transport& inner() { return *inner_; }

  Capabilities capabilities() const override { return inner_->capabilities(); }
  std::string address() const override { return inner_->address(); }
  uint64_t incarnation() const override { return inner_->incarnation(); }
  absl::StatusOr<MemoryRegionPtr> RegisterMemory(MemorySpan span, MemoryKind kind) override {
    return inner_->RegisterMemory(span, kind);
  }
  absl::StatusOr<MemoryRegionPtr> AllocateMemory(size_t bytes) override {
    return inner_->AllocateMemory(bytes);
  }
  using Transport::Connect;
  absl::StatusOr<PeerId> Connect(std::string_view address, absl::Time deadline,
                                 const ConnectOptions& options) override {
    return inner_->Connect(address, deadline, options);
  }
  absl::Status Disconnect(PeerId peer) override { return inner_->Disconnect(peer); }
  absl::StatusOr<std::vector<RemoteRegionInfo>> RemoteRegions(PeerId peer) const override {
    return inner_->RemoteRegions(peer);
  }
  absl::StatusOr<PeerStatus> GetPeerStatus(PeerId peer) const override {
    return inner_->GetPeerStatus(peer);
  }
  std::vector<PeerId> Peers() const override { return inner_->Peers(); }
  absl::StatusOr<TransferPlan> Prepare(const TransferBatch& batch) override {
    return inner_->Prepare(batch);
  }
  absl::StatusOr<TransferHandlePtr> Post(const TransferPlan& plan, LayerRange layers,
                                         PostOptions options = {}) override;
  absl::Status SendControl(PeerId peer, uint64_t tag, std::string_view message) override {
    return inner_->SendControl(peer, tag, message);
  }
  void SetInboundHandler(InboundHandler handler) override {
    inner_->SetInboundHandler(std::move(handler));
  }
  void SetAcceptKey(std::string key) override { inner_->SetAcceptKey(std::move(key)); }
  absl::StatusOr<MemoryRegionPtr> AllocatePrivateMemory(size_t bytes) override {
    return inner_->AllocatePrivateMemory(bytes);
  }
  absl::StatusOr<MemoryRegionPtr> RegisterPrivateMemory(MemorySpan span, MemoryKind kind) override {
    return inner_->RegisterPrivateMemory(span, kind);
  }
  absl::StatusOr<std::string> ExportRegion(const MemoryRegion& region) const override {
    return inner_->ExportRegion(region);
  }
  absl::StatusOr<RegionId> ImportRegion(PeerId peer, std::string_view exported) override {
    return inner_->ImportRegion(peer, exported);
  }
  absl::Status ForgetRegion(PeerId peer, RegionId region) override {
    return inner_->ForgetRegion(peer, region);
  }

 private:
  class Impl;
  TransportPtr inner_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::transfer
