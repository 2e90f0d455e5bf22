#pragma once

// LookupStream: the client's side of one kvrelay.v1.CacheStore/MatchPrefixStream call, shared by
// every MatchPrefix a CacheStoreClient sends to one store instance (issue 19). A lookup is one
// message each way on the open stream instead of a unary call with its own HTTP/2 stream,
// headers and trailers.
//
// Any number of threads call Lookup() at once (at most kMaxInFlight waiting); writes go out one
// at a time in call order, the store answers in order, and each answer is handed to its caller
// by id. A caller whose deadline passes gets DEADLINE_EXCEEDED at once; its late answer is
// dropped. When the stream ends (the store died, drained, stopped leading, or does not know the
// RPC: UNIMPLEMENTED), every waiting caller gets the stream's status with `stream_ended` set and
// ended() turns true: the owner opens a new stream for the next lookup.
//
// Threading: the stream owns a grpc::CompletionQueue and the callers drive it themselves: one
// waiting caller at a time (the driver) takes the stream's events off the queue on its own
// thread, hands each answer to its caller, and when its own answer is in hands the driving on
// to another waiting caller. A lone caller thus wakes once per lookup, for its own answer, on
// its own thread; with gRPC's callback API each answer was first taken by a gRPC thread and
// then handed over (two wake-ups and a cross-thread hand-off per lookup). Nothing drives the
// queue while no lookup waits, so a lookup that finds the stream idle first takes in what
// happened meanwhile (the store closed the stream, died or drained) without blocking, and is
// refused `not_sent` rather than written to a dead stream.
//
// Lifetime: no gRPC thread ever runs this object's code, so the last reference may be dropped
// on any thread; the destructor cancels an unfinished stream and drains its queue (both local
// and prompt) as gRPC requires before a queue and its call are destroyed. Thread-safe.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"

namespace kvrelay::cachestore {

class LookupStream final {
 public:
  // Lookups waiting on one stream at most; past it Lookup() answers `not_sent` (the caller
  // uses unary MatchPrefix), so a stalled store cannot pile up unbounded requests.
  static constexpr int kMaxInFlight = 256;

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
  ~LookupStream();
  LookupStream(const LookupStream&) = delete;
  LookupStream& operator=(const LookupStream&) = delete;

  // Sends `request` and waits for its answer until `deadline`.
  Result Lookup(const v1::MatchPrefixRequest& request, absl::Time deadline);

  // True once the stream can take no more lookups (it ended as far as this process has seen,
  // or Cancel() was called).
  bool ended() const;
  // Ends the stream (waiting callers get CANCELLED, as the stream's status).
  void Cancel();
  // True once gRPC has finished the call and its queue is drained. Takes in pending events
  // without blocking when no caller drives the queue.
  bool finished();
  // Drives the queue until finished(), at most `timeout`. False if it has not finished.
  bool WaitDone(absl::Duration timeout);

 private:
  // What each operation's completion carries as its tag.
  enum Tag : intptr_t { kStarted = 1, kRead, kWritten, kFinished };
  // One waiting lookup, on its caller's stack; in pending_ while it waits.
  struct Pending {
    absl::CondVar answered;  // or: the driver left, take over
    bool done = false;
    Result result;
  };

  LookupStream() = default;
  // Writes `request` (serialized before Write returns, so it need not outlive the call).
  void StartWrite(const v1::MatchPrefixStreamRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for one event until `until` and handles it; the caller has set driving_. mu_ is
  // released while waiting.
  void DriveOnce(absl::Time until) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Handles every event already there without blocking (takes the driver role for it).
  void PollNow() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Handle(Tag tag, bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When nobody drives and lookups wait, wakes one of them to drive.
  void HandOff() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  // Declared before ctx_ and rw_: the queue outlives the call, as gRPC requires.
  grpc::CompletionQueue cq_;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientAsyncReaderWriter<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse>>
      rw_;
  // The outstanding read's target (one read is outstanding from Open until it fails).
  v1::MatchPrefixStreamResponse read_ ABSL_GUARDED_BY(mu_);
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
  // Operations started whose tags have not come back; the queue is shut down at 0 after done_.
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  // A caller is taking events off cq_ (only one may: answers are handed out in one place).
  bool driving_ ABSL_GUARDED_BY(mu_) = false;
  // Reads have stopped or a write failed: no new lookups (Finish follows).
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Finish has come back: `end_status_` is why the stream ended.
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Pending*> pending_ ABSL_GUARDED_BY(mu_);
  // Lookups not yet written while a write is outstanding (`writing_`), in call order.
  std::deque<v1::MatchPrefixStreamRequest> writes_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // When a lookup last took its answer; a lookup after a longer pause than kIdleBeforePoll
  // first takes in what arrived meanwhile (within it, the previous driver has just done so).
  static constexpr absl::Duration kIdleBeforePoll = absl::Milliseconds(1);
  absl::Time last_driven_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The queue said SHUTDOWN: every tag is back, the object may be destroyed.
  std::atomic<bool> finished_{false};
};

}  // namespace kvrelay::cachestore
