// `kvrelay up`: a whole kvrelay cluster on loopback, as child processes of this binary: a cache
// store, N prefill workers, M decode workers and a gateway, serving a model directory (by
// default a tiny generated one). Waits until every service printed its listening line and
// answers grpc.health.v1 SERVING, prints the endpoints, forwards the services' output with a
// "[name] " prefix, and on Ctrl-C / SIGTERM stops them in order (gateway, workers, cache store:
// SIGTERM, a grace period, SIGKILL). A worker that dies is reported and the cluster keeps
// serving through the others; if the gateway or the cache store dies, everything stops.

#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cli/up/command.h"
#include "cli/up/health_check.h"
#include "cli/up/supervisor.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/server/dev_certs.h"
#include "common/status_macros.h"
#include "kv/hf_config.h"
#include "model/select/model_select.h"
#include "model/test_model.h"

namespace kvrelay::cli::up {
namespace {

int UsageError(const std::string& message) { return ::kvrelay::UsageError("up", message); }

int Fail(const std::string& message) { return ::kvrelay::UsageError("up", message, 1); }

std::vector<std::string> SplitArgs(const std::string& text) {
  return absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
}

// The binary of this process, for the children.
absl::StatusOr<std::string> SelfPath() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return absl::InternalError("cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

// Removes a directory this command created, on every return path.
class OwnedDir {
 public:
  explicit OwnedDir(std::string path) : path_(std::move(path)) {}
  ~OwnedDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  OwnedDir(const OwnedDir&) = delete;
  OwnedDir& operator=(const OwnedDir&) = delete;

 private:
  std::string path_;
};

// `bytes` random bytes as lowercase hex (a secret for a file).
absl::StatusOr<std::string> RandomHex(int bytes) {
  std::string raw(static_cast<size_t>(bytes), '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), bytes) != 1) {
    return absl::InternalError("RAND_bytes failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : raw) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  return hex;
}

absl::Status WriteSecretFile(const std::string& path, const std::string& contents) {
  KV_RETURN_IF_ERROR(WriteFileAtomically(path, contents + "\n"));
  if (::chmod(path.c_str(), 0600) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod 0600 ", path));
  }
  return absl::OkStatus();
}

struct Service {
  std::string name;
  int index = -1;  // in the supervisor
  Endpoint endpoint;
};

}  // namespace

int RunUpCommand(const std::vector<std::string>& args) {
  int32_t num_prefill = 1, num_decode = 1, worker_threads = 1;
  int64_t seed = 0;
  std::string model_dir, arch = "llama", gateway_address = "127.0.0.1:50051", data_dir;
  std::string cachestore_args, prefill_args, decode_args, gateway_args;
  absl::Duration start_timeout = absl::Seconds(60), grace = absl::Seconds(10);
  FlagSet flags("up",
                "Starts a cache store, prefill and decode workers and a gateway on loopback "
                "as child processes; Ctrl-C or SIGTERM stops them all.");
  flags.AddInt32("prefill", &num_prefill, "prefill workers, 1-16");
  flags.AddInt32("decode", &num_decode, "decode workers, 1-16");
  flags.AddString("model", &model_dir, "model directory (config.json + safetensors)");
  flags.AddString("arch", &arch,
                  "without --model: generate a tiny model of this architecture "
                  "(llama, deepseek_v3, gemma3)");
  flags.AddInt64("seed", &seed, "weights seed of the generated model");
  flags.AddString("gateway-address", &gateway_address,
                  "HOST:PORT the gateway listens on (port 0: any free port)");
  std::string http_address = "127.0.0.1:8000";
  flags.AddString("http-address", &http_address,
                  "HOST:PORT of the gateway's OpenAI-compatible HTTP API (port 0: any free "
                  "port; empty: off)");
  flags.AddString("data-dir", &data_dir,
                  "directory for the cache store's log and the generated model "
                  "(default: a temporary directory removed on exit)");
  flags.AddInt32("worker-threads", &worker_threads, "compute threads per prefill/decode worker");
  std::string device = "auto";
  flags.AddString("device", &device,
                  "--device of every prefill and decode worker: auto, cpu, cuda or cuda:N");
  std::string kv_cache_dtype = "auto";
  flags.AddString("kv-cache-dtype", &kv_cache_dtype,
                  "KV cache dtype of every worker and the gateway: auto (the model's), bf16, "
                  "fp16, fp32 or fp8_e4m3 (half of bf16; E4M3 values, scales inside each block)");
  flags.AddDuration("start-timeout", &start_timeout, "how long each service may take to start");
  flags.AddDuration("grace", &grace, "how long each service may take to drain on stop");
  flags.AddString("cachestore-args", &cachestore_args, "extra flags for the cache store");
  flags.AddString("prefill-args", &prefill_args, "extra flags for every prefill worker");
  flags.AddString("decode-args", &decode_args, "extra flags for every decode worker");
  flags.AddString("gateway-args", &gateway_args, "extra flags for the gateway");
  std::string ssd_dir;
  int64_t ssd_bytes = 0;
  flags.AddString("ssd-dir", &ssd_dir,
                  "a disk tier for every prefill and decode worker: each gets --ssd-dir "
                  "DIR/<node id> (empty: none)");
  flags.AddInt64("ssd-bytes", &ssd_bytes, "--ssd-bytes of each worker's disk tier");
  bool insecure = false;
  flags.AddBool("insecure", &insecure,
                "plain-text gRPC without authentication (default: mutual TLS with throwaway "
                "certificates in the data directory)");
  std::string tenant = "default";
  flags.AddString("tenant", &tenant, "tenant of the client certificate `up` issues");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (num_prefill < 1 || num_prefill > 16) {
    return UsageError(absl::StrCat("--prefill must be in [1, 16], got ", num_prefill));
  }
  if (num_decode < 1 || num_decode > 16) {
    return UsageError(absl::StrCat("--decode must be in [1, 16], got ", num_decode));
  }
  if (worker_threads < 1 || worker_threads > 256) {
    return UsageError(absl::StrCat("--worker-threads must be in [1, 256], got ", worker_threads));
  }
  if (absl::Status s = model::ParseDeviceFlag(device).status(); !s.ok()) {
    return UsageError(std::string(s.message()));
  }
  absl::StatusOr<std::optional<kv::DType>> kv_dtype =
      kv::ParseKvDTypeFlag("--kv-cache-dtype", kv_cache_dtype);
  if (!kv_dtype.ok()) return UsageError(std::string(kv_dtype.status().message()));
  kv::ConfigOptions config_options;
  config_options.kv_dtype = *kv_dtype;
  // Passed on only when given, so a default cluster runs exactly the flags it always did.
  std::vector<std::string> kv_dtype_flags;
  if (kv_dtype->has_value()) {
    kv_dtype_flags = {"--kv-cache-dtype", std::string(kv::DTypeName(**kv_dtype))};
  }
  if (seed < 0) return UsageError(absl::StrCat("--seed must be >= 0, got ", seed));
  if (ssd_dir.empty() != (ssd_bytes == 0) || ssd_bytes < 0) {
    return UsageError("--ssd-dir and a positive --ssd-bytes go together");
  }
  // Each worker's own directory (a tier file is locked by the one process that uses it).
  auto disk_flags = [&](const std::string& id) {
    if (ssd_dir.empty()) return std::string();
    return absl::StrCat("--ssd-dir ", ssd_dir, "/", id, " --ssd-bytes ", ssd_bytes, " ");
  };
  if (grace < absl::Seconds(1) || grace > absl::Minutes(10)) {
    return UsageError(
        absl::StrCat("--grace must be in [1s, 10m], got ", absl::FormatDuration(grace)));
  }
  const size_t colon = gateway_address.rfind(':');
  int gateway_port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(gateway_address.substr(colon + 1), &gateway_port) || gateway_port < 0 ||
      gateway_port > 65535) {
    return UsageError(
        absl::StrCat("--gateway-address must be HOST:PORT, got '", gateway_address, "'"));
  }
  const std::string gateway_host = gateway_address.substr(0, colon);
  std::string http_host = gateway_host, http_port = "-1";
  if (!http_address.empty()) {
    const size_t http_colon = http_address.rfind(':');
    int port = -1;
    if (http_colon == std::string::npos || http_colon == 0 ||
        !absl::SimpleAtoi(http_address.substr(http_colon + 1), &port) || port < 0 || port > 65535) {
      return UsageError(
          absl::StrCat("--http-address must be HOST:PORT or empty, got '", http_address, "'"));
    }
    http_host = http_address.substr(0, http_colon);
    http_port = absl::StrCat(port);
  }
  if (!model_dir.empty() && flags.WasSet("arch")) {
    return UsageError("give --model DIR or --arch A, not both");
  }
  if (model_dir.empty() && !model::TestModelPreset(arch).ok()) {
    return UsageError(
        absl::StrCat("--arch must be llama, deepseek_v3, gemma3, gpt2 or mamba, got '", arch, "'"));
  }

  // Before any thread exists: the supervisor blocks SIGINT/SIGTERM/SIGCHLD process-wide.
  absl::StatusOr<std::unique_ptr<Supervisor>> created = Supervisor::Create();
  if (!created.ok()) return Fail(std::string(created.status().message()));
  Supervisor& sup = **created;

  std::string owned_dir;
  if (data_dir.empty()) {
    char tmpl[] = "/tmp/kvrelay-up-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return Fail("cannot create a temporary data directory");
    data_dir = owned_dir = tmpl;
  } else if (absl::Status s = MakeDirectories(data_dir); !s.ok()) {
    return UsageError(absl::StrCat("--data-dir: ", s.message()));
  }
  OwnedDir remove_on_exit(owned_dir);

  if (model_dir.empty()) {
    model_dir = data_dir + "/model-" + arch;
    model::TestModelOptions options;
    options.arch = arch;
    options.seed = static_cast<uint64_t>(seed);
    if (absl::Status s = model::WriteTestModel(model_dir, options); !s.ok()) {
      return Fail(absl::StrCat("generating the ", arch, " test model: ", s.message()));
    }
  }
  // Throwaway credentials: a random tenant secret and bearer-token key, and (unless --insecure)
  // a CA with one certificate per service, one for the client and one for `up`'s own checks.
  const std::string secret_file = data_dir + "/tenant-secret";
  const std::string token_keys_file = data_dir + "/tenant-token-keys";
  for (const std::string& path : {secret_file, token_keys_file}) {
    absl::StatusOr<std::string> secret = RandomHex(32);
    if (!secret.ok()) return Fail(std::string(secret.status().message()));
    if (absl::Status s = WriteSecretFile(path, *secret); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  }
  std::unique_ptr<server::DevCertificateAuthority> ca;
  server::SecurityOptions admin_security;  // insecure by default
  server::SecurityOptions client_security;
  const std::string tls_dir = data_dir + "/tls";
  // The flags that give service `role`/`id` its certificate (or --insecure).
  auto security_flags = [&](server::PeerRole role,
                            const std::string& id) -> absl::StatusOr<std::vector<std::string>> {
    if (insecure) return std::vector<std::string>{"--insecure"};
    std::vector<std::string> hosts = {"localhost", "127.0.0.1"};
    if (role == server::PeerRole::kGateway && gateway_host != "127.0.0.1" &&
        gateway_host != "localhost" && !gateway_host.empty()) {
      hosts.push_back(gateway_host);
    }
    KV_ASSIGN_OR_RETURN(server::SecurityOptions issued, ca->Issue(role, id, hosts));
    return server::DevCertificateAuthority::Flags(issued);
  };
  if (!insecure) {
    if (absl::Status s = MakeDirectories(tls_dir); !s.ok()) return Fail(std::string(s.message()));
    ::chmod(tls_dir.c_str(), 0700);
    absl::StatusOr<std::unique_ptr<server::DevCertificateAuthority>> made =
        server::DevCertificateAuthority::Create(tls_dir);
    if (!made.ok()) return Fail(absl::StrCat("TLS: ", made.status().message()));
    ca = *std::move(made);
    absl::StatusOr<server::SecurityOptions> admin = ca->Issue(server::PeerRole::kAdmin, "up");
    absl::StatusOr<server::SecurityOptions> client = ca->Issue(server::PeerRole::kClient, tenant);
    if (!admin.ok() || !client.ok()) {
      return Fail(absl::StrCat("TLS: ", (admin.ok() ? client.status() : admin.status()).message()));
    }
    admin_security = *admin;
    client_security = *client;
  }

  absl::StatusOr<kv::ModelConfig> config =
      kv::LoadHfConfig(model_dir + "/config.json", config_options);
  if (!config.ok()) return UsageError(absl::StrCat("--model: ", config.status().message()));
  absl::StatusOr<std::string> self = SelfPath();
  if (!self.ok()) return Fail(std::string(self.status().message()));
  std::printf("kvrelay up: model %s (%s, KV %s, %lld KV bytes per token)\n", model_dir.c_str(),
              config->model_type.c_str(),
              std::string(kv::DTypeName(config->layout.dtype())).c_str(),
              static_cast<long long>(config->layout.BytesPerToken()));
  std::fflush(stdout);

  std::vector<Service> services;
  bool failed = false;
  // Starts a service and waits until it listens and answers SERVING.
  auto launch = [&](const std::string& name, std::vector<std::string> argv,
                    const std::string& extra, server::PeerRole role,
                    const std::string& id) -> absl::Status {
    argv.insert(argv.begin(), *self);
    KV_ASSIGN_OR_RETURN(std::vector<std::string> security, security_flags(role, id));
    argv.insert(argv.end(), security.begin(), security.end());
    if (role == server::PeerRole::kPrefill || role == server::PeerRole::kDecode ||
        role == server::PeerRole::kGateway) {
      argv.insert(argv.end(), kv_dtype_flags.begin(), kv_dtype_flags.end());
    }
    for (std::string& a : SplitArgs(extra)) argv.push_back(std::move(a));
    absl::StatusOr<int> index = sup.Start(name, argv);
    if (!index.ok()) return index.status();
    services.push_back({name, *index, {}});
    return absl::OkStatus();
  };
  auto wait_ready = [&](Service& s) -> absl::Status {
    const absl::Time deadline = absl::Now() + start_timeout;
    absl::StatusOr<Endpoint> endpoint = sup.WaitListening(s.index, start_timeout);
    if (!endpoint.ok()) return endpoint.status();
    s.endpoint = *endpoint;
    absl::Status health;
    while (true) {
      health = CheckServing(s.endpoint.address, absl::Seconds(2), admin_security);
      if (health.ok()) return health;
      if (sup.child(s.index).exit_code.has_value()) {
        return absl::FailedPreconditionError(
            absl::StrCat(s.name, " ended with ", DescribeExit(*sup.child(s.index).exit_code),
                         " before it was healthy"));
      }
      if (sup.stop_requested()) return absl::CancelledError("stopped by a signal");
      if (absl::Now() > deadline) break;
      sup.Poll(absl::Milliseconds(200));
    }
    return absl::DeadlineExceededError(
        absl::StrCat(s.name, " at ", s.endpoint.address, " is not SERVING after ",
                     absl::FormatDuration(start_timeout), ": ", health.message()));
  };
  // Each service's own drain ends inside the grace period, so a request that never completes
  // (a reservation whose push never comes) costs a logged timeout, not a SIGKILL.
  const std::string drain_timeout =
      absl::FormatDuration(grace - std::min(absl::Seconds(2), grace / 5));
  const std::vector<std::string> common = {
      "--host",         "127.0.0.1", "--port",          "0",
      "--metrics-port", "0",         "--drain-timeout", drain_timeout};
  auto with_common = [&](std::vector<std::string> head, std::vector<std::string> tail) {
    head.insert(head.end(), common.begin(), common.end());
    head.insert(head.end(), tail.begin(), tail.end());
    return head;
  };

  // Stop order: gateway first (no new requests), then the workers, then the cache store.
  auto stop_all = [&] {
    std::vector<int> gateway, workers, store;
    for (const Service& s : services) {
      if (s.name == "gateway") {
        gateway.push_back(s.index);
      } else if (s.name == "cachestore") {
        store.push_back(s.index);
      } else {
        workers.push_back(s.index);
      }
    }
    bool clean = true;
    for (const std::vector<int>* tier : {&gateway, &workers, &store}) {
      if (!tier->empty()) clean = sup.Stop(*tier, grace) && clean;
    }
    return clean;
  };

  absl::Status started = [&]() -> absl::Status {
    KV_RETURN_IF_ERROR(launch("cachestore",
                              with_common({"cachestore"}, {"--data-dir", data_dir + "/cachestore"}),
                              cachestore_args, server::PeerRole::kStore, "cachestore"));
    KV_RETURN_IF_ERROR(wait_ready(services.back()));
    const std::string store = services.back().endpoint.address;
    const std::string threads = absl::StrCat(worker_threads);
    for (int i = 0; i < num_prefill; ++i) {
      const std::string id = absl::StrCat("prefill-", i);
      KV_RETURN_IF_ERROR(
          launch(id,
                 with_common({"prefill"}, {"--cachestore", store, "--model", model_dir, "--node-id",
                                           id, "--threads", threads, "--device", device}),
                 disk_flags(id) + prefill_args, server::PeerRole::kPrefill, id));
    }
    for (int i = 0; i < num_decode; ++i) {
      const std::string id = absl::StrCat("decode-", i);
      KV_RETURN_IF_ERROR(
          launch(id,
                 with_common({"decode"}, {"--cachestore", store, "--model", model_dir, "--node-id",
                                          id, "--threads", threads, "--device", device}),
                 disk_flags(id) + decode_args, server::PeerRole::kDecode, id));
    }
    std::vector<std::string> prefill_addrs, decode_addrs;
    for (size_t i = 1; i < services.size(); ++i) {
      KV_RETURN_IF_ERROR(wait_ready(services[i]));
      (services[i].name.rfind("prefill", 0) == 0 ? prefill_addrs : decode_addrs)
          .push_back(services[i].endpoint.address);
    }
    KV_RETURN_IF_ERROR(launch("gateway",
                              {"gateway",
                               "--host",
                               gateway_host,
                               "--port",
                               absl::StrCat(gateway_port),
                               "--metrics-port",
                               "0",
                               "--cachestore",
                               store,
                               "--prefill",
                               absl::StrJoin(prefill_addrs, ","),
                               "--decode",
                               absl::StrJoin(decode_addrs, ","),
                               "--model",
                               model_dir,
                               "--http-host",
                               http_host,
                               "--http-port",
                               http_port,
                               "--tenant-secret-file",
                               secret_file,
                               "--tenant-token-keys",
                               token_keys_file},
                              gateway_args, server::PeerRole::kGateway, "gateway"));
    return wait_ready(services.back());
  }();
  if (!started.ok()) {
    if (sup.stop_requested()) {
      std::fprintf(stderr, "kvrelay up: stopping (signal %d during start-up)\n", sup.stop_signal());
      stop_all();
      return 1;
    }
    std::fprintf(stderr, "kvrelay up: start-up failed: %s\n",
                 std::string(started.message()).c_str());
    stop_all();
    return 1;
  }

  std::printf("kvrelay up: endpoints\n");
  for (const Service& s : services) {
    std::printf("  %-12s %-22s metrics %-22s pid %d\n", s.name.c_str(), s.endpoint.address.c_str(),
                s.endpoint.metrics_address.c_str(), static_cast<int>(sup.child(s.index).pid));
  }
  if (insecure) {
    std::printf("kvrelay up: PLAIN TEXT (--insecure): no authentication, tenants as requested\n");
  } else {
    std::printf(
        "kvrelay up: mutual TLS; client flags --tls-cert %s --tls-key %s --tls-ca %s "
        "(tenant %s); bearer-token keys %s\n",
        client_security.cert_file.c_str(), client_security.key_file.c_str(),
        client_security.ca_file.c_str(), tenant.c_str(), token_keys_file.c_str());
  }
  // The operator's view (Gateway/Status is for admin certificates): the command to run first.
  const std::string status_flags =
      insecure ? std::string("--insecure")
               : absl::StrCat("--tls-cert ", admin_security.cert_file, " --tls-key ",
                              admin_security.key_file, " --tls-ca ", admin_security.ca_file);
  std::printf("kvrelay up: status: kvrelay status --gateway %s %s\n",
              services.back().endpoint.address.c_str(), status_flags.c_str());
  std::printf("kvrelay up: ready; gateway %s (Ctrl-C or SIGTERM stops the cluster)\n",
              services.back().endpoint.address.c_str());
  std::fflush(stdout);

  bool lost_core = false;
  while (!sup.stop_requested() && !lost_core) {
    for (int index : sup.Poll(absl::Seconds(1))) {
      const Supervisor::Child& c = sup.child(index);
      failed = true;
      const bool core = c.name == "gateway" || c.name == "cachestore";
      std::fprintf(stderr, "kvrelay up: %s (pid %d) died unexpectedly: %s%s\n", c.name.c_str(),
                   static_cast<int>(c.pid), DescribeExit(*c.exit_code).c_str(),
                   core ? "; stopping the cluster" : "; the others keep serving");
      lost_core = lost_core || core;
    }
  }
  if (sup.stop_requested()) {
    std::printf("kvrelay up: signal %d, stopping\n", sup.stop_signal());
    std::fflush(stdout);
  }
  const bool clean = stop_all();
  std::printf("kvrelay up: stopped%s\n", clean ? "" : " (not every service exited cleanly)");
  std::fflush(stdout);
  return failed || !clean ? 1 : 0;
}

}  // namespace kvrelay::cli::up
