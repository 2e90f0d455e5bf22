#include "worker/service_host.h"

#include <signal.h>

#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/health_check_service_interface.h"

namespace kvrelay::worker {

void ServiceHost::BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

absl::StatusOr<std::unique_ptr<ServiceHost>> ServiceHost::Start(
    const ServiceHostOptions& options, const std::vector<grpc::Service*>& services,
    const MetricsRegistry* metrics) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port must be in [0, 65535], got ",
                                                   options.port));
  }
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      HttpServer::Start(options.host, options.metrics_port, MetricsHandler(metrics));
  if (!http.ok()) return http.status();

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.port),
                           grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat(options.name, ": cannot listen on ", options.host, ":", options.port));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  auto host = std::unique_ptr<ServiceHost>(
      new ServiceHost(options, std::move(server), port, *std::move(http)));
  // The launcher (`kvrelay up`) and tests wait for exactly this line.
  std::printf("%s listening on %s metrics %s:%d\n", options.name.c_str(), host->address().c_str(),
              options.host.c_str(), host->metrics_port());
  std::fflush(stdout);
  return host;
}

ServiceHost::ServiceHost(ServiceHostOptions options, std::unique_ptr<grpc::Server> server,
                         int port, std::unique_ptr<HttpServer> http)
    : options_(std::move(options)), server_(std::move(server)), port_(port), http_(std::move(http)) {}

ServiceHost::~ServiceHost() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
}

std::string ServiceHost::address() const { return absl::StrCat(options_.host, ":", port_); }

void ServiceHost::WaitForShutdown(const std::function<void()>& on_drain) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  const timespec tick{0, 100 * 1000 * 1000};
  while (!shutdown_requested_.load(std::memory_order_acquire)) {
    int signo = sigtimedwait(&set, nullptr, &tick);
    if (signo == SIGTERM || signo == SIGINT) {
      KV_LOG(INFO) << options_.name << ": signal " << signo << ", draining";
      break;
    }
  }
  draining_.store(true, std::memory_order_release);
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (on_drain) on_drain();
  // Refuses new RPCs at once; in-flight ones get until the deadline, then are cancelled.
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(options_.drain_timeout)));
  server_->Wait();
  KV_LOG(INFO) << options_.name << ": drained";
}

int ServeUntilSignal(const ServiceHostOptions& options, grpc::Service* service,
                     const MetricsRegistry* metrics, const std::function<void()>& on_drain) {
  absl::StatusOr<std::unique_ptr<ServiceHost>> server = ServiceHost::Start(options, {service}, metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay %s: %s\n", options.name.c_str(),
                 server.status().ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown(on_drain);
  return 0;
}

absl::Status CheckHostPort(const std::string& address, const std::string& what) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be HOST:PORT, got '", address, "'"));
  }
  return absl::OkStatus();
}

std::string ModelNameFromDir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir.substr(dir.rfind('/') + 1);
}

}  // namespace kvrelay::worker
