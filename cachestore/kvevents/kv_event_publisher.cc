#include "cachestore/kvevents/kv_event_publisher.h"

#include <zmq.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cachestore/kvevents/vllm_codec.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace kvrelay::cachestore::kvevents {
namespace {

using ContextPtr = std::unique_ptr<void, int (*)(void*)>;
using SocketPtr = std::unique_ptr<void, int (*)(void*)>;

constexpr size_t kMaxEventsPerBatch = 1024;

std::string BigEndian(int64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<char>(v & 0xFF);
    v = static_cast<int64_t>(static_cast<uint64_t>(v) >> 8);
  }
  return out;
}

absl::Status ZmqError(std::string_view what) {
  return absl::UnavailableError(absl::StrCat(std::string(what), ": ", zmq_strerror(zmq_errno())));
}

std::optional<std::string> MediumOf(const NodeSpec& spec) {
  std::optional<Tier> tier;
  for (const SegmentSpec& s : spec.segments) {
    // A disk tier's blocks come with their own events (StoreEvent::tier kSsd: "DISK").
    if (s.tier == Tier::kSsd) continue;
    if (tier && *tier != s.tier) return std::nullopt;  // mixed tiers: unknown per block
    tier = s.tier;
  }
  if (!tier) return std::nullopt;
  switch (*tier) {
    case Tier::kGpu:
      return "GPU";
    case Tier::kHost:
      return "CPU";
    default:
      return std::nullopt;
  }
}

constexpr size_t kZ85KeyChars = 40;  // a 32-byte CURVE key in Z85
constexpr size_t kKeyBytes = 32;
// Where libzmq sends ZAP requests (RFC 27): one handler per context.
constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";

// A 32-byte CURVE key from its Z85 text; InvalidArgument naming `what` otherwise.
absl::StatusOr<std::string> DecodeZ85Key(absl::string_view text, const std::string& what) {
  text = absl::StripAsciiWhitespace(text);
  if (text.size() != kZ85KeyChars) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a CURVE key is ", kZ85KeyChars,
                                                   " characters of Z85, got ", text.size()));
  }
  const std::string z85(text);
  std::string key(kKeyBytes, '\0');
  if (zmq_z85_decode(reinterpret_cast<uint8_t*>(key.data()), z85.c_str()) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a Z85 CURVE key"));
  }
  return key;
}

// One multipart message (every frame), or nothing when none is waiting.
std::vector<std::string> ReceiveFrames(void* socket) {
  std::vector<std::string> frames;
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, frames.empty() ? ZMQ_DONTWAIT : 0) < 0) {
      zmq_msg_close(&msg);
      return frames;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    const bool more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
    if (!more) return frames;
  }
}

}  // namespace

void AddKvEventsFlags(FlagSet& flags, KvEventsOptions* o) {
  flags.AddString("kv-events-endpoint", &o->endpoint,
                  "bind a ZeroMQ PUB socket here and publish block events in vLLM's KV-event "
                  "format (e.g. tcp://127.0.0.1:5557); empty = off");
  flags.AddString("kv-events-replay-endpoint", &o->replay_endpoint,
                  "bind the ROUTER socket answering vLLM replay requests here; empty = off");
  flags.AddString("kv-events-model", &o->model, "model name in the topic kv@<node>@<model>");
  flags.AddInt32("kv-events-block-size", &o->block_size,
                 "tokens per block, sent as BlockStored.block_size; defaults to --block-tokens "
                 "and must equal it");
  flags.AddInt64("kv-events-replay-batches", &o->replay_batches,
                 "batches kept for replay (all topics together)");
  flags.AddString("kv-events-curve-secret-key-file", &o->curve_secret_key_file,
                  "ZeroMQ CURVE: file with this publisher's secret key (40 characters of Z85); "
                  "required for --kv-events-endpoint unless --insecure");
  flags.AddString("kv-events-curve-clients-file", &o->curve_clients_file,
                  "ZeroMQ CURVE: file with the public keys (Z85, one per line) of the "
                  "subscribers allowed to connect; nobody else is");
}

struct KvEventPublisher::Impl {
  Impl(CacheStore* s, KvEventsOptions o)
      : store(s),
        options(std::move(o)),
        context(nullptr, zmq_ctx_term),
        pub(nullptr, zmq_close),
        replay(nullptr, zmq_close),
        zap(nullptr, zmq_close) {}

  struct Retained {
    std::string topic;
    int64_t sequence;
    std::string payload;
  };

  CacheStore* const store;
  const KvEventsOptions options;
  // Declared in creation order: the sockets close before the context terminates.
  ContextPtr context;
  SocketPtr pub;
  SocketPtr replay;
  SocketPtr zap;  // the ZAP handler's REP socket (CURVE only); owned by zap_thread
  std::atomic<bool> stop{false};
  std::thread thread;
  std::thread zap_thread;
  // Raw 32-byte public keys of the subscribers allowed in; immutable once the threads run.
  absl::flat_hash_set<std::string> allowed_clients;

  // Answers ZAP requests (RFC 27): 200 for a CURVE client whose key is listed, 400 otherwise.
  void ServeZap() {
    while (!stop.load(std::memory_order_acquire)) {
      zmq_pollitem_t item = {zap.get(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 100) <= 0) continue;
      // [version, request id, domain, address, identity, mechanism, credentials...]
      std::vector<std::string> request = ReceiveFrames(zap.get());
      if (request.size() < 6) continue;  // not a ZAP request: nothing to answer
      const bool allowed = request[0] == "1.0" && request[5] == "CURVE" && request.size() >= 7 &&
                           allowed_clients.contains(request[6]);
      if (!allowed) {
        KV_LOG(WARNING) << "kv-events: refused a subscriber from " << request[3] << " (mechanism "
                        << request[5] << "): its CURVE key is not listed";
      }
      const std::string status = allowed ? "200" : "400";
      const std::string text = allowed ? "OK" : "unknown CURVE key";
      const std::string* frames[] = {&request[0], &request[1], &status, &text};
      for (const std::string* f : frames) zmq_send(zap.get(), f->data(), f->size(), ZMQ_SNDMORE);
      zmq_send(zap.get(), "", 0, ZMQ_SNDMORE);  // user id
      zmq_send(zap.get(), "", 0, 0);            // metadata
    }
  }

  // Makes `socket` a CURVE server with `secret_key` (32 bytes); every handshake goes to ZAP.
  absl::Status MakeCurveServer(void* socket, const std::string& secret_key) {
    const int one = 1;
    if (zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &one, sizeof(one)) != 0 ||
        zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret_key.data(), secret_key.size()) != 0 ||
        zmq_setsockopt(socket, ZMQ_ZAP_DOMAIN, "kvrelay", 7) != 0) {
      return ZmqError("kv-events: CURVE socket options");
    }
    return absl::OkStatus();
  }
  // Thread-only state below.
  absl::flat_hash_map<std::string, int64_t> next_sequence;              // per topic
  absl::flat_hash_map<std::string, std::optional<std::string>> medium;  // per node
  std::deque<Retained> retained;

  std::string Topic(const std::string& node) const {
    return absl::StrCat("kv@", node, "@", options.model);
  }

  std::optional<std::string> Medium(const std::string& node) {
    auto it = medium.find(node);
    if (it != medium.end()) return it->second;
    std::optional<std::string> m;
    if (std::optional<uint16_t> index = store->registry().Find(node)) {
      if (std::optional<NodeSpec> spec = store->registry().Spec(*index)) m = MediumOf(*spec);
    }
    medium[node] = m;
    return m;
  }

  // The medium of a block event: DISK for a disk tier's, else the node's DRAM tier.
  std::optional<std::string> EventMedium(const StoreEvent& e, const std::string& node) {
    if (e.tier == Tier::kSsd) return std::string("DISK");
    return Medium(node);
  }

  BlockStored Stored(const BlockHash& hash, const BlockHash& parent, std::vector<int32_t> token_ids,
                     std::optional<std::string> medium) {
    BlockStored e;
    e.block_hashes = {hash.hi};
    if (!parent.IsZero()) e.parent_block_hash = parent.hi;
    e.token_ids = std::move(token_ids);
    e.block_size = options.block_size;
    e.medium = std::move(medium);
    e.group_idx = 0;  // one kvrelay block holds every layer group
    return e;
  }

  void Send(const std::string& topic, std::vector<KvEvent> events) {
    for (size_t begin = 0; begin < events.size(); begin += kMaxEventsPerBatch) {
      KvEventBatch batch;
      batch.ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
      batch.data_parallel_rank = options.data_parallel_rank;
      const size_t end = std::min(events.size(), begin + kMaxEventsPerBatch);
      batch.events.assign(std::make_move_iterator(events.begin() + begin),
                          std::make_move_iterator(events.begin() + end));
      std::string payload = EncodeKvEventBatch(batch);
      const int64_t seq = next_sequence[topic]++;
      const std::string seq_bytes = BigEndian(seq);
      // PUB never blocks: past the high-water mark ZeroMQ drops, and subscribers replay.
      zmq_send(pub.get(), topic.data(), topic.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(pub.get(), seq_bytes.data(), seq_bytes.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(pub.get(), payload.data(), payload.size(), ZMQ_DONTWAIT);
      retained.push_back({topic, seq, std::move(payload)});
      while (static_cast<int64_t>(retained.size()) > options.replay_batches) retained.pop_front();
    }
  }

  // Every node's full state: AllBlocksCleared, then one BlockStored per block it holds.
  void SendState() {
    std::map<std::string, std::vector<KvEvent>> by_topic;
    for (const NodeSpec& spec : store->registry().AllSpecs()) {
      by_topic[Topic(spec.node_id)].emplace_back(std::in_place_type<AllBlocksCleared>);
    }
    store->index().ForEachCommitted([&](const NewBlock& b) {
      const std::vector<int32_t> tokens = store->TokensOf(b.hash);
      for (const Replica& r : b.replicas) {
        std::optional<std::string> node = store->registry().NodeId(r.node);
        if (!node) continue;
        by_topic[Topic(*node)].emplace_back(std::in_place_type<BlockStored>,
                                            Stored(b.hash, b.parent, tokens, Medium(*node)));
      }
    });
    for (auto& [topic, events] : by_topic) Send(topic, std::move(events));
  }

  void ServeReplay() {
    for (;;) {
      std::vector<std::string> frames;
      for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, replay.get(), ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&msg);
          if (frames.empty()) return;  // nothing waiting
          break;
        }
        frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
        const bool more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        if (!more) break;
      }
      // [identity, "", start] or [identity, "", start, topic]; anything else is ignored, as
      // vLLM does.
      if ((frames.size() != 3 && frames.size() != 4) || !frames[1].empty() ||
          frames[2].size() != 8) {
        KV_LOG(WARNING) << "kv-events: ignoring a malformed replay request of " << frames.size()
                        << " frames";
        continue;
      }
      int64_t start = 0;
      for (unsigned char c : frames[2]) start = (start << 8) | c;
      const std::string* topic = frames.size() == 4 ? &frames[3] : nullptr;
      auto reply = [&](const std::string& seq, const std::string& payload) {
        zmq_send(replay.get(), frames[0].data(), frames[0].size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay.get(), "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay.get(), seq.data(), seq.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay.get(), payload.data(), payload.size(), ZMQ_DONTWAIT);
      };
      for (const Retained& r : retained) {
        if (r.sequence < start || (topic != nullptr && r.topic != *topic)) continue;
        reply(BigEndian(r.sequence), r.payload);
      }
      reply(BigEndian(-1), "");
    }
  }

  void Run() {
    uint64_t next = store->last_sequence() + 1;
    SendState();
    while (!stop.load(std::memory_order_acquire)) {
      if (replay) ServeReplay();
      absl::StatusOr<std::vector<StoreEvent>> events =
          store->EventsSince(next, 4096, absl::Now() + absl::Milliseconds(50));
      if (!events.ok()) {
        // Fell behind the store's retention: resend everyone's state from here.
        KV_LOG(WARNING) << "kv-events: " << events.status() << "; resending the full state";
        next = store->last_sequence() + 1;
        SendState();
        continue;
      }
      // Per topic, in sequence order; topics are independent streams.
      std::map<std::string, std::vector<KvEvent>> by_topic;
      for (const StoreEvent& e : *events) {
        next = e.sequence + 1;
        if (e.kind == StoreEvent::Kind::kNodeLeft) {
          // The node's process is gone (deregistered, replaced or forgotten): so are its blocks.
          by_topic[Topic(e.node.node_id)].emplace_back(std::in_place_type<AllBlocksCleared>);
          medium.erase(e.node.node_id);  // a re-registered node may bring other tiers
          continue;
        }
        if (e.kind != StoreEvent::Kind::kStored && e.kind != StoreEvent::Kind::kRemoved) continue;
        for (const std::string& node : e.node_ids) {
          std::vector<KvEvent>& out = by_topic[Topic(node)];
          switch (e.kind) {
            case StoreEvent::Kind::kStored:
              out.emplace_back(std::in_place_type<BlockStored>,
                               Stored(e.hash, e.parent, e.token_ids, EventMedium(e, node)));
              break;
            case StoreEvent::Kind::kRemoved:
              out.emplace_back(std::in_place_type<BlockRemoved>,
                               BlockRemoved{{e.hash.hi}, EventMedium(e, node), 0});
              break;
            default:
              break;
          }
        }
      }
      for (auto& [topic, out] : by_topic) Send(topic, std::move(out));
    }
  }
};

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  impl_->stop.store(true, std::memory_order_release);
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->zap_thread.joinable()) impl_->zap_thread.join();
}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(CacheStore* store,
                                                                          KvEventsOptions options) {
  if (options.endpoint.empty()) {
    if (!options.replay_endpoint.empty()) {
      return absl::InvalidArgumentError(
          "--kv-events-replay-endpoint needs --kv-events-endpoint as well");
    }
    return std::unique_ptr<KvEventPublisher>();
  }
  if (options.model.empty() || absl::StrContains(options.model, "@")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-model: must be non-empty without '@', got '", options.model, "'"));
  }
  if (options.block_size == 0) options.block_size = store->block_tokens();
  if (options.block_size != store->block_tokens()) {
    // BlockStored.token_ids holds one store block's tokens: another block_size would make a
    // router cut them at the wrong places.
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-block-size ", options.block_size, " differs from the store's --block-tokens ",
        store->block_tokens(), ": the events carry the store's blocks (leave it out to use ",
        store->block_tokens(), ")"));
  }
  if (options.replay_batches < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-events-replay-batches: must be >= 0, got ", options.replay_batches));
  }
  const bool curve = !options.curve_secret_key_file.empty() || !options.curve_clients_file.empty();
  if (curve && (options.curve_secret_key_file.empty() || options.curve_clients_file.empty())) {
    return absl::InvalidArgumentError(
        "--kv-events-curve-secret-key-file and --kv-events-curve-clients-file go together");
  }
  if (!curve && !options.insecure) {
    // The stream is every tenant's block activity (what WatchEvents gives only to gateways).
    return absl::InvalidArgumentError(
        "--kv-events-endpoint: the KV-event stream shows every tenant's activity; give "
        "--kv-events-curve-secret-key-file and --kv-events-curve-clients-file (ZeroMQ CURVE), "
        "or run with --insecure");
  }
  std::string secret_key;
  absl::flat_hash_set<std::string> allowed_clients;
  if (curve) {
    if (zmq_has("curve") == 0) {
      return absl::FailedPreconditionError("kv-events: this libzmq is built without CURVE");
    }
    KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(options.curve_secret_key_file));
    KV_ASSIGN_OR_RETURN(secret_key, DecodeZ85Key(text, "--kv-events-curve-secret-key-file " +
                                                           options.curve_secret_key_file));
    KV_ASSIGN_OR_RETURN(std::string clients, ReadFileToString(options.curve_clients_file));
    int line_number = 0;
    for (absl::string_view line : absl::StrSplit(clients, '\n')) {
      ++line_number;
      if (absl::StripAsciiWhitespace(line).empty()) continue;
      KV_ASSIGN_OR_RETURN(
          std::string key,
          DecodeZ85Key(line, absl::StrCat("--kv-events-curve-clients-file ",
                                          options.curve_clients_file, " line ", line_number)));
      allowed_clients.insert(std::move(key));
    }
    if (allowed_clients.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-events-curve-clients-file ",
                                                     options.curve_clients_file,
                                                     ": no public key in the file"));
    }
  }
  auto impl = std::make_unique<Impl>(store, std::move(options));
  impl->allowed_clients = std::move(allowed_clients);
  impl->context.reset(zmq_ctx_new());
  if (!impl->context) return ZmqError("zmq_ctx_new");
  const int linger = 0, hwm = 100000;
  if (curve) {
    // The ZAP handler must listen before any socket takes a handshake.
    impl->zap.reset(zmq_socket(impl->context.get(), ZMQ_REP));
    if (!impl->zap) return ZmqError("zmq_socket(REP)");
    zmq_setsockopt(impl->zap.get(), ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(impl->zap.get(), kZapEndpoint) != 0) return ZmqError("kv-events: ZAP bind");
  }
  impl->pub.reset(zmq_socket(impl->context.get(), ZMQ_PUB));
  if (!impl->pub) return ZmqError("zmq_socket(PUB)");
  zmq_setsockopt(impl->pub.get(), ZMQ_LINGER, &linger, sizeof(linger));
  zmq_setsockopt(impl->pub.get(), ZMQ_SNDHWM, &hwm, sizeof(hwm));
  if (curve) KV_RETURN_IF_ERROR(impl->MakeCurveServer(impl->pub.get(), secret_key));
  if (zmq_bind(impl->pub.get(), impl->options.endpoint.c_str()) != 0) {
    return ZmqError(absl::StrCat("--kv-events-endpoint: cannot bind ", impl->options.endpoint));
  }
  if (!impl->options.replay_endpoint.empty()) {
    impl->replay.reset(zmq_socket(impl->context.get(), ZMQ_ROUTER));
    if (!impl->replay) return ZmqError("zmq_socket(ROUTER)");
    zmq_setsockopt(impl->replay.get(), ZMQ_LINGER, &linger, sizeof(linger));
    if (curve) KV_RETURN_IF_ERROR(impl->MakeCurveServer(impl->replay.get(), secret_key));
    if (zmq_bind(impl->replay.get(), impl->options.replay_endpoint.c_str()) != 0) {
      return ZmqError(
          absl::StrCat("--kv-events-replay-endpoint: cannot bind ", impl->options.replay_endpoint));
    }
  }
  Impl* raw = impl.get();
  // The thread takes the sockets over; nothing else touches them until it is joined.
  raw->thread = std::thread([raw] { raw->Run(); });
  if (curve) raw->zap_thread = std::thread([raw] { raw->ServeZap(); });
  std::string public_key;
  if (curve) {
    char secret_z85[kZ85KeyChars + 1], public_z85[kZ85KeyChars + 1];
    zmq_z85_encode(secret_z85, reinterpret_cast<const uint8_t*>(secret_key.data()), kKeyBytes);
    if (zmq_curve_public(public_z85, secret_z85) == 0) public_key = public_z85;
  }
  KV_LOG(INFO) << "cachestore: kv-events on " << raw->options.endpoint
               << (raw->options.replay_endpoint.empty()
                       ? std::string()
                       : absl::StrCat(" replay ", raw->options.replay_endpoint))
               << (curve ? absl::StrCat(", CURVE (server public key ", public_key, ", ",
                                        raw->allowed_clients.size(), " subscriber keys)")
                         : std::string(", plain text (--insecure): anyone who reaches the port "
                                       "sees every tenant's block activity"));
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

}  // namespace kvrelay::cachestore::kvevents
