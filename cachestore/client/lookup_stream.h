#pragma once

// LookupStream: the client's side of one kvrelay.v1.CacheStore/MatchPrefixStream call, shared by
// every MatchPrefix a CacheStoreClient sends to one store instance (issue 19). A lookup is one
// message each way on the open stream instead of a unary call with its own HTTP/2 stream,
// headers and trailers.
//
// Any number of threads call Lookup() at once (at most kMaxInFlight waiting); writes go out one
// at a time in call order, the store answers in order, and each answer is handed to its caller
// by id. A caller whose deadline passes gets DEADLINE_EXCEEDED at once; its late answer is
// dropped (and a lookup not yet sent is not sent at all).
//
// Coalescing: once the store's initial metadata says it takes batches (kvrelay-lookup-batch), at
// most kMaxMessagesInFlight messages are unanswered at a time; lookups that arrive meanwhile
// wait here and go out together in the next message (`lookups`, up to the limits of
// proto/limits.h), each with what is left of its own deadline, and the store answers them in
// one message. A lone caller thus sends alone and waits for nothing but its answer; many callers
// on one stream pay the per-message costs once per batch. Before that metadata (a new stream's
// first lookup, or an older store) lookups go one per message, pipelined as they come. When the
// stream ends (the store died, drained, stopped leading, or does not know the RPC: UNIMPLEMENTED),
// every waiting caller gets the stream's status with `stream_ended` set and ended() turns true: the
// owner opens a new stream for the next lookup.
//
// Lifetime: the owner must keep a reference until finished() (gRPC has run OnDone), and drop the
// last one on its own thread, never on a gRPC callback thread: the stream's ClientContext holds
// the channel, and a channel released on gRPC 1.51's callback threads tears down the very
// threads it runs on (grpc/grpc#32584: a crash). Cancel() then WaitDone() end it promptly.
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"

namespace kvrelay::cachestore {

class LookupStream final
    : public grpc::ClientBidiReactor<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse> {
 public:
  // Lookups waiting on one stream at most; past it Lookup() answers `not_sent` (the caller
  // uses unary MatchPrefix), so a stalled store cannot pile up unbounded requests.
  static constexpr int kMaxInFlight = 256;
  // Messages written and not yet answered at most, with a store that takes batches: one the
  // store works on and one waiting in its socket, so it never idles between batches.
  static constexpr int kMaxMessagesInFlight = 2;

  struct Result {
    // The lookup's status as MatchPrefix would have returned it (with its ErrorInfo), or, with
    // `stream_ended`, the status that ended the whole stream.
    absl::Status status;
    bool stream_ended = false;
    // The lookup never left this process (kMaxInFlight were waiting, or the stream had ended:
    // then `status` is the stream's end status, as for lookups it was carrying).
    bool not_sent = false;
    v1::MatchPrefixResponse response;
    int64_t term = 0;  // the store's term the answer was decided under (0 without --etcd)
  };

  // Starts the call on `stub` (its channel must stay alive until the stream has ended).
  static std::shared_ptr<LookupStream> Open(v1::CacheStore::Stub* stub);

  // Sends `request` and waits for its answer until `deadline`.
  Result Lookup(const v1::MatchPrefixRequest& request, absl::Time deadline);

  // True once the stream can take no more lookups.
  bool ended() const;
  // Ends the stream (waiting callers get CANCELLED, as the stream's status).
  void Cancel();
  // True once gRPC has finished the call: the object may be destroyed.
  bool finished() const { return finished_.load(std::memory_order_acquire); }
  // Waits until finished(), at most `timeout`. False if it has not finished.
  bool WaitDone(absl::Duration timeout);

  // gRPC's reactions.
  void OnReadInitialMetadataDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  struct Pending {
    absl::Notification done;
    Result result;
    bool sent = false;  // guarded by mu_: its message has been handed to StartWrite
  };
  // A lookup not yet in a message.
  struct Queued {
    uint64_t id = 0;
    v1::MatchPrefixRequest request;
    absl::Time deadline;
  };
  LookupStream() = default;

  // True when the next message may be started now.
  bool CanWriteLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the queued lookups whose callers still wait into out_ (one, or a batch when the store
  // takes them); false when none still waits. Sets writing_ when it returns true.
  bool TakeNextMessageLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands `answer` to its caller (nothing when nobody waits for it any more).
  void Deliver(v1::MatchPrefixStreamResponse& answer, std::shared_ptr<Pending> pending);

  grpc::ClientContext ctx_;
  // Only the reactions touch it: one read is outstanding from Open until OnReadDone(false).
  v1::MatchPrefixStreamResponse read_;
  mutable absl::Mutex mu_;
  // Reads have stopped or a write failed: no new lookups (OnDone follows).
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // OnDone has run: `end_status_` is why the stream ended.
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
  // Lookups not yet in a message, in call order.
  std::deque<Queued> queued_ ABSL_GUARDED_BY(mu_);
  // The message being written while `writing_` (only the thread that set writing_ starts its
  // write, and nothing touches it again until OnWriteDone).
  v1::MatchPrefixStreamRequest out_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Messages whose write was started and whose answer has not come.
  int unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  // The store's initial metadata carries kvrelay-lookup-batch: batches may be sent.
  bool batching_ ABSL_GUARDED_BY(mu_) = false;
  // Set (release) as OnDone's very last access to this object; read (acquire) by finished().
  std::atomic<bool> finished_{false};
};

}  // namespace kvrelay::cachestore
