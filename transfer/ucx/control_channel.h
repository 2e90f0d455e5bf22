#pragma once

// ControlChannel: the transport's TCP control connections, apart from the UCX RMA pipeline.
//
// One plain TCP connection per peer pair carries the hello (protocol version, the peer's
// incarnation and advertised address, then the transport's own part: worker address and
// regions), the transport's frames (regions, DONE/ACK, control messages) and the channel's own
// heartbeats and BYE. The channel decides when a peer is down: EOF or a socket error (process
// death: milliseconds), a malformed frame, a BYE, or nothing received for `peer_timeout`
// (heartbeats every `heartbeat_interval` keep a quiet pair alive). It tells its owner through
// the Delegate; the owner never touches sockets.
//
// Why TCP and not a UCX listener: UCX 1.13's sockaddr listener works over tcp only, so it
// cannot bootstrap a shared-memory-only configuration, and a kernel socket reports the peer
// process's death at once even where UCX endpoints run with error mode NONE.
//
// Thread safety: everything except the constructor runs on the ProgressThread (asserted);
// delegate callbacks run there too, and may call back into the channel (Send, Close).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/check.h"
#include "common/scoped_fd.h"
#include "transfer/transport.h"
#include "transfer/ucx/progress_thread.h"
#include "transfer/ucx/wire.h"

namespace kvrelay::transfer::ucx {

// The caller of Connect() waits on this until the handshake is done or failed.
struct ConnectWaiter {
  absl::Notification done;
  absl::StatusOr<PeerId> result = absl::UnknownError("not connected");
  PeerId peer = 0;  // set once the connection is adopted
  // First call wins.
  void Finish(absl::StatusOr<PeerId> r) {
    if (done.HasBeenNotified()) return;
    result = std::move(r);
    done.Notify();
  }
};

// What the channel itself reads from a peer's hello.
struct PeerHello {
  uint64_t incarnation = 0;
  std::string advertised_address;
};

enum class PeerDownKind {
  kLost,     // the connection failed or went silent: the owner notifies and logs
  kOrderly,  // the peer said BYE: notify, do not log
  kLocal,    // we closed it (Disconnect, shutdown, handshake timeout): no notification
};

class ControlChannel {
 public:
  class Delegate {
   public:
    virtual ~Delegate() = default;
    // Appends the transport's part of our hello (after the channel's own fields).
    virtual void WriteHelloBody(wire::Writer& w) = 0;
    // The peer's hello arrived; `body` is the peer transport's part. An error ends the
    // connection (the waiter, if any, gets it).
    virtual absl::Status OnHello(PeerId peer, bool outgoing, const std::string& address,
                                 const PeerHello& hello, wire::Reader& body) = 0;
    // A frame other than hello, heartbeat and BYE on a connection past its handshake. An
    // error ends the connection as a protocol error.
    virtual absl::Status OnFrame(PeerId peer, wire::FrameType type, wire::Reader& payload) = 0;
    // The connection of a peer whose hello reached OnHello (even if OnHello failed) ended;
    // called once. Not called for connections that never delivered a hello.
    virtual void OnPeerDown(PeerId peer, const absl::Status& why, PeerDownKind kind) = 0;
  };

  struct Options {
    uint64_t incarnation = 0;
    std::string advertised_address;
    absl::Duration heartbeat_interval = absl::Milliseconds(200);
    absl::Duration peer_timeout = absl::Seconds(2);
  };

  // `progress` and `delegate` must outlive the channel. Call Start() on the loop.
  ControlChannel(ProgressThread* progress, Delegate* delegate, Options options);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // --- progress thread only ---
  // Accepts connections on `listener` (already listening).
  void Start(ScopedFd listener);
  // Takes over a connected socket. Outgoing connections send our hello at once; `waiter`
  // (outgoing only) finishes when the handshake completes or fails (PermissionDenied when the
  // peer refused `peer_key`, which our hello presents). Returns the PeerId.
  PeerId Adopt(ScopedFd fd, bool outgoing, std::string address,
               std::shared_ptr<ConnectWaiter> waiter, std::string peer_key = "");
  // Queues a frame; false if the peer is unknown or not past its handshake. Queued frames go
  // out, in order, at the next FlushPending(), so that the frames of one loop turn (the DONEs of
  // several Posts, the ACKs of several DONEs, a heartbeat) share one send(): on this VM a send
  // over loopback costs ~15 us, half of it waking the peer's sleeping thread.
  bool Send(PeerId peer, std::string frame);
  // Writes every queued frame (what the socket takes now; the rest on POLLOUT). The owner calls
  // it once per loop turn, before the loop may sleep.
  void FlushPending();
  // Sends `frame` to every peer past its handshake.
  void Broadcast(const std::string& frame);
  // Ends the connection (with a BYE first if `say_bye`); the delegate hears OnPeerDown(kind)
  // if the peer had finished its handshake. No-op for an unknown peer.
  void Close(PeerId peer, const absl::Status& why, PeerDownKind kind, bool say_bye);
  // Closes every connection (BYE, kLocal) and stops accepting.
  void Shutdown(const absl::Status& why);
  // Heartbeats and liveness; returns when it next wants to run.
  absl::Time Tick(absl::Time now);
  bool IsReady(PeerId peer) const;
  // Non-empty: an incoming hello must carry this key (constant-time compare), or the
  // connection is refused (kRefuse, then closed) before our hello, with the transport's worker
  // address and memory keys, is sent. Applies to connections whose hello arrives later.
  void SetAcceptKey(std::string key) {
    KV_DCHECK(OnLoop());
    accept_key_ = std::move(key);
  }

 private:
  struct Conn;
  void OnListenerReadable();
  void OnConnEvent(PeerId id, short revents);
  void FlushWrites(Conn& c);
  // Parses complete frames from c's read buffer; false if the connection ended meanwhile.
  bool DrainFrames(PeerId id);
  absl::Status HandleHello(Conn& c, wire::Reader& r);
  std::string HelloFrame(const std::string& key);
  Conn* Find(PeerId id);
  bool OnLoop() const { return progress_->IsOnProgressThread(); }

  ProgressThread* const progress_;
  Delegate* const delegate_;
  const Options options_;
  ScopedFd listener_;
  std::string accept_key_;  // progress thread only
  // Progress thread only.
  absl::flat_hash_map<PeerId, std::unique_ptr<Conn>> conns_;
  std::vector<PeerId> unflushed_;  // connections with frames queued since the last flush
  PeerId next_peer_ = 1;
  absl::Time next_check_ = absl::InfinitePast();
};

}  // namespace kvrelay::transfer::ucx
