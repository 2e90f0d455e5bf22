#include "transfer/ucx/control_channel.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "transfer/internal/handle_state.h"
#include "transfer/ucx/frames.h"

namespace kvrelay::transfer::ucx {

using wire::FrameType;

struct ControlChannel::Conn {
  PeerId id = 0;
  ScopedFd fd;
  bool outgoing = false;
  std::string address;  // what Connect() was given (outgoing), else the peer's advertised one
  enum class State { kHandshake, kReady, kClosed } state = State::kHandshake;
  std::string rbuf;
  size_t roff = 0;
  std::string wbuf;
  size_t woff = 0;
  absl::Time last_recv;
  absl::Time last_send;
  std::shared_ptr<ConnectWaiter> waiter;
  std::string peer_key;          // outgoing: what our hello presents
  bool hello_delivered = false;  // the delegate saw OnHello, so it hears OnPeerDown
  bool flush_queued = false;     // in unflushed_
};

ControlChannel::ControlChannel(ProgressThread* progress, Delegate* delegate, Options options)
    : progress_(progress), delegate_(delegate), options_(std::move(options)) {}

ControlChannel::~ControlChannel() = default;

void ControlChannel::Start(ScopedFd listener) {
  KV_DCHECK(OnLoop());
  listener_ = std::move(listener);
  progress_->WatchFd(listener_.get(), POLLIN, [this](short) { OnListenerReadable(); });
}

void ControlChannel::OnListenerReadable() {
  KV_DCHECK(OnLoop());
  while (true) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a transient error; poll tells us again
    Adopt(ScopedFd(fd), /*outgoing=*/false, "", nullptr, "");
  }
}

PeerId ControlChannel::Adopt(ScopedFd fd, bool outgoing, std::string address,
                             std::shared_ptr<ConnectWaiter> waiter, std::string peer_key) {
  KV_DCHECK(OnLoop());
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto conn = std::make_unique<Conn>();
  Conn& c = *conn;
  c.id = next_peer_++;
  c.fd = std::move(fd);
  c.outgoing = outgoing;
  c.address = std::move(address);
  c.last_recv = c.last_send = absl::Now();
  c.waiter = std::move(waiter);
  c.peer_key = std::move(peer_key);
  if (c.waiter) c.waiter->peer = c.id;
  const PeerId id = c.id;
  const int raw = c.fd.get();
  conns_[id] = std::move(conn);
  progress_->WatchFd(raw, POLLIN, [this, id](short revents) { OnConnEvent(id, revents); });
  if (outgoing) {
    Conn* p = Find(id);
    p->wbuf = HelloFrame(p->peer_key);
    FlushWrites(*p);
  }
  return id;
}

std::string ControlChannel::HelloFrame(const std::string& key) {
  wire::Writer w(FrameType::kHello);
  w.U32(wire::kMagic);
  w.U32(wire::kVersion);
  w.U64(options_.incarnation);
  w.Str(options_.advertised_address);
  w.Str(key);
  delegate_->WriteHelloBody(w);
  return std::move(w).Finish();
}

ControlChannel::Conn* ControlChannel::Find(PeerId id) {
  auto it = conns_.find(id);
  return it == conns_.end() || it->second->state == Conn::State::kClosed ? nullptr
                                                                         : it->second.get();
}

bool ControlChannel::IsReady(PeerId peer) const {
  KV_DCHECK(OnLoop());
  auto it = conns_.find(peer);
  return it != conns_.end() && it->second->state == Conn::State::kReady;
}

bool ControlChannel::Send(PeerId peer, std::string frame) {
  KV_DCHECK(OnLoop());
  Conn* c = Find(peer);
  if (c == nullptr || c->state != Conn::State::kReady) return false;
  if (c->woff == c->wbuf.size()) {
    c->wbuf.clear();
    c->woff = 0;
  }
  c->wbuf.append(frame);
  c->last_send = absl::Now();
  if (!c->flush_queued) {
    c->flush_queued = true;
    unflushed_.push_back(peer);
  }
  return true;
}

void ControlChannel::FlushPending() {
  KV_DCHECK(OnLoop());
  std::vector<PeerId> ids;
  ids.swap(unflushed_);
  for (PeerId id : ids) {
    Conn* c = Find(id);
    if (c == nullptr) continue;
    c->flush_queued = false;
    FlushWrites(*c);
  }
}

void ControlChannel::Broadcast(const std::string& frame) {
  KV_DCHECK(OnLoop());
  std::vector<PeerId> ready;
  for (auto& [id, c] : conns_) {
    if (c->state == Conn::State::kReady) ready.push_back(id);
  }
  for (PeerId id : ready) Send(id, frame);
}

void ControlChannel::FlushWrites(Conn& c) {
  while (c.woff < c.wbuf.size()) {
    ssize_t n = ::send(c.fd.get(), c.wbuf.data() + c.woff, c.wbuf.size() - c.woff,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.woff += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      progress_->SetFdEvents(c.fd.get(), POLLIN | POLLOUT);
      return;
    }
    if (n < 0 && errno == EINTR) continue;
    // The reader side notices the broken connection and takes the peer down.
    return;
  }
  c.wbuf.clear();
  c.woff = 0;
  progress_->SetFdEvents(c.fd.get(), POLLIN);
}

void ControlChannel::OnConnEvent(PeerId id, short revents) {
  KV_DCHECK(OnLoop());
  Conn* c = Find(id);
  if (c == nullptr) return;
  if (revents & POLLOUT) FlushWrites(*c);
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  char buf[64 << 10];
  bool eof = false;
  int read_errno = 0;
  while (true) {
    ssize_t n = ::recv(c->fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      c->rbuf.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      eof = true;
    } else if (errno == EINTR) {
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      read_errno = errno;
    }
    break;
  }
  if (c->rbuf.size() > c->roff) c->last_recv = absl::Now();
  if (!DrainFrames(id)) return;
  c = Find(id);
  if (c == nullptr) return;
  if (eof) {
    Close(id, absl::UnavailableError(absl::StrCat("peer ", id, " closed the control connection")),
          PeerDownKind::kLost, /*say_bye=*/false);
  } else if (read_errno != 0) {
    // Whatever recv says, the peer is lost to us: Unavailable, not the errno's own code.
    Close(id,
          absl::UnavailableError(
              absl::StrCat("control connection to peer ", id, ": ", std::strerror(read_errno))),
          PeerDownKind::kLost, /*say_bye=*/false);
  }
}

bool ControlChannel::DrainFrames(PeerId id) {
  Conn* c = Find(id);
  while (c != nullptr) {
    absl::StatusOr<std::optional<frames::Frame>> next =
        frames::NextFrame(std::string_view(c->rbuf).substr(c->roff));
    if (!next.ok()) {
      Close(id, absl::UnavailableError(absl::StrCat("peer sent a ", next.status().message())),
            PeerDownKind::kLost, false);
      return false;
    }
    if (!next->has_value()) break;
    const FrameType type = (*next)->type;
    // Stays valid even if the frame closes the connection: closed connections are destroyed
    // only at the next Tick.
    const std::string_view payload = (*next)->payload;
    c->roff += (*next)->consumed;
    wire::Reader r(payload);
    absl::Status st;
    if (type == FrameType::kHello) {
      st = HandleHello(*c, r);
    } else if (type == FrameType::kRefuse && c->state == Conn::State::kHandshake && c->outgoing) {
      std::string reason;
      r.Str(&reason);
      if (reason.size() > 1024) reason.resize(1024);
      Close(id, absl::PermissionDeniedError(absl::StrCat("peer refused the connection: ", reason)),
            PeerDownKind::kLocal, false);
      return false;
    } else if (c->state != Conn::State::kReady) {
      st = absl::InvalidArgumentError("frame before hello");
    } else if (type == FrameType::kHeartbeat) {
      // last_recv already moved
    } else if (type == FrameType::kBye) {
      Close(id, absl::UnavailableError(absl::StrCat("peer ", id, " disconnected")),
            PeerDownKind::kOrderly, false);
      return false;
    } else {
      st = delegate_->OnFrame(id, type, r);
    }
    c = Find(id);
    if (c == nullptr) return false;  // the frame took the peer down
    if (!st.ok()) {
      Close(id, absl::UnavailableError(absl::StrCat("protocol error: ", st.message())),
            PeerDownKind::kLost, false);
      return false;
    }
  }
  if (c == nullptr) return false;
  if (c->roff == c->rbuf.size()) {
    c->rbuf.clear();
    c->roff = 0;
  } else if (c->roff > (1 << 20)) {
    c->rbuf.erase(0, c->roff);
    c->roff = 0;
  }
  return true;
}

absl::Status ControlChannel::HandleHello(Conn& c, wire::Reader& r) {
  if (c.state != Conn::State::kHandshake) return absl::InvalidArgumentError("second hello");
  KV_ASSIGN_OR_RETURN(frames::HelloHeader header, frames::DecodeHelloHeader(r));
  PeerHello hello{.incarnation = header.incarnation,
                  .advertised_address = std::move(header.advertised_address)};
  const std::string& key = header.key;
  if (!c.outgoing && !internal::PeerKeyAccepted(accept_key_, key)) {
    // Refused before the delegate sees the peer: it learns nothing of our memory.
    KV_LOG(WARNING) << "data plane: refused a connection from " << hello.advertised_address
                    << ": its hello carries " << (key.empty() ? "no" : "a wrong")
                    << " data-plane key";
    wire::Writer w(FrameType::kRefuse);
    w.Str("wrong data-plane key");
    const std::string refuse = std::move(w).Finish();
    ::send(c.fd.get(), refuse.data(), refuse.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    Close(c.id, absl::PermissionDeniedError("wrong data-plane key"), PeerDownKind::kLocal, false);
    return absl::OkStatus();
  }
  if (hello.incarnation == options_.incarnation) {
    return absl::InvalidArgumentError("a transport cannot connect to itself");
  }
  if (!c.outgoing) c.address = hello.advertised_address;
  const PeerId id = c.id;
  c.hello_delivered = true;
  KV_RETURN_IF_ERROR(delegate_->OnHello(id, c.outgoing, c.address, hello, r));
  Conn* still = Find(id);
  if (still == nullptr) return absl::OkStatus();
  if (!still->outgoing) {
    if (still->woff == still->wbuf.size()) {
      still->wbuf.clear();
      still->woff = 0;
    }
    still->wbuf.append(HelloFrame(""));
    still->last_send = absl::Now();
    FlushWrites(*still);
  }
  still->state = Conn::State::kReady;
  if (still->waiter) still->waiter->Finish(id);
  return absl::OkStatus();
}

void ControlChannel::Close(PeerId peer, const absl::Status& why, PeerDownKind kind, bool say_bye) {
  KV_DCHECK(OnLoop());
  Conn* c = Find(peer);
  if (c == nullptr) return;
  const bool was_ready = c->state == Conn::State::kReady;
  const bool tell = c->hello_delivered;
  if (say_bye && was_ready) {
    // After the frames still queued (a DONE or CONTROL sent just before Disconnect), never
    // inside one: best effort, what the socket does not take now is dropped with it.
    if (c->woff == c->wbuf.size()) {
      c->wbuf.clear();
      c->woff = 0;
    }
    c->wbuf.append(std::move(wire::Writer(FrameType::kBye)).Finish());
    FlushWrites(*c);
  }
  c->state = Conn::State::kClosed;
  progress_->UnwatchFd(c->fd.get());
  c->fd.Reset();
  if (c->waiter) c->waiter->Finish(why);
  if (tell) delegate_->OnPeerDown(peer, why, kind);
}

void ControlChannel::Shutdown(const absl::Status& why) {
  KV_DCHECK(OnLoop());
  std::vector<PeerId> ids;
  for (auto& [id, c] : conns_) ids.push_back(id);
  for (PeerId id : ids) Close(id, why, PeerDownKind::kLocal, /*say_bye=*/true);
  if (listener_.valid()) {
    progress_->UnwatchFd(listener_.get());
    listener_.Reset();
  }
  conns_.clear();
}

absl::Time ControlChannel::Tick(absl::Time now) {
  KV_DCHECK(OnLoop());
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (it->second->state == Conn::State::kClosed) {
      conns_.erase(it++);
    } else {
      ++it;
    }
  }
  if (now < next_check_) return next_check_;
  next_check_ = now + options_.heartbeat_interval / 4;
  std::vector<PeerId> ids;
  for (auto& [id, c] : conns_) ids.push_back(id);
  for (PeerId id : ids) {
    Conn* c = Find(id);
    if (c == nullptr) continue;
    if (now - c->last_recv > options_.peer_timeout) {
      // Frames may be waiting unread in the socket while this thread was busy.
      OnConnEvent(id, POLLIN);
      c = Find(id);
      if (c == nullptr) continue;
    }
    if (now - c->last_recv > options_.peer_timeout) {
      Close(id,
            absl::UnavailableError(absl::StrCat("peer ", id, " sent nothing for ",
                                                absl::FormatDuration(now - c->last_recv))),
            PeerDownKind::kLost, false);
      continue;
    }
    if (c->state == Conn::State::kReady && now - c->last_send >= options_.heartbeat_interval) {
      Send(id, std::move(wire::Writer(FrameType::kHeartbeat)).Finish());
    }
  }
  return next_check_;
}

}  // namespace kvrelay::transfer::ucx
