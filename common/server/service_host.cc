#include "common/server/service_host.h"

#include <signal.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/health_check_service_interface.h"

namespace kvrelay::server {
namespace {

// Threads that libraries start before main (OpenBLAS's pool, at load time) do not block
// SIGTERM; the kernel hands a process-directed signal to one of them whenever the main thread is
// not inside sigtimedwait, and the default action would kill the process. A handler makes that
// harmless: it records the signal, and WaitForShutdown picks it up on its next tick.
std::atomic<int> pending_shutdown_signal{0};

void RecordShutdownSignal(int signo) { pending_shutdown_signal.store(signo); }

}  // namespace

void ServiceHost::BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  struct sigaction action = {};
  action.sa_handler = &RecordShutdownSignal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
}

absl::StatusOr<std::unique_ptr<ServiceHost>> ServiceHost::Start(
    const ServiceHostOptions& options, const std::vector<grpc::Service*>& services,
    const MetricsRegistry* metrics) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port must be in [0, 65535], got ", options.port));
  }
  if (options.metrics_port < 0 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-port must be in [0, 65535], got ", options.metrics_port));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFor(options.security);
  if (!credentials.ok()) return credentials.status();
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      HttpServer::Start(options.host, options.metrics_port, MetricsHandler(metrics));
  if (!http.ok()) return http.status();

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.port), *credentials, &port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // Clients ping every 10 s (server::MakeChannel); accept that instead of answering GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // The server pings each connection too and closes one that does not answer: a client whose
  // connection died in a partition (its close lost on the cut link) reconnects on a new one,
  // and without this the old one stayed ESTABLISHED here for TCP's two hours (the soak: one
  // descriptor more per link cut, without end).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // Two live processes never share a port: the cache store takes a registration from a live
  // node's gRPC address as that node's successor (see cachestore::NodeRegistry::Register).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat(options.name, ": cannot listen on ", options.host, ":", options.port));
  }
  if (options.security.insecure) {
    KV_LOG(WARNING) << options.name
                    << ": serving PLAIN TEXT gRPC (--insecure): no authentication, no "
                       "encryption; anyone who reaches this port can call it";
  }
  auto host = std::unique_ptr<ServiceHost>(
      new ServiceHost(options, std::move(server), port, *std::move(http)));
  host->SetServing(options.serving_at_start);
  // The launcher (`kvrelay up`) and tests wait for exactly this line.
  std::printf("%s listening on %s metrics %s:%d%s%s\n", options.name.c_str(),
              host->address().c_str(), options.host.c_str(), host->metrics_port(),
              options.listening_note.empty() ? "" : " ", options.listening_note.c_str());
  std::fflush(stdout);
  return host;
}

ServiceHost::ServiceHost(ServiceHostOptions options, std::unique_ptr<grpc::Server> server, int port,
                         std::unique_ptr<HttpServer> http)
    : options_(std::move(options)),
      server_(std::move(server)),
      port_(port),
      http_(std::move(http)) {}

ServiceHost::~ServiceHost() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
}

void ServiceHost::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  for (const std::string& name : options_.health_services) {
    health->SetServingStatus(name, serving);
  }
  health->SetServingStatus(serving);
}

std::string ServiceHost::address() const { return absl::StrCat(options_.host, ":", port_); }

std::shared_ptr<grpc::Channel> ServiceHost::InProcessChannel() {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void ServiceHost::WaitForShutdown(const ShutdownHooks& hooks) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  const absl::Duration tick = std::min(hooks.tick, absl::Milliseconds(100));
  const timespec wait = absl::ToTimespec(tick);
  absl::Time next_tick = absl::Now() + hooks.tick;
  while (!shutdown_requested_.load(std::memory_order_acquire)) {
    int signo = sigtimedwait(&set, nullptr, &wait);
    if (signo < 0) signo = pending_shutdown_signal.exchange(0);
    if (signo == SIGTERM || signo == SIGINT) {
      KV_LOG(INFO) << options_.name << ": signal " << signo << ", draining";
      break;
    }
    if (hooks.on_tick && absl::Now() >= next_tick) {
      hooks.on_tick();
      next_tick = absl::Now() + hooks.tick;
    }
  }
  // One drain_timeout from the signal, whatever on_drain spends of it (a worker waits there for
  // its admitted requests): the pod's grace period is sized on it.
  const absl::Time drain_deadline = absl::Now() + options_.drain_timeout;
  draining_.store(true, std::memory_order_release);
  SetServing(false);
  if (hooks.on_drain) hooks.on_drain();
  // Refuses new RPCs at once; in-flight ones get until the deadline, then are cancelled.
  server_->Shutdown(absl::ToChronoTime(drain_deadline));
  server_->Wait();
  KV_LOG(INFO) << options_.name << ": drained";
}

int ServeUntilSignal(const ServiceHostOptions& options, const std::vector<grpc::Service*>& services,
                     const MetricsRegistry* metrics, const ShutdownHooks& hooks) {
  absl::StatusOr<std::unique_ptr<ServiceHost>> server =
      ServiceHost::Start(options, services, metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay %s: %s\n", options.name.c_str(),
                 server.status().ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown(hooks);
  return 0;
}

}  // namespace kvrelay::server
